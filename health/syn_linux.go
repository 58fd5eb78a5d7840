package health

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// reservedPortsFile is where the kernel keeps the ports it never hands out as
// ephemeral ports. It belongs to the network namespace of the thread that
// opens it, and covers IPv6 as well.
const reservedPortsFile = "/proc/sys/net/ipv4/ip_local_reserved_ports"

// srcTTL is how long a kernel-chosen source address is reused for a
// destination before the route is asked again. A change of addresses, routes
// or rules that netlink reports drops every remembered one at once; the TTL
// covers the changes it does not report (Linux flushes the IPv4 routes of a
// link that goes down without a message), and is shorter when netlink cannot
// be watched. Each ask costs four system calls, and at 100,000 backends a
// 30 s TTL was a third of them asked every second.
const (
	srcTTL          = 5 * time.Minute
	srcTTLUnwatched = 30 * time.Second
)

// synProber sends the SYNs of every syn check through one raw socket per
// address family and matches the answers, which one kernel socket filter per
// socket selects from all the host's TCP traffic: SYN-ACKs and RSTs to the
// reserved port range. A check holds one port of the range from its SYN to its
// answer or timeout, so the range also bounds the checks in flight.
//
// It has no goroutine, timer or allocation per check: Run's goroutine sends
// the SYNs, reads the answers (poll) and ends the checks whose timeout passed,
// which a FIFO per timeout value keeps in the order of their deadlines. Only
// drop, for Remove, comes from other goroutines; mu guards what it touches.
type synProber struct {
	lo, hi   uint16
	fd4, fd6 int // raw sockets, non-blocking; fd6 -1 without IPv6
	// Raw ICMP and ICMPv6 sockets for the destination unreachables that
	// answer a SYN (a firewall's reject, a router with no route); -1 if they
	// could not be opened, and the checks time out instead.
	icmp4, icmp6 int
	// A netlink socket on the groups of address, route and rule changes;
	// -1 if it could not be opened. Any message bumps srcGen, which drops
	// the source addresses remembered before.
	routes     int
	srcGen     uint32
	lastRoutes time.Time
	// done ends a check of b (err nil: up) at the time at; it runs on Run's
	// goroutine without mu held.
	done func(b *backend, err error, at time.Time)
	// restore is what ip_local_reserved_ports held before, if open changed it.
	restore    *string
	reserveErr error // why the range is not reserved; nil if it is
	excluded   int   // ports of the range left out because a socket had them

	mu     sync.Mutex
	free   []uint16   // a stack of the ports no check holds
	checks []synCheck // by port - lo
	n4, n6 int        // checks in flight per family

	// Run's goroutine alone touches the rest.
	epoch     time.Time // deadlines count from it
	ipID      uint16    // of the last IPv4 SYN
	lastPoll  time.Time
	deadlines []*deadlineQueue
	ended     []endedCheck
	// The SYNs queued for the next flush, and what sendmmsg reads.
	out, spare []*outSYN
	msgs       []*outSYN
	hdrs       []unix.Mmsghdr
	// recvmmsg's buffers.
	bufs  [recvBatch][128]byte // all the filters pass: headers, and an ICMP error's quote
	names [recvBatch]unix.RawSockaddrInet6
	iovs  [recvBatch]unix.Iovec
	rhdrs [recvBatch]unix.Mmsghdr
}

type synCheck struct {
	live bool
	seq  uint32
	dst  netip.AddrPort
	b    *backend
}

type endedCheck struct {
	b   *backend
	err error
}

// deadlineQueue holds the checks of one timeout value in the order they
// started, which is the order of their deadlines. An entry whose check ended
// earlier is skipped.
type deadlineQueue struct {
	timeout time.Duration
	err     error // the timeout's error, shared by every check it ends
	q       []deadline
	head    int
}

type deadline struct {
	at   int64 // nanoseconds since synProber.epoch
	port uint16
	seq  uint32
}

// errRefused is the result of a check answered with an RST: the connect
// method's error.
var errRefused error = &os.SyscallError{Syscall: "connect", Err: syscall.ECONNREFUSED}

