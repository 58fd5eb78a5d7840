package loader

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"
	"unsafe"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/balance"
)

const testSeed = 0x5eed

var (
	clientMAC = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x01}
	lbMAC     = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x02}
	vip4      = netip.MustParseAddr("10.77.100.1")
	vip6      = netip.MustParseAddr("fd77:100::1")
	client4   = netip.MustParseAddr("10.77.0.1")
	client6   = netip.MustParseAddr("fd77::1")
	other4    = netip.MustParseAddr("10.77.0.99")
)

func backendMAC(i int) net.HardwareAddr { return net.HardwareAddr{0x02, 0, 0, 0, 1, byte(i)} }

// testBackends returns n usable backends of weight 1 on the VIP's port (dsr).
func testBackends(n int, v6 bool, port uint16) []Backend {
	out := make([]Backend, n)
	for i := range out {
		a := netip.AddrFrom4([4]byte{10, 77, 0, byte(11 + i)})
		if v6 {
			a = netip.MustParseAddr(fmt.Sprintf("fd77::%x", 0x11+i))
		}
		out[i] = Backend{Addr: netip.AddrPortFrom(a, port), MAC: backendMAC(i), Weight: 1, Usable: true}
	}
	return out
}

func loadT(t testing.TB) *Program {
	t.Helper()
	p, err := Load(Options{HashSeed: testSeed, ConntrackSize: 4096})
	xdptest.Check(t, err)
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return p
}

// wantBackend predicts, from the Go hash and table builder, which backend the
// program must pick for a new flow.
func wantBackend(t *testing.T, s Service, f Flow) Backend {
	t.Helper()
	table := testTable(t, s, testSeed)
	k := flowKey(f)
	h := flowHash(&k, testSeed, s.SourceHash)
	return s.Backends[table[h%uint32(len(table))]]
}

// testTable builds the Maglev table the loader builds for s with seed, its entries
// indexes into s.Backends.
func testTable(t *testing.T, s Service, seed uint64) []uint32 {
	t.Helper()
	members := make([]balance.Backend, len(s.Backends))
	for i, b := range s.Backends {
		members[i] = balance.Backend{ID: b.Addr.String(), Weight: b.Weight, Usable: b.Usable}
	}
	size := s.TableSize
	if size == 0 {
		size = balance.MaglevSize(len(s.Backends))
	}
	table, err := balance.BuildMaglev(members, size, seed)
	if err != nil {
		t.Fatalf("build table: %v", err)
	}
	return table
}

// dsrOut is what dsr must make of a frame: source MAC ours, destination the backend's.
func dsrOut(in []byte, to net.HardwareAddr) []byte {
	out := bytes.Clone(in)
	copy(out[6:12], in[0:6])
	copy(out[0:6], to)
	return out
}

