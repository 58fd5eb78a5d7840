package httplb

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestAcceptOutOfFilesRecovers: a service whose accept finds no file
// descriptor left (EMFILE) serves again once some are free, as net/http's
// server does. Before, the connection splitter took the error for a failed
// listener: the service stopped for good, by the default engines; and
// net/http's server, serving alone (HTTP/1.1 by net/http to HTTP/1.1
// backends), waited it out but logged it only at debug level.
func TestAcceptOutOfFilesRecovers(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"default", Config{}},
		{"net_http_only", Config{NetHTTP1: true, Upstream: UpstreamHTTP1}},
	} {
		t.Run(tc.name, func(t *testing.T) { acceptOutOfFiles(t, tc.cfg) })
	}
}

// acceptOutOfFiles checks that a service with cfg logs its accept's EMFILE
// and serves again once descriptors are free.
func acceptOutOfFiles(t *testing.T, cfg Config) {
	good, _ := h1TestBackend(t)
	backedOff := make(chan struct{}, 1)
	cfg.Logger = slog.New(&msgSignal{Handler: slog.DiscardHandler, msg: "accept", c: backedOff})
	sv := serveStoppable(t, cfg, []Backend{{Addr: good, Weight: 1, Usable: true}})
	c := h1Client()
	t.Cleanup(c.CloseIdleConnections)
	url := "http://" + sv.Addr().String() + "/"
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	restore := lim
	t.Cleanup(func() { syscall.Setrlimit(syscall.RLIMIT_NOFILE, &restore) })
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	// Room for a few more files only: the process's own fill it, and a
	// client's connection is queued with no descriptor for its accept.
	lim.Cur = uint64(len(fds)) + 8
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	var fill []*os.File
	t.Cleanup(func() {
		for _, f := range fill {
			f.Close()
		}
	})
	// Every free descriptor is taken, then the last one goes to a client
	// connection, which the service cannot accept. (Should another file
	// take it first, the dial finds none: one more is freed.) Another
	// goroutine of the process (a connection of an earlier test closing)
	// may free one and let the accept through: then all is taken again
	// and another client dials, until the service meets EMFILE.
	deadline := time.Now().Add(20 * time.Second)
	for backed := false; !backed; {
		for {
			f, err := os.Open("/dev/null")
			if err != nil {
				break
			}
			fill = append(fill, f)
		}
		for len(fill) > 0 {
			fill[len(fill)-1].Close()
			fill = fill[:len(fill)-1]
			conn, err := net.Dial("tcp", sv.Addr().String())
			if errors.Is(err, syscall.EMFILE) {
				continue
			}
			if err != nil {
				// Reset: the service closed its listener at the accept's
				// EMFILE (checked below).
				t.Logf("dial: %v", err)
				break
			}
			t.Cleanup(func() { conn.Close() })
			break
		}
		// The service meets EMFILE at its accept while the descriptors
		// are taken; it must not end for it.
		select {
		case <-backedOff:
			backed = true
		case <-sv.done:
			backed = true
		case <-time.After(100 * time.Millisecond):
			if time.Now().After(deadline) {
				t.Fatal("no `accept` warning for EMFILE at the service's accept, nor did Serve return")
			}
		}
	}
	for _, f := range fill {
		f.Close()
	}
	fill = nil
	syscall.Setrlimit(syscall.RLIMIT_NOFILE, &restore)
	select {
	case <-sv.done:
		t.Fatalf("Serve returned after an accept found no descriptor: %v", sv.err)
	default:
	}
	waitfor.Value(t, 10*time.Second, "a 200 once descriptors are free", func() (any, bool) {
		resp, err := c.Get(url)
		if err != nil {
			return err, false
		}
		resp.Body.Close()
		return resp.StatusCode, resp.StatusCode == http.StatusOK
	})
}

// msgSignal sends on c (without blocking) when a record with message msg is
// handled.
type msgSignal struct {
	slog.Handler
	msg string
	c   chan struct{}
}

