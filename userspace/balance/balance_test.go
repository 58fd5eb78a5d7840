package balance

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// clock is a manual clock for slow start and EWMA tests.
type clock struct{ t int64 }

func (c *clock) now() int64              { return c.t }
func (c *clock) advance(d time.Duration) { c.t += int64(d) }

func mustNew(t *testing.T, alg string, bs []Backend, seed uint64) Balancer {
	t.Helper()
	b, err := New(alg, bs, seed)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func mustNewClock(t *testing.T, alg string, bs []Backend, seed uint64, c *clock) Balancer {
	t.Helper()
	b, err := newBalancer(alg, bs, seed, c.now)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func abc(weights ...uint32) []Backend {
	bs := make([]Backend, len(weights))
	for i, w := range weights {
		bs[i] = Backend{ID: string(rune('A' + i)), Weight: w, Usable: true}
	}
	return bs
}

// picks picks n times, releasing each lease at once, and returns the IDs joined.
func picks(t *testing.T, b Balancer, n int) string {
	t.Helper()
	var s strings.Builder
	for i := range n {
		l, err := b.Pick(uint64(i), nil)
		if err != nil {
			t.Fatalf("pick %d: %v", i, err)
		}
		s.WriteString(l.Backend())
		l.Release(Result{})
	}
	return s.String()
}

// counts picks n times, holding every lease, and returns how often each ID was chosen.
func counts(t *testing.T, b Balancer, n int, hold bool) map[string]int {
	t.Helper()
	c := map[string]int{}
	leases := make([]Lease, 0, n)
	for i := range n {
		l, err := b.Pick(uint64(i)*0x9e3779b97f4a7c15, nil)
		if err != nil {
			t.Fatalf("pick %d: %v", i, err)
		}
		c[l.Backend()]++
		if hold {
			leases = append(leases, l)
		} else {
			l.Release(Result{})
		}
	}
	for i := range leases {
		leases[i].Release(Result{})
	}
	return c
}

func TestNewErrors(t *testing.T) {
	if _, err := New("fastest", abc(1), 0); !errors.Is(err, ErrUnknownAlgorithm) {
		t.Errorf("New(fastest): got %v; want ErrUnknownAlgorithm", err)
	}
	dup := []Backend{{ID: "a", Weight: 1, Usable: true}, {ID: "a", Weight: 2, Usable: true}}
	for _, alg := range Algorithms() {
		if _, err := New(alg, dup, 0); !errors.Is(err, ErrDuplicateID) {
			t.Errorf("New(%s, duplicate IDs): got %v; want ErrDuplicateID", alg, err)
		}
	}
}

// TestNoBackend: every algorithm says ErrNoBackend, never panics, when nothing is usable.
func TestNoBackend(t *testing.T) {
	sets := []struct {
		name     string
		backends []Backend
		skip     func(string) bool
	}{
		{"empty", nil, nil},
		{"all unusable", []Backend{{ID: "a", Weight: 1}, {ID: "b", Weight: 1}}, nil},
		{"all weight 0", []Backend{{ID: "a", Usable: true}, {ID: "b", Usable: true}}, nil},
		{"all skipped", abc(1, 2, 3), func(string) bool { return true }},
	}
	for _, alg := range Algorithms() {
		for _, set := range sets {
			t.Run(alg+"/"+set.name, func(t *testing.T) {
				b := mustNew(t, alg, set.backends, 1)
				l, err := b.Pick(7, set.skip)
				if !errors.Is(err, ErrNoBackend) {
					t.Errorf("got %q, %v; want ErrNoBackend", l.Backend(), err)
				}
				l.Release(Result{}) // a zero lease: no-op
			})
		}
	}
}

// TestSkip: skipped backends are never chosen, whatever the algorithm.
func TestSkip(t *testing.T) {
	bs := backendsN(10, one)
	for _, alg := range Algorithms() {
		t.Run(alg, func(t *testing.T) {
			b := mustNew(t, alg, bs, 3)
			allowed := map[string]bool{bs[3].ID: true, bs[8].ID: true}
			skip := func(id string) bool { return !allowed[id] }
			seen := map[string]int{}
			for i := range 400 {
				l, err := b.Pick(uint64(i), skip)
				if err != nil {
					t.Fatal(err)
				}
				seen[l.Backend()]++
				l.Release(Result{})
			}
			for id := range seen {
				if !allowed[id] {
					t.Errorf("picked skipped backend %s", id)
				}
			}
			if alg != Maglev && alg != SourceHash && alg != WeightedLeastConn && alg != LeastConn && len(seen) != 2 {
				t.Errorf("got %v; want both unskipped backends used", seen)
			}
		})
	}
}

func TestRoundRobin(t *testing.T) {
	b := mustNew(t, RoundRobin, abc(1, 5, 1), 0)
	if got, want := picks(t, b, 7), "ABCABCA"; got != want {
		t.Errorf("got %s; want %s", got, want)
	}
	// A new usable set: it cycles over the new set.
	b.SetBackends([]Backend{{ID: "A", Weight: 1, Usable: true}, {ID: "B", Weight: 1}, {ID: "C", Weight: 1, Usable: true}, {ID: "D", Weight: 1, Usable: true}})
	got := picks(t, b, 6)
	for _, c := range "ACD" {
		if strings.Count(got, string(c)) != 2 {
			t.Errorf("after SetBackends got %s; want A, C and D twice each", got)
		}
	}
	if strings.Contains(got, "B") {
		t.Errorf("after SetBackends got %s; want no B (unusable)", got)
	}
}

// TestWeighted checks nginx's smooth weighted round robin sequences.
func TestWeighted(t *testing.T) {
	tests := []struct {
		weights []uint32
		n       int
		want    string
	}{
		{[]uint32{5, 1, 1}, 7, "AABACAA"},
		{[]uint32{5, 1, 1}, 14, "AABACAAAABACAA"},
		{[]uint32{1, 1, 1}, 6, "ABCABC"},
		{[]uint32{2, 1}, 6, "ABAABA"},
		{[]uint32{4, 2, 1}, 7, "ABACABA"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.weights), func(t *testing.T) {
			b := mustNew(t, Weighted, abc(tt.weights...), 0)
			if got := picks(t, b, tt.n); got != tt.want {
				t.Errorf("got %s; want %s", got, tt.want)
			}
		})
	}
}

// TestWeightedNoBurst: a backend returning after an absence gets its share from the
// first round on, not a run of picks from stored credit.
func TestWeightedNoBurst(t *testing.T) {
	bs := abc(1, 1, 1)
	b := mustNew(t, Weighted, bs, 0)
	picks(t, b, 5)
	bs[2].Usable = false
	b.SetBackends(bs)
	if got := picks(t, b, 100); strings.Contains(got, "C") {
		t.Fatalf("C unusable but picked: %s", got)
	}
	bs[2].Usable = true
	b.SetBackends(bs)
	got := picks(t, b, 9)
	for _, c := range "ABC" {
		if n := strings.Count(got, string(c)); n != 3 {
			t.Errorf("after C returns got %s: %c %d times; want 3", got, c, n)
		}
	}
}

// TestWeightedChangeNoBurst: a change of weights, or a backend added or removed,
// at any point of a cycle sends no run of picks to one backend from credit the old
// weights built up: from the change on, every window of a new cycle's length holds
// each backend its new share. Credits stay within the total weight; kept across a
// change, one built under a total of 101 runs for about a hundred picks under a
// total of 2.
func TestWeightedChangeNoBurst(t *testing.T) {
	tests := []struct {
		name      string
		before    []uint32
		after     []Backend
		wantCycle map[string]int // picks per window of a cycle's length after the change
	}{
		{"heavy to light", []uint32{1, 100}, abc(1, 1), map[string]int{"A": 1, "B": 1}},
		{"light to heavy", []uint32{100, 1}, abc(1, 1), map[string]int{"A": 1, "B": 1}},
		{"removed", []uint32{1, 1, 100}, abc(1, 1), map[string]int{"A": 1, "B": 1}},
		{"added", []uint32{1, 100}, abc(1, 1, 1), map[string]int{"A": 1, "B": 1, "C": 1}},
		{"reweighted", []uint32{5, 1, 1}, abc(1, 5, 1), map[string]int{"A": 1, "B": 5, "C": 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			oldCycle := 0
			for _, w := range tt.before {
				oldCycle += int(w)
			}
			cycle := 0
			for _, n := range tt.wantCycle {
				cycle += n
			}
			for warm := range oldCycle {
				b := mustNew(t, Weighted, abc(tt.before...), 0)
				picks(t, b, warm)
				b.SetBackends(tt.after)
				got := picks(t, b, 4*cycle)
				for i := 0; i+cycle <= len(got); i += cycle {
					for id, want := range tt.wantCycle {
						if n := strings.Count(got[i:i+cycle], id); n != want {
							t.Fatalf("changed after %d picks, then got %s: window at %d holds %s %d times; want %d",
								warm, got, i, id, n, want)
						}
					}
				}
			}
		})
	}
}

// TestWeightedFlapShares: a backend going down and up every few picks (a
// flapping health check at light load) starts a new cycle at each change, and the
// others still get their shares: with the ties of each new cycle going to the
// first backend listed, A took the first pick of every cycle, and with a change
// after every pick, every pick.
func TestWeightedFlapShares(t *testing.T) {
	const rounds = 3000
	for _, every := range []int{1, 2, 3, 5} {
		bs := abc(1, 1, 1)
		b := mustNew(t, Weighted, bs, 7)
		got := map[string]int{}
		for r := range rounds {
			for range every {
				l, err := b.Pick(0, nil)
				if err != nil {
					t.Fatal(err)
				}
				got[l.Backend()]++
				l.Release(Result{})
			}
			bs[1].Usable = r%2 == 1 // B flaps: down, up, down...
			b.SetBackends(bs)
		}
		// Half the picks among all three, half among A and C.
		total := float64(rounds * every)
		want := map[string]float64{"A": 0.5/3 + 0.5/2, "B": 0.5 / 3, "C": 0.5/3 + 0.5/2}
		for id, w := range want {
			sd := math.Sqrt(w * (1 - w) / total)
			if share := float64(got[id]) / total; math.Abs(share-w) > 5*sd {
				t.Errorf("B flapping every %d picks: picks %v: %s has share %.3f; want %.3f ± %.3f",
					every, got, id, share, w, 5*sd)
			}
		}
	}
}

// TestWeightedPickRacingChange: a pick that read the backend list just before a
// change of weights, and takes the lock only after the change started the new
// cycle, must not move credit by the old weights: here it would leave A owing the
// old total of 200, and D, beside it at weight 1 each, would take the next hundred
// picks in a row. The clock, which a pick reads while a backend ramps, holds the
// pick at that point.
func TestWeightedPickRacingChange(t *testing.T) {
	var armed atomic.Bool
	entered, release := make(chan struct{}), make(chan struct{})
	c := &clock{}
	now := func() int64 {
		if armed.CompareAndSwap(true, false) {
			close(entered)
			<-release
		}
		return c.now()
	}
	bs := abc(100, 100, 1)
	bs[2].SlowStart = time.Hour
	bs[2].Usable = false
	bal, err := newBalancer(Weighted, bs, 0, now)
	if err != nil {
		t.Fatal(err)
	}
	bs[2].Usable = true
	bal.SetBackends(bs) // C ramps, so a pick reads the clock
	armed.Store(true)
	picked := make(chan error, 1)
	go func() { // exits when the pick returns, once release is closed
		l, err := bal.Pick(0, nil)
		l.Release(Result{})
		picked <- err
	}()
	select {
	case <-entered:
	case <-time.After(time.Minute):
		t.Fatal("the pick never read the clock")
	}
	after := []Backend{{ID: "A", Weight: 1, Usable: true}, {ID: "D", Weight: 1, Usable: true}}
	w := bal.(*smoothWeighted)
	if w.mu.TryLock() {
		// The pick reads the clock before it takes the lock: change the set there.
		w.mu.Unlock()
		bal.SetBackends(after)
		close(release)
	} else {
		// It holds the lock: it picks from the old set, and the change follows.
		close(release)
		bal.SetBackends(after)
	}
	if err := <-picked; err != nil {
		t.Fatal(err)
	}
	got := picks(t, bal, 20)
	for i := 0; i+2 <= len(got); i += 2 {
		if got[i] == got[i+1] {
			t.Fatalf("after the change, got %s; want A and D alternating", got)
		}
	}
}

func TestLeastConn(t *testing.T) {
	b := mustNew(t, LeastConn, abc(1, 1, 1), 5)
	// Hold: least_conn spreads held connections evenly.
	got := counts(t, b, 300, true)
	for _, id := range []string{"A", "B", "C"} {
		if got[id] != 100 {
			t.Errorf("held picks: %s got %d; want 100 (%v)", id, got[id], got)
		}
	}
	// Released at once every backend ties at 0: the winner must still vary.
	got = counts(t, b, 3000, false)
	for _, id := range []string{"A", "B", "C"} {
		if got[id] < 700 {
			t.Errorf("ties: %s got %d of 3000; want each >= 700 (%v)", id, got[id], got)
		}
	}
}

// TestLeastConnTiesEven: backends tied for the fewest in flight share the picks
// alike, whatever lies before them in the list. With A holding a connection, B and
// C (and D) tie at none; a scan from a random offset alone gave B, after the busy
// A, twice the picks of each of the others (every scan that starts at A finds B
// first). With D ramping (slow start) the scan takes its float path, where D's cost
// puts it out of the running at idle, and B won three picks in four.
func TestLeastConnTiesEven(t *testing.T) {
	for _, alg := range []string{LeastConn, WeightedLeastConn} {
		for _, ramp := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/ramp=%v", alg, ramp), func(t *testing.T) {
				c := &clock{}
				bs := abc(1, 1, 1, 1)
				bs[3].SlowStart = 10 * time.Second
				bs[3].Usable = !ramp
				b := mustNewClock(t, alg, bs, 9, c)
				if ramp {
					bs[3].Usable = true
					b.SetBackends(bs) // D ramps from the floor
				}
				held, err := b.Pick(0, func(id string) bool { return id != "A" })
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { held.Release(Result{}) })
				const n = 30000
				got := counts(t, b, n, false)
				tied := []string{"B", "C"}
				if !ramp {
					tied = append(tied, "D")
				}
				want := float64(n) / float64(len(tied))
				for _, id := range tied {
					if r := float64(got[id]) / want; r < 0.9 || r > 1.1 {
						t.Errorf("picks %v: %s has %.2f× its share of the ties; want about 1", got, id, r)
					}
				}
			})
		}
	}
}

