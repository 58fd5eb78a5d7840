package httplb

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/textproto"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/http/httpguts"
)

// This file is the upstream side of HTTP/1.1 requests without a body (GET, HEAD
// and the like: most of what a balancer carries) and of those whose small body
// came whole with their head (a POST of a little JSON), done on the handler's
// own goroutine. http.Transport writes each request from a goroutine of its own
// and reads each response on another, so a request costs two goroutine hand-offs
// besides the wait for the answer, and its idle connections each hold a reader
// parked in the poller. Here the handler writes the request (the head as
// Request.Write would, then the body it holds), reads the answer
// (http.ReadResponse: the standard library's parser, not one of weir's) and
// streams the body, and an idle connection is a socket in a list. Requests with
// any other body (longer, chunked, not all come yet, or sent with Expect) stay
// with http.Transport, which writes the body while it reads the answer (a
// backend may answer before the body is all sent), and so do upgrades.

// h1Pool is one backend's idle HTTP/1.1 connections for the synchronous path.
type h1Pool struct {
	dial      func(ctx context.Context) (net.Conn, error)
	maxIdle   int
	idleFor   time.Duration
	maxHeader int64

	mu     sync.Mutex
	idle   []*h1Conn // most recently used last
	closed bool
	reaper *time.Timer
}

// h1Conn is an upstream connection with its buffers.
type h1Conn struct {
	pool   *h1Pool
	c      net.Conn
	raw    syscall.RawConn // for the check that the backend has not closed it
	lim    limitReader
	br     *bufio.Reader
	bw     *bufio.Writer
	used   bool // has carried a request: the backend may have closed it meanwhile
	idleAt time.Time
	// breakOff fails a blocked read or write: made once, not per request, as
	// exchange hands it to onCancel.
	breakOff func()
	// peek is alive's look at the socket, made once too; it leaves its
	// finding in peekIdle.
	peek     func(fd uintptr) bool
	peekIdle bool
}

// limitReader caps what the response's header may take (MaxResponseHeaderBytes,
// as http.Transport does); the body reads with no cap.
type limitReader struct {
	r io.Reader
	n int64
}

func (l *limitReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, errHeaderTooLong
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	return n, err
}

var errHeaderTooLong = errors.New("backend's response header is too long")

func newH1Pool(dial func(ctx context.Context) (net.Conn, error), maxIdle int, idleFor time.Duration, maxHeader int64) *h1Pool {
	return &h1Pool{dial: dial, maxIdle: maxIdle, idleFor: idleFor, maxHeader: maxHeader}
}

// get returns an idle connection the backend still holds open and has sent
// nothing on since its last answer, or a new one.
//
// Every idle connection is looked at first (a system call), whatever the
// request: bytes a backend sent past an answer's end (a HEAD answer's body is
// the common case) would otherwise be read as the answer to the next request,
// which may be another client's.
func (p *h1Pool) get(ctx context.Context) (*h1Conn, error) {
	for {
		p.mu.Lock()
		n := len(p.idle)
		if n == 0 {
			p.mu.Unlock()
			break
		}
		hc := p.idle[n-1]
		p.idle[n-1] = nil
		p.idle = p.idle[:n-1]
		p.mu.Unlock()
		if hc.alive() {
			return hc, nil
		}
		hc.c.Close()
	}
	c, err := p.dial(ctx)
	if err != nil {
		return nil, err
	}
	hc := &h1Conn{pool: p, c: c}
	hc.breakOff = func() { hc.c.SetDeadline(aLongTimeAgo) }
	hc.peek = func(fd uintptr) bool {
		var b [1]byte
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		hc.peekIdle = n < 0 && (err == syscall.EAGAIN || err == syscall.EWOULDBLOCK)
		return true
	}
	if sc, ok := c.(syscall.Conn); ok {
		hc.raw, _ = sc.SyscallConn()
	}
	hc.lim.r = c
	hc.br = bufio.NewReaderSize(&hc.lim, 32<<10)
	hc.bw = bufio.NewWriterSize(c, 4<<10)
	return hc, nil
}

