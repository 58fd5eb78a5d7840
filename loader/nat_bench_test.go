package loader

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
)

// BenchmarkNAT measures ns per packet of the nat paths beside the MAC-swap floor.
//
// A nat run rewrites its frame, so with repeat > 1 every repeat after the first
// would see the program's own output. Each call therefore runs the program once on
// a fresh copy of the original frame (repeat = 1) and takes the kernel's own
// measurement of that run, which includes a fixed timer overhead. The floor is
// measured the same way, and the estimate per packet is
//
//	nat(repeat 1) - floor(repeat 1) + floor(repeat 1,000,000)
//
// i.e. the overhead cancels and the floor's true cost is added back. New flows
// differ in source port on every call, so each one allocates a port and inserts
// both table entries. The runs happen in the nat topology's balancer namespace,
// where the fib lookup finds its routes.
//
//	go test -run '^$' -bench NAT -benchtime 1x ./loader/
func BenchmarkNAT(b *testing.B) {
	const calls = 20000
	nt := newNATTopology(b, ModeGeneric)
	floor := floorProgram(b)
	be := nt.Backends[0]

	type frameFunc func(i int) []byte
	// New flows go to the three-backend web service, so 20,000 of them use well
	// under the 3 × 22,768 source ports there are.
	forward := func(v6 bool, flags uint8, distinct bool) frameFunc {
		port := uint16(echoPort)
		if distinct {
			port = topo.HTTPPort
		}
		client, vip := nt.Client.IP4, nt.VIP4
		if v6 {
			client, vip = nt.Client.IP6, nt.VIP6
		}
		return func(i int) []byte {
			sport := uint16(20000)
			if distinct {
				sport = uint16(1024 + i)
			}
			return packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Src: netip.AddrPortFrom(client, sport),
				Dst: netip.AddrPortFrom(vip, port), TCPFlags: flags, Payload: make([]byte, 64)}.Build()
		}
	}
	// reply builds the backend's reply to the established flow; its nat port is read
	// from the forward path's output once.
	reply := func(v6 bool) frameFunc {
		var fwd []byte
		err := nt.Balancer.NS.Do(func() error {
			var err error
			_, fwd, err = nt.prog.Run(forward(v6, packet.ACK, false)(0))
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
		l4, lb, backend := 14+20, nt.Balancer.IP4, be.IP4
		if v6 {
			l4, lb, backend = 14+40, nt.Balancer.IP6, be.IP6
		}
		port := binary.BigEndian.Uint16(fwd[l4:])
		frame := packet.Frame{SrcMAC: be.MAC, DstMAC: nt.Balancer.MAC, Src: netip.AddrPortFrom(backend, echoPort),
			Dst: netip.AddrPortFrom(lb, port), TCPFlags: packet.ACK, Payload: make([]byte, 64)}.Build()
		return func(int) []byte { return frame }
	}

	cases := []struct {
		name  string
		frame frameFunc
	}{
		{"established-v4-forward", forward(false, packet.ACK, false)},
		{"established-v4-reply", reply(false)},
		{"established-v6-forward", forward(true, packet.ACK, false)},
		{"established-v6-reply", reply(true)},
		{"new-flow-v4", forward(false, packet.SYN, true)},
		{"new-flow-v6", forward(true, packet.SYN, true)},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) { measureFresh(b, nt.Balancer.NS, nt.prog, floor, tc.frame, calls) })
	}
}

// measureFresh runs prog once per call on a fresh frame (repeat = 1), beside the
// floor measured the same way, inside ns, and reports
//
//	prog(repeat 1) - floor(repeat 1) + floor(repeat 1,000,000)
//
// as ns/pkt: the per-call timer overhead cancels and the floor's true cost is added
// back. Every call must forward the packet.
func measureFresh(b *testing.B, ns *netns.NS, prog *Program, floor *ebpf.Program, frame func(i int) []byte, calls int) {
	var fresh, fl1 []float64
	var flN float64
	for range b.N {
		err := ns.Do(func() error {
			for i := range calls {
				in := frame(i)
				action, d, err := prog.Benchmark(in, 1)
				if err != nil {
					return err
				}
				if action != XDPRedirect && action != XDPTX {
					return fmt.Errorf("call %d: action %s; want the packet forwarded", i, action)
				}
				fresh = append(fresh, float64(d.Nanoseconds()))
				_, fd, err := floor.Benchmark(in, 1, nil)
				if err != nil {
					return err
				}
				fl1 = append(fl1, float64(fd.Nanoseconds()))
			}
			_, fd, err := floor.Benchmark(frame(0), 1_000_000, nil)
			flN = float64(fd.Nanoseconds())
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	est := mean(fresh) - mean(fl1) + flN
	b.ReportMetric(est, "ns/pkt")
	b.ReportMetric(flN, "floor-ns/pkt")
	b.ReportMetric(est/flN, "x-floor")
	b.ReportMetric(mean(fresh), "raw-repeat1-ns")
	b.ReportMetric(mean(fl1), "floor-repeat1-ns")
	b.ReportMetric(0, "ns/op")
}

func mean(v []float64) float64 {
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}