// openSyn opens the raw sockets and reserves the port range, in the network
// namespace of the calling thread. It fails only if the IPv4 raw socket cannot
// be opened (no CAP_NET_RAW, say); a range that cannot be reserved is reported
// in reserveErr. done is called for every check that ends (see synProber).
func openSyn(ports [2]uint16, done func(b *backend, err error, at time.Time)) (*synProber, error) {
	p := &synProber{lo: ports[0], hi: ports[1], fd6: -1, icmp4: -1, icmp6: -1, routes: -1, done: done, epoch: time.Now()}
	var err error
	if p.fd4, err = rawSocket(unix.AF_INET, unix.IPPROTO_TCP, synFilter(false, p.lo, p.hi)); err != nil {
		return nil, err
	}
	// IPv4 SYNs carry their own IP header: the kernel then only checks it
	// and routes it, instead of building it through its append path and
	// picking an IP id. IPv6 has no such shortcut.
	if err := unix.SetsockoptInt(p.fd4, unix.IPPROTO_IP, unix.IP_HDRINCL, 1); err != nil {
		unix.Close(p.fd4)
		return nil, os.NewSyscallError("setsockopt IP_HDRINCL", err)
	}
	if p.fd6, err = rawSocket(unix.AF_INET6, unix.IPPROTO_TCP, synFilter(true, p.lo, p.hi)); err != nil {
		p.fd6 = -1 // no IPv6 here: IPv6 checks fail to send
	}
	if p.icmp4, err = rawSocket(unix.AF_INET, unix.IPPROTO_ICMP, unreachFilter(false, p.lo, p.hi)); err != nil {
		p.icmp4 = -1
	}
	if p.icmp6, err = rawSocket(unix.AF_INET6, unix.IPPROTO_ICMPV6, unreachFilter(true, p.lo, p.hi)); err != nil {
		p.icmp6 = -1
	}
	p.routes = watchRoutes()
	bound := boundPorts(p.lo, p.hi)
	p.checks = make([]synCheck, int(p.hi)-int(p.lo)+1)
	// Highest first, so that the stack hands out the lowest port first.
	for port := int(p.hi); port >= int(p.lo); port-- {
		if bound[uint16(port)] {
			p.excluded++
			continue
		}
		p.free = append(p.free, uint16(port))
	}
	if len(p.free) == 0 {
		p.closeSockets()
		return nil, fmt.Errorf("syn ports %d-%d: every one is held by a local socket", p.lo, p.hi)
	}
	p.reserve()
	for i := range p.rhdrs {
		p.iovs[i].Base = &p.bufs[i][0]
		p.iovs[i].SetLen(len(p.bufs[i]))
	}
	return p, nil
}

func rawSocket(family, proto int, filter []unix.SockFilter) (int, error) {
	fd, err := unix.Socket(family, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return -1, os.NewSyscallError("socket", err)
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &prog); err != nil {
		unix.Close(fd)
		return -1, os.NewSyscallError("setsockopt SO_ATTACH_FILTER", err)
	}
	// Room for the answers of a poll period (and more); FORCE passes rmem_max
	// with CAP_NET_ADMIN.
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 4<<20) != nil {
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 1<<20)
	return fd, nil
}

// synFilter is the classic BPF program that keeps a raw socket's queue to the
// answers to its SYNs: TCP segments to a port in lo..hi with RST, or with SYN
// and ACK, set. An IPv4 raw socket sees the packet from the IP header on (the
// filter skips it by its IHL); an IPv6 one from the TCP header.
func synFilter(v6 bool, lo, hi uint16) []unix.SockFilter {
	skipIP := unix.SockFilter{Code: unix.BPF_LDX | unix.BPF_B | unix.BPF_MSH, K: 0} // x = 4*(ip[0]&0xf)
	if v6 {
		skipIP = unix.SockFilter{Code: unix.BPF_LDX | unix.BPF_W | unix.BPF_IMM, K: 0} // x = 0
	}
	return []unix.SockFilter{
		/* 0 */ skipIP,
		/* 1 */ {Code: unix.BPF_LD | unix.BPF_H | unix.BPF_IND, K: 2}, // destination port
		/* 2 */ {Code: unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K, Jt: 0, Jf: 6, K: uint32(lo)},
		/* 3 */ {Code: unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K, Jt: 5, Jf: 0, K: uint32(hi)},
		/* 4 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_IND, K: 13}, // flags
		/* 5 */ {Code: unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K, Jt: 2, Jf: 0, K: tcpRST},
		/* 6 */ {Code: unix.BPF_ALU | unix.BPF_AND | unix.BPF_K, K: tcpSYN | tcpACK},
		/* 7 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 1, K: tcpSYN | tcpACK},
		/* 8 */ {Code: unix.BPF_RET | unix.BPF_K, K: 128}, // IP header, TCP header: all we read
		/* 9 */ {Code: unix.BPF_RET | unix.BPF_K, K: 0},
	}
}

