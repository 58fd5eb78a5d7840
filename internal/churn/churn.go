// Package churn is a load of short connections for tests: several goroutines
// each open a connection to one address, send a request, read the start of the
// answer and close, over and over, counting the connections served and the
// ones that failed. Tests put it on a service while they reconfigure it; Echo
// is a backend for it. Tests only.
package churn

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// Load is a running load.
type Load struct {
	served, failed atomic.Int64
	stop           chan struct{}
	wg             sync.WaitGroup
	mu             sync.Mutex
	errs           []error // the first few failures
}

// Start opens connections to addr from workers goroutines until Stop (or the
// test's cleanup): each sends req and wants the answer to begin with want.
func Start(t testing.TB, addr string, workers int, req, want []byte) *Load {
	l := &Load{stop: make(chan struct{})}
	for range workers {
		// Exits when Stop is called.
		l.wg.Go(func() {
			for {
				select {
				case <-l.stop:
					return
				default:
				}
				if err := once(addr, req, want); err != nil {
					l.failed.Add(1)
					l.mu.Lock()
					if len(l.errs) < 5 {
						l.errs = append(l.errs, err)
					}
					l.mu.Unlock()
					continue
				}
				l.served.Add(1)
			}
		})
	}
	t.Cleanup(func() { l.Stop() })
	return l
}

// once is one connection: dial, send, read the start of the answer.
func once(addr string, req, want []byte) error {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(req); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("read the answer: %w", err)
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("got answer %q; want %q", got, want)
	}
	return nil
}

// Served returns how many connections were served so far.
func (l *Load) Served() int64 { return l.served.Load() }

// Progress waits, up to timeout, until n more connections than now are
// served; it reports false if they were not.
func (l *Load) Progress(n int64, timeout time.Duration) bool {
	from := l.Served()
	return waitfor.Cond(timeout, func() bool { return l.Served() >= from+n })
}

// Stop ends the load and returns how many connections were served and how
// many failed, with the first failures. It may be called more than once.
func (l *Load) Stop() (served, failed int64, errs []error) {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.served.Load(), l.failed.Load(), l.errs
}

// Each calls f(0) .. f(n-1), each once the load has served 50 more
// connections; it fails the test if the load stalls.
func (l *Load) Each(t testing.TB, n int, f func(i int)) {
	t.Helper()
	for i := range n {
		if !l.Progress(50, 10*time.Second) {
			t.Fatalf("step %d: the load made no progress", i)
		}
		f(i)
	}
}

// NoneFailed lets the load serve 50 more connections, stops it and fails the
// test if any connection failed, saying during what.
func (l *Load) NoneFailed(t testing.TB, during string) {
	t.Helper()
	l.Progress(50, 10*time.Second)
	served, failed, errs := l.Stop()
	if failed != 0 {
		t.Errorf("%s: got %d of %d connections failed (first: %v); want 0", during, failed, served+failed, errs)
	}
}

// Echo serves an echo on a loopback port until the test's cleanup and returns
// its address.
func Echo(t testing.TB) netip.AddrPort {
	t.Helper()
	return EchoAt(t, "127.0.0.1:0")
}

// EchoAt is Echo on the address addr (a port 0 picks one).
func EchoAt(t testing.TB, addr string) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	// Exits when ln is closed at cleanup.
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			// Exits when the client closes its side.
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}
