package pktbench

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/bench/pktgen"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/loader"
)

// TestFloodTaken sends exactly n SYNs of distinct flows at the nat service
// and at a port with no service, with the new-flow limit at the config's
// default and off, and checks the accounting the flood cases rely on:
// floodTaken counts every one of the n frames once, and the far sink
// counts as forwarded those the service forwarded.
func TestFloodTaken(t *testing.T) {
	l, err := NewLine()
	xdptest.Check(t, err)
	t.Cleanup(func() { l.Close() })
	const n = 50_000
	for _, tc := range []struct {
		b       Balancer
		dst     string
		packets pktgen.Packet
	}{
		{WeirNATLimit, "service", pktgen.Packet{SYN: true, Dst: FloodService}},
		{WeirNATNoLimit, "service", pktgen.Packet{SYN: true, Dst: FloodService}},
		{WeirNATLimit, "no service", pktgen.Packet{SYN: true, Dst: FloodNoService}},
	} {
		t.Run(fmt.Sprintf("%s/%s", tc.b.Name, tc.dst), func(t *testing.T) {
			teardown, err := tc.b.Setup(l)
			xdptest.Check(t, err)
			defer func() {
				if err := teardown(); err != nil {
					t.Error(err)
				}
			}()
			g, err := pktgen.New(pktgen.Config{
				SrcMAC: GenMAC, DstMAC: LBInMAC, Dst4: netipPort(VIP4),
				Flows: n, Mix: []pktgen.Packet{tc.packets},
			})
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			before, err := l.weir.Stats()
			if err != nil {
				t.Fatal(err)
			}
			fwd0, err := l.Far.Count()
			if err != nil {
				t.Fatal(err)
			}
			sendStart := time.Now()
			if err := g.Send(l.Gen, l.GenIndex, n); err != nil {
				t.Fatal(err)
			}
			sent := time.Since(sendStart)
			after, err := l.weir.Stats()
			if err != nil {
				t.Fatal(err)
			}
			fwd1, err := l.Far.Count()
			if err != nil {
				t.Fatal(err)
			}
			taken := floodTaken(after, tc.packets.Dst) - floodTaken(before, tc.packets.Dst)
			forwarded := fwd1.Sub(fwd0).Packets
			delta := func(r loader.Reason) uint64 { return after.Reasons[r].Packets - before.Reasons[r].Packets }
			t.Logf("taken %d, forwarded %d; flow_new %d, flow_hit %d, drop_flow_rate %d, pass_not_service %d",
				taken, forwarded, delta(loader.ReasonFlowNew), delta(loader.ReasonFlowHit), delta(loader.ReasonDropFlowRate), delta(loader.ReasonPassNotService))
			if taken != n {
				t.Errorf("floodTaken counted %d frames; want %d", taken, n)
			}
			svc := after.Services[loader.ServiceKey{VIP: tc.packets.Dst, Protocol: loader.TCP}].Packets -
				before.Services[loader.ServiceKey{VIP: tc.packets.Dst, Protocol: loader.TCP}].Packets
			if forwarded != svc {
				t.Errorf("far sink counted %d frames; want the %d the service forwarded", forwarded, svc)
			}
			switch {
			case tc.dst == "no service" && forwarded != 0:
				t.Errorf("forwarded %d frames to no service; want 0", forwarded)
			case tc.b.Name == WeirNATNoLimit.Name && tc.dst == "service" && forwarded != n:
				t.Errorf("without a limit forwarded %d; want all %d", forwarded, n)
			case tc.b.Name == WeirNATLimit.Name && tc.dst == "service":
				// The limit is per CPU: each CPU that took frames passes
				// its burst and the rate's credit over the send's time;
				// on a quiet machine n frames take far less than a second,
				// so far fewer than n get through, but a loaded one sends
				// slower and earns more credit.
				most := uint64(runtime.NumCPU()) * (floodLimitBurst + uint64(float64(floodLimitRate)*sent.Seconds()*1.2) + 100)
				if forwarded < floodLimitBurst || forwarded > min(most, n) {
					t.Errorf("with the limit forwarded %d in %v; want at least the burst (%d) and at most %d", forwarded, sent, floodLimitBurst, min(most, n))
				}
			}
		})
	}
}

// TestFloodReport checks how the report reads flood cases, on made-up
// samples: stream shares are per round against the same round's baseline,
// × floor is what weir took over the floor's forwarded rate, stream cases
// stay out of the main table and get their own, and Save draws their plot.
func TestFloodReport(t *testing.T) {
	syn := pktgen.Packet{SYN: true, Dst: FloodService}
	floor := Result{Case: Case{Balancer: FloorRedirectNative, Flows: 1000}, Samples: []Sample{{Offered: 10e6, Forwarded: 10e6}, {Offered: 8e6, Forwarded: 8e6}}}
	flatAlone := Result{Case: Case{Balancer: WeirNATLimit, Idle: true, Streams: ManyStreams, Interactive: true}, Samples: []Sample{{StreamBps: 8e6}, {StreamBps: 8e6}}}
	flat := Result{
		Case:    Case{Balancer: WeirNATLimit, Flows: FloodFlows, SrcPorts: FloodPorts, Packet: syn, Streams: ManyStreams, Interactive: true},
		Samples: []Sample{{Offered: 6e6, Forwarded: 0.125e6, Taken: 6e6, StreamBps: 8e6}, {Offered: 3e6, Forwarded: 0.125e6, Taken: 3e6, StreamBps: 4e6, StreamsIdle: 3}},
	}
	splitAlone := Result{Case: Case{Balancer: WeirNATLimit, Idle: true, Streams: FloodStreams, SplitCPU: true}, Samples: []Sample{{StreamBps: 100}, {StreamBps: 200}}}
	split := Result{
		Case:    Case{Balancer: WeirNATLimit, Flows: FloodFlows, SrcPorts: FloodPorts, Packet: pktgen.Packet{SYN: true, Dst: FloodNoService}, Rate: 1e6, Streams: FloodStreams, SplitCPU: true},
		Samples: []Sample{{Offered: 1e6, Taken: 1e6, StreamBps: 50}, {Offered: 1e6, Taken: 1e6, StreamBps: 150, StreamsBroken: 1}},
	}
	r := Report{Results: []Result{floor, flatAlone, flat, splitAlone, split}, Opts: Options{Runs: 2, CPU: 1}}

	for _, tc := range []struct {
		name          string
		x             Result
		share, lo, hi float64
		ratio         float64
	}{
		{"flat out", flat, 0.75, 0.5, 1, 4.5e6 / 9e6},
		{"split", split, 0.625, 0.5, 0.75, math.NaN()},
	} {
		share, lo, hi := r.StreamShare(tc.x)
		if share != tc.share || lo != tc.lo || hi != tc.hi {
			t.Errorf("%s: StreamShare = %v (%v–%v); want %v (%v–%v)", tc.name, share, lo, hi, tc.share, tc.lo, tc.hi)
		}
		if ratio := r.FloodRatio(tc.x); ratio != tc.ratio && !(math.IsNaN(ratio) && math.IsNaN(tc.ratio)) {
			t.Errorf("%s: FloodRatio = %v; want %v", tc.name, ratio, tc.ratio)
		}
	}
	if share, _, _ := r.StreamShare(floor); !math.IsNaN(share) {
		t.Errorf("StreamShare of a case without streams = %v; want NaN", share)
	}

	var md bytes.Buffer
	if err := r.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	main, floods, ok := strings.Cut(md.String(), "SYN floods against established TCP streams")
	if !ok {
		t.Fatalf("no flood section in\n%s", md.String())
	}
	if strings.Contains(main, WeirNATLimit.Name) {
		t.Errorf("main table holds stream cases:\n%s", main)
	}
	for _, want := range []string{
		"| " + WeirNATLimit.Name + " | service 10.78.100.1:80 | 4.500 | 4.500 | 0.50 | 0.125 | 48.0 (32.0–64.0) | 0.75 (0.50–1.00) | 3 | 0 |",
		"| " + WeirNATLimit.Name + " | 10.78.100.1:81 (no service), 1.00 Mpps | 1.000 | 1.000 | — | 0.000 | 0.0 (0.0–0.0) | 0.62 (0.50–0.75) | 0 | 1 |",
		"| " + WeirNATLimit.Name + " | none | — | — | — | — |",
	} {
		if !strings.Contains(floods, want) {
			t.Errorf("flood section lacks %q:\n%s", want, floods)
		}
	}

	dir := t.TempDir()
	if err := r.Save(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "floods.png")); err != nil {
		t.Errorf("Save drew no flood plot: %v", err)
	}
}

// TestFloodSmoke runs a few flood cases once, briefly and small, through the
// real pipeline: bulk streams on split CPUs alone and under a slow flood
// aimed at the service and at no service, and interactive streams through a
// flat-out flood. Every stream must deliver and survive, and weir's counters
// must account for the paced floods. It measures nothing.
func TestFloodSmoke(t *testing.T) {
	if numCPU() < 2 {
		t.Skip("split CPUs need two CPUs")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	flood := func(b Balancer, dst netip.AddrPort, rate float64) Case {
		return Case{Balancer: b, Flows: FloodFlows, SrcPorts: FloodPorts, Packet: pktgen.Packet{SYN: true, Dst: dst}, Rate: rate}
	}
	split := func(c Case) Case {
		c.Streams, c.SplitCPU = 2, true
		return c
	}
	interactive := func(c Case) Case {
		c.Streams, c.Interactive = 20, true
		return c
	}
	cases := []Case{
		split(Case{Balancer: WeirNATLimit, Idle: true}),
		split(flood(WeirNATLimit, FloodService, 50_000)),
		split(flood(WeirNATLimit, FloodNoService, 50_000)),
		interactive(flood(WeirNATLimit, FloodService, 0)),
	}
	res, err := Run(ctx, cases, Options{Runs: 1, Duration: 300 * time.Millisecond, Warmup: 100 * time.Millisecond})
	xdptest.Check(t, err)
	for _, r := range res {
		s := r.Samples[0]
		t.Logf("%s: offered %.3f Mpps, weir took %.3f Mpps, forwarded %.3f Mpps, streams %.1f Mbit/s, %d idle, %d broken",
			r.Case.Name(), s.Offered/1e6, s.Taken/1e6, s.Forwarded/1e6, 8*s.StreamBps/1e6, s.StreamsIdle, s.StreamsBroken)
		if s.StreamBps == 0 || s.StreamsBroken > 0 {
			t.Errorf("%s: streams delivered %.0f B/s, %d broken; want > 0 and none", r.Case.Name(), s.StreamBps, s.StreamsBroken)
		}
		switch {
		case r.Case.Idle:
		case r.Case.Rate > 0 && (s.Taken < 0.9*s.Offered || s.Taken > 1.1*s.Offered):
			// 50,000 frames/s is far below what the balancer's CPU takes.
			t.Errorf("%s: weir took %.0f of %.0f frames/s offered; want all, give or take 10%%", r.Case.Name(), s.Taken, s.Offered)
		case r.Case.Rate == 0 && (s.Taken == 0 || s.Forwarded == 0):
			t.Errorf("%s: weir took %.0f frames/s, forwarded %.0f; want both > 0", r.Case.Name(), s.Taken, s.Forwarded)
		}
	}
}