// unreachFilter is the classic BPF program that keeps a raw ICMP (ICMPv6)
// socket's queue to the destination unreachables about our SYNs: type 3 (1),
// quoting a TCP segment from a port in lo..hi. An IPv4 raw socket sees the
// packet from the outer IP header on, and the quoted IP header has a length
// of its own; an ICMPv6 one from the ICMPv6 header, and the quoted IPv6
// header is 40 bytes (a SYN of ours has no extension headers).
func unreachFilter(v6 bool, lo, hi uint16) []unix.SockFilter {
	if v6 {
		return []unix.SockFilter{
			/* 0 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_ABS, K: 0}, // type
			/* 1 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 6, K: 1},
			/* 2 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_ABS, K: 8 + 6}, // quoted next header
			/* 3 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 4, K: unix.IPPROTO_TCP},
			/* 4 */ {Code: unix.BPF_LD | unix.BPF_H | unix.BPF_ABS, K: 8 + 40}, // quoted source port
			/* 5 */ {Code: unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K, Jt: 0, Jf: 2, K: uint32(lo)},
			/* 6 */ {Code: unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K, Jt: 1, Jf: 0, K: uint32(hi)},
			/* 7 */ {Code: unix.BPF_RET | unix.BPF_K, K: 128},
			/* 8 */ {Code: unix.BPF_RET | unix.BPF_K, K: 0},
		}
	}
	return []unix.SockFilter{
		/* 0 */ {Code: unix.BPF_LDX | unix.BPF_B | unix.BPF_MSH, K: 0}, // x = outer IP header length
		/* 1 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_IND, K: 0}, // type
		/* 2 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 11, K: 3},
		/* 3 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_IND, K: 8 + 9}, // quoted protocol
		/* 4 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 9, K: unix.IPPROTO_TCP},
		/* 5 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_IND, K: 8}, // quoted version and IHL
		/* 6 */ {Code: unix.BPF_ALU | unix.BPF_AND | unix.BPF_K, K: 0x0f},
		/* 7 */ {Code: unix.BPF_ALU | unix.BPF_LSH | unix.BPF_K, K: 2},
		/* 8 */ {Code: unix.BPF_ALU | unix.BPF_ADD | unix.BPF_X},
		/* 9 */ {Code: unix.BPF_MISC | unix.BPF_TAX}, // x = both headers' lengths
		/* 10 */ {Code: unix.BPF_LD | unix.BPF_H | unix.BPF_IND, K: 8}, // quoted source port
		/* 11 */ {Code: unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K, Jt: 0, Jf: 2, K: uint32(lo)},
		/* 12 */ {Code: unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K, Jt: 1, Jf: 0, K: uint32(hi)},
		/* 13 */ {Code: unix.BPF_RET | unix.BPF_K, K: 128},
		/* 14 */ {Code: unix.BPF_RET | unix.BPF_K, K: 0},
	}
}

// boundPorts lists the ports of lo..hi that a TCP socket of this namespace
// holds now (bound before the range was reserved, bound explicitly — the
// reservation only keeps the kernel from choosing them — or in TIME_WAIT). A
// SYN-ACK to such a port could reach that socket, so checks never use them. It
// tries to bind a wildcard socket to each port, which fails exactly when some
// socket holds it: a few milliseconds for the range, where reading
// /proc/net/tcp would take as long as the host has sockets (hundreds of
// thousands of TIME_WAITs on a busy balancer).
func boundPorts(lo, hi uint16) map[uint16]bool {
	bound := make(map[uint16]bool)
	family, v6 := unix.AF_INET6, true
	if fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
		family, v6 = unix.AF_INET, false // no IPv6: IPv4 alone
	} else {
		unix.Close(fd)
	}
	for port := int(lo); port <= int(hi); port++ {
		fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			continue
		}
		var sa unix.Sockaddr = &unix.SockaddrInet4{Port: port}
		if v6 {
			unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0) // [::] covers IPv4 too
			sa = &unix.SockaddrInet6{Port: port}
		}
		if err := unix.Bind(fd, sa); err == unix.EADDRINUSE {
			bound[uint16(port)] = true
		}
		unix.Close(fd)
	}
	return bound
}

// reserve adds the range to ip_local_reserved_ports unless it is there already,
// remembering what to restore.
func (p *synProber) reserve() {
	b, err := os.ReadFile(reservedPortsFile)
	if err != nil {
		p.reserveErr = fmt.Errorf("reserve ports %d-%d: %w", p.lo, p.hi, err)
		return
	}
	old := strings.TrimSpace(string(b))
	next, changed, err := reservedPorts(old, p.lo, p.hi)
	if err != nil {
		p.reserveErr = fmt.Errorf("reserve ports %d-%d: %s: %w", p.lo, p.hi, reservedPortsFile, err)
		return
	}
	if !changed {
		return
	}
	if err := os.WriteFile(reservedPortsFile, []byte(next), 0o644); err != nil {
		p.reserveErr = fmt.Errorf("reserve ports %d-%d: %w", p.lo, p.hi, err)
		return
	}
	p.restore = &old
}

