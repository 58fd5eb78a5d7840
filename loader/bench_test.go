package loader

import (
	"bytes"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/bench/rerun"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/xdptest"
)

// The ns/packet benchmarks run every path in BPF_PROG_TEST_RUN's repeat mode through
// bench/rerun's wrapper, which puts the frame back as it was given before each
// iteration and then tail-calls the program: weir's, or the floor (swap the MACs,
// XDP_TX). Both pay the same wrapper on the same frame, so
//
//	x-floor = weir through the wrapper / floor through the wrapper
//
// is the same ratio for every mode, whether the program rewrites or encapsulates its
// frame or not. Each case also measures the floor without the wrapper; the
// difference is the wrapper's cost on that frame (wrapper-ns), and
//
//	net-ns/pkt = ns/pkt - wrapper-ns
//
// estimates weir alone, x-plain-floor = net-ns/pkt / plain floor. Runs of weir, the
// wrapped floor and the plain floor are interleaved so all see the same machine;
// each metric is the median over runs.
//
// The per-call benchmarks (BenchmarkNATPerCall, BenchmarkTunnelPerCall) keep the
// older method, one run per fresh frame, for comparison.
const (
	benchRepeat = 1_000_000
	benchRuns   = 5
	// fixedSport is the source port of every benchmark flow that stays the same:
	// above the ports new flows get (rerun's 1024..33791, the per-call
	// benchmarks' 1024..21023), so no new flow is ever one of them.
	fixedSport = 40000
)

// pathCase is one path through the program.
type pathCase struct {
	name     string
	frame    []byte
	newFlows bool     // every iteration a new flow (rerun varies the source port and address)
	actions  []Action // the verdicts the path ends in
	// count is the counter the path adds to once per packet: the benchmark checks that
	// every iteration took the path, not only the last.
	count Reason
	// same: the program leaves a frame it handles alike on the next run (dsr only
	// swaps MACs), so plain repeat mode is honest too and is measured beside (plain-ns/pkt).
	same bool
}

// loadRig loads bench/rerun's wrapper for a benchmark.
func loadRig(tb testing.TB) *rerun.Rig {
	tb.Helper()
	r, err := rerun.Load()
	xdptest.Check(tb, err)
	tb.Cleanup(func() { r.Close() })
	return r
}

// inNS runs fn in ns, or right here if ns is nil.
func inNS(ns *netns.NS, fn func() error) error {
	if ns == nil {
		return fn()
	}
	return ns.Do(fn)
}

// benchPaths measures each case in repeat mode (see the top of this file) inside ns
// (nil: the caller's namespace).
func benchPaths(b *testing.B, ns *netns.NS, p *Program, rig *rerun.Rig, cases []pathCase) {
	weir := p.objs.WeirXdp
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			if err := inNS(ns, func() error { return checkPath(p, rig, tc) }); err != nil {
				b.Fatal(err)
			}
			var lb, fl, plainFl, plainLB []float64
			for range b.N {
				err := inNS(ns, func() error {
					for range benchRuns {
						d, err := runPath(p, rig, weir, tc)
						if err != nil {
							return err
						}
						lb = append(lb, d)
						res, err := rig.Run(rig.Floor(), tc.frame, benchRepeat, tc.newFlows)
						if err != nil {
							return err
						}
						if Action(res.Action) != XDPTX {
							return fmt.Errorf("floor through rerun: action %s; want XDP_TX", Action(res.Action))
						}
						fl = append(fl, float64(res.PerRun.Nanoseconds()))
						_, fd, err := rig.Floor().Benchmark(tc.frame, benchRepeat, nil)
						if err != nil {
							return err
						}
						plainFl = append(plainFl, float64(fd.Nanoseconds()))
						if tc.same {
							action, d, err := p.Benchmark(tc.frame, benchRepeat)
							if err != nil {
								return err
							}
							if !slices.Contains(tc.actions, action) {
								return fmt.Errorf("plain repeat: action %s; want one of %v", action, tc.actions)
							}
							plainLB = append(plainLB, float64(d.Nanoseconds()))
						}
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
			}
			reportPath(b, lb, fl, plainFl, plainLB)
		})
	}
}

