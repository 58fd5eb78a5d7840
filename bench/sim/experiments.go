package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
)

// scale shrinks every experiment for a quick run (tests); 1 is the full run.
type scale struct {
	jobs   int // arrivals per queueing run
	reps   int // repetitions of the slowdown experiment
	maxN   int // largest n in the balls-into-bins sweep
	trials int // balls-into-bins trials at n = 1000 (fewer at larger n)
}

var (
	fullScale  = scale{jobs: 200_000, reps: 40, maxN: 1_000_000, trials: 200}
	quickScale = scale{jobs: 20_000, reps: 4, maxN: 10_000, trials: 10}
)

// parallel runs n jobs on GOMAXPROCS workers; results land by index, so the output
// doesn't depend on scheduling.
func parallel[T any](n int, f func(i int) T) []T {
	out := make([]T, n)
	var next sync.Mutex
	i := 0
	var wg sync.WaitGroup
	for range runtime.GOMAXPROCS(0) {
		wg.Add(1)
		// Takes indexes until none are left, then exits.
		go func() {
			defer wg.Done()
			for {
				next.Lock()
				j := i
				i++
				next.Unlock()
				if j >= n {
					return
				}
				out[j] = f(j)
			}
		}()
	}
	wg.Wait()
	return out
}

func uniform(n int) []backendSpec {
	bs := make([]backendSpec, n)
	for i := range bs {
		bs[i] = backendSpec{mean: 1}
	}
	return bs
}

// --- Claim 1: maximum load, random versus P2C --------------------------------------

type maxLoadRow struct {
	n                  int
	trials             int
	random, p2c        float64 // mean maximum bin load over trials
	theoryRandom       float64 // ln n / ln ln n
	theoryP2C          float64 // ln ln n / ln 2
	queueRandom, qP2C  int     // dynamic: maximum queue at util 0.9 (n <= 1000)
	hasQueue           bool
	p99Random, p99P2C  float64
	queueJobsPerServer int
}

func maxLoad(sc scale, seed uint64) []maxLoadRow {
	var ns []int
	for n := 10; n <= sc.maxN; n *= 10 {
		ns = append(ns, n)
	}
	rows := parallel(len(ns), func(i int) maxLoadRow {
		n := ns[i]
		trials := max(3, min(sc.trials*1000/n, sc.trials))
		rng := rand.New(rand.NewPCG(seed, uint64(n)))
		r := maxLoadRow{n: n, trials: trials}
		for range trials {
			r.random += float64(ballsIntoBins(n, 1, rng)) / float64(trials)
			r.p2c += float64(ballsIntoBins(n, 2, rng)) / float64(trials)
		}
		ln := math.Log(float64(n))
		r.theoryRandom = ln / math.Log(ln)
		r.theoryP2C = math.Log(ln) / math.Ln2
		return r
	})
	// The queueing form: n servers at utilisation 0.9 (the supermarket model), the same
	// run length per server at every n, so only n changes.
	perServer := max(100, sc.jobs/1000)
	qs := parallel(2*3, func(i int) result {
		n := []int{10, 100, 1000}[i/2]
		return run(config{
			backends: uniform(n), balancers: 1, policy: []string{"random", "p2c"}[i%2],
			util: 0.9, jobs: perServer * n, warmup: perServer * n / 10, seed: seed + uint64(i),
		})
	})
	for i := range 3 {
		rows[i].hasQueue = true
		rows[i].queueRandom, rows[i].qP2C = qs[2*i].maxQueue, qs[2*i+1].maxQueue
		rows[i].p99Random, rows[i].p99P2C = qs[2*i].p99, qs[2*i+1].p99
		rows[i].queueJobsPerServer = perServer
	}
	return rows
}

// --- Claim 2: herd behaviour with many independent balancers ---------------------------

var herdPolicies = []string{"random", "round_robin", "least_conn", "p2c", "maglev", "maglev_p2c"}
var herdKs = []int{1, 4, 16}