// close ends every check in flight with errSynClosed, closes the sockets and
// restores ip_local_reserved_ports if open changed it. The caller must be
// Run's goroutine, on a thread of the namespace open ran in.
func (p *synProber) close() {
	p.mu.Lock()
	p.ended = p.ended[:0]
	for i := range p.checks {
		if sc := &p.checks[i]; sc.live {
			p.ended = append(p.ended, endedCheck{b: sc.b, err: errSynClosed})
			p.release(p.lo+uint16(i), sc)
		}
	}
	p.mu.Unlock()
	p.finish(time.Now())
	p.closeSockets()
	if p.restore != nil {
		// With a newline: the kernel ignores an empty write.
		os.WriteFile(reservedPortsFile, []byte(*p.restore+"\n"), 0o644)
	}
}

func (p *synProber) closeSockets() {
	for _, fd := range []int{p.fd4, p.fd6, p.icmp4, p.icmp6, p.routes} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// takePort returns a free source port, if there is one.
func (p *synProber) takePort() (uint16, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.free)
	if n == 0 {
		return 0, false
	}
	port := p.free[n-1]
	p.free = p.free[:n-1]
	return port, true
}

// putPort gives back a port that takePort returned and no check used.
func (p *synProber) putPort(port uint16) {
	p.mu.Lock()
	p.free = append(p.free, port)
	p.mu.Unlock()
}

// freePorts counts the ports no check holds.
func (p *synProber) freePorts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.free)
}

// queue starts a check of b at dst from port (taken with takePort), sent at
// now: it registers the check and adds its SYN to the batch that the next
// flush sends. The check ends, through done, with nil for a SYN-ACK, a
// "connect: connection refused" error for an RST, or a timeout error once
// timeout has passed and a poll sees it. done is called at once, before queue
// returns, if there is no route to dst.
func (p *synProber) queue(now time.Time, b *backend, dst netip.AddrPort, source netip.Addr, port uint16, seq uint32, timeout time.Duration) {
	daddr := dst.Addr().Unmap()
	src, err := p.source(daddr, source, now, &b.synSrc)
	if err != nil {
		p.putPort(port)
		p.done(b, err, now)
		return
	}
	v6 := !daddr.Is4()
	p.mu.Lock()
	p.checks[port-p.lo] = synCheck{live: true, seq: seq, dst: netip.AddrPortFrom(daddr, dst.Port()), b: b}
	if v6 {
		p.n6++
	} else {
		p.n4++
	}
	p.mu.Unlock()
	p.deadlineQueue(timeout).push(deadline{at: int64(now.Add(timeout).Sub(p.epoch)), port: port, seq: seq})

	var o *outSYN
	if n := len(p.spare); n > 0 {
		o, p.spare = p.spare[n-1], p.spare[:n-1]
	} else {
		o = new(outSYN)
	}
	o.port, o.seq, o.v6 = port, seq, v6
	if !v6 {
		p.ipID++
		buildIPv4(o.pkt[:], src.As4(), daddr.As4(), p.ipID|1)
		buildSYN(o.pkt[ipv4Len:], src, daddr, port, dst.Port(), seq)
		o.n = ipv4Len + synLen
		o.sa4 = unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: daddr.As4()}
		o.oob = pktInfo4(o.oobBuf[:], src.As4())
	} else {
		buildSYN(o.pkt[:], src, daddr, port, dst.Port(), seq)
		o.n = synLen
		o.sa6 = unix.RawSockaddrInet6{Family: unix.AF_INET6, Addr: daddr.As16()}
		if z := dst.Addr().Zone(); z != "" {
			if ifi, err := net.InterfaceByName(z); err == nil {
				o.sa6.Scope_id = uint32(ifi.Index)
			}
		}
		o.oob = pktInfo6(o.oobBuf[:], src.As16())
	}
	p.out = append(p.out, o)
}

// deadlineQueue returns the queue of checks with this timeout, made on first use.
func (p *synProber) deadlineQueue(timeout time.Duration) *deadlineQueue {
	for _, d := range p.deadlines {
		if d.timeout == timeout {
			return d
		}
	}
	d := &deadlineQueue{timeout: timeout, err: &timeoutError{op: "connect", after: timeout}}
	p.deadlines = append(p.deadlines, d)
	return d
}

func (d *deadlineQueue) push(e deadline) {
	if d.head > 1024 && d.head > len(d.q)/2 {
		n := copy(d.q, d.q[d.head:])
		d.q = d.q[:n]
		d.head = 0
	}
	d.q = append(d.q, e)
}

