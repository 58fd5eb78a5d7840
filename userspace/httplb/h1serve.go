package httplb

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/http2"
)

// This file serves HTTP/1.1 clients: one goroutine per connection reads a
// request (http.ReadRequest: the standard library's parser), forwards it through
// ServeHTTP with a ResponseWriter of its own that frames the answer straight into
// the connection's buffer, and reads the next. It replaces net/http's server for
// these connections because that server pays, per request, for a goroutine that
// reads ahead to notice a client that has gone (a read that finds nothing, and
// two deadline changes to stop it), a cancellable context and a response object
// with buffers from pools; on loopback, dropping them took a quarter off weir's
// CPU per request (bench/README.md). What it keeps from net/http's server: the same checks of a request
// (header limit, Host, header names and values, Expect), the same answers to bad
// ones, keep-alive and HTTP/1.0 rules, 100-continue, trailers, the h2c upgrade
// (handed to x/net's HTTP/2 server), and graceful shutdown.
//
// A client that goes away mid-request is still noticed, lazily: only a request
// still unanswered after h1WatchAfter gets a read that watches the connection,
// and its ending cancels the request's context, which breaks off the backend's
// request as net/http's would.

// h1WatchAfter is how long a request runs before its connection is watched for
// the client going away. Most answers come sooner and never pay for the watch.
const h1WatchAfter = 20 * time.Millisecond

// h1MaxDiscard is how much of a request body nobody read is read and dropped to
// keep the connection (net/http's maxPostHandlerReadBytes); past it the
// connection closes.
const h1MaxDiscard = 256 << 10

// h1MaxUpgradeBody bounds the body of an h2c upgrade request, which must be read
// whole before the connection switches.
const h1MaxUpgradeBody = 1 << 20

var (
	errClientGone = errors.New("client closed the connection")
	errShutdown   = errors.New("service shut down before the request ended")
)

// Client connection states; shutdown closes only idle ones (between two
// requests: a new connection starts active).
const (
	h1Idle int32 = iota
	h1Active
	h1Closed
)

// h1Session is one HTTP/1.1 client connection.
type h1Session struct {
	s      *Service
	conn   net.Conn
	in     h1Input
	out    h1Output
	br     *bufio.Reader // nil only while awaitRequest waits
	bw     *bufio.Writer // writes to out
	idle   *pooledReader // awaitRequest's, made at its first wait
	remote string
	tls    *tls.ConnectionState
	ctx    *sessionCtx // cancelled when the client is seen to go away
	state  atomic.Int32
	done   chan struct{} // closed when serve returns
	w      h1Writer

	// The watch for a client that goes away while its request is forwarded.
	// The timer outlives a request: armed by one whose connection had none
	// pending, it finds the request in flight when it fires (watchFrom) and
	// waits out what is left of that one's h1WatchAfter, or goes unarmed if
	// the connection is idle. Back-to-back requests so cost no timer change
	// each: resetting a timer wakes a thread to poll for it (a futex wake
	// per request). A request that came alone (none armed within
	// h1WatchAfter before it) stops the timer when it ends, as the next one
	// is not expected soon: kept, the timer would fire once for nothing.
	watch     *time.Timer
	wmu       sync.Mutex
	watching  int32 // watchOff, watchArmed, watchReading
	watchSet  bool  // watch is pending, or its function runs and has yet to decide
	watchFrom int64 // nanotime of the armed request's start
	watchArms int   // how often a request set the timer (a test reads it)
	watchKeep bool  // the armed request came soon after the one before it
	aborting  bool  // the loop ended the watch's read
	watchWG   sync.WaitGroup
	body      *h1ReqBody // the request's body; nil without one
}

const (
	watchOff int32 = iota
	watchArmed
	watchReading
)

// h1Input is what the connection's reader reads: bytes read ahead first (the
// listener's sniff, the idle wait's read, the watch's byte), then the
// connection, with the header limit while a header is read.
type h1Input struct {
	pending []byte
	held    *pooledReader // owns pending's buffer until pending is read; nil if none does
	lim     limitReader
	// acct is the connection as it was accepted, which counts the client
	// gone if a read or write of it fails so (clientFailed): the session's
	// reads and writes go around it.
	acct *coalescingConn
}

func (in *h1Input) Read(p []byte) (int, error) {
	if len(in.pending) > 0 {
		n := copy(p, in.pending)
		in.pending = in.pending[n:]
		if len(in.pending) == 0 && in.held != nil {
			// Nil too: the watch appends its byte to pending, which must not
			// land in a buffer back in the pool.
			in.pending = nil
			in.held.release()
			in.held = nil
		}
		return n, nil
	}
	n, err := in.lim.Read(p)
	if err != nil {
		in.acct.clientFailed(err)
	}
	return n, err
}

// h1Output is what the connection's writer writes to: the connection, whose
// failures the accepted connection is told (clientFailed).
type h1Output struct {
	conn net.Conn
	acct *coalescingConn
}

func (out *h1Output) Write(p []byte) (int, error) {
	n, err := out.conn.Write(p)
	if err != nil {
		out.acct.clientFailed(err)
	}
	return n, err
}

// serveH1 serves an HTTP/1.1 client connection until it closes. acct is the
// connection as it was accepted, which conn reads and writes (or goes around);
// prefix is what the listener read of it first; tlsState is set for TLS
// connections; arrived is called once the session is known to a shutdown (or
// refused by it).
func (s *Service) serveH1(conn net.Conn, acct *coalescingConn, prefix []byte, tlsState *tls.ConnectionState, arrived func()) {
	c := s.newH1Session(conn, acct, prefix, tlsState)
	defer s.stats.conns.Add(-1)
	defer c.watch.Stop()
	defer close(c.done)
	defer c.ctx.cancelWith(nil)
	ok := s.registerH1(c)
	arrived()
	if !ok {
		conn.Close()
		return
	}
	defer s.unregisterH1(c)
	if c.serve() {
		conn.Close()
	}
}

