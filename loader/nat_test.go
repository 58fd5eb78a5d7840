package loader

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"net/netip"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// TestNATFixtures runs frames through the program inside the topology's balancer
// namespace (the next hop comes from its routes and neighbours) and compares the
// output byte for byte with frames built from scratch, so every checksum the
// program updated incrementally is checked against one computed independently.
func TestNATFixtures(t *testing.T) {
	nt := newNATTopology(t, ModeGeneric)
	be0 := nt.Backends[0]
	for _, tc := range []struct {
		name       string
		v6         bool
		proto      uint8
		flags      uint8
		replyFlags uint8
	}{
		{"tcp syn v4", false, packet.ProtoTCP, packet.SYN, packet.SYN | packet.ACK},
		{"tcp syn v6", true, packet.ProtoTCP, packet.SYN, packet.SYN | packet.ACK},
		{"udp v4", false, packet.ProtoUDP, 0, 0},
		{"udp v6", true, packet.ProtoUDP, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, vip, lb, backend := nt.Client.IP4, nt.VIP4, nt.Balancer.IP4, be0.IP4
			if tc.v6 {
				client, vip, lb, backend = nt.Client.IP6, nt.VIP6, nt.Balancer.IP6, be0.IP6
			}
			port := uint16(topo.HTTPPort)
			if tc.proto == packet.ProtoUDP {
				port = topo.UDPPort
			}
			// TCP goes to the echo service; either way the output frame's MAC tells
			// which backend was chosen.
			if tc.proto == packet.ProtoTCP {
				port = echoPort
			}
			in := packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Proto: tc.proto,
				Src: netip.AddrPortFrom(client, 41000), Dst: netip.AddrPortFrom(vip, port),
				TCPFlags: tc.flags, Payload: []byte("hello")}
			var action Action
			var out []byte
			err := nt.Balancer.NS.Do(func() error {
				var err error
				action, out, err = nt.prog.RunOn(in.Build(), nt.Balancer.Index)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			if action != XDPTX {
				t.Fatalf("forward: action %s; want XDP_TX", action)
			}
			// The output tells which backend and source port were chosen; the rest
			// must be exactly the frame built for them.
			l4 := 14 + 20
			if tc.v6 {
				l4 = 14 + 40
			}
			natPort := binary.BigEndian.Uint16(out[l4:])
			if natPort < 10000 || natPort > 32767 {
				t.Fatalf("nat source port %d; want 10000..32767", natPort)
			}
			var chosen topo.Host
			for _, h := range nt.Backends {
				if bytes.Equal(out[0:6], h.MAC) {
					chosen = h
				}
			}
			if chosen.Name == "" {
				t.Fatalf("output to MAC %x, no backend's", out[0:6])
			}
			backend = chosen.IP4
			if tc.v6 {
				backend = chosen.IP6
			}
			want := in
			want.SrcMAC, want.DstMAC = nt.Balancer.MAC, chosen.MAC
			want.Src, want.Dst = netip.AddrPortFrom(lb, natPort), netip.AddrPortFrom(backend, port)
			if w := want.Build(); !bytes.Equal(out, w) {
				t.Fatalf("forward frame\n got %x\nwant %x", out, w)
			}

			// The backend's reply, translated back to the client. A TCP reply must
			// acknowledge the client's SYN (sequence number 1000): one that
			// acknowledges anything else (beyond what data the SYN may carry) is
			// another connection's, left on the backend by an earlier flow on the
			// port, and goes to the host untouched.
			reply := packet.Frame{SrcMAC: chosen.MAC, DstMAC: nt.Balancer.MAC, Proto: tc.proto,
				Src: netip.AddrPortFrom(backend, port), Dst: netip.AddrPortFrom(lb, natPort),
				TCPFlags: tc.replyFlags, Payload: []byte("world!")}
			if tc.proto == packet.ProtoTCP {
				stale := reply
				stale.Ack = 1001 + 1<<28
				var got []byte
				err = nt.Balancer.NS.Do(func() error {
					var err error
					action, got, err = nt.prog.RunOn(stale.Build(), nt.Balancer.Index)
					return err
				})
				if err != nil {
					t.Fatal(err)
				}
				if w := stale.Build(); action != XDPPass || !bytes.Equal(got, w) {
					t.Fatalf("another connection's reply: action %s, frame\n got %x\nwant %s, %x", action, got, XDPPass, w)
				}
				reply.Ack = 1001
			}
			err = nt.Balancer.NS.Do(func() error {
				var err error
				action, out, err = nt.prog.RunOn(reply.Build(), nt.Balancer.Index)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			if action != XDPTX {
				t.Fatalf("reply: action %s; want XDP_TX", action)
			}
			wantReply := reply
			wantReply.SrcMAC, wantReply.DstMAC = nt.Balancer.MAC, nt.Client.MAC
			wantReply.Src, wantReply.Dst = netip.AddrPortFrom(vip, port), netip.AddrPortFrom(client, 41000)
			if w := wantReply.Build(); !bytes.Equal(out, w) {
				t.Fatalf("reply frame\n got %x\nwant %x", out, w)
			}

			// ICMP errors quoting the flow, from either side, are translated like it:
			// the quote becomes the packet the receiver itself sent.
			icmpProto, errType, errCode, mtu := uint8(packet.ProtoICMP), uint8(3), uint8(4), uint32(1400)
			if tc.v6 {
				icmpProto, errType, errCode, mtu = packet.ProtoICMPv6, 2, 0, 1280
			}
			// A router may quote only 8 bytes past the IP header (RFC 792), which
			// leaves a TCP quote's checksum out; the frame can hold more after the
			// error's IP packet (a trailer), which is no part of the quote and must
			// not be taken for that checksum.
			ipHdr := 20
			if tc.v6 {
				ipHdr = 40
			}
			cut := func(quote []byte) []byte { return quote[:ipHdr+8] }
			// A parameter problem (RFC 792 type 12, RFC 4443 type 4) points at a byte of
			// the quote, here its TCP/UDP header, which translation leaves where it was.
			ppType, ppRest := uint8(12), uint32(20)<<24
			if tc.v6 {
				ppType, ppRest = 4, 40
			}
			// A quoted IPv4 header may carry options (RFC 5508 REQ-3 b), a quoted IPv6
			// header extension headers (what a parameter problem of RFC 4443 code 2 is
			// about); the ports follow them.
			withOptions := func(f packet.Frame) packet.Frame {
				f.IPv4Options = []byte{1, 1, 1, 0}
				f.IPv6ExtHeaders = []uint8{packet.ProtoHopOpts, packet.ProtoDstOpts}
				return f
			}
			trailer := bytes.Repeat([]byte{0xa5}, 24)
			// badHeaderSum makes a quoted IPv4 header's own checksum wrong; the ICMP
			// checksum, computed over the quote as it is, holds (RFC 5508 REQ-3 a: one
			// without options is dropped).
			badHeaderSum := func(quote []byte) []byte {
				quote[10] ^= 0x40
				return quote
			}
			type icmpCase struct {
				side     string
				in, want packet.Frame
				trailer  []byte
				// corrupt: the error's ICMP checksum is made wrong; it must be dropped
				// as it came, never translated, as must one with drop set.
				corrupt, drop bool
			}
			// routerFilled quotes f with a Record Route option that a router filled in
			// place (the address written, the pointer moved past it) after the header's
			// checksum was made, as Linux quotes a packet it answers with an error
			// before forwarding it: the header's checksum no longer holds, yet the
			// error is a true one and must be translated.
			routerFilled := func(f packet.Frame) []byte {
				f.IPv4Options = []byte{7, 7, 4, 0, 0, 0, 0, 0}
				q := f.IPPacket()
				q[22] = 8
				copy(q[23:27], []byte{192, 0, 2, 1})
				return q
			}
			var quoteSumWrong []icmpCase
			if !tc.v6 {
				quoteSumWrong = []icmpCase{
					{
						side: "from the backend, its quoted header's checksum wrong",
						in: packet.Frame{SrcMAC: chosen.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
							Src: netip.AddrPortFrom(backend, 0), Dst: netip.AddrPortFrom(lb, 0),
							ICMP: &packet.ICMP{Type: ppType, Rest: ppRest, Quote: badHeaderSum(want.IPPacket())}},
						drop: true,
					},
					{
						side: "from the backend, quoting a Record Route a router filled in",
						in: packet.Frame{SrcMAC: chosen.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
							Src: netip.AddrPortFrom(backend, 0), Dst: netip.AddrPortFrom(lb, 0),
							ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: routerFilled(want)}},
						want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: nt.Client.MAC, Proto: icmpProto,
							Src: netip.AddrPortFrom(vip, 0), Dst: netip.AddrPortFrom(client, 0),
							ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: routerFilled(in)}},
					},
					{
						side: "from the client, quoting a Record Route a router filled in",
						in: packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
							Src: netip.AddrPortFrom(client, 0), Dst: netip.AddrPortFrom(vip, 0),
							ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: routerFilled(wantReply)}},
						want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: chosen.MAC, Proto: icmpProto,
							Src: netip.AddrPortFrom(lb, 0), Dst: netip.AddrPortFrom(backend, 0),
							ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: routerFilled(reply)}},
					},
					{
						side: "from the client, its quoted header's checksum wrong",
						in: packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
							Src: netip.AddrPortFrom(client, 0), Dst: netip.AddrPortFrom(vip, 0),
							ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: badHeaderSum(wantReply.IPPacket())}},
						drop: true,
					},
				}
			}
			for _, ic := range append([]icmpCase{
				{
					side: "from the backend",
					in: packet.Frame{SrcMAC: chosen.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(backend, 0), Dst: netip.AddrPortFrom(lb, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: want.IPPacket()}},
					want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: nt.Client.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(vip, 0), Dst: netip.AddrPortFrom(client, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: in.IPPacket()}},
				},
				{
					side: "from the client",
					in: packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(client, 0), Dst: netip.AddrPortFrom(vip, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: wantReply.IPPacket()}},
					want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: chosen.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(lb, 0), Dst: netip.AddrPortFrom(backend, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: reply.IPPacket()}},
				},
				{
					side: "from the backend, quoting 8 bytes past the IP header, in a frame with a trailer",
					in: packet.Frame{SrcMAC: chosen.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(backend, 0), Dst: netip.AddrPortFrom(lb, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: cut(want.IPPacket())}},
					want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: nt.Client.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(vip, 0), Dst: netip.AddrPortFrom(client, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: cut(in.IPPacket())}},
					trailer: trailer,
				},
				{
					side: "from the client, quoting 8 bytes past the IP header, in a frame with a trailer",
					in: packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(client, 0), Dst: netip.AddrPortFrom(vip, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: cut(wantReply.IPPacket())}},
					want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: chosen.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(lb, 0), Dst: netip.AddrPortFrom(backend, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: cut(reply.IPPacket())}},
					trailer: trailer,
				},
				{
					side: "from the backend, a parameter problem",
					in: packet.Frame{SrcMAC: chosen.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(backend, 0), Dst: netip.AddrPortFrom(lb, 0),
						ICMP: &packet.ICMP{Type: ppType, Rest: ppRest, Quote: want.IPPacket()}},
					want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: nt.Client.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(vip, 0), Dst: netip.AddrPortFrom(client, 0),
						ICMP: &packet.ICMP{Type: ppType, Rest: ppRest, Quote: in.IPPacket()}},
				},
				{
					side: "from the client, a parameter problem",
					in: packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(client, 0), Dst: netip.AddrPortFrom(vip, 0),
						ICMP: &packet.ICMP{Type: ppType, Rest: ppRest, Quote: wantReply.IPPacket()}},
					want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: chosen.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(lb, 0), Dst: netip.AddrPortFrom(backend, 0),
						ICMP: &packet.ICMP{Type: ppType, Rest: ppRest, Quote: reply.IPPacket()}},
				},
				{
					side: "from the backend, quoting a packet with options",
					in: packet.Frame{SrcMAC: chosen.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(backend, 0), Dst: netip.AddrPortFrom(lb, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: withOptions(want).IPPacket()}},
					want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: nt.Client.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(vip, 0), Dst: netip.AddrPortFrom(client, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: withOptions(in).IPPacket()}},
				},
				{
					side: "from the client, quoting a packet with options",
					in: packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(client, 0), Dst: netip.AddrPortFrom(vip, 0),
						ICMP: &packet.ICMP{Type: ppType, Rest: ppRest, Quote: withOptions(wantReply).IPPacket()}},
					want: packet.Frame{SrcMAC: nt.Balancer.MAC, DstMAC: chosen.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(lb, 0), Dst: netip.AddrPortFrom(backend, 0),
						ICMP: &packet.ICMP{Type: ppType, Rest: ppRest, Quote: withOptions(reply).IPPacket()}},
				},
				{
					side: "from the backend, its checksum wrong",
					in: packet.Frame{SrcMAC: chosen.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(backend, 0), Dst: netip.AddrPortFrom(lb, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: want.IPPacket()}},
					corrupt: true,
				},
				{
					side: "from the client, its checksum wrong",
					in: packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Proto: icmpProto,
						Src: netip.AddrPortFrom(client, 0), Dst: netip.AddrPortFrom(vip, 0),
						ICMP: &packet.ICMP{Type: errType, Code: errCode, Rest: mtu, Quote: wantReply.IPPacket()}},
					corrupt: true,
				},
			}, quoteSumWrong...) {
				in := append(ic.in.Build(), ic.trailer...)
				if ic.corrupt {
					// One bit of the quote.
					in[len(in)-1] ^= 0x40
				}
				err = nt.Balancer.NS.Do(func() error {
					var err error
					action, out, err = nt.prog.RunOn(in, nt.Balancer.Index)
					return err
				})
				if err != nil {
					t.Fatal(err)
				}
				if ic.corrupt || ic.drop {
					if action != XDPDrop {
						t.Fatalf("icmp error %s: action %s; want XDP_DROP", ic.side, action)
					}
					continue
				}
				if action != XDPTX {
					t.Fatalf("icmp error %s: action %s; want XDP_TX", ic.side, action)
				}
				if w := append(ic.want.Build(), ic.trailer...); !bytes.Equal(out, w) {
					t.Fatalf("icmp error %s\n got %x\nwant %x", ic.side, out, w)
				}
			}
		})
	}

	t.Run("untracked packet to the nat address passes", func(t *testing.T) {
		in := packet.Frame{SrcMAC: be0.MAC, DstMAC: nt.Balancer.MAC,
			Src: netip.AddrPortFrom(be0.IP4, 80), Dst: netip.AddrPortFrom(nt.Balancer.IP4, 22222), TCPFlags: packet.ACK}.Build()
		var action Action
		var out []byte
		err := nt.Balancer.NS.Do(func() error {
			var err error
			action, out, err = nt.prog.RunOn(in, nt.Balancer.Index)
			return err
		})
		if err != nil || action != XDPPass || !bytes.Equal(out, in) {
			t.Fatalf("action %s, err %v, changed %t; want XDP_PASS unchanged", action, err, !bytes.Equal(out, in))
		}
	})
}

