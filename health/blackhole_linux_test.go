package health

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"
)

// TestBlackHoledBackend drops the SYNs to one port inside a namespace: its
// checks must fail by timeout, and meanwhile the checks of the healthy
// backends must keep their schedule although few check slots are free; with
// either method, with the same errors.
func TestBlackHoledBackend(t *testing.T) {
	for _, m := range []Method{MethodConnect, MethodSyn} {
		t.Run(m.String(), func(t *testing.T) { testBlackHoledBackend(t, m) })
	}
}

func testBlackHoledBackend(t *testing.T, method Method) {
	ns := newNetNS(t)
	good := []string{ns.listen(t, "127.0.0.1:0").Addr().String(), ns.listen(t, "127.0.0.1:0").Addr().String()}
	hole := ns.listen(t, "127.0.0.1:0").Addr().String() // listening, but its SYNs are dropped
	ns.dropSYN(t, netip.MustParseAddrPort(hole).Port())

	const (
		interval = 50 * time.Millisecond
		// A check stuck behind a black hole starts a whole timeout late; a timeout
		// far above what load alone adds to a check's start keeps the two apart
		// on a busy shared machine.
		timeout = time.Second
		nHoles  = 4
		nGood   = 20
		runFor  = 3500 * time.Millisecond
	)
	var (
		mu        sync.Mutex
		lags      []time.Duration
		goodCount = map[string]int{}
		holeRes   []Result
	)
	c := &Checker{
		// The black holes hold half the slots for their whole timeout.
		MaxInFlight: 2 * nHoles,
		OnCheck: func(r Result) {
			mu.Lock()
			defer mu.Unlock()
			if r.Addr == hole {
				holeRes = append(holeRes, r)
				return
			}
			lags = append(lags, r.Lag())
			if r.Err == nil {
				goodCount[r.ID]++
			}
		},
	}
	cfg := Config{Check: Check{Method: method, Interval: interval, Timeout: timeout, Rise: 1, Fall: 2, Initial: Up}}
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	for i := range nHoles {
		if err := c.Set(Backend{ID: fmt.Sprint("hole", i), Addr: hole, Service: "web"}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range nGood {
		if err := c.Set(Backend{ID: fmt.Sprint("good", i), Addr: good[i%2], Service: "web"}); err != nil {
			t.Fatal(err)
		}
	}
	if method == MethodSyn {
		ns.run(t, c) // the raw sockets are Run's namespace's
	} else {
		c.Dial = ns.dial
		run(t, c)
	}
	time.Sleep(runFor)

	for _, st := range c.Snapshot() {
		want := Up
		if st.Addr == hole {
			want = Down
		}
		if st.State != want {
			t.Errorf("%s (%s): got %v (%s); want %v", st.ID, st.Addr, st.State, st.Reason, want)
		}
		if st.Addr == hole && st.Reason != "connect: timeout after 1s" {
			t.Errorf("%s reason: got %q; want connect: timeout after 1s", st.ID, st.Reason)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(holeRes) < nHoles*2 {
		t.Errorf("black-holed checks: got %d; want at least %d", len(holeRes), nHoles*2)
	}
	for _, r := range holeRes {
		// Not before the timeout; the upper bound only says "not stuck", with room for
		// a late timer on a loaded machine.
		if !errors.Is(r.Err, ErrTimeout) || r.Duration < timeout || r.Duration > timeout+700*time.Millisecond {
			t.Errorf("black-holed check: got %v after %v; want a timeout after about %v", r.Err, r.Duration, timeout)
		}
	}
	// Every healthy backend gets most of its checks (one stuck behind the black
	// holes would get well under half)...
	wantChecks := int(runFor/interval) * 6 / 10
	for i := range nGood {
		if n := goodCount[fmt.Sprint("good", i)]; n < wantChecks {
			t.Errorf("good%d: got %d passed checks in %v; want at least %d", i, n, runFor, wantChecks)
		}
	}
	// ...on time.
	slices.Sort(lags)
	p99 := lags[len(lags)*99/100]
	t.Logf("healthy checks: %d, lag p50 %v p99 %v max %v; black-holed checks: %d",
		len(lags), lags[len(lags)/2], p99, lags[len(lags)-1], len(holeRes))
	// A check that waited behind a black hole would start a whole timeout
	// late; half of it leaves room for a busy shared machine, where the p99
	// is normally a few milliseconds.
	if p99 >= timeout/2 {
		t.Errorf("healthy checks' p99 scheduling lag: got %v; want < %v", p99, timeout/2)
	}
}
