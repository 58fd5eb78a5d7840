package pktbench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"image/color"
	"io"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
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

// find returns the result of the first flat-out case of the named balancer
// sent by the named generator.
func (r Report) find(balancer, generator string) (Result, bool) {
	for _, x := range r.Results {
		if x.Case.Balancer.Name == balancer && x.Case.Generator == generator && !x.Case.paced() {
			return x, true
		}
	}
	return Result{}, false
}

// null returns the null case sent by the named generator.
func (r Report) null(generator string) (Result, bool) {
	for _, x := range r.Results {
		if x.Case.Group == "null" && x.Case.Generator == generator {
			return x, true
		}
	}
	return Result{}, false
}

// FloorRatio is a result's median forwarding rate over its floor's (sent by
// the same generator), or NaN.
func (r Report) FloorRatio(x Result) float64 {
	f, ok := r.find(x.Case.Floor, x.Case.Generator)
	if !ok || f.Forwarded() == 0 || x.Case.paced() {
		return math.NaN()
	}
	return x.Forwarded() / f.Forwarded()
}

// StepNs is the per-frame cost of the balancer step: 1/rate - 1/rate of the
// null case, in ns (generator, balancer and sinks share one CPU, so time per
// frame adds up).
func (r Report) StepNs(x Result) float64 {
	n, ok := r.null(x.Case.Generator)
	if !ok || x.Forwarded() == 0 || n.Forwarded() == 0 || x.Case.Group == "null" || x.Case.paced() {
		return math.NaN()
	}
	return 1e9/x.Forwarded() - 1e9/n.Forwarded()
}

// SoftirqNs is the median over rounds of the softirq time per forwarded
// frame in ns (numerically, ms per million frames), or NaN.
func (r Report) SoftirqNs(x Result) float64 {
	var v []float64
	for _, s := range x.Samples {
		if s.Forwarded > 0 {
			v = append(v, 1e9*s.Softirq/s.Forwarded)
		}
	}
	if len(v) == 0 || x.Case.Idle {
		return math.NaN()
	}
	return median(v)
}

// SoftirqStepNs is SoftirqNs over the null case's (same generator): the
// softirq time the balancer step and the frame's onward delivery add.
func (r Report) SoftirqStepNs(x Result) float64 {
	n, ok := r.null(x.Case.Generator)
	if !ok || x.Case.Group == "null" {
		return math.NaN()
	}
	return r.SoftirqNs(x) - r.SoftirqNs(n)
}

// latency returns the median and min-max over rounds of a probed case's
// per-round percentile.
func latency(x Result, p func(Sample) float64) (med, lo, hi float64) {
	v := x.values(p)
	return median(v), slices.Min(v), slices.Max(v)
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
	b.WriteString("| balancer | traffic | flows | offered Mpps | forwarded Mpps | lost | × floor | ns/frame over null | softirq ns/frame | softirq over null |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, x := range r.Results {
		c := x.Case
		if c.Idle || c.Streams > 0 {
			continue
		}
		name := c.Balancer.Name
		if c.Generator != "" {
			name += " (by " + c.Generator + ")"
		}
		traffic := c.Packet.String()
		switch {
		case c.RateOfFloor > 0:
			traffic += fmt.Sprintf(", paced at %.0f%% of %s", 100*c.RateOfFloor, c.Floor)
		case c.Rate > 0:
			traffic += fmt.Sprintf(", paced at %.2f Mpps", c.Rate/1e6)
		}
		if c.Probe {
			traffic += ", probed"
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %s | %s (%s–%s) | %.1f%% | %s | %s | %s | %s |\n",
			name, traffic, c.Flows, mpps(x.Offered()), mpps(x.Forwarded()), mpps(x.MinForwarded()), mpps(x.MaxForwarded()),
			100*x.LossRatio(), orDash(r.FloorRatio(x), "%.2f"), orDash(r.StepNs(x), "%.0f"),
			orDash(r.SoftirqNs(x), "%.0f"), orDash(r.SoftirqStepNs(x), "%.0f"))
	}
	r.writeGenerators(&b)
	r.writeLatency(&b)
	r.writeFloods(&b)
	_, err := w.Write(b.Bytes())
	return err
}

