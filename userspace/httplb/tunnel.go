package httplb

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/weir-lb/weir/userspace/balance"
)

// This file carries HTTP/1.1 upgrades: WebSocket, and any other protocol a
// client asks to switch to with Upgrade (h2c aside, which weir speaks itself).
// The request goes to the backend on a connection of its own, never pooled;
// when the backend answers 101 Switching Protocols, the client's connection
// and that one are joined and bytes are copied both ways until both sides
// have ended, as HAProxy's tunnel mode does. The tunnel counts as a request
// in flight on its backend for its whole life, so least_conn spreads long-lived
// WebSockets by how many each backend holds.

// upgradeProtocols returns the protocols r asks to switch to, or nil if r is
// not an upgrade weir tunnels: an HTTP/1.1 request whose Connection names
// upgrade, without a body (bytes before the switch would have no framing the
// tunnel could keep), and not h2c.
func upgradeProtocols(r *http.Request) []string {
	up := r.Header["Upgrade"]
	if len(up) == 0 || r.ProtoMajor != 1 || r.ProtoMinor < 1 {
		return nil // HTTP/1.0 has no upgrade (RFC 9110 7.8)
	}
	if !httpguts.HeaderValuesContainsToken(r.Header["Connection"], "upgrade") ||
		httpguts.HeaderValuesContainsToken(up, "h2c") {
		return nil
	}
	if r.ContentLength != 0 || len(r.TransferEncoding) > 0 {
		return nil
	}
	return up
}

