package proxy

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// This file is the in-kernel forwarding path (Config.Redirector): once a connection's
// backend is connected, its two sockets are paired in a socket map and a BPF stream
// verdict program sends the bytes each receives out of the other, without waking the
// loop. The loop keeps the rest as on the copy path — the choice of backend, the
// accounting, limits, draining and timeouts — and still reads both sockets: a read
// returns only what the program handed to the proxy (the bytes that found no peer,
// see bpf/sockmap.c, which the copy path then forwards, in order) and, at the end,
// the EOF.
//
// The one thing the kernel does not forward is the FIN. At a source's EOF the loop
// half-closes the destination only once every byte the source received is in the
// destination's send queue: the redirect runs in a kernel worker, so the FIN can be
// seen before the last bytes have moved. The test compares two TCP counters:
// bytes received by the source (tcpi_bytes_received, which counts the FIN) against
// bytes queued on the destination (tcpi_bytes_acked + SIOCOUTQ, which on an actively
// opened socket counts its SYN), less what the proxy itself read and wrote. Until
// they agree the connection is checked again after a short wait.

// Redirector pairs the two sockets of a connection for in-kernel forwarding
// (loader.SockMap). Pair is called on the event loop, once per connection, and
// returns the sockets' cookies (client's, backend's); an error leaves the connection
// to the copy path, unless it has a method Lost() bool that reports true (bytes were
// lost on the way in: the connection is reset). Forget is called once per pair, with
// those cookies, after both sockets are closed (before, bytes that reach a socket
// would leave state behind that nothing deletes); it returns when the kernel first
// saw bytes of each socket (CLOCK_MONOTONIC, ns), 0 if it saw none.
type Redirector interface {
	Pair(client, server int) ([2]uint64, error)
	Forget(cookies [2]uint64) ([2]int64, error)
}

// Flush rechecks of connections whose kernel forwarding lags a FIN: the first after
// flushFirst, then twice as long each time up to timerTick while some are still
// waiting; a connection that starts waiting brings the next check back to flushFirst.
const flushFirst = 20_000 // ns

var (
	redirected   atomic.Uint64 // connections paired
	redirectErrs atomic.Uint64 // pairings that failed (the connection stayed on the copy path)
	flushWaits   atomic.Uint64 // EOFs that had to wait for the kernel to forward the rest
	kernelBytes  atomic.Uint64 // bytes the kernel forwarded
)

// tcpInfoRaw is getsockopt(TCP_INFO).
func tcpInfoRaw(fd int) (unix.TCPInfo, error) {
	var ti unix.TCPInfo
	l := uint32(unsafe.Sizeof(ti))
	_, _, e := unix.RawSyscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.IPPROTO_TCP, unix.TCP_INFO,
		uintptr(unsafe.Pointer(&ti)), uintptr(unsafe.Pointer(&l)), 0)
	return ti, errnoErr(e)
}

// outqRaw is ioctl(SIOCOUTQ): bytes in the send queue not yet acknowledged.
func outqRaw(fd int) (int, error) { return ioctlIntRaw(fd, unix.SIOCOUTQ) }

// inqRaw is ioctl(SIOCINQ): bytes in the receive queue not yet read.
func inqRaw(fd int) (int, error) { return ioctlIntRaw(fd, unix.SIOCINQ) }

func ioctlIntRaw(fd int, req uintptr) (int, error) {
	var n int32
	_, _, e := unix.RawSyscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(unsafe.Pointer(&n)))
	return int(n), errnoErr(e)
}

// kickRaw makes the kernel run a socket's data-ready path now (tcp_set_rcvlowat does),
// so bytes that were queued before the socket was paired are forwarded.
func kickRaw(fd int) error {
	one := int32(1)
	_, _, e := unix.RawSyscall6(unix.SYS_SETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT,
		uintptr(unsafe.Pointer(&one)), 4, 0)
	return errnoErr(e)
}

