package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// loopback0 is 127.0.0.1 port 0: a listener there gets a free port.
var loopback0 = netip.MustParseAddrPort("127.0.0.1:0")

// testBackend is a real TCP server on 127.0.0.1 that runs handle for each connection.
type testBackend struct {
	t      *testing.T
	name   string
	ln     net.Listener
	handle func(name string, c *net.TCPConn)
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

func startBackend(t *testing.T, name string, ap netip.AddrPort, handle func(name string, c *net.TCPConn)) *testBackend {
	t.Helper()
	addr := "127.0.0.1:0"
	if ap.IsValid() {
		addr = ap.String()
	}
	var ln net.Listener
	var err error
	// A restarted backend's port may linger briefly.
	if !waitfor.Cond(time.Second, func() bool { ln, err = net.Listen("tcp", addr); return err == nil }) {
		t.Fatalf("backend %s: %v", name, err)
	}
	return serveBackend(t, name, ln, handle)
}

// serveBackend is startBackend on a listener of the test's own.
func serveBackend(t *testing.T, name string, ln net.Listener, handle func(name string, c *net.TCPConn)) *testBackend {
	t.Helper()
	b := &testBackend{t: t, name: name, ln: ln, handle: handle, conns: map[net.Conn]struct{}{}}
	b.wg.Add(1)
	// Exits when the listener is closed by stop.
	go func() {
		defer b.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b.mu.Lock()
			b.conns[c] = struct{}{}
			b.mu.Unlock()
			b.wg.Add(1)
			// Exits when the handler returns (the peer closed or stop closed c).
			go func() {
				defer b.wg.Done()
				defer func() {
					b.mu.Lock()
					delete(b.conns, c)
					b.mu.Unlock()
					c.Close()
				}()
				b.handle(name, c.(*net.TCPConn))
			}()
		}
	}()
	t.Cleanup(b.stop)
	return b
}

func (b *testBackend) addr() netip.AddrPort { return b.ln.Addr().(*net.TCPAddr).AddrPort() }

// stop closes the listener and every connection (a backend dying) and waits.
func (b *testBackend) stop() {
	b.ln.Close()
	b.mu.Lock()
	for c := range b.conns {
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}
	b.mu.Unlock()
	b.wg.Wait()
}

// echo copies the client's bytes back, then half-closes.
func echo(_ string, c *net.TCPConn) {
	io.Copy(c, c)
	c.CloseWrite()
}

// hello says the backend's name (one line), then echoes.
func hello(name string, c *net.TCPConn) {
	c.Write([]byte(name + "\n"))
	echo(name, c)
}

// startProxy runs a Service until the test ends.
func startProxy(t *testing.T, cfg Config) *Service {
	t.Helper()
	return startProxyWith(t, cfg, Listen)
}

// startProxyWith is startProxy with the listeners bound by listen.
func startProxyWith(t *testing.T, cfg Config, listen func(context.Context, Config) (*Service, error)) *Service {
	t.Helper()
	if !cfg.Listen.IsValid() {
		cfg.Listen = loopback0
	}
	if cfg.Name == "" {
		cfg.Name = t.Name()
	}
	if cfg.ShutdownTimeout == 0 && cfg.DrainTimeout == 0 {
		cfg.ShutdownTimeout = DefaultDrainTimeout // bounded, so a test that leaks a connection fails rather than hangs
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(testWriter{t}, nil))
	}
	if cfg.Redirector == nil {
		cfg.Redirector = testRedirector
	}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := listen(ctx, cfg)
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	done := make(chan error, 1)
	// Exits when ctx is cancelled by the cleanup below and Serve has shut down.
	go func() { done <- s.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
		checkReleased(t, s)
	})
	return s
}

// serveStoppable runs the service listen gives until the returned stop, which
// waits for its Serve to end; the test's cleanup stops it too.
func serveStoppable(t *testing.T, cfg Config, listen func(context.Context, Config) (*Service, error)) (*Service, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s, err := listen(ctx, cfg)
	if err != nil {
		cancel()
		t.Fatalf("listen: %v", err)
	}
	done := make(chan error, 1)
	// Exits when stop cancels ctx and Serve has shut down.
	go func() { done <- s.Serve(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("serve: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return s, stop
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}

func dial(t *testing.T, s *Service) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatalf("dial proxy: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// readLine reads one '\n'-terminated line byte by byte (no buffering past it).
func readLine(c net.Conn) (string, error) {
	var b []byte
	one := make([]byte, 1)
	for {
		if _, err := c.Read(one); err != nil {
			return string(b), err
		}
		if one[0] == '\n' {
			return string(b), nil
		}
		b = append(b, one[0])
	}
}

// roundTrip writes msg and expects it echoed.
func roundTrip(c net.Conn, msg string) error {
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != msg {
		return errors.New("echo mismatch: got " + string(got) + "; want " + msg)
	}
	return nil
}

// countFDs is the number of open descriptors of this process.
func countFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("count fds: %v", err)
	}
	return len(ents)
}

// active is the number of client connections s is handling, for waitfor.Value.
func active(s *Service, want int64) func() (any, bool) {
	return func() (any, bool) {
		n := s.Snapshot().Active
		return fmt.Sprintf("%d active connections", n), n == want
	}
}

// settle waits for goroutines to get back to at most base (+slack).
func settle(t *testing.T, base, slack int) {
	t.Helper()
	if !waitfor.Cond(3*time.Second, func() bool { return runtime.NumGoroutine() <= base+slack }) {
		buf := make([]byte, 1<<16)
		n := runtime.Stack(buf, true)
		t.Fatalf("goroutines: got %d; want <= %d\n%s", runtime.NumGoroutine(), base+slack, buf[:n])
	}
}

// checkReleased checks that every connection gave its balancer lease and its backend
// slot back (exactly once: a double release would show as a negative count).
func checkReleased(t *testing.T, s *Service) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range s.backends {
		if n := s.bal.InFlight(b.addr); n != 0 {
			t.Errorf("backend %s: balancer in-flight after shutdown: got %d; want 0", b.addr, n)
		}
		if n := b.active.Load(); n != 0 {
			t.Errorf("backend %s: active after shutdown: got %d; want 0", b.addr, n)
		}
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }
