package loader

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/weir-lb/weir/internal/packet"
)

// The differential fuzzer compares the program with its model, which updates
// checksums the way the program does: a wrong update both share would pass it.
// checkChecksums judges every frame the program changed by the checksums alone,
// computed from scratch here: a translation keeps each checksum right or wrong as it
// came (a UDP checksum of zero stays absent), an outer tunnel header's is right and
// the packet inside is as it came, and an ICMP error the program made is right.

// checkChecksums says how out, what the program made of in with action, breaks
// those rules; nil if it does not.
func checkChecksums(in, out []byte, action Action) error {
	if action == XDPAborted || bytes.Equal(in, out) {
		return nil
	}
	had, got := frameSums(in), frameSums(out)
	icmp := func(sums []string) bool {
		return slices.ContainsFunc(sums, func(s string) bool { return strings.HasPrefix(s, "icmp") })
	}
	switch {
	case len(got) >= 2 && got[1] == "tunnel" && !slices.Contains(had, "tunnel"):
		if (got[0] != "ip4 right" && got[0] != "ip6") || !slices.Equal(got[2:], had) {
			return fmt.Errorf("checksums: encapsulated %v; want an outer header (IPv4: right) around %v", got, had)
		}
	case icmp(got) && !icmp(had):
		if len(got) < 2 || (got[0] != "ip4 right" && got[0] != "ip6") || (got[1] != "icmp right" && got[1] != "icmp6 right") {
			return fmt.Errorf("checksums: ICMP error made %v; want its IP header's and its own right", got)
		}
	default:
		if !slices.Equal(got, had) {
			return fmt.Errorf("checksums: translated %v; want %v, as they came", got, had)
		}
	}
	return nil
}

// frameSums lists what each checksum of an Ethernet frame's IP packet says, outer
// headers first: "ip4 right" or "ip4 wrong", "ip6" (no checksum), then the
// transport's ("tcp right", "udp none", "icmp6 wrong", ...), for an IPv4 ICMP message
// its quoted IPv4 header's, and for an IP-in-IP packet "tunnel" and the inner
// packet's. What cannot be read is named for what it is ("cut", "fragment").
func frameSums(b []byte) []string {
	if len(b) < 14 {
		return []string{"cut"}
	}
	l3, etherType := 14, binary.BigEndian.Uint16(b[12:])
	if etherType == 0x8100 && len(b) >= 18 {
		l3, etherType = 18, binary.BigEndian.Uint16(b[16:])
	}
	if etherType != 0x0800 && etherType != 0x86dd {
		return []string{fmt.Sprintf("ethertype %#x", etherType)}
	}
	return ipSums(b[l3:], nil, true)
}

func rightOrWrong(what string, sum uint16) string {
	if sum == 0 {
		return what + " right"
	}
	return what + " wrong"
}