const (
	herdN       = 20
	herdUtil    = 0.9
	herdRefresh = 1.0 // ms, one mean service time
)

type herdRow struct {
	policy string
	view   viewMode
	k      int
	res    result
}

func herd(sc scale, seed uint64) []herdRow {
	var rows []herdRow
	for _, v := range []viewMode{viewOwn, viewShared} {
		for _, p := range herdPolicies {
			for _, k := range herdKs {
				rows = append(rows, herdRow{policy: p, view: v, k: k})
			}
		}
	}
	res := parallel(len(rows), func(i int) result {
		r := rows[i]
		return run(config{
			backends: uniform(herdN), balancers: r.k, policy: r.policy, view: r.view,
			refresh: herdRefresh, util: herdUtil, jobs: sc.jobs, warmup: sc.jobs / 10,
			seed: seed + uint64(i),
		})
	})
	for i := range rows {
		rows[i].res = res[i]
	}
	return rows
}

// --- Claim 3: time to shift load off a slowed backend ---------------------------------

var slowPolicies = []string{"least_conn", "p2c", "ewma", "round_robin"}

const (
	slowN      = 10
	slowUtil   = 0.7
	slowAt     = 500.0 // ms
	slowFactor = 10.0
	slowEnd    = 1500.0
	slowBin    = 5.0
)

// slowKs: one balancer, and eight that each see only their own requests (a latency
// sample is not diluted by K, an in-flight count is).
var slowKs = []int{1, 8}

type slowRow struct {
	policy     string
	k          int
	share      []float64 // backend 0's share of picks per bin, over all repetitions
	preShare   float64   // mean share in [100, slowAt)
	afterShare float64   // mean share in the last 500 ms
	shift      float64   // ms after slowAt until a bin's share first falls to preShare/2; NaN: never
	sentFirst  float64   // requests sent to backend 0 in the first 100 ms after slowAt, per repetition
	p99        float64   // median over repetitions of the run's p99
}

