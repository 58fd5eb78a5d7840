package proxy

import (
	"encoding/binary"
	"net/netip"
	"strconv"
)

// PROXY protocol headers sent to a backend before the client's bytes, so it learns the
// client's address (https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt).

// v2Signature opens every version 2 header.
var v2Signature = [12]byte{0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A}

// appendProxyHeader appends the header of the given version (1 or 2) for a connection
// from src to dst (the address the client connected to).
func appendProxyHeader(b []byte, version int, src, dst netip.AddrPort) []byte {
	src = netip.AddrPortFrom(src.Addr().Unmap(), src.Port())
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	v4 := src.Addr().Is4() && dst.Addr().Is4()
	if !v4 {
		// Mixed families: say both in IPv6, which can express an IPv4 address.
		src = netip.AddrPortFrom(netip.AddrFrom16(src.Addr().As16()), src.Port())
		dst = netip.AddrPortFrom(netip.AddrFrom16(dst.Addr().As16()), dst.Port())
	}
	if version == 1 {
		b = append(b, "PROXY TCP4 "...)
		if !v4 {
			b[len(b)-2] = '6'
		}
		b = src.Addr().AppendTo(b)
		b = append(b, ' ')
		b = dst.Addr().AppendTo(b)
		b = append(b, ' ')
		b = strconv.AppendUint(b, uint64(src.Port()), 10)
		b = append(b, ' ')
		b = strconv.AppendUint(b, uint64(dst.Port()), 10)
		return append(b, '\r', '\n')
	}
	b = append(b, v2Signature[:]...)
	b = append(b, 0x21) // version 2, command PROXY
	if v4 {
		b = append(b, 0x11) // AF_INET, STREAM
		b = binary.BigEndian.AppendUint16(b, 12)
		s, d := src.Addr().As4(), dst.Addr().As4()
		b = append(b, s[:]...)
		b = append(b, d[:]...)
	} else {
		b = append(b, 0x21) // AF_INET6, STREAM
		b = binary.BigEndian.AppendUint16(b, 36)
		s, d := src.Addr().As16(), dst.Addr().As16()
		b = append(b, s[:]...)
		b = append(b, d[:]...)
	}
	b = binary.BigEndian.AppendUint16(b, src.Port())
	return binary.BigEndian.AppendUint16(b, dst.Port())
}