// outSYN is a queued SYN with everything sendmmsg points to.
type outSYN struct {
	pkt [ipv4Len + synLen]byte // IPv4: the IP header too (IP_HDRINCL)
	n   int
	sa4 unix.RawSockaddrInet4
	sa6 unix.RawSockaddrInet6
	oob []byte // points into oobBuf
	iov unix.Iovec
	// room for the IP_PKTINFO or IPV6_PKTINFO control message
	oobBuf [64]byte
	port   uint16
	seq    uint32
	v6     bool
}

// sendBatch caps the SYNs of one sendmmsg. After a stall the scheduler may
// start hundreds of checks at once; sent back to back they would overflow a
// device queue (a veth ring holds 256 packets) and time out as lost. Between
// two calls the device's receive path gets a chance to drain.
const sendBatch = 32

// flush sends the queued SYNs, one sendmmsg per family for a whole batch of
// checks: one system call, and one wakeup of the device's receive path, for
// tens of checks. A SYN that cannot be sent ends its check at once, unless
// TCP would take it as lost (then it times out).
func (p *synProber) flush(now time.Time) {
	if len(p.out) == 0 {
		return
	}
	p.mu.Lock()
	p.ended = p.ended[:0]
	p.mu.Unlock()
	for _, v6 := range []bool{false, true} {
		p.hdrs, p.msgs = p.hdrs[:0], p.msgs[:0]
		for _, o := range p.out {
			if o.v6 != v6 {
				continue
			}
			var h unix.Mmsghdr
			o.iov.Base = &o.pkt[0]
			o.iov.SetLen(o.n)
			if v6 {
				h.Hdr.Name = (*byte)(unsafe.Pointer(&o.sa6))
				h.Hdr.Namelen = unix.SizeofSockaddrInet6
			} else {
				h.Hdr.Name = (*byte)(unsafe.Pointer(&o.sa4))
				h.Hdr.Namelen = unix.SizeofSockaddrInet4
			}
			h.Hdr.Iov = &o.iov
			h.Hdr.SetIovlen(1)
			h.Hdr.Control = &o.oob[0]
			h.Hdr.SetControllen(len(o.oob))
			p.hdrs = append(p.hdrs, h)
			p.msgs = append(p.msgs, o)
		}
		if len(p.hdrs) == 0 {
			continue
		}
		fd := p.fd4
		if v6 {
			fd = p.fd6
		}
		if fd < 0 {
			for _, o := range p.msgs {
				p.fail(o, unix.EAFNOSUPPORT)
			}
			continue
		}
		for i, waited := 0, false; i < len(p.hdrs); {
			n, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(fd), uintptr(unsafe.Pointer(&p.hdrs[i])), uintptr(min(len(p.hdrs)-i, sendBatch)), 0, 0, 0)
			switch errno {
			case 0:
				i += int(n)
			case unix.EINTR:
			case unix.EAGAIN:
				// The socket's send buffer is full. Wait a little for room;
				// if there is none, the rest are lost and time out.
				if waited {
					i = len(p.hdrs)
					break
				}
				waited = true
				unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}, 10)
			default:
				// The first message failed; the rest are unsent.
				p.fail(p.msgs[i], errno)
				i++
			}
		}
		runtime.KeepAlive(p.msgs)
	}
	p.spare = append(p.spare, p.out...)
	clear(p.out)
	p.out = p.out[:0]
	clear(p.msgs)
	p.finish(now)
}

// fail ends the check of o, whose SYN could not be sent, unless TCP would
// take the SYN as lost: a local firewall dropped it (netfilter's drop is EPERM
// to a raw socket) or a queue was full. That check times out, as TCP would.
func (p *synProber) fail(o *outSYN, errno syscall.Errno) {
	switch errno {
	case unix.EPERM, unix.ENOBUFS:
		return
	}
	p.mu.Lock()
	if sc := &p.checks[o.port-p.lo]; sc.live && sc.seq == o.seq {
		p.ended = append(p.ended, endedCheck{b: sc.b, err: &os.SyscallError{Syscall: "connect", Err: errno}}) // "connect: network is unreachable"
		p.release(o.port, sc)
	}
	p.mu.Unlock()
}

// release frees the port of sc, which is live; p.mu must be held.
func (p *synProber) release(port uint16, sc *synCheck) {
	if sc.dst.Addr().Is4() {
		p.n4--
	} else {
		p.n6--
	}
	*sc = synCheck{}
	p.free = append(p.free, port)
}

// finish calls done for the checks that ended, collected in p.ended.
func (p *synProber) finish(now time.Time) {
	for i, e := range p.ended {
		p.ended[i] = endedCheck{}
		p.done(e.b, e.err, now)
	}
	p.ended = p.ended[:0]
}

