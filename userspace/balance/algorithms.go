package balance

import (
	"math"
	"slices"
	"sync"
)

// Weights: round_robin, random, least_conn, p2c and ewma treat every usable backend
// alike (weight only says 0 = never); weighted, weighted_least_conn, source_hash and
// maglev honour weights. Slow start scales the weight-like term each algorithm has:
// an acceptance probability for round_robin and random, the cost divisor for the
// least-loaded family, the SWRR weight for weighted. source_hash and maglev ignore it:
// their table must stay a pure function of the configuration.

// roundRobin cycles over the usable set with one atomic counter. When the set changes
// it continues from the counter's position in the new set.
type roundRobin struct{ *core }

func (r *roundRobin) Pick(key uint64, skip func(id string) bool) (Lease, error) {
	s := r.snap.Load()
	n := len(s.entries)
	if n == 0 {
		return Lease{}, ErrNoBackend
	}
	// 32-bit modulo: a 64-bit division costs several times more on older x86. The
	// wrap at 2^32 picks only shifts the cycle once.
	start := int(uint32(r.ctr.Add(1)-1) % uint32(n))
	now, ramping := s.ramping(r.core)
	var rnd splitmix
	if ramping {
		rnd = r.rand()
	}
	j := start
	for i := range n {
		if i > 0 {
			// A turn refused (slow start) or skipped (a limit) goes on with the
			// cycle's next turn, not with the next backend in the list, which
			// would take every turn the other gives up on top of its own.
			j = int(uint32(r.ctr.Add(1)-1) % uint32(n))
		}
		e := &s.entries[j]
		if skip != nil && skip(e.b.id) {
			continue
		}
		if ramping && !accept(e, now, &rnd) {
			continue
		}
		return r.lease(e.b, key, skip)
	}
	// Every turn was refused or skipped (other picks take turns meanwhile, so
	// not every backend need have had one): the first one not skipped.
	return r.firstNotSkipped(s, start, key, skip)
}

// accept lets a ramping backend through with probability equal to its slow start factor.
func accept(e *entry, now int64, rnd *splitmix) bool {
	f := e.factor(now)
	return f >= 1 || rnd.float() < f
}

func (c *core) firstNotSkipped(s *snapshot, start int, key uint64, skip func(string) bool) (Lease, error) {
	n := len(s.entries)
	for i := range n {
		e := &s.entries[(start+i)%n]
		if skip == nil || !skip(e.b.id) {
			return c.lease(e.b, key, skip)
		}
	}
	return Lease{}, ErrNoBackend
}

// random picks uniformly; its only state is the snapshot.
type random struct{ *core }

func (r *random) Pick(key uint64, skip func(id string) bool) (Lease, error) {
	s := r.snap.Load()
	if len(s.entries) == 0 {
		return Lease{}, ErrNoBackend
	}
	rnd := r.rand()
	now, ramping := s.ramping(r.core)
	var i int
	for range rampDraws {
		i = pickRandom(s, &rnd, skip, -1)
		if i < 0 {
			return Lease{}, ErrNoBackend
		}
		if !ramping || accept(&s.entries[i], now, &rnd) {
			break
		}
	}
	// Accepted, or refused rampDraws times by slow start: the last candidate
	// drawn. (Not another draw: skip reads live state, such as a limit other
	// connections reach meanwhile, and may refuse every backend by now.)
	return r.lease(s.entries[i].b, key, skip)
}

// rampDraws is how many draws random makes while a backend ramps before it takes a
// refused one. Each refusal that ends the draws gives a ramping backend a pick it
// would not have had, so they must be rare: with one backend at full weight beside
// one ramping at a tenth, 0.45 of the draws are refused; after four in a row (4 %)
// the ramping one had 0.127 of the picks, not 0.091. After sixteen (3 in a million)
// the bias is gone, and only a set mostly ramping, where the candidate refused is as
// good as any, gets that far often. Each draw costs a few ns.
const rampDraws = 16

// pickRandom returns the index of a uniformly random entry that skip doesn't exclude
// and that isn't exclude (-1 for none), or -1 if there is none. A few random draws
// first; if the skipped share is large, a scan from a random start.
func pickRandom(s *snapshot, rnd *splitmix, skip func(string) bool, exclude int) int {
	n := len(s.entries)
	if exclude >= 0 {
		n-- // draw from the others: index >= exclude shifts up by one
	}
	if n <= 0 {
		return -1
	}
	for range 4 {
		i := rnd.intn(n)
		if exclude >= 0 && i >= exclude {
			i++
		}
		if skip == nil || !skip(s.entries[i].b.id) {
			return i
		}
	}
	all := len(s.entries)
	start := rnd.intn(all)
	for k := range all {
		i := (start + k) % all
		if i != exclude && (skip == nil || !skip(s.entries[i].b.id)) {
			return i
		}
	}
	return -1
}