// alive reports whether an idle connection can take a request: the backend has
// neither closed it nor sent anything unasked (a peek that finds nothing). Without
// the check, a backend's idle timeout would meet the next request, which for a
// method that is not idempotent could not be sent again.
func (hc *h1Conn) alive() bool {
	if hc.br.Buffered() > 0 {
		return false
	}
	if hc.raw == nil {
		return true
	}
	hc.raw.Read(hc.peek)
	return hc.peekIdle
}

// put returns a connection whose last answer has been read whole.
func (p *h1Pool) put(hc *h1Conn) {
	hc.used = true
	hc.idleAt = time.Now()
	p.mu.Lock()
	if p.closed || len(p.idle) >= p.maxIdle {
		p.mu.Unlock()
		hc.c.Close()
		return
	}
	p.idle = append(p.idle, hc)
	if p.reaper == nil && p.idleFor > 0 {
		p.reaper = time.AfterFunc(p.idleFor, p.reap)
	}
	p.mu.Unlock()
}

// reap closes the connections idle for longer than idleFor, and runs again while
// any are left.
func (p *h1Pool) reap() {
	now := time.Now()
	p.mu.Lock()
	k := 0
	for k < len(p.idle) && now.Sub(p.idle[k].idleAt) >= p.idleFor {
		k++
	}
	old := slices.Clone(p.idle[:k])
	p.idle = append(p.idle[:0], p.idle[k:]...)
	p.reaper = nil
	if len(p.idle) > 0 && !p.closed {
		next := p.idle[0].idleAt.Add(p.idleFor).Sub(now)
		p.reaper = time.AfterFunc(max(next, time.Second), p.reap)
	}
	p.mu.Unlock()
	for _, hc := range old {
		hc.c.Close()
	}
}

// reopen lets the pool keep idle connections again.
func (p *h1Pool) reopen() {
	p.mu.Lock()
	p.closed = false
	p.mu.Unlock()
}

// close closes every idle connection and keeps none from then on, until reopen.
func (p *h1Pool) close() {
	p.mu.Lock()
	idle := p.idle
	p.idle = nil
	p.closed = true
	if p.reaper != nil {
		p.reaper.Stop()
		p.reaper = nil
	}
	p.mu.Unlock()
	for _, hc := range idle {
		hc.c.Close()
	}
}

// errUpstreamReused marks a failure on a reused connection before any of the
// answer came: the backend may have closed it just as the request went out
// (EOF, a reset, EPIPE). Not ETIMEDOUT: that connection was not closed, its
// backend stopped acknowledging (TCP_USER_TIMEOUT, keepalive), and a new
// connection to it would fare no better; that failure is the try's, counted
// against the backend and retried elsewhere as any other.
type errUpstreamReused struct{ err error }

func (e *errUpstreamReused) Error() string { return e.err.Error() }
func (e *errUpstreamReused) Unwrap() error { return e.err }

// roundTrip sends req with body (nil: none; req.Body is not read) and returns
// the answer; ctx, not req's own, bounds it (so the caller need not copy the
// request to give it one). The answer's body must be read to the end or closed;
// the connection goes back to the pool when it has been read whole. ans is
// where the answer's body goes (resp.Body), the caller's until it is done with
// the answer. On a reused connection that fails
// before any answer comes, a request that may be sent twice is sent once more on
// a new connection, as http.Transport does (the body is in hand, as it is for
// http.Transport with GetBody).
func (p *h1Pool) roundTrip(ctx context.Context, req *http.Request, body []byte, ans *h1Body) (*http.Response, error) {
	again := replayable(req)
	for attempt := 0; ; attempt++ {
		// A backend can still close a connection the check found open, just
		// as the request goes out.
		hc, err := p.get(ctx)
		if err != nil {
			return nil, err
		}
		resp, err := hc.exchange(ctx, req, body, ans)
		if err == nil {
			return resp, nil
		}
		var reused *errUpstreamReused
		if attempt == 0 && errors.As(err, &reused) && ctx.Err() == nil && again {
			continue
		}
		return nil, err
	}
}

