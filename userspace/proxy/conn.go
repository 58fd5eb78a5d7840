package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/userspace/balance"
)

// Connection states.
const (
	stateFree        = iota // the slot holds no connection
	stateConnecting         // accepted; a backend's connect is in progress
	stateEstablished        // bytes move
)

// Sides of a connection, and the directions named after their source.
const (
	client = 0
	server = 1
	up     = client // client to backend
	down   = server // backend to client
)

// conn is one client connection, owned by its loop. The slot's conn is reused by the
// slot's next connection.
type conn struct {
	l     *loop
	slot  int32
	gen   uint32 // incremented when the slot is freed
	state int

	fd  [2]int // client and server sockets; -1 when not open
	src netip.AddrPort

	b       *backend // the backend being dialed or connected to
	lease   balance.Lease
	dialed  time.Time     // start of the current dial
	lat     time.Duration // connect latency, once connected
	asked   int64         // monotonic ns when the first client bytes went to the backend; 0 before
	ttfb    time.Duration // time from asked to the backend's first bytes; 0 until they come
	header  int           // length of the PROXY protocol header, which is not the client's
	tried   []string      // backends tried, for the balancer's skip
	tries   [4]string
	attempt int
	lastErr error
	killed  bool // closed by a drain or shutdown deadline
	// A lingering connection (linger): lingerEnd, monotonic ns at which it
	// closes unless its client has acknowledged more of the answer since
	// lingerAcked (its tcpi_bytes_acked when lingerEnd was set); lingerLast,
	// when it closes whatever the client acknowledges.
	lingerEnd   int64
	lingerLast  int64
	lingerAcked uint64
	reset       bool // the backend broke the connection

	redirected  bool      // the kernel forwards (Config.Redirector)
	cookies     [2]uint64 // redirected: the sockets' cookies, by side, for Redirector.Forget
	seen        uint64    // redirected: bytes received by both sockets at the last idle check
	flushQueued bool      // redirected: in the loop's flushing list
	flushWaited bool      // redirected: an EOF has waited for the kernel to forward the rest

	h [2]half // by source side: h[up], h[down]

	deadline     int64 // connecting: monotonic ns of the connect timeout
	last         int64 // established: monotonic ns of the last byte moved
	tq           *tlist
	tprev, tnext *conn
}

// half is one direction of a connection, named by its source.
type half struct {
	ready   bool // the source may have bytes: an edge not yet drained
	hup     bool // the source reported a hang-up or an error: read until EOF
	fin     bool // the source reported the peer's FIN and no error
	blocked bool // the destination's buffer is full: wait for EPOLLOUT
	eof     bool // the source reached EOF
	whole   bool // the source failed after its FIN: the bytes before it are whole, and go on
	done    bool // ended: flushed and half-closed
	discard bool // h[up] only: the backend has gone, its stream whole; the client's bytes are read and dropped (linger)
	bulk    bool // moves through splice

	buf    *[]byte // unsent bytes: (*buf)[off:n]
	off, n int
	p      *pipe // bulk: holding inPipe bytes not yet sent
	inPipe int

	read, wrote uint64 // bytes the proxy read from the source and wrote to the destination
	kernel      uint64 // redirected: bytes the kernel forwarded, known once done
}

func (h *half) pending() bool { return h.n > h.off || h.inPipe > 0 }

// release hands back what the half holds. A pipe that still holds bytes is closed.
func (h *half) release() {
	h.drop()
	*h = half{}
}

// drop throws away the half's unsent bytes and hands back what held them; a pipe
// that still holds bytes is closed.
func (h *half) drop() {
	if h.buf != nil {
		bufPool.Put(h.buf)
		h.buf, h.off, h.n = nil, 0, 0
	}
	if h.p != nil {
		if h.inPipe > 0 {
			h.p.close()
		} else {
			pipes.put(h.p)
		}
		h.p, h.inPipe = nil, 0
	}
}

// newConn starts serving an accepted socket fd from src; a MaxConns slot is held.
func (l *loop) newConn(fd int, src netip.AddrPort) {
	s := l.s
	s.stats.accepted.Add(1)
	if s.killAll.Load() {
		unix.Close(fd)
		s.releaseSlot()
		return
	}
	var c *conn
	if n := len(l.free); n > 0 {
		c = l.conns[l.free[n-1]]
		l.free = l.free[:n-1]
	} else {
		c = &conn{l: l, slot: int32(len(l.conns))}
		l.conns = append(l.conns, c)
	}
	c.state = stateConnecting
	c.fd = [2]int{fd, -1}
	c.src = src
	c.tried = c.tries[:0]
	s.wg.Add(1)
	s.stats.active.Add(1)
	if !l.readEarly(c) {
		l.close(c, OutcomeSuccess)
		return
	}
	if err := l.register(c, client); err != nil {
		s.noteUnserved(fmt.Errorf("register accepted socket: %w", err))
		l.close(c, OutcomeSuccess)
		return
	}
	l.connect(c)
}

// readEarly reads what the client has already sent, before the backend is dialed:
// with bytes to send at once, the dial holds back the handshake's last ACK, which
// then goes out with them (one segment fewer per connection, and the backend
// finds its first bytes with the connection). A client that has sent nothing yet
// (or a protocol where the server speaks first) gets the plain dial. Not with the
// PROXY protocol, whose header must go first, nor when the kernel forwards: there,
// with early bytes, the backend now and then got some of the client's bytes twice
// (TestEveryTestOnSockmap, 1 run in 6; the cause is not found). It reports false
// if the client's socket failed.
func (l *loop) readEarly(c *conn) bool {
	if l.s.cfg.ProxyProtocol != 0 || l.s.cfg.Redirector != nil {
		return true
	}
	h := &c.h[up]
	n, err := readRaw(c.fd[client], l.scratch)
	switch {
	case err == unix.EAGAIN || err == unix.EINTR:
		return true
	case err != nil:
		return false
	case n == 0:
		h.eof = true
		return true
	}
	earlyReads.Add(1)
	h.read += uint64(n)
	h.buf = bufPool.Get().(*[]byte)
	// Not marked bulk even if the read filled the buffer: the next read that does
	// makes the direction bulk.
	h.off, h.n = 0, copy(*h.buf, l.scratch[:n])
	return true
}

// connect picks a backend and starts dialing it; after a failed dial it tries up to
// Retries other backends. If none can be tried the client is closed.
func (l *loop) connect(c *conn) {
	s := l.s
	now := monotonic()
	skip := func(id string) bool {
		for _, t := range c.tried {
			if t == id {
				return true
			}
		}
		b := (*s.table.Load())[id]
		if b == nil || b.ejectedUntil.Load() > now {
			return true
		}
		m := b.maxConns.Load()
		return m > 0 && b.active.Load() >= m
	}
	key := flowKey(c.src, s.hashPort.Load())
	for c.attempt <= s.cfg.Retries {
		lease, err := s.bal.Pick(key, skip)
		if err != nil {
			if c.lastErr != nil {
				err = fmt.Errorf("connect: %d attempts failed: %w", c.attempt, c.lastErr)
			} else {
				err = fmt.Errorf("connect: %w", err)
			}
			l.unserved(c, err)
			return
		}
		id := lease.Backend()
		c.tried = append(c.tried, id)
		b := (*s.table.Load())[id]
		if b == nil || !b.acquire() {
			// Removed meanwhile, or filled up by a concurrent pick: not an attempt.
			lease.Release(balance.Result{})
			continue
		}
		c.attempt++
		c.b, c.lease = b, lease
		c.dialed = time.Now()
		fd, err := startDial(b.sa, c.h[up].pending(), &s.backend)
		if err == nil {
			c.fd[server] = fd
			if err = l.register(c, server); err == nil {
				c.deadline = monotonic() + int64(s.cfg.ConnectTimeout)
				l.connecting.push(c)
				return // connected, or still connecting: the event says which
			}
			err = &localError{err}
			unix.Close(fd)
			c.fd[server] = -1
		}
		if local := (*localError)(nil); errors.As(err, &local) {
			err = fmt.Errorf("dial %s: %w", b.addr, err)
			l.dialAborted(c)
			l.unserved(c, err)
			return
		}
		l.dialFailed(c, err)
	}
	l.unserved(c, fmt.Errorf("connect: %d attempts failed: %w", s.cfg.Retries+1, c.lastErr))
}

// dialFailed accounts for a failed dial of c.b.
func (l *loop) dialFailed(c *conn, err error) {
	b := c.b
	lat := time.Since(c.dialed)
	b.active.Add(-1)
	c.lease.Release(balance.Result{Failed: true, Latency: lat})
	c.b, c.lease = nil, balance.Lease{}
	l.s.dialFailed(b, err, lat)
	c.lastErr = fmt.Errorf("dial %s: %w", b.addr, err)
}

// dialAborted gives up c's dial of c.b for a failure of this host's, which
// counts against no backend.
func (l *loop) dialAborted(c *conn) {
	c.b.active.Add(-1)
	c.lease.Release(balance.Result{})
	c.b, c.lease = nil, balance.Lease{}
}

// connectFailed ends the dial in progress with err and tries the next backend.
func (l *loop) connectFailed(c *conn, err error) {
	l.connecting.remove(c)
	closeRaw(c.fd[server])
	c.fd[server] = -1
	l.dialFailed(c, err)
	l.connect(c)
}

// unserved closes a client that could not be served.
func (l *loop) unserved(c *conn, err error) {
	l.s.noteUnserved(err)
	l.close(c, OutcomeSuccess)
}

// event handles the events of one socket of c.
func (l *loop) event(c *conn, side int, ev uint32) {
	bad := ev&(unix.EPOLLERR|unix.EPOLLHUP) != 0
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP) != 0 || bad {
		c.h[side].ready = true
		if ev&unix.EPOLLRDHUP != 0 || bad {
			c.h[side].hup = true
		}
		c.h[side].fin = ev&unix.EPOLLRDHUP != 0 && ev&unix.EPOLLERR == 0
	}
	if ev&unix.EPOLLOUT != 0 || bad {
		c.h[1-side].blocked = false
	}
	if c.state == stateConnecting {
		if side == client {
			if ev&unix.EPOLLERR != 0 && c.b != nil {
				// The client reset while its backend is dialed: it has gone.
				// The dial is given up, counted against no backend, and the
				// slots it held are freed now, not at the connect timeout.
				l.dialAborted(c)
				l.close(c, OutcomeSuccess)
			}
			return // the client's bytes wait until the backend is connected
		}
		if bad {
			err := error(unix.ECONNREFUSED)
			if errno := sockErr(c.fd[server]); errno != 0 {
				err = errno
			}
			c.h[down] = half{}
			l.connectFailed(c, fmt.Errorf("connect: %w", err))
			return
		}
		if ev&unix.EPOLLOUT == 0 {
			return
		}
		if self := c.b.self; self.IsValid() && selfConnected(c.fd[server], self) {
			c.h[down] = half{}
			l.connectFailed(c, errSelfConnect)
			return
		}
		if !l.connected(c) {
			return
		}
	}
	l.pumpBoth(c)
}

// connected finishes a successful connect: counters, the idle list, the PROXY
// protocol header. It reports false if it closed the connection.
func (l *loop) connected(c *conn) bool {
	s := l.s
	c.lat = time.Since(c.dialed)
	b := c.b
	b.consecFails.Store(0)
	b.c.connects.Add(1)
	b.c.connectNanos.Add(uint64(c.lat))
	l.connecting.remove(c)
	c.state = stateEstablished
	c.last = l.now
	if s.cfg.IdleTimeout > 0 {
		l.idle.push(c)
	}
	if s.cfg.ProxyProtocol != 0 {
		// The listener's own address, unless it is a wildcard.
		dst, err := s.addr, error(nil)
		if dst.Addr().IsUnspecified() {
			dst, err = getsocknameRaw(c.fd[client])
		}
		if err != nil {
			c.reset = true
			l.close(c, OutcomeReset)
			return false
		}
		h := &c.h[up]
		h.buf = bufPool.Get().(*[]byte)
		h.off, h.n = 0, len(appendProxyHeader((*h.buf)[:0], s.cfg.ProxyProtocol, c.src, dst))
		c.header = h.n
	}
	return l.redirect(c)
}

// pumpBoth moves what can be moved in both directions.
func (l *loop) pumpBoth(c *conn) {
	if l.pump(c, up) {
		l.pump(c, down)
	}
}