func TestStructSizesMatchC(t *testing.T) {
	spec, err := bpf.LoadWeir()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		mapName string
		key     uintptr
		value   uintptr
	}{
		{bpf.WeirMapServices, unsafe.Sizeof(bpf.WeirVipKey{}), unsafe.Sizeof(bpf.WeirService{})},
		{bpf.WeirMapBackends, 4, unsafe.Sizeof(bpf.WeirBackend{})},
		{bpf.WeirMapLbConntrack4, unsafe.Sizeof(bpf.WeirFlowKey4{}), unsafe.Sizeof(bpf.WeirLbFlow{})},
		{bpf.WeirMapLbConntrack6, unsafe.Sizeof(bpf.WeirFlowKey{}), unsafe.Sizeof(bpf.WeirLbFlow{})},
		{bpf.WeirMapLbHalfOpen4, unsafe.Sizeof(bpf.WeirFlowKey4{}), unsafe.Sizeof(bpf.WeirLbFlow{})},
		{bpf.WeirMapNatConntrack4, unsafe.Sizeof(bpf.WeirFlowKey4{}), unsafe.Sizeof(bpf.WeirNatFlow{})},
		{bpf.WeirMapNatHalfOpen6, unsafe.Sizeof(bpf.WeirFlowKey{}), unsafe.Sizeof(bpf.WeirNatFlow{})},
		{bpf.WeirMapServiceStats, 4, unsafe.Sizeof(bpf.WeirCounter{})},
		{bpf.WeirMapGlobalStats, 4, unsafe.Sizeof(bpf.WeirCounter{})},
		{bpf.WeirMapNatReverse4, unsafe.Sizeof(bpf.WeirFlowKey4{}), unsafe.Sizeof(bpf.WeirNatEntry{})},
		{bpf.WeirMapNatHalfReverse6, unsafe.Sizeof(bpf.WeirFlowKey{}), unsafe.Sizeof(bpf.WeirNatEntry{})},
		{bpf.WeirMapBackendFlows, 4, unsafe.Sizeof(bpf.WeirFlowCount{})},
	} {
		m := spec.Maps[tc.mapName]
		if uintptr(m.KeySize) != tc.key || uintptr(m.ValueSize) != tc.value {
			t.Errorf("map %s: C key/value sizes %d/%d; Go %d/%d", tc.mapName, m.KeySize, m.ValueSize, tc.key, tc.value)
		}
	}
	// The flow entries' sizes, as docs/datapath.md states them.
	for _, c := range []struct {
		what      string
		got, want uintptr
	}{
		{"flow_key4", unsafe.Sizeof(bpf.WeirFlowKey4{}), 16},
		{"flow_key", unsafe.Sizeof(bpf.WeirFlowKey{}), 40},
		{"lb_flow", unsafe.Sizeof(bpf.WeirLbFlow{}), 8},
		{"nat_flow", unsafe.Sizeof(bpf.WeirNatFlow{}), 16},
		{"nat_entry", unsafe.Sizeof(bpf.WeirNatEntry{}), 64},
		{"nat_client", unsafe.Sizeof(bpf.WeirNatClient{}), 40}, // a flow_key, its padding the VLAN tag
	} {
		if c.got != c.want {
			t.Errorf("%s is %d bytes; want %d", c.what, c.got, c.want)
		}
	}
	decap, err := bpf.LoadDecap()
	if err != nil {
		t.Fatal(err)
	}
	if m := decap.Maps[bpf.DecapMapDecapAddrs]; uintptr(m.KeySize) != unsafe.Sizeof(bpf.DecapDecapKey{}) {
		t.Errorf("decap_addrs: C key size %d; Go %d", m.KeySize, unsafe.Sizeof(bpf.DecapDecapKey{}))
	}
	if m := decap.Maps[bpf.DecapMapDecapStats]; uintptr(m.ValueSize) != unsafe.Sizeof(bpf.DecapDecapCounter{}) {
		t.Errorf("decap_stats: C value size %d; Go %d", m.ValueSize, unsafe.Sizeof(bpf.DecapDecapCounter{}))
	}
	// Room for reasons to come (STAT_SLOTS), so pinned maps stay compatible.
	if n := spec.Maps[bpf.WeirMapGlobalStats].MaxEntries; n != 64 || n < uint32(reasonMax) || len(reasonNames) != int(reasonMax) {
		t.Errorf("global_stats has %d entries, reasonMax %d, %d names; want 64 entries and a name per reason", n, reasonMax, len(reasonNames))
	}
}