// checkPath checks, before timing, that the wrapper hands weir the frame it should:
// the third iteration's output is what one plain run makes of the frame (for the
// same flow; a new flow's output differs by design).
func checkPath(p *Program, rig *rerun.Rig, tc pathCase) error {
	action, out, err := rig.Output(p.objs.WeirXdp, tc.frame, 3, tc.newFlows)
	if err != nil {
		return err
	}
	if !slices.Contains(tc.actions, Action(action)) {
		return fmt.Errorf("through rerun: action %s; want one of %v", Action(action), tc.actions)
	}
	if tc.newFlows {
		return nil
	}
	_, want, err := p.Run(tc.frame)
	if err != nil {
		return err
	}
	if !bytes.Equal(out, want) {
		return fmt.Errorf("through rerun, third iteration: got %x; want %x (one plain run)", out, want)
	}
	return nil
}

// runPath runs weir through the wrapper once and checks that every iteration
// took the case's path: the verdict, and the counters, which must have grown by one
// per iteration.
func runPath(p *Program, rig *rerun.Rig, weir *ebpf.Program, tc pathCase) (float64, error) {
	before, err := p.Stats()
	if err != nil {
		return 0, err
	}
	res, err := rig.Run(weir, tc.frame, benchRepeat, tc.newFlows)
	if err != nil {
		return 0, err
	}
	after, err := p.Stats()
	if err != nil {
		return 0, err
	}
	if !slices.Contains(tc.actions, Action(res.Action)) {
		return 0, fmt.Errorf("action %s; want one of %v", Action(res.Action), tc.actions)
	}
	if res.TailMoves != 0 {
		return 0, fmt.Errorf("%d of %d iterations moved the frame's end: their restore costs more than the floor's", res.TailMoves, res.Repeats)
	}
	grew := func(r Reason) uint64 { return after.Reasons[r].Packets - before.Reasons[r].Packets }
	if n := grew(tc.count); n != res.Repeats {
		return 0, fmt.Errorf("counter %s +%d over %d iterations; want one per iteration (counters: %v)", tc.count, n, res.Repeats, changed(before, after))
	}
	if slices.Contains(tc.actions, XDPTX) || slices.Contains(tc.actions, XDPRedirect) {
		if n := grew(ReasonTX) + grew(ReasonRedirect); n != res.Repeats {
			return 0, fmt.Errorf("forwarded +%d over %d iterations; want every one (counters: %v)", n, res.Repeats, changed(before, after))
		}
	}
	return float64(res.PerRun.Nanoseconds()), nil
}

// changed lists the counters that grew from before to after, for error messages.
func changed(before, after Stats) map[string]uint64 {
	m := map[string]uint64{}
	for r, c := range after.Reasons {
		if n := c.Packets - before.Reasons[r].Packets; n != 0 {
			m[r.String()] = n
		}
	}
	return m
}

// reportPath reports a case's metrics (see the top of this file) from its runs: weir
// and the floor through the wrapper, the floor without it and, if measured, weir
// without it.
func reportPath(b *testing.B, lb, fl, plainFl, plainLB []float64) {
	wrapper := median(fl) - median(plainFl)
	net := median(lb) - wrapper
	b.ReportMetric(median(lb), "ns/pkt")
	b.ReportMetric(slices.Min(lb), "min-ns/pkt")
	b.ReportMetric(median(fl), "floor-ns/pkt")
	b.ReportMetric(median(lb)/median(fl), "x-floor")
	b.ReportMetric(median(plainFl), "plain-floor-ns/pkt")
	b.ReportMetric(wrapper, "wrapper-ns")
	b.ReportMetric(net, "net-ns/pkt")
	b.ReportMetric(net/median(plainFl), "x-plain-floor")
	if len(plainLB) > 0 {
		b.ReportMetric(median(plainLB), "plain-ns/pkt")
	}
	b.ReportMetric(0, "ns/op")
}