// drop forgets the check holding port, if it is still the one with seq, and
// frees the port, without calling done: its backend is gone. Any goroutine
// may call it.
func (p *synProber) drop(port uint16, seq uint32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if sc := &p.checks[port-p.lo]; sc.live && sc.seq == seq {
		p.release(port, sc)
	}
}

// source is the address a SYN to dst leaves from: want if valid, else the one
// the kernel's routing picks (asked with a connected UDP socket, which sends
// nothing, and remembered in cache, the backend's, for srcTTL). It has to be
// known before the SYN is sent, for the TCP checksum, and the SYN then carries
// it in IP_PKTINFO.
func (p *synProber) source(dst, want netip.Addr, now time.Time, cache *srcEntry) (netip.Addr, error) {
	if want.IsValid() {
		if want.Is4() != dst.Is4() {
			return netip.Addr{}, fmt.Errorf("connect: source %v and backend %v differ in address family", want, dst)
		}
		return want, nil
	}
	ttl := srcTTL
	if p.routes < 0 {
		ttl = srcTTLUnwatched
	}
	if cache.dst == dst && cache.gen == p.srcGen && now.Sub(cache.at) < ttl {
		return cache.addr, nil
	}
	family, sa := unix.AF_INET6, unix.Sockaddr(&unix.SockaddrInet6{Port: 9, Addr: dst.As16()})
	if dst.Is4() {
		family, sa = unix.AF_INET, &unix.SockaddrInet4{Port: 9, Addr: dst.As4()}
	}
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return netip.Addr{}, os.NewSyscallError("connect", err)
	}
	defer unix.Close(fd)
	if err := unix.Connect(fd, sa); err != nil {
		return netip.Addr{}, os.NewSyscallError("connect", err) // "connect: network is unreachable"
	}
	local, err := unix.Getsockname(fd)
	if err != nil {
		return netip.Addr{}, os.NewSyscallError("getsockname", err)
	}
	var src netip.Addr
	switch a := local.(type) {
	case *unix.SockaddrInet4:
		src = netip.AddrFrom4(a.Addr)
	case *unix.SockaddrInet6:
		src = netip.AddrFrom16(a.Addr)
	}
	*cache = srcEntry{dst: dst, addr: src, at: now, gen: p.srcGen}
	return src, nil
}

// recvBatch is how many answers one recvmmsg reads at most.
const recvBatch = 64

// poll reads the answers waiting in the sockets and ends the checks they
// answer, then ends the checks whose deadline passed by now. Run calls it when
// it wakes, and wakes for it at wakeAt; a call within synMinPoll of the last
// one reads nothing unless a deadline is due.
func (p *synProber) poll(now time.Time) {
	p.readRoutes(now)
	if now.Sub(p.lastPoll) < synMinPoll && !p.deadlineDue(now) {
		return
	}
	p.lastPoll = now
	p.mu.Lock()
	p.ended = p.ended[:0]
	n4, n6 := p.n4, p.n6
	p.mu.Unlock()
	// A socket with no check of its family in flight holds only late or
	// foreign answers: not worth a system call.
	if n4 > 0 {
		p.read(p.fd4, false, false)
		if p.icmp4 >= 0 {
			p.read(p.icmp4, false, true)
		}
	}
	if n6 > 0 && p.fd6 >= 0 {
		p.read(p.fd6, true, false)
		if p.icmp6 >= 0 {
			p.read(p.icmp6, true, true)
		}
	}
	p.expire(now)
	p.finish(now)
}

// read drains fd, a TCP or an ICMP socket, collecting the checks its answers
// end in p.ended.
func (p *synProber) read(fd int, v6, icmp bool) {
	for {
		for i := range p.rhdrs {
			p.rhdrs[i] = unix.Mmsghdr{}
			p.rhdrs[i].Hdr.Iov = &p.iovs[i]
			p.rhdrs[i].Hdr.SetIovlen(1)
			if v6 {
				p.rhdrs[i].Hdr.Name = (*byte)(unsafe.Pointer(&p.names[i]))
				p.rhdrs[i].Hdr.Namelen = unix.SizeofSockaddrInet6
			}
		}
		n, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&p.rhdrs[0])), recvBatch, unix.MSG_DONTWAIT, 0, 0)
		switch errno {
		case 0:
		case unix.EINTR:
			continue
		default: // EAGAIN: drained
			return
		}
		p.mu.Lock()
		for i := range int(n) {
			b := p.bufs[i][:min(int(p.rhdrs[i].Len), len(p.bufs[i]))]
			if icmp {
				if u, ok := parseUnreachable(b, v6); ok {
					p.unreachable(u)
				}
				continue
			}
			var seg segment
			var ok bool
			if v6 {
				seg, ok = parseTCP(b, netip.AddrFrom16(p.names[i].Addr).Unmap())
			} else {
				seg, ok = parseIPv4TCP(b)
			}
			if ok {
				p.answer(seg)
			}
		}
		p.mu.Unlock()
		if int(n) < recvBatch {
			return // drained when it returned
		}
	}
}