// newH1Session sets up a connection's session. Not inlined into serveH1: its
// temporaries would widen serveH1's frame, which stays under every idle
// connection's parked read, and a parked goroutine that uses a quarter of its
// stack, less 800 bytes, or more keeps its whole stack through garbage
// collection (it is not shrunk), which each idle connection pays for.
//
//go:noinline
func (s *Service) newH1Session(conn net.Conn, acct *coalescingConn, prefix []byte, tlsState *tls.ConnectionState) *h1Session {
	c := &h1Session{s: s, conn: conn, remote: conn.RemoteAddr().String(), tls: tlsState, done: make(chan struct{})}
	c.in = h1Input{pending: prefix, lim: limitReader{r: conn, n: math.MaxInt64}, acct: acct}
	c.out = h1Output{conn: conn, acct: acct}
	c.br = h1ReaderPool.Get().(*bufio.Reader)
	c.br.Reset(&c.in)
	c.ctx = newSessionCtx()
	c.w.c = c
	c.w.own = http.Header{} // no room until a field goes in: most answers bring their own
	c.w.header = c.w.own
	c.watch = time.AfterFunc(time.Hour, c.startWatch)
	c.watch.Stop()
	// Not idle until its first request is answered: a client that was
	// accepted has a request coming, which a shutdown lets it bring (within
	// the header timeout) and answers with Connection: close, as net/http's
	// server does a new connection's.
	c.state.Store(h1Active)
	return c
}

// serve reads and answers requests until the connection is to close; false: it
// was handed to the HTTP/2 server, which closes it.
func (c *h1Session) serve() bool {
	s := c.s
	// The first request's head is due by the read deadline the listener set
	// (the header timeout from the accept, or from the TLS handshake's end),
	// as net/http has it: the wait for its first byte and its read share it
	// (a connection that sends nothing is not kept for the idle timeout). The
	// later ones may keep the client waiting up to the idle timeout.
	first := true
	lastMethod := ""
	for {
		wait := s.cfg.IdleTimeout
		if first {
			wait = 0
		}
		if !c.nextRequest(wait, lastMethod == http.MethodPost) {
			return true
		}
		if !c.state.CompareAndSwap(h1Idle, h1Active) && c.state.Load() == h1Closed {
			return true // shutdown closed it
		}
		c.in.lim.n = int64(s.cfg.MaxHeaderBytes) + 4096
		// The head as it came, for ambiguousFraming: read whole into the reader
		// (if it fits), from which http.ReadRequest then parses it without
		// reading more, so the bytes stay put.
		head := bufferedHead(c.br)
		var err error
		if head == nil {
			if !first {
				c.conn.SetReadDeadline(time.Now().Add(s.cfg.ReadHeaderTimeout))
			}
			head, err = readHead(c.br)
		}
		first = false
		var req *http.Request
		if err == nil {
			req, err = http.ReadRequest(c.br)
		}
		tooLong := c.in.lim.n <= 0
		c.in.lim.n = math.MaxInt64
		if err != nil {
			c.badRequest(err, tooLong)
			return true
		}
		if ambiguousFraming(req, head) {
			req.Close = true
		}
		lastMethod = req.Method
		if status, why := checkRequest(req); status != 0 {
			c.reject(status, why)
			return true
		}
		if isH2CUpgrade(req) && c.tls == nil {
			return c.upgrade(req)
		}
		if !c.forward(req) {
			// A hijacked connection is the tunnel's now, to close.
			return !c.w.hijacked
		}
		c.dropWriter()
		// The answered request and the backend's answer header are garbage
		// now; an idle connection does not keep them.
		c.w.req, c.w.header = nil, c.w.own
		c.state.Store(h1Idle)
		if s.h1Shutdown.Load() {
			return true // shutdown may have passed this connection by while it was active
		}
	}
}

// nextRequest waits, if it must, until the next request's first byte has
// come: under wait, from when it began to wait (the header timeout a request's
// head is read under is due from that byte on, as net/http's server has it),
// or with zero, under the read deadline set; false: none came in time, or the
// connection closed or failed.
//
// Some clients end a POST's body with a CRLF more, which net/http's server
// skips too (RFC 9112 2.2): after a POST, up to 4 CR and LF bytes before the
// next request are dropped, and are no start of one. A client that sent them
// and then nothing is an idle client, kept for the idle timeout; one that
// sent a byte of the next request's head has its header timeout.
func (c *h1Session) nextRequest(wait time.Duration, afterPOST bool) bool {
	skip := 0
	if afterPOST {
		skip = 4
	}
	waiting := false
	for {
		for skip > 0 {
			if c.br.Buffered() == 0 {
				if len(c.in.pending) == 0 {
					break
				}
				c.br.Peek(1) // from pending: no read of the connection
			}
			b, _ := c.br.Peek(min(c.br.Buffered(), skip))
			n := leadingCRLF(b)
			c.br.Discard(n)
			skip -= n
			if n < len(b) {
				skip = 0 // a request's first byte
			}
		}
		if c.br.Buffered() > 0 || len(c.in.pending) > 0 {
			return true
		}
		if !waiting && wait > 0 {
			waiting = true
			c.conn.SetReadDeadline(time.Now().Add(wait))
		}
		if !c.awaitRequest() {
			return false
		}
	}
}