// ipSums appends the checksums of the IP packet at the start of ip to sums; inner
// says whether an IP-in-IP packet's inner one is read too.
func ipSums(ip []byte, sums []string, inner bool) []string {
	if len(ip) == 0 {
		return append(sums, "cut")
	}
	var pseudo []byte // the pseudo-header's addresses
	var payload []byte
	var proto uint8
	switch ip[0] >> 4 {
	case 4:
		if len(ip) < 20 {
			return append(sums, "ip4 cut")
		}
		ihl, total := int(ip[0]&0xf)*4, int(binary.BigEndian.Uint16(ip[2:]))
		if ihl < 20 || total < ihl || total > len(ip) {
			return append(sums, "ip4 malformed")
		}
		sums = append(sums, rightOrWrong("ip4", packet.Checksum(ip[:ihl])))
		if binary.BigEndian.Uint16(ip[6:])&0x3fff != 0 {
			return append(sums, "fragment")
		}
		pseudo, payload, proto = ip[12:20], ip[ihl:total], ip[9]
	case 6:
		if len(ip) < 40 {
			return append(sums, "ip6 cut")
		}
		total := 40 + int(binary.BigEndian.Uint16(ip[4:]))
		if total > len(ip) {
			return append(sums, "ip6 malformed")
		}
		sums = append(sums, "ip6")
		off, next := 40, ip[6]
		for range 8 {
			if next != packet.ProtoHopOpts && next != packet.ProtoRouting && next != packet.ProtoDstOpts {
				break
			}
			if off+2 > total {
				return append(sums, "ext cut")
			}
			next, off = ip[off], off+(int(ip[off+1])+1)*8
		}
		if off > total {
			return append(sums, "ext cut")
		}
		if next == packet.ProtoFrag {
			return append(sums, "fragment")
		}
		pseudo, payload, proto = ip[8:40], ip[off:total], next
	default:
		return append(sums, fmt.Sprintf("ip version %d", ip[0]>>4))
	}
	// withPseudo is the sum over the pseudo-header (RFC 768, RFC 8200 8.1) and seg.
	withPseudo := func(seg []byte) uint16 {
		h := slices.Clone(pseudo)
		if len(pseudo) == 8 {
			h = append(h, 0, proto)
			h = binary.BigEndian.AppendUint16(h, uint16(len(seg)))
		} else {
			h = binary.BigEndian.AppendUint32(h, uint32(len(seg)))
			h = append(h, 0, 0, 0, proto)
		}
		return packet.Checksum(append(h, seg...))
	}
	switch {
	case proto == packet.ProtoTCP:
		if len(payload) < 20 {
			return append(sums, "tcp cut")
		}
		return append(sums, rightOrWrong("tcp", withPseudo(payload)))
	case proto == packet.ProtoUDP:
		if len(payload) < 8 {
			return append(sums, "udp cut")
		}
		// The checksum covers the datagram as its length says, not what follows it.
		n := int(binary.BigEndian.Uint16(payload[4:]))
		if n < 8 || n > len(payload) {
			return append(sums, "udp malformed")
		}
		if payload[6] == 0 && payload[7] == 0 {
			return append(sums, "udp none")
		}
		return append(sums, rightOrWrong("udp", withPseudo(payload[:n])))
	case proto == packet.ProtoICMP && len(pseudo) == 8:
		if len(payload) < 8 {
			return append(sums, "icmp cut")
		}
		sums = append(sums, rightOrWrong("icmp", packet.Checksum(payload)))
		if q := payload[8:]; len(q) >= 20 && q[0]>>4 == 4 && int(q[0]&0xf)*4 >= 20 && len(q) >= int(q[0]&0xf)*4 {
			sums = append(sums, rightOrWrong("quoted ip4", packet.Checksum(q[:int(q[0]&0xf)*4])))
		}
		return quotedSums(payload[8:], sums)
	case proto == packet.ProtoICMPv6 && len(pseudo) == 32:
		sums = append(sums, rightOrWrong("icmp6", withPseudo(payload)))
		if len(payload) < 8 {
			return sums
		}
		return quotedSums(payload[8:], sums)
	case (proto == protoIPIP || proto == protoIPv6) && inner:
		return ipSums(payload, append(sums, "tunnel"), false)
	}
	return append(sums, fmt.Sprintf("protocol %d", proto))
}

// quotedSums appends the transport checksum of the packet an ICMP error quotes,
// as "quoted udp none" and the like, when the quote holds all of it: a nat
// translation updates it with the quote's addresses and ports.
func quotedSums(q []byte, sums []string) []string {
	qs := ipSums(q, nil, false)
	if len(qs) < 2 || (qs[0] != "ip6" && !strings.HasPrefix(qs[0], "ip4 ")) {
		return sums // cut short, as most quotes are: nothing to judge
	}
	for _, s := range qs[1:] {
		sums = append(sums, "quoted "+s)
	}
	return sums
}