// answer ends the check that seg answers, if any; p.mu must be held.
func (p *synProber) answer(seg segment) {
	if seg.dport < p.lo || seg.dport > p.hi {
		return
	}
	sc := &p.checks[seg.dport-p.lo]
	if !sc.live || sc.dst.Addr() != seg.src || sc.dst.Port() != seg.sport || seg.flags&tcpACK == 0 || seg.ack != sc.seq+1 {
		return // another checker's, a late answer to a check that timed out, or noise
	}
	var err error
	switch {
	case seg.flags&tcpRST != 0:
		err = errRefused
	case seg.flags&(tcpSYN|tcpACK) == tcpSYN|tcpACK:
	default:
		return
	}
	p.ended = append(p.ended, endedCheck{b: sc.b, err: err})
	p.release(seg.dport, sc)
}

// watchRoutes opens a netlink socket that receives the kernel's messages
// about IPv4 and IPv6 addresses, routes and rules of this namespace, or
// returns -1.
func watchRoutes() int {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return -1
	}
	groups := uint32(unix.RTMGRP_IPV4_IFADDR | unix.RTMGRP_IPV4_ROUTE | unix.RTMGRP_IPV4_RULE | unix.RTMGRP_IPV6_IFADDR | unix.RTMGRP_IPV6_ROUTE)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: groups}); err != nil {
		unix.Close(fd)
		return -1
	}
	unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_ADD_MEMBERSHIP, unix.RTNLGRP_IPV6_RULE)
	return fd
}

// readRoutes drains the netlink socket, at most once per synMinPoll, and
// drops the remembered source addresses if anything changed (or if messages
// were lost: ENOBUFS).
func (p *synProber) readRoutes(now time.Time) {
	if p.routes < 0 || now.Sub(p.lastRoutes) < synMinPoll {
		return
	}
	p.lastRoutes = now
	var buf [4096]byte // a message longer than this is cut short: only its arrival counts
	changed := false
	for {
		_, err := unix.Read(p.routes, buf[:])
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			break
		}
		changed = true
		if err != nil && err != unix.ENOBUFS {
			break
		}
	}
	if changed {
		p.srcGen++
	}
}

// unreachable ends the check whose SYN u quotes, if any; p.mu must be held.
func (p *synProber) unreachable(u unreach) {
	if u.sport < p.lo || u.sport > p.hi || u.err == 0 {
		return
	}
	sc := &p.checks[u.sport-p.lo]
	if !sc.live || sc.dst.Addr() != u.dst || sc.dst.Port() != u.dport || u.seq != sc.seq {
		return
	}
	p.ended = append(p.ended, endedCheck{b: sc.b, err: &os.SyscallError{Syscall: "connect", Err: u.err}})
	p.release(u.sport, sc)
}

// unreach is what the receive path reads of a destination unreachable: the
// SYN it quotes and the error a connect would return for it, which is zero
// for "fragmentation needed", no verdict on the backend.
type unreach struct {
	dst          netip.Addr
	sport, dport uint16
	seq          uint32
	err          syscall.Errno
}

// The errors of connect for the codes of ICMP and ICMPv6 destination
// unreachables, as Linux's icmp_err_convert and icmpv6_err_convert give them.
var (
	unreachErrs4 = [...]syscall.Errno{unix.ENETUNREACH, unix.EHOSTUNREACH, unix.ENOPROTOOPT, unix.ECONNREFUSED, 0,
		unix.EOPNOTSUPP, unix.ENETUNREACH, unix.EHOSTDOWN, unix.ENONET, unix.ENETUNREACH, unix.EHOSTUNREACH,
		unix.ENETUNREACH, unix.EHOSTUNREACH, unix.EHOSTUNREACH, unix.EHOSTUNREACH, unix.EHOSTUNREACH}
	unreachErrs6 = [...]syscall.Errno{unix.ENETUNREACH, unix.EACCES, unix.EHOSTUNREACH, unix.EHOSTUNREACH,
		unix.ECONNREFUSED, unix.EACCES, unix.EACCES}
)