// awaitRequest waits for the client's next bytes, with the connection's read
// deadline; false: none will come (closed, failed or timed out). A connection
// the runtime poller can be asked about waits holding no read buffer: its
// reader goes back to h1ReaderPool for the wait, and the bytes come in a
// buffer from h1ReadPool, which the reader takes them from (4 KiB less per
// idle keep-alive connection).
func (c *h1Session) awaitRequest() bool {
	if c.idle == nil {
		c.idle = newPooledReader(c.conn, &h1ReadPool)
	}
	if !c.idle.raw() {
		_, err := c.br.Peek(1)
		return err == nil
	}
	c.putReader()
	b, err := c.idle.read()
	c.takeReader()
	if err != nil {
		c.in.acct.clientFailed(err)
		return false
	}
	c.in.pending, c.in.held = b, c.idle
	// Into the reader at once, as a wait on the reader would have put them
	// (bufferedHead looks there), and the read buffer back to the pool.
	c.br.Peek(1)
	return true
}

// putReader gives the connection's reader back to h1ReaderPool for a wait,
// and takeReader takes one again. Not inlined into awaitRequest: bufio's
// Reset builds a whole Reader on the stack, and two of them would widen the
// frame the wait parks under past what garbage collection allows a stack it
// halves, a quarter of the goroutine's 8 KB less 800 bytes kept for nosplit
// calls (runtime/stack.go, shrinkstack): 4 KB more per idle connection. The
// chain uses about 1150 of those 1248 bytes (TestIdleKeepAliveMemory).
//
//go:noinline
func (c *h1Session) putReader() {
	c.br.Reset(nil)
	h1ReaderPool.Put(c.br)
	c.br = nil
}

//go:noinline
func (c *h1Session) takeReader() {
	c.br = h1ReaderPool.Get().(*bufio.Reader)
	c.br.Reset(&c.in)
}

func leadingCRLF(b []byte) int {
	n := 0
	for n < len(b) && (b[n] == '\r' || b[n] == '\n') {
		n++
	}
	return n
}

// forward answers one request; false: the connection is to close after it.
func (c *h1Session) forward(req *http.Request) (keep bool) {
	s := c.s
	c.takeWriter()
	defer c.w.dropPending()
	req.RemoteAddr = c.remote
	req.TLS = c.tls
	keep = !req.Close
	w := &c.w
	w.reset(req)
	body, ok := c.requestBody(req)
	if !ok {
		return false
	}
	c.body = body
	c.armWatch()
	ok = c.serveHTTP(w, req)
	c.endWatch()
	c.body = nil
	if !ok || w.hijacked {
		return false
	}
	if body != nil && !body.finish(s.cfg.ReadHeaderTimeout) {
		w.closeAfter = true // not yet framed if the handler wrote nothing
	}
	err := w.finish()
	if w.writeDeadline {
		c.conn.SetWriteDeadline(time.Time{}) // the request's, not the next one's
	}
	if err != nil || w.closeAfter || c.ctx.Err() != nil {
		return false
	}
	return keep
}

// requestBody wraps req's body for the loop (100 Continue, the end of the
// request) and checks Expect, answering 417 to one it does not know; false:
// the connection is to close.
func (c *h1Session) requestBody(req *http.Request) (*h1ReqBody, bool) {
	ex := req.Header["Expect"]
	if ex != nil && (len(ex) != 1 || !strings.EqualFold(ex[0], "100-continue")) {
		c.reject(http.StatusExpectationFailed, "")
		return nil, false
	}
	if req.Body == nil || req.Body == http.NoBody {
		return nil, true
	}
	// A body's reads are not bounded by the idle or header deadline (net/http
	// without a ReadTimeout bounds them by nothing either).
	c.conn.SetReadDeadline(time.Time{})
	body := &h1ReqBody{c: c, rc: req.Body, wantContinue: ex != nil && req.ProtoAtLeast(1, 1)}
	req.Body = body
	return body, true
}

// serveHTTP runs the handler; false: it panicked, and the connection is to
// close without more being written (http.ErrAbortHandler: the answer broke off).
func (c *h1Session) serveHTTP(w *h1Writer, req *http.Request) (ok bool) {
	defer func() {
		if v := recover(); v != nil {
			ok = false
			if v != http.ErrAbortHandler {
				c.s.log.Error("http: panic serving a request", "client", c.remote, "panic", v, "stack", string(debug.Stack()))
			}
			// What was framed so far goes out, so the client sees the answer
			// end early rather than nothing (none after a hijack: the
			// connection was handed over).
			if c.bw != nil {
				c.bw.Flush()
			}
		}
	}()
	c.s.serveRequest(c.ctx, w, req)
	return true
}

// checkRequest is net/http's server's check of a request http.ReadRequest has
// read (which refuses a second Host itself): a version it serves, a valid
// Host, and field names and values RFC 9110 allows. textproto's reader lets
// through a field name with a space in it ("X Y: 1"), which a backend would
// read otherwise or refuse (http.Transport refuses to send it; weir's own
// writer would drop it).
func checkRequest(req *http.Request) (int, string) {
	if req.ProtoMajor != 1 {
		return http.StatusHTTPVersionNotSupported, "unsupported protocol version"
	}
	if req.ProtoAtLeast(1, 1) && req.Host == "" && req.Method != http.MethodConnect {
		return http.StatusBadRequest, "missing required Host header"
	}
	if !httpguts.ValidHostHeader(req.Host) {
		return http.StatusBadRequest, "malformed Host header"
	}
	for k, vv := range req.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return http.StatusBadRequest, "invalid header name"
		}
		for _, v := range vv {
			if !httpguts.ValidHeaderFieldValue(v) {
				return http.StatusBadRequest, "invalid header value"
			}
		}
	}
	return 0, ""
}