func TestFixtures(t *testing.T) {
	p := loadT(t)
	svc4 := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(3, false, 80)}
	svc6 := Service{Key: ServiceKey{netip.AddrPortFrom(vip6, 80), TCP}, Backends: testBackends(3, true, 80)}
	udp4 := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 53), UDP}, Backends: testBackends(3, false, 53)}
	for _, s := range []Service{svc4, svc6, udp4} {
		if err := p.AddService(s); err != nil {
			t.Fatal(err)
		}
	}

	tcp4 := func(sport uint16, flags uint8) packet.Frame {
		return packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC,
			Src: netip.AddrPortFrom(client4, sport), Dst: netip.AddrPortFrom(vip4, 80), TCPFlags: flags}
	}
	tcp6 := func(sport uint16, flags uint8) packet.Frame {
		return packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC,
			Src: netip.AddrPortFrom(client6, sport), Dst: netip.AddrPortFrom(vip6, 80), TCPFlags: flags}
	}
	flowOf := func(f packet.Frame) Flow {
		proto := TCP
		if f.Proto == packet.ProtoUDP {
			proto = UDP
		}
		return Flow{Src: f.Src, Dst: f.Dst, Protocol: proto}
	}
	udp4Frame := func(sport uint16, payload []byte) packet.Frame {
		return packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Proto: packet.ProtoUDP,
			Src: netip.AddrPortFrom(client4, sport), Dst: netip.AddrPortFrom(vip4, 53), Payload: payload}
	}
	with := func(f packet.Frame, change func(*packet.Frame)) packet.Frame { change(&f); return f }

	type fixture struct {
		name       string
		in         []byte
		wantAction Action
		wantOut    []byte // nil: the frame unchanged
		wantReason Reason
	}
	dsr := func(name string, s Service, f packet.Frame) fixture {
		in := f.Build()
		return fixture{name, in, XDPTX, dsrOut(in, wantBackend(t, s, flowOf(f)).MAC), ReasonTX}
	}
	pass := func(name string, in []byte, r Reason) fixture { return fixture{name, in, XDPPass, nil, r} }
	// icmpQuoting is a router's ICMP error (code: fragmentation needed 4, port
	// unreachable 3; ICMPv6 sends packet too big) about answer, sent to its source.
	icmpQuoting := func(answer packet.Frame, code uint8) packet.Frame {
		icmp := &packet.ICMP{Type: 3, Code: code, Rest: 1400, Quote: answer.IPPacket()}
		proto, router := uint8(packet.ProtoICMP), netip.MustParseAddr("10.99.0.1")
		if answer.Src.Addr().Is6() {
			icmp.Type, icmp.Code, proto, router = 2, 0, packet.ProtoICMPv6, netip.MustParseAddr("fd99::1")
		}
		return packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Proto: proto, ICMP: icmp,
			Src: netip.AddrPortFrom(router, 0), Dst: netip.AddrPortFrom(answer.Src.Addr(), 0)}
	}
	// icmpAbout is one about the answer to f, which the backend sent from the VIP.
	icmpAbout := func(f packet.Frame, code uint8) packet.Frame {
		return icmpQuoting(packet.Frame{Proto: f.Proto, Src: f.Dst, Dst: f.Src, TCPFlags: packet.ACK}, code)
	}
	// icmpFixture: err, about the answer to f, goes to f's backend unchanged.
	icmpFixture := func(name string, s Service, f, err packet.Frame) fixture {
		in := err.Build()
		return fixture{name, in, XDPTX, dsrOut(in, wantBackend(t, s, flowOf(f)).MAC), ReasonICMPToBackend}
	}
	icmpToBackend := func(name string, s Service, f packet.Frame, code uint8) fixture {
		return icmpFixture(name, s, f, icmpAbout(f, code))
	}
	// udpAnswer is the udp service's answer to the client's port sport, or a fragment
	// of it (offset in 8-byte units).
	udpAnswer := func(sport, offset uint16, more bool) packet.Frame {
		return packet.Frame{Proto: packet.ProtoUDP, Src: netip.AddrPortFrom(vip4, 53), Dst: netip.AddrPortFrom(client4, sport),
			FragOffset: offset, MoreFrags: more, Payload: make([]byte, 64)}
	}
	// flipLast flips a bit of frame's last byte: for an ICMP error, of its quote.
	flipLast := func(frame []byte) []byte {
		frame[len(frame)-1] ^= 0x40
		return frame
	}
	// cutIP sets the IP packet's length in frame to n bytes (its header's own
	// included for IPv4, not for IPv6), leaving the bytes after it in the frame.
	cutIP := func(frame []byte, n uint16) []byte {
		if frame[12] == 0x08 && frame[13] == 0x00 {
			binary.BigEndian.PutUint16(frame[14+2:], n)
			binary.BigEndian.PutUint16(frame[14+10:], 0)
			binary.BigEndian.PutUint16(frame[14+10:], packet.Checksum(frame[14:14+20]))
		} else {
			binary.BigEndian.PutUint16(frame[14+4:], n)
		}
		return frame
	}
	drop := func(name string, in []byte, r Reason) fixture { return fixture{name, in, XDPDrop, nil, r} }

	fixtures := []fixture{
		dsr("tcp syn v4", svc4, tcp4(40000, packet.SYN)),
		dsr("tcp syn v4 again", svc4, tcp4(40000, packet.SYN)),
		dsr("tcp ack v4 of known flow", svc4, tcp4(40000, packet.ACK)),
		dsr("tcp syn v6", svc6, tcp6(40001, packet.SYN)),
		dsr("tcp ack v6", svc6, tcp6(40001, packet.ACK|packet.PSH)),
		dsr("udp v4", udp4, packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Proto: packet.ProtoUDP,
			Src: netip.AddrPortFrom(client4, 5353), Dst: netip.AddrPortFrom(vip4, 53), Payload: []byte("query")}),
		dsr("vlan tagged v4", svc4, with(tcp4(40002, packet.SYN), func(f *packet.Frame) { f.VLAN = 7 })),
		dsr("ipv4 with options", svc4, with(tcp4(40003, packet.SYN), func(f *packet.Frame) { f.IPv4Options = []byte{1, 1, 1, 0} })),
		dsr("ipv6 hop-by-hop and dest options", svc6, with(tcp6(40004, packet.SYN), func(f *packet.Frame) {
			f.IPv6ExtHeaders = []uint8{packet.ProtoHopOpts, packet.ProtoDstOpts}
		})),
		pass("non-vip v4", with(tcp4(40005, packet.SYN), func(f *packet.Frame) { f.Dst = netip.AddrPortFrom(other4, 80) }).Build(), ReasonPassNotService),
		pass("vip wrong port", with(tcp4(40006, packet.SYN), func(f *packet.Frame) { f.Dst = netip.AddrPortFrom(vip4, 81) }).Build(), ReasonPassNotService),
		pass("vip wrong protocol", with(tcp4(40007, 0), func(f *packet.Frame) { f.Proto = packet.ProtoUDP }).Build(), ReasonPassNotService),
		pass("icmp to vip", with(tcp4(0, 0), func(f *packet.Frame) { f.Proto = packet.ProtoICMP; f.Payload = make([]byte, 8) }).Build(), ReasonPassNotService),
		// A frame to a group MAC (broadcast, multicast) was not sent to this host
		// alone, and its destination is no source MAC to send from.
		pass("tcp to vip in a broadcast frame", with(tcp4(40029, packet.SYN), func(f *packet.Frame) {
			f.DstMAC = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
		}).Build(), ReasonPassL2Group),
		pass("tcp to vip in a multicast frame, vlan tagged", with(tcp6(40030, packet.SYN), func(f *packet.Frame) {
			f.DstMAC, f.VLAN = net.HardwareAddr{0x33, 0x33, 0, 0, 0, 1}, 7
		}).Build(), ReasonPassL2Group),
		pass("arp", append(append(append([]byte{}, lbMAC...), clientMAC...), append([]byte{0x08, 0x06}, make([]byte, 28)...)...), ReasonPassNotIP),
		// BPF_PROG_TEST_RUN refuses frames shorter than an Ethernet header (as no NIC
		// delivers them), so the shortest frames tried are a bare header and a cut tag.
		pass("ethernet header only", tcp4(40019, packet.SYN).Build()[:14], ReasonPassMalformedL3),
		pass("truncated vlan tag", with(tcp4(40020, packet.SYN), func(f *packet.Frame) { f.VLAN = 7 }).Build()[:16], ReasonPassNotIP),
		pass("truncated ipv4 header", tcp4(40008, packet.SYN).Build()[:14+12], ReasonPassMalformedL3),
		pass("ipv4 total length past the frame", func() []byte {
			b := tcp4(40009, packet.SYN).Build()
			b[14+3] += 40
			return b
		}(), ReasonPassMalformedL3),
		pass("ipv4 ihl below 5", func() []byte {
			b := tcp4(40010, packet.SYN).Build()
			b[14] = 0x44
			return b
		}(), ReasonPassMalformedL3),
		drop("truncated tcp to vip", func() []byte {
			b := tcp4(40011, packet.SYN).Build()[:14+20+10]
			b[14+3] = 30 // keep the IPv4 length consistent with what is there
			return b
		}(), ReasonDropMalformedL4),
		drop("tcp header only in the ethernet padding", func() []byte {
			b := tcp4(40021, packet.SYN).Build()
			b[14+3] = 24 // the IP packet ends 4 bytes into the TCP header
			binary.BigEndian.PutUint16(b[14+10:], 0)
			binary.BigEndian.PutUint16(b[14+10:], packet.Checksum(b[14:34]))
			return b
		}(), ReasonDropMalformedL4),
		drop("tcp data offset past the packet to vip", func() []byte {
			b := tcp4(40022, packet.SYN).Build()
			b[14+20+12] = 15 << 4 // 60 bytes of header in a 20-byte segment
			return b
		}(), ReasonDropMalformedL4),
		drop("tcp data offset below 5 to vip", func() []byte {
			b := tcp4(40023, packet.SYN).Build()
			b[14+20+12] = 2 << 4
			return b
		}(), ReasonDropMalformedL4),
		drop("tcp data offset past the packet v6 to vip", func() []byte {
			b := with(tcp6(40024, packet.SYN), func(f *packet.Frame) { f.Payload = []byte("abcd") }).Build()
			b[14+40+12] = 7 << 4 // 28 bytes of header in a 24-byte segment
			return b
		}(), ReasonDropMalformedL4),
		drop("tcp data offset into the ethernet padding to vip", func() []byte {
			b := append(tcp4(40025, packet.SYN).Build(), make([]byte, 8)...)
			b[14+20+12] = 6 << 4 // the options would be the padding
			return b
		}(), ReasonDropMalformedL4),
		pass("tcp data offset past the packet not to vip", func() []byte {
			b := with(tcp4(40026, packet.SYN), func(f *packet.Frame) { f.Dst = netip.AddrPortFrom(other4, 80) }).Build()
			b[14+20+12] = 15 << 4
			return b
		}(), ReasonPassNotVIPL4),
		drop("udp length below 8 to vip", func() []byte {
			b := udp4Frame(5354, []byte("query")).Build()
			binary.BigEndian.PutUint16(b[14+20+4:], 4)
			return b
		}(), ReasonDropMalformedL4),
		drop("udp length past the packet to vip", func() []byte {
			b := udp4Frame(5355, []byte("query")).Build()
			binary.BigEndian.PutUint16(b[14+20+4:], 8+5+1)
			return b
		}(), ReasonDropMalformedL4),
		func() fixture {
			// Shorter than the IP payload is a datagram with trailing bytes, which
			// the backend's stack trims.
			f := udp4Frame(5356, []byte("query"))
			in := f.Build()
			binary.BigEndian.PutUint16(in[14+20+4:], 8+2)
			return fixture{"udp length short of the ip payload", in, XDPTX, dsrOut(in, wantBackend(t, udp4, flowOf(f)).MAC), ReasonTX}
		}(),
		pass("truncated tcp not to vip", func() []byte {
			b := with(tcp4(40012, packet.SYN), func(f *packet.Frame) { f.Dst = netip.AddrPortFrom(other4, 80) }).Build()[:14+20+10]
			b[14+3] = 30
			return b
		}(), ReasonPassNotVIPL4),
		drop("ipv4 first fragment to vip", with(tcp4(40013, packet.SYN), func(f *packet.Frame) { f.MoreFrags = true }).Build(), ReasonDropFragment),
		drop("ipv4 later fragment to vip", with(tcp4(40014, packet.SYN), func(f *packet.Frame) { f.FragOffset = 185 }).Build(), ReasonDropFragment),
		pass("ipv4 fragment not to vip", with(tcp4(40015, packet.SYN), func(f *packet.Frame) {
			f.MoreFrags = true
			f.Dst = netip.AddrPortFrom(other4, 80)
		}).Build(), ReasonPassNotVIPL4),
		drop("ipv6 fragment header to vip", with(tcp6(40016, packet.SYN), func(f *packet.Frame) { f.IPv6ExtHeaders = []uint8{packet.ProtoFrag} }).Build(), ReasonDropFragment),
		drop("ipv6 five option headers to vip", with(tcp6(40017, packet.SYN), func(f *packet.Frame) {
			f.IPv6ExtHeaders = []uint8{packet.ProtoHopOpts, packet.ProtoDstOpts, packet.ProtoRouting, packet.ProtoDstOpts, packet.ProtoDstOpts}
		}).Build(), ReasonDropIPv6Extension),
		pass("truncated ipv6 header", tcp6(40018, packet.SYN).Build()[:14+30], ReasonPassMalformedL3),
		// A routing header with segments left makes the VIP a waypoint, not the
		// packet's destination (nor the one its TCP checksum covers, RFC 8200 8.1).
		// One whose segments are all visited is walked past like any other.
		dsr("ipv6 routing header, no segments left", svc6, with(tcp6(40027, packet.SYN), func(f *packet.Frame) {
			f.IPv6ExtHeaders = []uint8{packet.ProtoRouting}
		})),
		drop("ipv6 routing header with segments left to vip", func() []byte {
			b := with(tcp6(40028, packet.SYN), func(f *packet.Frame) {
				f.IPv6ExtHeaders = []uint8{packet.ProtoDstOpts, packet.ProtoRouting}
			}).Build()
			b[14+40+8+2], b[14+40+8+3] = 4, 1 // a segment routing header, one segment left
			return b
		}(), ReasonDropIPv6Extension),
		// A router on the way back to the client could not pass on the backend's
		// answer (VIP -> client): its error, to the VIP, goes to the flow's backend
		// as it came, so the backend's socket lowers its path MTU.
		icmpToBackend("icmp frag needed about a dsr flow's answer", svc4, tcp4(40000, packet.ACK), 4),
		icmpToBackend("icmpv6 packet too big about a dsr flow's answer", svc6, tcp6(40001, packet.ACK), 0),
		icmpToBackend("icmp port unreachable about a dsr udp flow's answer", udp4, udp4Frame(5353, nil), 3),
		// An error whose ICMP checksum fails is dropped, never sent on; one about no
		// service's answer is the kernel's to judge.
		drop("icmp frag needed about a dsr flow's answer, its checksum wrong", flipLast(icmpAbout(tcp4(40000, packet.ACK), 4).Build()), ReasonDropICMPChecksum),
		drop("icmpv6 packet too big about a dsr flow's answer, its checksum wrong", flipLast(icmpAbout(tcp6(40001, packet.ACK), 0).Build()), ReasonDropICMPChecksum),
		// So is one whose quoted IPv4 header's own checksum fails (RFC 5508 REQ-3 a),
		// though its ICMP checksum, made over the quote as it is, holds.
		drop("icmp frag needed about a dsr flow's answer, its quoted header's checksum wrong", func() []byte {
			f := icmpAbout(tcp4(40000, packet.ACK), 4)
			f.ICMP.Quote[10] ^= 0x40
			return f.Build()
		}(), ReasonDropICMPChecksum),
		pass("icmp frag needed about no service's answer, its checksum wrong", flipLast(icmpAbout(with(tcp4(40000, packet.ACK), func(f *packet.Frame) {
			f.Dst = netip.AddrPortFrom(vip4, 81)
		}), 4).Build()), ReasonPassNotService),
		// A quote's IP options are read past to its ports (RFC 5508 REQ-3 b).
		icmpFixture("icmp frag needed about a dsr flow's answer with ip options", svc4, tcp4(40000, packet.ACK),
			icmpQuoting(packet.Frame{Src: netip.AddrPortFrom(vip4, 80), Dst: netip.AddrPortFrom(client4, 40000),
				TCPFlags: packet.ACK, IPv4Options: []byte{1, 1, 1, 0}}, 4)),
		// One whose Record Route a router filled in after the header's checksum was
		// made (Linux quotes a packet it has not forwarded yet so) is no less true:
		// a quoted header with options is not checked, and the error goes on.
		icmpFixture("icmp frag needed about a dsr flow's answer, its record route filled in", svc4, tcp4(40000, packet.ACK), func() packet.Frame {
			f := icmpQuoting(packet.Frame{Src: netip.AddrPortFrom(vip4, 80), Dst: netip.AddrPortFrom(client4, 40000),
				TCPFlags: packet.ACK, IPv4Options: []byte{7, 7, 4, 0, 0, 0, 0, 0}}, 4)
			f.ICMP.Quote[22] = 8
			copy(f.ICMP.Quote[23:27], []byte{10, 99, 0, 1})
			return f
		}()),
		// A parameter problem (its pointer a byte of the quote) is an error like these,
		// also one about an option of the quote's extension headers (code 2).
		icmpFixture("icmpv6 parameter problem about a dsr flow's answer's destination option", svc6, tcp6(40001, packet.ACK),
			with(icmpQuoting(packet.Frame{Src: netip.AddrPortFrom(vip6, 80), Dst: netip.AddrPortFrom(client6, 40001),
				TCPFlags: packet.ACK, IPv6ExtHeaders: []uint8{packet.ProtoDstOpts}}, 0), func(f *packet.Frame) {
				f.ICMP.Type, f.ICMP.Code, f.ICMP.Rest = 4, 2, 42
			})),
		icmpFixture("icmp parameter problem about a dsr flow's answer", svc4, tcp4(40000, packet.ACK),
			with(icmpAbout(tcp4(40000, packet.ACK), 0), func(f *packet.Frame) { f.ICMP.Type, f.ICMP.Rest = 12, 20<<24 })),
		icmpFixture("icmpv6 parameter problem about a dsr flow's answer", svc6, tcp6(40001, packet.ACK),
			with(icmpAbout(tcp6(40001, packet.ACK), 0), func(f *packet.Frame) { f.ICMP.Type, f.ICMP.Rest = 4, 40 })),
		pass("icmp frag needed about no service's answer", icmpAbout(with(tcp4(40000, packet.ACK), func(f *packet.Frame) {
			f.Dst = netip.AddrPortFrom(vip4, 81)
		}), 4).Build(), ReasonPassNotService),
		// An error is sent to the source of the packet it quotes: one about the VIP's
		// answer addressed elsewhere is not the VIP's, and goes to the kernel.
		pass("icmp frag needed about a dsr flow's answer, to an address not the vip", with(icmpAbout(tcp4(40000, packet.ACK), 4), func(f *packet.Frame) {
			f.Dst = netip.MustParseAddrPort("10.99.0.50:0")
		}).Build(), ReasonPassNotService),
		pass("icmpv6 packet too big about a dsr flow's answer, to an address not the vip", with(icmpAbout(tcp6(40001, packet.ACK), 0), func(f *packet.Frame) {
			f.Dst = netip.MustParseAddrPort("[fd99::50]:0")
		}).Build(), ReasonPassNotService),
		// A later fragment of an answer carries no ports where they would be: its
		// bytes there name no flow. The first fragment does.
		pass("icmp time exceeded quoting a later fragment of a dsr udp flow's answer", with(icmpQuoting(udpAnswer(5353, 185, false), 0), func(f *packet.Frame) {
			f.ICMP.Type = 11
		}).Build(), ReasonPassNotService),
		icmpFixture("icmp time exceeded quoting the first fragment of a dsr udp flow's answer", udp4, udp4Frame(5353, nil),
			with(icmpQuoting(udpAnswer(5353, 0, true), 0), func(f *packet.Frame) { f.ICMP.Type = 11 })),
		// A quote whose ports lie past the IP packet's end (in the frame's padding)
		// is truncated, whatever the frame holds there.
		pass("icmp frag needed whose quote ends before its ports", cutIP(icmpAbout(tcp4(40000, packet.ACK), 4).Build(), 20+8+20), ReasonPassNotService),
		pass("icmpv6 packet too big whose quote ends before its ports", cutIP(icmpAbout(tcp6(40001, packet.ACK), 0).Build(), 8+40), ReasonPassNotService),
	}
	for _, fx := range fixtures {
		t.Run(fx.name, func(t *testing.T) {
			before, err := p.Stats()
			if err != nil {
				t.Fatal(err)
			}
			action, out, err := p.Run(fx.in)
			if err != nil {
				t.Fatal(err)
			}
			if action != fx.wantAction {
				t.Fatalf("action %s; want %s", action, fx.wantAction)
			}
			want := fx.wantOut
			if want == nil {
				want = fx.in
			}
			if !bytes.Equal(out, want) {
				t.Errorf("output frame\n got %x\nwant %x", out, want)
			}
			after, err := p.Stats()
			if err != nil {
				t.Fatal(err)
			}
			if got := after.Reasons[fx.wantReason].Packets - before.Reasons[fx.wantReason].Packets; got != 1 {
				t.Errorf("counter %s went up by %d; want 1", fx.wantReason, got)
			}
		})
	}
}

