package main

import (
	"container/heap"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/weir-lb/weir/userspace/balance"
)

// Time is in milliseconds throughout; a nominal backend serves a request in 1 ms on
// average (exponentially distributed).

// backendSpec describes one simulated backend: a FIFO single server.
type backendSpec struct {
	mean float64 // mean service time, ms
	// Periodic pauses (a GC stall): no service during [phase+k·period, phase+k·period+pause).
	period, pause, phase float64
}

// capacity is requests per ms the backend completes when always busy.
func (s backendSpec) capacity() float64 {
	c := 1 / s.mean
	if s.period > 0 {
		c *= 1 - s.pause/s.period
	}
	return c
}

// finish returns when work ms of service starting at start completes, skipping pauses.
func (s backendSpec) finish(start, work float64) float64 {
	if s.period == 0 {
		return start + work
	}
	// Walk pause cycles by index: each turn of the loop moves to the next cycle, so
	// floating-point rounding at a boundary can't stall it.
	t := start
	for k := math.Floor((t - s.phase) / s.period); ; k++ {
		pauseStart := s.phase + k*s.period
		next := pauseStart + s.period
		t = max(t, pauseStart+s.pause)
		if t+work <= next {
			return t + work
		}
		if avail := next - t; avail > 0 {
			work -= avail
		}
		t = next
	}
}

// viewMode is what a balancer knows of backend load.
type viewMode int

const (
	// viewOwn: only its own in-flight requests per backend (a proxy's local counters).
	viewOwn viewMode = iota
	// viewShared: every balancer reads the true queue lengths as published every
	// refresh ms, plus the requests it sent itself since that publication.
	viewShared
)

func (v viewMode) String() string {
	if v == viewShared {
		return "shared"
	}
	return "own"
}

// config is one simulation run.
type config struct {
	backends  []backendSpec
	balancers int
	policy    string
	view      viewMode
	refresh   float64 // viewShared publication interval, ms
	util      float64 // arrival rate ÷ total capacity
	jobs      int
	warmup    int // jobs excluded from the latency statistics
	seed      uint64

	// Slowdown: from slowAt on, backend 0 serves slowFactor times slower (requests
	// that start service after slowAt). 0 = never.
	slowAt, slowFactor float64
	// Trace: count picks in bins of traceBin ms, for backend 0 and in total.
	traceBin float64
	traceEnd float64 // stop the run at this time (0: run jobs arrivals)
	// infinite: a backend serves every request at once for its whole duration (an
	// M/G/∞ server: connections held open, not queued), so the "queue" is its active
	// connections and response time is connection time.
	infinite bool
}

// result is what one run measured.
type result struct {
	p50, p99, p999 float64 // response time (queueing + service), ms
	maxQueue       int     // largest number of requests at one backend (queued + in service)
	finalQueue     int     // largest backend queue at the end: grows with run length if unstable
	// Trace bins (traceBin wide from 0): picks of backend 0, and all picks.
	tracePicks0, tracePicks []int
	// After warmup, sampled at every arrival: the mean of (busiest backend's count ÷
	// the mean count), each backend's share of picks, and the share of picks that
	// took maglev_p2c's second candidate.
	maxOverMean float64
	share       []float64
	second      float64
}

// departure is a request finishing at a backend.
type departure struct {
	at, arrived float64
	backend     int
	balancer    int
}

type departures []departure

func (d departures) Len() int           { return len(d) }
func (d departures) Less(i, j int) bool { return d[i].at < d[j].at }
func (d departures) Swap(i, j int)      { d[i], d[j] = d[j], d[i] }
func (d *departures) Push(x any)        { *d = append(*d, x.(departure)) }
func (d *departures) Pop() any {
	old := *d
	x := old[len(old)-1]
	*d = old[:len(old)-1]
	return x
}

// balancer is one independent balancer's state.
type balancer struct {
	inflight []int     // own requests in flight per backend
	sent     []int     // own requests sent since the last publication (viewShared)
	rr       int       // round robin position
	est      []float64 // peak-EWMA latency estimate per backend, ms (0 = none yet)
	stamp    []float64 // time of the last observation per backend
	neutral  float64   // balancer-wide average latency
	nstamp   float64
}

// ewmaDecay is the EWMA time constant in ms: 10 s, as in the balance package (and
// Finagle and Linkerd).
const ewmaDecay = 10_000.0

func decayToward(old, target, elapsed float64) float64 {
	if elapsed <= 0 {
		return old
	}
	return target + (old-target)*math.Exp(-elapsed/ewmaDecay)
}