// pump moves bytes of direction d (from side d to the other side) until the source
// has none, the destination is full, or the turn's budget is spent. At the source's
// EOF it half-closes the destination, unless the other direction has already ended
// (the close then sends the FIN, one call fewer). It reports false if it closed c.
func (l *loop) pump(c *conn, d int) bool {
	h := &c.h[d]
	if h.done {
		if h.discard {
			return l.linger(c)
		}
		if h.hup && !h.fin {
			if d == up {
				// The client reset after its FIN: it has gone, and nothing
				// queued for it can reach it. The backend learns it as it
				// would from the client, by a reset; else the connection,
				// its lease and its slot would last until the backend
				// wrote, which one waiting for an event may never do.
				return l.fail(c, d, true, failure(c.fd[d]))
			}
			// The backend reset after its FIN (a close with the client's
			// later bytes unread, or an abortive close): its whole answer
			// is in the client's socket, and the connection ends once the
			// client has it (linger); the client's further bytes then meet
			// the reset of the closed socket, as they would the backend's.
			// Else the connection lasted until the client wrote or closed,
			// and with the kernel forwarding, the client's bytes vanished
			// into the backend's dead socket and it never ended.
			if c.h[up].discard {
				return true // lingering already: pump(up) does it
			}
			return l.linger(c)
		}
		return true
	}
	src, dst := c.fd[d], c.fd[1-d]
	budget := spliceBudget
	for !h.done {
		if h.pending() {
			if h.blocked {
				if h.hup && !h.fin && !h.whole {
					if d == down && (h.eof || l.finBeforeReset(c, src)) {
						// The backend reset after its FIN: its answer is
						// whole, and what the proxy holds of it goes on to
						// the client, as the kernel still delivers what is
						// in the socket, then the EOF. The end is a plain
						// close, once the client has it; the client's
						// bytes, which have nowhere to go, are dropped
						// meanwhile, and one that does not take the answer
						// is closed at lingerMax (linger).
						h.whole = true
						return l.linger(c)
					}
					// The source failed (a reset) while its bytes waited for a
					// destination that does not read: they will never go, and
					// nothing else would end c, as the destination may never
					// drain. The destination gets a reset too.
					return l.fail(c, d, true, failure(src))
				}
				return true
			}
			sent, err := l.flush(c, h, d, dst)
			if err != nil {
				return l.fail(c, d, false, err)
			}
			if !sent {
				h.blocked = true
				return true
			}
		}
		if h.eof {
			if c.redirected {
				n, all := l.kernelMoved(c, d)
				if !all {
					if d == down && h.hup && !h.fin {
						// The backend failed after its FIN: the kernel
						// holds the rest of a whole answer for a client
						// slow to take it, up to lingerMax (linger).
						return l.linger(c)
					}
					l.flushLater(c)
					return true
				}
				h.kernel = n
			}
			return l.endHalf(c, d)
		}
		if !h.ready {
			return true
		}
		if budget <= 0 {
			l.again = append(l.again, connRef{c, c.gen})
			return true
		}
		var n int
		var err error
		if h.bulk {
			if h.p == nil {
				if h.p, err = pipes.get(); err != nil {
					return l.cut(c, fmt.Errorf("splice pipe: %w", err))
				}
			}
			n, err = spliceRaw(src, h.p.w, pipeSize, spliceFlags)
		} else {
			n, err = readRaw(src, l.scratch)
		}
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			h.ready = false
			if h.p != nil {
				pipes.put(h.p) // empty: a waiting direction holds no pipe
				h.p = nil
			}
			return true
		case err != nil:
			return l.fail(c, d, true, err)
		case n == 0:
			h.eof = true
			continue
		}
		budget -= n
		if d == down && c.asked != 0 && c.ttfb == 0 {
			c.ttfb = time.Duration(max(monotonic()-c.asked, 1))
		}
		h.read += uint64(n)
		if h.bulk {
			spliceCalls.Add(1)
			splicedIn.Add(uint64(n))
			h.inPipe = n
			// A direction whose bulk has turned into small messages goes back to
			// read/write once this chunk is out: splicing a few hundred bytes costs
			// a pipe round trip for what one copy does.
			h.bulk = n > smallSplice
			continue
		}
		m, err := writeRaw(dst, l.scratch[:n])
		for err == unix.EINTR {
			m, err = writeRaw(dst, l.scratch[:n])
		}
		if err == unix.EAGAIN {
			m, err = 0, nil
		}
		if err != nil {
			return l.fail(c, d, false, err)
		}
		l.moved(c, d, m)
		copiedBytes.Add(uint64(m))
		if m < n {
			h.buf = bufPool.Get().(*[]byte)
			h.off, h.n = 0, copy(*h.buf, l.scratch[m:n])
			h.blocked = true
			return true
		}
		if n == len(l.scratch) {
			h.bulk = true
		} else if !h.hup {
			h.ready = false // a short read drained the socket; new bytes bring a new edge
			return true
		} else if h.fin && !c.redirected {
			// The peer's FIN was in before this read, and the read came back short:
			// it took everything up to the FIN, so this is EOF without a read to
			// return 0. (Like HAProxy's read0 on a hang-up; TCP urgent data, which
			// would also stop a read short, is not supported.) After an error the
			// read goes on, to report it; so it does when the kernel forwards, as
			// bytes it hands to the proxy may still be on their way to the socket.
			h.eof = true
		}
	}
	return true
}

// flush writes the direction's unsent bytes. It reports whether all were sent.
func (l *loop) flush(c *conn, h *half, d, dst int) (bool, error) {
	for h.n > h.off {
		m, err := writeRaw(dst, (*h.buf)[h.off:h.n])
		switch err {
		case nil:
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false, nil
		default:
			return false, err
		}
		h.off += m
		l.moved(c, d, m)
		copiedBytes.Add(uint64(m))
	}
	if h.buf != nil {
		bufPool.Put(h.buf)
		h.buf, h.off, h.n = nil, 0, 0
	}
	for h.inPipe > 0 {
		m, err := spliceOut(h.p.r, dst, h.inPipe, spliceFlags)
		switch err {
		case nil:
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false, nil
		default:
			return false, err
		}
		if m == 0 {
			return false, errors.New("splice wrote 0 bytes")
		}
		spliceCalls.Add(1)
		h.inPipe -= m
		l.moved(c, d, m)
	}
	if h.p != nil && !h.bulk {
		pipes.put(h.p) // back to read/write: the empty pipe is not needed
		h.p = nil
	}
	return true, nil
}

// moved accounts for n bytes sent in direction d and marks the connection active.
func (l *loop) moved(c *conn, d, n int) {
	if n <= 0 {
		return
	}
	c.h[d].wrote += uint64(n)
	if d == up && c.asked == 0 && c.h[d].wrote > uint64(c.header) {
		c.asked = monotonic()
	}
	l.count(c, d, n)
	if c.last != l.now && c.tq != nil {
		c.last = l.now
		l.idle.remove(c)
		l.idle.push(c)
	}
}

// count adds n bytes of direction d to the byte counters.
func (l *loop) count(c *conn, d, n int) {
	if n <= 0 {
		return
	}
	if d == up {
		c.b.c.bytesIn.Add(uint64(n))
		l.s.stats.bytesIn.Add(uint64(n))
	} else {
		c.b.c.bytesOut.Add(uint64(n))
		l.s.stats.bytesOut.Add(uint64(n))
	}
}

// endHalf ends direction d after its source's EOF, everything sent.
func (l *loop) endHalf(c *conn, d int) bool {
	h := &c.h[d]
	h.done = true
	if h.p != nil {
		pipes.put(h.p)
		h.p = nil
	}
	o := &c.h[1-d]
	if o.done && !o.discard {
		// Both directions ended: the close sends the FIN.
		l.close(c, OutcomeSuccess)
		return false
	}
	if err := shutdownRaw(c.fd[1-d], unix.SHUT_WR); err != nil && err != unix.ENOTCONN && d == up {
		c.reset = true
	}
	if d == down && (o.discard || h.hup && !h.fin) {
		// The backend failed after its FIN, so the client's bytes have
		// nowhere to go: the answer's rest and the FIN are in the client's
		// socket, and the connection ends once the client has them.
		return l.linger(c)
	}
	return true
}

