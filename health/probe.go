package health

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

// probe is one check, with everything it needs copied out of the Checker so it
// runs without the lock.
type probe struct {
	service   string
	cfg       Check
	dial      func(ctx context.Context, network, address string) (net.Conn, error)
	dialer    *net.Dialer
	addr      string
	gen       uint64
	scheduled time.Time
}

func newDialer(cfg Check) *net.Dialer {
	d := &net.Dialer{
		// Check connections live for one exchange; keepalive probes would
		// only cost setsockopt calls.
		KeepAlive: -1,
	}
	if cfg.Source.IsValid() {
		d.LocalAddr = &net.TCPAddr{IP: cfg.Source.AsSlice()}
	}
	return d
}

// run performs the check; nil means passed. ctx carries the check's timeout.
func (p probe) run(ctx context.Context) error {
	conn, err := p.dial(ctx, "tcp", p.addr)
	if err != nil {
		return p.fail(ctx, "connect", err)
	}
	if p.cfg.Kind != HTTP {
		// Close right away: a FIN, so the backend sees an orderly close and
		// keeps no half-open socket.
		conn.Close()
		return nil
	}
	err = p.http(ctx, conn)
	conn.Close()
	return err
}

// fail turns an error into a short reason that still unwraps to its cause:
// "connect: connection refused", "connect: timeout after 1s".
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
			return se // "connect: connection refused"
		}
		return fmt.Errorf("%s: %w", op, oe.Err)
	}
	return fmt.Errorf("%s: %w", op, err)
}

// http sends one GET on conn and judges the response.
func (p probe) http(ctx context.Context, conn net.Conn) error {
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	// Remove and the end of Run cancel ctx; unblock the read then too.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	host := p.cfg.HTTP.Host
	if host == "" {
		host, _, _ = net.SplitHostPort(p.addr)
		if strings.Contains(host, ":") {
			host = "[" + host + "]"
		}
	}
	req := "GET " + p.cfg.HTTP.Path + " HTTP/1.1\r\nHost: " + host +
		"\r\nUser-Agent: weir-health\r\nAccept: */*\r\nConnection: close\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		return p.fail(ctx, "http", err)
	}
	resp, err := http.ReadResponse(bufio.NewReaderSize(conn, 4096), nil)
	if err != nil {
		return p.fail(ctx, "http", err)
	}
	defer resp.Body.Close()
	ok := false
	for _, r := range p.cfg.HTTP.Status {
		ok = ok || r.contains(resp.StatusCode)
	}
	if !ok {
		return &statusError{code: resp.StatusCode}
	}
	if p.cfg.HTTP.Body == "" {
		return nil
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, DefaultMaxBody))
	if err != nil {
		return p.fail(ctx, "http body", err)
	}
	if !bytes.Contains(body, []byte(p.cfg.HTTP.Body)) {
		return &bodyError{want: p.cfg.HTTP.Body, read: len(body)}
	}
	return nil
}

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
