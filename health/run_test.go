package health

import (
	"context"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
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
	waitfor.Value(t, 5*time.Second, "Run started", func() (any, bool) { r := c.isRunning(); return r, r })
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

	if !waitfor.Cond(5*time.Second, func() bool { return runtime.NumGoroutine() <= baseline }) {
		got := runtime.NumGoroutine()
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

// TestReconfigureSchedule changes one service, adds and removes backends, and
// checks on the fake clock that the other service's schedule is untouched, that
// a shorter interval takes effect at once, and that a removed backend is never
// checked again. Every time in it is the fake clock's, so a loaded machine
// changes nothing.
func TestReconfigureSchedule(t *testing.T) {
	clk := newFakeClock()
	var (
		mu        sync.Mutex
		scheduled = map[string][]time.Time{}
	)
	c := &Checker{clock: clk.Now, Dial: pipeDial, OnCheck: func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		scheduled[r.ID] = append(scheduled[r.ID], r.Scheduled)
	}}
	const (
		ivA    = 200 * time.Millisecond
		ivB    = 100 * time.Millisecond
		ivAnew = 20 * time.Millisecond
	)
	if err := c.SetService("a", Config{Check: Check{Interval: ivA}}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetService("b", Config{Check: Check{Interval: ivB}}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a0", "a1", "b0", "b1", "b2"} {
		if err := c.Set(Backend{ID: id, Addr: "127.0.0.1:1", Service: id[:1]}); err != nil {
			t.Fatal(err)
		}
	}
	t0 := clk.Now()
	runFake(t, c, clk, t0.Add(300*time.Millisecond))

	changed := clk.Now()
	if err := c.SetService("a", Config{Check: Check{Interval: ivAnew}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "a2", Addr: "127.0.0.1:1", Service: "a"}); err != nil {
		t.Fatal(err)
	}
	c.Remove("a0")
	end := changed.Add(400 * time.Millisecond)
	runFake(t, c, clk, end)

	mu.Lock()
	defer mu.Unlock()
	// Fixed rate, no jitter: b's checks are exactly one interval apart, across
	// the change of service a. The first comes within the first interval.
	for _, id := range []string{"b0", "b1", "b2"} {
		ts := scheduled[id]
		if len(ts) < 7 {
			t.Errorf("%s: got %d checks in 700ms at %v; want at least 7", id, len(ts), ivB)
			continue
		}
		if d := ts[0].Sub(t0); d < 0 || d >= ivB {
			t.Errorf("%s: first check %v after the start; want within %v", id, d, ivB)
		}
		for i := 1; i < len(ts); i++ {
			if d := ts[i].Sub(ts[i-1]); d != ivB {
				t.Errorf("%s: check %d scheduled %v after the previous; want %v (schedule restarted)", id, i, d, ivB)
			}
		}
	}
	// a1 and a2 run at the new interval from within one new interval of the
	// change: 400ms at 20ms is 20 checks (the old 200ms would give 2).
	for _, id := range []string{"a1", "a2"} {
		var after []time.Time
		for _, ts := range scheduled[id] {
			if !ts.Before(changed) {
				after = append(after, ts)
			}
		}
		if len(after) < 20 {
			t.Errorf("%s after the change to %v: got %d checks in 400ms; want at least 20", id, ivAnew, len(after))
		}
		if len(after) == 0 {
			continue
		}
		if d := after[0].Sub(changed); d >= ivAnew {
			t.Errorf("%s: first check %v after the change; want within %v", id, d, ivAnew)
		}
		for i := 1; i < len(after); i++ {
			if d := after[i].Sub(after[i-1]); d != ivAnew {
				t.Errorf("%s: check %d after the change scheduled %v after the previous; want %v", id, i, d, ivAnew)
			}
		}
	}
	for _, ts := range scheduled["a0"] {
		if !ts.Before(changed) {
			t.Errorf("a0: check scheduled at +%v, after its removal at +%v", ts.Sub(t0), changed.Sub(t0))
		}
	}
	if _, ok := c.Status("a0"); ok {
		t.Errorf("a0: still known after Remove")
	}
}

// TestReconfigureWhileRunning makes the same changes while Run runs on the
// real clock, and checks only what no scheduling delay can change: the old
// interval is an hour, so any check of a1 proves the shorter interval took
// effect; a2, added while running, gets checked; and no result of a0 comes
// from a check that started after Remove returned.
func TestReconfigureWhileRunning(t *testing.T) {
	var (
		mu        sync.Mutex
		checks    = map[string]int{}
		removedAt time.Time
		lateCheck string
	)
	c := &Checker{Dial: pipeDial, OnCheck: func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		checks[r.ID]++
		if r.ID == "a0" && !removedAt.IsZero() && r.Start.After(removedAt) {
			lateCheck = fmt.Sprintf("a0 checked at %v, after its removal at %v", r.Start, removedAt)
		}
	}}
	if err := c.SetService("a", Config{Check: Check{Interval: time.Hour}}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetService("b", Config{Check: Check{Interval: 10 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a0", "a1", "b0"} {
		if err := c.Set(Backend{ID: id, Addr: "127.0.0.1:1", Service: id[:1]}); err != nil {
			t.Fatal(err)
		}
	}
	run(t, c)
	count := func(id string) int {
		mu.Lock()
		defer mu.Unlock()
		return checks[id]
	}
	waitfor.Value(t, 5*time.Second, "b0 checked twice", func() (any, bool) { return count("b0"), count("b0") >= 2 })

	if err := c.SetService("a", Config{Check: Check{Interval: 10 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "a2", Addr: "127.0.0.1:1", Service: "a"}); err != nil {
		t.Fatal(err)
	}
	c.Remove("a0")
	mu.Lock()
	removedAt = time.Now()
	mu.Unlock()
	for _, id := range []string{"a1", "a2"} {
		waitfor.Value(t, 5*time.Second, id+" checked 3 times", func() (any, bool) { return count(id), count(id) >= 3 })
	}
	mu.Lock()
	defer mu.Unlock()
	if lateCheck != "" {
		t.Error(lateCheck)
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
	ln := newToggleListener(t, net.Listen)
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
	waitfor.Value(t, 5*time.Second, "Run started", func() (any, bool) { r := c.isRunning(); return r, r })
	// Not waiting to see that no check comes: a backend without active checks
	// is in no queue, so Run has nothing to start for it.
	c.mu.RLock()
	queued, inflight := c.backends["b"].queued, c.backends["b"].inflight != nil
	c.mu.RUnlock()
	if st, _ := c.Status("b"); st.State != Up || !st.Last.Start.IsZero() || queued || inflight {
		t.Fatalf("without active checks: got %v, last check at %v, queued %t, in flight %t; want up, never checked, not queued",
			st.State, st.Last.Start, queued, inflight)
	}
	if err := c.Set(Backend{ID: "b", Addr: ln.addr, Service: "active"}); err != nil {
		t.Fatal(err)
	}
	ch := waitChange(t, sub, "b", 5*time.Second, func(ch Change) bool { return ch.To == Down })
	if ch.Service != "active" || ch.Reason != "connect: connection refused" {
		t.Errorf("after the move: got %v; want down in service active, connect: connection refused", ch)
	}
}

// TestRunDeadlineRecordsNoResult: when Run's context ends by its deadline, not
// by a cancel, a check it cuts short is no result either: the backend keeps
// its state, its run of failures and OnCheck are untouched, as when the
// context is cancelled.
func TestRunDeadlineRecordsNoResult(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	accepted := make(chan struct{}, 1)
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, conn := range conns {
			conn.Close()
		}
	})
	// Exits when the cleanup closes ln. The server never answers.
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, conn)
			mu.Unlock()
			select {
			case accepted <- struct{}{}:
			default:
			}
		}
	}()

	var checks atomic.Int32
	c := &Checker{OnCheck: func(Result) { checks.Add(1) }}
	cfg := Config{Check: Check{Kind: HTTP, Interval: 20 * time.Millisecond, Timeout: time.Minute, Fall: 1, Initial: Up}}
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b0", Addr: ln.Addr().String(), Service: "web"}); err != nil {
		t.Fatal(err)
	}
	const life = 3 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), life)
	t.Cleanup(cancel)
	done := make(chan error, 1)
	// Exits at ctx's deadline.
	go func() { done <- c.Run(ctx) }()
	select {
	case <-accepted:
	case <-time.After(life):
		t.Fatalf("no check reached the server within Run's %v", life)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: got %v; want nil", err)
		}
	case <-time.After(life + 5*time.Second):
		t.Fatal("Run did not return after its deadline")
	}
	st, _ := c.Status("b0")
	if st.State != Up || st.Fails != 0 || checks.Load() != 0 {
		t.Errorf("after Run's deadline cut its check short: got %v, %d fails, %d checks reported (last: %v); want up, 0, 0",
			st.State, st.Fails, checks.Load(), st.Last.Err)
	}
}