// badRequest answers a request http.ReadRequest could not read, as net/http's
// server does; a connection that closed or timed out gets no answer.
func (c *h1Session) badRequest(err error, tooLong bool) {
	switch {
	case tooLong:
		c.reject(http.StatusRequestHeaderFieldsTooLarge, "")
	case strings.Contains(err.Error(), "unsupported transfer encoding"):
		c.reject(http.StatusNotImplemented, "Unsupported transfer encoding")
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), isTimeout(err), isReadError(err):
		// Nothing to answer: the client closed, or was too slow.
	default:
		c.s.log.Debug("bad request", "client", c.remote, "err", err)
		c.reject(http.StatusBadRequest, "")
	}
}

func isReadError(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "read"
}

// takeWriter gives the connection a write buffer for an answer. An idle
// connection holds none (h1WriterPool keeps them): 4 KiB less per idle client.
// Taken on the connection's goroutine before a handler runs, so a transport's
// goroutine sending 100 Continue finds it there.
func (c *h1Session) takeWriter() {
	if c.bw == nil {
		c.bw = h1WriterPool.Get().(*bufio.Writer)
		c.bw.Reset(&c.out)
	}
}

// dropWriter gives the write buffer back once an answer has gone out.
func (c *h1Session) dropWriter() {
	if c.bw != nil && c.bw.Buffered() == 0 {
		c.bw.Reset(nil)
		h1WriterPool.Put(c.bw)
		c.bw = nil
	}
}

var (
	h1WriterPool  = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 4<<10) }}
	h1ReaderPool  = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}
	h1ReadPool    = sync.Pool{New: func() any { b := make([]byte, 4<<10); return &b }}
	h1PendingPool = sync.Pool{New: func() any { return new([h1PendingMax]byte) }}
)

// h1PendingMax is how much of an answer of unknown length the writer holds back,
// to send it with a Content-Length if it ends within that (net/http holds 2 KiB
// too), rather than chunked.
const h1PendingMax = 2 << 10

