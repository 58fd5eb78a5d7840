package httplb

import (
	"context"
	"crypto/tls"
	"io"
	"maps"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
)

// splitListener hands connections that open with the HTTP/2 preface to the
// frame engine, HTTP/1.1 connections to the connection loop (h1serve.go), and
// whatever the service's settings keep on net/http to its server, which reads
// them through Accept. Each connection's first bytes are read on a goroutine of
// its own, so a slow client holds up no other.
type splitListener struct {
	net.Listener
	s     *Service
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
	err   error

	// arriving counts the connections accepted that are not yet with their
	// engine (registered, refused, handed to net/http's server or closed).
	arriving sync.WaitGroup
	stopping atomic.Bool   // stop closed the socket: run returns quietly
	ran      chan struct{} // closed when run returns
}

func newSplitListener(ln net.Listener, s *Service) *splitListener {
	return &splitListener{Listener: ln, s: s, conns: make(chan net.Conn), done: make(chan struct{}), ran: make(chan struct{})}
}

// run accepts until the listener closes or fails.
func (l *splitListener) run() {
	defer close(l.ran)
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if !l.stopping.Load() {
				l.closeWith(err)
			}
			return
		}
		l.s.stats.accept()
		l.arriving.Add(1)
		// Exits once the connection's first bytes are read or its header
		// time is up, and it has been served.
		go l.sniff(c.(*coalescingConn), sync.OnceFunc(l.arriving.Done))
	}
}

// stop stops accepting, and waits until the connections accepted so far are
// with their engine, which a shutdown then finds, or until abandon is closed:
// a connection accepted is served, as a connection waiting in the socket's
// queue is when a replacement took the socket over. Accept (net/http's
// server's) goes on until Close.
func (l *splitListener) stop(abandon <-chan struct{}) {
	l.stopping.Store(true)
	l.Listener.Close()
	<-l.ran
	arrived := make(chan struct{})
	// Exits when the last sniff is over: each is bounded by the header time
	// (over TLS by twice it: the handshake's, then the HTTP/2 preface's).
	go func() {
		l.arriving.Wait()
		close(arrived)
	}()
	select {
	case <-arrived:
	case <-abandon:
	}
}

func (l *splitListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		if l.err != nil {
			return nil, l.err
		}
		return nil, net.ErrClosed
	}
}

func (l *splitListener) Close() error { return l.closeWith(nil) }

// closeWith closes the listener; Accept returns cause (nil: net.ErrClosed).
// The socket is closed before Accept returns: a service whose listener failed
// (Failed, once net/http's server has seen it) holds its address no longer,
// and a replacement bound there (SO_REUSEPORT) is the only one accepting.
func (l *splitListener) closeWith(cause error) error {
	var err error
	l.once.Do(func() {
		l.err = cause
		err = l.Listener.Close()
		close(l.done)
	})
	return err
}

// sniff reads as much of the preface as the client has sent, until it is
// whole or differs. The sniff and the first request's head share one header
// time from the accept: a client that sends a byte that could begin the
// preface and then nothing is closed at its end, not given it again for its
// request.
func (l *splitListener) sniff(c *coalescingConn, arrived func()) {
	defer arrived()
	if l.s.tls != nil {
		l.sniffTLS(c, arrived)
		return
	}
	by := time.Now().Add(l.s.cfg.ReadHeaderTimeout)
	c.SetReadDeadline(by)
	buf := make([]byte, len(http2.ClientPreface))
	n := 0
	for n < len(buf) {
		k, err := c.Conn.Read(buf[n:])
		if err != nil {
			c.clientFailed(err) // read around c, which counts its own reads' failures
		}
		n += k
		if string(buf[:n]) != http2.ClientPreface[:n] || err != nil {
			break
		}
	}
	if n == 0 {
		// Nothing came within the header time, or the client closed: no
		// engine would wait for its request again (nor a shutdown for it).
		c.Close()
		l.s.stats.conns.Add(-1)
		return
	}
	if string(buf[:n]) == http2.ClientPreface && l.s.framesServe() {
		c.SetReadDeadline(time.Time{})
		c.sniffed = true
		c.mu.Lock()
		c.async = true
		c.mu.Unlock()
		l.s.serveFrames(c, false, arrived)
		return
	}
	if string(buf[:n]) != http2.ClientPreface && !l.s.cfg.NetHTTP1 {
		// The loop writes whole answers itself: no coalescing wrapper. The
		// deadline set stays for the first request's head.
		l.s.serveH1(rawConnOf(c.Conn), c, buf[:n], nil, arrived)
		return
	}
	c.sniffed = false
	// Not HTTP/2's preface nor the start of it: HTTP/1.1 for net/http's server.
	h1 := n > len(http2.ClientPreface) || string(buf[:n]) != http2.ClientPreface[:n]
	l.handOver(&prefixConn{coalescingConn: c, prefix: buf[:n], by: by}, h1)
}