// linger goes on with c after its backend has gone, its stream whole (its
// reset came after its FIN), while the client may still send. Nothing more goes
// to the backend: the client's bytes, which have nowhere to go, are read and
// dropped, with those the proxy held for the backend. The answer goes on to the
// client, and once it is all in the client's socket and the client has
// acknowledged it and the FIN (SIOCOUTQ is 0), c is closed; or before, if the
// client half-closes or fails. A close with the client's bytes unread, or one
// that more of them reach, makes the kernel reset the client and throw away
// what it has not yet acknowledged: the answer's rest. Like the lingering close
// of HAProxy and nginx; bounded by the idle timeout, as the bytes dropped do
// not count as activity, and by lingerMax and lingerLimit. It reports false if
// it closed c.
func (l *loop) linger(c *conn) bool {
	u := &c.h[up]
	if !u.discard {
		if c.redirected {
			u.kernel, _ = l.kernelMoved(c, up) // accountKernel reads a done half's here
		}
		u.discard, u.done = true, true
		u.drop()
		now := monotonic()
		c.lingerEnd, c.lingerLast = now+int64(lingerMax), now+int64(lingerLimit)
		c.lingerAcked = bytesAcked(c.fd[client])
		// A reset the backend's socket has yet to report is not a broken
		// stream (pump's blocked source).
		c.h[down].whole = true
	}
	for budget := spliceBudget; u.ready && !u.eof; {
		if budget <= 0 {
			l.again = append(l.again, connRef{c, c.gen})
			return true
		}
		n, err := readRaw(c.fd[client], l.scratch)
		switch {
		case err == unix.EINTR:
		case err == unix.EAGAIN:
			u.ready = false
		case err != nil:
			// The client reset, or the kernel gave it up: it has gone,
			// and took no notice of the answer's rest.
			l.s.clientFailed(err)
			l.close(c, OutcomeSuccess)
			return false
		case n == 0:
			u.eof = true
		default:
			budget -= n
		}
	}
	now := monotonic()
	if !c.h[down].done {
		// The answer is still on its way to the client's socket. A client
		// that takes none of it for lingerMax loses the rest: the close
		// resets it, as it does a peer whose bytes the proxy (or the
		// kernel) still holds.
		if l.lingerOn(c, now) {
			l.lingerLater(c)
			return true
		}
		l.close(c, OutcomeSuccess)
		return false
	}
	if !u.eof {
		if n, err := outqRaw(c.fd[client]); err == nil && n > 0 && l.lingerOn(c, now) {
			l.lingerLater(c)
			return true
		}
	}
	l.close(c, OutcomeSuccess)
	return false
}

// lingerOn reports whether lingering c may go on at now: before its lingerEnd,
// or, at it, if the client has acknowledged more of the answer since the last
// one (which sets the next, lingerMax on), and never past its lingerLast.
// Acknowledgements are what tells: the proxy writes more of the answer only
// once a third of its socket's send buffer is free, and none once the whole
// answer is in it, so a client that takes a send buffer's worth slower than
// that would be cut while it reads. They are read once a lingerMax, not at
// each check (timerTick apart).
func (l *loop) lingerOn(c *conn, now int64) bool {
	if now < c.lingerEnd {
		return true
	}
	if now >= c.lingerLast {
		return false
	}
	acked := bytesAcked(c.fd[client])
	if acked == c.lingerAcked {
		return false
	}
	c.lingerAcked, c.lingerEnd = acked, min(now+int64(lingerMax), c.lingerLast)
	return true
}

// bytesAcked is the bytes fd's peer has acknowledged (tcpi_bytes_acked, which
// counts each byte once, retransmitted or not, and the FIN), or 0 if unknown.
func bytesAcked(fd int) uint64 {
	ti, err := tcpInfoRaw(fd)
	if err != nil {
		return 0
	}
	return ti.Bytes_acked
}

// lingerMax and lingerLimit bound how long a lingering connection waits for
// its client to acknowledge the answer, and its end, whatever the idle timeout,
// which may be none: the backend has gone, and a client that never reads
// would otherwise hold the connection, its slot and the backend's count for
// good. The connection closes at the end of a lingerMax, counted from when the
// proxy saw the backend go and then one after another, in which the client
// acknowledged none of the answer: a client that reads slowly gets it. And it
// closes lingerLimit after the backend went, however the client reads: else a
// client that acknowledges a few bytes each lingerMax (a tiny receive window)
// held it, at no cost, for as long as the answer's rest lasts at that pace:
// days for a megabyte. The rest is at most what the backend's socket, the
// proxy and the client's socket held when the backend went (about 11 MiB with
// Linux's default buffer limits), which a client taking 40 KB/s gets in
// lingerLimit.
var (
	lingerMax   = 30 * time.Second
	lingerLimit = 5 * time.Minute
)

// lingerLater checks c again soon: its client has not yet acknowledged the
// answer's end. It shares the list of connections whose kernel forwarding lags
// an EOF, and its checks, at most timerTick apart.
func (l *loop) lingerLater(c *conn) {
	if c.flushQueued {
		return
	}
	c.flushQueued = true
	if len(l.flushing) == 0 {
		l.flushAt = l.now + int64(timerTick)
		l.flushDelay = int64(timerTick)
	}
	l.flushing = append(l.flushing, connRef{c, c.gen})
}

