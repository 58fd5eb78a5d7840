package loader

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/xdptest"
)

var (
	decapHost4 = netip.MustParseAddr("10.78.0.2")
	decapHost6 = netip.MustParseAddr("fd78::2")
	decapLB4   = netip.MustParseAddr("10.78.0.1")
	decapLB6   = netip.MustParseAddr("fd78::1")
)

// loadDecapT loads the decapsulation program for the test's host addresses; t's
// cleanup closes it.
func loadDecapT(t *testing.T) *Decap {
	t.Helper()
	d, err := LoadDecap([]netip.Addr{decapHost4, decapHost6})
	xdptest.Check(t, err)
	t.Cleanup(func() { d.Close() })
	return d
}

// runDecap runs the program once on frame (BPF_PROG_TEST_RUN) and returns its
// verdict and the frame it left.
func runDecap(t *testing.T, d *Decap, frame []byte) (Action, []byte) {
	t.Helper()
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+256)}
	ret, err := d.objs.WeirDecap.Run(&opts)
	if err != nil {
		t.Fatalf("test-run decap program: %v", err)
	}
	return Action(ret), opts.DataOut
}

// tunnelFrame is inner (an IP packet) in an outer header from src to dst, as weir's
// tunnel mode sends it: IPv4 with DF, TTL 64 and its checksum, or IPv6 with hop
// limit 64, in an Ethernet frame to the backend. edit, if not nil, changes the
// outer header (its checksum is computed after) before the frame is built.
func tunnelFrame(src, dst netip.Addr, inner []byte, edit func(outer []byte)) []byte {
	proto := byte(4)
	if inner[0]>>4 == 6 {
		proto = 41
	}
	var outer []byte
	etherType := uint16(0x0800)
	if dst.Is4() {
		outer = make([]byte, 20)
		outer[0] = 0x45
		binary.BigEndian.PutUint16(outer[2:], uint16(20+len(inner)))
		binary.BigEndian.PutUint16(outer[6:], 0x4000)
		outer[8], outer[9] = 64, proto
		s, d := src.As4(), dst.As4()
		copy(outer[12:], s[:])
		copy(outer[16:], d[:])
	} else {
		etherType = 0x86dd
		outer = make([]byte, 40)
		outer[0] = 0x60
		binary.BigEndian.PutUint16(outer[4:], uint16(len(inner)))
		outer[6], outer[7] = proto, 64
		s, d := src.As16(), dst.As16()
		copy(outer[8:], s[:])
		copy(outer[24:], d[:])
	}
	if edit != nil {
		edit(outer)
	}
	if dst.Is4() && outer[0]&0x0f == 5 {
		binary.BigEndian.PutUint16(outer[10:], 0)
		binary.BigEndian.PutUint16(outer[10:], packet.Checksum(outer[:20]))
	}
	return decapEth(etherType, append(outer, inner...))
}

// decapEth is l3 in an Ethernet frame from the balancer's MAC to the backend's.
func decapEth(etherType uint16, l3 []byte) []byte {
	b := append(append([]byte(nil), clientMAC...), lbMAC...)
	b = binary.BigEndian.AppendUint16(b, etherType)
	return append(b, l3...)
}

// decapInner4 and decapInner6 are client packets to a VIP as a tunnel carries them.
func decapInner4() []byte {
	return packet.Frame{Src: netip.AddrPortFrom(client4, 40000), Dst: netip.AddrPortFrom(vip4, 80), TCPFlags: packet.SYN, TTL: 57, Payload: []byte("hello")}.IPPacket()
}

func decapInner6() []byte {
	return packet.Frame{Src: netip.AddrPortFrom(client6, 40000), Dst: netip.AddrPortFrom(vip6, 80), Proto: packet.ProtoUDP, TTL: 9, Payload: []byte("hello")}.IPPacket()
}

