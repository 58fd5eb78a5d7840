package health

import (
	"errors"
	"fmt"
	"testing"
	"time"
)

// passiveChecker returns a Checker on a fake clock with one service of n
// backends b0..b(n-1) whose active checks are off.
func passiveChecker(t *testing.T, n int, cfg Config) (*Checker, *fakeClock) {
	t.Helper()
	clk := newFakeClock()
	c := &Checker{clock: clk.Now}
	cfg.Check.Kind = None
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if err := c.Set(Backend{ID: fmt.Sprintf("b%d", i), Addr: "127.0.0.1:1", Service: "web"}); err != nil {
			t.Fatal(err)
		}
	}
	return c, clk
}

func observeN(c *Checker, id string, o Outcome, n int) {
	for range n {
		c.Observe(id, o)
	}
}

// advance moves the fake clock and lets the Checker end due ejections, as Run does.
func advance(c *Checker, clk *fakeClock, d time.Duration) {
	now := clk.Add(d)
	c.mu.Lock()
	c.expire(now)
	c.mu.Unlock()
}

func TestEjectionBackoff(t *testing.T) {
	out := Outlier{Consecutive: 3, BaseEjection: 10 * time.Second, MaxEjection: 25 * time.Second, MaxEjectionPercent: 100}
	c, clk := passiveChecker(t, 1, Config{Outlier: out})
	steps := []struct {
		name        string
		wait        time.Duration // clock advance before the failures
		failures    int
		wantEjected time.Duration // 0: not ejected
	}{
		{"below threshold", 0, 2, 0},
		{"threshold reached: base", 0, 1, 10 * time.Second},
		{"right after return: 2x base", 10 * time.Second, 3, 20 * time.Second},
		{"third in a row: capped at max", 20 * time.Second, 3, 25 * time.Second},
		// Back for 2 x base: the multiplier decays from 3 to 1, so the next
		// ejection is 2 x base again.
		{"decayed after a quiet spell", 25*time.Second + 20*time.Second, 3, 20 * time.Second},
	}
	for _, s := range steps {
		advance(c, clk, s.wait)
		st, _ := c.Status("b0")
		if st.State != Up {
			t.Fatalf("%s: before failures: got %v; want up", s.name, st.State)
		}
		observeN(c, "b0", ConnectFailure, s.failures)
		st, _ = c.Status("b0")
		got := time.Duration(0)
		if st.State == Ejected {
			got = st.EjectedUntil.Sub(clk.Now())
		}
		if got != s.wantEjected {
			t.Errorf("%s: ejected for %v; want %v (status %+v)", s.name, got, s.wantEjected, st)
		}
	}
	advance(c, clk, 19*time.Second)
	if st, _ := c.Status("b0"); st.State != Ejected || st.Usable {
		t.Errorf("1s before the end: got %v usable %t; want ejected, unusable", st.State, st.Usable)
	}
	advance(c, clk, time.Second)
	if st, _ := c.Status("b0"); st.State != Up || !st.Usable || st.Reason != "ejection ended" {
		t.Errorf("at the end: got %v usable %t reason %q; want up, usable, ejection ended", st.State, st.Usable, st.Reason)
	}
}

func TestSuccessResetsFailureRun(t *testing.T) {
	c, _ := passiveChecker(t, 1, Config{Outlier: Outlier{Consecutive: 3}})
	for _, o := range []Outcome{Reset, Timeout, Success, ConnectFailure, Reset, Success, Timeout, Timeout} {
		c.Observe("b0", o)
	}
	if st, _ := c.Status("b0"); st.State != Up {
		t.Errorf("after failures broken by successes: got %v; want up", st.State)
	}
	c.Observe("b0", Reset)
	st, _ := c.Status("b0")
	if st.State != Ejected || st.Reason != "ejected for 30s after 3 consecutive failures (last: reset)" {
		t.Errorf("after 3 in a row: got %v %q; want ejected for 30s after 3 consecutive failures (last: reset)", st.State, st.Reason)
	}
	// Unknown backends and disabled services ignore outcomes.
	c.Observe("nope", Reset)
	d, _ := passiveChecker(t, 1, Config{})
	observeN(d, "b0", Reset, 100)
	if st, _ := d.Status("b0"); st.State != Up {
		t.Errorf("passive off: got %v; want up", st.State)
	}
}