// natRig is a topology without servers and a program attached to its balancer in
// generic mode, nat addresses set: frames go through BPF_PROG_TEST_RUN in the
// balancer's namespace, whose routes and neighbours the fib lookups use.
func natRig(t *testing.T, backends int) (*topo.Topology, *Program) {
	t.Helper()
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wn"), Backends: backends})
	p := attachBalancer(t, tp, ModeGeneric, Options{HashSeed: 7, NAT: NATOptions{Addr4: tp.Balancer.IP4, Addr6: tp.Balancer.IP6}})
	return tp, p
}

// runIn runs frame through p as if it came in on the balancer's link.
func runIn(t *testing.T, tp *topo.Topology, p *Program, frame []byte) (Action, []byte) {
	t.Helper()
	var action Action
	var out []byte
	err := tp.Balancer.NS.Do(func() error {
		var err error
		action, out, err = p.RunOn(frame, tp.Balancer.Index)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return action, out
}

// reasonCount is the packets counted under r so far.
func reasonCount(t *testing.T, p *Program, r Reason) uint64 {
	t.Helper()
	st, err := p.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return st.Reasons[r].Packets
}

// TestNATServicesSharingABackend: two nat services (one app on two ports) with the
// same backend address and port claim that backend's source ports under the same
// keys, so they take them from one ring: their half-open flows get different ports,
// and the first flow's handshake completes on the port its SYN used.
func TestNATServicesSharingABackend(t *testing.T) {
	tp, p := natRig(t, 1)
	be := tp.Backends[0]
	for _, v6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "v4", true: "v6"}[v6], func(t *testing.T) {
			client, vip, lb, backendIP, l4 := tp.Client.IP4, tp.VIP4, tp.Balancer.IP4, be.IP4, 14+20
			if v6 {
				client, vip, lb, backendIP, l4 = tp.Client.IP6, tp.VIP6, tp.Balancer.IP6, be.IP6, 14+40
			}
			backend := netip.AddrPortFrom(backendIP, 7000)
			var svcs [2]Service
			for i := range svcs {
				svcs[i] = Service{Key: ServiceKey{netip.AddrPortFrom(vip, 7000+uint16(i)), TCP}, Forwarding: ForwardNAT,
					Backends: []Backend{{Addr: backend, Weight: 1, Usable: true}}}
				if err := p.AddService(svcs[i]); err != nil {
					t.Fatal(err)
				}
			}
			natPort := func(out []byte) uint16 { return binary.BigEndian.Uint16(out[l4:]) }
			send := func(what string, f packet.Frame) uint16 {
				t.Helper()
				action, out := runIn(t, tp, p, f.Build())
				if action != XDPTX {
					t.Fatalf("%s: action %s; want XDP_TX", what, action)
				}
				return natPort(out)
			}
			synA := packet.Frame{SrcMAC: tp.Client.MAC, DstMAC: tp.Balancer.MAC,
				Src: netip.AddrPortFrom(client, 41000), Dst: svcs[0].Key.VIP, TCPFlags: packet.SYN, Seq: 1000}
			synB := packet.Frame{SrcMAC: tp.Client.MAC, DstMAC: tp.Balancer.MAC,
				Src: netip.AddrPortFrom(client, 41001), Dst: svcs[1].Key.VIP, TCPFlags: packet.SYN, Seq: 5000}
			portA := send("SYN to the first service", synA)
			portB := send("SYN to the second service", synB)
			if portA == portB {
				t.Fatalf("both services' flows to backend %s from nat port %d; want distinct ports", backend, portA)
			}

			synAck := packet.Frame{SrcMAC: be.MAC, DstMAC: tp.Balancer.MAC,
				Src: backend, Dst: netip.AddrPortFrom(lb, portA), TCPFlags: packet.SYN | packet.ACK, Seq: 9000, Ack: 1001}
			if action, _ := runIn(t, tp, p, synAck.Build()); action != XDPTX {
				t.Fatalf("the backend's SYN-ACK to the first flow: action %s; want XDP_TX", action)
			}
			ackA := synA
			ackA.TCPFlags, ackA.Seq, ackA.Ack = packet.ACK, 1001, 9001
			if got := send("the first flow's ACK", ackA); got != portA {
				t.Errorf("the first flow's ACK left from nat port %d; want %d, its SYN's", got, portA)
			}
			for _, s := range svcs {
				if err := p.DeleteService(s.Key); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// TestNATRings: the slots holding one backend (address, port and protocol) share a
// nat port ring, any other backend has its own, a ring outlives the service that
// made it while another slot holds its backend, and a Load that adopts pinned maps
// keeps the rings, or gives each backend its own where the pinned backends named
// none (every slot ring 0).
func TestNATRings(t *testing.T) {
	pinPath := filepath.Join(xdptest.BPFFS(t), "weir")
	opts := Options{HashSeed: 7, NAT: NATOptions{Addr4: netip.MustParseAddr("10.77.0.2")}, PinPath: pinPath}
	p, err := Load(opts)
	xdptest.Check(t, err)
	t.Cleanup(func() { p.Close() })

	x := netip.MustParseAddrPort("10.77.0.11:80")
	y := netip.MustParseAddrPort("10.77.0.12:80")
	svc := func(port uint16, proto Protocol, backends ...netip.AddrPort) Service {
		s := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, port), proto}, Forwarding: ForwardNAT}
		for _, b := range backends {
			s.Backends = append(s.Backends, Backend{Addr: b, Weight: 1, Usable: true})
		}
		return s
	}
	a, b, c := svc(80, TCP, x, y), svc(81, TCP, y, x), svc(80, UDP, x)
	for _, s := range []Service{a, b, c} {
		if err := p.SetService(s); err != nil {
			t.Fatal(err)
		}
	}
	rings := func(p *Program) map[ServiceKey]map[netip.AddrPort]uint32 {
		t.Helper()
		out := make(map[ServiceKey]map[netip.AddrPort]uint32)
		for k, st := range p.services {
			out[k] = make(map[netip.AddrPort]uint32)
			for addr, slot := range st.slots {
				var be bpf.WeirBackend
				if err := p.objs.Backends.Lookup(slot, &be); err != nil {
					t.Fatal(err)
				}
				out[k][addr] = be.NatRing
			}
		}
		return out
	}
	check := func(when string, got map[ServiceKey]map[netip.AddrPort]uint32) {
		t.Helper()
		ax, ay, bx, by, cx := got[a.Key][x], got[a.Key][y], got[b.Key][x], got[b.Key][y], got[c.Key][x]
		if ax != bx || ay != by {
			t.Errorf("%s: rings of %s %d and %d, of %s %d and %d; want one each, shared by both TCP services", when, x, ax, bx, y, ay, by)
		}
		if ax == ay || cx == ax || cx == ay {
			t.Errorf("%s: rings tcp %s %d, tcp %s %d, udp %s %d; want three", when, x, ax, y, ay, x, cx)
		}
	}
	before := rings(p)
	check("set", before)

	if err := p.Release(); err != nil {
		t.Fatal(err)
	}
	p, err = Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	if got := rings(p); !maps.EqualFunc(got, before, maps.Equal) {
		t.Errorf("adopted rings %v; want %v as pinned", got, before)
	}

	// Pinned by a weir without shared rings: every slot names ring 0.
	for _, st := range p.services {
		for _, slot := range st.slots {
			var be bpf.WeirBackend
			if err := p.objs.Backends.Lookup(slot, &be); err != nil {
				t.Fatal(err)
			}
			be.NatRing = 0
			if err := p.objs.Backends.Put(slot, be); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := p.Release(); err != nil {
		t.Fatal(err)
	}
	p, err = Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	check("adopted from ring 0", rings(p))

	// The service that made x's TCP ring goes; b's slot keeps it, and a service
	// on x made after takes it too.
	kept := rings(p)[b.Key][x]
	if err := p.DeleteService(a.Key); err != nil {
		t.Fatal(err)
	}
	d := svc(82, TCP, x)
	if err := p.SetService(d); err != nil {
		t.Fatal(err)
	}
	if got := rings(p); got[b.Key][x] != kept || got[d.Key][x] != kept {
		t.Errorf("after the first service on %s went: rings %d and %d; want %d, the one it shared", x, got[b.Key][x], got[d.Key][x], kept)
	}
}

// TestNATNextHopOutsideTxPorts: the route to a nat backend leaves by an interface
// the program is not attached to (a VLAN device over the attached link, or any link
// without weir), which tx_ports does not hold. The packet is dropped and counted
// drop_no_tx_port, not counted as redirected.
func TestNATNextHopOutsideTxPorts(t *testing.T) {
	tp, p := natRig(t, 1)
	be := tp.Backends[0]
	backend := netip.AddrPortFrom(be.IP4, 7000)
	svc := Service{Key: ServiceKey{netip.AddrPortFrom(tp.VIP4, 7000), TCP}, Forwarding: ForwardNAT,
		Backends: []Backend{{Addr: backend, Weight: 1, Usable: true}}}
	if err := p.AddService(svc); err != nil {
		t.Fatal(err)
	}
	// A link of the balancer's without weir, and the backend's route over it.
	ns := tp.Name + "-lb"
	for _, args := range [][]string{
		{"link", "add", "wno0", "type", "veth", "peer", "name", "wno1"},
		{"link", "set", "wno1", "up"},
		{"link", "set", "wno0", "up"},
		{"addr", "add", "10.99.0.1/24", "dev", "wno0"},
		{"neigh", "add", "10.99.0.2", "lladdr", "02:99:00:00:00:02", "dev", "wno0", "nud", "permanent"},
		{"route", "add", be.IP4.String() + "/32", "via", "10.99.0.2", "dev", "wno0"},
	} {
		cmd := exec.Command("ip", append([]string{"netns", "exec", ns, "ip"}, args...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", cmd, err, out)
		}
	}
	in := packet.Frame{SrcMAC: tp.Client.MAC, DstMAC: tp.Balancer.MAC,
		Src: netip.AddrPortFrom(tp.Client.IP4, 41000), Dst: svc.Key.VIP, TCPFlags: packet.SYN}
	redirect, noTXPort := reasonCount(t, p, ReasonRedirect), reasonCount(t, p, ReasonDropNoTXPort)
	action, _ := runIn(t, tp, p, in.Build())
	if action != XDPDrop {
		t.Errorf("action %s; want XDP_DROP", action)
	}
	if got := reasonCount(t, p, ReasonRedirect) - redirect; got != 0 {
		t.Errorf("redirect went up by %d; want 0", got)
	}
	if got := reasonCount(t, p, ReasonDropNoTXPort) - noTXPort; got != 1 {
		t.Errorf("drop_no_tx_port went up by %d; want 1", got)
	}
}

// TestNATTooBig: the route to a nat backend has a smaller MTU (1300) than the
// client's packets (1400 bytes). As the kernel would when forwarding, weir answers
// with ICMP "fragmentation needed" (IPv4 with DF) or ICMPv6 "packet too big"
// carrying the route's MTU, from the VIP, quoting the client's packet as it sent it;
// back the way it came (its VLAN tag kept). An IPv4 packet without DF is dropped:
// XDP cannot fragment. The flow stays, and packets that fit go on to the backend.
func TestNATTooBig(t *testing.T) {
	tp, p := natRig(t, 1)
	be := tp.Backends[0]
	const mtu = 1300
	// A narrower path to the backend (a tunnel, a router's smaller link).
	for _, dst := range []string{be.IP4.String() + "/32", be.IP6.String() + "/128"} {
		cmd := exec.Command("ip", "netns", "exec", tp.Name+"-lb", "ip", "route", "add", dst,
			"dev", tp.Balancer.Link, "mtu", "lock", fmt.Sprint(mtu))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", cmd, err, out)
		}
	}
	for i, tc := range []struct {
		name       string
		v6         bool
		proto      uint8
		vlan       uint16
		noDF       bool
		wantAction Action
		wantReason Reason
	}{
		{"udp v4 with df", false, packet.ProtoUDP, 0, false, XDPTX, ReasonNATTooBig},
		{"tcp v4 with df, vlan tagged", false, packet.ProtoTCP, 7, false, XDPTX, ReasonNATTooBig},
		{"udp v4 without df", false, packet.ProtoUDP, 0, true, XDPDrop, ReasonDropTooBig},
		{"tcp v6", true, packet.ProtoTCP, 0, false, XDPTX, ReasonNATTooBig},
		{"udp v6, vlan tagged", true, packet.ProtoUDP, 7, false, XDPTX, ReasonNATTooBig},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, vip, backendIP, ipLen := tp.Client.IP4, tp.VIP4, be.IP4, 20
			icmpProto, icmpType, icmpCode := uint8(packet.ProtoICMP), uint8(3), uint8(4)
			if tc.v6 {
				client, vip, backendIP, ipLen = tp.Client.IP6, tp.VIP6, be.IP6, 40
				icmpProto, icmpType, icmpCode = packet.ProtoICMPv6, 2, 0
			}
			proto := TCP
			if tc.proto == packet.ProtoUDP {
				proto = UDP
			}
			svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip, 7000), proto}, Forwarding: ForwardNAT,
				Backends: []Backend{{Addr: netip.AddrPortFrom(backendIP, 7000), Weight: 1, Usable: true}}}
			if err := p.AddService(svc); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.DeleteService(svc.Key) })
			l4Len := 8
			if tc.proto == packet.ProtoTCP {
				l4Len = 20
			}
			in := packet.Frame{SrcMAC: tp.Client.MAC, DstMAC: tp.Balancer.MAC, VLAN: tc.vlan, Proto: tc.proto,
				Src: netip.AddrPortFrom(client, 41000+uint16(i)), Dst: svc.Key.VIP, TCPFlags: packet.ACK,
				Payload: make([]byte, 1400-ipLen-l4Len)}
			frame := in.Build()
			l3 := len(frame) - 1400
			if !tc.v6 && !tc.noDF {
				ip := frame[l3 : l3+20]
				binary.BigEndian.PutUint16(ip[6:], 0x4000)
				binary.BigEndian.PutUint16(ip[10:], 0)
				binary.BigEndian.PutUint16(ip[10:], packet.Checksum(ip))
			}
			before := reasonCount(t, p, tc.wantReason)
			action, out := runIn(t, tp, p, frame)
			if action != tc.wantAction {
				t.Fatalf("1400-byte packet: action %s; want %s", action, tc.wantAction)
			}
			if got := reasonCount(t, p, tc.wantReason) - before; got != 1 {
				t.Errorf("%s went up by %d; want 1", tc.wantReason, got)
			}
			if tc.wantAction == XDPTX {
				want := packet.Frame{SrcMAC: tp.Balancer.MAC, DstMAC: tp.Client.MAC, VLAN: tc.vlan, Proto: icmpProto,
					Src: netip.AddrPortFrom(vip, 0), Dst: netip.AddrPortFrom(client, 0),
					ICMP: &packet.ICMP{Type: icmpType, Code: icmpCode, Rest: mtu, Quote: frame[l3 : l3+ipLen+8]}}
				w := want.Build()
				if !tc.v6 {
					// weir's IPv4 header has ID 0, packet.Frame's 0x1234.
					ip := w[l3 : l3+20]
					binary.BigEndian.PutUint16(ip[4:], 0)
					binary.BigEndian.PutUint16(ip[10:], 0)
					binary.BigEndian.PutUint16(ip[10:], packet.Checksum(ip))
				}
				if !bytes.Equal(out, w) {
					t.Errorf("answer to the client\n got %x\nwant %x", out, w)
				}
			}

			// The flow's packets that fit the route still reach the backend.
			small := in
			small.Payload = []byte("hi")
			if action, _ := runIn(t, tp, p, small.Build()); action != XDPTX {
				t.Errorf("a small packet of the flow: action %s; want XDP_TX to the backend", action)
			}
		})
	}
}

