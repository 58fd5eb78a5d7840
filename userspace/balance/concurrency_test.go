package balance

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
)

// randomSet returns a random backend set drawn from a pool of ids, with random weights,
// usable flags and slow start windows.
func randomSet(r *rand.Rand, ids []string) []Backend {
	var bs []Backend
	for _, id := range ids {
		if r.IntN(4) == 0 {
			continue // absent from this set
		}
		bs = append(bs, Backend{
			ID:        id,
			Weight:    uint32(r.IntN(4)), // 0 sometimes
			Usable:    r.IntN(5) != 0,
			SlowStart: time.Duration(r.IntN(2)) * time.Millisecond,
		})
	}
	return bs
}

// TestInFlightProperty: after any interleaving of picks, releases (some twice, some of
// zero leases) and backend set changes, the in-flight counts always equal the open
// leases per backend, and return to zero when every lease is released.
func TestInFlightProperty(t *testing.T) {
	ids := []string{"a", "b", "c", "d", "e", "f"}
	// Few seeds: every set change under maglev/source_hash rebuilds a 65537-slot table.
	seeds := 10
	if testing.Short() {
		seeds = 3
	}
	for _, alg := range Algorithms() {
		for seed := range uint64(seeds) {
			r := rand.New(rand.NewPCG(seed, 77))
			b := mustNew(t, alg, randomSet(r, ids), seed+1)
			var open []Lease
			for step := range 1000 {
				switch op := r.IntN(20); {
				case op < 10:
					skip := func(id string) bool { return id == ids[step%len(ids)] }
					l, err := b.Pick(r.Uint64(), skip)
					if err != nil && !errors.Is(err, ErrNoBackend) {
						t.Fatalf("%s seed %d: pick: %v", alg, seed, err)
					}
					open = append(open, l) // a zero lease on error: releasing it is a no-op
				case op < 19 && len(open) > 0:
					i := r.IntN(len(open))
					open[i].Release(Result{Failed: r.IntN(8) == 0, Latency: time.Duration(r.IntN(1000))})
					if r.IntN(3) == 0 {
						open[i].Release(Result{}) // twice on the same variable: no-op
					}
					open[i] = open[len(open)-1]
					open = open[:len(open)-1]
				default:
					b.SetBackends(randomSet(r, ids))
				}
				if step%100 == 0 {
					checkCounts(t, b, ids, open, fmt.Sprintf("%s seed %d step %d", alg, seed, step))
				}
			}
			for i := range open {
				open[i].Release(Result{})
			}
			for _, id := range ids {
				if n := b.InFlight(id); n != 0 {
					t.Errorf("%s seed %d: all released but InFlight(%s) = %d; want 0", alg, seed, id, n)
				}
			}
		}
	}
}

func checkCounts(t *testing.T, b Balancer, ids []string, open []Lease, where string) {
	t.Helper()
	want := map[string]int{}
	for i := range open {
		want[open[i].Backend()]++
	}
	for _, id := range ids {
		if got := b.InFlight(id); got != want[id] {
			t.Fatalf("%s: InFlight(%s) = %d; want %d open leases", where, id, got, want[id])
		}
	}
}

// TestConcurrent runs many goroutines picking and releasing while another keeps
// replacing the backend set; run it with -race. Counts must end at zero.
func TestConcurrent(t *testing.T) {
	ids := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	const workers = 16
	iters := 3000
	if testing.Short() {
		iters = 300
	}
	for _, alg := range Algorithms() {
		t.Run(alg, func(t *testing.T) {
			b := mustNew(t, alg, randomSet(rand.New(rand.NewPCG(1, 1)), ids), 0)
			stop := make(chan struct{})
			var churn sync.WaitGroup
			churn.Add(1)
			// Replaces the set until the workers are done (stop is closed).
			go func() {
				defer churn.Done()
				r := rand.New(rand.NewPCG(2, 2))
				for {
					select {
					case <-stop:
						return
					default:
					}
					b.SetBackends(randomSet(r, ids))
					_ = b.InFlight(ids[r.IntN(len(ids))])
				}
			}()
			var wg sync.WaitGroup
			for w := range workers {
				wg.Add(1)
				// Picks and releases iters times, then exits.
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(w), 3))
					var held []Lease
					for i := range iters {
						l, err := b.Pick(r.Uint64(), func(id string) bool { return id == ids[i%len(ids)] })
						if err != nil && !errors.Is(err, ErrNoBackend) {
							t.Errorf("pick: %v", err)
							return
						}
						held = append(held, l)
						if len(held) > 4 || r.IntN(2) == 0 {
							k := r.IntN(len(held))
							held[k].Release(Result{Latency: time.Duration(1 + r.IntN(1000))})
							held[k] = held[len(held)-1]
							held = held[:len(held)-1]
						}
					}
					for k := range held {
						held[k].Release(Result{})
					}
				}()
			}
			wg.Wait()
			close(stop)
			churn.Wait()
			for _, id := range ids {
				if n := b.InFlight(id); n != 0 {
					t.Errorf("InFlight(%s) = %d after every lease was released; want 0", id, n)
				}
			}
		})
	}
}