func TestMaxEjectionPercent(t *testing.T) {
	tests := []struct {
		name        string
		backends    int
		percent     int
		wantEjected int
	}{
		{"20% of 10", 10, 20, 2},
		{"10% of 10", 10, 10, 1},
		{"at least one even when the share rounds to none", 3, 10, 1},
		{"50% of 4", 4, 50, 2},
		{"100%", 4, 100, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _ := passiveChecker(t, tt.backends, Config{
				Outlier: Outlier{Consecutive: 2, MaxEjectionPercent: tt.percent},
			})
			for i := range tt.backends {
				observeN(c, fmt.Sprintf("b%d", i), ConnectFailure, 2)
			}
			got := 0
			for _, st := range c.Snapshot() {
				if st.State == Ejected {
					got++
				}
			}
			if got != tt.wantEjected {
				t.Errorf("ejected: got %d; want %d", got, tt.wantEjected)
			}
		})
	}
}

func TestPanicThreshold(t *testing.T) {
	tests := []struct {
		name      string
		threshold int
		down      int // of 4 backends
		wantPanic bool
	}{
		{"none down", 50, 0, false},
		{"half up is not below 50%", 50, 2, false},
		{"a quarter up is below 50%", 50, 3, true},
		{"all down, panic uses all", 50, 4, true},
		{"all down, panic off: none usable", 0, 4, false},
		{"threshold 100: any down panics", 100, 1, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _ := passiveChecker(t, 4, Config{
				Outlier:        Outlier{Consecutive: 1, MaxEjectionPercent: 100},
				PanicThreshold: tt.threshold,
			})
			sub := c.Subscribe()
			defer sub.Close()
			for i := range tt.down {
				c.Observe(fmt.Sprintf("b%d", i), Timeout)
			}
			usable := 0
			for i, st := range c.Snapshot() {
				if st.Panic != tt.wantPanic {
					t.Errorf("%s panic: got %t; want %t", st.ID, st.Panic, tt.wantPanic)
				}
				wantUsable := tt.wantPanic || i >= tt.down
				if st.Usable != wantUsable {
					t.Errorf("%s usable: got %t; want %t", st.ID, st.Usable, wantUsable)
				}
				if st.Usable {
					usable++
				}
			}
			// Subscribers end at the same usability.
			last := map[string]Change{}
			for {
				ch, err := sub.Next(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				last[ch.ID] = ch
				if len(last) == 4 && sub.pending() == 0 {
					break
				}
			}
			n := 0
			for _, ch := range last {
				if ch.Usable {
					n++
				}
				if ch.Panic != tt.wantPanic {
					t.Errorf("%s change panic: got %t; want %t", ch.ID, ch.Panic, tt.wantPanic)
				}
			}
			if n != usable {
				t.Errorf("usable per subscriber: got %d; want %d", n, usable)
			}
		})
	}
}

