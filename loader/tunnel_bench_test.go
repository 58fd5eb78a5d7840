package loader

import (
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// BenchmarkTunnel measures ns per packet of tunnel mode beside the MAC-swap floor.
// Encapsulation changes the frame, so, as for nat, every call runs once on a fresh
// copy of the original frame (see measureFresh). Established flows repeat one
// 5-tuple (a connection-table hit, the backend's cached next hop); new flows take a
// new source port on every call (lookup table, connection-table insert). The runs
// happen in the routed topology's balancer namespace, where the backends are behind
// a router.
//
//	go test -run '^$' -bench Tunnel -benchtime 1x ./loader/
func BenchmarkTunnel(b *testing.B) {
	const calls = 20000
	tp := topo.NewRoutedT(b, 3)
	p, err := Load(Options{HashSeed: 3, NAT: NATOptions{Addr4: tp.BalancerUp.IP4, Addr6: tp.BalancerUp.IP6}})
	xdptest.Check(b, err)
	b.Cleanup(func() { p.Close() })
	err = tp.Balancer.NS.Do(func() error {
		for _, link := range []string{tp.Balancer.Link, tp.BalancerUp.Link} {
			if _, err := p.Attach(link, ModeGeneric); err != nil {
				return err
			}
		}
		return nil
	})
	xdptest.Check(b, err)
	for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
		s := Service{Key: ServiceKey{netip.AddrPortFrom(vip, 80), TCP}, Forwarding: ForwardTunnel}
		for _, be := range tp.Backends {
			ip := be.IP4
			if vip.Is6() {
				ip = be.IP6
			}
			s.Backends = append(s.Backends, Backend{Addr: netip.AddrPortFrom(ip, 80), Weight: 1, Usable: true})
		}
		if err := p.AddService(s); err != nil {
			b.Fatal(err)
		}
	}
	floor := floorProgram(b)
	frame := func(v6 bool, flags uint8, distinct bool) func(int) []byte {
		client, vip := tp.Client.IP4, tp.VIP4
		if v6 {
			client, vip = tp.Client.IP6, tp.VIP6
		}
		return func(i int) []byte {
			sport := uint16(20000)
			if distinct {
				sport = uint16(1024 + i)
			}
			return packet.Frame{SrcMAC: tp.Client.MAC, DstMAC: tp.Balancer.MAC, Src: netip.AddrPortFrom(client, sport),
				Dst: netip.AddrPortFrom(vip, 80), TCPFlags: flags, Payload: make([]byte, 64)}.Build()
		}
	}
	// Wait for the managed neighbour of the router to resolve, so the benchmark
	// measures forwarding, not the first packets' hand-off to the kernel.
	for _, v6 := range []bool{false, true} {
		for try := 0; try < 50; try++ {
			var action Action
			tp.Balancer.NS.Do(func() error {
				action, _, _ = p.RunOn(frame(v6, packet.ACK, false)(0), tp.Balancer.Index)
				return nil
			})
			if action == XDPRedirect {
				break
			}
			sleepBriefly()
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
		b.Run(tc.name, func(b *testing.B) { measureFresh(b, tp.Balancer.NS, p, floor, tc.frame, calls) })
	}
}

func sleepBriefly() { time.Sleep(100 * time.Millisecond) }