// TestDecapFixtures runs tunnel packets, well formed and not, through the
// decapsulation program: a well-formed one to this host leaves as the client's
// packet, byte for byte (TTL and checksums as the balancer sent them); one that is
// not a tunnel packet to us passes untouched; a tunnel packet to us that does not
// hold together is dropped and counted malformed, never passed up cut short or with
// bytes that were not in it.
func TestDecapFixtures(t *testing.T) {
	d := loadDecapT(t)
	in4, in6 := decapInner4(), decapInner6()
	// An ICMP error the balancer sends on to a backend (icmp_to_backend).
	icmpIn := packet.Frame{Src: netip.AddrPortFrom(other4, 0), Dst: netip.AddrPortFrom(vip4, 0), Proto: packet.ProtoICMP,
		ICMP: &packet.ICMP{Type: 3, Code: 4, Rest: 1400, Quote: in4[:28]}}.IPPacket()
	badSum := append([]byte(nil), in4...)
	badSum[10] ^= 0xff
	badIHL := append([]byte(nil), in4...)
	badIHL[0] = 0x44
	padded := func(b []byte) []byte { return append(append([]byte(nil), b...), make([]byte, 6)...) }
	const (
		pass = iota
		decap
		drop
	)
	for _, tc := range []struct {
		name  string
		frame []byte
		want  int
		inner []byte // with decap: the packet that must go up
	}{
		{"v4-in-v4", tunnelFrame(decapLB4, decapHost4, in4, nil), decap, in4},
		{"v6-in-v6", tunnelFrame(decapLB6, decapHost6, in6, nil), decap, in6},
		{"v6-in-v4", tunnelFrame(decapLB4, decapHost4, in6, nil), decap, in6},
		{"v4-in-v6", tunnelFrame(decapLB6, decapHost6, in4, nil), decap, in4},
		{"icmp-error-inside", tunnelFrame(decapLB4, decapHost4, icmpIn, nil), decap, icmpIn},
		// The inner header is the kernel's to judge, as after its own tunnel.
		{"inner-v4-bad-checksum", tunnelFrame(decapLB4, decapHost4, badSum, nil), decap, badSum},
		{"inner-v4-bad-ihl", tunnelFrame(decapLB4, decapHost4, badIHL, nil), decap, badIHL},
		// Ethernet padding after the outer packet is no part of it.
		{"v4-padded", padded(tunnelFrame(decapLB4, decapHost4, in4, nil)), decap, padded(in4)},

		{"not-our-address-v4", tunnelFrame(decapLB4, other4, in4, nil), pass, nil},
		{"not-our-address-v6", tunnelFrame(decapLB6, decapLB6, in6, nil), pass, nil},
		{"plain-packet-to-us", packet.Frame{Src: netip.AddrPortFrom(client4, 1), Dst: netip.AddrPortFrom(decapHost4, 80)}.Build(), pass, nil},
		{"outer-v4-options", decapV4Options(in4), pass, nil},
		{"outer-v4-ihl-4", tunnelFrame(decapLB4, decapHost4, in4, func(o []byte) { o[0] = 0x44 }), pass, nil},
		{"outer-v4-first-fragment", tunnelFrame(decapLB4, decapHost4, in4, func(o []byte) {
			binary.BigEndian.PutUint16(o[6:], 0x2000)
		}), pass, nil},
		{"outer-v4-later-fragment", tunnelFrame(decapLB4, decapHost4, in4, func(o []byte) {
			binary.BigEndian.PutUint16(o[6:], 0x0004)
		}), pass, nil},
		{"outer-v6-fragment-header", decapV6Ext(in6, packet.ProtoFrag), pass, nil},
		{"outer-v6-dstopts", decapV6Ext(in6, packet.ProtoDstOpts), pass, nil},
		{"vlan-tagged", decapVLAN(tunnelFrame(decapLB4, decapHost4, in4, nil)), pass, nil},

		{"outer-v4-bad-checksum", decapBreakSum(tunnelFrame(decapLB4, decapHost4, in4, nil)), drop, nil},
		{"outer-v4-version-6", tunnelFrame(decapLB4, decapHost4, in4, func(o []byte) { o[0] = 0x65 }), drop, nil},
		{"outer-v6-version-4", tunnelFrame(decapLB6, decapHost6, in6, func(o []byte) { o[0] = 0x40 }), drop, nil},
		{"outer-v4-length-past-frame", tunnelFrame(decapLB4, decapHost4, in4, func(o []byte) {
			binary.BigEndian.PutUint16(o[2:], uint16(20+len(in4)+1))
		}), drop, nil},
		{"outer-v4-length-below-header", tunnelFrame(decapLB4, decapHost4, in4, func(o []byte) {
			binary.BigEndian.PutUint16(o[2:], 19)
		}), drop, nil},
		{"outer-v6-length-past-frame", tunnelFrame(decapLB6, decapHost6, in6, func(o []byte) {
			binary.BigEndian.PutUint16(o[4:], uint16(len(in6)+1))
		}), drop, nil},
		{"outer-v6-jumbo-length", tunnelFrame(decapLB6, decapHost6, in6, func(o []byte) {
			binary.BigEndian.PutUint16(o[4:], 0)
		}), drop, nil},
		// The outer packet ends before the inner one does: the rest of the frame is
		// not the tunnel's to hand up.
		{"outer-v4-shorter-than-inner", tunnelFrame(decapLB4, decapHost4, in4, func(o []byte) {
			binary.BigEndian.PutUint16(o[2:], uint16(20+len(in4)-3))
		}), drop, nil},
		{"outer-v6-shorter-than-inner", tunnelFrame(decapLB6, decapHost6, in6, func(o []byte) {
			binary.BigEndian.PutUint16(o[4:], uint16(len(in6)-3))
		}), drop, nil},
		// Padded: the frame holds as many bytes as the inner packet claims.
		{"inner-v4-longer-than-outer-payload", padded(tunnelFrame(decapLB4, decapHost4, decapSetLen(in4, len(in4)+6), nil)), drop, nil},
		{"inner-v4-shorter-than-outer-payload", tunnelFrame(decapLB4, decapHost4, decapSetLen(in4, len(in4)-2), nil), drop, nil},
		{"inner-v6-longer-than-outer-payload", padded(tunnelFrame(decapLB6, decapHost6, decapSetLen(in6, len(in6)+6), nil)), drop, nil},
		{"inner-v4-cut-short", tunnelFrame(decapLB4, decapHost4, in4, nil)[:14+20+12], drop, nil},
		// The outer packet ends inside the inner IPv4 header, whose length says so:
		// the rest of that header is the frame's padding, not the tunnel's.
		{"inner-v4-header-past-outer-packet", tunnelFrame(decapLB4, decapHost4, decapSetLen(in4, 12), func(o []byte) {
			binary.BigEndian.PutUint16(o[2:], 20+12)
		}), drop, nil},
		{"inner-v4-zero-length-in-v6-jumbo-length", tunnelFrame(decapLB6, decapHost6, decapSetLen(in4, 0), func(o []byte) {
			binary.BigEndian.PutUint16(o[4:], 0)
		}), drop, nil},
		{"inner-v6-cut-short", tunnelFrame(decapLB6, decapHost6, in6, nil)[:14+40+30], drop, nil},
		{"ipip-carrying-v6", tunnelFrame(decapLB4, decapHost4, in6, func(o []byte) { o[9] = 4 }), drop, nil},
		{"ipv6-proto-carrying-v4", tunnelFrame(decapLB6, decapHost6, in4, func(o []byte) { o[6] = 41 }), drop, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, err := d.Stats()
			if err != nil {
				t.Fatal(err)
			}
			action, out := runDecap(t, d, tc.frame)
			after, err := d.Stats()
			if err != nil {
				t.Fatal(err)
			}
			var want []byte
			wantAction, counted, what := XDPPass, after.NotOurs.Packets-before.NotOurs.Packets, "not ours"
			switch tc.want {
			case pass:
				want = tc.frame
			case decap:
				etherType := uint16(0x0800)
				if tc.inner[0]>>4 == 6 {
					etherType = 0x86dd
				}
				want = decapEth(etherType, tc.inner)
				counted, what = after.Decapsulated.Packets-before.Decapsulated.Packets, "decapsulated"
			case drop:
				wantAction = XDPDrop
				counted, what = after.Malformed.Packets-before.Malformed.Packets, "malformed"
			}
			if action != wantAction {
				t.Fatalf("got %v; want %v", action, wantAction)
			}
			if counted != 1 {
				t.Errorf("counted %s %d times; want once", what, counted)
			}
			if want != nil && !bytes.Equal(out, want) {
				t.Errorf("got frame\n%x\nwant\n%x", out, want)
			}
		})
	}
}