func TestWeightedLeastConn(t *testing.T) {
	b := mustNew(t, WeightedLeastConn, abc(3, 1), 5)
	got := counts(t, b, 400, true)
	if got["A"] != 300 || got["B"] != 100 {
		t.Errorf("held picks: got %v; want A 300, B 100", got)
	}
}

// TestRandomUniform: with a fixed seed, random's counts stay within 5 standard deviations
// of uniform.
func TestRandomUniform(t *testing.T) {
	const n, picks = 10, 100000
	b := mustNew(t, Random, backendsN(n, one), 11)
	got := counts(t, b, picks, false)
	mean := float64(picks) / n
	sd := math.Sqrt(picks * (1.0 / n) * (1 - 1.0/n))
	for id, c := range got {
		if math.Abs(float64(c)-mean) > 5*sd {
			t.Errorf("%s: %d picks; want %.0f ± %.0f", id, c, mean, 5*sd)
		}
	}
	if len(got) != n {
		t.Errorf("got %d backends picked; want %d", len(got), n)
	}
}

// TestSeeded: the same seed gives the same sequence of random choices.
func TestSeeded(t *testing.T) {
	for _, alg := range []string{Random, P2C, LeastConn, EWMA} {
		a := picks(t, mustNew(t, alg, backendsN(20, one), 99), 50)
		b := picks(t, mustNew(t, alg, backendsN(20, one), 99), 50)
		if a != b {
			t.Errorf("%s: two balancers with seed 99 differ; want the same picks", alg)
		}
	}
}

