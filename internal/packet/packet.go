// Package packet builds Ethernet frames for tests, benchmarks and the data-plane
// model: IPv4 (with options and fragment fields) or IPv6 (with extension headers),
// TCP or UDP with correct checksums, an optional 802.1Q tag.
package packet

import (
	"encoding/binary"
	"net"
	"net/netip"
)

// TCP flag bits.
const (
	FIN = 0x01
	SYN = 0x02
	RST = 0x04
	PSH = 0x08
	ACK = 0x10
)

// IP protocol numbers.
const (
	ProtoTCP     = 6
	ProtoUDP     = 17
	ProtoICMP    = 1
	ProtoICMPv6  = 58
	ProtoHopOpts = 0
	ProtoRouting = 43
	ProtoFrag    = 44
	ProtoDstOpts = 60
)

// Frame describes one frame. Zero values give a plain TCP segment without payload.
type Frame struct {
	SrcMAC, DstMAC net.HardwareAddr
	VLAN           uint16 // 0: untagged
	Src, Dst       netip.AddrPort
	Proto          uint8 // ProtoTCP (default) or ProtoUDP, or any other number: no L4 header is written
	TCPFlags       uint8
	// Seq and Ack are the TCP sequence number (0: 1000) and, with ACK set, the
	// acknowledgement number (0: 2000).
	Seq, Ack uint32
	Payload  []byte
	TTL      uint8 // default 64

	IPv4Options []byte // multiple of 4 bytes
	FragOffset  uint16 // in 8-byte units
	MoreFrags   bool
	// IPv6ExtHeaders are extension header protocol numbers placed before the L4
	// header, each 8 bytes long (ProtoFrag writes a fragment header).
	IPv6ExtHeaders []uint8

	// ICMP, with Proto ProtoICMP or ProtoICMPv6, writes an ICMP message instead of
	// Payload; its checksum is computed (with the pseudo-header for ICMPv6).
	ICMP *ICMP
}

// ICMP is an ICMP or ICMPv6 message.
type ICMP struct {
	Type, Code uint8
	Rest       uint32 // the second word: unused, or the MTU of "fragmentation needed" / "packet too big"
	Quote      []byte // the quoted IP packet, as much of it as the sender keeps
}

// IPPacket returns the frame's IP packet (the bytes after the Ethernet header and
// VLAN tag), for quoting in an ICMP error.
func (f Frame) IPPacket() []byte {
	b := f.Build()
	if f.VLAN != 0 {
		return b[18:]
	}
	return b[14:]
}

// Build returns the frame's bytes.
func (f Frame) Build() []byte {
	proto := f.Proto
	if proto == 0 {
		proto = ProtoTCP
	}
	ttl := f.TTL
	if ttl == 0 {
		ttl = 64
	}
	l4 := f.l4(proto)

	var l3 []byte
	var etherType uint16
	if f.Dst.Addr().Is4() {
		etherType = 0x0800
		l3 = f.ipv4(proto, ttl, l4)
	} else {
		etherType = 0x86dd
		l3 = f.ipv6(proto, ttl, l4)
	}

	b := make([]byte, 0, 18+len(l3))
	b = append(b, mac(f.DstMAC)...)
	b = append(b, mac(f.SrcMAC)...)
	if f.VLAN != 0 {
		b = binary.BigEndian.AppendUint16(b, 0x8100)
		b = binary.BigEndian.AppendUint16(b, f.VLAN&0x0fff)
	}
	b = binary.BigEndian.AppendUint16(b, etherType)
	return append(b, l3...)
}

func mac(m net.HardwareAddr) []byte {
	if len(m) == 6 {
		return m
	}
	return make([]byte, 6)
}