// decapV6Ext is in6 in an IP6IP6 packet to this host whose outer header has an
// 8-byte extension header of type ext before it.
func decapV6Ext(in6 []byte, ext uint8) []byte {
	b := tunnelFrame(decapLB6, decapHost6, in6, nil)
	l3 := append([]byte(nil), b[14:14+40]...)
	e := make([]byte, 8)
	e[0] = l3[6]
	l3[6] = ext
	binary.BigEndian.PutUint16(l3[4:], uint16(8+len(in6)))
	return decapEth(0x86dd, append(append(l3, e...), in6...))
}

// decapV4Options is in4 in an IPIP packet to this host whose outer header carries 4
// bytes of options (NOPs).
func decapV4Options(in4 []byte) []byte {
	b := tunnelFrame(decapLB4, decapHost4, in4, nil)
	l3 := append(append([]byte(nil), b[14:14+20]...), 1, 1, 1, 1)
	l3[0] = 0x46
	binary.BigEndian.PutUint16(l3[2:], uint16(24+len(in4)))
	binary.BigEndian.PutUint16(l3[10:], 0)
	binary.BigEndian.PutUint16(l3[10:], packet.Checksum(l3))
	return decapEth(0x0800, append(l3, in4...))
}

// decapVLAN puts an 802.1Q tag (VLAN 7) into frame.
func decapVLAN(frame []byte) []byte {
	b := append([]byte(nil), frame[:12]...)
	b = append(b, 0x81, 0x00, 0x00, 0x07)
	return append(b, frame[12:]...)
}