func TestP2C(t *testing.T) {
	// Two backends: the candidates are always both, so the less loaded always wins.
	b := mustNew(t, P2C, abc(1, 1), 3)
	hold := make([]Lease, 0, 10)
	for range 10 {
		l, err := b.Pick(0, nil)
		if err != nil {
			t.Fatal(err)
		}
		hold = append(hold, l)
	}
	if a, bb := b.InFlight("A"), b.InFlight("B"); a != 5 || bb != 5 {
		t.Errorf("in flight A %d, B %d; want 5 and 5", a, bb)
	}
	for i := range hold {
		hold[i].Release(Result{})
	}
	// Many backends, held: the maximum load stays close to the mean (the power of two
	// choices), where uniform random would spread much wider.
	const n, k = 100, 2000
	b = mustNew(t, P2C, backendsN(n, one), 3)
	got := counts(t, b, k, true)
	worst := 0
	for _, c := range got {
		worst = max(worst, c)
	}
	if worst > k/n+3 {
		t.Errorf("max load %d; want <= mean %d + 3", worst, k/n)
	}
}

// TestP2CCandidatesDistinct: the P2C family's two candidates are two backends,
// never one drawn twice, for any number of usable backends from two on and with
// some skipped; skip is asked about each candidate drawn, so it sees them.
func TestP2CCandidatesDistinct(t *testing.T) {
	for _, alg := range []string{P2C, EWMA, LeastTime} {
		for n := 2; n <= 6; n++ {
			bs := backendsN(n, one)
			b := mustNew(t, alg, bs, uint64(n))
			for i := range 5000 {
				var asked []string
				skipped := ""
				if n > 2 && i%2 == 1 {
					skipped = bs[i%n].ID // one skipped, two or more left
				}
				l, err := b.Pick(0, func(id string) bool {
					if id == skipped {
						return true
					}
					asked = append(asked, id)
					return false
				})
				if err != nil {
					t.Fatal(err)
				}
				l.Release(Result{Latency: time.Millisecond})
				if len(asked) != 2 || asked[0] == asked[1] {
					t.Fatalf("%s, %d backends, pick %d: candidates %v; want two distinct", alg, n, i, asked)
				}
			}
		}
	}
}

