package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/balance"
)

// pathEnv set to "sockmap" runs this package's tests with every proxy forwarding in
// the kernel (TestEveryTestOnSockmap sets it for a child process).
const pathEnv = "WEIR_PROXY_TEST_PATH"

// testRedirector is what startProxy gives a service that names none: nil (the copy
// path), or the sockmap in the child of TestEveryTestOnSockmap.
var testRedirector Redirector

// runOnSockmap runs the tests with the sockmap loaded; it fails if none of them
// forwarded a connection in the kernel.
func runOnSockmap(m *testing.M) int {
	sm, err := loader.LoadSockMap()
	if err != nil {
		fmt.Fprintln(os.Stderr, "sockmap path:", err)
		return 1
	}
	defer sm.Close()
	testRedirector = sm
	code := m.Run()
	if code == 0 && redirected.Load() == 0 {
		fmt.Fprintln(os.Stderr, "sockmap path: no connection was forwarded in the kernel")
		return 1
	}
	return code
}

// TestEveryTestOnSockmap runs the behaviour tests of this package again — half-close,
// exactly-once release, retries, limits, PROXY protocol, draining, idle timeout,
// resets, 5,000 connections, shutdown — with the kernel forwarding every connection
// (loader.SockMap), in a child process; those in a network namespace of their own
// (inOwnNetns) too.
func TestEveryTestOnSockmap(t *testing.T) {
	if os.Getenv(pathEnv) != "" {
		t.Skip("already on the sockmap path") // the child runs the others
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// TestSelfConnectIsRefused connects no backend: nothing to forward.
	args := []string{"-test.count=1", "-test.skip=^(TestEveryTestOnSockmap|TestRedirectFallsBack|TestSelfConnectIsRefused)$"}
	if testing.Verbose() {
		args = append(args, "-test.v")
	}
	if testing.Short() {
		args = append(args, "-test.short")
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), pathEnv+"=sockmap")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	if testing.Verbose() || err != nil {
		t.Logf("child:\n%s", out.String())
	}
	if err != nil {
		t.Fatalf("tests on the sockmap path: %v", err)
	}
}

// failingRedirector pairs nothing: the sockmap of a host without one.
type failingRedirector struct{ err error }

func (f failingRedirector) Pair(int, int) ([2]uint64, error)   { return [2]uint64{}, f.err }
func (f failingRedirector) Forget([2]uint64) ([2]int64, error) { return [2]int64{}, nil }

// TestRedirectFallsBack checks that a connection the kernel can't take on is served by
// the copy path: with a sockmap that has been closed (its Pair fails as a kernel
// without sockmap support would) and with one that refuses every pair.
func TestRedirectFallsBack(t *testing.T) {
	closed, err := loader.LoadSockMap()
	if err != nil {
		t.Fatalf("load sockmap: %v", err)
	}
	closed.Close()
	for _, tc := range []struct {
		name string
		r    Redirector
	}{
		{"closed sockmap", closed},
		{"pair refused", failingRedirector{errors.New("sockmap: not supported")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := startBackend(t, "a", netip.AddrPort{}, hello)
			s := startProxy(t, Config{Backends: []Backend{{Addr: be.addr()}}, Redirector: tc.r})
			errs := redirectErrs.Load()
			c := dial(t, s)
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if line, err := readLine(c); err != nil || line != "a" {
				t.Fatalf("greeting: got %q, %v; want \"a\"", line, err)
			}
			if err := roundTrip(c, strings.Repeat("x", 300<<10)); err != nil {
				t.Fatalf("echo: %v", err)
			}
			c.CloseWrite()
			if rest, err := io.ReadAll(c); err != nil || len(rest) != 0 {
				t.Fatalf("after half-close: got %d bytes, %v; want EOF", len(rest), err)
			}
			if got := redirectErrs.Load() - errs; got != 1 {
				t.Errorf("failed pairings: got %d; want 1", got)
			}
			waitfor.Value(t, 3*time.Second, "0 active connections", active(s, 0))
		})
	}
}

