package proxy

import (
	"context"
	"net"
	"testing"
	"time"
)

// TestFailedLoop: when an event loop fails, Failed's channel is closed once
// no listener of the service is left, while Serve still lets the other
// loops' connections finish; a replacement bound to the same port then gets
// every new connection, and Serve returns the loop's error. Before, nothing
// told that the service no longer accepted until Serve returned after the
// drain. Nothing outside the kernel makes epoll_wait fail, so the test closes
// a loop's epoll file: its real wait then fails, as a failed epoll_wait does.
func TestFailedLoop(t *testing.T) {
	b := startBackend(t, "a", loopback0, hello)
	cfg := Config{Name: t.Name(), Listen: loopback0, Backends: []Backend{{Addr: b.addr()}},
		AcceptLoops: 2, ShutdownTimeout: time.Hour, Logger: discardLogger(), Redirector: testRedirector}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := Listen(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var serveErr error
	done := make(chan struct{})
	// Exits when a loop fails and its last connection closes.
	go func() { serveErr = s.Serve(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	c := dial(t, s)
	if got, err := readLine(c); err != nil || got != "a" {
		t.Fatalf("through the proxy: got %q, %v; want a", got, err)
	}
	select {
	case <-s.Failed():
		t.Fatal("Failed closed while the service serves")
	default:
	}

	// The loop that does not serve c fails, so that c drains.
	var idle *loop
	for _, l := range *s.loops.Load() {
		n := 0
		l.call(func() {
			for _, c := range l.conns {
				if c.state != stateFree {
					n++
				}
			}
		})
		if n == 0 {
			idle = l
		}
	}
	if idle == nil {
		t.Fatal("no event loop without a connection")
	}
	idle.ep.Close() // its wait fails, as a failed epoll_wait does
	select {
	case <-s.Failed():
	case <-time.After(10 * time.Second):
		t.Fatal("Failed not closed 10s after an event loop failed")
	}
	select {
	case <-done:
		t.Fatalf("Serve returned before the drain (ShutdownTimeout 1h): %v", serveErr)
	default:
	}

	cfg.Listen = s.Addr()
	cfg.Name = t.Name() + "-new"
	next := startProxy(t, cfg)
	for range 20 {
		c, err := net.DialTimeout("tcp", next.Addr().String(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := readLine(c); err != nil || got != "a" {
			t.Errorf("a new connection after the failure: got %q, %v; want a from the replacement", got, err)
		}
		c.Close()
	}
	if n := next.Snapshot().Accepted; n != 20 {
		t.Errorf("the replacement accepted %d of 20 new connections; want all", n)
	}
	c.Close() // the drain ends with the last connection
	select {
	case <-done:
		if serveErr == nil {
			t.Error("Serve after a loop failed: got nil; want the loop's error")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return 10s after its last connection closed")
	}
}