// leastConn scans every usable backend for the fewest in-flight connections (divided by
// weight for weighted_least_conn). Among backends tied for the least, each wins alike:
// the scan keeps the k-th tie it meets with probability 1/k (reservoir sampling, one
// random number per tie). A random start alone favoured the backend after a run of
// busier ones: with A busy, B after it won every scan starting at A or B. Cost is
// linear in the backend count: see the benchmark.
type leastConn struct {
	*core
	weighted bool
}

func (l *leastConn) Pick(key uint64, skip func(id string) bool) (Lease, error) {
	s := l.snap.Load()
	n := len(s.entries)
	if n == 0 {
		return Lease{}, ErrNoBackend
	}
	rnd := l.rand()
	start := rnd.intn(n)
	now, ramping := s.ramping(l.core)
	if !l.weighted && !ramping {
		return l.pickCount(s, start, &rnd, key, skip)
	}
	if !ramping {
		return l.pickWeighted(s, start, &rnd, key, skip)
	}
	best, bestCost, ties := -1, math.Inf(1), 0
	for k := range n {
		i := start + k
		if i >= n {
			i -= n
		}
		e := &s.entries[i]
		if skip != nil && skip(e.b.id) {
			continue
		}
		w := 1.0
		if l.weighted {
			w = float64(e.weight)
		}
		if ramping {
			w *= e.factor(now)
		}
		// +1: with nothing in flight anywhere, the heavier backend still wins.
		switch c := float64(e.b.inflight.Load()+1) / w; {
		case c < bestCost:
			best, bestCost, ties = i, c, 1
		case c == bestCost:
			ties++
			if rnd.intn(ties) == 0 {
				best = i
			}
		}
	}
	if best < 0 {
		return Lease{}, ErrNoBackend
	}
	return l.lease(s.entries[best].b, key, skip)
}

// pickCount is least_conn's integer fast path (no weights, no slow start).
func (l *leastConn) pickCount(s *snapshot, start int, rnd *splitmix, key uint64, skip func(string) bool) (Lease, error) {
	n := len(s.entries)
	best, bestN, ties := -1, int64(math.MaxInt64), 0
	for k := range n {
		i := start + k
		if i >= n {
			i -= n
		}
		e := &s.entries[i]
		c := e.b.inflight.Load()
		if c > bestN || (skip != nil && skip(e.b.id)) {
			continue
		}
		if c < bestN {
			best, bestN, ties = i, c, 1
		} else if ties++; rnd.intn(ties) == 0 {
			best = i
		}
	}
	if best < 0 {
		return Lease{}, ErrNoBackend
	}
	return l.lease(s.entries[best].b, key, skip)
}

// pickWeighted is weighted_least_conn's integer path (no slow start): it compares
// (in flight + 1) / weight by cross-multiplying, avoiding a division per backend.
// In flight < 2^31 and weight < 2^32, so the products fit in a uint64.
func (l *leastConn) pickWeighted(s *snapshot, start int, rnd *splitmix, key uint64, skip func(string) bool) (Lease, error) {
	n := len(s.entries)
	best, ties := -1, 0
	var bestN, bestW uint64
	for k := range n {
		i := start + k
		if i >= n {
			i -= n
		}
		e := &s.entries[i]
		c := uint64(max(0, e.b.inflight.Load())) + 1
		w := uint64(e.weight)
		if (best >= 0 && c*bestW > bestN*w) || (skip != nil && skip(e.b.id)) {
			continue
		}
		if best < 0 || c*bestW < bestN*w {
			best, bestN, bestW, ties = i, c, w, 1
		} else if ties++; rnd.intn(ties) == 0 {
			best = i
		}
	}
	if best < 0 {
		return Lease{}, ErrNoBackend
	}
	return l.lease(s.entries[best].b, key, skip)
}

// smoothWeighted is nginx's smooth weighted round robin: each pick adds every
// candidate's weight to its credit, the highest credit wins and pays the total. Ties go
// to the earlier backend in the configured order (nginx's strict ">" over its peer list),
// so weights 5:1:1 give A A B A C A A. Skipped backends sit the pick out, as nginx's
// "tried" peers do.
type smoothWeighted struct {
	*core
	mu sync.Mutex // guards every backend's current credit
}