// parseUnreachable reads a destination unreachable as a raw ICMP socket
// returns it (from the IP header on) or an ICMPv6 one does (from the ICMPv6
// header on).
func parseUnreachable(b []byte, v6 bool) (unreach, bool) {
	var u unreach
	var tcp []byte
	if v6 {
		if len(b) < 8+40+8 || b[0] != 1 || b[8+6] != unix.IPPROTO_TCP {
			return u, false
		}
		if int(b[1]) < len(unreachErrs6) {
			u.err = unreachErrs6[b[1]]
		}
		u.dst = netip.AddrFrom16([16]byte(b[8+24 : 8+40])).Unmap()
		tcp = b[8+40:]
	} else {
		if len(b) < 20 || b[0]>>4 != 4 {
			return u, false
		}
		// The kernel checks the header's length before a raw socket gets
		// the packet; a buffer shorter than the packet would still cut it.
		ihl := int(b[0]&0x0f) * 4
		if ihl < 20 || len(b) < ihl {
			return u, false
		}
		icmp := b[ihl:]
		if len(icmp) < 8+20 || icmp[0] != 3 || icmp[8]>>4 != 4 || icmp[8+9] != unix.IPPROTO_TCP {
			return u, false
		}
		if int(icmp[1]) < len(unreachErrs4) {
			u.err = unreachErrs4[icmp[1]]
		}
		inner := icmp[8:]
		u.dst = netip.AddrFrom4([4]byte(inner[16:20]))
		if ihl := int(inner[0]&0x0f) * 4; ihl >= 20 && len(inner) >= ihl {
			tcp = inner[ihl:]
		}
	}
	if len(tcp) < 8 {
		return u, false // RFC 792 quotes 8 bytes: the ports and the sequence number
	}
	u.sport, u.dport = binary.BigEndian.Uint16(tcp[0:]), binary.BigEndian.Uint16(tcp[2:])
	u.seq = binary.BigEndian.Uint32(tcp[4:])
	return u, true
}

// expire collects in p.ended the checks whose deadline passed by now.
func (p *synProber) expire(now time.Time) {
	at := int64(now.Sub(p.epoch))
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range p.deadlines {
		for ; d.head < len(d.q); d.head++ {
			e := d.q[d.head]
			sc := &p.checks[e.port-p.lo]
			if sc.live && sc.seq == e.seq {
				if e.at > at {
					break
				}
				p.ended = append(p.ended, endedCheck{b: sc.b, err: d.err})
				p.release(e.port, sc)
			}
		}
		if d.head == len(d.q) {
			d.q, d.head = d.q[:0], 0
		}
	}
}

// deadlineDue reports whether some deadline queue's head is due by now.
func (p *synProber) deadlineDue(now time.Time) bool {
	at := int64(now.Sub(p.epoch))
	for _, d := range p.deadlines {
		if d.head < len(d.q) && d.q[d.head].at <= at {
			return true
		}
	}
	return false
}

// wakeAt is when Run must next call poll, if any check is in flight: a poll
// period after the last, or the first deadline if sooner.
func (p *synProber) wakeAt() (time.Time, bool) {
	p.mu.Lock()
	n := p.n4 + p.n6
	p.mu.Unlock()
	if n == 0 {
		return time.Time{}, false
	}
	w := p.lastPoll.Add(synPoll)
	for _, d := range p.deadlines {
		if d.head < len(d.q) {
			// The head may belong to a check that has ended: an early
			// wakeup at worst, and expire then drops it.
			if at := p.epoch.Add(time.Duration(d.q[d.head].at)); at.Before(w) {
				w = at
			}
		}
	}
	return w, true
}

// newSeq is the initial sequence number of a check's SYN.
func newSeq() uint32 { return rand.Uint32() }

func (p *synProber) excludedPorts() int  { return p.excluded }
func (p *synProber) reserveError() error { return p.reserveErr }

// pktInfo4 writes an IP_PKTINFO control message with source src into b, as
// unix.PktInfo4 does without allocating.
func pktInfo4(b []byte, src [4]byte) []byte {
	b = b[:unix.CmsgSpace(unix.SizeofInet4Pktinfo)]
	clear(b)
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = unix.IPPROTO_IP, unix.IP_PKTINFO
	h.SetLen(unix.CmsgLen(unix.SizeofInet4Pktinfo))
	info := (*unix.Inet4Pktinfo)(unsafe.Pointer(&b[unix.CmsgLen(0)]))
	info.Spec_dst = src
	return b
}

// pktInfo6 writes an IPV6_PKTINFO control message with source src into b.
func pktInfo6(b []byte, src [16]byte) []byte {
	b = b[:unix.CmsgSpace(unix.SizeofInet6Pktinfo)]
	clear(b)
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = unix.IPPROTO_IPV6, unix.IPV6_PKTINFO
	h.SetLen(unix.CmsgLen(unix.SizeofInet6Pktinfo))
	info := (*unix.Inet6Pktinfo)(unsafe.Pointer(&b[unix.CmsgLen(0)]))
	info.Addr = src
	return b
}