// tunnelTry sends an upgrade request to be and, if be switches protocols,
// joins the client to it until the tunnel ends. Its results are try's.
func (s *Service) tunnelTry(client, ctx context.Context, l *live, w http.ResponseWriter, r *http.Request, be *backend, lease *balance.Lease,
	hdr http.Header, protos []string, retryable bool, try int, start time.Time) (done bool, f failure) {
	tryStart := time.Now()
	tctx := ctx
	if l.cfg.TryTimeout > 0 {
		var cancel context.CancelFunc
		tctx, cancel = context.WithTimeoutCause(ctx, l.cfg.TryTimeout, errTryTimeout)
		defer cancel()
	}
	failed := func(o Outcome, err error) (bool, failure) {
		if client.Err() != nil {
			lease.Release(balance.Result{})
			abandoned()
		}
		status := http.StatusBadGateway
		if o == Timeout {
			status = http.StatusGatewayTimeout
		}
		lease.Release(balance.Result{Failed: true, Latency: time.Since(tryStart)})
		l.observeTry(be, o)
		be.stats.count(0)
		overall := ctx.Err() != nil
		return false, failure{retry: !overall && (retryable || o == ConnectFailure), dial: o == ConnectFailure, status: status, err: err}
	}
	if be.retired.Load() {
		return false, retiredSincePick(lease)
	}
	if try > 0 {
		be.stats.retries.Add(1)
	}
	d := s.dialer()
	bc, err := d.DialContext(tctx, "tcp", be.id)
	if err != nil {
		if tctx.Err() != nil && client.Err() == nil {
			return failed(Timeout, err)
		}
		return failed(ConnectFailure, &dialError{err})
	}
	bc = rawConnOf(bc) // raw reads and writes, as the HTTP/1.1 loop's sockets

	// The request and the wait for its answer end with the try's context.
	stop := context.AfterFunc(tctx, func() { bc.SetDeadline(aLongTimeAgo) })
	target := *r.URL
	target.Opaque = rawTargetPath(r.RequestURI) // the target as the client wrote it
	out := &http.Request{Method: r.Method, URL: &target, Host: r.Host, Header: hdr, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1}
	out.Header["Connection"] = []string{"Upgrade"}
	out.Header["Upgrade"] = protos
	bw := bufio.NewWriterSize(bc, 4<<10)
	lim := &limitReader{r: bc}
	br := bufio.NewReaderSize(lim, 4<<10)
	err = writeRequestHead(bw, out, 0)
	if err == nil {
		err = bw.Flush()
	}
	var a answer
	if err == nil {
		// Interim answers (100 Continue, 103 Early Hints) before the switch or
		// the final answer are dropped, as http.Transport drops them, within
		// the budget for heads weir's own exchange has.
		a, err = readAnswer(br, lim, out, be.h1s.maxHeader)
	}
	resp := a.resp
	headerLatency := time.Since(tryStart)
	if !stop() || err != nil {
		bc.Close()
		if err == nil || tctx.Err() != nil {
			err = fmt.Errorf("no answer to the upgrade in time: %w", context.Cause(tctx))
			return failed(Timeout, err)
		}
		if isTimeout(err) {
			// The backend stopped acknowledging (ETIMEDOUT: TCP_USER_TIMEOUT,
			// keepalive): a timeout, as try counts one.
			return failed(Timeout, err)
		}
		return failed(Reset, err)
	}
	bc.SetDeadline(time.Time{})
	if resp.StatusCode != http.StatusSwitchingProtocols {
		// The backend declined (or answered otherwise): the answer goes to the
		// client as any other, and the connection goes with it. Its outcome
		// is told once, when its body has come whole or broken off (try's
		// rule).
		bp := bufPool.Get().(*[]byte)
		n, copyErr := s.respond(ctx, w, resp, nil, nil, *bp)
		bufPool.Put(bp)
		bc.Close()
		s.answered(l, r, be, lease, resp.StatusCode, n, headerLatency, headerLatency, start, copyErr)
		if copyErr != nil && client.Err() == nil {
			l.observeTry(be, Reset)
			panic(http.ErrAbortHandler)
		}
		if resp.StatusCode >= 500 {
			l.observeTry(be, ServerError)
		} else {
			l.observeTry(be, Success)
		}
		return true, failure{}
	}
	var proto string
	if got := resp.Header["Upgrade"]; len(got) == 1 {
		proto = strings.TrimSpace(got[0])
	}
	if proto == "" || !httpguts.HeaderValuesContainsToken(protos, proto) {
		// A switch to a protocol the client did not ask for (or to several) is
		// no answer to its request.
		bc.Close()
		return failed(Reset, fmt.Errorf("backend switched to %q, not to one of %q", resp.Header["Upgrade"], protos))
	}
	hj, ok := w.(http.Hijacker)
	var cc net.Conn
	var crw *bufio.ReadWriter
	if ok {
		cc, crw, err = hj.Hijack()
	}
	if !ok || err != nil {
		bc.Close()
		lease.Release(balance.Result{})
		plainError(w, r, http.StatusBadGateway, grpcUnavailable, fmt.Sprintf("service %q: this connection cannot switch protocols", s.cfg.Name))
		return true, failure{}
	}
	l.observeTry(be, Success)
	be.stats.count(resp.StatusCode)
	s.stats.requests.Add(1)

	// The backend's 101, less the hop-by-hop fields but the switch's own.
	h := resp.Header
	removeConnectionHeaders(h, h)
	cw := crw.Writer
	cw.WriteString("HTTP/1.1 " + resp.Status + "\r\n")
	for k, vv := range h {
		if hopByHop(k) || !httpguts.ValidHeaderFieldName(k) {
			continue
		}
		for _, v := range vv {
			writeField(cw, k, v)
		}
	}
	writeField(cw, "Connection", "Upgrade")
	writeField(cw, "Upgrade", proto)
	cw.WriteString("\r\n")
	// What the backend sent behind its 101 goes first.
	if k := a.rd.Buffered(); k > 0 {
		b, _ := a.rd.Peek(k)
		cw.Write(b)
	}
	err = cw.Flush()
	// What the client sent behind its request, read ahead by the server, goes
	// first; the rest is read from the connection itself. (net/http's reader
	// would cancel the request's context at the client's half-close, and the
	// tunnel is not the request's any more.)
	var ahead []byte
	if k := crw.Reader.Buffered(); k > 0 {
		b, _ := crw.Reader.Peek(k)
		ahead = bytes.Clone(b)
	}
	if l.cfg.Observer != nil {
		// The request is the switch: its duration is the time to the 101, which
		// a tunnel open for hours would not swamp in the latency histograms.
		l.cfg.Observer.Request(be.addr, resp.StatusCode, time.Since(start))
	}
	if err != nil {
		cc.Close()
		bc.Close()
		lease.Release(balance.Result{Latency: headerLatency})
		return true, failure{}
	}
	// The tunnel runs on goroutines of its own and the request returns: the
	// client connection's goroutine, deep in the request's frames, and its
	// session would otherwise be held for the tunnel's life (TestIdleTunnelMemory).
	// The tunnel stays a request in flight (the request's count is its to
	// end), and keeps the lease, until it ends.
	t := s.newTunnel(be, cc, bc, s.cfg.IdleTimeout)
	t.acct = acceptedConn(w, cc)
	held := *lease
	*lease = balance.Lease{}
	method, path, remote := r.Method, r.URL.Path, r.RemoteAddr
	accessLog := l.cfg.AccessLog
	// Exits when both directions have ended (or the tunnel is aborted:
	// idle, drain or shutdown).
	go func() {
		up, down, err := t.run(ahead)
		s.dropTunnel(t)
		cc.Close()
		bc.Close()
		held.Release(balance.Result{Latency: headerLatency})
		s.stats.inflight.Add(-1)
		if accessLog {
			s.log.Info("tunnel", "method", method, "path", path, "client", remote, "backend", be.id,
				"upgrade", proto, "bytes_in", up, "bytes_out", down, "headers", headerLatency,
				"duration", time.Since(start), "err", err)
		}
	}()
	return true, failure{tunnel: true}
}