// TestNATVLAN: a nat flow from a client on VLAN 7. Its packets leave for the
// backend untagged, by the route's interface (bpf_fib_lookup's next hop is the
// attached link, not a VLAN on it), as tunnel mode's do; the backend's replies go
// back to the client with the tag its packets came with.
func TestNATVLAN(t *testing.T) {
	tp, p := natRig(t, 1)
	be := tp.Backends[0]
	for i, v6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "v4", true: "v6"}[v6], func(t *testing.T) {
			client, vip, lb, backendIP, l4 := tp.Client.IP4, tp.VIP4, tp.Balancer.IP4, be.IP4, 14+20
			if v6 {
				client, vip, lb, backendIP, l4 = tp.Client.IP6, tp.VIP6, tp.Balancer.IP6, be.IP6, 14+40
			}
			backend := netip.AddrPortFrom(backendIP, 7000)
			svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip, 7000+uint16(i)), TCP}, Forwarding: ForwardNAT,
				Backends: []Backend{{Addr: backend, Weight: 1, Usable: true}}}
			if err := p.AddService(svc); err != nil {
				t.Fatal(err)
			}
			syn := packet.Frame{SrcMAC: tp.Client.MAC, DstMAC: tp.Balancer.MAC, VLAN: 7,
				Src: netip.AddrPortFrom(client, 41000), Dst: svc.Key.VIP, TCPFlags: packet.SYN, Seq: 1000}
			action, out := runIn(t, tp, p, syn.Build())
			if action != XDPTX {
				t.Fatalf("SYN: action %s; want XDP_TX", action)
			}
			natPort := binary.BigEndian.Uint16(out[l4:])
			want := syn
			want.VLAN = 0
			want.SrcMAC, want.DstMAC = tp.Balancer.MAC, be.MAC
			want.Src, want.Dst = netip.AddrPortFrom(lb, natPort), backend
			if w := want.Build(); !bytes.Equal(out, w) {
				t.Errorf("SYN to the backend, untagged\n got %x\nwant %x", out, w)
			}

			reply := packet.Frame{SrcMAC: be.MAC, DstMAC: tp.Balancer.MAC, Src: backend,
				Dst: netip.AddrPortFrom(lb, natPort), TCPFlags: packet.SYN | packet.ACK, Seq: 9000, Ack: 1001}
			action, out = runIn(t, tp, p, reply.Build())
			wantReply := reply
			wantReply.VLAN = 7
			wantReply.SrcMAC, wantReply.DstMAC = tp.Balancer.MAC, tp.Client.MAC
			wantReply.Src, wantReply.Dst = svc.Key.VIP, syn.Src
			if w := wantReply.Build(); action != XDPTX || !bytes.Equal(out, w) {
				t.Errorf("SYN-ACK to the client on VLAN 7: action %s\n got %x\nwant %x", action, out, w)
			}

			// The handshake's ACK establishes the flow, whose replies keep the tag.
			ack := syn
			ack.TCPFlags, ack.Seq, ack.Ack = packet.ACK, 1001, 9001
			if action, out = runIn(t, tp, p, ack.Build()); action != XDPTX || binary.BigEndian.Uint16(out[l4:]) != natPort {
				t.Fatalf("ACK: action %s; want XDP_TX from nat port %d", action, natPort)
			}
			data := reply
			data.TCPFlags, data.Seq, data.Payload = packet.ACK|packet.PSH, 9001, []byte("hello")
			action, out = runIn(t, tp, p, data.Build())
			wantData := wantReply
			wantData.TCPFlags, wantData.Seq, wantData.Payload = data.TCPFlags, data.Seq, data.Payload
			if w := wantData.Build(); action != XDPTX || !bytes.Equal(out, w) {
				t.Errorf("established reply to the client on VLAN 7: action %s\n got %x\nwant %x", action, out, w)
			}
		})
	}
}