// TestConnectionTable checks that established flows keep their backend when the
// table changes, and move only when their backend becomes unusable.
func TestConnectionTable(t *testing.T) {
	p := loadT(t)
	svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(4, false, 80)}
	if err := p.AddService(svc); err != nil {
		t.Fatal(err)
	}
	backendOf := func(sport uint16, flags uint8) net.HardwareAddr {
		t.Helper()
		in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(client4, sport),
			Dst: netip.AddrPortFrom(vip4, 80), TCPFlags: flags}.Build()
		action, out, err := p.Run(in)
		if err != nil || action != XDPTX {
			t.Fatalf("flow %d: action %s, err %v; want XDP_TX", sport, action, err)
		}
		return net.HardwareAddr(out[0:6])
	}

	// Open 200 flows and remember where each went.
	first := make(map[uint16]string)
	for port := uint16(20000); port < 20200; port++ {
		first[port] = backendOf(port, packet.SYN).String()
	}
	// Remove backend 0 from the table by weight, keep it usable: established flows
	// (non-SYN packets) must all stay where they were.
	changed := svc
	changed.Backends = append([]Backend(nil), svc.Backends...)
	changed.Backends[0].Weight = 0
	if err := p.UpdateService(changed); err != nil {
		t.Fatal(err)
	}
	for port, was := range first {
		if got := backendOf(port, packet.ACK).String(); got != was {
			t.Fatalf("flow %d moved from %s to %s after a table change; want it to stay", port, was, got)
		}
	}

	// Now mark backend 1 unusable: its flows move, everyone else's stay, nothing new
	// reaches it.
	gone := svc.Backends[1]
	if err := p.SetBackendUsable(svc.Key, gone.Addr, false); err != nil {
		t.Fatal(err)
	}
	before, _ := p.Stats()
	moved := 0
	for port, was := range first {
		got := backendOf(port, packet.ACK).String()
		switch {
		case got == gone.MAC.String():
			t.Fatalf("flow %d still reaches the unusable backend", port)
		case was == gone.MAC.String():
			moved++
		case got != was:
			t.Fatalf("flow %d moved from %s to %s; only the unusable backend's flows may move", port, was, got)
		}
	}
	for port := uint16(30000); port < 30300; port++ {
		if got := backendOf(port, packet.SYN).String(); got == gone.MAC.String() || got == svc.Backends[0].MAC.String() {
			t.Fatalf("new flow %d went to %s, which is unusable or has weight 0", port, got)
		}
	}
	after, _ := p.Stats()
	if got := after.Reasons[ReasonFlowReselect].Packets - before.Reasons[ReasonFlowReselect].Packets; got != uint64(moved) || moved == 0 {
		t.Errorf("reselected %d flows, counted %d; want equal and > 0", moved, got)
	}
}

