package balance

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"
)

// atomicRR is the baseline every Pick is compared with: the least a balancer can do,
// one atomic add and an index.
type atomicRR struct {
	n   atomic.Uint64
	ids []string
}

func (r *atomicRR) pick() string { return r.ids[(r.n.Add(1)-1)%uint64(len(r.ids))] }

func newAtomicRR(n int) *atomicRR {
	r := &atomicRR{}
	for _, b := range backendsN(n, one) {
		r.ids = append(r.ids, b.ID)
	}
	return r
}

// benchAtomicRR runs the baseline and returns its ns/op (of the final, largest run:
// the benchmark function runs several times with growing b.N).
func benchAtomicRR(b *testing.B, n int) float64 {
	r := newAtomicRR(n)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		var last string
		for pb.Next() {
			last = r.pick()
		}
		_ = last
	})
	return float64(b.Elapsed().Nanoseconds()) / float64(b.N)
}

// BenchmarkPickRelease measures one Pick and its Release, from GOMAXPROCS goroutines
// (run with -cpu 2 for the target), at 3, 100 and 1,000 backends. x_atomic_rr is
// ns/op divided by the plain atomic round robin measured first in the same run.
func BenchmarkPickRelease(b *testing.B) {
	var base float64
	b.Run("atomic_rr/n=1000", func(b *testing.B) { base = benchAtomicRR(b, 1000) })
	for _, alg := range Algorithms() {
		for _, n := range []int{3, 100, 1000} {
			b.Run(fmt.Sprintf("%s/n=%d", alg, n), func(b *testing.B) {
				benchPick(b, alg, n, 0, base)
			})
		}
	}
	// The seeded path (reproducible choices) shares one counter between goroutines.
	for _, alg := range []string{Random, P2C} {
		b.Run(fmt.Sprintf("%s-seeded/n=1000", alg), func(b *testing.B) {
			benchPick(b, alg, 1000, 42, base)
		})
	}
	// The baseline again: on a shared machine, a baseline that moved between the two
	// runs says the ratios in between are only as good as that spread.
	b.Run("atomic_rr-again/n=1000", func(b *testing.B) { benchAtomicRR(b, 1000) })
}

func benchPick(b *testing.B, alg string, n int, seed uint64, base float64) {
	bal := mustNewB(b, alg, backendsN(n, func(i int) uint32 { return uint32(1 + i%3) }), seed)
	var key atomic.Uint64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		k := key.Add(1) << 40 // distinct keys per goroutine, no shared counter per pick
		for pb.Next() {
			k++
			l, err := bal.Pick(k, nil)
			if err != nil {
				b.Error(err)
				return
			}
			l.Release(Result{Latency: time.Millisecond})
		}
	})
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/base, "x_atomic_rr")
}

func mustNewB(b *testing.B, alg string, bs []Backend, seed uint64) Balancer {
	b.Helper()
	bal, err := New(alg, bs, seed)
	if err != nil {
		b.Fatal(err)
	}
	return bal
}

// BenchmarkSetBackends is the cost of a backend set change, which for maglev and
// source_hash rebuilds the table.
func BenchmarkSetBackends(b *testing.B) {
	for _, alg := range []string{RoundRobin, Maglev} {
		for _, n := range []int{100, 1000} {
			b.Run(fmt.Sprintf("%s/n=%d", alg, n), func(b *testing.B) {
				bs := backendsN(n, one)
				bal := mustNewB(b, alg, bs, 0)
				b.ReportAllocs()
				for i := 0; b.Loop(); i++ {
					bs[i%n].Usable = !bs[i%n].Usable
					bal.SetBackends(bs)
				}
			})
		}
	}
}