// finBeforeReset reports whether the backend's socket src, which has failed,
// received the backend's FIN before the failure, and clears its error. For a
// reset in CLOSE_WAIT (the client's FIN not yet passed on) the kernel says so
// with EPIPE. In LAST_ACK (passed on, and not yet acknowledged: the backend
// reset with the client's bytes unread) it says ECONNRESET, as for any reset;
// the TCP counters tell then: tcpi_bytes_received counts the FIN, the bytes
// the proxy has read and those still in the socket (SIOCINQ) do not. On the
// in-kernel path the proxy does not know what the kernel has read, and it
// answers false; it need not know: there the proxy holds none of the
// backend's bytes (the program hands them to the proxy only once the client's
// socket has left the map, closed), and it reads the backend's EOF itself,
// which a read returns after the reset too (TestBackendResetAfterBothFINs runs
// on both paths).
func (l *loop) finBeforeReset(c *conn, src int) bool {
	switch sockErr(src) {
	case unix.EPIPE:
		return true
	case unix.ECONNRESET:
		if c.redirected {
			return false
		}
		ti, err := tcpInfoRaw(src)
		if err != nil {
			return false
		}
		inq, err := inqRaw(src)
		if err != nil {
			return false
		}
		return ti.Bytes_received > c.h[down].read+uint64(inq)
	}
	return false
}

// failure returns the error that failed fd, a socket that hung up without a
// FIN, which no read has returned: its pending error (a reset, or ETIMEDOUT
// when the kernel gave the peer up), or ECONNRESET if it has none left.
func failure(fd int) error {
	if errno := sockErr(fd); errno != 0 {
		return errno
	}
	return unix.ECONNRESET
}

// sockErr returns and clears fd's pending error (SO_ERROR), or 0.
func sockErr(fd int) unix.Errno {
	n, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
	if err != nil {
		return 0
	}
	return unix.Errno(n)
}

// fail ends c after an error in direction d, reading its source (read) or writing
// its destination. The peer that was not at fault gets a reset rather than a clean
// FIN, so it doesn't take a truncated stream for a complete one; but a client whose
// bytes find the backend gone after its whole stream still gets that (linger). It
// reports false if it closed c.
func (l *loop) fail(c *conn, d int, read bool, err error) bool {
	faulty, other := 1-d, d
	if read {
		faulty, other = d, 1-d
	}
	outcome := OutcomeSuccess
	if faulty == client {
		l.s.clientFailed(err)
	}
	if faulty == server {
		if h := &c.h[down]; !h.eof && !h.whole && err != unix.EPIPE {
			outcome = OutcomeReset
		} else if !read {
			// A backend whose stream has ended (its FIN read, or its reset
			// seen after its FIN; a write's EPIPE is the kernel's word for a
			// reset in CLOSE_WAIT, after the FIN) broke nothing: the reset
			// its host answers later bytes with, once it has closed, is met
			// by a client that talked on after the end. The answer goes on
			// to the client, whose bytes are dropped (linger).
			return l.linger(c)
		}
	}
	setLinger0(c.fd[other])
	l.close(c, outcome)
	return false
}

// clientFailed counts err, which failed a client's socket, if the kernel gave
// the client up: keepalive probes or bytes sent to it went unacknowledged
// (ETIMEDOUT: TCP keepalive, TCP_USER_TIMEOUT).
func (s *Service) clientFailed(err error) {
	if errors.Is(err, unix.ETIMEDOUT) {
		s.stats.clientTimeouts.Add(1)
	}
}

// cut ends c for a failure of this host's (no descriptor or memory for a
// pipe): neither peer is at fault, and both get a reset, as the stream is cut.
// It is counted and logged with the connections that could not be served.
func (l *loop) cut(c *conn, err error) bool {
	l.s.noteUnserved(err)
	setLinger0(c.fd[client])
	setLinger0(c.fd[server])
	l.close(c, OutcomeSuccess)
	return false
}