func (h *msgSignal) Enabled(context.Context, slog.Level) bool { return true }

func (h *msgSignal) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		select {
		case h.c <- struct{}{}:
		default:
		}
	}
	return nil
}

func (h *msgSignal) WithAttrs([]slog.Attr) slog.Handler { return h }

func (h *msgSignal) WithGroup(string) slog.Handler { return h }

// TestAcceptOutOfMemoryWaits: an accept that finds no memory for the socket
// (ENOBUFS, ENOMEM) is waited out as the proxy does, not taken for a failed
// listener. No test can make the kernel fail so, hence a listener that fails
// once with the error before it hands over a real connection.
func TestAcceptOutOfMemoryWaits(t *testing.T) {
	for _, errno := range []syscall.Errno{syscall.ENOBUFS, syscall.ENOMEM} {
		t.Run(errno.Error(), func(t *testing.T) {
			ln := queuedListener(t)
			s := &Service{cfg: Config{Name: "test"}, log: slog.New(slog.DiscardHandler)}
			pl := newPatientListener(&failOnce{Listener: ln, err: &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", errno)}}, s)
			t.Cleanup(func() { pl.Close() })
			c, err := pl.Accept()
			if err != nil {
				t.Fatalf("Accept after %v: got %v; want the connection", errno, err)
			}
			c.Close()
		})
	}
}

// queuedListener returns a loopback listener with a client's connection
// queued, both closed at the test's end.
func queuedListener(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return ln
}

// failOnce is a listener whose first Accept fails with err.
type failOnce struct {
	net.Listener
	err    error
	failed bool
}

func (l *failOnce) Accept() (net.Conn, error) {
	if !l.failed {
		l.failed = true
		return nil, l.err
	}
	return l.Listener.Accept()
}

// TestAcceptErrorsLoggedOnce: an episode of accept errors logs its first
// error and its end, not a line per wait (over a long EMFILE episode: a line
// a second, for ever), and counts each error in the service's snapshot. A listener that fails n times with EMFILE before it
// hands over a real connection stands in for a long episode.
func TestAcceptErrorsLoggedOnce(t *testing.T) {
	ln := queuedListener(t)
	var rec records
	s := &Service{cfg: Config{Name: "test"}, log: slog.New(&rec)}
	const n = 6
	fail := &failN{Listener: ln, n: n, err: &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}}
	pl := newPatientListener(fail, s)
	t.Cleanup(func() { pl.Close() })
	c, err := pl.Accept()
	if err != nil {
		t.Fatalf("Accept after %d EMFILE: got %v; want the connection", n, err)
	}
	c.Close()
	want := []string{"accept errors=1", fmt.Sprintf("accepting again errors=%d", n)}
	if got := rec.lines(); !slices.Equal(got, want) {
		t.Errorf("logged %q; want %q", got, want)
	}
	if got := s.stats.acceptErrors.Load(); got != n {
		t.Errorf("accept errors counted: got %d; want %d", got, n)
	}
}

// failN is a listener whose first n Accepts fail with err.
type failN struct {
	net.Listener
	n   int
	err error
}

func (l *failN) Accept() (net.Conn, error) {
	if l.n > 0 {
		l.n--
		return nil, l.err
	}
	return l.Listener.Accept()
}

// records keeps each record's message and its errors attribute.
type records struct {
	mu  sync.Mutex
	got []string
}

func (h *records) Enabled(context.Context, slog.Level) bool { return true }

func (h *records) Handle(_ context.Context, r slog.Record) error {
	line := r.Message
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "errors" {
			line += " errors=" + a.Value.String()
		}
		return true
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	h.got = append(h.got, line)
	return nil
}

func (h *records) WithAttrs([]slog.Attr) slog.Handler { return h }

func (h *records) WithGroup(string) slog.Handler { return h }

func (h *records) lines() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.got)
}