// TestCheckChecksums holds the fuzzer's checksum rules to frames built here: each
// rule passes a right frame and catches a wrong one.
func TestCheckChecksums(t *testing.T) {
	udp := func(dst string, payload int) packet.Frame {
		return packet.Frame{Src: netip.MustParseAddrPort("[fd00::1]:1000"), Dst: netip.MustParseAddrPort(dst),
			Proto: packet.ProtoUDP, Payload: make([]byte, payload)}
	}
	noSum := func(b []byte) []byte {
		b[14+40+6], b[14+40+7] = 0, 0
		return b
	}
	in := udp("[fd00::2]:53", 20).Build()
	translated := udp("[fd00::3]:53", 20).Build()
	spoilt := slices.Clone(translated)
	spoilt[len(spoilt)-1] ^= 1
	tunnel := packet.Frame{Src: netip.MustParseAddrPort("10.0.0.1:0"), Dst: netip.MustParseAddrPort("10.0.0.2:0"),
		Proto: protoIPv6, Payload: in[14:]}.Build()
	badOuter := slices.Clone(tunnel)
	badOuter[14+8]-- // the TTL, under the checksum made for it
	tooBig := packet.Frame{Src: netip.MustParseAddrPort("[fd00::2]:0"), Dst: netip.MustParseAddrPort("[fd00::1]:0"),
		Proto: packet.ProtoICMPv6, ICMP: &packet.ICMP{Type: 2, Rest: 1280, Quote: in[14:]}}.Build()
	badTooBig := slices.Clone(tooBig)
	badTooBig[len(badTooBig)-1] ^= 1
	// An ICMP error about a datagram, quoting all of it, and the error translated:
	// the quote's checksum is judged as a datagram's is.
	unreachable := func(quote []byte) []byte {
		return packet.Frame{Src: netip.MustParseAddrPort("[fd00::9]:0"), Dst: netip.MustParseAddrPort("[fd00::1]:0"),
			Proto: packet.ProtoICMPv6, ICMP: &packet.ICMP{Type: 1, Code: 4, Quote: quote[14:]}}.Build()
	}
	v4 := func(dst string) packet.Frame {
		return packet.Frame{Src: netip.MustParseAddrPort("10.0.0.1:1000"), Dst: netip.MustParseAddrPort(dst),
			Proto: packet.ProtoTCP, TCPFlags: packet.SYN, Payload: make([]byte, 4)}
	}
	fragNeeded := func(quote []byte) []byte {
		return packet.Frame{Src: netip.MustParseAddrPort("10.0.0.9:0"), Dst: netip.MustParseAddrPort("10.0.0.1:0"),
			Proto: packet.ProtoICMP, ICMP: &packet.ICMP{Type: 3, Code: 4, Rest: 1400, Quote: quote[14:]}}.Build()
	}
	spoilt4 := v4("10.0.0.3:80").Build()
	spoilt4[len(spoilt4)-1] ^= 1
	for _, tc := range []struct {
		name    string
		in, out []byte
		ok      bool
	}{
		{"icmp6 error translated, quoted zero checksum kept", unreachable(noSum(slices.Clone(in))),
			unreachable(noSum(slices.Clone(translated))), true},
		{"icmp6 error translated, quoted zero checksum made non-zero", unreachable(noSum(slices.Clone(in))),
			unreachable(translated), false},
		{"icmp error translated", fragNeeded(v4("10.0.0.2:80").Build()), fragNeeded(v4("10.0.0.3:80").Build()), true},
		{"icmp error translated, quoted checksum spoilt", fragNeeded(v4("10.0.0.2:80").Build()), fragNeeded(spoilt4), false},
		{"icmp error translated, quote cut short", fragNeeded(v4("10.0.0.2:80").Build()[:14+28]),
			fragNeeded(spoilt4[:14+28]), true},
		{"translated", in, translated, true},
		{"translated, a checksum spoilt", in, spoilt, false},
		{"zero checksum kept", noSum(slices.Clone(in)), noSum(slices.Clone(translated)), true},
		{"zero checksum made non-zero", noSum(slices.Clone(in)), translated, false},
		{"encapsulated", in, tunnel, true},
		{"encapsulated, outer header's checksum wrong", in, badOuter, false},
		{"encapsulated, inner packet spoilt", spoilt, tunnel, false},
		{"icmp error made", in, tooBig, true},
		{"icmp error made, its checksum wrong", in, badTooBig, false},
	} {
		if err := checkChecksums(tc.in, tc.out, XDPTX); (err == nil) != tc.ok {
			t.Errorf("%s: %v; want ok %t", tc.name, err, tc.ok)
		}
	}
}
