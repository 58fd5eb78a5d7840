package health

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"testing"
	"time"
)

// requirePrivilege skips a test that needs root and namespaces, unless CI asked
// for every such test to run (WEIR_REQUIRE_XDP=1), where it fails instead.
func requirePrivilege(t *testing.T, reason string) {
	t.Helper()
	if os.Getenv("WEIR_REQUIRE_XDP") == "1" {
		t.Fatalf("WEIR_REQUIRE_XDP=1 but %s", reason)
	}
	t.Skip(reason)
}

// fakeClock is a settable clock for tests that drive the Checker by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Unix(1_700_000_000, 0)} }

func (f *fakeClock) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

func (f *fakeClock) Add(d time.Duration) time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
	return f.now
}

// Set moves the clock to t.
func (f *fakeClock) Set(t time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = t
}

// isRunning reports whether c.Run has started.
func (c *Checker) isRunning() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.running
}

// runFake runs c's scheduler on the fake clock until the clock reaches until,
// as Run does it: at each pass it ends due ejections and starts the checks due,
// then waits for those checks to complete before it moves the clock to the
// next event, so every check takes no time on the fake clock. The checks
// themselves are real; give c a Dial that answers at once.
func runFake(t *testing.T, c *Checker, clk *fakeClock, until time.Time) {
	t.Helper()
	sem := make(chan struct{}, DefaultMaxInFlight)
	var (
		wg    sync.WaitGroup
		batch []*backend
		next  time.Time
	)
	for {
		batch, next = c.takeDue(clk.Now(), batch[:0])
		for _, b := range batch {
			sem <- struct{}{}
			if !c.start(t.Context(), b, sem, &wg) {
				<-sem
			}
		}
		wg.Wait()
		if len(batch) > 0 {
			continue
		}
		if next.IsZero() || next.After(until) {
			clk.Set(until)
			return
		}
		clk.Set(next)
	}
}

// pipeDial is a Checker.Dial that connects at once, to nothing: a TCP check
// through it always passes, without touching the network.
func pipeDial(context.Context, string, string) (net.Conn, error) {
	a, b := net.Pipe()
	b.Close()
	return a, nil
}

// run starts c.Run and stops it (and waits for it) at the end of the test.
func run(t *testing.T, c *Checker) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	// Exits when the cleanup below cancels ctx.
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: got %v; want nil", err)
		}
	})
}

// waitChange returns the first change of backend id that satisfies ok, or
// fails the test after timeout.
func waitChange(t *testing.T, sub *Subscription, id string, timeout time.Duration, ok func(Change) bool) Change {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		ch, err := sub.Next(ctx)
		if err != nil {
			t.Fatalf("waiting for a change of %s: %v", id, err)
		}
		if ch.ID == id && ok(ch) {
			return ch
		}
	}
}

// toggleListener is a TCP listener on a fixed 127.0.0.1 port that can be shut
// and reopened, accepting and closing every connection while open.
type toggleListener struct {
	t      *testing.T
	addr   string
	listen func(network, addr string) (net.Listener, error)
	mu     sync.Mutex
	ln     net.Listener
	wg     sync.WaitGroup
}

func newToggleListener(t *testing.T, listen func(network, addr string) (net.Listener, error)) *toggleListener {
	ln, err := listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &toggleListener{t: t, addr: ln.Addr().String(), listen: listen}
	l.serve(ln)
	t.Cleanup(func() { l.set(false) })
	return l
}

func (l *toggleListener) serve(ln net.Listener) {
	l.ln = ln
	l.wg.Add(1)
	// Exits when ln is closed by set(false).
	go func() {
		defer l.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
}

func (l *toggleListener) set(open bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case open && l.ln == nil:
		ln, err := l.listen("tcp", l.addr)
		if err != nil {
			l.t.Errorf("reopen %s: %v", l.addr, err)
			return
		}
		l.serve(ln)
	case !open && l.ln != nil:
		l.ln.Close()
		l.wg.Wait()
		l.ln = nil
	}
}

// checkEnv is where a test's backends listen and its Checker runs, for a
// check method: the test's own namespace for connect checks, and for syn
// checks a namespace of their own (on Linux), whose ip_local_reserved_ports
// they may change.
type checkEnv struct {
	listen func(network, addr string) (net.Listener, error)
	run    func(t *testing.T, c *Checker)
}

func newCheckEnv(t *testing.T, m Method) checkEnv {
	if m == MethodSyn {
		return synEnv(t)
	}
	return checkEnv{listen: net.Listen, run: run}
}

// isTimeout reports whether err is the Checker's timeout.
func isTimeout(err error) bool { return errors.Is(err, ErrTimeout) }

// pending counts the changes queued in s.
func (s *Subscription) pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue) - s.head
}

// serveTCP listens on 127.0.0.1:0 and runs handle on each connection it
// accepts, each on a goroutine of its own, closing the connection when handle
// returns. At the end of the test it closes the listener and waits for every
// handle, which must return once the checker closes its connection. It
// returns the listener's address.
func serveTCP(t *testing.T, handle func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	t.Cleanup(func() { ln.Close() })
	wg.Add(1)
	// Exits when the cleanup closes the listener.
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			// Exits when handle returns.
			go func() {
				defer wg.Done()
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return ln.Addr().String()
}
