package main

import (
	"fmt"
	"math"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// series is one named line.
type series struct {
	name string
	xy   plotter.XYs
}

type axes struct {
	title, x, y string
	logX, logY  bool
}

// savePlot draws the series as lines with points and writes a PNG.
func savePlot(dir, file string, a axes, ss []series) error {
	p := plot.New()
	p.Title.Text = a.title
	p.X.Label.Text = a.x
	p.Y.Label.Text = a.y
	if a.logX {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	if a.logY {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Add(plotter.NewGrid())
	var args []any
	for _, s := range ss {
		args = append(args, s.name, s.xy)
	}
	if err := plotutil.AddLinePoints(p, args...); err != nil {
		return fmt.Errorf("plot %s: %w", file, err)
	}
	// Headroom above the data for the legend, which sits top left.
	if a.logY {
		p.Y.Max *= 6
	} else {
		p.Y.Max += 0.45 * (p.Y.Max - p.Y.Min)
	}
	if err := p.Save(7*vg.Inch, 4.5*vg.Inch, filepath.Join(dir, file)); err != nil {
		return fmt.Errorf("plot %s: %w", file, err)
	}
	return nil
}

func plotMaxLoad(dir string, rows []maxLoadRow) error {
	var random, p2c, tr, tp plotter.XYs
	for _, r := range rows {
		x := float64(r.n)
		random = append(random, plotter.XY{X: x, Y: r.random})
		p2c = append(p2c, plotter.XY{X: x, Y: r.p2c})
		tr = append(tr, plotter.XY{X: x, Y: r.theoryRandom})
		tp = append(tp, plotter.XY{X: x, Y: r.theoryP2C})
	}
	return savePlot(dir, "max-load.png", axes{
		title: "n connections onto n backends: fullest backend",
		x:     "n", y: "max connections on one backend", logX: true,
	}, []series{
		{"random (measured)", random}, {"p2c (measured)", p2c},
		{"ln n / ln ln n", tr}, {"ln ln n / ln 2", tp},
	})
}

func plotHerd(dir string, rows []herdRow) error {
	var ss []series
	for _, v := range []viewMode{viewOwn, viewShared} {
		for _, p := range herdPolicies {
			var xy plotter.XYs
			for _, r := range rows {
				if r.view == v && r.policy == p {
					xy = append(xy, plotter.XY{X: float64(r.k), Y: r.res.p99})
				}
			}
			ss = append(ss, series{fmt.Sprintf("%s, %s view", p, v), xy})
		}
	}
	return savePlot(dir, "herd-p99.png", axes{
		title: fmt.Sprintf("K independent balancers, %d backends at utilisation %.1f", herdN, herdUtil),
		x:     "balancers K", y: "p99 response time (ms)", logX: true, logY: true,
	}, ss)
}

func plotSlowdown(dir string, rows []slowRow) error {
	for _, k := range slowKs {
		var ss []series
		for _, r := range rows {
			if r.k != k {
				continue
			}
			var xy plotter.XYs
			// 25 ms buckets from 300 ms before to 700 ms after the slowdown, for legibility.
			const per = 5
			for b := int((slowAt - 300) / slowBin); b+per <= int((slowAt+700)/slowBin); b += per {
				var s float64
				for i := b; i < b+per; i++ {
					s += r.share[i]
				}
				xy = append(xy, plotter.XY{X: float64(b)*slowBin - slowAt, Y: 100 * s / per})
			}
			ss = append(ss, series{r.policy, xy})
		}
		if err := savePlot(dir, fmt.Sprintf("slowdown-share-k%d.png", k), axes{
			title: fmt.Sprintf("backend 0 becomes %.0f× slower at t = 0 (%d backends, ρ %.1f, K = %d)", slowFactor, slowN, slowUtil, k),
			x:     "ms since the slowdown", y: "backend 0's share of new requests (%)",
		}, ss); err != nil {
			return err
		}
	}
	return nil
}

func plotUtil(dir string, rows []utilRow) error {
	for _, sc := range scenarios() {
		var ss []series
		for _, p := range utilPolicies {
			var xy plotter.XYs
			for _, r := range rows {
				if r.scenario == sc.name && r.policy == p {
					// Cap for the log axis: an unstable run's p99 only says "unbounded".
					xy = append(xy, plotter.XY{X: r.util, Y: math.Min(r.res.p99, 1e4)})
				}
			}
			ss = append(ss, series{p, xy})
		}
		if err := savePlot(dir, "util-p99-"+sc.name+".png", axes{
			title: "p99 by utilisation: " + sc.desc,
			x:     "utilisation", y: "p99 response time (ms)", logY: true,
		}, ss); err != nil {
			return err
		}
	}
	return nil
}