// TestEjectionWaitsForActiveChecks checks that an ejected backend whose active
// checks fail meanwhile stays out when the ejection ends, until they pass.
func TestEjectionWaitsForActiveChecks(t *testing.T) {
	clk := newFakeClock()
	c := &Checker{clock: clk.Now}
	cfg := Config{
		Check:   Check{Rise: 2, Fall: 1, Initial: Up},
		Outlier: Outlier{Consecutive: 1, BaseEjection: 10 * time.Second},
	}
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b0", Addr: "127.0.0.1:1", Service: "web"}); err != nil {
		t.Fatal(err)
	}
	b := c.backends["b0"]
	record := func(err error) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.record(b, Result{ID: "b0", Err: err}, clk.Now())
	}
	state := func() State { st, _ := c.Status("b0"); return st.State }

	c.Observe("b0", Reset)
	if got := state(); got != Ejected {
		t.Fatalf("after a reset: got %v; want ejected", got)
	}
	record(errors.New("connect: connection refused"))
	if got := state(); got != Down {
		t.Fatalf("ejected and failing checks: got %v; want down", got)
	}
	advance(c, clk, 10*time.Second)
	if got := state(); got != Down {
		t.Fatalf("ejection over, checks still failing: got %v; want down", got)
	}
	record(nil)
	record(nil)
	if got := state(); got != Up {
		t.Fatalf("checks pass again: got %v; want up", got)
	}

	// Passing checks do not end an ejection early either.
	c.Observe("b0", Reset)
	record(nil)
	if got := state(); got != Ejected {
		t.Fatalf("ejected with passing checks: got %v; want ejected", got)
	}
}

// TestMoveToServiceWithoutEjection: a backend moved by Set into a service whose
// passive ejection is off leaves its ejection behind, as a service reconfigured
// with ejection off does, instead of staying out of use until it ends; and it
// no longer counts against its old service's max_ejection_percent.
func TestMoveToServiceWithoutEjection(t *testing.T) {
	c, _ := passiveChecker(t, 2, Config{Outlier: Outlier{Consecutive: 2, MaxEjectionPercent: 10}})
	if err := c.SetService("db", Config{Check: Check{Kind: None}}); err != nil {
		t.Fatal(err)
	}
	observeN(c, "b0", Reset, 2)
	if st, _ := c.Status("b0"); st.State != Ejected {
		t.Fatalf("b0 after 2 resets: got %v; want ejected", st.State)
	}
	if err := c.Set(Backend{ID: "b0", Addr: "127.0.0.1:1", Service: "db"}); err != nil {
		t.Fatal(err)
	}
	if st, _ := c.Status("b0"); st.State != Up || !st.Usable || !st.EjectedUntil.IsZero() {
		t.Errorf("b0 moved to a service without ejection: got %v usable %t ejected until %v; want up, usable, not ejected", st.State, st.Usable, st.EjectedUntil)
	}
	observeN(c, "b1", Reset, 2)
	if st, _ := c.Status("b1"); st.State != Ejected {
		t.Errorf("b1, the old service's only backend, after 2 resets: got %v; want ejected", st.State)
	}
}

// TestEjectionMultiplierStopsAtMax: once n × base_ejection reaches max_ejection
// a longer streak adds nothing to the multiplier (as in Envoy), so a backend
// that failed for hours is, after max_ejection ÷ base_ejection quiet bases,
// ejected for one base again like any other, not for max_ejection long after
// it recovered.
func TestEjectionMultiplierStopsAtMax(t *testing.T) {
	out := Outlier{Consecutive: 1, BaseEjection: 10 * time.Second, MaxEjection: 25 * time.Second, MaxEjectionPercent: 100}
	c, clk := passiveChecker(t, 1, Config{Outlier: out})
	for range 20 { // a long streak: ejected again as soon as it returns
		c.Observe("b0", Reset)
		st, _ := c.Status("b0")
		advance(c, clk, st.EjectedUntil.Sub(clk.Now()))
	}
	if st, _ := c.Status("b0"); st.Ejections != 3 {
		t.Errorf("multiplier after 20 ejections in a row, base 10s, max 25s: got %d; want 3", st.Ejections)
	}
	advance(c, clk, 30*time.Second) // three bases back in service
	c.Observe("b0", Reset)
	st, _ := c.Status("b0")
	if got := st.EjectedUntil.Sub(clk.Now()); got != 10*time.Second {
		t.Errorf("ejection after 3 quiet bases: got %v; want 10s (multiplier back to 1)", got)
	}
}

