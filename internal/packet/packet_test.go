package packet

import (
	"encoding/binary"
	"net/netip"
	"testing"
)

// TestChecksums checks the builder's checksums the way a receiver does: summing a
// header (or segment with its pseudo-header) including its checksum gives 0xffff,
// i.e. Checksum over it is 0.
func TestChecksums(t *testing.T) {
	for _, tc := range []struct {
		name string
		f    Frame
	}{
		{"tcp v4", Frame{Src: netip.MustParseAddrPort("10.0.0.1:1234"), Dst: netip.MustParseAddrPort("10.0.0.2:80"), TCPFlags: SYN, Payload: []byte("odd")}},
		{"udp v4", Frame{Proto: ProtoUDP, Src: netip.MustParseAddrPort("10.0.0.1:53"), Dst: netip.MustParseAddrPort("10.0.0.2:53"), Payload: []byte("query")}},
		{"tcp v6", Frame{Src: netip.MustParseAddrPort("[fd00::1]:1234"), Dst: netip.MustParseAddrPort("[fd00::2]:80"), TCPFlags: ACK}},
		{"icmp v4", Frame{Proto: ProtoICMP, Src: netip.MustParseAddrPort("10.0.0.1:0"), Dst: netip.MustParseAddrPort("10.0.0.2:0"),
			ICMP: &ICMP{Type: 3, Code: 4, Rest: 1400, Quote: []byte{0x45, 0, 0, 20}}}},
		{"icmpv6", Frame{Proto: ProtoICMPv6, Src: netip.MustParseAddrPort("[fd00::1]:0"), Dst: netip.MustParseAddrPort("[fd00::2]:0"),
			ICMP: &ICMP{Type: 2, Rest: 1280, Quote: []byte{0x60, 0, 0, 0, 1}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.f.Build()
			ip := b[14:]
			var l4 []byte
			var pseudo []byte
			proto := ip[9]
			if tc.f.Dst.Addr().Is4() {
				if got := Checksum(ip[:20]); got != 0 {
					t.Errorf("IPv4 header sums to %#x; want 0", got)
				}
				l4 = ip[20:]
				pseudo = append(append(pseudo, ip[12:20]...), 0, proto)
				pseudo = binary.BigEndian.AppendUint16(pseudo, uint16(len(l4)))
			} else {
				proto = ip[6]
				l4 = ip[40:]
				pseudo = append(pseudo, ip[8:40]...)
				pseudo = binary.BigEndian.AppendUint32(pseudo, uint32(len(l4)))
				pseudo = append(pseudo, 0, 0, 0, proto)
			}
			if proto == ProtoICMP {
				pseudo = nil // ICMPv4 has no pseudo-header
			}
			if got := Checksum(append(pseudo, l4...)); got != 0 {
				t.Errorf("L4 (proto %d) sums to %#x; want 0", proto, got)
			}
		})
	}
}

func TestVLANAndOptions(t *testing.T) {
	f := Frame{VLAN: 7, IPv4Options: []byte{1, 1, 1, 0}, Src: netip.MustParseAddrPort("10.0.0.1:1"), Dst: netip.MustParseAddrPort("10.0.0.2:2")}
	b := f.Build()
	if got := binary.BigEndian.Uint16(b[12:]); got != 0x8100 {
		t.Fatalf("ethertype %#x; want 0x8100", got)
	}
	if got := b[18] & 0x0f; got != 6 {
		t.Errorf("IHL %d; want 6 with 4 bytes of options", got)
	}
	if got := len(f.IPPacket()); got != len(b)-18 {
		t.Errorf("IPPacket is %d bytes; want the frame less 18", got)
	}
}