func (b *balancer) estimate(i int, now float64) float64 {
	if b.est[i] == 0 {
		return b.neutral
	}
	return decayToward(b.est[i], b.neutral, now-b.stamp[i])
}

func (b *balancer) observe(i int, now, latency float64) {
	if b.est[i] == 0 || latency > b.est[i] {
		b.est[i] = latency
	} else {
		b.est[i] = decayToward(b.est[i], latency, now-b.stamp[i])
	}
	b.stamp[i] = now
	if b.neutral == 0 {
		b.neutral = latency
	} else {
		b.neutral = decayToward(b.neutral, latency, now-b.nstamp)
	}
	b.nstamp = now
}

// sim is the state of one run.
type sim struct {
	cfg       config
	rng       *rand.Rand
	queue     []int     // requests at each backend (queued + in service)
	lastDep   []float64 // when each backend's last queued request finishes (FIFO)
	board     []int     // viewShared: queue lengths as last published
	published float64   // when board was published
	bals      []balancer
	deps      departures
	tables    [2][]uint32 // maglev and maglev_p2c: the first and second Maglev tables
	seconds   int         // picks that took the second candidate
}

func run(cfg config) result {
	n := len(cfg.backends)
	s := &sim{
		cfg:     cfg,
		rng:     rand.New(rand.NewPCG(cfg.seed, 0x5eed)),
		queue:   make([]int, n),
		lastDep: make([]float64, n),
		board:   make([]int, n),
		bals:    make([]balancer, cfg.balancers),
	}
	for k := range s.bals {
		s.bals[k] = balancer{
			inflight: make([]int, n), sent: make([]int, n),
			rr:  s.rng.IntN(n), // independent balancers are not in phase
			est: make([]float64, n), stamp: make([]float64, n),
		}
	}
	if cfg.policy == "maglev" || cfg.policy == "maglev_p2c" {
		s.tables = maglevTables(n)
	}
	var capacity float64
	for _, b := range cfg.backends {
		capacity += b.capacity()
	}
	if cfg.infinite {
		capacity = float64(n) // util is then arrivals per ms per backend
	}
	rate := cfg.util * capacity

	var res result
	var samples, picked, arrivals int
	res.share = make([]float64, n)
	var lat []float64
	if cfg.traceBin > 0 {
		bins := int(cfg.traceEnd/cfg.traceBin) + 1
		res.tracePicks0, res.tracePicks = make([]int, bins), make([]int, bins)
	}
	now := 0.0
	for j := 0; cfg.traceEnd > 0 || j < cfg.jobs; j++ {
		now += s.rng.ExpFloat64() / rate
		if cfg.traceEnd > 0 && now >= cfg.traceEnd {
			break
		}
		s.departUntil(now)
		k := s.rng.IntN(cfg.balancers) // ECMP spreads arrivals over balancers
		i := s.pick(k, now)
		arrivals++
		bal := &s.bals[k]
		bal.inflight[i]++
		bal.sent[i]++
		s.queue[i]++
		res.maxQueue = max(res.maxQueue, s.queue[i])

		if j >= cfg.warmup {
			total, top := 0, 0
			for _, q := range s.queue {
				total += q
				top = max(top, q)
			}
			res.maxOverMean += float64(top) * float64(n) / float64(total)
			samples++
			res.share[i]++
			picked++
		}
		spec := cfg.backends[i]
		work := s.rng.ExpFloat64() * spec.mean
		start := max(now, s.lastDep[i])
		if cfg.infinite {
			start = now
		}
		if i == 0 && cfg.slowFactor > 0 && start >= cfg.slowAt {
			work *= cfg.slowFactor
		}
		done := spec.finish(start, work)
		s.lastDep[i] = done
		heap.Push(&s.deps, departure{at: done, arrived: now, backend: i, balancer: k})
		if j >= cfg.warmup {
			lat = append(lat, done-now)
		}
		if cfg.traceBin > 0 {
			bin := int(now / cfg.traceBin)
			res.tracePicks[bin]++
			if i == 0 {
				res.tracePicks0[bin]++
			}
		}
	}
	res.finalQueue = slices.Max(s.queue)
	if samples > 0 {
		res.maxOverMean /= float64(samples)
		for i := range res.share {
			res.share[i] /= float64(picked)
		}
		res.second = float64(s.seconds) / float64(arrivals)
	}
	slices.Sort(lat)
	res.p50, res.p99, res.p999 = quantile(lat, 0.5), quantile(lat, 0.99), quantile(lat, 0.999)
	return res
}

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	return sorted[min(len(sorted)-1, int(q*float64(len(sorted))))]
}

