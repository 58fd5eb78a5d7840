package health

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestCheckChangeRestartsCounts: a reload that passes a service's check
// unchanged keeps its backends' pass counts, so rise goes on counting; one
// that changes what a check asks (here the HTTP path) starts them again, since
// a pass of the old request says nothing of the new one. The state stays, so
// neither change flaps the backend.
func TestCheckChangeRestartsCounts(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "ok") }))
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)

	clk := newFakeClock()
	c := &Checker{clock: clk.Now}
	cfg := func(path string) Config {
		return Config{Check: Check{Kind: HTTP, Interval: 100 * time.Millisecond, Timeout: time.Second, Rise: 5, Initial: Down,
			HTTP: HTTPCheck{Path: path, Status: []StatusRange{{200, 299}}}}}
	}
	if err := c.SetService("web", cfg("/a")); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	runFake(t, c, clk, clk.Now().Add(250*time.Millisecond))
	st, _ := c.Status("b")
	if st.Passes < 2 || st.Active != Down {
		t.Fatalf("after 250ms at 100ms: got %d passes, active %v; want at least 2, down", st.Passes, st.Active)
	}
	before := st.Passes

	// The same settings, in a new value, as a reload builds them.
	if err := c.SetService("web", cfg("/a")); err != nil {
		t.Fatal(err)
	}
	if st, _ := c.Status("b"); st.Passes != before || st.State != Down {
		t.Errorf("after an unchanged check: got %d passes, %v; want %d, down", st.Passes, st.State, before)
	}

	if err := c.SetService("web", cfg("/b")); err != nil {
		t.Fatal(err)
	}
	if st, _ := c.Status("b"); st.Passes != 0 || st.Fails != 0 || st.State != Down {
		t.Errorf("after the path changed: got %d passes, %d fails, %v; want 0, 0, down", st.Passes, st.Fails, st.State)
	}
}

// TestPassedOutlivesTheRun: Passed says that a check has passed since the
// backend was added after a failure ended the run of passes (Passes 0), and
// while the backend stays up (fall not reached).
func TestPassedOutlivesTheRun(t *testing.T) {
	var fail atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if fail.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	clk := newFakeClock()
	c := &Checker{clock: clk.Now}
	if err := c.SetService("web", Config{Check: Check{Kind: HTTP, Interval: 100 * time.Millisecond, Timeout: time.Second, Rise: 1, Fall: 100,
		Initial: Up, HTTP: HTTPCheck{Path: "/", Status: []StatusRange{{200, 299}}}}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	if st, _ := c.Status("b"); st.Passed {
		t.Fatalf("before any check: got %+v; want not passed", st)
	}
	runFake(t, c, clk, clk.Now().Add(150*time.Millisecond))
	if st, _ := c.Status("b"); st.Passes == 0 || !st.Passed {
		t.Fatalf("after a passing check: got %d passes, passed %t; want a run, passed", st.Passes, st.Passed)
	}
	fail.Store(true)
	runFake(t, c, clk, clk.Now().Add(250*time.Millisecond))
	if st, _ := c.Status("b"); st.Passes != 0 || st.Fails == 0 || !st.Passed || st.State != Up {
		t.Errorf("after failing checks: got %d passes, %d fails, passed %t, %v; want 0, some, passed, up", st.Passes, st.Fails, st.Passed, st.State)
	}
}

// TestPassedRestartsWithTheCheck: a change of what a backend's check asks (the
// HTTP path) or of where it asks (the address) forgets the pass the old check
// had, as it forgets the run of passes: Passed then says that the check as it
// now runs has passed, which a new service's VIP waits for.
func TestPassedRestartsWithTheCheck(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	t.Cleanup(other.Close)
	o, _ := url.Parse(other.URL)
	cfg := func(path string) Config {
		return Config{Check: Check{Kind: HTTP, Interval: 100 * time.Millisecond, Timeout: time.Second, Rise: 1, Fall: 1,
			Initial: Up, HTTP: HTTPCheck{Path: path, Status: []StatusRange{{200, 299}}}}}
	}
	for _, c := range []struct {
		name   string
		change func(c *Checker) error
	}{
		{"path", func(c *Checker) error { return c.SetService("web", cfg("/b")) }},
		{"address", func(c *Checker) error { return c.Set(Backend{ID: "b", Addr: o.Host, Service: "web"}) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			clk := newFakeClock()
			ck := &Checker{clock: clk.Now}
			if err := ck.SetService("web", cfg("/a")); err != nil {
				t.Fatal(err)
			}
			if err := ck.Set(Backend{ID: "b", Addr: u.Host, Service: "web"}); err != nil {
				t.Fatal(err)
			}
			runFake(t, ck, clk, clk.Now().Add(150*time.Millisecond))
			if st, _ := ck.Status("b"); !st.Passed {
				t.Fatalf("after a passing check: got %+v; want passed", st)
			}
			if err := c.change(ck); err != nil {
				t.Fatal(err)
			}
			if st, _ := ck.Status("b"); st.Passed || st.State != Up {
				t.Errorf("after the change: got passed %t, %v; want not passed, up", st.Passed, st.State)
			}
		})
	}
}

// TestCheckChangeDropsCheckInFlight: the result of a check that started
// before its service's check changed is not counted: here the old path's
// answer, a 503 that comes after the change, would take the backend down
// at fall 1 although the new path answers 200 (and rise 100 would keep it
// down).
func TestCheckChangeDropsCheckInFlight(t *testing.T) {
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	var fresh atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/new" {
			fresh.Add(1)
			fmt.Fprint(w, "ok")
			return
		}
		select {
		case started <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) }) // before srv.Close, which waits for the handler
	u, _ := url.Parse(srv.URL)

	c := &Checker{}
	cfg := func(path string) Config {
		return Config{Check: Check{Kind: HTTP, Interval: 50 * time.Millisecond, Timeout: 10 * time.Second, Rise: 100, Fall: 1, Initial: Up,
			HTTP: HTTPCheck{Path: path}}}
	}
	if err := c.SetService("web", cfg("/old")); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	sub := c.Subscribe()
	t.Cleanup(sub.Close)
	run(t, c)
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("no check of /old started")
	}
	if err := c.SetService("web", cfg("/new")); err != nil {
		t.Fatal(err)
	}
	release <- struct{}{} // the old check's answer: 503
	// Two checks of /new: the second starts after the old check's end was
	// applied, and after the first's.
	waitfor.Value(t, 5*time.Second, "2 checks of /new", func() (any, bool) { return fresh.Load(), fresh.Load() >= 2 })
	for sub.pending() > 0 {
		ch, err := sub.Next(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if ch.To != Up {
			t.Errorf("change after the path changed: %v -> %v (%s); want none but up", ch.From, ch.To, ch.Reason)
		}
	}
	if st, _ := c.Status("b"); st.State != Up {
		t.Errorf("state: got %v (%s); want up", st.State, st.Reason)
	}
}
