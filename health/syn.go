package health

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"
)

// The half-open (syn) method's packets, and the source ports they come from.
//
// A syn check sends one SYN from a port of the Checker's reserved range and
// waits for the answer to that SYN: a SYN-ACK acknowledging its sequence
// number means up, an RST means refused. Nothing else on the host owns the
// port, so the checker's kernel answers the SYN-ACK with an RST itself and the
// backend drops its half-open connection at once: the checker never writes a
// second packet.

// DefaultSynPorts is the source port range of syn checks when
// Checker.SynPorts is zero: above Linux's default ephemeral range
// (32768–60999) and clear of weir's NAT range (10000–32767). It also bounds the
// syn checks in flight at once, at 4000.
var DefaultSynPorts = [2]uint16{61000, 64999}

// synPoll is how often Run reads the raw sockets while syn checks are in
// flight. The answers wait in the socket's queue until then: one read of tens
// of answers every few milliseconds costs far less than a wakeup per answer,
// and at scale the reads fall on the scheduler's own wakeups (its slack is
// the same 5 ms). It bounds how late an answer is seen, so a syn check's
// Duration is exact to within it.
const synPoll = maxSlack

// synMinPoll is the least time between two reads: Run wakes for due checks
// as well, and a read right after another finds nothing.
const synMinPoll = time.Millisecond

// srcEntry remembers the source address the kernel picked for a destination.
type srcEntry struct {
	dst, addr netip.Addr
	at        time.Time
	gen       uint32 // synProber.srcGen when asked
}

// errSynClosed ends the syn checks still in flight when the prober closes.
var errSynClosed = errors.New("syn prober closed")

const (
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10

	// synLen is the length of the TCP header of a SYN: 20 bytes and an MSS option.
	synLen = 24
)

// buildSYN writes a SYN from src:sport to dst:dport with sequence number seq
// into b (at least synLen bytes), checksum included, and returns it.
func buildSYN(b []byte, src, dst netip.Addr, sport, dport uint16, seq uint32) []byte {
	b = b[:synLen]
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	binary.BigEndian.PutUint32(b[4:], seq)
	binary.BigEndian.PutUint32(b[8:], 0)
	b[12] = synLen / 4 << 4
	b[13] = tcpSYN
	binary.BigEndian.PutUint16(b[14:], 64240) // window
	binary.BigEndian.PutUint16(b[16:], 0)     // checksum, below
	binary.BigEndian.PutUint16(b[18:], 0)     // urgent pointer
	b[20], b[21] = 2, 4                       // MSS option: some middleboxes drop SYNs without one
	binary.BigEndian.PutUint16(b[22:], 1220)  // fits any IPv6 path
	binary.BigEndian.PutUint16(b[16:], tcpChecksum(src, dst, b))
	return b
}

// ipv4Len is the length of the IPv4 header of a SYN: no options.
const ipv4Len = 20

// buildIPv4 writes the IPv4 header of a SYN from src to dst into b (at least
// ipv4Len bytes). The kernel fills in the total length and the checksum of a
// raw socket's IP_HDRINCL packet; id must not be zero, or it picks one
// itself, at a cost. DF is set, so the id identifies no fragments (RFC 6864).
func buildIPv4(b []byte, src, dst [4]byte, id uint16) {
	b = b[:ipv4Len]
	b[0] = 4<<4 | ipv4Len/4
	b[1] = 0
	binary.BigEndian.PutUint16(b[2:], ipv4Len+synLen)
	binary.BigEndian.PutUint16(b[4:], id)
	binary.BigEndian.PutUint16(b[6:], 0x4000) // DF
	b[8] = 64                                 // TTL
	b[9] = 6                                  // TCP
	binary.BigEndian.PutUint16(b[10:], 0)
	copy(b[12:16], src[:])
	copy(b[16:20], dst[:])
}

// tcpChecksum is the TCP checksum of seg (with its checksum field zero) over
// the pseudo-header of src and dst (RFC 9293 3.1, RFC 8200 8.1).
func tcpChecksum(src, dst netip.Addr, seg []byte) uint16 {
	var sum uint32
	add := func(b []byte) {
		for len(b) >= 2 {
			sum += uint32(binary.BigEndian.Uint16(b))
			b = b[2:]
		}
		if len(b) == 1 {
			sum += uint32(b[0]) << 8
		}
	}
	s, d := src.AsSlice(), dst.AsSlice()
	add(s)
	add(d)
	sum += 6 + uint32(len(seg)) // protocol TCP, TCP length
	add(seg)
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

// segment is what the receive path reads of a TCP segment.
type segment struct {
	src      netip.Addr
	sport    uint16
	dport    uint16
	seq, ack uint32
	flags    uint8
}

// parseTCP reads the ports, numbers and flags of the TCP header at the start of b.
func parseTCP(b []byte, src netip.Addr) (segment, bool) {
	if len(b) < 20 {
		return segment{}, false
	}
	return segment{
		src:   src,
		sport: binary.BigEndian.Uint16(b[0:]),
		dport: binary.BigEndian.Uint16(b[2:]),
		seq:   binary.BigEndian.Uint32(b[4:]),
		ack:   binary.BigEndian.Uint32(b[8:]),
		flags: b[13],
	}, true
}

// parseIPv4TCP reads an IPv4 packet carrying TCP, as an IPv4 raw socket
// returns it: from the IP header on.
func parseIPv4TCP(b []byte) (segment, bool) {
	if len(b) < 20 || b[0]>>4 != 4 || b[9] != 6 {
		return segment{}, false
	}
	ihl := int(b[0]&0x0f) * 4
	if ihl < 20 || len(b) < ihl {
		return segment{}, false
	}
	return parseTCP(b[ihl:], netip.AddrFrom4([4]byte(b[12:16])))
}

// reservedPorts is the text of ip_local_reserved_ports with the range lo..hi
// added, and whether it had to change: ranges and ports separated by commas,
// as the kernel prints them.
func reservedPorts(cur string, lo, hi uint16) (string, bool, error) {
	covered := make([]bool, int(hi)-int(lo)+1)
	cur = strings.TrimSpace(cur)
	if cur != "" {
		for _, part := range strings.Split(cur, ",") {
			a, b, isRange := strings.Cut(strings.TrimSpace(part), "-")
			from, err := strconv.ParseUint(a, 10, 16)
			if err != nil {
				return "", false, fmt.Errorf("parse %q: %w", cur, err)
			}
			to := from
			if isRange {
				if to, err = strconv.ParseUint(b, 10, 16); err != nil {
					return "", false, fmt.Errorf("parse %q: %w", cur, err)
				}
			}
			for p := max(from, uint64(lo)); p <= min(to, uint64(hi)); p++ {
				covered[p-uint64(lo)] = true
			}
		}
	}
	all := true
	for _, c := range covered {
		all = all && c
	}
	if all {
		return cur, false, nil
	}
	add := fmt.Sprintf("%d-%d", lo, hi)
	if cur == "" {
		return add, true, nil
	}
	return cur + "," + add, true, nil
}