func TestNoUsableBackendDrops(t *testing.T) {
	p := loadT(t)
	svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(1, false, 80)}
	if err := p.AddService(svc); err != nil {
		t.Fatal(err)
	}
	if err := p.SetBackendUsable(svc.Key, svc.Backends[0].Addr, false); err != nil {
		t.Fatal(err)
	}
	in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(client4, 1234),
		Dst: netip.AddrPortFrom(vip4, 80), TCPFlags: packet.SYN}.Build()
	if action, _, err := p.Run(in); err != nil || action != XDPDrop {
		t.Fatalf("action %s, err %v; want XDP_DROP", action, err)
	}
}

func TestSourceHashAffinity(t *testing.T) {
	p := loadT(t)
	svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, SourceHash: true, Backends: testBackends(5, false, 80)}
	if err := p.AddService(svc); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for port := uint16(1000); port < 1100; port++ {
		in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(client4, port),
			Dst: netip.AddrPortFrom(vip4, 80), TCPFlags: packet.SYN}.Build()
		_, out, err := p.Run(in)
		if err != nil {
			t.Fatal(err)
		}
		seen[net.HardwareAddr(out[0:6]).String()] = true
	}
	want := wantBackend(t, svc, Flow{Src: netip.AddrPortFrom(client4, 1), Dst: svc.Key.VIP, Protocol: TCP})
	if len(seen) != 1 || !seen[want.MAC.String()] {
		t.Errorf("one client's flows went to %v; want all to %s", seen, want.MAC)
	}
}