// TestMultiplierDecaysAfterEjectionTurnedOff: an ejection ended early, by
// turning ejection off or by a move to a service without it, puts the backend
// back in service from then, so its multiplier decays from then as after an
// ejection that ran out: a backend ejected once, then back in service for an
// hour, is ejected for one base, not two.
func TestMultiplierDecaysAfterEjectionTurnedOff(t *testing.T) {
	out := Outlier{Consecutive: 1, BaseEjection: 10 * time.Second, MaxEjection: 300 * time.Second, MaxEjectionPercent: 100}
	for _, how := range []string{"SetService", "Set"} {
		t.Run(how, func(t *testing.T) {
			c, clk := passiveChecker(t, 1, Config{Outlier: out})
			for name, o := range map[string]Outlier{"db": out, "off": {}} {
				if err := c.SetService(name, Config{Check: Check{Kind: None}, Outlier: o}); err != nil {
					t.Fatal(err)
				}
			}
			c.Observe("b0", Reset)
			if st, _ := c.Status("b0"); st.State != Ejected {
				t.Fatalf("b0 after a reset: got %v; want ejected", st.State)
			}
			// The ejection ends early, and b0 comes back to a service that
			// ejects an hour later.
			switch how {
			case "SetService":
				if err := c.SetService("web", Config{Check: Check{Kind: None}}); err != nil {
					t.Fatal(err)
				}
			case "Set":
				if err := c.Set(Backend{ID: "b0", Addr: "127.0.0.1:1", Service: "off"}); err != nil {
					t.Fatal(err)
				}
			}
			if st, _ := c.Status("b0"); st.State != Up {
				t.Fatalf("b0 after its ejection was ended: got %v; want up", st.State)
			}
			advance(c, clk, time.Hour)
			switch how {
			case "SetService":
				if err := c.SetService("web", Config{Check: Check{Kind: None}, Outlier: out}); err != nil {
					t.Fatal(err)
				}
			case "Set":
				if err := c.Set(Backend{ID: "b0", Addr: "127.0.0.1:1", Service: "db"}); err != nil {
					t.Fatal(err)
				}
			}
			c.Observe("b0", Reset)
			st, _ := c.Status("b0")
			if got := st.EjectedUntil.Sub(clk.Now()); st.State != Ejected || got != out.BaseEjection {
				t.Errorf("b0 after an hour back in service: got %v for %v; want ejected for %v (multiplier back to 1)", st.State, got, out.BaseEjection)
			}
		})
	}
}

// TestStatusEjectionsDecays: Status reports the multiplier as it stands now, so
// after a quiet spell back in service it shows the decayed value the next
// ejection would start from, not the one of the last ejection.
func TestStatusEjectionsDecays(t *testing.T) {
	out := Outlier{Consecutive: 1, BaseEjection: 10 * time.Second, MaxEjection: 40 * time.Second, MaxEjectionPercent: 100}
	c, clk := passiveChecker(t, 1, Config{Outlier: out})
	for range 3 { // ejected for 10s, 20s, 30s in a row: multiplier 3
		c.Observe("b0", Reset)
		st, _ := c.Status("b0")
		advance(c, clk, st.EjectedUntil.Sub(clk.Now()))
	}
	steps := []struct {
		wait time.Duration
		want int
	}{
		{0, 3},
		{10 * time.Second, 2},
		{15 * time.Second, 1},
		{5 * time.Second, 0},
		{time.Hour, 0},
	}
	for _, s := range steps {
		advance(c, clk, s.wait)
		st, _ := c.Status("b0")
		snap := c.Snapshot()
		if st.Ejections != s.want || snap[0].Ejections != s.want {
			t.Errorf("after %v more in service: got Status %d, Snapshot %d; want %d", s.wait, st.Ejections, snap[0].Ejections, s.want)
		}
	}
	c.Observe("b0", Reset) // decayed to 0, so the next ejection is one base
	if st, _ := c.Status("b0"); st.Ejections != 1 || st.EjectedUntil.Sub(clk.Now()) != 10*time.Second {
		t.Errorf("ejected after the decay: got multiplier %d for %v; want 1 for 10s", st.Ejections, st.EjectedUntil.Sub(clk.Now()))
	}
}