// handOver gives net/http's server a connection that is not the engine's; h1:
// the server serves it HTTP/1.1 (not HTTP/2, whose connections the server
// hides from its ConnState hook).
func (l *splitListener) handOver(c net.Conn, h1 bool) {
	if h1 {
		// Fresh before the server has it, so that a shutdown that waited
		// for the connections accepted (stop) then finds it.
		l.s.addFresh(c)
	}
	select {
	case l.conns <- c:
	case <-l.done:
		l.s.freshDone(c)
		c.Close()
		l.s.stats.conns.Add(-1)
	}
}

// sniffTLS does the TLS handshake: a client that chose h2 by ALPN goes to the
// frame engine once its preface is in; the others to the connection loop or
// net/http's server, which finds the handshake done. The handshake has the
// header time from the accept, and the first request or the preface the
// header time again from the handshake's end, as net/http's server gives
// them (HAProxy and nginx, too, time the handshake and the request apart).
func (l *splitListener) sniffTLS(c *coalescingConn, arrived func()) {
	ctx, cancel := context.WithTimeout(context.Background(), l.s.cfg.ReadHeaderTimeout)
	defer cancel()
	tc := tls.Server(c, l.s.tls)
	if err := tc.HandshakeContext(ctx); err != nil {
		l.s.log.Debug("TLS handshake", "client", c.RemoteAddr(), "err", err)
		c.Close()
		l.s.stats.conns.Add(-1)
		return
	}
	if tc.ConnectionState().NegotiatedProtocol != http2.NextProtoTLS {
		if !l.s.cfg.NetHTTP1 {
			st := tc.ConnectionState()
			tc.SetReadDeadline(time.Now().Add(l.s.cfg.ReadHeaderTimeout)) // the first request's head
			l.s.serveH1(tc, c, nil, &st, arrived)
			return
		}
		l.handOver(tc, true)
		return
	}
	if !l.s.framesServe() {
		l.handOver(tc, false)
		return
	}
	tc.SetReadDeadline(time.Now().Add(l.s.cfg.ReadHeaderTimeout))
	buf := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(tc, buf); err != nil || string(buf) != http2.ClientPreface {
		tc.Close()
		l.s.stats.conns.Add(-1)
		return
	}
	tc.SetReadDeadline(time.Time{})
	l.s.serveFrames(newCoalescingConn(tc, true), true, arrived)
}

// prefixConn gives back the bytes sniff read before the rest.
type prefixConn struct {
	*coalescingConn
	prefix []byte
	// by is when the header time that began at the accept ends, until the
	// first request's head is in (zero since).
	by time.Time
}

// SetReadDeadline keeps the first request's head within the header time that
// began at the accept: net/http's server sets read deadlines of its own from
// when it starts to read (for the preface, then for the request), so a client
// whose first bytes the sniff waited for would get the header time again.
// The server clears the deadline once the head is in, and that ends it. Only
// the server's connection goroutine calls it until then.
func (c *prefixConn) SetReadDeadline(t time.Time) error {
	if !c.by.IsZero() {
		if t.IsZero() {
			c.by = time.Time{}
		} else if t.After(c.by) {
			t = c.by
		}
	}
	return c.coalescingConn.SetReadDeadline(t)
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.coalescingConn.Read(p)
}

// rawReadConn is the socket's RawConn for a pooledReader's reads once the
// connection has nothing of its own left to give first (the sniffed prefix,
// long read by the server by the time a request turns into a tunnel or a
// connection waits for its next request); nil otherwise.
func (c *prefixConn) rawReadConn() syscall.RawConn {
	sc, ok := c.Conn.(syscall.Conn)
	if len(c.prefix) > 0 || !c.sniffed || !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// registerSession adds a session for shutdown to find; false: the service is
// shutting down and the session is not to be served.
func (s *Service) registerSession(ss *fsess) bool {
	s.fmu.Lock()
	defer s.fmu.Unlock()
	if s.fshut {
		return false
	}
	if s.fsessions == nil {
		s.fsessions = map[*fsess]bool{}
	}
	s.fsessions[ss] = true
	return true
}

// shutdownFrames sends every session GOAWAY and waits until they have
// closed, or until deadline (zero: none), then closes what is left.
func (s *Service) shutdownFrames(deadline <-chan struct{}) {
	sessions := s.stopSessions()
	for _, ss := range sessions {
		ss.goAway(http2.ErrCodeNo)
	}
	for _, ss := range sessions {
		select {
		case <-ss.done:
		case <-deadline:
			ss.conn.Close()
			<-ss.done
		}
	}
}

// closeFrames closes every session at once.
func (s *Service) closeFrames() {
	for _, ss := range s.stopSessions() {
		ss.conn.Close()
	}
}

// stopSessions takes no more sessions and returns those open.
func (s *Service) stopSessions() []*fsess {
	s.fmu.Lock()
	defer s.fmu.Unlock()
	s.fshut = true
	return slices.Collect(maps.Keys(s.fsessions))
}