// replayable is http.Transport's rule for sending a request again after a reused
// connection failed: a method that is safe to repeat, or an Idempotency-Key
// (and a body that can be sent again, which roundTrip's is).
func replayable(req *http.Request) bool {
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	_, a := req.Header["Idempotency-Key"]
	_, b := req.Header["X-Idempotency-Key"]
	return a || b
}

func (hc *h1Conn) exchange(ctx context.Context, req *http.Request, body []byte, ans *h1Body) (*http.Response, error) {
	// A cancelled context (the client gone, a timeout) breaks off the wait and the
	// body: the deadline fails the blocked read.
	stop := onCancel(ctx, hc.breakOff)
	fail := func(err error, answered bool) (*http.Response, error) {
		stop.end()
		hc.c.Close()
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		if hc.used && !answered && !errors.Is(err, syscall.ETIMEDOUT) {
			return nil, &errUpstreamReused{err}
		}
		return nil, err
	}
	if err := writeRequestHead(hc.bw, req, len(body)); err != nil {
		return fail(err, false)
	}
	// With the head in one write when it fits the buffer: the body is all
	// sent before the answer is read, so an answer that comes early (a 413)
	// is read as any other.
	hc.bw.Write(body)
	if err := hc.bw.Flush(); err != nil {
		return fail(err, false)
	}
	// 1xx answers (103 Early Hints and the like) before the answer are
	// dropped. A 101 ends the wait: upgrades do not come here, and try refuses
	// it.
	a, err := readAnswer(hc.br, &hc.lim, req, hc.pool.maxHeader)
	if err != nil {
		return fail(err, a.came)
	}
	resp := a.resp
	// The request's own body, not the connection's: the handler may still
	// close this one after the connection has gone back to the pool and
	// carries the next. The caller's, so it costs no allocation.
	*ans = h1Body{hc: hc, body: resp.Body, resp: resp, stop: stop, grown: a.rd != hc.br}
	resp.Body = ans
	return resp, nil
}

// h1Body is an answer's body; the connection goes back to the pool once it has
// been read to its end, and is closed if the body is closed before that.
type h1Body struct {
	hc   *h1Conn
	body io.ReadCloser
	resp *http.Response
	stop cancelHook
	done bool
	// grown: the answer's head did not fit the connection's reader, and was
	// read with a larger one of its own, which the body reads on from: the
	// connection is closed after it rather than kept with that reader.
	grown bool
}

// cancelHook is a function run when a context is cancelled, until end.
type cancelHook struct {
	sess *sessionCtx // the HTTP/1.1 connection's own context holds it
	stop func() bool // or context.AfterFunc's
}

// onCancel runs f when ctx is cancelled, until the hook's end. An HTTP/1.1
// connection's context holds it without allocating; any other context (one with
// a timeout of its own) goes through context.AfterFunc.
func onCancel(ctx context.Context, f func()) cancelHook {
	if x, ok := ctx.(*sessionCtx); ok && x.hold(f) {
		return cancelHook{sess: x}
	}
	return cancelHook{stop: context.AfterFunc(ctx, f)}
}

// end stops the hook; it reports whether f had not run.
func (h cancelHook) end() bool {
	if h.sess != nil {
		return h.sess.release()
	}
	return h.stop()
}

func (b *h1Body) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	n, err := b.body.Read(p)
	if err == io.EOF {
		b.finish(true)
	} else if err != nil {
		b.finish(false)
	}
	return n, err
}

func (b *h1Body) Close() error {
	if !b.done {
		b.finish(false)
	}
	return nil
}