// decapBreakSum flips the outer IPv4 header's checksum.
func decapBreakSum(frame []byte) []byte {
	frame[14+10] ^= 0x5a
	return frame
}

// decapSetLen makes an inner IP packet claim n bytes, its IPv4 checksum made right
// again; its bytes stay as they were.
func decapSetLen(ip []byte, n int) []byte {
	b := append([]byte(nil), ip...)
	if b[0]>>4 == 4 {
		binary.BigEndian.PutUint16(b[2:], uint16(n))
		binary.BigEndian.PutUint16(b[10:], 0)
		binary.BigEndian.PutUint16(b[10:], packet.Checksum(b[:20]))
		return b
	}
	binary.BigEndian.PutUint16(b[4:], uint16(n-40))
	return b
}

// TestDecapSources: with the balancers' prefixes given, a tunnel packet from one of
// them is decapsulated and one from anywhere else is dropped and counted foreign;
// given none again, any source is decapsulated.
func TestDecapSources(t *testing.T) {
	spec, err := bpf.LoadDecap()
	if err != nil {
		t.Fatal(err)
	}
	if m := spec.Maps[bpf.DecapMapDecapSources]; uintptr(m.KeySize) != unsafe.Sizeof(bpf.DecapDecapSource{}) {
		t.Errorf("decap_sources: C key size %d; Go %d", m.KeySize, unsafe.Sizeof(bpf.DecapDecapSource{}))
	}
	d := loadDecapT(t)
	in4, in6 := decapInner4(), decapInner6()
	fromLB4 := tunnelFrame(decapLB4, decapHost4, in4, nil)
	fromLB6 := tunnelFrame(decapLB6, decapHost6, in6, nil)
	// Next to the balancers' prefixes, in the trie's other family and beyond their bits.
	near4 := tunnelFrame(netip.MustParseAddr("10.78.1.1"), decapHost4, in4, nil)
	near6 := tunnelFrame(netip.MustParseAddr("fd78::1:1"), decapHost6, in6, nil)
	check := func(t *testing.T, frame []byte, want Action, foreign uint64) {
		t.Helper()
		before, err := d.Stats()
		if err != nil {
			t.Fatal(err)
		}
		action, _ := runDecap(t, d, frame)
		after, err := d.Stats()
		if err != nil {
			t.Fatal(err)
		}
		if action != want {
			t.Errorf("got %v; want %v", action, want)
		}
		if n := after.Foreign.Packets - before.Foreign.Packets; n != foreign {
			t.Errorf("counted %d foreign; want %d", n, foreign)
		}
	}
	t.Run("any", func(t *testing.T) {
		for _, f := range [][]byte{fromLB4, fromLB6, near4, near6} {
			check(t, f, XDPPass, 0)
		}
	})
	t.Run("balancers", func(t *testing.T) {
		if err := d.SetSources([]netip.Prefix{netip.MustParsePrefix("10.78.0.0/24"), netip.PrefixFrom(decapLB6, 128)}); err != nil {
			t.Fatal(err)
		}
		check(t, fromLB4, XDPPass, 0)
		check(t, fromLB6, XDPPass, 0)
		check(t, near4, XDPDrop, 1)
		check(t, near6, XDPDrop, 1)
		// An IPv4 balancer's prefix does not let in an IPv6 source whose first
		// bits are the same, nor the other way round.
		check(t, tunnelFrame(netip.MustParseAddr("a4e:3::1"), decapHost6, in6, nil), XDPDrop, 1)
		// Not a tunnel packet to us: not the allow-list's to judge.
		check(t, tunnelFrame(other4, other4, in4, nil), XDPPass, 0)
	})
	t.Run("only-ipv4-balancers", func(t *testing.T) {
		if err := d.SetSources([]netip.Prefix{netip.PrefixFrom(decapLB4, 32)}); err != nil {
			t.Fatal(err)
		}
		check(t, fromLB4, XDPPass, 0)
		check(t, fromLB6, XDPDrop, 1)
	})
	t.Run("any-again", func(t *testing.T) {
		if err := d.SetSources(nil); err != nil {
			t.Fatal(err)
		}
		for _, f := range [][]byte{fromLB4, fromLB6, near4, near6} {
			check(t, f, XDPPass, 0)
		}
	})
	if err := d.SetSources([]netip.Prefix{netip.MustParsePrefix("::ffff:10.78.0.1/128")}); err == nil {
		t.Errorf("SetSources took an IPv4-mapped IPv6 prefix; want an error")
	}
}

