package health

import (
	"errors"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestRiseFall drives the hysteresis with scripted results: P passes, F fails.
// want is the active state after each result: u(p), d(own), ?(unknown).
func TestRiseFall(t *testing.T) {
	tests := []struct {
		name    string
		initial State
		results string
		want    string
	}{
		{"down after exactly fall", Up, "FFF", "uud"},
		{"up after exactly rise", Down, "PP", "du"},
		{"fail flapping shorter than fall", Up, "FFPFFPFFP", "uuuuuuuuu"},
		{"pass flapping shorter than rise", Down, "PFPFPF", "dddddd"},
		{"down then up", Up, "FFFPP", "uuddu"},
		{"unknown: first failure decides", Unknown, "FP", "dd"},
		{"unknown: first pass decides", Unknown, "PF", "uu"},
		{"rise counts only consecutive passes", Down, "PFPP", "dddu"},
	}
	letter := map[State]string{Up: "u", Down: "d", Unknown: "?"}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newFakeClock()
			c := &Checker{clock: clk.Now}
			if err := c.SetService("web", Config{Check: Check{Rise: 2, Fall: 3, Initial: tt.initial}}); err != nil {
				t.Fatal(err)
			}
			if err := c.Set(Backend{ID: "127.0.0.1:1", Service: "web"}); err != nil {
				t.Fatal(err)
			}
			b := c.backends["127.0.0.1:1"]
			var got strings.Builder
			for _, r := range tt.results {
				res := Result{ID: b.id}
				if r == 'F' {
					res.Err = errors.New("connect: connection refused")
				}
				c.mu.Lock()
				c.record(b, res, clk.Add(time.Second))
				got.WriteString(letter[b.active])
				c.mu.Unlock()
			}
			if got.String() != tt.want {
				t.Errorf("states after %s: got %s; want %s", tt.results, got.String(), tt.want)
			}
		})
	}
}

// TestTCPListenerClosesAndReopens runs real checks against a listener that the
// test shuts and reopens between checks, following a script: the backend must
// go down after exactly Fall refused connects, come back after exactly Rise
// accepted ones, and ignore flapping shorter than either; with either method,
// with the same errors.
func TestTCPListenerClosesAndReopens(t *testing.T) {
	for _, m := range []Method{MethodConnect, MethodSyn} {
		t.Run(m.String(), func(t *testing.T) { testListenerClosesAndReopens(t, m) })
	}
}

func testListenerClosesAndReopens(t *testing.T, method Method) {
	env := newCheckEnv(t, method)
	// The listener's state for each check, and the state wanted after it.
	const (
		script = "PPFFPFFPFFFPFPFPPFFP"
		want   = "uuuuuuuuuudddddduuuu"
	)
	ln := newToggleListener(t, env.listen)
	var (
		mu     sync.Mutex
		got    strings.Builder
		passed strings.Builder
		errs   []error
		done   = make(chan struct{})
	)
	c := &Checker{}
	c.OnCheck = func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		if got.Len() == len(script) {
			return
		}
		if r.Method != method {
			t.Errorf("result method: got %v; want %v", r.Method, method)
		}
		st, _ := c.Status(r.ID)
		got.WriteString(map[State]string{Up: "u", Down: "d", Unknown: "?"}[st.Active])
		if r.Err == nil {
			passed.WriteByte('P')
		} else {
			passed.WriteByte('F')
			errs = append(errs, r.Err)
		}
		if n := got.Len(); n < len(script) {
			// Called before the next check is scheduled, so the listener is
			// in place for it.
			ln.set(script[n] == 'P')
		} else {
			close(done)
		}
	}
	cfg := Config{Check: Check{Method: method, Interval: 10 * time.Millisecond, Timeout: time.Second, Rise: 2, Fall: 3, Initial: Up}}
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: ln.addr, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	env.run(t, c)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("script did not finish in 10s")
	}
	mu.Lock()
	defer mu.Unlock()
	if passed.String() != script {
		t.Fatalf("check results: got %s; want %s", passed.String(), script)
	}
	if got.String() != want {
		t.Errorf("states: got %s; want %s", got.String(), want)
	}
	for _, err := range errs {
		if !errors.Is(err, syscall.ECONNREFUSED) || err.Error() != "connect: connection refused" {
			t.Errorf("failed check: got %q; want connect: connection refused wrapping ECONNREFUSED", err)
		}
	}
	if m, err := c.Method("web"); m != method || err != nil {
		t.Errorf("Method: got %v, %v; want %v, nil", m, err, method)
	}
	st, _ := c.Status(ln.addr)
	if st.Last.Err != nil || st.Last.Start.IsZero() {
		t.Errorf("last result: got %+v; want a passed check", st.Last)
	}
}