// redirect pairs c's sockets; if it can't, or the proxy has bytes of its own to send
// first, c stays on the copy path. It reports false if it closed c.
func (l *loop) redirect(c *conn) bool {
	r := l.s.cfg.Redirector
	if r == nil {
		return true
	}
	if c.h[up].pending() {
		// Bytes the proxy writes to the backend just before the pairing (the PROXY
		// protocol header, pending here until the copy path sends it) left a long upload stalled now and then, about 1 run in
		// 16 of 256 MiB (TestProxyHeaderThenBulk on the sockmap path), with bytes
		// stuck between the two sockets; the cause is not found. Such connections
		// stay on the copy path.
		return true
	}
	cookies, err := r.Pair(c.fd[client], c.fd[server])
	if err != nil {
		redirectErrs.Add(1)
		l.s.noteRedirectFailed(err)
		var lost interface{ Lost() bool }
		if errors.As(err, &lost) && lost.Lost() {
			// Client bytes are stuck where nobody can read them: the connection
			// can't go on intact.
			setLinger0(c.fd[client])
			setLinger0(c.fd[server])
			c.reset = true
			l.close(c, OutcomeReset)
			return false
		}
		return true
	}
	redirected.Add(1)
	c.redirected, c.cookies = true, cookies
	kickRaw(c.fd[server])
	kickRaw(c.fd[client])
	return true
}

// kernelMoved returns how many bytes of direction d the kernel has forwarded and
// whether it has forwarded all that the source received (valid once the source is
// at EOF). On an error it reports true: the connection is then ended by the error
// path, with nothing more to wait for.
func (l *loop) kernelMoved(c *conn, d int) (uint64, bool) {
	p, ok := l.kernelProgress(c, d)
	if !ok {
		return 0, true
	}
	// received counts the FIN once it is in; queued never does.
	return p.queued, p.queued+1 >= p.received
}

// kernelCount is where the kernel's forwarding of one direction stands.
type kernelCount struct {
	queued   uint64 // bytes in the destination's send queue or acknowledged, not written by the proxy
	received uint64 // bytes the source received and the proxy did not read, its FIN included once in
	finIn    bool   // the source has received its peer's FIN
	closed   bool   // the source is closed (TCP_CLOSE): its FIN may be in, or not (kernelHolds)
}

// holds reports whether the source has received bytes that are neither in the
// destination's send queue nor read by the proxy: the kernel holds them still,
// on their way.
func (k kernelCount) holds() bool {
	received := k.received
	if k.finIn {
		received-- // the FIN, which tcpi_bytes_received counts
	}
	return received > k.queued
}

// kernelProgress reads direction d's kernelCount from both sockets' counters.
func (l *loop) kernelProgress(c *conn, d int) (kernelCount, bool) {
	h := &c.h[d]
	in, err := tcpInfoRaw(c.fd[d])
	if err != nil {
		return kernelCount{}, false
	}
	out, err := tcpInfoRaw(c.fd[1-d])
	if err != nil {
		return kernelCount{}, false
	}
	outq, err := outqRaw(c.fd[1-d])
	if err != nil {
		return kernelCount{}, false
	}
	queued := out.Bytes_acked + uint64(outq)
	if 1-d == server && queued > 0 {
		queued-- // the SYN of the socket the proxy opened
	}
	k := kernelCount{queued: queued - min(queued, h.wrote), received: in.Bytes_received - min(in.Bytes_received, h.read)}
	switch in.State { // the kernel's TCP states, by their BPF names
	case unix.BPF_TCP_CLOSE_WAIT, unix.BPF_TCP_LAST_ACK, unix.BPF_TCP_CLOSING:
		k.finIn = true
	case unix.BPF_TCP_CLOSE:
		k.closed = true
	}
	return k, true
}

// kernelHolds reads direction d's kernelCount at c's close: the bytes the
// kernel forwarded, and whether it still holds some (kernelCount.holds). A
// source closed since (TCP_CLOSE) was closed after both FINs (the proxy's
// first, then the peer's, through TIME_WAIT, which a socket still open shows
// as CLOSE; or LAST_ACK acknowledged), or by a reset: a peek finds the
// stream's end only if the FIN is in and no byte is left to read, and after a
// reset without a FIN, the error, which it takes (no one reads it at the close).
// After a reset whose error a read (or finBeforeReset) took first, the peek
// finds the end too, as the kernel shuts a reset socket both ways, and the
// count takes off a FIN that never came, one byte short. That changes nothing:
// such a read ends in fail, which resets the destination anyway, or is
// linger's, whose direction has ended (accountKernel asks for the others).
func (l *loop) kernelHolds(c *conn, d int) (uint64, bool) {
	k, ok := l.kernelProgress(c, d)
	if !ok {
		return k.queued, false
	}
	if k.closed {
		k.finIn = peekEOF(c.fd[d])
	}
	return k.queued, k.holds()
}

// peekEOF reports whether a read of fd would return the end of the stream now,
// without reading anything.
func peekEOF(fd int) bool {
	var b [1]byte
	n, _, e := unix.RawSyscall6(unix.SYS_RECVFROM, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), 1,
		unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
	return e == 0 && n == 0
}

