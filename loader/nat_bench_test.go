package loader

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
)

// natBench is a nat balancer for the benchmarks: the nat topology (client, balancer
// and three backends on one segment, permanent neighbours), and the program attached
// in generic mode to the balancer's link, serving the three backends on
// topo.HTTPPort (TCP) and topo.UDPPort (UDP) for both families.
type natBench struct {
	*topo.Topology
	prog *Program
}

func newNATBench(b *testing.B) *natBench {
	b.Helper()
	tp := topo.NewT(b, topo.Config{Name: topo.UniqueName("wnb"), Backends: 3})
	p := attachBalancer(b, tp, ModeGeneric, Options{HashSeed: 7, NAT: NATOptions{Addr4: tp.Balancer.IP4, Addr6: tp.Balancer.IP6}})
	for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
		for _, l4 := range []struct {
			proto Protocol
			port  uint16
		}{{TCP, topo.HTTPPort}, {UDP, topo.UDPPort}} {
			s := Service{Key: ServiceKey{netip.AddrPortFrom(vip, l4.port), l4.proto}, Forwarding: ForwardNAT}
			for _, h := range tp.Backends {
				ip := h.IP4
				if vip.Is6() {
					ip = h.IP6
				}
				s.Backends = append(s.Backends, Backend{Addr: netip.AddrPortFrom(ip, l4.port), Weight: 1, Usable: true})
			}
			if err := p.AddService(s); err != nil {
				b.Fatal(err)
			}
		}
	}
	return &natBench{Topology: tp, prog: p}
}

// forward is a client's segment with 64 bytes of payload to the VIP's web port.
func (nb *natBench) forward(v6 bool, sport uint16, flags uint8) []byte {
	return nb.segment(v6, sport, flags, 64)
}

// segment is a client's segment with n bytes of payload to the VIP's web port.
func (nb *natBench) segment(v6 bool, sport uint16, flags uint8, n int) []byte {
	client, vip := nb.Client.IP4, nb.VIP4
	if v6 {
		client, vip = nb.Client.IP6, nb.VIP6
	}
	return packet.Frame{SrcMAC: nb.Client.MAC, DstMAC: nb.Balancer.MAC, Src: netip.AddrPortFrom(client, sport),
		Dst: netip.AddrPortFrom(vip, topo.HTTPPort), TCPFlags: flags, Payload: make([]byte, n)}.Build()
}

// forwardUDP is a client's datagram with 64 bytes of payload to the VIP's UDP port.
func (nb *natBench) forwardUDP(v6 bool, sport uint16) []byte {
	client, vip := nb.Client.IP4, nb.VIP4
	if v6 {
		client, vip = nb.Client.IP6, nb.VIP6
	}
	return packet.Frame{SrcMAC: nb.Client.MAC, DstMAC: nb.Balancer.MAC, Src: netip.AddrPortFrom(client, sport),
		Dst: netip.AddrPortFrom(vip, topo.UDPPort), Proto: packet.ProtoUDP, Payload: make([]byte, 64)}.Build()
}

// established runs fwd, a forward frame, through the program twice (the first
// packet of a flow opens it half-open, the second establishes it) and returns what
// the program sent the backend.
func (nb *natBench) established(fwd []byte) ([]byte, error) {
	var out []byte
	err := nb.Balancer.NS.Do(func() error {
		for range 2 {
			action, o, err := nb.prog.Run(fwd)
			if err != nil {
				return err
			}
			if action != XDPRedirect && action != XDPTX {
				return fmt.Errorf("nat forward: action %s; want the packet forwarded", action)
			}
			out = o
		}
		return nil
	})
	return out, err
}

// reply is the backend's reply to the established flow of fwd, a forward frame,
// from the backend and to the nat port fwd was sent from.
func (nb *natBench) reply(fwd []byte) ([]byte, error) {
	out, err := nb.established(fwd)
	if err != nil {
		return nil, err
	}
	v6 := binary.BigEndian.Uint16(fwd[12:]) == 0x86dd
	l4, lb := 14+20, nb.Balancer.IP4
	backend := netip.AddrFrom4([4]byte(out[14+16 : 14+20]))
	proto := out[14+9]
	if v6 {
		l4, lb = 14+40, nb.Balancer.IP6
		backend = netip.AddrFrom16([16]byte(out[14+24 : 14+40]))
		proto = out[14+6]
	}
	// The backend answers from the port the frame went to.
	sport := binary.BigEndian.Uint16(out[l4+2:])
	for _, h := range nb.Backends {
		if h.IP4 == backend || h.IP6 == backend {
			f := packet.Frame{SrcMAC: h.MAC, DstMAC: nb.Balancer.MAC, Src: netip.AddrPortFrom(backend, sport),
				Dst: netip.AddrPortFrom(lb, binary.BigEndian.Uint16(out[l4:])), TCPFlags: packet.ACK, Payload: make([]byte, 64)}
			if proto == packet.ProtoUDP {
				f.Proto, f.TCPFlags = packet.ProtoUDP, 0
			}
			return f.Build(), nil
		}
	}
	return nil, fmt.Errorf("nat forward went to %s, no backend of the topology", backend)
}

