package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/weir-lb/weir/userspace/balance"
)

// conn is one client connection being handled.
type conn struct {
	s      *Service
	client *sock

	mu     sync.Mutex
	b      *backend // chosen backend, once connected
	server *sock    // backend connection, once connected
	killed bool     // closed by a drain or shutdown deadline

	last    atomic.Int64 // monotonic ns of the last byte moved either way
	idle    atomic.Pointer[time.Timer]
	idleHit atomic.Bool
}

func (c *conn) backend() *backend {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.b
}

// kill closes both sockets; the copy loops then end with errors.
func (c *conn) kill() {
	c.mu.Lock()
	c.killed = true
	server := c.server
	c.mu.Unlock()
	c.client.close()
	if server != nil {
		server.close()
	}
}

func (c *conn) wasKilled() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.killed
}

// connected records the backend connection; it reports false if the connection was
// killed meanwhile (the caller then closes server).
func (c *conn) connected(b *backend, server *sock) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.killed {
		return false
	}
	c.b, c.server = b, server
	return true
}

func (s *Service) track(c *conn) bool {
	s.connsMu.Lock()
	defer s.connsMu.Unlock()
	if s.killAll {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *Service) untrack(c *conn) {
	s.connsMu.Lock()
	delete(s.conns, c)
	s.connsMu.Unlock()
}

// handle serves one accepted connection from start to end. It owns fd, the accepted
// socket; src is the client's address.
func (s *Service) handle(fd int, src netip.AddrPort) {
	defer s.wg.Done()
	if s.sem != nil {
		defer func() { <-s.sem }()
	}
	client, err := newSock(fd)
	if err != nil {
		s.noteUnserved(fmt.Errorf("register accepted socket: %w", err))
		return
	}
	defer client.close()
	s.stats.accepted.Add(1)
	s.stats.active.Add(1)
	defer s.stats.active.Add(-1)
	c := &conn{s: s, client: client}
	if !s.track(c) {
		return
	}
	defer s.untrack(c)

	server, b, lease, lat, err := s.connect(src)
	if err != nil {
		if !c.wasKilled() {
			s.noteUnserved(err)
		}
		return
	}
	defer server.close()
	if !c.connected(b, server) {
		b.active.Add(-1)
		lease.Release(balance.Result{Latency: lat})
		return
	}

	outcome := OutcomeSuccess
	if s.cfg.ProxyProtocol != 0 {
		// The listener's own address, unless it is a wildcard.
		dst, err := s.addr, error(nil)
		if dst.Addr().IsUnspecified() {
			dst, err = client.localAddr()
		}
		if err == nil {
			hdr := appendProxyHeader(make([]byte, 0, 108), s.cfg.ProxyProtocol, src, dst)
			err = server.write(hdr)
		}
		if err != nil {
			outcome = OutcomeReset
		}
	}
	if outcome == OutcomeSuccess {
		outcome = c.proxy(server, b)
	}
	b.active.Add(-1)
	lease.Release(balance.Result{Latency: lat})
	switch outcome {
	case OutcomeReset:
		b.c.resets.Add(1)
	case OutcomeIdleTimeout:
		b.c.idleTimeouts.Add(1)
	}
	if o := s.cfg.Observer; o != nil {
		o.Observe(b.ap, outcome, lat)
	}
}

// sourceKey is the balancer's hash key for a client: FNV-1a of its address, so every
// balancer node computes the same key for the same client.
func sourceKey(a netip.Addr) uint64 {
	b := a.Unmap().As16()
	h := uint64(14695981039346656037)
	for _, x := range b {
		h ^= uint64(x)
		h *= 1099511628211
	}
	return h
}

// connect picks a backend and dials it, trying up to Retries other backends after a
// failed dial. On success the backend's active count holds this connection and the
// lease is the caller's to release.
func (s *Service) connect(src netip.AddrPort) (*sock, *backend, balance.Lease, time.Duration, error) {
	tried := make([]string, 0, 4)
	now := monotonic()
	skip := func(id string) bool {
		for _, t := range tried {
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
	key := sourceKey(src.Addr())
	var lastErr error
	for attempt := 0; attempt <= s.cfg.Retries; {
		lease, err := s.bal.Pick(key, skip)
		if err != nil {
			if lastErr != nil {
				return nil, nil, lease, 0, fmt.Errorf("connect: %d attempts failed: %w", attempt, lastErr)
			}
			return nil, nil, lease, 0, fmt.Errorf("connect: %w", err)
		}
		id := lease.Backend()
		tried = append(tried, id)
		b := (*s.table.Load())[id]
		if b == nil || !b.acquire() {
			// Removed meanwhile, or filled up by a concurrent pick: not an attempt.
			lease.Release(balance.Result{})
			continue
		}
		attempt++
		start := time.Now()
		server, err := dialBackend(b.ap, s.cfg.ConnectTimeout)
		lat := time.Since(start)
		if err == nil {
			b.consecFails.Store(0)
			b.c.connects.Add(1)
			b.c.connectNanos.Add(uint64(lat))
			return server, b, lease, lat, nil
		}
		b.active.Add(-1)
		lease.Release(balance.Result{Failed: true, Latency: lat})
		s.dialFailed(b, err, lat)
		lastErr = fmt.Errorf("dial %s: %w", b.addr, err)
	}
	return nil, nil, balance.Lease{}, 0, fmt.Errorf("connect: %d attempts failed: %w", s.cfg.Retries+1, lastErr)
}

// acquire takes a connection slot on b, or reports false if b is at its limit.
func (b *backend) acquire() bool {
	m := b.maxConns.Load()
	for {
		n := b.active.Load()
		if m > 0 && n >= m {
			return false
		}
		if b.active.CompareAndSwap(n, n+1) {
			return true
		}
	}
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

// proxy moves bytes both ways until both directions end, one fails, or the connection
// is closed by the idle timeout, a drain or shutdown.
func (c *conn) proxy(server *sock, b *backend) Outcome {
	c.last.Store(monotonic())
	if d := c.s.cfg.IdleTimeout; d > 0 {
		t := time.AfterFunc(d, c.checkIdle)
		c.idle.Store(t)
		defer t.Stop()
	}
	var ended atomic.Int32
	down := make(chan error, 1)
	// Exits when the backend-to-client direction ends: EOF from the backend, an error
	// on either socket, or both sockets closed by the other direction, a timeout or kill.
	go func() {
		down <- c.copyDirection(c.client, server, &b.c.bytesOut, &c.s.stats.bytesOut, &ended)
	}()
	upErr := c.copyDirection(server, c.client, &b.c.bytesIn, &c.s.stats.bytesIn, &ended)
	downErr := <-down

	switch {
	case c.idleHit.Load():
		return OutcomeIdleTimeout
	case c.wasKilled():
		return OutcomeSuccess
	}
	// A failure on the backend's socket: writing to it going up, reading it coming down.
	var ce *copyError
	if errors.As(upErr, &ce) && !ce.read && !errors.Is(ce, net.ErrClosed) {
		return OutcomeReset
	}
	if errors.As(downErr, &ce) && ce.read && !errors.Is(ce, net.ErrClosed) {
		return OutcomeReset
	}
	return OutcomeSuccess
}

// copyDirection splices src to dst. At src's EOF it half-closes dst, unless the other
// direction has already ended (the final close then sends the FIN, one call fewer). On
// an error it closes both sockets, resetting the other peer, so the other direction
// ends too.
func (c *conn) copyDirection(dst, src *sock, bytes, total *atomic.Uint64, ended *atomic.Int32) error {
	_, err := spliceCopy(dst.rc, src.rc, func(n int) {
		c.last.Store(monotonic())
		bytes.Add(uint64(n))
		total.Add(uint64(n))
	})
	if err == nil {
		if ended.Add(1) == 1 {
			if err := dst.closeWrite(); err != nil && !errors.Is(err, net.ErrClosed) {
				return &copyError{err: fmt.Errorf("half-close: %w", err)}
			}
		}
		return nil
	}
	ended.Add(1)
	// Tell the peer that was not at fault with a reset rather than a clean FIN, so
	// it doesn't take a truncated stream for a complete one.
	var ce *copyError
	other := src
	if errors.As(err, &ce) && ce.read {
		other = dst
	}
	other.setLinger0()
	src.close()
	dst.close()
	return err
}

// checkIdle runs when the idle timer fires: it closes the connection if nothing moved
// for IdleTimeout, or sleeps again until that could be the case.
func (c *conn) checkIdle() {
	d := int64(c.s.cfg.IdleTimeout)
	since := monotonic() - c.last.Load()
	if since < d {
		if t := c.idle.Load(); t != nil {
			t.Reset(time.Duration(d - since))
		}
		return
	}
	c.idleHit.Store(true)
	c.mu.Lock()
	server := c.server
	c.mu.Unlock()
	c.client.close()
	if server != nil {
		server.close()
	}
}