// SetBackends starts a new cycle, every credit at zero, when the usable backends or
// their weights change. Credits sum to zero and each stays within the total weight
// it was built under: kept across a change, a backend left with a credit built
// under a total of 101 would take about a hundred picks in a row under a total of
// 2, and one removed would take its credit's opposite out of the sum the others
// share. A call that changes nothing (a health state or a ramp step elsewhere)
// keeps the cycle going.
//
// The new cycle breaks its ties in an order drawn at random, not the list's: each
// credit starts at a random fraction of a weight unit (below 1 << 10, the unit),
// which decides only between credits that are otherwise equal, as every pick moves
// credits by whole units (a ramping backend's weight aside). With the list's order, the first backend took the first
// pick of every cycle: with a backend flapping every few picks, a share far above
// its weight's (A half of the picks, not 5 in 12, with B of A, B, C down every
// other three), and every balancer node's first pick after a change alike.
func (w *smoothWeighted) SetBackends(backends []Backend) {
	w.mu.Lock()
	defer w.mu.Unlock()
	old := w.snap.Load()
	w.core.SetBackends(backends)
	s := w.snap.Load()
	if sameWeights(old.entries, s.entries) {
		return
	}
	rnd := w.rand()
	for i := range s.entries {
		s.entries[i].b.current = int64(rnd.intn(1 << 10))
	}
}

// sameWeights reports whether two snapshots hold the same backends, in the same
// order, at the same weights.
func sameWeights(a, b []entry) bool {
	return slices.EqualFunc(a, b, func(x, y entry) bool { return x.b == y.b && x.weight == y.weight })
}

// Pick calls skip with w.mu held: skip must not call back into this balancer's Pick.
func (w *smoothWeighted) Pick(key uint64, skip func(id string) bool) (Lease, error) {
	best, err := w.choose(skip)
	if err != nil {
		return Lease{}, err
	}
	return w.lease(best, key, skip) // not under w.mu: it may pick again
}

// choose is Pick's choice of backend, made under w.mu. It reads the list under
// w.mu too, which SetBackends holds while it publishes a list and starts a new
// cycle: read before, the list could be one a change has replaced meanwhile, and
// the pick would move credit by the old weights into the new cycle.
func (w *smoothWeighted) choose(skip func(id string) bool) (*backend, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.snap.Load()
	now, ramping := s.ramping(w.core)
	var best *backend
	var total int64
	for i := range s.entries {
		e := &s.entries[i]
		if skip != nil && skip(e.b.id) {
			continue
		}
		// Weights scaled by 1024 so a ramping weight-1 backend still gets a fraction.
		ew := int64(e.weight) << 10
		if ramping {
			ew = max(1, int64(float64(ew)*e.factor(now)))
		}
		e.b.current += ew
		total += ew
		if best == nil || e.b.current > best.current {
			best = e.b
		}
	}
	if best == nil {
		return nil, ErrNoBackend
	}
	best.current -= total
	return best, nil
}

// p2c draws two distinct random backends and takes the one with fewer in flight.
type p2c struct{ *core }

func (p *p2c) Pick(key uint64, skip func(id string) bool) (Lease, error) {
	s, ea, eb, err := p.drawTwo(skip)
	if err != nil {
		return Lease{}, err
	}
	if eb == nil {
		return p.lease(ea.b, key, skip)
	}
	na, nb := ea.b.inflight.Load(), eb.b.inflight.Load()
	if now, ramping := s.ramping(p.core); ramping {
		if float64(nb+1)/eb.factor(now) < float64(na+1)/ea.factor(now) {
			ea = eb
		}
	} else if nb < na {
		ea = eb
	}
	return p.lease(ea.b, key, skip)
}

// drawTwo draws two distinct random usable backends for the P2C family. With one
// left after skip, eb is nil; with none, err is ErrNoBackend.
func (c *core) drawTwo(skip func(id string) bool) (s *snapshot, ea, eb *entry, err error) {
	s = c.snap.Load()
	if len(s.entries) == 0 {
		return s, nil, nil, ErrNoBackend
	}
	rnd := c.rand()
	a := pickRandom(s, &rnd, skip, -1)
	if a < 0 {
		return s, nil, nil, ErrNoBackend
	}
	ea = &s.entries[a]
	if b := pickRandom(s, &rnd, skip, a); b >= 0 {
		eb = &s.entries[b]
	}
	return s, ea, eb, nil
}