// is1xx: an interim status, as http.Transport reads them.
func is1xx(code int) bool { return 100 <= code && code <= 199 }

// errTunnelIdle ends a tunnel that moved no byte either way for the idle timeout.
var errTunnelIdle = errors.New("tunnel idle")

// tunnel is a client connection joined to a backend's after a switch of
// protocols.
type tunnel struct {
	be   *backend
	c, b net.Conn
	// acct is c as it was accepted, told c's failures (clientFailed): the
	// tunnel's reads go around it. nil if not known.
	acct   *coalescingConn
	idle   time.Duration
	moved  atomic.Bool // bytes moved since the idle timer last looked
	misses int         // looks in a row that found none (the timer's own)
	timer  *time.Timer
	once   sync.Once
	ended  atomic.Bool
	idled  atomic.Bool // ended by the idle timer
	done   chan struct{}
}

func (s *Service) newTunnel(be *backend, c, b net.Conn, idle time.Duration) *tunnel {
	t := &tunnel{be: be, c: c, b: b, idle: idle, done: make(chan struct{})}
	if idle > 0 {
		// One timer for both directions, looking every idle/2 whether bytes
		// moved (a deadline per read would reset a runtime timer per message);
		// two looks in a row that find none end the tunnel: idle to 1.5×idle
		// after its last byte.
		// Armed once the field is set: checkIdle reads it.
		t.timer = time.AfterFunc(time.Duration(math.MaxInt64), t.checkIdle)
		t.timer.Reset(idle / 2)
	}
	s.tunMu.Lock()
	if s.tunnels == nil {
		s.tunnels = map[*tunnel]struct{}{}
	}
	s.tunnels[t] = struct{}{}
	closing := s.tunClosing
	s.tunMu.Unlock()
	if closing {
		t.abort()
	}
	return t
}

func (s *Service) dropTunnel(t *tunnel) {
	close(t.done)
	s.tunMu.Lock()
	delete(s.tunnels, t)
	s.tunMu.Unlock()
}

// shutdownTunnels lets the tunnels run until they end or deadline, then
// closes them. A tunnel opened meanwhile (its 101 was on its way) is closed at
// once.
func (s *Service) shutdownTunnels(deadline <-chan struct{}) {
	s.tunMu.Lock()
	ts := make([]*tunnel, 0, len(s.tunnels))
	for t := range s.tunnels {
		ts = append(ts, t)
	}
	s.tunMu.Unlock()
	for _, t := range ts {
		select {
		case <-t.done:
		case <-deadline:
			t.abort()
		}
	}
	s.tunMu.Lock()
	s.tunClosing = true
	for t := range s.tunnels {
		t.abort()
	}
	s.tunMu.Unlock()
}