// flushLater checks c again soon: its kernel forwarding has not caught up with an EOF.
func (l *loop) flushLater(c *conn) {
	if c.flushQueued {
		return
	}
	c.flushQueued = true
	if !c.flushWaited {
		c.flushWaited = true
		flushWaits.Add(1)
		if at := l.now + flushFirst; len(l.flushing) == 0 || at < l.flushAt {
			l.flushAt = at
		}
		l.flushDelay = flushFirst
	}
	l.flushing = append(l.flushing, connRef{c, c.gen})
}

// recheck runs the connections waiting for kernel forwarding, and the lingering
// ones (linger), if it is time.
func (l *loop) recheck() {
	if len(l.flushing) == 0 || monotonic() < l.flushAt {
		return
	}
	list := l.flushing
	l.flushing = nil
	for _, r := range list {
		if r.c.gen == r.gen && r.c.state == stateEstablished {
			r.c.flushQueued = false
			l.pumpBoth(r.c)
		}
	}
	if len(l.flushing) > 0 {
		l.flushDelay = min(2*l.flushDelay, int64(timerTick))
		l.flushAt = monotonic() + l.flushDelay
	}
}

// accountKernel adds the bytes the kernel forwarded for c to the byte counters, at
// close. A destination whose source's bytes the kernel still holds, not yet in its
// send queue, gets a reset at the close, as on the copy path a peer gets one whose
// bytes the proxy holds: they are lost, and a FIN would pass the stream for whole.
func (l *loop) accountKernel(c *conn) {
	for d := range c.h {
		n := c.h[d].kernel
		if !c.h[d].done {
			var holds bool
			if n, holds = l.kernelHolds(c, d); holds {
				setLinger0(c.fd[1-d])
			}
		}
		l.count(c, d, int(n))
		kernelBytes.Add(n)
	}
}

// forgetKernel drops what the kernel keeps of c's sockets, once they are closed,
// and puts the times it saw their first bytes into c's time to first byte.
func (l *loop) forgetKernel(c *conn) {
	if r := l.s.cfg.Redirector; r != nil {
		first, _ := r.Forget(c.cookies)
		c.kernelFirstBytes(first[client], first[server])
	}
}

// kernelFirstBytes puts into c's time to first byte the times at which the kernel
// first saw the client's and the backend's bytes (CLOCK_MONOTONIC, 0: none): the
// proxy does not see the bytes it forwards. Where the proxy saw earlier bytes itself
// (before the pairing, or those that found no peer), its own times stand. A backend
// whose first bytes came before the client's (a banner) is left with what the proxy
// saw: the kernel keeps no later time. A client that sent bytes the backend never
// answered leaves c asked and unanswered, so the connection reports no sample, as on
// the copy path: its connect time would give a backend that hangs a fast estimate.
func (c *conn) kernelFirstBytes(client, server int64) {
	asked, answered := c.asked, int64(0)
	if c.ttfb > 0 {
		answered = c.asked + int64(c.ttfb)
	}
	if k := fromKernelClock(client); k > 0 && (asked == 0 || k < asked) {
		asked = k
	}
	if k := fromKernelClock(server); k > 0 && (answered == 0 || k < answered) {
		answered = k
	}
	switch {
	case asked > 0 && answered > asked:
		c.asked, c.ttfb = asked, time.Duration(answered-asked)
	case asked > 0 && answered == 0:
		c.asked = asked
	}
}

// kernelClockOffset is CLOCK_MONOTONIC less monotonic(): Go's monotonic clock is
// CLOCK_MONOTONIC on Linux, counted here from epoch.
var kernelClockOffset = sync.OnceValue(func() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0
	}
	return ts.Nano() - monotonic()
})

// fromKernelClock turns a CLOCK_MONOTONIC time (the kernel's, bpf_ktime_get_ns)
// into monotonic()'s; 0 stays 0, as does a time before epoch.
func fromKernelClock(ns int64) int64 {
	if ns == 0 {
		return 0
	}
	return max(ns-kernelClockOffset(), 0)
}

// kernelActive reports whether c's sockets received bytes since the last check, for
// the idle timeout of a connection whose bytes the loop does not see.
func (l *loop) kernelActive(c *conn) bool {
	var total uint64
	for _, fd := range c.fd {
		ti, err := tcpInfoRaw(fd)
		if err != nil {
			return false
		}
		total += ti.Bytes_received
	}
	if total == c.seen {
		return false
	}
	c.seen = total
	return true
}
