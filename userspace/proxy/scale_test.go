package proxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

const helperEnv = "WEIR_PROXY_TEST_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		if err := clientsAndBackend(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if os.Getenv(pathEnv) == "sockmap" {
		os.Exit(runOnSockmap(m))
	}
	os.Exit(m.Run())
}

// clientsAndBackend is the child process of TestManyConcurrentConnections: it holds
// both ends outside the proxy (an echo backend and the clients), so the parent's
// descriptors are the proxy's alone. Protocol on stdin/stdout, one line each:
// it says "BACKEND addr"; reads "OPEN proxyaddr n"; answers "OPENED"; reads "CLOSE";
// answers "CLOSED".
func clientsAndBackend(in io.Reader, out io.Writer) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer ln.Close()
	// Exits when ln is closed at return.
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			// Exits when the proxy closes the connection. The copy goes through a
			// buffer, not io.Copy's splice: Go's splice holds a pipe pair per blocked
			// connection, and with 5,000 of them this process would reach the
			// 20,000-descriptor limit, fail a pipe2 and reset a connection.
			go func() {
				io.CopyBuffer(struct{ io.Writer }{c}, struct{ io.Reader }{c}, make([]byte, 256))
				c.Close()
			}()
		}
	}()
	fmt.Fprintf(out, "BACKEND %s\n", ln.Addr())
	sc := bufio.NewScanner(in)
	if !sc.Scan() {
		return fmt.Errorf("no OPEN")
	}
	f := strings.Fields(sc.Text())
	n, _ := strconv.Atoi(f[2])
	conns := make([]net.Conn, n)
	var wg sync.WaitGroup
	errc := make(chan error, n)
	sem := make(chan struct{}, 64)
	for i := range conns {
		wg.Add(1)
		sem <- struct{}{}
		// Exits after one round trip on its connection.
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := net.Dial("tcp", f[1])
			if err != nil {
				errc <- err
				return
			}
			conns[i] = c
			c.SetDeadline(time.Now().Add(10 * time.Second))
			if err := roundTrip(c, "hello"); err != nil {
				errc <- fmt.Errorf("conn %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		return err
	}
	fmt.Fprintln(out, "OPENED")
	if !sc.Scan() || sc.Text() != "CLOSE" {
		return fmt.Errorf("no CLOSE")
	}
	for _, c := range conns {
		c.Close()
	}
	fmt.Fprintln(out, "CLOSED")
	io.Copy(io.Discard, in) // until the parent is done with us
	return nil
}

func TestManyConcurrentConnections(t *testing.T) {
	const n = 5000
	fd0, g0 := countFDs(t), runtime.NumGoroutine()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	lines := bufio.NewScanner(stdout)
	expect := func(prefix string) string {
		t.Helper()
		if !lines.Scan() || !strings.HasPrefix(lines.Text(), prefix) {
			t.Fatalf("helper: got %q; want %s", lines.Text(), prefix)
		}
		return strings.TrimSpace(strings.TrimPrefix(lines.Text(), prefix))
	}
	backend := expect("BACKEND")

	ctx, cancel := context.WithCancel(context.Background())
	s, err := Listen(ctx, Config{Name: "scale", Listen: loopback0, Backends: []Backend{{Addr: netip.MustParseAddrPort(backend)}}, Logger: discardLogger()})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	// Exits when ctx is cancelled below.
	go func() { served <- s.Serve(ctx) }()
	fdListen := countFDs(t)

	start := time.Now()
	fmt.Fprintf(stdin, "OPEN %s %d\n", s.Addr(), n)
	expect("OPENED")
	opened := time.Since(start)
	if a := s.Snapshot().Active; a != n {
		t.Errorf("active: got %d; want %d", a, n)
	}
	fds := countFDs(t)
	perConn := float64(fds-fdListen) / n
	t.Logf("%d connections opened in %v; proxy process: %d descriptors (%.2f per connection, %d pipes open), %d goroutines",
		n, opened, fds, perConn, pipesOpen.Load(), runtime.NumGoroutine())
	if perConn > 3 {
		t.Errorf("descriptors per proxied connection: got %.2f; want <= 3", perConn)
	}

	fmt.Fprintln(stdin, "CLOSE")
	expect("CLOSED")
	waitfor.Value(t, 10*time.Second, "0 active connections", active(s, 0))
	cancel()
	if err := <-served; err != nil {
		t.Fatalf("serve: %v", err)
	}
	checkReleased(t, s)
	snap := s.Snapshot()
	if snap.Accepted != n || snap.Unserved != 0 || snap.Backends[0].Resets != 0 {
		t.Errorf("accepted %d unserved %d resets %d; want %d, 0, 0", snap.Accepted, snap.Unserved, snap.Backends[0].Resets, n)
	}
	settle(t, g0, 2)
	// Idle pooled pipes stay open by design (at most maxIdlePipes pairs).
	if fds, limit := countFDs(t), fd0+2*maxIdlePipes; fds > limit {
		t.Errorf("descriptors after: got %d; want <= %d (baseline %d + pooled pipes)", fds, limit, fd0)
	}
}

func TestGracefulShutdown(t *testing.T) {
	be := startBackend(t, "a", netip.AddrPort{}, echo)
	fd0, g0 := countFDs(t), runtime.NumGoroutine()
	ctx, cancel := context.WithCancel(context.Background())
	s, err := Listen(ctx, Config{
		Name: "shutdown", Listen: loopback0, Backends: []Backend{{Addr: be.addr()}},
		ShutdownTimeout: 400 * time.Millisecond, Logger: discardLogger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	// Exits when ctx is cancelled below and the shutdown is over.
	go func() { served <- s.Serve(ctx) }()
	short, long := dial(t, s), dial(t, s)
	for _, c := range []net.Conn{short, long} {
		if err := roundTrip(c, "before"); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	t0 := time.Now()
	waitfor.Value(t, time.Second, "the listener closed", func() (any, bool) {
		c, err := net.Dial("tcp", s.Addr().String())
		if err == nil {
			c.Close()
		}
		return err, err != nil
	})
	// The grace is on the real clock: a connection that fails before most of
	// it has passed was cut early; later, a loaded machine may have let the
	// grace end, and that is no error.
	early := func() bool { return time.Since(t0) < 300*time.Millisecond }
	if err := roundTrip(short, "during"); err != nil && early() {
		t.Fatalf("connection cut during the grace (%v): %v", time.Since(t0), err)
	}
	short.Close()
	// Serve waits on while the long connection is open: one active connection,
	// unless a loaded machine let the grace end first (then none, which the
	// checks below hold to their own rules).
	waitfor.Value(t, 2*time.Second, "1 active connection (the long one), or the grace over", func() (any, bool) {
		n := s.Snapshot().Active
		return fmt.Sprintf("%d active connections after %v", n, time.Since(t0)), n == 1 || n == 0 && !early()
	})
	select {
	case err := <-served:
		if early() {
			t.Fatalf("serve returned after %v with a connection open: %v; want it to wait for the 400ms grace", time.Since(t0), err)
		}
		served <- err
	default:
	}
	if err := roundTrip(long, "still"); err != nil && early() {
		t.Fatalf("long connection cut before the deadline (%v): %v", time.Since(t0), err)
	}
	select {
	case err := <-served:
		if d := time.Since(t0); d < 400*time.Millisecond {
			t.Errorf("serve returned after %v; want after the 400ms grace", d)
		}
		if err != nil {
			t.Errorf("serve: %v", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("serve did not return after the grace")
	}
	long.SetReadDeadline(time.Now().Add(time.Second))
	if n, err := long.Read(make([]byte, 1)); err == nil {
		t.Errorf("long connection still open after shutdown: read %d", n)
	}
	checkReleased(t, s)
	long.Close()
	settle(t, g0, 0)
	if fds, limit := countFDs(t), fd0+2*maxIdlePipes; fds > limit {
		t.Errorf("descriptors after shutdown: got %d; want <= %d", fds, limit)
	}
}