// TestEWMA: a backend that answers slowly loses its share at once (peak), and gets
// tried again after it has been left alone (decay toward the neutral estimate).
func TestEWMA(t *testing.T) {
	c := &clock{}
	b := mustNewClock(t, EWMA, abc(1, 1, 1), 7, c)
	// serve runs n connections, conc at a time, each taking 1ms of clock.
	serve := func(n, conc int, latency map[string]time.Duration) map[string]int {
		got := map[string]int{}
		open := make([]Lease, conc)
		for i := range n {
			l, err := b.Pick(0, nil)
			if err != nil {
				t.Fatal(err)
			}
			got[l.Backend()]++
			open[i%conc] = l
			if i%conc == conc-1 {
				c.advance(time.Millisecond)
				for j := range open {
					open[j].Release(Result{Latency: latency[open[j].Backend()]})
				}
			}
		}
		return got
	}
	fast := map[string]time.Duration{"A": time.Millisecond, "B": time.Millisecond, "C": time.Millisecond}
	got := serve(300, 1, fast)
	for _, id := range []string{"A", "B", "C"} {
		if got[id] < 60 {
			t.Errorf("all fast: %s got %d of 300; want >= 60", id, got[id])
		}
	}
	slow := map[string]time.Duration{"A": time.Millisecond, "B": time.Millisecond, "C": 50 * time.Millisecond}
	got = serve(300, 1, slow)
	if got["C"] > 3 {
		t.Errorf("C 50x slower: got %d of 300 picks; want <= 3 (one slow answer is enough)", got["C"])
	}
	// Nobody picks C now; after many decay times its estimate is back at the average,
	// so it wins as soon as the others have a connection open.
	c.advance(10 * ewmaDecay)
	got = serve(300, 3, fast)
	if got["C"] < 30 {
		t.Errorf("after a long quiet: C got %d of 300; want >= 30", got["C"])
	}
}

// TestEWMADecayCurve: an estimate left alone decays toward the balancer-wide
// average with the documented time constant τ = 10 s: after t its excess over the
// average is e^(-t/τ) of what it was (a 37 % remains after 10 s, 14 % after 20 s;
// a half-life of τ ln 2, about 6.9 s).
func TestEWMADecayCurve(t *testing.T) {
	for _, alg := range []string{EWMA, LeastTime} {
		c := &clock{}
		b := mustNewClock(t, alg, abc(1, 1), 3, c)
		// A answers in 1 ms, then B in 101 ms at the same instant: the average, which
		// decays by time too, is still A's 1 ms.
		for _, id := range []string{"A", "B"} {
			l, err := b.Pick(0, func(x string) bool { return x != id })
			if err != nil {
				t.Fatal(err)
			}
			lat := time.Millisecond
			if id == "B" {
				lat = 101 * time.Millisecond
			}
			l.Release(Result{Latency: lat})
		}
		var elapsed time.Duration
		for _, at := range []time.Duration{0, 6931 * time.Millisecond, 10 * time.Second, 20 * time.Second} {
			c.advance(at - elapsed)
			elapsed = at
			est, seen := b.Estimate("B")
			want := time.Millisecond + time.Duration(float64(100*time.Millisecond)*math.Exp(-at.Seconds()/10))
			if !seen || math.Abs(float64(est-want)) > float64(10*time.Microsecond) {
				t.Errorf("%s: B's estimate %v after its one 101 ms sample: %v; want %v", alg, at, est, want)
			}
		}
	}
}

// TestSlowOnceTriedAgain: at light load, where every connection finds every backend
// idle, a backend whose first answer was slow is tried again and its estimate comes
// back once it is fast, while one that stays slow is held to a probe per ewmaDecay.
func TestSlowOnceTriedAgain(t *testing.T) {
	for _, alg := range []string{EWMA, LeastTime} {
		for _, tc := range []struct {
			name     string
			slowA    func(i int) bool // whether A's ith answer takes 50 ms
			from, to time.Duration    // the part of the run judged
			minConns int              // A's connections in it at least
			maxShare float64          // and at most this share of them
			est      [2]time.Duration // A's estimate at the end
		}{
			{"slow once", func(i int) bool { return i == 0 }, 12 * time.Second, 30 * time.Second, 10, 1,
				[2]time.Duration{800 * time.Microsecond, 1500 * time.Microsecond}},
			{"slow always", func(int) bool { return true }, 0, 60 * time.Second, 0, 0.01,
				[2]time.Duration{10 * time.Millisecond, 50 * time.Millisecond}},
		} {
			t.Run(alg+"/"+tc.name, func(t *testing.T) {
				c := &clock{}
				b := mustNewClock(t, alg, abc(1, 1, 1), 7, c)
				jitter := splitmix(3)
				answersA, judged, toA := 0, 0, 0
				// 100 connections/s, one at a time, each answered in 0.8 to 1.2 ms
				// unless it is A's and slow.
				for at := time.Duration(0); at < tc.to; at += 10 * time.Millisecond {
					l, err := b.Pick(0, nil)
					if err != nil {
						t.Fatal(err)
					}
					latency := time.Duration(800+jitter.intn(400)) * time.Microsecond
					if l.Backend() == "A" {
						if tc.slowA(answersA) {
							latency = 50 * time.Millisecond
						}
						answersA++
					}
					if at >= tc.from {
						judged++
						if l.Backend() == "A" {
							toA++
						}
					}
					c.advance(10 * time.Millisecond)
					l.Release(Result{Latency: latency})
				}
				if share := float64(toA) / float64(judged); toA < tc.minConns || share > tc.maxShare {
					t.Errorf("A got %d of %d connections from %v to %v (%.3f); want at least %d, a share of at most %.2f",
						toA, judged, tc.from, tc.to, share, tc.minConns, tc.maxShare)
				}
				if est, _ := b.Estimate("A"); est < tc.est[0] || est > tc.est[1] {
					t.Errorf("A's estimate at %v: %v; want %v to %v", tc.to, est, tc.est[0], tc.est[1])
				}
			})
		}
	}
}

