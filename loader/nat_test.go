package loader

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
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
			for _, ic := range []struct {
				side       string
				in, want   packet.Frame
				wantAction Action
			}{
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
			} {
				err = nt.Balancer.NS.Do(func() error {
					var err error
					action, out, err = nt.prog.RunOn(ic.in.Build(), nt.Balancer.Index)
					return err
				})
				if err != nil {
					t.Fatal(err)
				}
				if action != XDPTX {
					t.Fatalf("icmp error %s: action %s; want XDP_TX", ic.side, action)
				}
				if w := ic.want.Build(); !bytes.Equal(out, w) {
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