// writeGenerators writes the cases trafgen sent beside the same cases sent
// by weir's generator, if any.
func (r Report) writeGenerators(b *bytes.Buffer) {
	var rows []string
	for _, t := range r.Results {
		c := t.Case
		if c.Generator == "" {
			continue
		}
		var w Result
		for _, x := range r.Results {
			if x.Case.Balancer.Name == c.Balancer.Name && x.Case.Generator == "" && x.Case.Flows == c.Flows && x.Case.Packet == c.Packet && !x.Case.paced() {
				w = x
				break
			}
		}
		none := w.Samples == nil
		rows = append(rows, fmt.Sprintf("| %s | %s | %d | %s | %s | %s | %s | %s | %s |",
			c.Balancer.Name, c.Packet, c.Flows,
			orDash(nan(none, w.Forwarded()/1e6), "%.3f"), orDash(nan(none, r.FloorRatio(w)), "%.2f"), orDash(nan(none, r.StepNs(w)), "%.0f"),
			mpps(t.Forwarded()), orDash(r.FloorRatio(t), "%.2f"), orDash(r.StepNs(t), "%.0f")))
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(b, "\nThe same cases from a second, independent generator (%s: one process, packet socket TX ring, same frames, pinned to the same CPU). It sends far fewer frames/s and each of its frames costs more to deliver (an skb, not an XDP frame), so compare what the balancer step adds over the null case and over the floor, not the rates:\n\n", Trafgen)
	b.WriteString("| balancer | traffic | flows | weir's generator: Mpps | × floor | ns/frame over null | trafgen: Mpps | × floor | ns/frame over null |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
	b.WriteString(strings.Join(rows, "\n") + "\n")
}

// writeLatency writes the probed cases' round trips, if any.
func (r Report) writeLatency(b *bytes.Buffer) {
	var rows []string
	for _, x := range r.Results {
		c := x.Case
		if !c.Probe {
			continue
		}
		load := "none"
		if !c.Idle {
			load = fmt.Sprintf("%s Mpps, %d flows", mpps(c.Rate), c.Flows)
		}
		probes, fails := 0, 0
		for _, s := range x.Samples {
			probes += s.Probes
			fails += s.ProbeFails
		}
		p50, p50lo, p50hi := latency(x, func(s Sample) float64 { return s.P50us })
		p99, p99lo, p99hi := latency(x, func(s Sample) float64 { return s.P99us })
		fwd := "—"
		if !c.Idle {
			fwd = fmt.Sprintf("%s (%.1f%% lost)", mpps(x.Forwarded()), 100*x.LossRatio())
		}
		rows = append(rows, fmt.Sprintf("| %s | %s | %s | %d | %d | %.0f (%.0f–%.0f) | %.0f (%.0f–%.0f) |",
			c.Balancer.Name, load, fwd, probes, fails, p50, p50lo, p50hi, p99, p99lo, p99hi))
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(b, "\nLatency under load: TCP request/response probes (%d-byte request and echo over one established connection, one every %v; prober in the generator namespace, echo server behind the VIP's probe service in the sink namespace, both pinned to the CPU next to the generator's, their frames queued in l0's receive ring with the load) while the generator sends the load at a fixed rate. Round trip in µs: median (min–max) over rounds of each round's percentile; failed: no echo within %v.\n\n", ProbeSize, ProbeInterval, probeTimeout)
	b.WriteString("| balancer | load offered | load forwarded Mpps | probes | failed | p50 µs | p99 µs |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|\n")
	b.WriteString(strings.Join(rows, "\n") + "\n")
}

// nan is NaN if cond, else v.
func nan(cond bool, v float64) float64 {
	if cond {
		return math.NaN()
	}
	return v
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
	md.WriteString("\n![forwarded Mpps](mpps.png)\n\n![ratio to the floor](floor-ratio.png)\n\n![softirq time per frame](softirq.png)\n\n![probe round trip p99](latency.png)\n\n![stream throughput under SYN floods](floods.png)\n")
	if err := os.WriteFile(filepath.Join(dir, "results.md"), md.Bytes(), 0o644); err != nil {
		return err
	}

	type jsonCase struct {
		Name, Balancer, Group, Traffic string
		Generator                      string `json:",omitempty"`
		FrameBytes, Flows              int
		RateOfFloor                    float64
		Rate                           float64 `json:",omitempty"`
		Idle, Probe                    bool    `json:",omitempty"`
		// Flood cases (flood.go): where the load went, its source ports
		// (Flows counts every port's), the streams.
		Dst                   string `json:",omitempty"`
		SrcPorts, Streams     int    `json:",omitempty"`
		Interactive, SplitCPU bool   `json:",omitempty"`
		Samples               []Sample
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
		jc := jsonCase{
			Name: c.Name(), Balancer: c.Balancer.Name, Group: c.Group, Traffic: c.Packet.Traffic(), Generator: c.Generator,
			FrameBytes: c.Packet.FrameSize(), Flows: c.flows(), RateOfFloor: c.RateOfFloor, Rate: c.Rate, Idle: c.Idle, Probe: c.Probe,
			SrcPorts: c.SrcPorts, Streams: c.Streams, Interactive: c.Interactive, SplitCPU: c.SplitCPU, Samples: x.Samples,
		}
		if c.Packet.Dst.IsValid() {
			jc.Dst = c.Packet.Dst.String()
		}
		js.Cases = append(js.Cases, jc)
	}
	data, err := json.MarshalIndent(js, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(data, '\n'), 0o644); err != nil {
		return err
	}

	if err := r.plot(filepath.Join(dir, "mpps.png"), "Frames forwarded (Mpps, median; bars: min–max)", noStreams(func(x Result) (v, lo, hi float64) {
		return x.Forwarded() / 1e6, x.MinForwarded() / 1e6, x.MaxForwarded() / 1e6
	})); err != nil {
		return err
	}
	if err := r.plot(filepath.Join(dir, "floor-ratio.png"), "Forwarded rate ÷ its floor's (median)", noStreams(func(x Result) (v, lo, hi float64) {
		v = r.FloorRatio(x)
		return v, v, v
	})); err != nil {
		return err
	}
	if err := r.plot(filepath.Join(dir, "softirq.png"), "Softirq time per forwarded frame (ns = ms per million frames, median)", noStreams(func(x Result) (v, lo, hi float64) {
		v = r.SoftirqNs(x)
		return v, v, v
	})); err != nil {
		return err
	}
	if err := r.plotLatency(filepath.Join(dir, "latency.png")); err != nil {
		return err
	}
	return r.plotFloods(filepath.Join(dir, "floods.png"))
}

// plotLatency draws each probed case's p50 (circle) and p99 (triangle) round
// trip, medians over rounds with min–max whiskers, on a log scale: an
// overloaded balancer's p99 is a retransmission timeout, 1,000× the rest.
func (r Report) plotLatency(path string) error {
	p := plot.New()
	p.Title.Text = "Probe round trip (µs, log scale; circle p50, triangle p99: median over rounds, bars min–max)"
	var labels []string
	i := 0
	for _, x := range r.Results {
		if !x.Case.Probe {
			continue
		}
		y := float64(-i)
		for k, pc := range []func(Sample) float64{
			func(s Sample) float64 { return s.P50us },
			func(s Sample) float64 { return s.P99us },
		} {
			v, lo, hi := latency(x, pc)
			if v <= 0 || lo <= 0 {
				continue
			}
			pts := plotter.XYs{{X: v, Y: y}}
			sc, err := plotter.NewScatter(pts)
			if err != nil {
				return err
			}
			sc.GlyphStyle.Color = groupColors[x.Case.Group]
			sc.GlyphStyle.Radius = vg.Points(4)
			sc.GlyphStyle.Shape = []draw.GlyphDrawer{draw.CircleGlyph{}, draw.TriangleGlyph{}}[k]
			eb, err := plotter.NewXErrorBars(struct {
				plotter.XYer
				plotter.XErrorer
			}{pts, plotter.XErrors{{Low: v - lo, High: hi - v}}})
			if err != nil {
				return err
			}
			p.Add(sc, eb)
		}
		labels = append([]string{x.Case.Name()}, labels...)
		i++
	}
	if i == 0 {
		return nil
	}
	p.Y.Min, p.Y.Max = float64(-i)+0.5, 0.5
	p.Y.Tick.Width = 0
	p.Y.Tick.Length = 0
	p.Y.Tick.Marker = shiftedTicks{labels: labels}
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.X.Label.Text = "round trip, µs"
	return p.Save(10*vg.Inch, vg.Length(1.2+0.3*float64(i))*vg.Inch, path)
}

var groupColors = map[string]color.Color{
	"null":   color.RGBA{150, 150, 150, 255},
	"floor":  color.RGBA{90, 120, 200, 255},
	"weir":   color.RGBA{220, 120, 40, 255},
	"kernel": color.RGBA{80, 160, 90, 255},
}

// noStreams leaves the stream cases (flood.go) out of a plot of value: their
// forwarded frames are a flood's, which plotFloods shows otherwise.
func noStreams(value func(Result) (v, lo, hi float64)) func(Result) (v, lo, hi float64) {
	return func(x Result) (v, lo, hi float64) {
		if x.Case.Streams > 0 {
			return math.NaN(), 0, 0
		}
		return value(x)
	}
}

// plot draws one horizontal bar per case (NaN values are left out), coloured
// by group, with min–max whiskers where lo < hi.
func (r Report) plot(path, title string, value func(Result) (v, lo, hi float64)) error {
	return r.plotWith(path, title, value, func(x Result) color.Color { return groupColors[x.Case.Group] }, Case.Name)
}

// plotWith is plot with each bar's colour and label chosen by colorOf and
// label.
func (r Report) plotWith(path, title string, value func(Result) (v, lo, hi float64), colorOf func(Result) color.Color, label func(Case) string) error {
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
		bar.Color = colorOf(x)
		p.Add(bar)
		if hi > lo {
			pts = append(pts, plotter.XY{X: v, Y: y})
			errs = append(errs, struct{ Low, High float64 }{v - lo, hi - v})
		}
		labels = append([]string{label(x.Case)}, labels...)
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

// streamBaseline returns the no-load case a stream case is read against:
// the same balancer, streams and arrangement of CPUs.
func (r Report) streamBaseline(x Result) (Result, bool) {
	c := x.Case
	for _, b := range r.Results {
		bc := b.Case
		if bc.Idle && bc.Balancer.Name == c.Balancer.Name && bc.Streams == c.Streams &&
			bc.Interactive == c.Interactive && bc.SplitCPU == c.SplitCPU && len(b.Samples) > 0 {
			return b, true
		}
	}
	return Result{}, false
}

// StreamShare is a stream case's stream throughput over its baseline's in
// the same round: median, min and max over rounds; NaN without a baseline.
func (r Report) StreamShare(x Result) (med, lo, hi float64) {
	b, ok := r.streamBaseline(x)
	if !ok || x.Case.Streams == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	var v []float64
	for i, s := range x.Samples {
		if i < len(b.Samples) && b.Samples[i].StreamBps > 0 {
			v = append(v, s.StreamBps/b.Samples[i].StreamBps)
		}
	}
	if len(v) == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	return median(v), slices.Min(v), slices.Max(v)
}

// FloodRatio is a flat-out flood's median rate taken by weir over its
// floor's median forwarding rate (the floor measured the usual way, so
// only flood cases measured that way, not split, have one), or NaN.
func (r Report) FloodRatio(x Result) float64 {
	c := x.Case
	f, ok := r.find(c.Floor, c.Generator)
	if !ok || f.Forwarded() == 0 || c.paced() || c.SplitCPU || c.Streams == 0 {
		return math.NaN()
	}
	return median(x.values(func(s Sample) float64 { return s.Taken })) / f.Forwarded()
}

// writeFloods writes the stream cases, if any: flat-out floods and floods
// at fixed rates on split CPUs, each in a table of its own.
func (r Report) writeFloods(b *bytes.Buffer) {
	var flat, split []string
	for _, x := range r.Results {
		c := x.Case
		if c.Streams == 0 {
			continue
		}
		flood, offered, taken, fwd, ratio := "none", "—", "—", "—", "—"
		if !c.Idle {
			flood = floodTarget(c.Packet.Dst)
			if c.Rate > 0 {
				flood += fmt.Sprintf(", %.2f Mpps", c.Rate/1e6)
			}
			offered = mpps(x.Offered())
			taken = mpps(median(x.values(func(s Sample) float64 { return s.Taken })))
			fwd = mpps(x.Forwarded())
			ratio = orDash(r.FloodRatio(x), "%.2f")
		}
		idle, broken := 0, 0
		for _, s := range x.Samples {
			idle += s.StreamsIdle
			broken += s.StreamsBroken
		}
		bps := x.values(func(s Sample) float64 { return 8 * s.StreamBps / 1e6 })
		share, lo, hi := r.StreamShare(x)
		shareText := "—"
		if !math.IsNaN(share) {
			shareText = fmt.Sprintf("%.2f (%.2f–%.2f)", share, lo, hi)
		}
		row := fmt.Sprintf("| %s | %s | %s | %s | %s | %s | %.1f (%.1f–%.1f) | %s | %d | %d |",
			c.Balancer.Name, flood, offered, taken, ratio, fwd,
			median(bps), slices.Min(bps), slices.Max(bps), shareText, idle, broken)
		if c.SplitCPU {
			split = append(split, row)
		} else {
			flat = append(flat, row)
		}
	}
	if len(flat)+len(split) == 0 {
		return
	}
	rounds := r.Opts.Runs
	fmt.Fprintf(b, "\nSYN floods against established TCP streams through weir nat. The generator sends SYNs from %d sources × %d source ports (%d flows; none comes round again while the half-open table remembers it, so each is a new flow, as from random sources) to the nat service %s, whose backends are the far sink, or to %s, a port of the same address that no service has (weir passes it to the balancer namespace's stack, which has no route to the VIP: a route lookup, a rate-limited ICMP unreachable, a drop). The streams go through another nat service of that VIP (%s, one backend in the sink namespace that reads and discards) and are established before the flood starts. *offered*: frames/s the generator sent; *weir took*: flood frames its program took a verdict on (forwarded, dropped over the new-flow limit, passed), from its counters; *× floor*: weir took over %s's forwarded rate; *forwarded*: flood SYNs that reached the backends' sink. *Mbit/s*: what the streams delivered to their server, median (min–max) over rounds; *× no flood*: that over the same streams' with no load in the same round, median (min–max) over rounds; *idle*: streams that delivered nothing in a window, *broken*: streams that did not deliver again within %v of the flood's end or met an error, summed over %d rounds.\n\n",
		FloodFlows, FloodPorts, FloodFlows*FloodPorts, FloodService, FloodNoService, netip.AddrPortFrom(VIP4, ProbePort), FloorRedirectNative.Name, streamRecover, rounds)
	header := "| balancer | flood aimed at | offered Mpps | weir took Mpps | × floor | forwarded Mpps | streams Mbit/s | × no flood | idle | broken |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
	if len(flat) > 0 {
		fmt.Fprintf(b, "Flat out, everything on the generator's CPU as in the cases above, with %d interactive streams (%d KiB every %v each) on that CPU too:\n\n", ManyStreams, streamBurst>>10, streamEvery)
		b.WriteString(header + strings.Join(flat, "\n") + "\n")
	}
	if len(split) > 0 {
		if len(flat) > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(b, "At fixed rates, split CPUs: the generator alone on CPU %d sends at its rate whatever the balancer costs; l0 is polled by a SCHED_FIFO kernel thread on CPU %d, where %d bulk streams and the rest of the line run, so a flood's frames share l0's ring and poll with the streams' and its cost comes out of their CPU:\n\n", r.Opts.CPU, probeCPU(r.Opts.CPU), FloodStreams)
		b.WriteString(header + strings.Join(split, "\n") + "\n")
	}
}

// floodColors tell the flood plot's bars apart: aimed at the service with
// the new-flow limit on or off, and at no service.
var floodColors = map[string]color.Color{
	"limit":      color.RGBA{220, 120, 40, 255},
	"no limit":   color.RGBA{190, 60, 60, 255},
	"no service": color.RGBA{80, 160, 90, 255},
}

// plotFloods draws the flood cases' stream throughput over their no-flood
// baseline's (median, min–max whiskers), if there are any.
func (r Report) plotFloods(path string) error {
	found := false
	for _, x := range r.Results {
		found = found || (x.Case.Streams > 0 && !x.Case.Idle)
	}
	if !found {
		return nil
	}
	return r.plotWith(path, "Streams' throughput under a SYN flood ÷ with none (median; bars: min–max)", func(x Result) (v, lo, hi float64) {
		if x.Case.Streams == 0 || x.Case.Idle {
			return math.NaN(), 0, 0
		}
		return r.StreamShare(x)
	}, func(x Result) color.Color {
		switch {
		case x.Case.Packet.Dst != FloodService:
			return floodColors["no service"]
		case x.Case.Balancer.Name == WeirNATNoLimit.Name:
			return floodColors["no limit"]
		}
		return floodColors["limit"]
	}, floodLabel)
}

// floodLabel is a flood case's short name: "limit 125000/s, to service, 0.25
// Mpps, 4 bulk streams, split CPUs".
func floodLabel(c Case) string {
	limit := strings.TrimPrefix(c.Balancer.Name, "weir nat native, new-flow ")
	to := "to service"
	if c.Packet.Dst != FloodService {
		to = "to no service"
	}
	rate := "flat out"
	if c.Rate > 0 {
		rate = fmt.Sprintf("%.2f Mpps", c.Rate/1e6)
	}
	kind := "bulk"
	if c.Interactive {
		kind = "interactive"
	}
	s := fmt.Sprintf("%s, %s, %s, %d %s streams", limit, to, rate, c.Streams, kind)
	if c.SplitCPU {
		s += ", split CPUs"
	}
	return s
}
