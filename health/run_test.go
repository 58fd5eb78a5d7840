package health

import (
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"
)

// TestRemoveInFlightLeaksNothing removes backends whose HTTP checks wait on a
// server that never answers: every check goroutine must end and every
// connection must be closed with a FIN.
func TestRemoveInFlightLeaksNothing(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 100)
	var serve sync.WaitGroup
	serve.Add(1)
	// Exits when ln is closed at the end of the test.
	go func() {
		defer serve.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	defer serve.Wait()
	defer ln.Close()

	c := &Checker{}
	cfg := Config{Check: Check{Kind: HTTP, Interval: 20 * time.Millisecond, Timeout: 10 * time.Second}}
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	run(t, c)
	time.Sleep(20 * time.Millisecond)
	baseline := runtime.NumGoroutine()

	const n = 50
	for i := range n {
		if err := c.Set(Backend{ID: fmt.Sprint("b", i), Addr: ln.Addr().String(), Service: "web"}); err != nil {
			t.Fatal(err)
		}
	}
	conns := make([]net.Conn, 0, n)
	for range n {
		select {
		case conn := <-accepted:
			conns = append(conns, conn)
		case <-time.After(5 * time.Second):
			t.Fatalf("only %d of %d checks reached the server", len(conns), n)
		}
	}
	if got := runtime.NumGoroutine(); got < baseline+n {
		t.Fatalf("goroutines with %d checks in flight: got %d; want at least %d", n, got, baseline+n)
	}
	for i := range n {
		if !c.Remove(fmt.Sprint("b", i)) {
			t.Fatalf("Remove(b%d): got false; want true", i)
		}
	}

	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > baseline && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := runtime.NumGoroutine(); got > baseline {
		buf := make([]byte, 1<<16)
		t.Fatalf("goroutines after removing every backend: got %d; want %d\n%s", got, baseline, buf[:runtime.Stack(buf, true)])
	}
	for i, conn := range conns {
		conn.SetReadDeadline(time.Now().Add(2 * time.Second))
		// The request, then EOF: the checker closed with a FIN.
		if _, err := io.Copy(io.Discard, conn); err != nil {
			t.Errorf("connection %d after removal: got %v; want EOF", i, err)
		}
		conn.Close()
	}
	if len(c.Snapshot()) != 0 {
		t.Errorf("snapshot after removal: got %d backends; want 0", len(c.Snapshot()))
	}
	select {
	case conn := <-accepted:
		conn.Close()
		t.Errorf("a removed backend was checked again")
	default:
	}
}