// TestDecapSourcesReplace: SetSources takes as many prefixes as decap_sources holds,
// whatever list was in force before (any source, too); a list it refuses — too long,
// or with a prefix that is not one — changes nothing, and the map holds exactly the
// list in force after each call, so no refused or replaced prefix still lets packets
// in.
func TestDecapSourcesReplace(t *testing.T) {
	d := loadDecapT(t)
	in4 := decapInner4()
	capacity := int(d.objs.DecapSources.MaxEntries())
	host := func(i int) netip.Prefix {
		return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 79, byte(i >> 8), byte(i)}), 32)
	}
	list := func(n int) []netip.Prefix {
		var l []netip.Prefix
		for i := range n {
			l = append(l, host(i))
		}
		return l
	}
	from := func(t *testing.T, p netip.Prefix, want Action) {
		t.Helper()
		if got, _ := runDecap(t, d, tunnelFrame(p.Addr(), decapHost4, in4, nil)); got != want {
			t.Errorf("tunnel packet from %s: got %v; want %v", p.Addr(), got, want)
		}
	}
	entries := func(t *testing.T, want int) {
		t.Helper()
		var key bpf.DecapDecapSource
		var value uint8
		n := 0
		for it := d.objs.DecapSources.Iterate(); it.Next(&key, &value); {
			n++
		}
		if n != want {
			t.Errorf("decap_sources holds %d prefixes; want %d", n, want)
		}
	}

	// From any source (two prefixes) straight to a full list.
	if err := d.SetSources(list(capacity)); err != nil {
		t.Fatalf("SetSources(%d prefixes) after any source: %v", capacity, err)
	}
	entries(t, capacity)
	from(t, host(capacity-1), XDPPass)
	from(t, host(capacity), XDPDrop)

	// One too many: refused, the list before stays whole.
	if err := d.SetSources(list(capacity + 1)); err == nil {
		t.Errorf("SetSources took %d prefixes; want an error", capacity+1)
	}
	entries(t, capacity)
	from(t, host(capacity), XDPDrop)

	// A list with a bad prefix after a good one: refused, the good one not let in.
	newcomer := netip.MustParsePrefix("10.79.200.0/24")
	if err := d.SetSources([]netip.Prefix{newcomer, {}}); err == nil {
		t.Errorf("SetSources took an invalid prefix; want an error")
	}
	entries(t, capacity)
	from(t, newcomer, XDPDrop)
	from(t, host(0), XDPPass)

	// A full list to another full list with no prefix in common.
	other := make([]netip.Prefix, capacity)
	for i := range other {
		other[i] = host(capacity + i)
	}
	if err := d.SetSources(other); err != nil {
		t.Fatalf("SetSources(another %d prefixes): %v", capacity, err)
	}
	entries(t, capacity)
	from(t, host(0), XDPDrop)
	from(t, host(2*capacity-1), XDPPass)

	if err := d.SetSources(nil); err != nil {
		t.Fatal(err)
	}
	entries(t, 2)
}