// reject answers status and closes: the connection's state is not known to be
// at a request's start any more.
func (c *h1Session) reject(status int, why string) {
	c.takeWriter()
	text := strconv.Itoa(status) + " " + http.StatusText(status)
	if why != "" {
		text += ": " + why
	}
	c.conn.SetWriteDeadline(time.Now().Add(time.Second))
	if status == http.StatusExpectationFailed {
		// net/http's answer to an Expect it does not know: no body.
		c.bw.WriteString("HTTP/1.1 " + text + "\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
	} else {
		c.bw.WriteString("HTTP/1.1 " + text + "\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n" + text)
	}
	c.bw.Flush()
	if tc, ok := c.conn.(interface{ CloseWrite() error }); ok {
		// The client may still be sending; a close with unread bytes would reset
		// the connection and could lose the answer. net/http waits a moment too.
		// Read through the session's input, which tells the accepted
		// connection a failure (clientFailed): a client that stopped
		// acknowledging the answer fails this read.
		tc.CloseWrite()
		c.conn.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		io.Copy(io.Discard, io.LimitReader(&c.in, 256<<10))
	}
}

// upgrade switches the connection to HTTP/2 (an h2c upgrade: RFC 7540 3.2) and
// hands it to x/net's HTTP/2 server, which answers the upgrading request as its
// stream 1, as net/http's h2c handler does.
func (c *h1Session) upgrade(req *http.Request) bool {
	vals := req.Header["Http2-Settings"]
	if len(vals) != 1 {
		c.reject(http.StatusBadRequest, "want one HTTP2-Settings header")
		return true
	}
	settings, err := base64.RawURLEncoding.DecodeString(vals[0])
	if err != nil {
		c.reject(http.StatusBadRequest, "malformed HTTP2-Settings header")
		return true
	}
	c.takeWriter() // before the body's read, which may send 100 Continue
	c.w.reset(req)
	rb, ok := c.requestBody(req)
	if !ok {
		return true
	}
	var body []byte
	if rb != nil {
		c.conn.SetReadDeadline(time.Now().Add(c.s.cfg.ReadHeaderTimeout))
		var err error
		body, err = io.ReadAll(io.LimitReader(rb, h1MaxUpgradeBody+1))
		if err != nil {
			return true
		}
	}
	if len(body) > h1MaxUpgradeBody {
		c.reject(http.StatusRequestEntityTooLarge, "")
		return true
	}
	c.conn.SetReadDeadline(time.Time{})
	req.Body = io.NopCloser(strings.NewReader(string(body)))
	req.RemoteAddr = c.remote
	c.bw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
	if c.bw.Flush() != nil {
		return true
	}
	// No longer an HTTP/1.1 connection: the HTTP/2 server's shutdown (through
	// s.upgraded) sends it GOAWAY.
	c.s.unregisterH1(c)
	c.s.h2.ServeConn(&h1Upgraded{Conn: c.conn, r: c.br, w: &c.out}, &http2.ServeConnOpts{
		BaseConfig: c.s.upgraded, Handler: c.s, UpgradeRequest: req, Settings: settings,
	})
	return false
}

// h1Upgraded is an upgraded connection, read on through the HTTP/1.1 reader, so
// what it had read ahead (and the watch's byte under it) comes first, and
// written through the session's output, which tells its failures.
type h1Upgraded struct {
	net.Conn
	r io.Reader
	w io.Writer
}

func (u *h1Upgraded) Read(p []byte) (int, error)  { return u.r.Read(p) }
func (u *h1Upgraded) Write(p []byte) (int, error) { return u.w.Write(p) }

// armWatch starts the countdown to watching the connection for the request.
func (c *h1Session) armWatch() {
	c.wmu.Lock()
	c.watching = watchArmed
	now := nanotime()
	c.watchKeep = now-c.watchFrom < int64(h1WatchAfter)
	c.watchFrom = now
	set := c.watchSet
	c.watchSet = true
	if !set {
		c.watchArms++
	}
	c.wmu.Unlock()
	if !set {
		c.watch.Reset(h1WatchAfter)
	}
}

// startWatch runs when a request has taken h1WatchAfter: a read on the
// connection that ends when the client closes it (the request's context is
// cancelled), sends more (a pipelined request: kept for the reader), or the
// request ends (the loop stops the read with a deadline).
func (c *h1Session) startWatch() {
	c.wmu.Lock()
	if c.watching != watchArmed {
		c.watchSet = false // idle: the next request arms it
		c.wmu.Unlock()
		return
	}
	if left := h1WatchAfter - time.Duration(nanotime()-c.watchFrom); left > 0 {
		// A request that came after the one that armed the timer. Under
		// wmu, so endWatch's stop sees the timer pending or not yet fired.
		c.watch.Reset(left)
		c.wmu.Unlock()
		return
	}
	if b := c.body; b != nil && !b.eof.Load() {
		// The body is still being read from the connection: try later.
		c.wmu.Unlock()
		c.watch.Reset(h1WatchAfter)
		return
	}
	c.watching = watchReading
	c.watchSet = false
	c.watchWG.Add(1)
	c.wmu.Unlock()
	defer c.watchWG.Done()
	var b [1]byte
	for {
		n, err := c.conn.Read(b[:])
		if err != nil {
			c.in.acct.clientFailed(err) // ETIMEDOUT looks like a deadline below
		}
		c.wmu.Lock()
		switch {
		case n > 0:
			c.in.pending = append(c.in.pending, b[0])
		case c.aborting:
		case isTimeout(err):
			// A deadline the request's header or the idle wait left: the
			// request goes on, and so does the watch. Under wmu, so the loop's
			// stop (aborting, then its own deadline) cannot come in between.
			c.conn.SetReadDeadline(time.Time{})
			c.wmu.Unlock()
			continue
		case err != nil:
			c.ctx.cancelWith(errClientGone)
		}
		c.wmu.Unlock()
		return
	}
}

// endWatch stops the watch when the request has been answered, and waits for
// its read to end.
func (c *h1Session) endWatch() {
	c.wmu.Lock()
	reading := c.watching == watchReading
	c.watching = watchOff
	if !c.watchKeep && c.watchSet && c.watch.Stop() {
		c.watchSet = false
	}
	if reading {
		c.aborting = true
		c.conn.SetReadDeadline(aLongTimeAgo)
	}
	c.wmu.Unlock()
	if reading {
		c.watchWG.Wait()
		c.aborting = false
		// The stop's deadline must not meet the next request's reads.
		c.conn.SetReadDeadline(time.Time{})
	}
}

var aLongTimeAgo = time.Unix(1, 0)

// h1ReqBody is a request's body as the handler and the transports read it.
// Close is the loop's (finish): a transport closing it must not read the rest,
// as net/http's body would, on the transport's goroutine while the loop reads the
// next request.
type h1ReqBody struct {
	c            *h1Session
	rc           io.ReadCloser
	wantContinue bool // the client waits for 100 Continue before it sends
	// eof: no more of the body will be read from the connection (its end was
	// read, or finish closed it), so the watch may read there.
	eof atomic.Bool

	mu     sync.Mutex // one reader at a time; held through a read
	closed bool
	kept   bool // closed with the body read to its end: the connection can go on
	sent   bool // 100 Continue
}

func (b *h1ReqBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, http.ErrBodyReadAfterClose
	}
	if b.wantContinue && !b.sent {
		b.sent = true
		if !b.c.w.writeContinue() {
			return 0, errors.New("100 Continue not sent: the answer has begun")
		}
	}
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.eof.Store(true)
	}
	return n, err
}

func (b *h1ReqBody) Close() error { return nil }

// inHand reads a body of n bytes (Content-Length) into buf and returns it, if
// all of it is in the connection's reader already, having come with its head
// (so within the reader's 4 KiB): no read waits on the client, and none is
// left for the loop. nil: the body is not read (longer than buf, not all come,
// or the client awaits 100 Continue), and streams as any other.
func (b *h1ReqBody) inHand(n int64, buf []byte) ([]byte, error) {
	if b.wantContinue || n <= 0 || n > int64(len(buf)) || int64(b.c.br.Buffered()) < n {
		return nil, nil
	}
	buf = buf[:n]
	got := 0
	for {
		// Read on past the n bytes: the end, read, marks the body done
		// (eof), as a transport's last read would.
		k, err := b.Read(buf[got:])
		got += k
		switch {
		case err == io.EOF && got == len(buf):
			return buf, nil
		case err == io.EOF:
			return nil, io.ErrUnexpectedEOF
		case err != nil:
			return nil, err
		}
	}
}

