package health

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestDueQueue: whatever the mix of queueing, re-queueing and removal, the
// queue hands out exactly the queued backends, each once, in the order of
// their due times, and its stale entries stay bounded.
func TestDueQueue(t *testing.T) {
	t0 := time.Now()
	for _, tt := range []struct {
		name            string
		backends, steps int
		requeue, remove float64 // share of the steps that re-queue / remove a backend
	}{
		{"push and take", 100, 1000, 0, 0},
		{"re-queue", 100, 5000, 0.5, 0},
		{"remove", 100, 5000, 0, 0.3},
		{"churn, many stale entries", 2000, 50000, 0.45, 0.45},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, 2))
			var q dueQueue
			bs := make([]*backend, tt.backends)
			for i := range bs {
				bs[i] = &backend{id: string(rune('a' + i%26))}
			}
			// The reference: each queued backend's due time.
			want := map[*backend]time.Time{}
			now := t0
			check := func() {
				t.Helper()
				if q.len() != len(want) {
					t.Fatalf("len: got %d; want %d", q.len(), len(want))
				}
				if len(q.h) > 2*q.live+1024+1 {
					t.Fatalf("entries: got %d for %d queued; want at most 2x+1024", len(q.h), q.live)
				}
			}
			for range tt.steps {
				b := bs[rng.IntN(len(bs))]
				switch r := rng.Float64(); {
				case r < tt.remove:
					q.remove(b)
					delete(want, b)
				case r < tt.remove+tt.requeue || !b.queued:
					at := now.Add(time.Duration(rng.IntN(1000)) * time.Millisecond)
					q.push(b, at)
					want[b] = at
				default:
					// Take everything due by now, in order.
					now = now.Add(10 * time.Millisecond)
					var prev time.Time
					for h := q.head(); h != nil && !h.dueAt.After(now); h = q.head() {
						if got := q.take(); got != h {
							t.Fatal("take: got another backend than head")
						}
						at, ok := want[h]
						if !ok || !at.Equal(h.dueAt) || h.dueAt.Before(prev) {
							t.Fatalf("took a backend due at %v (queued %t at %v) after one due at %v", h.dueAt, ok, at, prev)
						}
						prev = h.dueAt
						delete(want, h)
					}
					for b, at := range want {
						if !at.After(now) {
							t.Fatalf("backend due at %v left queued at %v", at, now)
						}
						_ = b
					}
				}
				check()
			}
			// Drain: all of the rest, in order.
			var rest []time.Time
			for h := q.head(); h != nil; h = q.head() {
				rest = append(rest, q.take().dueAt)
			}
			if len(rest) != len(want) || !slices.IsSortedFunc(rest, func(a, b time.Time) int { return a.Compare(b) }) {
				t.Errorf("drained %d backends (sorted %t); want the %d queued, in order", len(rest), slices.IsSortedFunc(rest, func(a, b time.Time) int { return a.Compare(b) }), len(want))
			}
		})
	}
}
