//go:build linux

package health

import (
	"encoding/binary"
	"net/netip"
	"testing"
)

// FuzzParseReplies: the SYN prober's readers of what its raw sockets return
// (a TCP segment after an IPv4 header or alone, an ICMP or ICMPv6 unreachable
// quoting a segment) take any bytes without a panic, and what they read lies
// inside them. The seeds are well-formed replies; the rest are the mutations.
//
//	go test -run '^$' -fuzz FuzzParseReplies ./health/
func FuzzParseReplies(f *testing.F) {
	tcp := make([]byte, 20)
	binary.BigEndian.PutUint16(tcp[0:], 80)
	binary.BigEndian.PutUint16(tcp[2:], 40001)
	tcp[13] = tcpSYN | tcpACK
	ip4 := append([]byte{0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0, 10, 0, 0, 2, 10, 0, 0, 1}, tcp...)
	icmp4 := append([]byte{0x45, 0, 0, 56, 0, 0, 0, 0, 64, 1, 0, 0, 10, 0, 0, 9, 10, 0, 0, 1, 3, 1, 0, 0, 0, 0, 0, 0}, ip4[:28]...)
	icmp6 := make([]byte, 8+40+8)
	icmp6[0], icmp6[1], icmp6[8+6] = 1, 3, 6
	for _, b := range [][]byte{tcp, ip4, icmp4, icmp6, {0x4f}, {0x4f, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3}} {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		parseTCP(b, netip.Addr{})
		parseIPv4TCP(b)
		parseUnreachable(b, false)
		parseUnreachable(b, true)
	})
}