// close ends c: both sockets closed, the lease released (exactly once, here or in
// dialFailed), counters and the Observer told, the slot freed.
func (l *loop) close(c *conn, outcome Outcome) {
	s := l.s
	if c.tq != nil {
		c.tq.remove(c)
	}
	if c.killed || outcome == OutcomeIdleTimeout {
		// As the other peer sees it, the proxy closed the connection.
		c.reset = false
	}
	if c.redirected {
		l.accountKernel(c)
	}
	// Bytes the proxy holds for a peer are lost with the close (an idle
	// timeout on a peer that stopped reading, a drain's deadline): that peer
	// gets a reset, not a FIN it would take for the whole stream's end.
	if c.h[up].pending() && c.fd[server] >= 0 {
		setLinger0(c.fd[server])
	}
	if c.h[down].pending() && c.fd[client] >= 0 {
		setLinger0(c.fd[client])
	}
	for i, fd := range c.fd {
		if fd >= 0 {
			closeRaw(fd)
			c.fd[i] = -1
		}
	}
	if c.redirected {
		l.forgetKernel(c)
	}
	c.h[up].release()
	c.h[down].release()
	if b := c.b; b != nil {
		b.active.Add(-1)
		c.lease.Release(balance.Result{Latency: c.sample()})
		if c.state == stateEstablished {
			if c.killed {
				outcome = OutcomeSuccess
			} else if c.reset && outcome == OutcomeSuccess {
				outcome = OutcomeReset
			}
			switch outcome {
			case OutcomeReset:
				b.c.resets.Add(1)
			case OutcomeIdleTimeout:
				b.c.idleTimeouts.Add(1)
			}
			if o := s.cfg.Observer; o != nil {
				o.Observe(b.ap, outcome, c.lat)
			}
		}
	}
	*c = conn{l: l, slot: c.slot, gen: c.gen + 1, fd: [2]int{-1, -1}}
	l.free = append(l.free, c.slot)
	s.stats.active.Add(-1)
	s.releaseSlot()
	s.wg.Done()
}

// sample is the latency the connection reports to the balancer (ewma and the other
// latency-aware algorithms): the time to the backend's first byte after the client's
// first bytes went to it. A connection the backend never answered reports none (0):
// an upload is not a slow answer, and a backend that hangs is held off by its
// connections in flight. A connection whose client sent nothing reports its connect
// time. Where the kernel forwarded the bytes, it knows their times (kernelFirstBytes).
func (c *conn) sample() time.Duration {
	switch {
	case c.state == stateConnecting:
		return time.Since(c.dialed)
	case c.ttfb > 0:
		return c.ttfb
	case c.asked != 0:
		return 0
	}
	return c.lat
}

// flowKey is the balancer's hash key for a client's connection: FNV-1a of its
// address and, with port, its port (big-endian), so every balancer node computes
// the same key for the same client or flow.
func flowKey(src netip.AddrPort, port bool) uint64 {
	b := src.Addr().Unmap().As16()
	h := uint64(14695981039346656037)
	mix := func(x byte) {
		h ^= uint64(x)
		h *= 1099511628211
	}
	for _, x := range b {
		mix(x)
	}
	if port {
		mix(byte(src.Port() >> 8))
		mix(byte(src.Port()))
	}
	return h
}

// acquire takes a connection slot on b, or reports false if b is at its limit or
// removed. The removal marks b before it reads b's count (to forget b once it is
// 0, and with b its drain), so removed is read after the slot is taken: a slot
// taken on b unmarked has its count seen, and its connection is drained with b's.
func (b *backend) acquire() bool {
	m := b.maxConns.Load()
	for {
		n := b.active.Load()
		if m > 0 && n >= m {
			return false
		}
		if b.active.CompareAndSwap(n, n+1) {
			break
		}
	}
	if b.removed.Load() {
		b.active.Add(-1)
		return false
	}
	return true
}

// dialFailed is passive health: EjectAfter consecutive failed dials eject b for
// EjectFor. When that time is over, one more failure ejects it again.
func (s *Service) dialFailed(b *backend, err error, lat time.Duration) {
	outcome := OutcomeConnectFailed
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		outcome = OutcomeConnectTimeout
	}
	b.c.connectFailures.Add(1)
	if o := s.cfg.Observer; o != nil {
		o.Observe(b.ap, outcome, lat)
	}
	if s.cfg.EjectAfter == 0 {
		return
	}
	if n := b.consecFails.Add(1); int(n) >= s.cfg.EjectAfter {
		until := monotonic() + int64(s.cfg.EjectFor)
		if old := b.ejectedUntil.Load(); old < monotonic() && b.ejectedUntil.CompareAndSwap(old, until) {
			b.consecFails.Store(int32(s.cfg.EjectAfter - 1))
			b.c.ejections.Add(1)
			s.log.Warn("backend ejected after consecutive failed connects",
				"backend", b.addr, "failures", n, "for", s.cfg.EjectFor, "err", err)
		}
	}
}