// TestUntriedBackendTried: one connection at a time, the first to a backend that
// answers in 50 ms (a little faster each time, as a backend warming up does), the
// others to whichever the balancer picks, which answers in 1 ms. The untried one's
// estimate is the balancer-wide average, which then is the slow one's own give or
// take a rounding; it must still get its connection and, with its first sample,
// all but a few of the rest, whatever those roundings say.
func TestUntriedBackendTried(t *testing.T) {
	for _, alg := range []string{EWMA, LeastTime} {
		for seed := uint64(1); seed <= 8; seed++ {
			c := &clock{}
			b := mustNewClock(t, alg, abc(1, 1), seed, c)
			slow := ""
			got := map[string]int{}
			for i := range 100 {
				l, err := b.Pick(0, nil)
				if err != nil {
					t.Fatal(err)
				}
				if slow == "" {
					slow = l.Backend()
				}
				got[l.Backend()]++
				latency := time.Millisecond
				if l.Backend() == slow {
					latency = 50*time.Millisecond - time.Duration(i)*10*time.Microsecond
				}
				c.advance(latency)
				l.Release(Result{Latency: latency})
			}
			if got[slow] > 3 {
				t.Errorf("%s, seed %d: the slow backend got %d of 100 connections (%v); want at most 3", alg, seed, got[slow], got)
			}
		}
	}
}

// TestUntriedWinsOncePerDecay: a backend whose connections never bring a sample
// (one whose clients give up before it answers, say) stays untried; its win for
// being untried comes once per ewmaDecay, not in every draw it is in while nothing
// is in flight. With A answering in 1 ms and C in 50 ms, B's estimate (the average)
// loses to A's and beats C's, so B should get about the draws it shares with C, a
// third; winning every draw it is in would give it two thirds.
func TestUntriedWinsOncePerDecay(t *testing.T) {
	for _, alg := range []string{EWMA, LeastTime} {
		c := &clock{}
		b := mustNewClock(t, alg, abc(1, 1, 1), 7, c)
		got := map[string]int{}
		for range 600 {
			l, err := b.Pick(0, nil)
			if err != nil {
				t.Fatal(err)
			}
			got[l.Backend()]++
			c.advance(10 * time.Millisecond)
			switch l.Backend() {
			case "A":
				l.Release(Result{Latency: time.Millisecond})
			case "B":
				l.Release(Result{}) // no sample
			default:
				l.Release(Result{Latency: 50 * time.Millisecond})
			}
		}
		if got["B"] > 300 {
			t.Errorf("%s: the backend that never brings a sample got %d of 600 connections (%v); want about a third", alg, got["B"], got)
		}
	}
}

// TestEWMAFailure: failed connects count as slow, so a quickly refusing backend doesn't
// attract traffic.
func TestEWMAFailure(t *testing.T) {
	c := &clock{}
	b := mustNewClock(t, EWMA, abc(1, 1), 7, c)
	got := map[string]int{}
	pickBFailing(t, b, c, 200, got)
	if got["B"] > 5 {
		t.Errorf("B fails every connect: got %d of 200 picks; want <= 5", got["B"])
	}
}

// pickBFailing picks n times, one at a time, counting the picks in got: B's
// connects fail in 10 µs, the others answer in 1 ms.
func pickBFailing(t *testing.T, b Balancer, c *clock, n int, got map[string]int) {
	t.Helper()
	for range n {
		l, err := b.Pick(0, nil)
		if err != nil {
			t.Fatal(err)
		}
		got[l.Backend()]++
		c.advance(time.Millisecond)
		if l.Backend() == "B" {
			l.Release(Result{Failed: true, Latency: 10 * time.Microsecond})
		} else {
			l.Release(Result{Latency: time.Millisecond})
		}
	}
}

// TestReturnedBackendStartsOver: a backend that failed its connects until it
// was taken out (its health checks failed) and comes back a few seconds later,
// answering as fast as the others, gets its share from its return on. The
// estimate its failures left (five times the others') would otherwise have kept
// it out, at one connection at a time, until ewmaDecay after its last sample.
func TestReturnedBackendStartsOver(t *testing.T) {
	for _, alg := range []string{EWMA, LeastTime} {
		for seed := uint64(1); seed <= 4; seed++ {
			c := &clock{}
			bs := abc(1, 1, 1)
			b := mustNewClock(t, alg, bs, seed, c)
			answer := func(n int, got map[string]int, skip func(string) bool, r Result) {
				for range n {
					l, err := b.Pick(0, skip)
					if err != nil {
						t.Fatal(err)
					}
					if got != nil {
						got[l.Backend()]++
					}
					c.advance(10 * time.Millisecond)
					l.Release(r)
				}
			}
			answer(300, nil, nil, Result{Latency: time.Millisecond})
			answer(20, nil, func(id string) bool { return id != "C" }, Result{Failed: true, Latency: time.Millisecond})
			downFor(b, bs, 2, c, 3*time.Second)
			got := map[string]int{}
			answer(300, got, nil, Result{Latency: time.Millisecond})
			if got["C"] < 60 {
				t.Errorf("%s, seed %d: back after failing, C got %d of the next 300 connections (%v); want about a third", alg, seed, got["C"], got)
			}
		}
	}
}