// finish ends the body once the request is answered: what nobody read is read
// and dropped, up to h1MaxDiscard and for at most wait; false: the connection
// cannot carry another request.
//
// The connection's writer calls it before it frames the answer, as net/http's
// server does, so an answer after which the connection closes says so; a
// second call returns what the first found.
func (b *h1ReqBody) finish(wait time.Duration) bool {
	if b.eof.Load() {
		return true
	}
	// Bounds the discard, and a read a transport is blocked in: that read holds
	// mu, so the deadline goes on first. Set under mu, it would wait for a client
	// that has paused its upload (the backend answered before the body's end)
	// for ever, and the answer with it.
	b.c.conn.SetReadDeadline(time.Now().Add(wait))
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.kept
	}
	b.closed = true
	if b.wantContinue && !b.sent {
		b.eof.Store(true)
		return false // the client never sent it; it may yet, or not
	}
	n, err := io.CopyN(io.Discard, b.rc, h1MaxDiscard)
	b.kept = err == io.EOF && n < h1MaxDiscard
	b.eof.Store(true)
	return b.kept
}

// h1Writer frames a request's answer into the connection's buffer: headers when
// the first body bytes or the end come, then the body with a Content-Length
// (the backend's, or counted when the answer is short and ends before the
// buffer fills), chunked when the length is not known, or up to a close for an
// HTTP/1.0 client.
type h1Writer struct {
	c      *h1Session
	req    *http.Request
	header http.Header // the answer's: own, or the backend's answer's (respond)
	own    http.Header // kept from request to request

	mu         sync.Mutex // the status line, against a 100 Continue from a transport's goroutine
	status     int
	committed  bool // the status line and headers are in the buffer
	chunked    bool
	closeAfter bool
	hijacked   bool // the connection went to a tunnel (tunnel.go)
	// writeDeadline: the handler bounded the answer's writes (SetWriteDeadline);
	// lifted once the answer is out.
	writeDeadline bool
	head          bool  // a HEAD request: no body goes out
	noBody        bool  // a status without a body (1xx, 204, 304)
	length        int64 // the Content-Length sent; -1 none
	written       int64
	pending       []byte              // body written before the length was known, in pendingBuf
	pendingBuf    *[h1PendingMax]byte // from h1PendingPool while an answer needs it
	err           error
}

func (w *h1Writer) reset(req *http.Request) {
	clear(w.own)
	w.header = w.own
	w.req = req
	w.status = 0
	w.committed, w.chunked, w.closeAfter, w.hijacked, w.writeDeadline = false, false, false, false, false
	w.head = req.Method == http.MethodHead
	w.noBody = false
	w.length = -1
	w.written = 0
	w.dropPending()
	w.err = nil
}

// dropPending gives the held-back body's buffer back.
func (w *h1Writer) dropPending() {
	if w.pendingBuf != nil {
		h1PendingPool.Put(w.pendingBuf)
		w.pendingBuf = nil
	}
	w.pending = nil
}

func (w *h1Writer) Header() http.Header { return w.header }

func (w *h1Writer) WriteHeader(code int) {
	if w.status != 0 {
		return
	}
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		// An interim answer (103 Early Hints): sent now, with the headers so
		// far, as net/http does.
		w.mu.Lock()
		if !w.committed {
			w.writeHead(code, false)
			w.err = w.c.bw.Flush()
		}
		w.mu.Unlock()
		return
	}
	w.status = code
	w.noBody = code == http.StatusNoContent || code == http.StatusNotModified || code < 200
}

func (w *h1Writer) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	if w.noBody {
		return 0, http.ErrBodyNotAllowed
	}
	if w.head {
		return len(p), nil
	}
	if !w.committed {
		if w.header["Content-Length"] == nil && len(w.pending)+len(p) <= h1PendingMax {
			if w.pendingBuf == nil {
				w.pendingBuf = h1PendingPool.Get().(*[h1PendingMax]byte)
				w.pending = w.pendingBuf[:0]
			}
			w.pending = append(w.pending, p...)
			return len(p), nil
		}
		if err := w.commitPending(false); err != nil {
			return 0, err
		}
	}
	return w.writeBody(p)
}

// framed makes sure the status line and headers are in the buffer (200 if the
// handler set no status), and what was written before them; ending: as
// commit's. It returns the error of an earlier write, if any.
func (w *h1Writer) framed(ending bool) error {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return w.err
	}
	if !w.committed {
		return w.commitPending(ending)
	}
	return nil
}

// commitPending puts the headers in the buffer, and after them what was
// written before they were; ending: as commit's.
func (w *h1Writer) commitPending(ending bool) error {
	w.commit(ending)
	if len(w.pending) == 0 {
		return nil
	}
	pending := w.pending
	w.pending = w.pending[:0]
	_, err := w.writeBody(pending)
	return err
}

func (w *h1Writer) writeBody(p []byte) (int, error) {
	if w.length >= 0 && w.written+int64(len(p)) > w.length {
		return 0, http.ErrContentLength
	}
	bw := w.c.bw
	if w.chunked {
		if len(p) == 0 {
			return 0, nil
		}
		bw.WriteString(strconv.FormatInt(int64(len(p)), 16))
		bw.WriteString("\r\n")
	}
	n, err := bw.Write(p)
	if w.chunked && err == nil {
		_, err = bw.WriteString("\r\n")
	}
	w.written += int64(n)
	if err != nil {
		w.err = err
	}
	return n, err
}

// FlushError sends what is buffered; an answer of unknown length goes chunked
// from here (http.ResponseController finds it).
func (w *h1Writer) FlushError() error {
	if err := w.framed(false); err != nil {
		return err
	}
	if err := w.c.bw.Flush(); err != nil {
		w.err = err
	}
	return w.err
}

// SetWriteDeadline bounds the answer's writes to the client
// (http.ResponseController finds it); the deadline is lifted once the answer
// is out, before the connection's next request.
func (w *h1Writer) SetWriteDeadline(t time.Time) error {
	w.writeDeadline = true
	return w.c.conn.SetWriteDeadline(t)
}

