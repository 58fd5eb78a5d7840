package health

import (
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

// srcTTL is how long a kernel-chosen source address is reused for a destination
// before the route is asked again.
const srcTTL = 30 * time.Second

// synProber sends the SYNs of every syn check through one raw socket per
// address family and matches the answers, which one kernel socket filter per
// socket selects from all the host's TCP traffic: SYN-ACKs and RSTs to the
// reserved port range. A check holds one port of the range from its SYN to its
// answer or timeout; the free ports are a channel, so the range also bounds the
// checks in flight.
type synProber struct {
	lo, hi uint16
	free   chan uint16
	f4, f6 *os.File // raw sockets, non-blocking, on the runtime's poller; f6 nil without IPv6
	// restore is what ip_local_reserved_ports held before, if open changed it.
	restore    *string
	reserveErr error // why the range is not reserved; nil if it is
	excluded   int   // ports of the range left out because a socket had them
	wg         sync.WaitGroup

	// The SYNs queued for the next flush, and what sendmmsg reads; Run's
	// goroutine alone touches them.
	out, spare []*outSYN
	msgs       []*outSYN
	hdrs       []unix.Mmsghdr

	mu      sync.Mutex
	pending map[uint16]*synCheck // by source port
	srcs    map[netip.Addr]srcEntry
}

type synCheck struct {
	dst   netip.AddrPort
	seq   uint32
	timer *time.Timer
	done  func(error)
}

type srcEntry struct {
	addr netip.Addr
	at   time.Time
}

// openSyn opens the raw sockets and reserves the port range, in the network
// namespace of the calling thread. It fails only if the IPv4 raw socket cannot
// be opened (no CAP_NET_RAW, say); a range that cannot be reserved is reported
// in reserveErr.
func openSyn(ports [2]uint16) (*synProber, error) {
	p := &synProber{lo: ports[0], hi: ports[1], pending: make(map[uint16]*synCheck), srcs: make(map[netip.Addr]srcEntry)}
	var err error
	if p.f4, err = rawSocket(unix.AF_INET, synFilter(false, p.lo, p.hi)); err != nil {
		return nil, err
	}
	if p.f6, err = rawSocket(unix.AF_INET6, synFilter(true, p.lo, p.hi)); err != nil {
		p.f6 = nil // no IPv6 here: IPv6 checks fail to send
	}
	bound := boundPorts(p.lo, p.hi)
	p.free = make(chan uint16, int(p.hi)-int(p.lo)+1)
	for port := int(p.lo); port <= int(p.hi); port++ {
		if bound[uint16(port)] {
			p.excluded++
			continue
		}
		p.free <- uint16(port)
	}
	p.reserve()
	for _, f := range []*os.File{p.f4, p.f6} {
		if f == nil {
			continue
		}
		p.wg.Add(1)
		// Exits when close closes f.
		go func() {
			defer p.wg.Done()
			p.receive(f, f == p.f6)
		}()
	}
	return p, nil
}

func rawSocket(family int, filter []unix.SockFilter) (*os.File, error) {
	fd, err := unix.Socket(family, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &prog); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("setsockopt SO_ATTACH_FILTER", err)
	}
	// Room for a burst of answers; FORCE passes rmem_max with CAP_NET_ADMIN.
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 4<<20) != nil {
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 1<<20)
	return os.NewFile(uintptr(fd), "weir-health-syn"), nil
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

// close stops the receive loops, ends every check in flight with errSynClosed
// and restores ip_local_reserved_ports if open changed it. The caller must be
// on a thread of the namespace open ran in.
func (p *synProber) close() {
	p.f4.Close()
	if p.f6 != nil {
		p.f6.Close()
	}
	p.wg.Wait()
	p.mu.Lock()
	var ended []*synCheck
	for port, sc := range p.pending {
		delete(p.pending, port)
		sc.timer.Stop()
		ended = append(ended, sc)
	}
	p.mu.Unlock()
	for _, sc := range ended {
		sc.done(errSynClosed)
	}
	if p.restore != nil {
		// With a newline: the kernel ignores an empty write.
		os.WriteFile(reservedPortsFile, []byte(*p.restore+"\n"), 0o644)
	}
}