// TestPickNeverLeasesForgotten: a Pick that chose from a snapshot older than a
// SetBackends which removed that backend, while nothing was in flight on it, and
// so forgot it, does not lease the forgotten backend: it picks again. Its lease
// was taken on an object the balancer no longer knew, so a backend added back
// under the same ID started from 0 and InFlight missed the connection. Workers
// pick (yielding in skip, between the snapshot and the lease) and hold every
// lease while backends are removed and added back; then InFlight must count
// every lease held.
func TestPickNeverLeasesForgotten(t *testing.T) {
	ids := []string{"a", "b", "c", "d"}
	full := make([]Backend, len(ids))
	for i, id := range ids {
		full[i] = Backend{ID: id, Weight: 1, Usable: true}
	}
	const workers, picks = 8, 200
	rounds := 20
	if testing.Short() {
		rounds = 5
	}
	for _, alg := range Algorithms() {
		t.Run(alg, func(t *testing.T) {
			b := mustNew(t, alg, full, 0)
			for round := range rounds {
				b.SetBackends(full)
				stop := make(chan struct{})
				var churn sync.WaitGroup
				churn.Add(1)
				// Removes one backend and adds it back, until stop is closed.
				go func() {
					defer churn.Done()
					for i := 0; ; i++ {
						select {
						case <-stop:
							return
						default:
						}
						b.SetBackends(slices.Delete(slices.Clone(full), i%len(full), i%len(full)+1))
						b.SetBackends(full)
					}
				}()
				held := make([][]Lease, workers)
				var wg sync.WaitGroup
				for w := range workers {
					wg.Add(1)
					// Picks picks times, holding every lease, then exits.
					go func() {
						defer wg.Done()
						for i := range picks {
							l, err := b.Pick(uint64(w*picks+i), func(string) bool { runtime.Gosched(); return false })
							if err != nil && !errors.Is(err, ErrNoBackend) {
								t.Errorf("pick: %v", err)
								return
							}
							held[w] = append(held[w], l)
						}
					}()
				}
				wg.Wait()
				close(stop)
				churn.Wait()
				all := slices.Concat(held...)
				checkCounts(t, b, ids, all, fmt.Sprintf("round %d", round))
				for i := range all {
					all[i].Release(Result{})
				}
			}
		})
	}
}

// TestStrayReleaseRefusesNoPick: a stray release (a copied lease released twice)
// that finds nothing in flight takes the count to -1 for an instant, then puts it
// back (backend.release). A Pick whose acquire falls in that instant brings the
// count to 0: a live backend's lease, not a forgotten backend's. Refused, its
// add was not undone and the Pick leased again, so the count stayed one above
// the leases for good (least_conn shunned the backend; removed, it was never
// forgotten). The test runs that interleaving step by step: the stray
// release's decrement, the Pick, the release's undo; once the Pick's lease is
// released, InFlight must be 0.
func TestStrayReleaseRefusesNoPick(t *testing.T) {
	for _, alg := range Algorithms() {
		t.Run(alg, func(t *testing.T) {
			b := mustNew(t, alg, []Backend{{ID: "a", Weight: 1, Usable: true}}, 0)
			l, err := b.Pick(1, nil)
			if err != nil {
				t.Fatal(err)
			}
			be := l.b
			l.Release(Result{})
			// The stray release of a copy of l, halfway: its decrement.
			if n := be.inflight.Add(-1); n != -1 {
				t.Fatalf("count after a stray release's decrement: got %d; want -1", n)
			}
			l2, err := b.Pick(1, nil)
			be.inflight.Add(1) // the stray release's undo
			if err != nil {
				t.Fatal(err)
			}
			checkCounts(t, b, []string{"a"}, []Lease{l2}, "the lease held")
			l2.Release(Result{})
			checkCounts(t, b, []string{"a"}, nil, "all released")
		})
	}
}