// peakEWMA is Finagle's and Linkerd's least-time balancer: P2C over
// cost = latency estimate × (in flight + 1).
type peakEWMA struct{ *core }

func (p *peakEWMA) Pick(key uint64, skip func(id string) bool) (Lease, error) {
	_, ea, eb, err := p.drawTwo(skip)
	if err != nil {
		return Lease{}, err
	}
	if eb == nil {
		return p.lease(ea.b, key, skip)
	}
	now := p.now()
	neutral := p.ewma.neutral()
	ca, untriedA, probeA := p.cost(ea, now, neutral)
	cb, untriedB, probeB := p.cost(eb, now, neutral)
	switch {
	// An untried backend with nothing in flight wins against a tried one, once
	// per ewmaDecay (ewmaState.claimUntried). Its estimate is the balancer-wide
	// average, which, while one backend has answered, is that backend's own
	// average give or take a rounding: the two then compare on noise, and if
	// the tried one came out a hair lower each time it kept every connection
	// (TestSlowFirstByteGetsSmallerShare: all 100 to the slow backend, 1 run in 6).
	case untriedA && !untriedB && ea.b.ewma.claimUntried(now):
	case untriedB && !untriedA && eb.b.ewma.claimUntried(now):
		ea = eb
	// A backend due a probe wins the draw (ewmaState.dueProbe).
	case probeA && ea.b.ewma.claimProbe(now):
	case probeB && eb.b.ewma.claimProbe(now):
		ea = eb
	case cb < ca:
		ea = eb
	}
	return p.lease(ea.b, key, skip)
}

// cost is e's latency estimate × (in flight + 1); whether e has had no sample of
// its own and has nothing in flight; and whether e is due a probe.
func (p *peakEWMA) cost(e *entry, now int64, neutral float64) (cost float64, untried, probe bool) {
	est, seen, idle := e.b.ewma.look(now, neutral)
	inflight := e.b.inflight.Load()
	if est <= 0 {
		est = 1 // nothing observed anywhere yet: plain P2C on in-flight counts
	}
	return est * float64(inflight+1) / e.factor(now), !seen && inflight == 0, e.b.ewma.dueProbe(now, idle, inflight)
}

// maglevHash serves source_hash and maglev: both look the key up in a weighted Maglev
// table; they differ only in the key the caller hashes (client address, or 5-tuple).
type maglevHash struct{ *core }

func (m *maglevHash) Pick(key uint64, skip func(id string) bool) (Lease, error) {
	s := m.snap.Load()
	size := uint64(len(s.table))
	if size == 0 {
		return Lease{}, ErrNoBackend
	}
	// Mix the key: callers may pass a raw IPv4 address, whose low bits are poorly spread.
	h := mix64(key)
	e := &s.entries[s.table[h%size]]
	if skip == nil || !skip(e.b.id) {
		return m.lease(e.b, key, skip)
	}
	// The owner is skipped: retry with rehashed keys (still a pure function of key and
	// table, so balancer nodes agree), then fall back to a scan.
	for a := uint64(1); a <= 8; a++ {
		e = &s.entries[s.table[mix64(key+a*0x9e3779b97f4a7c15)%size]]
		if !skip(e.b.id) {
			return m.lease(e.b, key, skip)
		}
	}
	return m.firstNotSkipped(s, int(h%uint64(len(s.entries))), key, skip)
}

// maglevP2C is maglev_p2c: the flow's slot in two Maglev tables names two candidates,
// and PreferSecond picks by in-flight counts, as the XDP program does by active flows.
type maglevP2C struct{ maglevHash }

func (m *maglevP2C) Pick(key uint64, skip func(id string) bool) (Lease, error) {
	s := m.snap.Load()
	size := uint64(len(s.table))
	if size == 0 {
		return Lease{}, ErrNoBackend
	}
	h := mix64(key)
	a, b := &s.entries[s.table[h%size]], &s.entries[s.table2[h%size]]
	if skip != nil && (skip(a.b.id) || skip(b.b.id)) {
		return m.maglevHash.Pick(key, skip)
	}
	if a != b && PreferSecond(a.b.inflight.Load(), a.weight, b.b.inflight.Load(), b.weight) {
		a = b
	}
	return m.lease(a.b, key, skip)
}
