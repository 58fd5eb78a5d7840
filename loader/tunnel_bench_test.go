package loader

import (
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
)

// tunnelBench is the routed topology (backends behind a router) with the program
// attached in generic mode to both of the balancer's links, serving tunnel-mode
// services on port 80 of both VIPs, its next hop to the router resolved.
type tunnelBench struct {
	*topo.Routed
	prog *Program
}

func newTunnelBench(b *testing.B) *tunnelBench {
	b.Helper()
	tp := topo.NewRoutedT(b, 3)
	p := tunnelBalancer(b, tp, ModeGeneric, 3)
	for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
		if err := p.AddService(tunnelService(vip, 80, tp.Backends)); err != nil {
			b.Fatal(err)
		}
	}
	tb := &tunnelBench{Routed: tp, prog: p}
	// Wait for the managed neighbour of the router to resolve, so the benchmark
	// measures forwarding, not the first packets' hand-off to the kernel.
	for _, v6 := range []bool{false, true} {
		for try := 0; try < 50; try++ {
			var action Action
			tp.Balancer.NS.Do(func() error {
				action, _, _ = p.RunOn(tb.frame(v6, fixedSport, packet.ACK), tp.Balancer.Index)
				return nil
			})
			if action == XDPRedirect {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return tb
}

// frame is a client's segment with 64 bytes of payload to the VIP's port 80.
func (tb *tunnelBench) frame(v6 bool, sport uint16, flags uint8) []byte {
	client, vip := tb.Client.IP4, tb.VIP4
	if v6 {
		client, vip = tb.Client.IP6, tb.VIP6
	}
	return packet.Frame{SrcMAC: tb.Client.MAC, DstMAC: tb.Balancer.MAC, Src: netip.AddrPortFrom(client, sport),
		Dst: netip.AddrPortFrom(vip, 80), TCPFlags: flags, Payload: make([]byte, 64)}.Build()
}

// BenchmarkTunnel measures ns per packet of tunnel mode beside the floor, in repeat
// mode through the wrapper (see bench_test.go), which takes the outer header off
// again before every iteration. Established flows repeat one 5-tuple (a
// connection-table hit, the backend's cached next hop); new flows are a new 5-tuple
// on every iteration (lookup table, connection-table insert). The runs happen in
// the routed topology's balancer namespace, where the backends are behind a router.
//
//	go test -run '^$' -bench 'Tunnel$' -benchtime 1x -count 3 ./loader/
func BenchmarkTunnel(b *testing.B) {
	rig := loadRig(b)
	tb := newTunnelBench(b)
	redirect := []Action{XDPRedirect}
	benchPaths(b, tb.Balancer.NS, tb.prog, rig, []pathCase{
		{name: "established-v4", frame: tb.frame(false, fixedSport, packet.ACK), actions: redirect, count: ReasonFlowHit},
		{name: "established-v6", frame: tb.frame(true, fixedSport, packet.ACK), actions: redirect, count: ReasonFlowHit},
		{name: "new-flow-v4", frame: tb.frame(false, fixedSport, packet.SYN), newFlows: true, actions: redirect, count: ReasonFlowNew},
		{name: "new-flow-v6", frame: tb.frame(true, fixedSport, packet.SYN), newFlows: true, actions: redirect, count: ReasonFlowNew},
	})
}

// BenchmarkTunnelPerCall is the older, per-call measurement of tunnel mode, kept for
// comparison with BenchmarkTunnel: as BenchmarkNATPerCall, every call runs once on a
// fresh copy of the original frame (see measureFresh); new flows take a new source
// port on every call.
//
//	go test -run '^$' -bench 'TunnelPerCall$' -benchtime 1x -count 3 ./loader/
func BenchmarkTunnelPerCall(b *testing.B) {
	const calls = 20000
	rig := loadRig(b)
	tb := newTunnelBench(b)
	frame := func(v6 bool, flags uint8, distinct bool) func(int) []byte {
		return func(i int) []byte {
			sport := uint16(fixedSport)
			if distinct {
				sport = uint16(1024 + i)
			}
			return tb.frame(v6, sport, flags)
		}
	}
	for _, tc := range []struct {
		name  string
		frame func(int) []byte
	}{
		{"established-v4", frame(false, packet.ACK, false)},
		{"established-v6", frame(true, packet.ACK, false)},
		{"new-flow-v4", frame(false, packet.SYN, true)},
		{"new-flow-v6", frame(true, packet.SYN, true)},
	} {
		b.Run(tc.name, func(b *testing.B) { measureFresh(b, tb.Balancer.NS, tb.prog, rig.Floor(), tc.frame, calls) })
	}
}
