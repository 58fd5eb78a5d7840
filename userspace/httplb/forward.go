package httplb

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/weir-lb/weir/userspace/balance"
)

// errTryTimeout is the cause a try's context is cancelled with when the backend
// has not answered with headers within TryTimeout.
var errTryTimeout = errors.New("no response headers within try_timeout")

// ServeHTTP forwards one request: pick a backend, send, and on a failure that is
// safe to retry pick another (never one already tried), within Retries and the
// retry budget. Once the response headers are written the request is the
// backend's: a failure after that resets the client's stream.
func (s *Service) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.serveRequest(r.Context(), w, r)
}

// serveRequest is ServeHTTP with the client's context given apart from r, so
// the HTTP/1.1 connection loop need not copy each request to attach its own:
// r.Context() is not the client's there; use client.
func (s *Service) serveRequest(client context.Context, w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	l := s.live.Load()
	s.stats.inflight.Add(1)
	tunnel := false // then the tunnel ends the request's count, when it ends
	defer func() {
		if !tunnel {
			s.stats.inflight.Add(-1)
		}
	}()
	if r.Method == http.MethodConnect {
		// A reverse proxy answers requests; it does not open tunnels.
		s.stats.requests.Add(1)
		plainError(w, r, http.StatusMethodNotAllowed, grpcUnavailable, fmt.Sprintf("service %q: CONNECT is not proxied", s.cfg.Name))
		return
	}
	l.budget.deposit()
	ctx := client
	if l.cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, l.cfg.Timeout)
		defer cancel()
	}
	// picker's balancer picks the request's backends, with key: the
	// request's own configuration's first, the one in force for retries
	// and tries moved off a backend retired since its pick.
	picker, key := l, l.hashKey(r)
	retryable := idempotent(r.Method) || l.grpcRetryable(r)
	// sc is set exactly for the requests weir's own exchange carries.
	sc, err := ownScratch(l.cfg.Upstream, r)
	if sc != nil {
		defer sc.put()
	}
	if err != nil {
		// Cannot be, the body's bytes having come: the client's fault if it is.
		s.answerFailure(l, w, r, failure{status: http.StatusBadRequest, err: fmt.Errorf("request body: %w", err), client: true}, 0, start)
		return
	}
	var body *replayBody
	if sc == nil && hasBody(r) {
		body = &replayBody{src: r.Body, keep: retryable && l.cfg.Retries > 0}
	}
	if body != nil && l.cfg.Timeout > 0 {
		// When the request's time is up, a read of the body the try under
		// way is blocked in is broken off: RoundTrip waits for it. (A try's
		// own timeout does the same from its timer, in try.) Only with a
		// timeout: the hook costs allocations.
		stop := context.AfterFunc(ctx, func() { body.breakRead(w, 0) })
		defer stop()
	}
	hdr := l.outHeader(r, sc)
	// The backends tried: the first kept apart, so a request that is not retried
	// allocates no list (a closure that reads the list makes it escape).
	var first string
	var tried []string
	ntried := 0
	// The backends a try was moved off (notSent): never tried, they are
	// picked again once configured again.
	var movedOff []string
	var fail failure
	for try := 0; ; try++ {
		if try > 0 {
			// A try not sent (notSent) is not a retry: the same try goes
			// on, if it can send the body.
			if !fail.notSent && (try > l.cfg.Retries || !fail.retry) {
				break
			}
			body.mend(w)
			if !body.replayable(fail.dial) || !fail.notSent && !l.budget.withdraw() {
				break
			}
		}
		if try > 0 || fail.notSent {
			// A retry, or a try moved off a backend retired or removed
			// since it was picked, is picked by the balancer in force:
			// the request's own, replaced by a reload that changed the
			// algorithm, may know no other backend, or still offer one
			// removed or down since. It is given the key its
			// configuration makes, which hashes what the request's may
			// not.
			if nl := s.live.Load(); nl != picker {
				picker, key = nl, nl.hashKey(r)
			}
		}
		var lease balance.Lease
		if ntried == 0 && movedOff == nil {
			lease, err = picker.bal.Pick(key, nil)
		} else {
			lease, err = picker.bal.Pick(key, s.excluded(first, tried, movedOff))
		}
		if err != nil {
			if try == 0 {
				paused := pausedUpload(w, r, body)
				s.noBackend(w, r, "every backend is down, drained or ejected")
				if paused {
					s.closeUpload(w, r)
				}
				return
			}
			break // every usable backend has been tried: answer with the last failure
		}
		be := s.backend(lease.Backend())
		if be == nil {
			// Removed between the pick and now, or offered by a balancer
			// a reload replaced: the request never left, and goes on as
			// the same try.
			movedOff = append(movedOff, lease.Backend())
			lease.Release(balance.Result{})
			fail = moveOn(fail, failure{retry: true, dial: true, notSent: true, status: http.StatusBadGateway, err: ErrNoBackend}, try > 0)
			try--
			continue
		}
		var done bool
		var f failure
		// An upgrade goes over HTTP/1.1 whatever the upstream protocol: HTTP/2
		// has no Upgrade (RFC 9113 8.6), and a tunnel gains nothing from sharing
		// a connection.
		if sc == nil && r.Header["Upgrade"] != nil && upgradeProtocols(r) != nil {
			done, f = s.tunnelTry(client, ctx, l, w, r, be, &lease, hdr, upgradeProtocols(r), retryable, try, start)
		} else {
			done, f = s.try(client, ctx, l, w, r, be, &lease, hdr, sc, body, retryable, try, start)
		}
		if done {
			tunnel = f.tunnel
			return
		}
		if f.notSent {
			f = moveOn(fail, f, try > 0)
			movedOff = append(movedOff, be.id)
			try-- // the same try, to another backend
		} else {
			if ntried == 0 {
				first = be.id
			} else {
				tried = append(tried, be.id)
			}
			ntried++
		}
		fail = f
	}
	if client.Err() != nil {
		abandoned()
	}
	paused := pausedUpload(w, r, body)
	s.answerFailure(l, w, r, fail, ntried, start)
	if paused {
		s.closeUpload(w, r)
	}
}

