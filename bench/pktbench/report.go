package pktbench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// Report is a run's results with what is needed to read them.
type Report struct {
	Results []Result
	Opts    Options
	Elapsed time.Duration
	Kernel  string
	CPUs    int
	Date    time.Time
}

// NewReport describes results measured with opts on this machine.
func NewReport(res []Result, opts Options, elapsed time.Duration) Report {
	opts.defaults(numCPU())
	var u unix.Utsname
	unix.Uname(&u)
	return Report{
		Results: res, Opts: opts, Elapsed: elapsed,
		Kernel: unix.ByteSliceToString(u.Release[:]), CPUs: numCPU(), Date: time.Now().UTC(),
	}
}

// find returns the result of the first case of the named balancer.
func (r Report) find(balancer string) (Result, bool) {
	for _, x := range r.Results {
		if x.Case.Balancer.Name == balancer {
			return x, true
		}
	}
	return Result{}, false
}

func (r Report) null() (Result, bool) {
	for _, x := range r.Results {
		if x.Case.Group == "null" {
			return x, true
		}
	}
	return Result{}, false
}

// FloorRatio is a result's median forwarding rate over its floor's, or NaN.
func (r Report) FloorRatio(x Result) float64 {
	f, ok := r.find(x.Case.Floor)
	if !ok || f.Forwarded() == 0 || x.Case.RateOfFloor > 0 {
		return math.NaN()
	}
	return x.Forwarded() / f.Forwarded()
}

// StepNs is the per-frame cost of the balancer step: 1/rate - 1/rate of the
// null case, in ns (generator, balancer and sinks share one CPU, so time per
// frame adds up).
func (r Report) StepNs(x Result) float64 {
	n, ok := r.null()
	if !ok || x.Forwarded() == 0 || n.Forwarded() == 0 || x.Case.Group == "null" || x.Case.RateOfFloor > 0 {
		return math.NaN()
	}
	return 1e9/x.Forwarded() - 1e9/n.Forwarded()
}

func mpps(v float64) string { return fmt.Sprintf("%.3f", v/1e6) }

func orDash(v float64, format string) string {
	if math.IsNaN(v) {
		return "—"
	}
	return fmt.Sprintf(format, v)
}

// WriteMarkdown writes the table with a header saying how it was measured.
func (r Report) WriteMarkdown(w io.Writer) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "Measured %s on Linux %s, %d CPUs shared with other work; %d rounds × %v per case (after %v warm-up), cases interleaved round by round; generator pinned to CPU %d, so generator, balancer and sinks all run on that one CPU. Mpps: median (min–max) over rounds. Run took %v.\n\n",
		r.Date.Format("2006-01-02"), r.Kernel, r.CPUs, r.Opts.Runs, r.Opts.Duration, r.Opts.Warmup, r.Opts.CPU, r.Elapsed.Round(time.Second))
	b.WriteString("| balancer | traffic | flows | offered Mpps | forwarded Mpps | lost | × floor | ns/frame over null |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|\n")
	for _, x := range r.Results {
		c := x.Case
		traffic := c.Packet.String()
		if c.RateOfFloor > 0 {
			traffic += fmt.Sprintf(", paced at %.0f%% of %s", 100*c.RateOfFloor, c.Floor)
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %s | %s (%s–%s) | %.1f%% | %s | %s |\n",
			c.Balancer.Name, traffic, c.Flows, mpps(x.Offered()), mpps(x.Forwarded()), mpps(x.MinForwarded()), mpps(x.MaxForwarded()),
			100*x.LossRatio(), orDash(r.FloorRatio(x), "%.2f"), orDash(r.StepNs(x), "%.0f"))
	}
	_, err := w.Write(b.Bytes())
	return err
}