// TestReturnedBackendWinsUntried: a backend that comes back starts over as a new
// one, and a new one wins the first draw it is in with nothing in flight, even
// when it won one as a new backend a few seconds before. Here C joins, wins its
// first draw, answers slowly once, goes down and is back two seconds later: its
// estimate is the balancer-wide average, a hair above A's and B's, so at light
// load it wins no draw on cost, and with its earlier win still counted it got no
// connection until ewmaDecay after it.
func TestReturnedBackendWinsUntried(t *testing.T) {
	for _, alg := range []string{EWMA, LeastTime} {
		for seed := uint64(1); seed <= 4; seed++ {
			c := &clock{}
			bs := abc(1, 1, 1)
			bs[2].Usable = false
			b := mustNewClock(t, alg, bs, seed, c)
			answer := func(n int, got map[string]int, r func(id string) Result) {
				for range n {
					l, err := b.Pick(0, nil)
					if err != nil {
						t.Fatal(err)
					}
					got[l.Backend()]++
					c.advance(10 * time.Millisecond)
					l.Release(r(l.Backend()))
				}
			}
			fast := func(string) Result { return Result{Latency: time.Millisecond} }
			answer(100, map[string]int{}, fast)
			bs[2].Usable = true // C joins
			b.SetBackends(bs)
			first := map[string]int{}
			answer(20, first, func(id string) Result {
				if id == "C" {
					return Result{Latency: 50 * time.Millisecond}
				}
				return fast(id)
			})
			if first["C"] != 1 {
				t.Fatalf("%s, seed %d: C new, got %d of 20 connections (%v); want its one win", alg, seed, first["C"], first)
			}
			downFor(b, bs, 2, c, 2*time.Second)
			got := map[string]int{}
			answer(50, got, fast)
			if got["C"] == 0 {
				t.Errorf("%s, seed %d: C back, got none of 50 connections (%v); want a first one", alg, seed, got)
			}
		}
	}
}

// TestReturnedBackendIgnoresOldLeases: a connection picked before a backend went
// down that ends after it is back (a request that hung until its timeout, say)
// tells nothing of the backend as it is now: its outcome leaves the fresh start
// alone. Recorded, its failure was the new estimate's first sample, five times
// the average, the very estimate starting over drops.
func TestReturnedBackendIgnoresOldLeases(t *testing.T) {
	for _, alg := range []string{EWMA, LeastTime} {
		c := &clock{}
		bs := abc(1, 1, 1)
		b := mustNewClock(t, alg, bs, 5, c)
		for _, id := range []string{"A", "B"} {
			l, err := b.Pick(0, func(x string) bool { return x != id })
			if err != nil {
				t.Fatal(err)
			}
			c.advance(time.Millisecond)
			l.Release(Result{Latency: time.Millisecond})
		}
		old, err := b.Pick(0, func(id string) bool { return id != "C" })
		if err != nil {
			t.Fatal(err)
		}
		downFor(b, bs, 2, c, 2*time.Second)
		c.advance(time.Second)
		old.Release(Result{Failed: true, Latency: 3 * time.Second})
		if est, seen := b.Estimate("C"); seen {
			t.Errorf("%s: C back, a connection from before it went down failed: estimate %v; want none", alg, est)
		}
		if n := b.InFlight("C"); n != 0 {
			t.Errorf("%s: C in flight %d after its one lease ended; want 0", alg, n)
		}
		l, err := b.Pick(0, func(id string) bool { return id != "C" })
		if err != nil {
			t.Fatal(err)
		}
		l.Release(Result{Latency: 2 * time.Millisecond})
		if est, seen := b.Estimate("C"); !seen || est != 2*time.Millisecond {
			t.Errorf("%s: C answered in 2 ms after its return: estimate %v, %v; want 2ms, true", alg, est, seen)
		}
	}
}

// downFor takes bs[i] out of b's usable set for d on c, and back.
func downFor(b Balancer, bs []Backend, i int, c *clock, d time.Duration) {
	bs[i].Usable = false
	b.SetBackends(bs)
	c.advance(d)
	bs[i].Usable = true
	b.SetBackends(bs)
}

// TestFailureBeforeAnySample: a backend that fails its connects before any backend
// has answered still pays the failure penalty, so it gets a small share, not the one
// a fast answer would earn; the first answers come only after B's failures.
func TestFailureBeforeAnySample(t *testing.T) {
	for _, alg := range []string{EWMA, LeastTime} {
		for seed := uint64(1); seed <= 8; seed++ {
			c := &clock{}
			b := mustNewClock(t, alg, abc(1, 1), seed, c)
			// Held: the first connections are all in flight before any answers, so
			// B's quick failures come before A's first sample.
			var held []Lease
			got := map[string]int{}
			for range 4 {
				l, err := b.Pick(0, nil)
				if err != nil {
					t.Fatal(err)
				}
				got[l.Backend()]++
				if l.Backend() == "B" {
					c.advance(10 * time.Microsecond)
					l.Release(Result{Failed: true, Latency: 10 * time.Microsecond})
				} else {
					held = append(held, l)
				}
			}
			c.advance(time.Millisecond)
			for _, l := range held {
				l.Release(Result{Latency: time.Millisecond})
			}
			pickBFailing(t, b, c, 200, got)
			if got["B"] > 10 {
				t.Errorf("%s, seed %d: B fails every connect from the first: got %d of 204 picks (%v); want <= 10", alg, seed, got["B"], got)
			}
		}
	}
}