// excluded is the backends a request's next pick must pass over: those it
// was tried on (first, "" before any, then tried), and those a try was moved
// off (movedOff) while they are still retired or gone.
func (s *Service) excluded(first string, tried []string, movedOff []string) func(string) bool {
	return func(id string) bool {
		if id == first && first != "" || slices.Contains(tried, id) {
			return true
		}
		if slices.Contains(movedOff, id) {
			be := s.backend(id)
			return be == nil || be.retired.Load()
		}
		return false
	}
}

// moveOn is the failure a request goes on from after a try moved to another
// backend (f, notSent): it keeps the status and error of last, the last try
// that failed, if one did (failed), to answer with should no other try
// succeed.
func moveOn(last, f failure, failed bool) failure {
	if failed {
		f.status, f.err, f.resp = last.status, last.err, last.resp
	}
	return f
}

// errStatusUnder100 is a backend's answer with a status under 100, which Go's
// response reader takes (any three digits) but no client may be sent: it is
// treated as an answer that could not be read (a 502).
func errStatusUnder100(code int) error {
	return fmt.Errorf("malformed answer: status %03d", code)
}

// rawTargetPath is the path of a request's target as the client wrote it, to be
// sent on as it is, as nginx and HAProxy send it: rebuilt from the parsed URL, a
// target's encoding changes (/a{b} goes as /a%7Bb%7D, /x? as /x), and with it
// what a signed URL's signature or a backend's routing covers. A URL whose
// Opaque is set writes it as its request target's path. "" where the parsed
// URL serves: no target in origin or absolute form, no path, or a path
// starting "//", which Opaque would write as a scheme-relative URL.
func rawTargetPath(target string) string {
	if q := strings.IndexByte(target, '?'); q >= 0 {
		target = target[:q] // before the authority's end: "http://x?q/a" has none
	}
	if i := strings.Index(target, "://"); i > 0 && !strings.HasPrefix(target, "/") {
		rest := target[i+len("://"):]
		j := strings.IndexByte(rest, '/')
		if j < 0 {
			return ""
		}
		target = rest[j:]
	}
	if !strings.HasPrefix(target, "/") || strings.HasPrefix(target, "//") {
		return ""
	}
	return target
}

// errUnaskedSwitch is a 101 to a request that asked for no upgrade: an answer
// that cannot be forwarded (a 502).
var errUnaskedSwitch = errors.New("malformed answer: 101 Switching Protocols to a request without an upgrade")

