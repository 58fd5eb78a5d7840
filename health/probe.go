package health

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"time"
)

// probe is one check, with everything it needs copied out of the Checker so it
// runs without the lock.
type probe struct {
	checkRun
	cfg    Check
	dial   func(ctx context.Context, network, address string) (net.Conn, error)
	dialer *net.Dialer
	// keep is the backend's kept-alive HTTP connection: given to the check
	// when it starts, handed back (or replaced, or nil) when it ends.
	keep *keptConn
}

// checkRun is what the result of a check needs to know of it: for the
// Result, and to tell a stale one (gen) and schedule the next (scheduled).
type checkRun struct {
	service   string
	addr      string
	gen       uint64
	scheduled time.Time
	method    Method
}

// keptConn is an HTTP check connection kept open between checks.
type keptConn struct {
	conn   net.Conn
	source netip.Addr // the Check.Source it was dialled from
	lim    headerLimit
	r      *bufio.Reader // reads through lim
}

func newKeptConn(conn net.Conn, source netip.Addr) *keptConn {
	k := &keptConn{conn: conn, source: source, lim: headerLimit{conn: conn, n: math.MaxInt64}}
	k.r = bufio.NewReaderSize(&k.lim, 4096)
	return k
}

// headerLimit is the connection as a check reads it: while a response's head
// is read, n bounds the bytes still to come, so a backend that sends a header
// without end fails its check at DefaultMaxHeader instead of having Go's
// header reader keep every byte until the timeout (2 GB in 5 s here).
type headerLimit struct {
	conn net.Conn
	n    int64
}

var errHeaderTooLarge = fmt.Errorf("response header over %d KiB", DefaultMaxHeader>>10)

func (l *headerLimit) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, errHeaderTooLarge
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.conn.Read(p)
	l.n -= int64(n)
	return n, err
}

func newDialer(cfg Check) *net.Dialer {
	d := &net.Dialer{
		// TCP check connections live for one exchange and kept-alive HTTP
		// ones see a request every interval: keepalive probes would only
		// cost setsockopt calls.
		KeepAlive: -1,
	}
	if cfg.Source.IsValid() {
		d.LocalAddr = &net.TCPAddr{IP: cfg.Source.AsSlice()}
	}
	return d
}

// run performs the check; nil means passed. ctx carries the check's timeout.
func (p *probe) run(ctx context.Context) error {
	if p.cfg.Kind == HTTP {
		return p.runHTTP(ctx)
	}
	conn, err := p.dial(ctx, "tcp", p.addr)
	if err != nil {
		return p.fail(ctx, "connect", err)
	}
	// Close right away: a FIN, so the backend sees an orderly close and
	// keeps no half-open socket.
	conn.Close()
	return nil
}

// runHTTP sends the check's request on the kept-alive connection, or on a new
// one if there is none or the kept one fails before an answer (the server
// may have closed it while idle), and leaves in p.keep the connection to
// reuse next time, if any.
func (p *probe) runHTTP(ctx context.Context) error {
	if k := p.keep; k != nil {
		p.keep = nil
		reuse, err := p.http(ctx, k)
		if reuse {
			p.keep = k
		} else {
			k.conn.Close()
		}
		var te *timeoutError
		var se *statusError
		switch {
		case errors.As(err, &se) && se.code == http.StatusRequestTimeout && ctx.Err() == nil:
			// Some servers close an idle connection with a 408 of their own
			// (Google's front ends do), which the request then reads: the
			// connection was closed while idle, as Go's transport takes it.
			if p.keep == k {
				p.keep = nil
				k.conn.Close()
			}
		case err == nil || errors.Is(err, ErrStatus) || errors.Is(err, ErrBody) || errors.Is(err, errHeaderTooLarge) ||
			errors.As(err, &te) || ctx.Err() != nil:
			return err // an answer, or no time left for a second try
		}
	}
	conn, err := p.dial(ctx, "tcp", p.addr)
	if err != nil {
		return p.fail(ctx, "connect", err)
	}
	k := newKeptConn(conn, p.cfg.Source)
	reuse, err := p.http(ctx, k)
	if reuse {
		p.keep = k
	} else {
		conn.Close()
	}
	return err
}