// SetReadDeadline bounds the reads of the request's body from the client
// (http.ResponseController finds it): how a try whose time is up breaks off a
// transport's read of a body the client has paused.
func (w *h1Writer) SetReadDeadline(t time.Time) error {
	return w.c.conn.SetReadDeadline(t)
}

// Flush is FlushError for callers that know only http.Flusher.
func (w *h1Writer) Flush() { w.FlushError() }

// finish ends the answer: headers if not yet sent (with the length of what was
// written), the last chunk and trailers, and the buffer flushed.
func (w *h1Writer) finish() error {
	if err := w.framed(true); err != nil {
		return err
	}
	bw := w.c.bw
	if w.chunked {
		bw.WriteString("0\r\n")
		for k, vv := range w.header {
			name, ok := strings.CutPrefix(k, http.TrailerPrefix)
			if !ok || !httpguts.ValidHeaderFieldName(name) {
				continue
			}
			for _, v := range vv {
				writeField(bw, name, v)
			}
		}
		bw.WriteString("\r\n")
	}
	if w.length >= 0 && w.written != w.length && !w.head && !w.noBody {
		w.closeAfter = true // the framing promised more than came
	}
	if err := bw.Flush(); err != nil {
		w.err = err
	}
	return w.err
}

// commit puts the status line and headers in the buffer; ending: the handler has
// returned, so what is pending is the whole body.
func (w *h1Writer) commit(ending bool) {
	if b := w.c.body; b != nil && !b.finish(w.c.s.cfg.ReadHeaderTimeout) {
		w.closeAfter = true // before w.mu: a body read may be sending 100 Continue
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	h := w.header
	delete(h, "Transfer-Encoding")
	if w.status == http.StatusNoContent {
		delete(h, "Content-Length") // RFC 9110 8.6: never on a 204
	}
	if cl := h["Content-Length"]; cl != nil {
		if n, err := strconv.ParseInt(cl[0], 10, 64); err == nil && n >= 0 && len(cl) == 1 {
			w.length = n
		} else {
			delete(h, "Content-Length")
		}
	}
	if w.head {
		w.length = -1 // whatever it says, no body follows
	}
	req := w.req
	switch {
	case w.noBody || w.head:
	case w.length >= 0:
	case ending && (w.header["Trailer"] == nil || !req.ProtoAtLeast(1, 1)):
		// A short answer that has ended gets its length, unless trailers
		// are to follow it, which only chunked framing has room for.
		w.length = int64(len(w.pending))
		h["Content-Length"] = []string{strconv.Itoa(len(w.pending))}
	case req.ProtoAtLeast(1, 1):
		w.chunked = true
	default:
		w.closeAfter = true // an HTTP/1.0 client reads to the close
	}
	if req.Close || w.c.s.h1Shutdown.Load() || w.c.ctx.Err() != nil {
		w.closeAfter = true
	}
	w.writeHead(w.status, true)
	w.committed = true
}

// writeHead writes a status line and the header; final adds the framing and
// connection fields.
func (w *h1Writer) writeHead(code int, final bool) {
	bw := w.c.bw
	if w.req.ProtoAtLeast(1, 1) {
		bw.WriteString("HTTP/1.1 ")
	} else {
		bw.WriteString("HTTP/1.0 ")
	}
	// Appended in the buffer's free room: a number appended to an array of
	// this frame's would escape (through the writer's io.Writer) and cost an
	// allocation per answer.
	bw.Write(strconv.AppendInt(bw.AvailableBuffer(), int64(code), 10))
	bw.WriteByte(' ')
	if text := http.StatusText(code); text != "" {
		bw.WriteString(text)
	} else {
		bw.WriteString("status code " + strconv.Itoa(code))
	}
	bw.WriteString("\r\n")
	for k, vv := range w.header {
		if !final && (k == "Content-Length" || k == "Transfer-Encoding") {
			continue
		}
		if strings.HasPrefix(k, http.TrailerPrefix) || k == "Connection" || !httpguts.ValidHeaderFieldName(k) {
			continue
		}
		for _, v := range vv {
			writeField(bw, k, v)
		}
	}
	if final {
		if w.header["Date"] == nil {
			bw.WriteString("Date: ")
			bw.Write(httpDate())
			bw.WriteString("\r\n")
		}
		if w.chunked {
			bw.WriteString("Transfer-Encoding: chunked\r\n")
		}
		switch {
		case w.closeAfter:
			bw.WriteString("Connection: close\r\n")
		case !w.req.ProtoAtLeast(1, 1):
			bw.WriteString("Connection: keep-alive\r\n")
		}
	}
	bw.WriteString("\r\n")
}

// writeContinue sends 100 Continue unless the answer has begun; false: it has.
func (w *h1Writer) writeContinue() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.committed {
		return false
	}
	w.c.bw.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
	return w.c.bw.Flush() == nil
}

// Hijack hands the connection to a tunnel (an upgrade its backend accepted),
// from inside the handler: the watch stops, the reader keeps what it has read
// ahead, and nothing more of the answer is framed. The handler owns the
// connection until it returns; the loop then closes it.
func (w *h1Writer) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	c := w.c
	if w.committed {
		return nil, nil, errors.New("httplb: an answer has begun on this connection")
	}
	c.endWatch()
	w.hijacked = true
	// The request's header deadline is still on the connection: the caller
	// sets its own, as net/http's Hijack leaves it to do.
	c.conn.SetDeadline(time.Time{})
	if n := len(c.in.pending); n > 0 {
		// The watch's byte goes into the reader, whose buffered bytes are all
		// the caller looks at before reading the connection.
		c.br.Peek(c.br.Buffered() + n)
	}
	rw := bufio.NewReadWriter(c.br, c.bw)
	// The session reads and writes no more: the caller holds the buffers only
	// until its first bytes are out and what was read ahead is taken, so a
	// long-lived tunnel does not keep them.
	c.br, c.bw = nil, nil
	return c.conn, rw, nil
}