// TestNATUDPZeroChecksum: a UDP checksum of zero stays zero when a nat flow's
// datagram is translated, each way and in an ICMP error's quote, in both families.
// Over IPv4 zero means "no checksum"; over IPv6 it is one only a receiver that
// allows it takes (RFC 6936, tunnels over UDP), and an incremental update would make
// it a wrong non-zero checksum that no receiver takes. Expected frames are built
// from scratch with the checksum zeroed.
func TestNATUDPZeroChecksum(t *testing.T) {
	tp, p := natRig(t, 1)
	be := tp.Backends[0]
	for _, v6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "v4", true: "v6"}[v6], func(t *testing.T) {
			client, vip, lb, backendIP, l4 := tp.Client.IP4, tp.VIP4, tp.Balancer.IP4, be.IP4, 14+20
			icmpProto, errType, errCode := uint8(packet.ProtoICMP), uint8(3), uint8(3)
			if v6 {
				client, vip, lb, backendIP, l4 = tp.Client.IP6, tp.VIP6, tp.Balancer.IP6, be.IP6, 14+40
				icmpProto, errType, errCode = packet.ProtoICMPv6, 1, 4
			}
			backend := netip.AddrPortFrom(backendIP, 7100)
			svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip, 7100), UDP}, Forwarding: ForwardNAT,
				Backends: []Backend{{Addr: backend, Weight: 1, Usable: true}}}
			if err := p.AddService(svc); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := p.DeleteService(svc.Key); err != nil {
					t.Error(err)
				}
			})
			// noSum is f's frame with its UDP checksum zeroed, after an Ethernet
			// header of 14 bytes.
			noSum := func(f packet.Frame) []byte {
				b := f.Build()
				binary.BigEndian.PutUint16(b[l4+6:], 0)
				return b
			}
			run := func(what string, in, want []byte) []byte {
				t.Helper()
				action, out := runIn(t, tp, p, in)
				if action != XDPTX {
					t.Fatalf("%s: action %s; want XDP_TX", what, action)
				}
				if want != nil && !bytes.Equal(out, want) {
					t.Fatalf("%s\n got %x\nwant %x", what, out, want)
				}
				return out
			}

			in := packet.Frame{SrcMAC: tp.Client.MAC, DstMAC: tp.Balancer.MAC, Proto: packet.ProtoUDP,
				Src: netip.AddrPortFrom(client, 41000), Dst: svc.Key.VIP, Payload: []byte("hello")}
			out := run("the client's datagram", noSum(in), nil)
			natPort := binary.BigEndian.Uint16(out[l4:])
			fwd := in
			fwd.SrcMAC, fwd.DstMAC = tp.Balancer.MAC, be.MAC
			fwd.Src, fwd.Dst = netip.AddrPortFrom(lb, natPort), backend
			if want := noSum(fwd); !bytes.Equal(out, want) {
				t.Fatalf("the client's datagram\n got %x\nwant %x", out, want)
			}

			reply := packet.Frame{SrcMAC: be.MAC, DstMAC: tp.Balancer.MAC, Proto: packet.ProtoUDP,
				Src: backend, Dst: netip.AddrPortFrom(lb, natPort), Payload: []byte("world!")}
			back := reply
			back.SrcMAC, back.DstMAC = tp.Balancer.MAC, tp.Client.MAC
			back.Src, back.Dst = svc.Key.VIP, netip.AddrPortFrom(client, 41000)
			run("the backend's answer", noSum(reply), noSum(back))

			// The backend's "port unreachable" quotes the datagram as it got it; the
			// client gets it quoting the datagram it sent.
			quote := func(b []byte) []byte { return b[14:] }
			icmpIn := packet.Frame{SrcMAC: be.MAC, DstMAC: tp.Balancer.MAC, Proto: icmpProto,
				Src: netip.AddrPortFrom(backendIP, 0), Dst: netip.AddrPortFrom(lb, 0),
				ICMP: &packet.ICMP{Type: errType, Code: errCode, Quote: quote(noSum(fwd))}}
			icmpOut := packet.Frame{SrcMAC: tp.Balancer.MAC, DstMAC: tp.Client.MAC, Proto: icmpProto,
				Src: netip.AddrPortFrom(vip, 0), Dst: netip.AddrPortFrom(client, 0),
				ICMP: &packet.ICMP{Type: errType, Code: errCode, Quote: quote(noSum(in))}}
			run("the backend's port unreachable", icmpIn.Build(), icmpOut.Build())
		})
	}
}