// retiredSincePick is a try whose backend was retired between the pick and
// its connection, which it is refused: nothing went to the backend, and
// nothing counts against it.
func retiredSincePick(lease *balance.Lease) failure {
	lease.Release(balance.Result{})
	return failure{retry: true, dial: true, notSent: true, status: http.StatusBadGateway, err: &dialError{errRetired}}
}

// abandoned ends a request whose client went away (closed, or ended its
// sending side, which net/http's server takes as gone too) before any answer:
// without a word, where a handler that returned having written nothing would
// have its server send an empty 200 OK, which a half-closed client still reads.
func abandoned() {
	panic(http.ErrAbortHandler)
}

// failure is what a try that did not answer the client came to.
type failure struct {
	retry  bool // another backend may take the request
	dial   bool // the request never left: safe whatever the method
	status int  // what to answer if no other try succeeds
	err    error
	resp   string // the backend's status line, for 5xx answers
	// tunnel: the request became a tunnel, which counts itself in flight
	// until it ends (with done).
	tunnel bool
	// client: the request itself failed (its body), not the backend.
	client bool
	// notSent: the backend, retired since the pick, got no connection for
	// the request; it goes to another as the same try.
	notSent bool
	// deadline: weir's own timeout (try_timeout, timeout) ended the try.
	deadline bool
}

// The grpc-status of weir's own answers to gRPC calls.
const (
	grpcUnavailable      = "14" // UNAVAILABLE: no usable backend, a failed try, a refusal
	grpcDeadlineExceeded = "4"  // DEADLINE_EXCEEDED: weir's own timeout ran out
)

// grpcStatus is the grpc-status of a gRPC call answered with f: weir's own
// timeout is DEADLINE_EXCEEDED, as Envoy's router answers its timeouts, so
// a client's retry policy, which retries UNAVAILABLE, does not send again a
// call that has had its time; anything else is UNAVAILABLE.
func (f failure) grpcStatus() string {
	if f.deadline {
		return grpcDeadlineExceeded
	}
	return grpcUnavailable
}