// BenchmarkPacket measures dsr and the pass path beside the floor, in repeat mode
// through the wrapper (see the top of this file). dsr only swaps MACs, so plain
// repeat mode is honest for it too, and is measured beside as a check on the
// wrapper: plain-ns/pkt should match net-ns/pkt. A SYN always takes the lookup
// table and rewrites its connection table entry (as Katran does), so syn-v4 pays
// selection and insertion on every iteration for one 5-tuple; new-flow-v4 is a new
// 5-tuple every iteration (an LRU insert, evicting once the table is full);
// new-flow-v4-p2c the same to a maglev_p2c service (both tables and both loads read;
// every load 0, so the first candidate wins: the comparison is paid in full).
//
//	go test -run '^$' -bench 'Packet$' -benchtime 1x -count 3 ./loader/
func BenchmarkPacket(b *testing.B) {
	p := loadT(b)
	rig := loadRig(b)
	svc4 := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(100, false, 80)}
	svc6 := Service{Key: ServiceKey{netip.AddrPortFrom(vip6, 80), TCP}, Backends: testBackends(100, true, 80)}
	p2c := Service{Key: ServiceKey{netip.AddrPortFrom(vipP2C, 80), TCP}, P2C: true, Backends: testBackends(100, false, 80)}
	for _, s := range []Service{svc4, svc6, p2c} {
		if err := p.AddService(s); err != nil {
			b.Fatal(err)
		}
	}
	tx := []Action{XDPTX}
	benchPaths(b, nil, p, rig, []pathCase{
		{name: "non-vip-pass", frame: dsrFrame(client4, other4, packet.ACK), actions: []Action{XDPPass}, count: ReasonPassNotService, same: true},
		{name: "established-v4", frame: dsrFrame(client4, vip4, packet.ACK), actions: tx, count: ReasonFlowHit, same: true},
		{name: "established-v6", frame: dsrFrame(client6, vip6, packet.ACK), actions: tx, count: ReasonFlowHit, same: true},
		{name: "syn-v4", frame: dsrFrame(client4, vip4, packet.SYN), actions: tx, count: ReasonFlowNew, same: true},
		{name: "new-flow-v4", frame: dsrFrame(client4, vip4, packet.SYN), newFlows: true, actions: tx, count: ReasonFlowNew},
		{name: "new-flow-v4-p2c", frame: dsrFrame(client4, vipP2C, packet.SYN), newFlows: true, actions: tx, count: ReasonFlowNew},
	})
}

// vipP2C is the benchmarks' maglev_p2c service address.
var vipP2C = netip.MustParseAddr("10.77.100.9")

// dsrFrame is a TCP segment with 64 bytes of payload from src:fixedSport to dst:80.
func dsrFrame(src, dst netip.Addr, flags uint8) []byte {
	return packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(src, fixedSport),
		Dst: netip.AddrPortFrom(dst, 80), TCPFlags: flags, Payload: make([]byte, 64)}.Build()
}