// fail turns an error into a short reason that still unwraps to its cause:
// "connect: connection refused", "connect: timeout after 1s",
// "http: read: connection reset by peer".
func (p probe) fail(ctx context.Context, op string, err error) error {
	var ne net.Error
	if errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout()) {
		return &timeoutError{op: op, after: p.cfg.Timeout}
	}
	var oe *net.OpError
	if errors.As(err, &oe) {
		var se *os.SyscallError
		if errors.As(oe.Err, &se) {
			if se.Syscall == op {
				return se // "connect: connection refused"
			}
			return fmt.Errorf("%s: %w", op, se)
		}
		return fmt.Errorf("%s: %w", op, oe.Err)
	}
	return fmt.Errorf("%s: %w", op, err)
}

// http sends one GET on k and judges the response. reuse reports whether the
// response was read to its end on a connection the server keeps open, so the
// next check can send its request on it.
func (p *probe) http(ctx context.Context, k *keptConn) (reuse bool, err error) {
	conn := k.conn
	// ctx ends at the check's timeout, or sooner when Remove or the end of
	// Run cancel it: unblock the write or read then. (No deadline is set
	// otherwise, which spares a timer per check on a kept-alive connection.)
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer func() {
		if !stop() {
			reuse = false // the deadline is in the past now
		}
	}()

	host := p.cfg.HTTP.Host
	if host == "" {
		host, _, _ = net.SplitHostPort(p.addr)
		if strings.Contains(host, ":") {
			host = "[" + host + "]"
		}
	}
	req := "GET " + p.cfg.HTTP.Path + " HTTP/1.1\r\nHost: " + host +
		"\r\nUser-Agent: weir-health\r\nAccept: */*\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		return false, p.fail(ctx, "http", err)
	}
	var resp *http.Response
	for interim := 0; ; interim++ {
		k.lim.n = DefaultMaxHeader
		resp, err = http.ReadResponse(k.r, nil)
		k.lim.n = math.MaxInt64 // the body has a bound of its own
		if err != nil {
			return false, p.fail(ctx, "http", err)
		}
		// Interim answers (103 Early Hints, 100 Continue) come before the
		// answer (RFC 9110 15.2); as many as net/http's client reads.
		if resp.StatusCode >= 200 || resp.StatusCode < 100 {
			break
		}
		if resp.StatusCode == http.StatusSwitchingProtocols || interim == maxInterim {
			// No answer of HTTP's follows a 101, and past the interim
			// answers allowed the rest is not read: the connection is not
			// kept, or the next check would read this one's answer.
			return false, &statusError{code: resp.StatusCode}
		}
	}
	// Read the body to its end (the marker is searched in the first
	// DefaultMaxBody bytes); one longer than that is not worth reading to
	// keep the connection, which the caller then closes. The body is not
	// closed: read to its end there is nothing left to do, and closing one
	// read in part would read the rest of it, to the timeout if it never ends.
	body, err := io.ReadAll(io.LimitReader(resp.Body, DefaultMaxBody+1))
	if err != nil {
		return false, p.fail(ctx, "http body", err)
	}
	reuse = !resp.Close && len(body) <= DefaultMaxBody && k.r.Buffered() == 0
	ok := false
	for _, r := range p.cfg.HTTP.Status {
		ok = ok || r.contains(resp.StatusCode)
	}
	if !ok {
		return reuse, &statusError{code: resp.StatusCode}
	}
	if p.cfg.HTTP.Body == "" {
		return reuse, nil
	}
	body = body[:min(len(body), DefaultMaxBody)]
	if !bytes.Contains(body, []byte(p.cfg.HTTP.Body)) {
		return reuse, &bodyError{want: p.cfg.HTTP.Body, read: len(body)}
	}
	return reuse, nil
}

// maxInterim bounds the interim (1xx) answers read before the answer.
const maxInterim = 5

type timeoutError struct {
	op    string
	after time.Duration
}

func (e *timeoutError) Error() string        { return e.op + ": timeout after " + e.after.String() }
func (e *timeoutError) Is(target error) bool { return target == ErrTimeout }
func (e *timeoutError) Timeout() bool        { return true }

type statusError struct{ code int }

func (e *statusError) Error() string        { return fmt.Sprintf("http status %d", e.code) }
func (e *statusError) Is(target error) bool { return target == ErrStatus }

type bodyError struct {
	want string
	read int
}

func (e *bodyError) Error() string {
	return fmt.Sprintf("http body: no %q in the first %d bytes", e.want, e.read)
}
func (e *bodyError) Is(target error) bool { return target == ErrBody }