// try sends the request to one backend, as its try number try (0: the
// first). done reports that the client has its answer (or is gone);
// otherwise f says why not and whether a retry may follow.
func (s *Service) try(client, ctx context.Context, l *live, w http.ResponseWriter, r *http.Request, be *backend, lease *balance.Lease,
	hdr http.Header, sc *outScratch, body *replayBody, retryable bool, try int, start time.Time) (done bool, f failure) {
	more := try < l.cfg.Retries
	tryStart := time.Now()
	defer s.tryEnded(be) // last: after the answer's body is closed
	var tb *tryBody
	if body != nil {
		tb = body.next()
		defer body.endTry()
	}
	tctx := ctx
	var timer *time.Timer
	if l.cfg.TryTimeout > 0 {
		// A context of its own only when there is a try timeout: the
		// cancellation it registers with the request's context costs a lock
		// and an allocation per request.
		var cancel context.CancelCauseFunc
		tctx, cancel = context.WithCancelCause(ctx)
		defer cancel(nil)
		timer = time.AfterFunc(l.cfg.TryTimeout, func() {
			cancel(errTryTimeout)
			if tb != nil {
				// A read of the body the transport is blocked in is
				// broken off: RoundTrip waits for it. (The request's
				// timeout has its own hook, in serveRequest.)
				body.breakRead(w, tb.gen)
			}
		})
	}
	var out *http.Request
	var u *url.URL
	if sc != nil {
		out, u = &sc.req, &sc.url
	} else {
		out, u = new(http.Request), new(url.URL)
	}
	// Both are zero here (new, or emptied by put; a retry sets the same fields
	// again), and are set field by field: composite literals would each be built
	// in a temporary on this frame first, and the deeper stack costs every idle
	// HTTP/1.1 connection, whose goroutine keeps the stack it grew.
	u.Scheme, u.Host, u.Path, u.RawPath, u.RawQuery, u.ForceQuery = "http", be.id, r.URL.Path, r.URL.RawPath, r.URL.RawQuery, r.URL.ForceQuery
	u.Opaque = rawTargetPath(r.RequestURI)
	out.Method, out.URL, out.Proto, out.ProtoMajor, out.ProtoMinor = r.Method, u, "HTTP/1.1", 1, 1
	out.Header, out.Host, out.ContentLength, out.Trailer = hdr, r.Host, r.ContentLength, r.Trailer
	if tb != nil {
		out.Body = tb
	}
	var resp *http.Response
	var err error
	if sc != nil { // set exactly for the requests weir's own exchange carries
		resp, err = be.h1s.roundTrip(tctx, out, sc.body, &sc.answer)
	} else {
		resp, err = be.transport(l.cfg.Upstream, r).RoundTrip(out.WithContext(tctx))
	}
	if timer != nil {
		timer.Stop()
	}
	if try > 0 && !errors.Is(err, errRetired) {
		// Counted once sent, whatever comes of it; a try moved on
		// (errRetired) was not be's.
		be.stats.retries.Add(1)
	}
	switch {
	case err != nil:
	case resp.StatusCode < 100:
		resp.Body.Close()
		resp, err = nil, errStatusUnder100(resp.StatusCode)
	case resp.StatusCode == http.StatusSwitchingProtocols:
		// Upgrades go through tunnelTry: this request asked for none, and its
		// client would take the bytes after the 101 for another protocol's.
		// Closing the body closes the connection, which has switched.
		resp.Body.Close()
		resp, err = nil, errUnaskedSwitch
	}
	headerLatency := time.Since(tryStart)
	if err != nil {
		if client.Err() != nil {
			// The client gave up; the backend is not to blame.
			lease.Release(balance.Result{})
			abandoned()
		}
		if errors.Is(err, errRetired) {
			return false, retiredSincePick(lease)
		}
		if berr := body.failed(); berr != nil {
			// The client's body broke off or was malformed, and the
			// transport gave up for it: nor is the backend to blame, and
			// no other backend can have the rest.
			lease.Release(balance.Result{})
			be.stats.count(0)
			return false, failure{status: http.StatusBadRequest, err: fmt.Errorf("request body: %w", berr), client: true}
		}
		o, status := Reset, http.StatusBadGateway
		// The try's timeout, or the overall one (the client's own end was
		// seen above).
		deadline := errors.Is(context.Cause(tctx), errTryTimeout) || ctx.Err() != nil
		var de *dialError
		switch {
		case errors.As(err, &de):
			o, deadline = ConnectFailure, false
		case deadline, isTimeout(err):
			o, status = Timeout, http.StatusGatewayTimeout
		}
		lease.Release(balance.Result{Failed: true, Latency: headerLatency})
		l.observeTry(be, o)
		be.stats.count(0)
		overall := ctx.Err() != nil
		return false, failure{retry: !overall && (retryable || o == ConnectFailure), dial: o == ConnectFailure, status: status, err: err,
			deadline: deadline}
	}
	// The answer's outcome is told once its body has come whole: a body
	// that breaks off makes the try a Reset, and one try must not be told as
	// a Success and a Reset, since the Success would end the run of failures
	// the checker counts towards an ejection.
	answerOutcome := Success
	if resp.StatusCode >= 500 {
		answerOutcome = ServerError
	}
	if more && retryable && retryStatus(resp.StatusCode) && body.replayable(false) {
		// Worth another backend: leave this answer unread.
		resp.Body.Close()
		l.observeTry(be, answerOutcome)
		lease.Release(balance.Result{Latency: headerLatency})
		be.stats.count(resp.StatusCode)
		return false, failure{retry: true, status: resp.StatusCode, resp: resp.Status, err: fmt.Errorf("backend answered %s", resp.Status)}
	}
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	var first []byte
	var firstErr error
	if more && retryable && resp.ContentLength > 0 {
		// A body of known length (not a stream): read its first bytes before
		// answering, so a backend that dies between its headers and its body is
		// still retried elsewhere.
		var k int
		k, firstErr = resp.Body.Read(*bp)
		first = (*bp)[:k]
		if firstErr != nil && firstErr != io.EOF && body.replayable(false) {
			resp.Body.Close()
			lease.Release(balance.Result{Failed: true, Latency: headerLatency})
			l.observeTry(be, Reset)
			be.stats.count(0)
			return false, failure{retry: true, status: http.StatusBadGateway, err: firstErr}
		}
	}
	paused := pausedUpload(w, r, body)
	n, copyErr := s.respond(ctx, w, resp, first, firstErr, *bp)
	if paused {
		s.closeUpload(w, r)
	}
	lastByte := time.Since(tryStart)
	latency := headerLatency
	if l.cfg.LastByte {
		latency = lastByte
	}
	s.answered(l, r, be, lease, resp.StatusCode, n, latency, headerLatency, start, copyErr)
	if copyErr != nil && client.Err() == nil {
		// The backend broke off mid-body. The status line is gone; the client must
		// see the answer is incomplete: a stream reset (HTTP/2) or a closed
		// connection (HTTP/1.1).
		l.observeTry(be, Reset)
		panic(http.ErrAbortHandler)
	}
	l.observeTry(be, answerOutcome)
	return true, failure{}
}