// icmpFromBackend is a router's "fragmentation needed" (ICMPv6: "packet too big")
// from the backend's side about the established flow of fwd, to the nat address,
// quoting the packet the program sent the backend: its IP header and l4 bytes after
// it (all of it: -1).
func (nb *natBench) icmpFromBackend(fwd []byte, l4 int) ([]byte, error) {
	out, err := nb.established(fwd)
	if err != nil {
		return nil, err
	}
	quote := out[14:]
	if l4 >= 0 && quote[0]>>4 == 4 {
		quote = quote[:20+l4]
	} else if l4 >= 0 {
		quote = quote[:40+l4]
	}
	return nb.icmpQuoting(quote), nil
}

// icmpFromBackendWithRecordRoute is icmpFromBackend's least quote with a Record
// Route option of two slots in the quoted IPv4 header (whose checksum the program
// then does not check, and whose ports it finds past the options).
func (nb *natBench) icmpFromBackendWithRecordRoute(fwd []byte) ([]byte, error) {
	out, err := nb.established(fwd)
	if err != nil {
		return nil, err
	}
	rr := []byte{7, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	quote := slices.Concat(out[14:14+20], rr, out[14+20:14+20+8])
	quote[0] = 0x40 | byte((20+len(rr))/4)
	binary.BigEndian.PutUint16(quote[2:], binary.BigEndian.Uint16(quote[2:])+uint16(len(rr)))
	binary.BigEndian.PutUint16(quote[10:], 0)
	binary.BigEndian.PutUint16(quote[10:], packet.Checksum(quote[:20+len(rr)]))
	return nb.icmpQuoting(quote), nil
}

// icmpQuoting is a router's error from the backend's side quoting quote.
func (nb *natBench) icmpQuoting(quote []byte) []byte {
	f := packet.Frame{DstMAC: nb.Balancer.MAC, Proto: packet.ProtoICMP,
		Src: netip.AddrPortFrom(netip.AddrFrom4([4]byte(quote[16:20])), 0), Dst: netip.AddrPortFrom(nb.Balancer.IP4, 0),
		ICMP: &packet.ICMP{Type: 3, Code: 4, Rest: 1400, Quote: quote}}
	if quote[0]>>4 == 6 {
		f.Proto, f.ICMP.Type, f.ICMP.Code = packet.ProtoICMPv6, 2, 0
		f.Src, f.Dst = netip.AddrPortFrom(netip.AddrFrom16([16]byte(quote[24:40])), 0), netip.AddrPortFrom(nb.Balancer.IP6, 0)
	}
	for _, h := range nb.Backends {
		if h.IP4 == f.Src.Addr() || h.IP6 == f.Src.Addr() {
			f.SrcMAC = h.MAC
		}
	}
	return f.Build()
}

// BenchmarkNAT measures ns per packet of the nat paths beside the floor, in repeat
// mode through the wrapper (see bench_test.go), in the nat topology's balancer
// namespace, where the fib lookups find their routes and neighbours.
//
// Established flows repeat one 5-tuple: a connection-table hit, the cached next hop,
// both rewrites. Replies hit the reverse table. New flows are a new 5-tuple on every
// iteration (the wrapper varies the source port and address), each a SYN: lookup
// table, a source port from the backend's ring, the half-open entries. A million new
// flows a run come round each backend's 22,768 ports many times; the ring hands a
// port held by a half-open flow (the oldest) to the next one, so the range never
// fills and every new flow is forwarded (the benchmark checks the counters).
//
//	go test -run '^$' -bench 'NAT$' -benchtime 1x -count 3 ./loader/
func BenchmarkNAT(b *testing.B) {
	rig := loadRig(b)
	fwd := []Action{XDPRedirect, XDPTX}
	nb := newNATBench(b)
	var cases []pathCase
	for _, v6 := range []bool{false, true} {
		family := "v4"
		if v6 {
			family = "v6"
		}
		in := nb.forward(v6, fixedSport, packet.ACK)
		reply, err := nb.reply(in)
		if err != nil {
			b.Fatal(err)
		}
		udp := nb.forwardUDP(v6, fixedSport)
		udpReply, err := nb.reply(udp)
		if err != nil {
			b.Fatal(err)
		}
		// ICMP errors from the backend's side, whose checksum is summed in full
		// before the translation: a long one (the 512-byte frame the wrapper takes
		// at most; routers send up to 576 bytes of ICMP, RFC 1812 4.3.2.3, and 1,280
		// of ICMPv6, RFC 4443 2.4) and the least (the IP header and 8 bytes of TCP
		// quoted, whose translation leaves the quoted TCP checksum alone).
		quoteLen, ipLen := 512-14-20-8, 20
		if v6 {
			quoteLen, ipLen = 512-14-40-8, 40
		}
		longErr, err := nb.icmpFromBackend(nb.segment(v6, fixedSport+1, packet.ACK, quoteLen-ipLen-20), -1)
		if err != nil {
			b.Fatal(err)
		}
		shortErr, err := nb.icmpFromBackend(nb.segment(v6, fixedSport+2, packet.ACK, 0), 8)
		if err != nil {
			b.Fatal(err)
		}
		if !v6 {
			optErr, err := nb.icmpFromBackendWithRecordRoute(nb.segment(v6, fixedSport+3, packet.ACK, 0))
			if err != nil {
				b.Fatal(err)
			}
			cases = append(cases, pathCase{name: "icmp-v4-from-backend-record-route-" + strconv.Itoa(len(optErr)-14), frame: optErr, actions: fwd, count: ReasonICMPTranslated})
		}
		cases = append(cases,
			pathCase{name: "established-" + family + "-forward", frame: in, actions: fwd, count: ReasonFlowHit},
			pathCase{name: "icmp-" + family + "-from-backend-" + strconv.Itoa(len(longErr)-14), frame: longErr, actions: fwd, count: ReasonICMPTranslated},
			pathCase{name: "icmp-" + family + "-from-backend-" + strconv.Itoa(len(shortErr)-14), frame: shortErr, actions: fwd, count: ReasonICMPTranslated},
			pathCase{name: "established-" + family + "-reply", frame: reply, actions: fwd, count: ReasonNATReply},
			// A UDP reply also refreshes its flow, at most once a second.
			pathCase{name: "established-udp-" + family + "-reply", frame: udpReply, actions: fwd, count: ReasonNATReply})
	}
	cases = append(cases,
		pathCase{name: "new-flow-v4", frame: nb.forward(false, fixedSport, packet.SYN), newFlows: true, actions: fwd, count: ReasonFlowNew},
		pathCase{name: "new-flow-v6", frame: nb.forward(true, fixedSport, packet.SYN), newFlows: true, actions: fwd, count: ReasonFlowNew})
	benchPaths(b, nb.Balancer.NS, nb.prog, rig, cases)
}

// BenchmarkNATPerCall is the older, per-call measurement of the nat paths, kept for
// comparison with BenchmarkNAT. A nat run rewrites its frame, so each call runs the
// program once on a fresh copy of the original frame (repeat = 1) and takes the
// kernel's own measurement of that run, which includes a fixed timer overhead of
// the order of 100 ns. The floor is measured the same way, and the estimate per
// packet is
//
//	nat(repeat 1) - floor(repeat 1) + floor(repeat 1,000,000)
//
// i.e. the overhead cancels and the floor's true cost is added back. New flows
// differ in source port on every call, so each one allocates a port and inserts
// its half-open entries.
//
//	go test -run '^$' -bench 'NATPerCall$' -benchtime 1x -count 3 ./loader/
func BenchmarkNATPerCall(b *testing.B) {
	const calls = 20000
	rig := loadRig(b)
	nb := newNATBench(b)
	type frameFunc func(i int) []byte
	forward := func(v6 bool, flags uint8, distinct bool) frameFunc {
		return func(i int) []byte {
			sport := uint16(fixedSport)
			if distinct {
				sport = uint16(1024 + i)
			}
			return nb.forward(v6, sport, flags)
		}
	}
	reply := func(v6 bool) frameFunc {
		frame, err := nb.reply(nb.forward(v6, fixedSport, packet.ACK))
		if err != nil {
			b.Fatal(err)
		}
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
		b.Run(tc.name, func(b *testing.B) { measureFresh(b, nb.Balancer.NS, nb.prog, rig.Floor(), tc.frame, calls) })
	}
}

// measureFresh runs prog once per call on a fresh frame (repeat = 1), beside the
// floor measured the same way, inside ns, and reports
//
//	prog(repeat 1) - floor(repeat 1) + floor(repeat 1,000,000)
//
// as percall-ns/pkt: the per-call timer overhead cancels and the floor's true cost
// is added back. Every call must forward the packet.
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
	b.ReportMetric(est, "percall-ns/pkt")
	b.ReportMetric(flN, "floor-ns/pkt")
	b.ReportMetric(est/flN, "percall-x-floor")
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