// queue starts a check of dst from port: it registers the check and adds
// its SYN to the batch that the next flush sends, and arranges for done to be
// called once, with nil for a SYN-ACK, a "connect: connection refused" error
// for an RST, or a timeout error after timeout. It calls done itself, before
// it returns, if there is no route to dst. done runs without any lock of the
// prober held, on the prober's goroutines, a timer's, or flush's caller's.
// Only one goroutine (Run's) calls queue and flush.
func (p *synProber) queue(dst netip.AddrPort, source netip.Addr, port uint16, seq uint32, timeout time.Duration, done func(error)) {
	daddr := dst.Addr().Unmap()
	src, err := p.source(daddr, source)
	if err != nil {
		p.free <- port
		done(err)
		return
	}
	sc := &synCheck{dst: netip.AddrPortFrom(daddr, dst.Port()), seq: seq, done: done}
	p.mu.Lock()
	p.pending[port] = sc
	sc.timer = time.AfterFunc(timeout, func() {
		p.end(port, seq, &timeoutError{op: "connect", after: timeout})
	})
	p.mu.Unlock()

	var o *outSYN
	if n := len(p.spare); n > 0 {
		o, p.spare = p.spare[n-1], p.spare[:n-1]
	} else {
		o = new(outSYN)
	}
	buildSYN(o.pkt[:], src, daddr, port, dst.Port(), seq)
	o.port, o.seq, o.v6 = port, seq, !daddr.Is4()
	if daddr.Is4() {
		o.sa4 = unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: daddr.As4()}
		o.oob = pktInfo4(o.oobBuf[:], src.As4())
	} else {
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

// outSYN is a queued SYN with everything sendmmsg points to.
type outSYN struct {
	pkt [synLen]byte
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
// tens of checks.
func (p *synProber) flush() {
	if len(p.out) == 0 {
		return
	}
	var failed []*outSYN
	var errs []error
	for _, v6 := range []bool{false, true} {
		p.hdrs, p.msgs = p.hdrs[:0], p.msgs[:0]
		for _, o := range p.out {
			if o.v6 != v6 {
				continue
			}
			var h unix.Mmsghdr
			o.iov.Base = &o.pkt[0]
			o.iov.SetLen(synLen)
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
		f := p.f4
		if v6 {
			f = p.f6
		}
		if f == nil {
			for _, o := range p.msgs {
				failed, errs = append(failed, o), append(errs, unix.EAFNOSUPPORT)
			}
			continue
		}
		rc, err := f.SyscallConn()
		if err != nil {
			continue // closed: close ends the checks
		}
		i := 0
		rc.Write(func(fd uintptr) bool {
			for i < len(p.hdrs) {
				n, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, fd, uintptr(unsafe.Pointer(&p.hdrs[i])), uintptr(min(len(p.hdrs)-i, sendBatch)), 0, 0, 0)
				switch errno {
				case 0:
					i += int(n)
				case unix.EINTR:
				case unix.EAGAIN:
					return false // wait until the socket has room
				default:
					// The first message failed; the rest are unsent.
					failed, errs = append(failed, p.msgs[i]), append(errs, errno)
					i++
				}
			}
			return true
		})
		runtime.KeepAlive(p.msgs)
	}
	for _, o := range p.out {
		p.spare = append(p.spare, o)
	}
	clear(p.out)
	p.out = p.out[:0]
	clear(p.msgs)
	for k, o := range failed {
		switch errs[k] {
		case unix.EPERM, unix.ENOBUFS:
			// A local firewall dropped the SYN (netfilter's drop is EPERM to
			// a raw socket) or a queue was full: TCP would take the SYN as
			// lost and time out, and so does the check.
		default:
			p.end(o.port, o.seq, &os.SyscallError{Syscall: "connect", Err: errs[k]}) // "connect: network is unreachable"
		}
	}
}

// end finishes the check holding port if it is still the one with seq, frees
// the port and calls its done with err.
func (p *synProber) end(port uint16, seq uint32, err error) {
	if sc := p.take(port, seq); sc != nil {
		sc.done(err)
	}
}

// drop forgets the check holding port, if it is still the one with seq, without
// calling its done: its backend is gone.
func (p *synProber) drop(port uint16, seq uint32) { p.take(port, seq) }

func (p *synProber) take(port uint16, seq uint32) *synCheck {
	p.mu.Lock()
	sc := p.pending[port]
	if sc == nil || sc.seq != seq {
		p.mu.Unlock()
		return nil
	}
	delete(p.pending, port)
	p.mu.Unlock()
	sc.timer.Stop()
	p.free <- port
	return sc
}

// source is the address a SYN to dst leaves from: want if valid, else the one
// the kernel's routing picks (asked with a connected UDP socket, which sends
// nothing, and remembered for srcTTL). It has to be known before the SYN is
// sent, for the TCP checksum, and the SYN then carries it in IP_PKTINFO.
func (p *synProber) source(dst, want netip.Addr) (netip.Addr, error) {
	if want.IsValid() {
		if want.Is4() != dst.Is4() {
			return netip.Addr{}, fmt.Errorf("connect: source %v and backend %v differ in address family", want, dst)
		}
		return want, nil
	}
	now := time.Now()
	p.mu.Lock()
	e, ok := p.srcs[dst]
	p.mu.Unlock()
	if ok && now.Sub(e.at) < srcTTL {
		return e.addr, nil
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
	p.mu.Lock()
	p.srcs[dst] = srcEntry{addr: src, at: now}
	p.mu.Unlock()
	return src, nil
}

// recvBatch is how many answers one recvmmsg reads at most.
const recvBatch = 32

// receive reads the answers that f's filter lets through until f is closed,
// up to recvBatch per system call.
func (p *synProber) receive(f *os.File, v6 bool) {
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	var (
		bufs  [recvBatch][128]byte // IP header (IPv4 only) and TCP header: all the filter passes
		names [recvBatch]unix.RawSockaddrInet6
		iovs  [recvBatch]unix.Iovec
		hdrs  [recvBatch]unix.Mmsghdr
	)
	for {
		err := rc.Read(func(fd uintptr) bool {
			for {
				for i := range hdrs {
					iovs[i].Base = &bufs[i][0]
					iovs[i].SetLen(len(bufs[i]))
					hdrs[i] = unix.Mmsghdr{}
					hdrs[i].Hdr.Iov = &iovs[i]
					hdrs[i].Hdr.SetIovlen(1)
					if v6 {
						hdrs[i].Hdr.Name = (*byte)(unsafe.Pointer(&names[i]))
						hdrs[i].Hdr.Namelen = unix.SizeofSockaddrInet6
					}
				}
				n, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, fd, uintptr(unsafe.Pointer(&hdrs[0])), recvBatch, unix.MSG_DONTWAIT, 0, 0)
				switch errno {
				case 0:
				case unix.EINTR:
					continue
				case unix.EAGAIN:
					return false // wait for the next answers
				default:
					return true
				}
				for i := range int(n) {
					b := bufs[i][:min(int(hdrs[i].Len), len(bufs[i]))]
					var seg segment
					var ok bool
					if v6 {
						seg, ok = parseTCP(b, netip.AddrFrom16(names[i].Addr).Unmap())
					} else {
						seg, ok = parseIPv4TCP(b)
					}
					if ok {
						p.answer(seg)
					}
				}
			}
		})
		runtime.KeepAlive(&bufs)
		if err != nil {
			return // f closed
		}
	}
}

// answer ends the check that seg answers, if any.
func (p *synProber) answer(seg segment) {
	p.mu.Lock()
	sc := p.pending[seg.dport]
	match := sc != nil && sc.dst.Addr() == seg.src && sc.dst.Port() == seg.sport &&
		seg.flags&tcpACK != 0 && seg.ack == sc.seq+1
	p.mu.Unlock()
	if !match {
		return // another checker's, a late answer to a check that timed out, or noise
	}
	var err error
	switch {
	case seg.flags&tcpRST != 0:
		err = &os.SyscallError{Syscall: "connect", Err: syscall.ECONNREFUSED}
	case seg.flags&(tcpSYN|tcpACK) == tcpSYN|tcpACK:
	default:
		return
	}
	p.end(seg.dport, sc.seq, err)
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