// pausedUpload readies the answer to an HTTP/1.1 request whose body has not
// all been read (its client may have paused its upload) for net/http's
// server, and reports whether it did: that server frames an answer after
// taking the request body's lock, which a transport's read of a client that
// paused its upload holds, for ever, and reads what is left of the body (up
// to 256 KiB) first; an answer that closes the connection is framed without
// either. closeUpload is then due once the answer is written. (The connection
// loop bounds that read instead, in h1ReqBody.finish.)
func pausedUpload(w http.ResponseWriter, r *http.Request, body *replayBody) bool {
	if _, own := w.(*h1Writer); own || r.ProtoMajor != 1 || body.ended() {
		return false
	}
	w.Header().Set("Connection", "close")
	return true
}

// closeUpload closes a body pausedUpload found unread. Once the handler
// returns, the server clears the read deadline and reads what is left of the
// body (up to 256 KiB) to close it: with no deadline, for as long as the
// client holds the connection. Closed here, under a deadline, that read is
// done.
func (s *Service) closeUpload(w http.ResponseWriter, r *http.Request) {
	if d, ok := w.(interface{ SetReadDeadline(time.Time) error }); ok {
		d.SetReadDeadline(time.Now().Add(s.cfg.ReadHeaderTimeout))
	}
	r.Body.Close()
}

// answered is the bookkeeping of a try whose answer has gone to the client:
// the lease released with the latency sample, the counters, the Observer and
// the access log line.
func (s *Service) answered(l *live, r *http.Request, be *backend, lease *balance.Lease, status int, n int64, latency, headers time.Duration,
	start time.Time, copyErr error) {
	lease.Release(balance.Result{Latency: latency})
	be.stats.count(status)
	s.stats.requests.Add(1)
	if l.cfg.Observer != nil {
		l.cfg.Observer.Request(be.addr, status, time.Since(start))
	}
	if l.cfg.AccessLog {
		s.logAnswered(r, be, status, n, headers, start, copyErr)
	}
}