// writeField writes one header field; a line break in a value (which no parser
// of weir's inputs lets through, but a value is checked where it is written)
// becomes a space, as net/http does.
func writeField(bw *bufio.Writer, k, v string) {
	bw.WriteString(k)
	bw.WriteString(": ")
	if strings.ContainsAny(v, "\r\n") {
		v = lineBreakToSpace.Replace(v)
	}
	bw.WriteString(v)
	bw.WriteString("\r\n")
}

var lineBreakToSpace = strings.NewReplacer("\r", " ", "\n", " ")

// dateStamp is the Date header's value for one second.
type dateStamp struct {
	sec int64
	b   []byte
}

// dateCache is formatted once a second.
var dateCache atomic.Pointer[dateStamp]

func httpDate() []byte {
	now := time.Now()
	if d := dateCache.Load(); d != nil && d.sec == now.Unix() {
		return d.b
	}
	d := &dateStamp{now.Unix(), now.UTC().AppendFormat(nil, http.TimeFormat)}
	dateCache.Store(d)
	return d.b
}

// registerH1 adds a connection for shutdown to find; false: the service is
// shutting down.
func (s *Service) registerH1(c *h1Session) bool {
	s.h1mu.Lock()
	defer s.h1mu.Unlock()
	if s.h1Shutdown.Load() {
		return false
	}
	if s.h1conns == nil {
		s.h1conns = map[*h1Session]struct{}{}
	}
	s.h1conns[c] = struct{}{}
	return true
}

func (s *Service) unregisterH1(c *h1Session) {
	s.h1mu.Lock()
	delete(s.h1conns, c)
	s.h1mu.Unlock()
}

// shutdownH1 closes the idle HTTP/1.1 connections, lets the others finish the
// request they carry (answered with Connection: close), and waits for them
// until deadline, then closes what is left.
func (s *Service) shutdownH1(deadline <-chan struct{}) {
	conns := s.stopH1()
	for _, c := range conns {
		if c.state.CompareAndSwap(h1Idle, h1Closed) {
			c.conn.Close()
		}
	}
	for _, c := range conns {
		select {
		case <-c.done:
		case <-deadline:
			c.abort()
		}
	}
}

// closeH1 closes every HTTP/1.1 connection at once.
func (s *Service) closeH1() {
	for _, c := range s.stopH1() {
		c.abort()
	}
}

// abort ends the connection now: its request's context is cancelled, which
// breaks off a wait for the backend, and the socket is closed; it returns once
// the connection's goroutine has.
func (c *h1Session) abort() {
	c.ctx.cancelWith(errShutdown)
	c.conn.Close()
	<-c.done
}

func (s *Service) stopH1() []*h1Session {
	s.h1mu.Lock()
	defer s.h1mu.Unlock()
	s.h1Shutdown.Store(true)
	conns := make([]*h1Session, 0, len(s.h1conns))
	for c := range s.h1conns {
		conns = append(conns, c)
	}
	return conns
}

// isH2CUpgrade is RFC 7540 3.2's upgrade request: an HTTP/1.1 request (1.0 has
// no upgrade, RFC 9110 7.8) whose Upgrade names h2c and whose Connection names
// both Upgrade and HTTP2-Settings. Anything less is a plain request.
func isH2CUpgrade(r *http.Request) bool {
	h := r.Header
	return r.ProtoAtLeast(1, 1) && httpguts.HeaderValuesContainsToken(h["Upgrade"], "h2c") &&
		httpguts.HeaderValuesContainsToken(h["Connection"], "upgrade") &&
		httpguts.HeaderValuesContainsToken(h["Connection"], "HTTP2-Settings")
}

// sessionCtx is an HTTP/1.1 connection's context, cancelled when the client is
// seen to go away and at shutdown's drain timeout. Besides that it holds one
// hook, the break-off of the upstream exchange in progress (a connection has
// one at a time): setting it allocates nothing, where context.AfterFunc
// allocates twice per request.
type sessionCtx struct {
	context.Context
	cancel context.CancelCauseFunc

	mu   sync.Mutex // over cancel and hook, so a hook never runs after a release that said it had not
	hook func()
}

func newSessionCtx() *sessionCtx {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &sessionCtx{Context: ctx, cancel: cancel}
}

// cancelWith cancels the context with cause err and runs the hook, if one is set.
func (x *sessionCtx) cancelWith(err error) {
	x.mu.Lock()
	x.cancel(err)
	hook := x.hook
	x.hook = nil
	x.mu.Unlock()
	if hook != nil {
		hook()
	}
}

// hold makes f the hook; if the context is cancelled already, f runs now. It
// reports false if another hook is set (f is then not held).
func (x *sessionCtx) hold(f func()) bool {
	x.mu.Lock()
	if x.hook != nil {
		x.mu.Unlock()
		return false
	}
	if x.Err() != nil {
		x.mu.Unlock()
		f()
		return true
	}
	x.hook = f
	x.mu.Unlock()
	return true
}

// release drops the hook; it reports whether the hook had not run (as the stop
// function context.AfterFunc returns does).
func (x *sessionCtx) release() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.Err() != nil {
		return false
	}
	x.hook = nil
	return true
}