// TestReconfigureWhileRunning changes one service, adds and removes backends
// while Run runs, and checks that the other service's schedule is untouched.
func TestReconfigureWhileRunning(t *testing.T) {
	ln := newToggleListener(t)
	var (
		mu        sync.Mutex
		scheduled = map[string][]time.Time{}
		results   = map[string][]Result{}
		removedAt time.Time
		lateCheck string
	)
	c := &Checker{OnCheck: func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		scheduled[r.ID] = append(scheduled[r.ID], r.Scheduled)
		results[r.ID] = append(results[r.ID], r)
		if r.ID == "a0" && !removedAt.IsZero() && r.Start.After(removedAt) {
			lateCheck = fmt.Sprintf("a0 checked at %v after its removal at %v", r.Start, removedAt)
		}
	}}
	const ivB = 100 * time.Millisecond
	if err := c.SetService("a", Config{Check: Check{Interval: 200 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetService("b", Config{Check: Check{Interval: ivB}}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a0", "a1", "b0", "b1", "b2"} {
		if err := c.Set(Backend{ID: id, Addr: ln.addr, Service: id[:1]}); err != nil {
			t.Fatal(err)
		}
	}
	run(t, c)
	time.Sleep(300 * time.Millisecond)

	if err := c.SetService("a", Config{Check: Check{Interval: 20 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	changed := time.Now()
	if err := c.Set(Backend{ID: "a2", Addr: ln.addr, Service: "a"}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	c.Remove("a0")
	removedAt = time.Now()
	mu.Unlock()
	time.Sleep(400 * time.Millisecond)

	mu.Lock()
	defer mu.Unlock()
	if lateCheck != "" {
		t.Error(lateCheck)
	}
	for _, id := range []string{"b0", "b1", "b2"} {
		rs := results[id]
		if len(rs) < 5 {
			t.Errorf("%s: got %d checks; want at least 5 in 700ms at %v", id, len(rs), ivB)
		}
		for i := 1; i < len(rs); i++ {
			prev := rs[i-1]
			if prev.Start.Add(prev.Duration).After(prev.Scheduled.Add(ivB)) {
				continue // overran its interval on a busy machine: rescheduled at its end
			}
			if d := rs[i].Scheduled.Sub(prev.Scheduled); d != ivB {
				t.Errorf("%s: check %d scheduled %v after the previous; want %v (schedule restarted)", id, i, d, ivB)
			}
		}
	}
	after := 0
	for _, ts := range scheduled["a1"] {
		if ts.After(changed) {
			after++
		}
	}
	// 400ms at the new 20ms interval is 20 checks; the old one would give 2.
	if after < 6 {
		t.Errorf("a1 after shortening its interval: got %d checks; want at least 6", after)
	}
	if len(scheduled["a2"]) < 6 {
		t.Errorf("a2 added while running: got %d checks; want at least 6", len(scheduled["a2"]))
	}
}

// TestSubscriptionCoalesces lets a subscriber fall behind and checks that it
// holds one change per backend, ending at the latest state.
func TestSubscriptionCoalesces(t *testing.T) {
	c, clk := passiveChecker(t, 3, Config{
		Outlier: Outlier{Consecutive: 1, BaseEjection: time.Second, MaxEjectionPercent: 100},
	})
	sub := c.Subscribe()
	defer sub.Close()
	for range 10 {
		c.Observe("b1", Reset)
		advance(c, clk, time.Hour)
	}
	c.Observe("b2", Timeout)
	if got := sub.pending(); got != 3 {
		t.Fatalf("queued changes: got %d; want 3 (one per backend)", got)
	}
	want := map[string]Change{
		"b0": {From: Up, To: Up, Usable: true, Reason: "current"},
		"b1": {From: Up, To: Up, Usable: true, Reason: "ejection ended"},
		"b2": {From: Up, To: Ejected, Usable: false, Reason: "ejected for 1s after 1 consecutive failures (last: timeout)"},
	}
	for range 3 {
		ch, err := sub.Next(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		w := want[ch.ID]
		if ch.From != w.From || ch.To != w.To || ch.Usable != w.Usable || ch.Reason != w.Reason {
			t.Errorf("%s: got %v; want %v -> %v usable %t: %s", ch.ID, ch, w.From, w.To, w.Usable, w.Reason)
		}
	}
	c.Remove("b2")
	c.Observe("b0", Reset)
	ch, err := sub.Next(t.Context())
	if err != nil || ch.ID != "b0" || ch.To != Ejected {
		t.Errorf("after removing b2 and ejecting b0: got %v, %v; want b0 ejected", ch, err)
	}
	sub.Close()
	if _, err := sub.Next(t.Context()); err != ErrClosed {
		t.Errorf("Next after Close: got %v; want ErrClosed", err)
	}
}

// TestMoveBackendBetweenServices moves a backend from a service without active
// checks to one with them: it must start being checked.
func TestMoveBackendBetweenServices(t *testing.T) {
	ln := newToggleListener(t)
	ln.set(false) // refused from now on
	c := &Checker{}
	if err := c.SetService("passive", Config{Check: Check{Kind: None}}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetService("active", Config{Check: Check{Interval: 10 * time.Millisecond, Fall: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: ln.addr, Service: "passive"}); err != nil {
		t.Fatal(err)
	}
	sub := c.Subscribe()
	defer sub.Close()
	run(t, c)
	time.Sleep(50 * time.Millisecond)
	if st, _ := c.Status("b"); st.State != Up || !st.Last.Start.IsZero() {
		t.Fatalf("without active checks: got %v, last check at %v; want up, never checked", st.State, st.Last.Start)
	}
	if err := c.Set(Backend{ID: "b", Addr: ln.addr, Service: "active"}); err != nil {
		t.Fatal(err)
	}
	ch := waitChange(t, sub, "b", 5*time.Second, func(ch Change) bool { return ch.To == Down })
	if ch.Service != "active" || ch.Reason != "connect: connection refused" {
		t.Errorf("after the move: got %v; want down in service active, connect: connection refused", ch)
	}
}