// BenchmarkFloor measures the wrapper itself: the floor with and without it (the
// wrapper's overhead, wrapper-ns), with new flows (the extra cost of varying the
// flow, newflow-ns), and whether restoring a frame whose start the program moved
// costs what restoring an unmoved one does. For that, push is one
// bpf_xdp_adjust_head(-20) before the floor (the wrapper moves the start back) and
// push-pull two calls (-20, +20) before it, honest without the wrapper too:
// push-ns (through the wrapper) should be half of push-pull-ns (plain), and
// rerun-push-pull-ns (push-pull through the wrapper) equal to it.
//
//	go test -run '^$' -bench 'Floor$' -benchtime 1x -count 3 ./loader/
func BenchmarkFloor(b *testing.B) {
	rig := loadRig(b)
	for _, tc := range []struct {
		name  string
		frame []byte
	}{
		{"v4", dsrFrame(client4, vip4, packet.ACK)},
		{"v6", dsrFrame(client6, vip6, packet.ACK)},
	} {
		b.Run(tc.name, func(b *testing.B) {
			type series struct {
				prog   *ebpf.Program
				rerun  bool
				newFlw bool
				v      []float64
			}
			plain := &series{prog: rig.Floor()}
			wrapped := &series{prog: rig.Floor(), rerun: true}
			newFlows := &series{prog: rig.Floor(), rerun: true, newFlw: true}
			push := &series{prog: rig.PushFloor(), rerun: true}
			pushPull := &series{prog: rig.PushPullFloor()}
			rerunPushPull := &series{prog: rig.PushPullFloor(), rerun: true}
			all := []*series{plain, wrapped, newFlows, push, pushPull, rerunPushPull}
			for range b.N {
				for range benchRuns {
					for _, s := range all {
						var d float64
						if s.rerun {
							res, err := rig.Run(s.prog, tc.frame, benchRepeat, s.newFlw)
							if err != nil || Action(res.Action) != XDPTX {
								b.Fatalf("action %s, err %v; want XDP_TX", Action(res.Action), err)
							}
							d = float64(res.PerRun.Nanoseconds())
						} else {
							action, pd, err := s.prog.Benchmark(tc.frame, benchRepeat, nil)
							if err != nil || Action(action) != XDPTX {
								b.Fatalf("action %s, err %v; want XDP_TX", Action(action), err)
							}
							d = float64(pd.Nanoseconds())
						}
						s.v = append(s.v, d)
					}
				}
			}
			m := func(s *series) float64 { return median(s.v) }
			b.ReportMetric(m(plain), "floor-ns/pkt")
			b.ReportMetric(m(wrapped), "rerun-floor-ns/pkt")
			b.ReportMetric(m(wrapped)-m(plain), "wrapper-ns")
			b.ReportMetric(m(newFlows)-m(wrapped), "newflow-ns")
			b.ReportMetric(m(push)-m(wrapped), "push-ns")
			b.ReportMetric(m(pushPull)-m(plain), "push-pull-ns")
			b.ReportMetric(m(rerunPushPull)-m(wrapped), "rerun-push-pull-ns")
			b.ReportMetric(0, "ns/op")
		})
	}
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// BenchmarkFallback measures what the previous-table fallback adds to a TCP packet
// that is not a SYN and misses the connection table (a new 5-tuple every
// iteration, recorded half-open as any such packet is), beside the same miss with
// no previous table. fallback: the previous table names other backends than the
// current one (the old ones drain), so every packet is sent by it (flow_fallback);
// previous-unusable: its backends were removed, so every packet pays both tables'
// lookups and takes the current one. syn-new-flow is the same new flow as a SYN,
// which never looks at the previous table.
//
//	go test -run '^$' -bench 'Fallback$' -benchtime 1x -count 3 ./loader/
func BenchmarkFallback(b *testing.B) {
	p, err := Load(Options{HashSeed: testSeed, ConntrackSize: 4096, PreviousTableWindow: time.Hour})
	xdptest.Check(b, err)
	b.Cleanup(func() { p.Close() })
	rig := loadRig(b)
	old, now := testBackends(100, false, 80)[:50], testBackends(100, false, 80)[50:]
	vips := []netip.Addr{vip4, netip.MustParseAddr("10.77.100.2"), netip.MustParseAddr("10.77.100.3")}
	for i, vip := range vips {
		s := Service{Key: ServiceKey{netip.AddrPortFrom(vip, 80), TCP}, Backends: slices.Clone(old)}
		if err := p.AddService(s); err != nil {
			b.Fatal(err)
		}
		switch i {
		case 1: // the old backends drain: still usable, out of the current table
			for j := range s.Backends {
				s.Backends[j].Draining = true
			}
			s.Backends = append(s.Backends, now...)
		case 2: // the old backends are gone
			s.Backends = slices.Clone(now)
		}
		if i > 0 {
			if err := p.UpdateService(s); err != nil {
				b.Fatal(err)
			}
		}
	}
	tx := []Action{XDPTX}
	benchPaths(b, nil, p, rig, []pathCase{
		{name: "ack-miss", frame: dsrFrame(client4, vips[0], packet.ACK), newFlows: true, actions: tx, count: ReasonFlowNew},
		{name: "ack-miss-fallback", frame: dsrFrame(client4, vips[1], packet.ACK), newFlows: true, actions: tx, count: ReasonFlowFallback},
		{name: "ack-miss-previous-unusable", frame: dsrFrame(client4, vips[2], packet.ACK), newFlows: true, actions: tx, count: ReasonFlowNew},
		{name: "syn-new-flow", frame: dsrFrame(client4, vips[1], packet.SYN), newFlows: true, actions: tx, count: ReasonFlowNew},
	})
}