func TestServiceErrors(t *testing.T) {
	p := loadT(t)
	good := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(2, false, 80)}
	if err := p.AddService(good); err != nil {
		t.Fatal(err)
	}
	zeroWeights := good
	zeroWeights.Key.VIP = netip.AddrPortFrom(vip4, 81)
	zeroWeights.Backends = testBackends(2, false, 81)
	for i := range zeroWeights.Backends {
		zeroWeights.Backends[i].Weight = 0
	}
	dup := good
	dup.Backends = append(testBackends(2, false, 80), testBackends(1, false, 80)...)
	noMAC := good
	noMAC.Key.VIP = netip.AddrPortFrom(vip4, 82)
	noMAC.Backends = testBackends(1, false, 82)
	noMAC.Backends[0].MAC = nil

	for _, tc := range []struct {
		name    string
		op      func() error
		wantErr error
		wantMsg string
	}{
		{"duplicate vip", func() error { return p.AddService(good) }, ErrServiceExists, "tcp/10.77.100.1:80"},
		{"no backends", func() error {
			s := good
			s.Key.VIP = netip.AddrPortFrom(vip4, 90)
			s.Backends = nil
			return p.AddService(s)
		}, ErrInvalidService, "at least one backend"},
		{"every weight zero", func() error { return p.AddService(zeroWeights) }, ErrInvalidService, "every weight is 0"},
		{"bad vip", func() error {
			s := good
			s.Key.VIP = netip.AddrPort{}
			return p.AddService(s)
		}, ErrInvalidService, "vip"},
		{"vip port zero", func() error {
			s := good
			s.Key.VIP = netip.AddrPortFrom(vip4, 0)
			return p.AddService(s)
		}, ErrInvalidService, "port must be 1..65535"},
		{"backend listed twice", func() error { return p.UpdateService(dup) }, ErrInvalidService, "listed twice"},
		{"backend without mac", func() error { return p.AddService(noMAC) }, ErrInvalidService, "mac must be"},
		{"weight too large", func() error {
			s := good
			s.Backends = testBackends(1, false, 80)
			s.Backends[0].Weight = 70000
			return p.UpdateService(s)
		}, ErrInvalidService, "weight must be 0..65535, got 70000"},
		{"update missing service", func() error {
			s := good
			s.Key.VIP = netip.AddrPortFrom(vip4, 99)
			return p.UpdateService(s)
		}, ErrNoService, "add it first"},
		{"unknown backend", func() error {
			return p.SetBackendUsable(good.Key, netip.MustParseAddrPort("10.9.9.9:80"), false)
		}, ErrNoBackend, "10.9.9.9:80"},
		{"missing interface", func() error {
			_, err := p.Attach("weir-no-such0", ModeAuto)
			return err
		}, nil, "weir-no-such0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.op()
			if err == nil {
				t.Fatal("got no error; want one")
			}
			if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Errorf("got %v; want errors.Is %v", err, tc.wantErr)
			}
			if !bytes.Contains([]byte(err.Error()), []byte(tc.wantMsg)) {
				t.Errorf("got %q; want it to mention %q", err, tc.wantMsg)
			}
		})
	}
	// Failed calls left the good service as it was.
	if got := p.Services(); len(got) != 1 || len(got[0].Backends) != 2 {
		t.Errorf("services after failed calls: %+v; want the one good service untouched", got)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("second close: %v; want nil", err)
	}
	if err := p.AddService(good); !errors.Is(err, net.ErrClosed) {
		t.Errorf("add after close: %v; want net.ErrClosed", err)
	}
}