// departUntil processes every departure up to now: queues shrink, balancers see their
// requests end (and their latency), and the board is republished on schedule.
func (s *sim) departUntil(now float64) {
	for len(s.deps) > 0 && s.deps[0].at <= now {
		d := heap.Pop(&s.deps).(departure)
		s.publishUntil(d.at)
		s.queue[d.backend]--
		b := &s.bals[d.balancer]
		b.inflight[d.backend]--
		b.observe(d.backend, d.at, d.at-d.arrived)
	}
	s.publishUntil(now)
}

// publishUntil republishes the board if a publication falls due by t.
func (s *sim) publishUntil(t float64) {
	if s.cfg.view != viewShared || t < s.published+s.cfg.refresh {
		return
	}
	s.published = math.Floor(t/s.cfg.refresh) * s.cfg.refresh
	copy(s.board, s.queue)
	for k := range s.bals {
		clear(s.bals[k].sent)
	}
}

// load is backend i's load as balancer k sees it.
func (s *sim) load(k, i int) int {
	if s.cfg.view == viewShared {
		return s.board[i] + s.bals[k].sent[i]
	}
	return s.bals[k].inflight[i]
}

// pick applies the policy: the same decision rules as userspace/balance.
func (s *sim) pick(k int, now float64) int {
	n := len(s.cfg.backends)
	switch s.cfg.policy {
	case "round_robin":
		b := &s.bals[k]
		i := b.rr % n
		b.rr++
		return i
	case "random":
		return s.rng.IntN(n)
	case "least_conn":
		// First minimum from a random start, as the package scans.
		start := s.rng.IntN(n)
		best, bestLoad := start, s.load(k, start)
		for o := 1; o < n; o++ {
			i := (start + o) % n
			if l := s.load(k, i); l < bestLoad {
				best, bestLoad = i, l
			}
		}
		return best
	case "p2c":
		a, b := s.two(n)
		if s.load(k, b) < s.load(k, a) {
			return b
		}
		return a
	case "maglev", "maglev_p2c":
		// A new flow's hash picks its slot in both tables, as the XDP program does;
		// the node compares the loads it sees (its own flows: viewOwn).
		h := s.rng.Uint32()
		a := int(s.tables[0][h%uint32(len(s.tables[0]))])
		b := int(s.tables[1][h%uint32(len(s.tables[1]))])
		if s.cfg.policy == "maglev_p2c" && a != b && balance.PreferSecond(int64(s.load(k, a)), 1, int64(s.load(k, b)), 1) {
			s.seconds++
			return b
		}
		return a
	case "ewma":
		a, b := s.two(n)
		bal := &s.bals[k]
		cost := func(i int) float64 {
			e := bal.estimate(i, now)
			if e <= 0 {
				e = 1
			}
			return e * float64(bal.inflight[i]+1)
		}
		if cost(b) < cost(a) {
			return b
		}
		return a
	}
	panic(fmt.Sprintf("sim: unknown policy %q", s.cfg.policy))
}

// two returns two distinct uniformly random backends.
func (s *sim) two(n int) (int, int) {
	a := s.rng.IntN(n)
	b := s.rng.IntN(n - 1)
	if b >= a {
		b++
	}
	return a, b
}

// ballsIntoBins throws n balls into n bins, each into a random bin (d = 1) or the less
// full of d random bins, and returns the fullest bin's count: the static form of the
// claims about random and P2C.
func ballsIntoBins(n, d int, rng *rand.Rand) int {
	bins := make([]int32, n)
	var top int32
	for range n {
		best := rng.IntN(n)
		for range d - 1 {
			if c := rng.IntN(n); bins[c] < bins[best] {
				best = c
			}
		}
		bins[best]++
		top = max(top, bins[best])
	}
	return int(top)
}

// maglevTables builds the two tables of n equal backends the loader builds for a
// maglev_p2c service (hash seed 0): the first is plain maglev's.
func maglevTables(n int) [2][]uint32 {
	bs := make([]balance.Backend, n)
	for i := range bs {
		bs[i] = balance.Backend{ID: fmt.Sprintf("10.0.%d.%d:80", i/256, i%256), Weight: 1, Usable: true}
	}
	var t [2][]uint32
	for i, seed := range []uint64{0, balance.P2CSeed(0)} {
		var err error
		if t[i], err = balance.BuildMaglev(bs, balance.MaglevSize(n), seed); err != nil {
			panic(fmt.Sprintf("sim: build maglev table: %v", err))
		}
	}
	return t
}
