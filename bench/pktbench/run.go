package pktbench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/weir-lb/weir/bench/pktgen"
)

// Options of a benchmark run. Zero values take the defaults.
type Options struct {
	Runs     int           // rounds; each runs every case once, in order; default 3
	Duration time.Duration // measured window per case and round; default 1s
	Warmup   time.Duration // sending before the window opens; default 300ms
	// CPU pins the generator's thread; the balancer's and sinks' softirq
	// work runs on the same CPU (veth schedules its NAPI on the sending
	// CPU). Default: the last CPU. -1 leaves it unpinned.
	CPU int
	Log io.Writer // progress lines; nil prints nothing
}

func (o *Options) defaults(ncpu int) {
	if o.Runs == 0 {
		o.Runs = 3
	}
	if o.Duration == 0 {
		o.Duration = time.Second
	}
	if o.Warmup == 0 {
		o.Warmup = 300 * time.Millisecond
	}
	if o.CPU == 0 {
		o.CPU = ncpu - 1
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
}

// Sample is one case in one round.
type Sample struct {
	Offered   float64 // frames/s the generator sent
	Forwarded float64 // frames/s the case's sink counted
	// Softirq is the softirq time of the generator's CPU (all CPUs if
	// unpinned) over the window, in CPU-seconds per second (cpu.go).
	Softirq float64
	// Probed cases: probes completed and failed in the window, and the
	// round trips' 50th and 99th percentiles in µs.
	Probes, ProbeFails int     `json:",omitempty"`
	P50us, P99us       float64 `json:",omitempty"`
	// Cases with streams (flood.go): the frames/s of the load that weir's
	// program took a verdict on (forwarded, dropped or passed), read from
	// its counters; the bytes/s the streams delivered to their server; the
	// streams that delivered nothing in the window; and those that did not
	// deliver again within streamRecover of the load's end or met an error.
	Taken         float64 `json:",omitempty"`
	StreamBps     float64 `json:",omitempty"`
	StreamsIdle   int     `json:",omitempty"`
	StreamsBroken int     `json:",omitempty"`
}

// Result is every sample of one case.
type Result struct {
	Case    Case
	Samples []Sample
}

// Offered and Forwarded are the medians over rounds; the Min/Max variants
// the spread.
func (r Result) Offered() float64 {
	return median(r.values(func(s Sample) float64 { return s.Offered }))
}
func (r Result) Forwarded() float64 { return median(r.forwarded()) }
func (r Result) MinForwarded() float64 {
	return slices.Min(r.forwarded())
}
func (r Result) MaxForwarded() float64 {
	return slices.Max(r.forwarded())
}

// LossRatio is the median over rounds of 1 - forwarded/offered.
func (r Result) LossRatio() float64 {
	return median(r.values(func(s Sample) float64 {
		if s.Offered == 0 {
			return 0
		}
		return max(0, 1-s.Forwarded/s.Offered)
	}))
}

func (r Result) forwarded() []float64 {
	return r.values(func(s Sample) float64 { return s.Forwarded })
}

func (r Result) values(f func(Sample) float64) []float64 {
	v := make([]float64, len(r.Samples))
	for i, s := range r.Samples {
		v[i] = f(s)
	}
	return v
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Run builds the line, runs every case Runs times, interleaved round by
// round so every case sees the same machine, and removes the line.
func Run(ctx context.Context, cases []Case, opts Options) (_ []Result, err error) {
	opts.defaults(numCPU())
	// Before the line is built: a case that cannot run should not end a
	// long run halfway.
	for _, c := range cases {
		if err := c.check(opts); err != nil {
			return nil, err
		}
	}
	l, err := NewLine()
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := l.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	results := make([]Result, len(cases))
	for i, c := range cases {
		results[i].Case = c
	}
	for round := range opts.Runs {
		floors := map[string]float64{} // this round's floor rates
		for i, c := range cases {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			rate := c.Rate
			if c.RateOfFloor > 0 {
				f, ok := floors[c.Floor]
				if !ok {
					return nil, fmt.Errorf("case %q: rate relative to %q, which no earlier case measured", c.Name(), c.Floor)
				}
				rate = c.RateOfFloor * f
			}
			s, err := runCase(ctx, l, c, rate, opts)
			if err != nil {
				return nil, fmt.Errorf("round %d: case %q: %w", round+1, c.Name(), err)
			}
			if c.Group == "floor" && c.Generator == "" {
				floors[c.Balancer.Name] = s.Forwarded
			}
			results[i].Samples = append(results[i].Samples, s)
			fmt.Fprintf(opts.Log, "round %d/%d  %-62s offered %6.3f Mpps  forwarded %6.3f Mpps  softirq %3.0f%%",
				round+1, opts.Runs, c.Name(), s.Offered/1e6, s.Forwarded/1e6, 100*s.Softirq)
			if c.Probe {
				fmt.Fprintf(opts.Log, "  probes %d (%d failed) p50 %.0f µs p99 %.0f µs", s.Probes, s.ProbeFails, s.P50us, s.P99us)
			}
			if c.Streams > 0 {
				fmt.Fprintf(opts.Log, "  weir took %6.3f Mpps  streams %8.1f Mbit/s (%d idle, %d broken)", s.Taken/1e6, 8*s.StreamBps/1e6, s.StreamsIdle, s.StreamsBroken)
			}
			fmt.Fprintln(opts.Log)
		}
	}
	return results, nil
}

// check says whether the case can run with opts.
func (c Case) check(opts Options) error {
	switch {
	case c.Probe && c.Streams > 0:
		return fmt.Errorf("case %q: probes and streams both need the probe service: choose one", c.Name())
	case c.SrcPorts > pktgen.MaxTemplates || (c.SrcPorts > 1 && c.Generator != ""):
		return fmt.Errorf("case %q: %d source ports: weir's generator sends at most %d, trafgen one", c.Name(), c.SrcPorts, pktgen.MaxTemplates)
	case c.SplitCPU && probeCPU(opts.CPU) < 0:
		return fmt.Errorf("case %q: split CPUs need the generator pinned (-cpu) and a second CPU", c.Name())
	}
	return nil
}

// runCase installs the case's balancer, sends for Warmup, counts what the
// generator sent and the sink received over Duration, and removes it all.
func runCase(ctx context.Context, l *Line, c Case, rate float64, opts Options) (_ Sample, err error) {
	teardown, err := c.Setup(l)
	if err != nil {
		return Sample{}, fmt.Errorf("set up %s: %w", c.Balancer.Name, err)
	}
	defer func() {
		if terr := teardown(); terr != nil && err == nil {
			err = fmt.Errorf("tear down %s: %w", c.Balancer.Name, terr)
		}
	}()
	cfg := pktgen.Config{
		SrcMAC: GenMAC, DstMAC: LBInMAC,
		Dst4: netipPort(VIP4), Dst6: netipPort(VIP6),
		Flows: c.Flows, Mix: c.mix(), Rate: rate,
	}
	// Split CPUs: l0 is polled on the other CPU, with the streams. This
	// goroutine, which reads the counters, stays on the generator's CPU:
	// l0's real-time poll can hold the other one for most of a second, and
	// a snapshot stalled between its reads would skew the rates.
	streamCPU := opts.CPU
	if c.SplitCPU {
		streamCPU = probeCPU(opts.CPU)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		unpin, err := pinThread(opts.CPU)
		if err != nil {
			return Sample{}, err
		}
		defer unpin()
		restore, err := pollOn(l.LB, LBIn, streamCPU)
		if err != nil {
			return Sample{}, err
		}
		defer func() {
			if rerr := restore(); rerr != nil && err == nil {
				err = rerr
			}
		}()
	}
	// Streams are established before the load starts, so a flood meets
	// them established, and end after the deferred stop of the load below.
	var st *streams
	if c.Streams > 0 {
		if l.weir == nil {
			return Sample{}, fmt.Errorf("streams through %s: only weir nat has the stream service", c.Balancer.Name)
		}
		st, err = startStreams(l, c.Streams, c.Interactive, streamCPU, opts.Warmup+opts.Duration+streamStart+streamRecover+30*time.Second)
		if err != nil {
			return Sample{}, err
		}
		defer st.Close()
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var cpus []int
	if opts.CPU >= 0 {
		cpus = []int{opts.CPU}
	}
	// sent reads what the load's generator has sent; runErr reports its
	// end, which before stop is an error. waitLoad stops the load and
	// returns how it ended (at once if there is none); it is idempotent.
	sent := func() (uint64, error) { return 0, nil }
	runErr := make(chan error, 1)
	loaded := false
	var (
		loadOnce sync.Once
		loadErr  error
	)
	waitLoad := func() error {
		loadOnce.Do(func() {
			stop()
			if loaded {
				loadErr = <-runErr
			}
		})
		return loadErr
	}
	defer func() {
		if rerr := waitLoad(); rerr != nil && err == nil {
			err = rerr
		}
	}()
	switch {
	case c.Idle:
	case c.Generator == Trafgen:
		t, err := startTrafgen(l, cfg, opts.CPU, rate, opts.Warmup+opts.Duration+30*time.Second)
		if err != nil {
			return Sample{}, err
		}
		sent = l.g0Sent
		loaded = true
		// Exits when trafgen does (stopped by waitLoad).
		go func() {
			<-runCtx.Done()
			runErr <- t.stop()
		}()
		// trafgen takes a moment to build its ring: wait for its first
		// frames before the warm-up starts.
		if err := waitSending(ctx, sent); err != nil {
			return Sample{}, err
		}
		if err := t.pin(opts.CPU); err != nil {
			return Sample{}, err
		}
	case c.Generator == "":
		if err := establishFlows(l, c, cfg); err != nil {
			return Sample{}, err
		}
		g, err := pktgen.New(cfg)
		if err != nil {
			return Sample{}, err
		}
		defer g.Close()
		sent = func() (uint64, error) {
			n, err := g.Sent()
			return n.Packets, err
		}
		loaded = true
		// Exits when waitLoad stops it and the generator's call is
		// interrupted. Registered after g.Close, so the deferred waitLoad
		// runs first.
		go func() { runErr <- g.Run(runCtx, l.Gen, l.GenIndex, cpus) }()
		defer waitLoad()
	default:
		return Sample{}, fmt.Errorf("unknown generator %q", c.Generator)
	}

	type probed struct {
		res probeResult
		err error
	}
	var probeDone chan probed // nil unless c.Probe; read once
	if c.Probe {
		echo, err := startEcho(l.Sink, netip.AddrPortFrom(ProbeBackend, ProbePort), probeCPU(opts.CPU))
		if err != nil {
			return Sample{}, err
		}
		defer echo.Close()
		probeDone = make(chan probed, 1)
		// Exits when stop is called.
		go func() {
			res, err := runProber(runCtx, l.Gen, netip.AddrPortFrom(VIP4, ProbePort), probeCPU(opts.CPU))
			probeDone <- probed{res, err}
		}()
		// On an early return: stop ends the prober; wait for it before
		// the echo server closes.
		defer func() {
			if probeDone != nil {
				stop()
				<-probeDone
			}
		}()
	}

	type snap struct {
		sent, got uint64
		softirq   uint64
		taken     uint64  // the load's frames weir took (stream cases)
		streamed  int64   // bytes the streams delivered
		perStream []int64 // the same per stream
		at        time.Time
	}
	snapshot := func() (s snap, err error) {
		if st != nil {
			ws, err := l.weir.Stats()
			if err != nil {
				return s, err
			}
			s.taken = floodTaken(ws, cfg.Mix[0].Dst)
			s.streamed, s.perStream = st.delivered()
		}
		if s.sent, err = sent(); err != nil {
			return
		}
		got, err := l.received(c.Path)
		if err != nil {
			return s, err
		}
		s.got = got.Packets
		if s.softirq, err = softirqTicks(opts.CPU); err != nil {
			return s, err
		}
		s.at = time.Now()
		return s, nil
	}
	if err := sleep(ctx, opts.Warmup, runErr); err != nil {
		return Sample{}, err
	}
	s0, err := snapshot()
	if err != nil {
		return Sample{}, err
	}
	if err := sleep(ctx, opts.Duration, runErr); err != nil {
		return Sample{}, err
	}
	s1, err := snapshot()
	if err != nil {
		return Sample{}, err
	}
	dt := s1.at.Sub(s0.at).Seconds()
	out := Sample{
		Offered:   float64(s1.sent-s0.sent) / dt,
		Forwarded: float64(s1.got-s0.got) / dt,
		Softirq:   float64(s1.softirq-s0.softirq) / userHZ / dt,
	}
	if st != nil {
		out.Taken = float64(s1.taken-s0.taken) / dt
		out.StreamBps = float64(s1.streamed-s0.streamed) / dt
		out.StreamsIdle = st.idle(s0.perStream, s1.perStream)
		if err := waitLoad(); err != nil {
			return Sample{}, err
		}
		// Streams a flood starved may be in retransmission back-off:
		// each has streamRecover to deliver again.
		_, after := st.delivered()
		out.StreamsBroken = st.broken(ctx, after, streamRecover)
	}
	if probeDone != nil {
		stop()
		p := <-probeDone
		probeDone = nil
		if p.err != nil {
			return Sample{}, p.err
		}
		rtts, fails := p.res.within(s0.at, s1.at)
		out.Probes, out.ProbeFails = len(rtts), fails
		out.P50us, out.P99us = percentile(rtts, 0.50), percentile(rtts, 0.99)
	}
	return out, nil
}

// sleep waits d, returning early with an error if ctx ends or the
// generator stops on its own (which is an error).
func sleep(ctx context.Context, d time.Duration, runErr chan error) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case err := <-runErr:
		runErr <- err // for the deferred wait
		return fmt.Errorf("generator stopped early: %w", err)
	}
}

// received reads the sink a path counts on.
func (l *Line) received(p Path) (pktgen.Counter, error) {
	switch p {
	case PathBack:
		return l.Back.Count()
	case PathFar:
		return l.Far.Count()
	case PathLocal:
		if l.local == nil {
			return pktgen.Counter{}, fmt.Errorf("no sink on %s: PathLocal needs a balancer that installs one", LBIn)
		}
		return l.local.Count()
	}
	return pktgen.Counter{}, fmt.Errorf("unknown path %d", p)
}

// waitSending waits up to 5 s for sent to rise: a generator outside weir
// has started.
func waitSending(ctx context.Context, sent func() (uint64, error)) error {
	first, err := sent()
	if err != nil {
		return err
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, err := sent()
		if err != nil {
			return err
		}
		if n > first {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return errors.New("generator sent nothing within 5 s")
}

// probeCPU is the CPU the prober and echo server are pinned to: the next
// one after the generator's, so they do not wait for the generator's thread
// to be scheduled out; their frames still queue in l0's one receive ring
// behind the load, which the generator's CPU polls. -1 (unpinned) if the
// generator is unpinned or there is one CPU.
func probeCPU(genCPU int) int {
	n := numCPU()
	if genCPU < 0 || n < 2 {
		return -1
	}
	return (genCPU + 1) % n
}

// establishFlows sends every flow of a weir case whose frames are not SYNs twice
// in a row, so the program holds each one as established before the window
// opens, as it would after the flow's handshake. Without it each flow's second
// frame comes a whole cycle of flows later, and with more flows than the half-open
// table holds (100,000 against 32,768 on one CPU) it would find its half-open entry
// gone, so no flow would ever be established and every frame would be measured as a
// new flow. Two kinds of the same frame alternate in the generator's schedule,
// each cycling the flows from the same start: flow 0, flow 0, flow 1, flow 1, ...
func establishFlows(l *Line, c Case, cfg pktgen.Config) error {
	if c.Group != "weir" || c.Packet.SYN || c.flows() <= 1 {
		return nil
	}
	prime := cfg
	prime.Rate = 0
	prime.Mix = nil
	for _, p := range c.mix() {
		prime.Mix = append(prime.Mix, p, p)
	}
	g, err := pktgen.New(prime)
	if err != nil {
		return fmt.Errorf("establish flows: %w", err)
	}
	defer g.Close()
	if err := g.Send(l.Gen, l.GenIndex, uint32(2*c.flows())); err != nil {
		return fmt.Errorf("establish flows: %w", err)
	}
	return nil
}