func slowdown(sc scale, seed uint64) []slowRow {
	nruns := len(slowKs) * len(slowPolicies)
	runs := parallel(nruns*sc.reps, func(i int) result {
		c := i / sc.reps
		return run(config{
			backends: uniform(slowN), balancers: slowKs[c/len(slowPolicies)], policy: slowPolicies[c%len(slowPolicies)],
			util: slowUtil, seed: seed + uint64(i), slowAt: slowAt, slowFactor: slowFactor,
			traceBin: slowBin, traceEnd: slowEnd,
		})
	})
	rows := make([]slowRow, nruns)
	bins := int(slowEnd/slowBin) + 1
	for p := range rows {
		r := slowRow{policy: slowPolicies[p%len(slowPolicies)], k: slowKs[p/len(slowPolicies)], share: make([]float64, bins), shift: math.NaN()}
		picks0, picks := make([]int, bins), make([]int, bins)
		var p99s []float64
		for _, res := range runs[p*sc.reps : (p+1)*sc.reps] {
			for b := range bins {
				picks0[b] += res.tracePicks0[b]
				picks[b] += res.tracePicks[b]
			}
			p99s = append(p99s, res.p99)
		}
		var pre0, pre, aft0, aft, first int
		for b := range bins {
			if picks[b] > 0 {
				r.share[b] = float64(picks0[b]) / float64(picks[b])
			}
			t := float64(b) * slowBin
			switch {
			case t >= 100 && t < slowAt:
				pre0, pre = pre0+picks0[b], pre+picks[b]
			case t >= slowEnd-500:
				aft0, aft = aft0+picks0[b], aft+picks[b]
			}
			if t >= slowAt && t < slowAt+100 {
				first += picks0[b]
			}
		}
		r.preShare = float64(pre0) / float64(pre)
		r.afterShare = float64(aft0) / float64(aft)
		r.sentFirst = float64(first) / float64(sc.reps)
		for b := int(slowAt / slowBin); b < bins; b++ {
			if picks[b] > 0 && r.share[b] <= r.preShare/2 {
				r.shift = float64(b)*slowBin - slowAt
				break
			}
		}
		r.p99 = median(p99s)
		rows[p] = r
	}
	return rows
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	if len(s) == 0 {
		return math.NaN()
	}
	for i := 1; i < len(s); i++ { // insertion sort: a few dozen values
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	return s[len(s)/2]
}

// --- Claim 4: round robin's tail under heterogeneous backends as utilisation rises ---

var utilPolicies = []string{"round_robin", "random", "least_conn", "p2c", "ewma"}
var utils = []float64{0.5, 0.7, 0.8, 0.9, 0.95}

type scenario struct {
	name, desc string
	backends   []backendSpec
}

func scenarios() []scenario {
	mixed := uniform(10)
	for i := 5; i < 10; i++ {
		mixed[i].mean = 2
	}
	gc := uniform(10)
	for i := range gc {
		gc[i].period, gc[i].pause, gc[i].phase = 500, 25, float64(i)*50
	}
	return []scenario{
		{"homogeneous", "10 backends, 1 ms mean service each", uniform(10)},
		{"mixed", "10 backends: 5 at 1 ms, 5 at 2 ms mean service", mixed},
		{"gc", "10 backends at 1 ms, each stalled 25 ms every 500 ms (staggered)", gc},
	}
}

type utilRow struct {
	scenario string
	policy   string
	util     float64
	res      result
}

func utilSweep(sc scale, seed uint64) []utilRow {
	var rows []utilRow
	for _, s := range scenarios() {
		for _, p := range utilPolicies {
			for _, u := range utils {
				rows = append(rows, utilRow{scenario: s.name, policy: p, util: u})
			}
		}
	}
	specs := map[string][]backendSpec{}
	for _, s := range scenarios() {
		specs[s.name] = s.backends
	}
	res := parallel(len(rows), func(i int) result {
		r := rows[i]
		return run(config{
			backends: specs[r.scenario], balancers: 1, policy: r.policy, util: r.util,
			jobs: sc.jobs, warmup: sc.jobs / 10, seed: seed + uint64(i),
		})
	})
	for i := range rows {
		rows[i].res = res[i]
	}
	return rows
}

// --- Claim 5: maglev_p2c against long connections on one backend -------------------

// Three backends hold connections open (no queueing: M/G/∞), backend 2 three times
// as long as the others; the balancer nodes count their own open connections, as XDP
// does. connFlows is the mean number of connections open at once under maglev.
var connPolicies = []string{"maglev", "maglev_p2c", "p2c", "least_conn"}
var connKs = []int{1, 16}
var connFlows = []float64{10, 100, 1000}

const connSlow = 2

type connRow struct {
	policy string
	k      int
	flows  float64
	res    result
}

func connBackends() []backendSpec {
	bs := uniform(3)
	bs[connSlow].mean = 3
	return bs
}

func connections(sc scale, seed uint64) []connRow {
	var rows []connRow
	for _, f := range connFlows {
		for _, k := range connKs {
			for _, p := range connPolicies {
				rows = append(rows, connRow{policy: p, k: k, flows: f})
			}
		}
	}
	bs := connBackends()
	var meanDur float64
	for _, b := range bs {
		meanDur += b.mean / float64(len(bs))
	}
	res := parallel(len(rows), func(i int) result {
		r := rows[i]
		// Little's law under maglev's even split: flows = rate × mean duration.
		perBackend := r.flows / meanDur / float64(len(bs))
		return run(config{
			backends: bs, balancers: r.k, policy: r.policy, util: perBackend, infinite: true,
			jobs: sc.jobs, warmup: sc.jobs / 10, seed: seed + uint64(i),
		})
	})
	for i := range rows {
		rows[i].res = res[i]
	}
	return rows
}

// fmtMs formats a latency; unstable runs can reach seconds.
func fmtMs(v float64) string {
	switch {
	case math.IsNaN(v):
		return "–"
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func row(cells ...string) string { return "| " + strings.Join(cells, " | ") + " |\n" }