// verifierBudget is the most instructions the verifier may process for the XDP
// program in any configuration TestVerifierHeadroom loads: nine tenths of the
// kernel's limit (BPF_COMPLEXITY_LIMIT_INSNS, 1,000,000), so that a change which
// brings the program near the limit fails here, by name, before some
// configuration stops loading at all.
const verifierBudget = 900_000

// TestVerifierHeadroom loads the program with the load-time settings that change
// which paths the verifier walks (the nat source addresses, the new-flow rate,
// the previous-table fallback) and logs what each cost the verifier.
func TestVerifierHeadroom(t *testing.T) {
	a4, a6 := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("fd00::1")
	for _, tc := range []struct {
		name string
		opts Options
	}{
		{"no nat address", Options{}},
		{"nat ipv4", Options{NAT: NATOptions{Addr4: a4}}},
		{"nat ipv6", Options{NAT: NATOptions{Addr6: a6}}},
		{"nat both", Options{NAT: NATOptions{Addr4: a4, Addr6: a6}}},
		{"nat ipv4, rate, fallback", Options{NewFlowRate: 1000, PreviousTableWindow: time.Minute, NAT: NATOptions{Addr4: a4}}},
		{"nat both, rate, fallback", Options{NewFlowRate: 1000, PreviousTableWindow: time.Minute, NAT: NATOptions{Addr4: a4, Addr6: a6}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Load(tc.opts)
			xdptest.Check(t, err)
			defer p.Close()
			info, err := p.objs.WeirXdp.Info()
			if err != nil {
				t.Fatal(err)
			}
			n, ok := info.VerifiedInstructions()
			if !ok {
				t.Fatal("the kernel does not report verified instructions (Linux 5.16+)")
			}
			t.Logf("verifier processed %d instructions (%.0f%% of the limit)", n, float64(n)/1e4)
			if n > verifierBudget {
				t.Errorf("verifier processed %d instructions; want at most %d", n, verifierBudget)
			}
		})
	}
}