// Save writes results.md, results.json (every sample), mpps.png and
// floor-ratio.png into dir.
func (r Report) Save(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var md bytes.Buffer
	md.WriteString("# Packets per second through the balancer namespace\n\n")
	md.WriteString("`make bench-pkt` (`go run ./bench/cmd/pktbench -out bench/results/pkt`). How to read it: README.md, section \"Packets per second through a balancer namespace\".\n\n")
	if err := r.WriteMarkdown(&md); err != nil {
		return err
	}
	md.WriteString("\n![forwarded Mpps](mpps.png)\n\n![ratio to the floor](floor-ratio.png)\n")
	if err := os.WriteFile(filepath.Join(dir, "results.md"), md.Bytes(), 0o644); err != nil {
		return err
	}

	type jsonCase struct {
		Name, Balancer, Group, Traffic string
		FrameBytes, Flows              int
		RateOfFloor                    float64
		Samples                        []Sample
	}
	var js struct {
		Date                         time.Time
		Kernel                       string
		CPUs, Runs, CPU              int
		DurationSeconds, WarmupSecds float64
		Cases                        []jsonCase
	}
	js.Date, js.Kernel, js.CPUs, js.Runs, js.CPU = r.Date, r.Kernel, r.CPUs, r.Opts.Runs, r.Opts.CPU
	js.DurationSeconds, js.WarmupSecds = r.Opts.Duration.Seconds(), r.Opts.Warmup.Seconds()
	for _, x := range r.Results {
		c := x.Case
		js.Cases = append(js.Cases, jsonCase{c.Name(), c.Balancer.Name, c.Group, c.Packet.Traffic(), c.Packet.FrameSize(), c.Flows, c.RateOfFloor, x.Samples})
	}
	data, err := json.MarshalIndent(js, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(data, '\n'), 0o644); err != nil {
		return err
	}

	if err := r.plot(filepath.Join(dir, "mpps.png"), "Frames forwarded (Mpps, median; bars: min–max)", func(x Result) (v, lo, hi float64) {
		return x.Forwarded() / 1e6, x.MinForwarded() / 1e6, x.MaxForwarded() / 1e6
	}); err != nil {
		return err
	}
	return r.plot(filepath.Join(dir, "floor-ratio.png"), "Forwarded rate ÷ its floor's (median)", func(x Result) (v, lo, hi float64) {
		v = r.FloorRatio(x)
		return v, v, v
	})
}

var groupColors = map[string]color.Color{
	"null":   color.RGBA{150, 150, 150, 255},
	"floor":  color.RGBA{90, 120, 200, 255},
	"weir":   color.RGBA{220, 120, 40, 255},
	"kernel": color.RGBA{80, 160, 90, 255},
}

// plot draws one horizontal bar per case (NaN values are left out), coloured
// by group, with min–max whiskers where lo < hi.
func (r Report) plot(path, title string, value func(Result) (v, lo, hi float64)) error {
	p := plot.New()
	p.Title.Text = title
	var labels []string
	var errs plotter.XErrors
	var pts plotter.XYs
	i := 0
	for _, x := range r.Results {
		v, lo, hi := value(x)
		if math.IsNaN(v) {
			continue
		}
		// Top to bottom in the table's order.
		y := float64(-i)
		bar, err := plotter.NewBarChart(plotter.Values{v}, vg.Points(9))
		if err != nil {
			return err
		}
		bar.Horizontal = true
		bar.XMin = y
		bar.LineStyle.Width = 0
		bar.Color = groupColors[x.Case.Group]
		p.Add(bar)
		if hi > lo {
			pts = append(pts, plotter.XY{X: v, Y: y})
			errs = append(errs, struct{ Low, High float64 }{v - lo, hi - v})
		}
		labels = append([]string{x.Case.Name()}, labels...)
		i++
	}
	if len(pts) > 0 {
		eb, err := plotter.NewXErrorBars(struct {
			plotter.XYer
			plotter.XErrorer
		}{pts, errs})
		if err != nil {
			return err
		}
		p.Add(eb)
	}
	p.Y.Min, p.Y.Max = float64(-i)+0.5, 0.5
	p.Y.Tick.Width = 0
	p.Y.Tick.Length = 0
	p.Y.Tick.Marker = shiftedTicks{labels: labels}
	p.X.Min = 0
	p.X.Label.Text = strings.TrimSpace(strings.Split(title, "(")[0])
	return p.Save(10*vg.Inch, vg.Length(1.2+0.22*float64(i))*vg.Inch, path)
}

// shiftedTicks puts labels[k] at y = k - (n-1), matching the bars drawn at
// 0, -1, ... from the top.
type shiftedTicks struct{ labels []string }

func (t shiftedTicks) Ticks(min, max float64) []plot.Tick {
	n := len(t.labels)
	ticks := make([]plot.Tick, n)
	for k, l := range t.labels {
		ticks[k] = plot.Tick{Value: float64(k - (n - 1)), Label: l}
	}
	return ticks
}