func (f Frame) l4(proto uint8) []byte {
	switch proto {
	case ProtoTCP:
		h := make([]byte, 20, 20+len(f.Payload))
		binary.BigEndian.PutUint16(h[0:], f.Src.Port())
		binary.BigEndian.PutUint16(h[2:], f.Dst.Port())
		seq, ack := f.Seq, f.Ack
		if seq == 0 {
			seq = 1000
		}
		if ack == 0 {
			ack = 2000
		}
		binary.BigEndian.PutUint32(h[4:], seq)
		if f.TCPFlags&ACK != 0 {
			binary.BigEndian.PutUint32(h[8:], ack)
		}
		h[12] = 5 << 4
		h[13] = f.TCPFlags
		binary.BigEndian.PutUint16(h[14:], 65535)
		h = append(h, f.Payload...)
		binary.BigEndian.PutUint16(h[16:], f.l4Checksum(proto, h))
		return h
	case ProtoUDP:
		h := make([]byte, 8, 8+len(f.Payload))
		binary.BigEndian.PutUint16(h[0:], f.Src.Port())
		binary.BigEndian.PutUint16(h[2:], f.Dst.Port())
		binary.BigEndian.PutUint16(h[4:], uint16(8+len(f.Payload)))
		h = append(h, f.Payload...)
		sum := f.l4Checksum(proto, h)
		if sum == 0 {
			sum = 0xffff
		}
		binary.BigEndian.PutUint16(h[6:], sum)
		return h
	}
	if f.ICMP != nil {
		m := make([]byte, 8, 8+len(f.ICMP.Quote))
		m[0], m[1] = f.ICMP.Type, f.ICMP.Code
		binary.BigEndian.PutUint32(m[4:], f.ICMP.Rest)
		m = append(m, f.ICMP.Quote...)
		var sum uint16
		if proto == ProtoICMPv6 {
			sum = f.l4Checksum(proto, m)
		} else {
			sum = Checksum(m)
		}
		binary.BigEndian.PutUint16(m[2:], sum)
		return m
	}
	return append([]byte(nil), f.Payload...)
}

func (f Frame) l4Checksum(proto uint8, segment []byte) uint16 {
	var pseudo []byte
	src, dst := f.Src.Addr(), f.Dst.Addr()
	if dst.Is4() {
		s, d := src.As4(), dst.As4()
		pseudo = append(append(pseudo, s[:]...), d[:]...)
		pseudo = append(pseudo, 0, proto)
		pseudo = binary.BigEndian.AppendUint16(pseudo, uint16(len(segment)))
	} else {
		s, d := src.As16(), dst.As16()
		pseudo = append(append(pseudo, s[:]...), d[:]...)
		pseudo = binary.BigEndian.AppendUint32(pseudo, uint32(len(segment)))
		pseudo = append(pseudo, 0, 0, 0, proto)
	}
	return Checksum(append(pseudo, segment...))
}

func (f Frame) ipv4(proto, ttl uint8, l4 []byte) []byte {
	hl := 20 + len(f.IPv4Options)
	h := make([]byte, hl, hl+len(l4))
	h[0] = 0x40 | uint8(hl/4)
	binary.BigEndian.PutUint16(h[2:], uint16(hl+len(l4)))
	binary.BigEndian.PutUint16(h[4:], 0x1234)
	frag := f.FragOffset & 0x1fff
	if f.MoreFrags {
		frag |= 0x2000
	}
	binary.BigEndian.PutUint16(h[6:], frag)
	h[8] = ttl
	h[9] = proto
	s, d := f.Src.Addr().As4(), f.Dst.Addr().As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	copy(h[20:], f.IPv4Options)
	binary.BigEndian.PutUint16(h[10:], Checksum(h))
	return append(h, l4...)
}

func (f Frame) ipv6(proto, ttl uint8, l4 []byte) []byte {
	var ext []byte
	for i, t := range f.IPv6ExtHeaders {
		next := proto
		if i+1 < len(f.IPv6ExtHeaders) {
			next = f.IPv6ExtHeaders[i+1]
		}
		e := make([]byte, 8)
		e[0] = next
		if t == ProtoFrag {
			binary.BigEndian.PutUint16(e[2:], f.FragOffset<<3|boolBit(f.MoreFrags))
		}
		ext = append(ext, e...)
	}
	first := proto
	if len(f.IPv6ExtHeaders) > 0 {
		first = f.IPv6ExtHeaders[0]
	}
	h := make([]byte, 40, 40+len(ext)+len(l4))
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(ext)+len(l4)))
	h[6] = first
	h[7] = ttl
	s, d := f.Src.Addr().As16(), f.Dst.Addr().As16()
	copy(h[8:], s[:])
	copy(h[24:], d[:])
	h = append(h, ext...)
	return append(h, l4...)
}

func boolBit(b bool) uint16 {
	if b {
		return 1
	}
	return 0
}

// Checksum is the Internet checksum (RFC 1071) of b.
func Checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