// drainTunnels arms be's drain timer (draining: the backend was drained, set
// to weight 0 or removed) or stops it: DrainTimeout after a backend began to
// drain, its tunnels are closed, as the proxy closes a draining backend's
// connections; its clients reconnect through the service to another backend.
// Called with s.mu held.
func (s *Service) drainTunnels(be *backend, draining bool) {
	switch {
	case !draining:
		if be.drainTimer != nil {
			be.drainTimer.Stop()
			be.drainTimer = nil
		}
	case be.drainTimer == nil && s.cfg.DrainTimeout > 0:
		var timer *time.Timer
		timer = time.AfterFunc(s.cfg.DrainTimeout, func() {
			s.mu.Lock()
			current := be.drainTimer == timer // not stopped while it fired
			s.mu.Unlock()
			if current {
				s.closeTunnelsOf(be)
			}
		})
		be.drainTimer = timer
	}
}

// closeTunnelsOf closes the tunnels to be.
func (s *Service) closeTunnelsOf(be *backend) {
	s.tunMu.Lock()
	var ts []*tunnel
	for t := range s.tunnels {
		if t.be == be {
			ts = append(ts, t)
		}
	}
	s.tunMu.Unlock()
	for _, t := range ts {
		t.abort()
	}
	if len(ts) > 0 {
		s.log.Info("drain timeout: closed tunnels", "backend", be.id, "closed", len(ts))
	}
}

// acceptedConn returns the connection as it was accepted of the client's
// connection w answers on, hijacked as c: the HTTP/1.1 loop's session has it,
// net/http's server hijacks what it was given (the sniffed connection, or TLS
// over the accepted one); nil if neither.
func acceptedConn(w http.ResponseWriter, c net.Conn) *coalescingConn {
	if hw, ok := w.(*h1Writer); ok {
		return hw.c.in.acct
	}
	for {
		switch x := c.(type) {
		case *coalescingConn:
			return x
		case *prefixConn:
			return x.coalescingConn
		case *tls.Conn:
			c = x.NetConn()
		default:
			return nil
		}
	}
}

// closedChan is a deadline already past.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// checkIdle ends the tunnel if no byte moved since it last looked.
func (t *tunnel) checkIdle() {
	if t.ended.Load() {
		return
	}
	if t.moved.Swap(false) {
		t.misses = 0
	} else if t.misses++; t.misses == 2 {
		t.idled.Store(true)
		t.abort()
		return
	}
	t.timer.Reset(t.idle / 2)
}

// abort ends the tunnel now: both connections close.
func (t *tunnel) abort() {
	t.once.Do(func() {
		t.ended.Store(true)
		if t.timer != nil {
			t.timer.Stop()
		}
		t.c.Close()
		t.b.Close()
	})
}

// run copies both ways until both directions have ended: a direction that
// ends cleanly passes its end on (a half-close), one that fails ends the
// tunnel. ahead is what the client sent that was read before the switch.
func (t *tunnel) run(ahead []byte) (up, down int64, err error) {
	var upErr error
	var wg sync.WaitGroup
	// Ends when the client's side ends or the tunnel is aborted.
	wg.Go(func() {
		if len(ahead) > 0 {
			if _, upErr = t.b.Write(ahead); upErr != nil {
				t.abort()
				return
			}
			up = int64(len(ahead))
		}
		var n int64
		n, upErr = t.pipe(t.b, t.c)
		up += n
	})
	down, err = t.pipe(t.c, t.b)
	wg.Wait()
	if err == nil {
		err = upErr
	}
	return up, down, err
}

// pipe copies from src to dst until src ends. A clean end half-closes dst; an
// error aborts the tunnel.
func (t *tunnel) pipe(dst, src net.Conn) (int64, error) {
	r := newPooledReader(src, &bufPool)
	defer r.release()
	var n int64
	for {
		b, err := r.read()
		if len(b) > 0 {
			if !t.moved.Load() {
				t.moved.Store(true) // a load first: no cache line written per message
			}
			if _, werr := dst.Write(b); werr != nil {
				if dst == t.c {
					t.acct.clientFailed(werr)
				}
				t.abort()
				return n, werr
			}
			n += int64(len(b))
		}
		switch {
		case err == nil:
			continue
		case err == io.EOF:
			if cw, ok := dst.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
				return n, nil
			}
			t.abort()
			return n, nil
		}
		if src == t.c {
			t.acct.clientFailed(err)
		}
		ended := t.ended.Load()
		t.abort()
		switch {
		case t.idled.Load():
			return n, errTunnelIdle
		case ended:
			return n, nil
		}
		return n, err
	}
}