// TestSlowStart: a backend that becomes usable starts near slowStartFloor of its share
// and reaches its full share when the window ends; the initial set is not ramped.
func TestSlowStart(t *testing.T) {
	for _, alg := range []string{RoundRobin, Random, LeastConn, WeightedLeastConn, Weighted, P2C, EWMA} {
		t.Run(alg, func(t *testing.T) {
			c := &clock{}
			bs := abc(1, 1, 1, 1)
			for i := range bs {
				bs[i].SlowStart = 10 * time.Second
			}
			bs[3].Usable = false
			b := mustNewClock(t, alg, bs, 1, c)
			if got := counts(t, b, 300, false); got["A"] < 80 {
				t.Errorf("initial set: A got %d of 300; want full share (no ramp at start)", got["A"])
			}
			bs[3].Usable = true
			b.SetBackends(bs)
			share := func() float64 {
				// Held picks for the least-loaded algorithms, so load, not ties, decides.
				hold := alg == LeastConn || alg == WeightedLeastConn || alg == P2C || alg == EWMA
				got := counts(t, b, 4000, hold)
				return float64(got["D"]) / 4000
			}
			early := share()
			c.advance(5 * time.Second)
			mid := share()
			c.advance(6 * time.Second)
			full := share()
			t.Logf("D's share at 0s %.3f, 5s %.3f, 11s %.3f", early, mid, full)
			if early > 0.1 {
				t.Errorf("D's share at the start = %.3f; want <= 0.1", early)
			}
			if mid <= early || mid >= full {
				t.Errorf("D's share mid-ramp = %.3f; want between %.3f and %.3f", mid, early, full)
			}
			if full < 0.2 {
				t.Errorf("D's share after the window = %.3f; want about 0.25", full)
			}
		})
	}
}

// TestLeaseRelease: release is idempotent on the same variable, a zero lease is a no-op,
// and a removed backend's lease releases safely.
func TestLeaseRelease(t *testing.T) {
	for _, alg := range Algorithms() {
		t.Run(alg, func(t *testing.T) {
			b := mustNew(t, alg, abc(1), 0)
			var zero Lease
			zero.Release(Result{})
			if zero.Backend() != "" {
				t.Errorf("zero lease Backend() = %q; want \"\"", zero.Backend())
			}
			l1, err := b.Pick(1, nil)
			if err != nil {
				t.Fatal(err)
			}
			l2, _ := b.Pick(2, nil)
			if got := b.InFlight("A"); got != 2 {
				t.Errorf("InFlight = %d; want 2", got)
			}
			l1.Release(Result{})
			l1.Release(Result{})
			if got := b.InFlight("A"); got != 1 {
				t.Errorf("after releasing one lease twice InFlight = %d; want 1", got)
			}
			if l1.Backend() != "" {
				t.Errorf("released lease Backend() = %q; want \"\"", l1.Backend())
			}
			// Remove A while l2 is open: it still counts, and re-adding keeps the count.
			b.SetBackends(abc())
			if got := b.InFlight("A"); got != 1 {
				t.Errorf("removed with one open: InFlight = %d; want 1", got)
			}
			b.SetBackends(abc(1))
			if got := b.InFlight("A"); got != 1 {
				t.Errorf("re-added: InFlight = %d; want 1", got)
			}
			l2.Release(Result{Latency: time.Millisecond})
			if got := b.InFlight("A"); got != 0 {
				t.Errorf("all released: InFlight = %d; want 0", got)
			}
			if got := b.InFlight("nobody"); got != 0 {
				t.Errorf("InFlight(unknown) = %d; want 0", got)
			}
		})
	}
}

// TestMaglevPick: maglev and source_hash send a key to the same backend every time, on
// every node with the same seed, and a removal moves the removed backend's keys and
// hardly any other (Maglev's disruption at N = 10 is about 1.03 × the minimum).
func TestMaglevPick(t *testing.T) {
	bs := backendsN(10, one)
	a := mustNew(t, Maglev, bs, 5)
	rev := make([]Backend, len(bs))
	for i := range bs {
		rev[len(bs)-1-i] = bs[i]
	}
	b := mustNew(t, Maglev, rev, 5)
	before := map[uint64]string{}
	for k := range uint64(2000) {
		la, _ := a.Pick(k, nil)
		lb, _ := b.Pick(k, nil)
		if la.Backend() != lb.Backend() {
			t.Fatalf("key %d: node 1 picked %s, node 2 %s; want the same", k, la.Backend(), lb.Backend())
		}
		before[k] = la.Backend()
		la.Release(Result{})
		lb.Release(Result{})
	}
	gone := bs[4].ID
	bs[4].Usable = false
	a.SetBackends(bs)
	moved, others := 0, 0
	for k, was := range before {
		l, _ := a.Pick(k, nil)
		if l.Backend() == gone {
			t.Fatalf("key %d still goes to removed %s", k, gone)
		}
		if l.Backend() != was {
			moved++
			if was != gone {
				others++
			}
		}
		l.Release(Result{})
	}
	if moved == 0 {
		t.Errorf("no key moved; want the down backend's keys to move")
	}
	// Down, its slots are spilled over the table with it: no other key moves.
	if others != 0 {
		t.Errorf("%d of %d keys of staying backends moved when %s went down; want 0", others, len(before), gone)
	}
	// Removed from the set, the table is rebuilt: Maglev moves a few more.
	a.SetBackends(slices.Delete(slices.Clone(bs), 4, 5))
	others = 0
	for k, was := range before {
		l, _ := a.Pick(k, nil)
		if l.Backend() != was && was != gone {
			others++
		}
		l.Release(Result{})
	}
	if others > len(before)/50 {
		t.Errorf("%d of %d keys of staying backends moved when %s was removed; want <= 2%%", others, len(before), gone)
	}
}

// TestMaglevBalancerRamp: the maglev balancer builds its table with each backend's
// Ramp, as the XDP loader does: a backend at a tenth holds about a tenth of its share
// of the keys, and the others' keys stay where the full table has them.
func TestMaglevBalancerRamp(t *testing.T) {
	bs := backendsN(3, one)
	full := mustNew(t, Maglev, bs, 9)
	bs[2].Ramp = RampFull / 10
	ramped := mustNew(t, Maglev, bs, 9)
	const keys = 20000
	held, others := 0, 0
	for k := range uint64(keys) {
		a, _ := full.Pick(k, nil)
		b, _ := ramped.Pick(k, nil)
		if b.Backend() == bs[2].ID {
			held++
		}
		if a.Backend() != bs[2].ID && b.Backend() != a.Backend() {
			others++
		}
		a.Release(Result{})
		b.Release(Result{})
	}
	if got, want := float64(held)/keys, 0.1/2.1; math.Abs(got-want) > 0.01 {
		t.Errorf("the ramping backend holds %.3f of the keys; want %.3f", got, want)
	}
	if others != 0 {
		t.Errorf("%d keys of the other backends moved; want 0", others)
	}
}