// TestKernelPathUnansweredReportsNoSample: a backend that reads a client's bytes
// and never answers gives the balancer no latency sample, on the in-kernel path as
// on the copy path (TestSample). Its connect time would give ewma a fast estimate
// of a backend that hangs.
func TestKernelPathUnansweredReportsNoSample(t *testing.T) {
	sm, err := loader.LoadSockMap()
	if err != nil {
		t.Fatalf("load sockmap: %v", err)
	}
	t.Cleanup(func() { sm.Close() })
	var got atomic.Int64
	mute := func(_ string, c *net.TCPConn) { // reads, never answers
		buf := make([]byte, 512)
		for {
			n, err := c.Read(buf)
			got.Add(int64(n))
			if err != nil {
				return
			}
		}
	}
	be := startBackend(t, "mute", netip.AddrPort{}, mute)
	s := startProxy(t, Config{Algorithm: balance.EWMA, Backends: []Backend{{Addr: be.addr()}}, Redirector: sm})
	paired := redirected.Load()
	c := dial(t, s)
	// The request goes once the sockets are paired, so the kernel forwards it.
	waitfor.Value(t, 5*time.Second, "the connection paired", func() (any, bool) {
		n := redirected.Load() - paired
		return n, n > 0
	})
	const req = "request\n"
	if _, err := c.Write([]byte(req)); err != nil {
		t.Fatal(err)
	}
	waitfor.Value(t, 5*time.Second, "the request at the backend", func() (any, bool) {
		n := got.Load()
		return n, n == int64(len(req))
	})
	c.Close()
	waitfor.Value(t, 5*time.Second, "0 active connections", active(s, 0))
	if est, seen := s.bal.Estimate(be.addr().String()); seen {
		t.Errorf("latency estimate of a backend that never answered: got %v; want none", est)
	}
}

// pairLog is a Redirector that notes the cookies of every pair it makes.
type pairLog struct {
	*loader.SockMap
	mu    sync.Mutex
	pairs [][2]uint64
}

func (p *pairLog) Pair(client, server int) ([2]uint64, error) {
	cookies, err := p.SockMap.Pair(client, server)
	if err == nil {
		p.mu.Lock()
		p.pairs = append(p.pairs, cookies)
		p.mu.Unlock()
	}
	return cookies, err
}

// TestKernelPathForgetsEverySocket: once its connections are closed, the sockmap
// keeps nothing of their sockets, not even of those closed while bytes still
// reached them both ways (a drain's deadline ends connections mid-stream). A
// socket's state dropped before its close was made anew by the bytes that came in
// between, and nothing deleted it: such leaks fill the map, which then evicts the
// state of live connections (their first bytes' times, and the mark that keeps
// their later bytes from overtaking those the proxy holds). Bytes land in that gap
// now and then, so the test ends connections in several rounds.
func TestKernelPathForgetsEverySocket(t *testing.T) {
	sm, err := loader.LoadSockMap()
	if err != nil {
		t.Fatalf("load sockmap: %v", err)
	}
	t.Cleanup(func() { sm.Close() })
	r := &pairLog{SockMap: sm}
	be := startBackend(t, "echo", netip.AddrPort{}, echo)
	backends := []Backend{{Addr: be.addr()}}
	s := startProxy(t, Config{Backends: backends, Redirector: r, DrainTimeout: time.Millisecond})
	const rounds, n = 16, 16
	for range rounds {
		if err := s.SetBackends(backends); err != nil {
			t.Fatal(err)
		}
		endMidStream(t, s, n)
	}
	r.mu.Lock()
	pairs := r.pairs
	r.mu.Unlock()
	left := 0
	for _, cookies := range pairs {
		if first, err := sm.Forget(cookies); err != nil {
			t.Fatalf("forget: %v", err)
		} else if first != [2]int64{} {
			left++ // a socket's first-byte time is still there
		}
	}
	if left > 0 {
		t.Errorf("closed connections whose sockets the sockmap still holds: got %d of %d; want 0", left, len(pairs))
	}
}

// endMidStream opens n connections through s to its echo backend, each of whose
// clients sends and reads without pause once the connections are paired, then
// removes the backend: after s's DrainTimeout the connections are closed, bytes
// still coming both ways.
func endMidStream(t *testing.T, s *Service, n int) {
	t.Helper()
	var streams sync.WaitGroup
	defer streams.Wait() // after the proxy has closed the connections
	paired := redirected.Load()
	conns := make([]*net.TCPConn, n)
	for i := range conns {
		conns[i] = dial(t, s)
		conns[i].SetDeadline(time.Now().Add(20 * time.Second))
	}
	// Whatever happens below, the clients' sockets are closed before the wait.
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	waitfor.Value(t, 5*time.Second, fmt.Sprintf("%d connections paired", n), func() (any, bool) {
		k := redirected.Load() - paired
		return k, k >= uint64(n)
	})
	var echoed atomic.Int64
	chunk := bytes.Repeat([]byte("x"), 1<<10)
	for _, c := range conns {
		streams.Add(2)
		go func() { // exits when the connection is closed
			defer streams.Done()
			for {
				if _, err := c.Write(chunk); err != nil {
					return
				}
			}
		}()
		go func() { // exits when the connection is closed
			defer streams.Done()
			buf := make([]byte, 64<<10)
			for {
				k, err := c.Read(buf)
				echoed.Add(int64(k))
				if err != nil {
					return
				}
			}
		}()
	}
	waitfor.Value(t, 10*time.Second, "every connection moving bytes", func() (any, bool) {
		k := echoed.Load()
		return k, k >= int64(n*len(chunk))
	})
	if err := s.SetBackends(nil); err != nil {
		t.Fatal(err)
	}
	waitfor.Value(t, 10*time.Second, "0 active connections", active(s, 0))
}