// finish ends the exchange: the connection is kept if the answer was read whole,
// the backend keeps it open and the cancellation had not fired.
func (b *h1Body) finish(whole bool) {
	b.done = true
	hc := b.hc
	// Bytes already read past the answer's end are not the next answer (get).
	if !b.stop.end() || !whole || b.grown || b.resp.Close || b.resp.Request.Close || hc.br.Buffered() > 0 {
		hc.c.Close()
		return
	}
	hc.pool.put(hc)
}

// writeRequestHead writes a request's head as http.Request.Write would for the
// request with a body of n bytes (0: none) (the same request line, Host,
// header fields and Content-Length rules), but
// straight into the buffer: Request.Write formats with fmt, sorts the header's
// names and copies them, which was a tenth of the plane's own time per request.
func writeRequestHead(bw *bufio.Writer, req *http.Request, n int) error {
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	host, err := httpguts.PunycodeHostPort(host)
	if err != nil {
		return err
	}
	if !httpguts.ValidHostHeader(host) {
		host = "" // what Request.Write sends for a host it cannot
	}
	host = withoutZone(host)
	path, query, hasQuery := requestTarget(req.URL)
	if hasCTL(path) || hasCTL(query) {
		return errors.New("request URI holds a control character")
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	bw.WriteString(method)
	bw.WriteByte(' ')
	bw.WriteString(path)
	if hasQuery {
		bw.WriteByte('?')
		bw.WriteString(query)
	}
	bw.WriteString(" HTTP/1.1\r\nHost: ")
	bw.WriteString(host)
	bw.WriteString("\r\n")
	for k, vv := range req.Header {
		switch k {
		case "Host", "Content-Length", "Transfer-Encoding", "Trailer":
			continue
		case "User-Agent":
			if len(vv) == 0 || vv[0] == "" {
				continue // Request.Write's rule: an empty User-Agent is none
			}
			vv = vv[:1]
		}
		if !httpguts.ValidHeaderFieldName(k) {
			continue
		}
		for _, v := range vv {
			writeField(bw, k, textproto.TrimString(v))
		}
	}
	switch {
	case n > 0:
		bw.WriteString("Content-Length: ")
		bw.Write(strconv.AppendInt(bw.AvailableBuffer(), int64(n), 10)) // no array to escape (writeHead)
		bw.WriteString("\r\n")
	case method == http.MethodPost || method == http.MethodPut || method == http.MethodPatch:
		bw.WriteString("Content-Length: 0\r\n") // servers expect a length with these
	}
	_, err = bw.WriteString("\r\n")
	return err
}

// requestTarget is u.RequestURI() in its pieces: the path (or opaque part),
// and the query if there is one (hasQuery: a "?" goes before it, even an
// empty one), so that writing it needs no string joined per request (a
// target with a query cost an allocation).
func requestTarget(u *url.URL) (path, query string, hasQuery bool) {
	path = u.Opaque
	if path == "" {
		if path = u.EscapedPath(); path == "" {
			path = "/"
		}
	} else if strings.HasPrefix(path, "//") {
		path = u.Scheme + ":" + path
	}
	return path, u.RawQuery, u.ForceQuery || u.RawQuery != ""
}

// hasCTL reports whether s holds a control character (a byte under 0x20, or
// DEL); bytes of multi-byte UTF-8 sequences are none.
func hasCTL(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < ' ' || s[i] == 0x7f {
			return true
		}
	}
	return false
}

// withoutZone drops an IPv6 zone from a bracketed host ("[fe80::1%eth0]:80"):
// it means nothing to the backend.
func withoutZone(host string) string {
	if !strings.HasPrefix(host, "[") {
		return host
	}
	end := strings.LastIndexByte(host, ']')
	if pct := strings.LastIndexByte(host[:max(end, 0)], '%'); end > 0 && pct > 0 {
		return host[:pct] + host[end:]
	}
	return host
}