// TestLeastTime: least_time averages its samples (no peak), so one slow answer
// does not exclude a backend, but a steadily slower one loses most of its share,
// and Estimate reports the averages Pick uses.
func TestLeastTime(t *testing.T) {
	c := &clock{}
	b := mustNewClock(t, LeastTime, abc(1, 1, 1), 7, c)
	latency := map[string]time.Duration{"A": time.Millisecond, "B": time.Millisecond, "C": 20 * time.Millisecond}
	got := map[string]int{}
	for i := range 600 {
		l, err := b.Pick(0, nil)
		if err != nil {
			t.Fatal(err)
		}
		if i >= 300 {
			got[l.Backend()]++
		}
		c.advance(time.Millisecond)
		l.Release(Result{Latency: latency[l.Backend()]})
	}
	if got["C"] > 30 {
		t.Errorf("C 20x slower: got %d of the last 300 picks; want <= 30", got["C"])
	}
	if got["A"] < 100 || got["B"] < 100 {
		t.Errorf("A and B equally fast: got %v; want >= 100 each", got)
	}
	for id, want := range map[string][2]time.Duration{"A": {500 * time.Microsecond, 3 * time.Millisecond}, "C": {5 * time.Millisecond, 21 * time.Millisecond}} {
		est, ok := b.Estimate(id)
		if !ok || est < want[0] || est > want[1] {
			t.Errorf("Estimate(%s): got %v, %v; want %v..%v, true", id, est, ok, want[0], want[1])
		}
	}
	// One slow answer from A moves its average a little, not to the sample.
	l, _ := b.Pick(0, func(id string) bool { return id != "A" })
	l.Release(Result{Latency: 100 * time.Millisecond})
	if est, _ := b.Estimate("A"); est > 10*time.Millisecond {
		t.Errorf("A after one 100ms answer: estimate %v; want an average well below the sample", est)
	}
	rr := mustNew(t, RoundRobin, abc(1, 1), 0)
	if _, ok := rr.Estimate("A"); ok {
		t.Errorf("round_robin Estimate: got ok; want false (it keeps no latency)")
	}
}

// Under round_robin, a turn a backend gives up (refused while it ramps, or
// skipped at a limit) goes on with the cycle, so the backends that take it
// share it alike; before, the next one in the list took all of them.
func TestRoundRobinGivenUpTurnsShared(t *testing.T) {
	for _, tc := range []struct {
		name string
		skip func(id string) bool
	}{
		{"B ramping", nil},
		{"B at its limit", func(id string) bool { return id == "B" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clock{}
			bs := abc(1, 1, 1, 1)
			for i := range bs {
				bs[i].SlowStart = 10 * time.Second
			}
			bs[1].Usable = false
			b := mustNewClock(t, RoundRobin, bs, 1, c)
			if tc.skip == nil {
				bs[1].Usable = true // back: B ramps from slowStartFloor
			}
			b.SetBackends(bs)
			got := map[string]int{}
			for range 40000 {
				l, err := b.Pick(0, tc.skip)
				if err != nil {
					t.Fatal(err)
				}
				got[l.Backend()]++
				l.Release(Result{})
			}
			for _, id := range []string{"A", "D"} {
				if r := float64(got["C"]) / float64(got[id]); r > 1.1 || r < 0.9 {
					t.Errorf("picks %v: C, after B in the list, has %.2f× %s's; want them alike", got, r, id)
				}
			}
		})
	}
}

// TestSlowStartShareExact: a backend ramping at factor f among n-1 at full weight
// gets f ÷ (n-1+f) of the picks, its weight's share at weight × f, as the tables
// ramp it too; with few backends a draw refused several times in a row is common
// (at n = 2, f = 0.1, 0.45 a draw), and random's answer to it must not favour the
// ramping backend.
func TestSlowStartShareExact(t *testing.T) {
	const draws = 100000
	for _, alg := range []string{Random, RoundRobin, Weighted} {
		for _, n := range []int{2, 3, 5} {
			for _, at := range []time.Duration{0, 3 * time.Second} {
				c := &clock{}
				bs := backendsN(n, one)
				last := &bs[n-1]
				last.SlowStart = 10 * time.Second
				last.Usable = false
				b := mustNewClock(t, alg, bs, 5, c)
				last.Usable = true
				b.SetBackends(bs)
				c.advance(at)
				got := counts(t, b, draws, false)
				f := SlowStartFactor(at, last.SlowStart)
				want := f / (float64(n-1) + f)
				sd := math.Sqrt(want * (1 - want) / draws)
				if share := float64(got[last.ID]) / draws; math.Abs(share-want) > 5*sd {
					t.Errorf("%s, %d backends, %v into the ramp: ramping share %.4f; want %.4f ± %.4f", alg, n, at, share, want, 5*sd)
				}
			}
		}
	}
}

// random under slow start, with a skip that refuses more as picks go on (a
// limit other connections reach meanwhile), leases a backend it drew or
// answers ErrNoBackend; it never indexes past its set.
func TestRandomSlowStartLiveSkip(t *testing.T) {
	for seed := uint64(1); seed <= 50; seed++ {
		c := &clock{}
		bs := abc(1, 1)
		bs[1].SlowStart = 10 * time.Second
		bs[1].Usable = false
		b := mustNewClock(t, Random, bs, seed, c)
		bs[1].Usable = true
		b.SetBackends(bs) // B ramps from slowStartFloor
		asked := 0
		skip := func(id string) bool {
			if id == "A" {
				return true // at its limit
			}
			asked++
			return asked > 4 // B reaches its limit after four draws
		}
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("seed %d: Pick panicked: %v", seed, r)
				}
			}()
			l, err := b.Pick(0, skip)
			if err == nil {
				if l.Backend() != "B" {
					t.Errorf("seed %d: leased %s, which skip refused throughout", seed, l.Backend())
				}
				l.Release(Result{})
			}
		}()
	}
}