// TestChangesCarryReasonAndTime checks what a subscriber sees when a backend
// goes down and up again.
func TestChangesCarryReasonAndTime(t *testing.T) {
	ln := newToggleListener(t, net.Listen)
	c := &Checker{}
	if err := c.SetService("web", Config{Check: Check{Interval: 10 * time.Millisecond, Rise: 1, Fall: 1, Initial: Up}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b1", Addr: ln.addr, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	sub := c.Subscribe()
	defer sub.Close()
	before := time.Now()
	run(t, c)
	first := waitChange(t, sub, "b1", time.Second, func(Change) bool { return true })
	if first.From != Up || first.To != Up || !first.Usable || first.Reason != "added" && first.Reason != "current" {
		t.Errorf("first change: got %v; want the current state, up and usable", first)
	}
	ln.set(false)
	down := waitChange(t, sub, "b1", 5*time.Second, func(ch Change) bool { return ch.To == Down })
	if down.From != Up || down.Usable || down.Reason != "connect: connection refused" || down.Time.Before(before) {
		t.Errorf("down change: got %v at %v; want up -> down, unusable, reason connect: connection refused, after %v", down, down.Time, before)
	}
	ln.set(true)
	up := waitChange(t, sub, "b1", 5*time.Second, func(ch Change) bool { return ch.To == Up })
	if up.From != Down || !up.Usable || up.Reason != "1 consecutive checks passed" || !up.Time.After(down.Time) {
		t.Errorf("up change: got %v; want down -> up, usable, after the down change", up)
	}
}

// A backend's own initial state is an active verdict: up, down or unknown.
func TestBackendInitialMustBeVerdict(t *testing.T) {
	c := &Checker{}
	if err := c.SetService("web", Config{}); err != nil {
		t.Fatal(err)
	}
	for _, st := range []State{Ejected, State(99)} {
		if err := c.Set(Backend{ID: "127.0.0.1:1", Service: "web", Initial: &st}); !errors.Is(err, ErrInvalidBackend) {
			t.Errorf("initial %v: %v; want ErrInvalidBackend", st, err)
		}
	}
	if _, ok := c.Status("127.0.0.1:1"); ok {
		t.Errorf("a backend refused for its initial state was added")
	}
}

// TestBackendInitialOverridesService: a backend's own initial state wins over its
// service's, only when it is first added, and the usual rise/fall apply from it.
func TestBackendInitialOverridesService(t *testing.T) {
	down, unknown := Down, Unknown
	for _, tc := range []struct {
		name    string
		service State
		own     *State
		want    State
	}{
		{"service up, backend down", Up, &down, Down},
		{"service up, backend unknown", Up, &unknown, Unknown},
		{"service down, backend inherits", Down, nil, Down},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			c := &Checker{clock: clk.Now}
			if err := c.SetService("web", Config{Check: Check{Rise: 2, Fall: 3, Initial: tc.service}}); err != nil {
				t.Fatal(err)
			}
			if err := c.Set(Backend{ID: "127.0.0.1:1", Service: "web", Initial: tc.own}); err != nil {
				t.Fatal(err)
			}
			st, ok := c.Status("127.0.0.1:1")
			if !ok || st.State != tc.want {
				t.Fatalf("state after add: %v (found %t); want %v", st.State, ok, tc.want)
			}
			// Setting it again (an update) does not reset its state.
			b := c.backends["127.0.0.1:1"]
			c.mu.Lock()
			for range 2 {
				c.record(b, Result{ID: b.id}, clk.Add(time.Second))
			}
			c.mu.Unlock()
			if err := c.Set(Backend{ID: "127.0.0.1:1", Service: "web", Initial: &down}); err != nil {
				t.Fatal(err)
			}
			if st, _ := c.Status("127.0.0.1:1"); st.State != Up {
				t.Errorf("after 2 passes and an update: %v; want up", st.State)
			}
		})
	}
}