// logAnswered writes a forwarded request's access log line. A function of its
// own, so the line's arguments take no room in try's frame: every HTTP/1.1
// connection's goroutine keeps the stack its deepest request grew.
func (s *Service) logAnswered(r *http.Request, be *backend, status int, n int64, headers time.Duration, start time.Time, err error) {
	s.log.Info("request", "method", r.Method, "path", r.URL.Path, "proto", r.Proto, "client", r.RemoteAddr,
		"backend", be.id, "status", status, "bytes", n, "headers", headers, "duration", time.Since(start), "err", err)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func retryStatus(code int) bool {
	return code == http.StatusBadGateway || code == http.StatusServiceUnavailable || code == http.StatusGatewayTimeout
}

func (l *live) observeTry(be *backend, o Outcome) {
	if l.cfg.Observer != nil {
		l.cfg.Observer.Try(be.addr, o)
	}
}

// ownPath reports whether a request goes to its backend through weir's own
// HTTP/1.1 exchange (h1Pool.roundTrip) rather than through an http.Transport,
// should its body allow (ownScratch): HTTP/1.1 upstream and no upgrade.
func ownPath(u Upstream, r *http.Request) bool {
	return (u == UpstreamHTTP1 || u == UpstreamAuto && r.ProtoMajor != 2) && r.Header["Upgrade"] == nil
}

// hasBody reports whether r has a body to send (of a length given or not).
func hasBody(r *http.Request) bool {
	return r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0
}

// ownScratch returns the scratch of a request weir's own exchange carries, nil
// for one an http.Transport does. Besides ownPath, the request has no body, or
// a body of known length that an HTTP/1.1 client sent whole with its head
// (h1ReqBody.inHand), read here into the scratch, so every try can send it.
// Any other body streams through http.Transport, which sends it while it reads
// the answer, keeps what a retry needs (replayBody), and handles 100 Continue
// (a request with Expect stays there). An error is the body's, read in part.
func ownScratch(u Upstream, r *http.Request) (*outScratch, error) {
	if !ownPath(u, r) {
		return nil, nil
	}
	if !hasBody(r) {
		return outScratchPool.Get().(*outScratch), nil
	}
	rb, ok := r.Body.(*h1ReqBody)
	if !ok || r.Header["Expect"] != nil || len(r.TransferEncoding) > 0 {
		return nil, nil
	}
	sc := outScratchPool.Get().(*outScratch)
	sc.bodyBuf = h1ReadPool.Get().(*[]byte)
	b, err := rb.inHand(r.ContentLength, *sc.bodyBuf)
	if b == nil {
		if err == nil {
			sc.put()
			return nil, nil
		}
		return sc, err
	}
	sc.body = b
	return sc, nil
}

// outScratch is the memory one request needs on its way upstream when it goes
// through weir's own exchange, taken from a pool and given back when the
// request is done: that exchange writes the header before it returns and keeps
// nothing of the request after the answer's body is read or closed, which an
// http.Transport (a goroutine may still write the request) does not promise.
type outScratch struct {
	hdr http.Header
	req http.Request
	url url.URL
	xff [1]string // X-Forwarded-For's value
	// body is the request's body, in bodyBuf (from h1ReadPool, held only
	// while a request needs it); nil without one.
	body    []byte
	bodyBuf *[]byte
	// answer is the answer's body as weir's exchange hands it over; a retry's
	// answer reuses it, the one before it being closed by then.
	answer h1Body
}

var outScratchPool = sync.Pool{New: func() any { return &outScratch{hdr: make(http.Header, 8)} }}

// put gives sc back, emptied; a header grown large for one request is dropped
// rather than kept for every later one.
func (sc *outScratch) put() {
	if len(sc.hdr) > 32 {
		sc.hdr = make(http.Header, 8)
	} else {
		clear(sc.hdr)
	}
	sc.req, sc.url, sc.xff[0], sc.body, sc.answer = http.Request{}, url.URL{}, "", nil, h1Body{}
	if sc.bodyBuf != nil {
		h1ReadPool.Put(sc.bodyBuf)
		sc.bodyBuf = nil
	}
	outScratchPool.Put(sc)
}

// transport is the pool for the request's upstream protocol.
func (b *backend) transport(u Upstream, r *http.Request) *http.Transport {
	switch {
	case u == UpstreamH2C, u == UpstreamAuto && r.ProtoMajor == 2:
		return b.h2[int(b.next.Add(1))%len(b.h2)]
	}
	return b.h1
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// respond writes the backend's answer to the client: headers, the body as it
// comes (flushed at once when its length is unknown, as gRPC's and event
// streams' are), then trailers. ctx's deadline (http.timeout), if it has one,
// bounds the writes to the client too.
func (s *Service) respond(ctx context.Context, w http.ResponseWriter, resp *http.Response, first []byte, firstErr error, buf []byte) (int64, error) {
	defer resp.Body.Close()
	if deadline, ok := ctx.Deadline(); ok {
		// A client that does not read its answer would otherwise hold the
		// request, and the backend's connection, past the timeout for as
		// long as it likes: its writes break off at the deadline as the
		// reads from the backend do. The connection loop's writer keeps the
		// deadline until the answer's last flush, then lifts it.
		rc := http.NewResponseController(w)
		rc.SetWriteDeadline(deadline)
		if _, own := w.(*h1Writer); !own {
			defer rc.SetWriteDeadline(time.Time{})
		}
	}
	var h http.Header
	if hw, ok := w.(*h1Writer); ok && len(hw.header) == 0 {
		// The answer's header is the plane's own: the connection loop writes
		// it as it is, less its hop-by-hop fields, rather than a copy of it.
		h = resp.Header
		removeConnectionHeaders(h, h)
		for k := range h {
			if hopByHop(k) {
				delete(h, k)
			}
		}
		hw.header = h
	} else {
		h = w.Header()
		for k, vv := range resp.Header {
			if !hopByHop(k) {
				h[k] = vv
			}
		}
		removeConnectionHeaders(h, resp.Header)
	}
	if len(resp.Trailer) > 0 {
		// The trailers the backend declared are declared to the client: the
		// writer then frames the answer so they can follow it (chunked), also
		// when no body byte comes, where it would count a Content-Length.
		names := make([]string, 0, len(resp.Trailer))
		for k := range resp.Trailer {
			names = append(names, k)
		}
		h["Trailer"] = []string{strings.Join(names, ", ")}
	}
	w.WriteHeader(resp.StatusCode)
	var n int64
	var err error
	if len(first) > 0 {
		k, werr := w.Write(first)
		n = int64(k)
		if werr != nil {
			return n, nil // the client went away
		}
	}
	switch {
	case firstErr == io.EOF:
	case firstErr != nil:
		err = firstErr
	default:
		var m int64
		m, err = copyBody(w, resp.Body, buf, resp.ContentLength < 0)
		n += m
	}
	for k, vv := range resp.Trailer {
		h[http.TrailerPrefix+k] = vv
	}
	return n, err
}

// copyBody copies the backend's body to the client; flush sends each piece at
// once instead of when the buffer fills.
func copyBody(w http.ResponseWriter, src io.Reader, buf []byte, flush bool) (int64, error) {
	var n int64
	rc := http.NewResponseController(w)
	for {
		nr, rerr := src.Read(buf)
		if nr > 0 {
			nw, werr := w.Write(buf[:nr])
			n += int64(nw)
			if werr != nil {
				return n, nil // the client went away; nothing to blame the backend for
			}
			if flush {
				if err := rc.Flush(); err != nil {
					return n, nil
				}
			}
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

func (s *Service) answerFailure(l *live, w http.ResponseWriter, r *http.Request, f failure, tries int, start time.Time) {
	msg := fmt.Sprintf("service %q: %d tries failed, the last: %v", s.cfg.Name, tries, f.err)
	if f.client {
		msg = fmt.Sprintf("service %q: %v", s.cfg.Name, f.err)
	}
	if f.status == 0 {
		f.status = http.StatusBadGateway
	}
	s.stats.requests.Add(1)
	if l.cfg.AccessLog {
		s.log.Info("request", "method", r.Method, "path", r.URL.Path, "proto", r.Proto, "client", r.RemoteAddr,
			"status", f.status, "tries", tries, "duration", time.Since(start), "err", f.err)
	}
	plainError(w, r, f.status, f.grpcStatus(), msg)
}

// noBackend answers 503 with the reason; gRPC clients read it from grpc-status
// 14 (UNAVAILABLE) and grpc-message as well.
func (s *Service) noBackend(w http.ResponseWriter, r *http.Request, why string) {
	s.stats.noBackend.Add(1)
	s.stats.requests.Add(1)
	plainError(w, r, http.StatusServiceUnavailable, grpcUnavailable, fmt.Sprintf("service %q: no usable backend: %s", s.cfg.Name, why))
}

// plainError answers status with msg; a gRPC call gets grpcStatus and msg as
// its grpc-status and grpc-message too.
func plainError(w http.ResponseWriter, r *http.Request, status int, grpcStatus, msg string) {
	h := w.Header()
	if isGRPC(r) {
		// As a gRPC server answers a call it fails at once (trailers only:
		// the status in the answer's head, and no body). A client reads
		// grpc-status only beside gRPC's content type: with another (grpc-go,
		// grpc-java) it takes a status from the HTTP status, UNAVAILABLE for
		// 502, 503 and 504, and the body for a message's bytes.
		h.Set("Content-Type", "application/grpc")
		h.Set("Grpc-Status", grpcStatus)
		h.Set("Grpc-Message", url.PathEscape(msg))
		w.WriteHeader(status)
		return
	}
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	io.WriteString(w, msg+"\n")
}

func isGRPC(r *http.Request) bool {
	return r.ProtoMajor == 2 && strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc")
}

func idempotent(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete:
		return true
	}
	return false
}

// grpcRetryable reports whether the request is a gRPC call the config marks safe
// to retry.
func (l *live) grpcRetryable(r *http.Request) bool {
	return l.grpcRetryableName(isGRPC(r), r.URL.Path)
}

// grpcRetryableName is grpcRetryable for a request known by its path.
func (l *live) grpcRetryableName(grpc bool, path string) bool {
	if len(l.cfg.RetryGRPC) == 0 || !grpc {
		return false
	}
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	for _, m := range l.cfg.RetryGRPC {
		if m == "*" || m == path || strings.HasSuffix(m, "/*") && strings.HasPrefix(path, m[:len(m)-1]) {
			return true
		}
	}
	return false
}

// hopByHop lists the headers that belong to one connection (RFC 9110 7.6.1),
// which a proxy does not forward.
func hopByHop(k string) bool {
	switch k {
	case "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
		"Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return false
}

// removeConnectionHeaders drops from h the headers that from's Connection
// header names as the connection's own.
func removeConnectionHeaders(h, from http.Header) {
	for _, v := range from["Connection"] {
		for f := range strings.SplitSeq(v, ",") {
			if f = strings.TrimSpace(f); f != "" {
				h.Del(f)
			}
		}
	}
}

// outHeader is the request's header as the backend gets it: hop-by-hop headers
// dropped (TE: trailers kept, gRPC needs it), forwarding headers added.
func (l *live) outHeader(r *http.Request, sc *outScratch) http.Header {
	var h http.Header
	if sc != nil {
		h = sc.hdr
	} else {
		h = make(http.Header, len(r.Header)+3)
	}
	for k, vv := range r.Header {
		if !hopByHop(k) {
			h[k] = vv
		}
	}
	removeConnectionHeaders(h, r.Header)
	for _, v := range r.Header["Te"] {
		if strings.Contains(strings.ToLower(v), "trailers") {
			h["Te"] = []string{"trailers"}
			break
		}
	}
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = []string{""} // not Go's default
	}
	proto := "http"
	if r.TLS != nil {
		proto = "https"
	}
	client, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		client = r.RemoteAddr
	}
	if l.cfg.XForwardedFor {
		v := forwardedFor(h["X-Forwarded-For"], client)
		if sc != nil {
			sc.xff[0] = v
			h["X-Forwarded-For"] = sc.xff[:]
		} else {
			h["X-Forwarded-For"] = []string{v}
		}
	}
	if l.cfg.XForwardedProto {
		h["X-Forwarded-Proto"] = protoValue[proto]
	}
	if l.cfg.Forwarded {
		h["Forwarded"] = append(h["Forwarded"], forwardedElement(client, proto, r.Host))
	}
	return h
}

// protoValue are X-Forwarded-Proto's values, shared by every request's header
// (nothing writes to a header's value slices once set).
var protoValue = map[string][]string{"http": {"http"}, "https": {"https"}}

// forwardedFor is X-Forwarded-For with client appended to what came (prior).
func forwardedFor(prior []string, client string) string {
	if len(prior) == 0 {
		return client
	}
	return strings.Join(prior, ", ") + ", " + client
}

// forwardedElement is this hop's RFC 7239 Forwarded element.
func forwardedElement(client, proto, host string) string {
	node := client
	if a, err := netip.ParseAddr(client); err == nil && a.Is6() {
		node = `"[` + client + `]"`
	}
	el := "for=" + node + ";proto=" + proto
	if host != "" {
		el += `;host="` + strings.ReplaceAll(host, `"`, "") + `"`
	}
	return el
}

// hashes reports whether algorithm picks by the request's hash key: maglev,
// source_hash, and maglev_p2c, whose two candidates are the key's entries in
// two tables (with no key every request would have the same two).
func hashes(algorithm string) bool {
	return algorithm == balance.Maglev || algorithm == balance.SourceHash || algorithm == balance.MaglevP2C
}

// hashKey is the request's key for the algorithms that hash: FNV-1a of the
// client's address, a header's or a cookie's value, so every balancer node
// computes the same key for a request.
func (l *live) hashKey(r *http.Request) uint64 {
	h := &l.hash
	if !h.on {
		return 0
	}
	var v string
	switch {
	case h.host:
		// Go's server moves Host (and HTTP/2's :authority) out of the
		// header into r.Host.
		v = r.Host
	case h.kind == HashHeader:
		if vv := r.Header[h.field]; len(vv) > 0 {
			v = vv[0]
		}
	case h.kind == HashCookie:
		if c, err := r.Cookie(h.cookie); err == nil {
			v = c.Value
		}
	}
	if v == "" {
		// No such header or cookie: the client's address keeps the client on one
		// backend all the same.
		v, _, _ = net.SplitHostPort(r.RemoteAddr)
	}
	return fnv1a(v)
}

// fnv1a is the 64-bit FNV-1a hash of v.
func fnv1a(v string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(v); i++ {
		h ^= uint64(v[i])
		h *= 1099511628211
	}
	return h
}
