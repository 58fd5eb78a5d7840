// Package balance holds the backend selection algorithms of weir's splice proxy and
// the Maglev table builder shared with the XDP loader. It is pure Go and does no I/O.
//
// Every algorithm publishes the usable backends as an immutable snapshot behind an
// atomic pointer, so Pick takes no lock (except weighted and ewma, which keep small
// per-balancer or per-backend state under a mutex) and allocates nothing.
package balance

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// ErrNoBackend: no usable backend (all unhealthy, draining, weight 0, or skipped).
var ErrNoBackend = errors.New("no usable backend")

// ErrUnknownAlgorithm is returned by New for a name not in Algorithms().
var ErrUnknownAlgorithm = errors.New("unknown algorithm")

// ErrDuplicateID is returned by New and BuildMaglev when two backends share an ID.
var ErrDuplicateID = errors.New("duplicate backend ID")

// Backend is one backend as the configuration and the health checker see it.
type Backend struct {
	ID        string        // stable identity, e.g. "10.0.0.5:80"; hashing and Maglev use it, never slice order
	Weight    uint32        // 0 = never picked
	Usable    bool          // healthy and not draining
	SlowStart time.Duration // 0 = off; ramp effective weight after becoming usable
	// Ramp is the part of its share a backend takes in a lookup table while it slow
	// starts in table steps, out of RampFull; 0 (or RampFull) is all of it. The table
	// keeps the backend's full weight in its base and hands the other slots to the
	// rest (BuildMaglev), so a step moves only the ramping backend's slots. Balancers
	// that pick without a table ignore it: they ramp by SlowStart.
	Ramp uint32
}

// RampFull is Backend.Ramp for all of a backend's share.
const RampFull = 1 << 16

// ramping reports whether b takes only part of its share (see Backend.Ramp).
func (b *Backend) ramping() bool { return b.Ramp > 0 && b.Ramp < RampFull }

// Result is the outcome of a connection, reported when its lease is released.
type Result struct {
	Failed  bool          // connect failed: no connection was made
	Latency time.Duration // 0 if unknown (e.g. connect time / time to first byte)
}

// Lease is what Pick returns (a value, so Pick allocates nothing). Release is idempotent
// on the same variable: it clears the lease; Release of a zero Lease is a no-op.
// Copies of a lease are not tracked: releasing two copies releases twice (the count
// is clamped at zero, so it can't go negative, but it can undercount).
type Lease struct {
	b   *backend
	gen uint32 // the ewma state's generation when picked (see ewmaState.gen)
}

// Backend returns the chosen backend's ID ("" for a zero lease).
func (l *Lease) Backend() string {
	if l.b == nil {
		return ""
	}
	return l.b.id
}

// Release ends the connection the lease was picked for and reports its outcome.
func (l *Lease) Release(r Result) {
	b := l.b
	if b == nil {
		return
	}
	l.b = nil
	b.release()
	if b.ewma != nil {
		b.ewma.observe(r, l.gen)
	}
}

// Balancer chooses backends for new connections. All methods are safe for concurrent use.
type Balancer interface {
	// Pick chooses a backend for a new connection. key is the hash key (used by
	// source_hash and maglev; ignored by others). skip, if non-nil, excludes backends
	// by ID (already tried for this connection, at a connection limit); if all usable
	// ones are skipped it returns ErrNoBackend.
	Pick(key uint64, skip func(id string) bool) (Lease, error)
	// SetBackends replaces the set; backends whose ID stays keep their in-flight counts
	// and latency state; leases of removed backends may still be released safely.
	SetBackends(backends []Backend)
	// InFlight returns the in-flight count for metrics (0 if unknown ID).
	InFlight(id string) int
	// Estimate returns the latency estimate a latency-aware algorithm (ewma,
	// least_time) would use for the backend now; false for other algorithms, an
	// unknown ID or a backend with no sample yet.
	Estimate(id string) (time.Duration, bool)
}

// Algorithm names, as the configuration spells them.
const (
	RoundRobin        = "round_robin"
	Random            = "random"
	LeastConn         = "least_conn"
	WeightedLeastConn = "weighted_least_conn"
	Weighted          = "weighted"
	P2C               = "p2c"
	EWMA              = "ewma"
	LeastTime         = "least_time"
	SourceHash        = "source_hash"
	Maglev            = "maglev"
	// MaglevP2C draws two candidates from two Maglev tables (the second built from
	// P2CSeed) and takes the less loaded one by PreferSecond.
	MaglevP2C = "maglev_p2c"
)

// Algorithms lists the names New accepts.
func Algorithms() []string {
	return []string{RoundRobin, Random, LeastConn, WeightedLeastConn, Weighted, P2C, EWMA, LeastTime, SourceHash, Maglev, MaglevP2C}
}

// New builds a balancer. algorithm is one of Algorithms(). seed makes random choices and
// hashing reproducible (tests) and lets independent balancer nodes agree (maglev/source_hash).
// With seed 0 the random choices (random, p2c, ewma, least_conn's tie break) use the
// runtime's per-thread generator: fastest, but not reproducible; Maglev hashing is
// deterministic for every seed, 0 included.
//
// Backends in the initial set start at full weight: slow start applies to backends that
// become usable later, through SetBackends.
func New(algorithm string, backends []Backend, seed uint64) (Balancer, error) {
	return newBalancer(algorithm, backends, seed, monotonic)
}

// epoch anchors monotonic: time.Since reads the monotonic clock, so wall-clock steps
// don't make EWMA decay or slow start jump.
var epoch = time.Now()

func monotonic() int64 { return int64(time.Since(epoch)) }

func newBalancer(algorithm string, backends []Backend, seed uint64, now func() int64) (Balancer, error) {
	if err := checkUnique(backends); err != nil {
		return nil, fmt.Errorf("new %s balancer: %w", algorithm, err)
	}
	c := &core{seed: seed, now: now, known: map[string]*backend{}}
	var b Balancer
	switch algorithm {
	case RoundRobin:
		b = &roundRobin{core: c}
	case Random:
		b = &random{core: c}
	case LeastConn:
		b = &leastConn{core: c}
	case WeightedLeastConn:
		b = &leastConn{core: c, weighted: true}
	case Weighted:
		b = &smoothWeighted{core: c}
	case P2C:
		b = &p2c{core: c}
	case EWMA:
		c.ewma = newEWMAShared(now)
		b = &peakEWMA{core: c}
	case LeastTime:
		c.ewma = newEWMAShared(now)
		c.average = true
		b = &peakEWMA{core: c}
	case SourceHash, Maglev:
		c.maglev = true
		b = &maglevHash{core: c}
	case MaglevP2C:
		c.maglev, c.second = true, true
		b = &maglevP2C{maglevHash{core: c}}
	default:
		return nil, fmt.Errorf("new balancer: %q: %w (want one of %v)", algorithm, ErrUnknownAlgorithm, Algorithms())
	}
	c.self = b
	c.set(backends, true)
	return b, nil
}

func checkUnique(backends []Backend) error {
	seen := make(map[string]struct{}, len(backends))
	for _, b := range backends {
		if _, dup := seen[b.ID]; dup {
			return fmt.Errorf("backend %q: %w", b.ID, ErrDuplicateID)
		}
		seen[b.ID] = struct{}{}
	}
	return nil
}

// backend is the state that outlives snapshots: in-flight count and latency estimate.
// Leases point at it, so a lease of a removed backend still releases into it.
type backend struct {
	id       string
	inflight atomic.Int64
	ewma     *ewmaState // nil unless the algorithm is ewma

	// Guarded by core.mu.
	wasUsable bool
	rampStart int64 // monotonic ns when it last became usable; ramp only if SlowStart > 0

	// SWRR credit; guarded by smoothWeighted.mu (its SetBackends holds that too).
	current int64

	// Pad to two cache lines: neighbouring backends are picked by different goroutines
	// at once, and the adjacent-line prefetcher pairs lines.
	_ [64]byte
}

// forgotten is the in-flight count of a backend SetBackends has forgotten: so far
// below zero that no number of refused acquires brings it back up.
const forgotten = math.MinInt64 / 2

// acquire takes an in-flight slot on b; it reports false if b is forgotten. The
// refused add is not undone: the count of a forgotten backend means nothing. A
// live count may be below zero for an instant (a stray release, undone), so the
// line between them is far below any live count, far above a forgotten one.
func (b *backend) acquire() bool { return b.inflight.Add(1) > forgotten/2 }

// release decrements in-flight but undoes a decrement below zero, so a stray release
// (of a copied lease) can't leave a negative count that would attract every new
// connection. One atomic add in the common case; a load-and-CAS loop costs two
// coherence round trips on a contended line.
func (b *backend) release() {
	if b.inflight.Add(-1) < 0 {
		b.inflight.Add(1)
	}
}

// entry is one usable backend in a snapshot.
type entry struct {
	b      *backend
	weight uint32
	ramp   uint32 // Backend.Ramp: for the lookup table only
	// Slow start window [rampStart, rampStart+rampLen); rampLen 0 means full weight.
	rampStart int64
	rampLen   int64
}

// SlowStartFloor is the share of its weight a backend gets the moment it becomes usable;
// it rises linearly to 1 over its SlowStart window. Envoy's default minimum is 10% too:
// starting at 0 would send the backend nothing at all for the first instants.
const SlowStartFloor = 0.1

// SlowStartFactor is the slow start multiplier in [SlowStartFloor, 1] of a backend
// that became usable elapsed ago, with a window of window (0: no slow start). Every
// data plane ramps by it: the proxy's balancers on each pick, the XDP lookup tables
// (and the proxy's Maglev tables) in steps the agent rebuilds.
func SlowStartFactor(elapsed, window time.Duration) float64 {
	if window <= 0 || elapsed >= window {
		return 1
	}
	elapsed = max(elapsed, 0)
	return SlowStartFloor + (1-SlowStartFloor)*float64(elapsed)/float64(window)
}

// factor returns the slow start multiplier at time now.
func (e *entry) factor(now int64) float64 {
	if e.rampLen == 0 {
		return 1
	}
	return SlowStartFactor(time.Duration(now-e.rampStart), time.Duration(e.rampLen))
}

// snapshot is an immutable view of the usable backends, swapped whole by SetBackends.
type snapshot struct {
	entries []entry // usable with weight > 0, in the caller's order
	// rampEnd is when the last slow start window ends; rampDone is set by the first
	// Pick after it, so later picks skip reading the clock.
	rampEnd  int64
	rampDone atomic.Bool
	table    []uint32 // Maglev lookup table, indexes into entries (maglev/source_hash)
	table2   []uint32 // maglev_p2c's second table, from P2CSeed
}

// ramping reports whether any entry may still be in its slow start window; only then
// does Pick pay for reading the clock.
func (s *snapshot) ramping(c *core) (now int64, ok bool) {
	if s.rampEnd == 0 || s.rampDone.Load() {
		return 0, false
	}
	now = c.now()
	if now >= s.rampEnd {
		s.rampDone.Store(true)
		return now, false
	}
	return now, true
}

// core is what every algorithm shares: the snapshot, the known backends and the
// random source.
type core struct {
	snap atomic.Pointer[snapshot]
	seed uint64
	now  func() int64
	ctr  atomic.Uint64 // round robin's position
	// rctr is the seeded random stream's position, apart from ctr: sharing one counter,
	// round robin under slow start would advance by two and visit every other backend.
	rctr atomic.Uint64

	ewma *ewmaShared // ewma and least_time only
	// average: least_time's plain decaying average, where ewma takes a slower
	// sample at once (peak).
	average bool
	maglev  bool // build a lookup table with each snapshot
	second  bool // and a second one (maglev_p2c)

	mu sync.Mutex // serialises SetBackends and guards known
	// known holds every current backend and removed ones still in flight, so a backend
	// removed and re-added while connections are open keeps its count.
	known map[string]*backend

	self Balancer // the algorithm, for a pick made again (lease)
}

func (c *core) SetBackends(backends []Backend) { c.set(backends, false) }

func (c *core) set(backends []Backend, initial bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	s := &snapshot{entries: make([]entry, 0, len(backends))}
	var down []Backend // weighted but not usable: their table slots are spilled, not rebuilt
	live := make(map[string]bool, len(backends))
	for _, cfg := range backends {
		if live[cfg.ID] {
			continue // a duplicate ID: the first one wins (New rejects duplicates outright)
		}
		live[cfg.ID] = true
		b := c.known[cfg.ID]
		if b == nil {
			b = &backend{id: cfg.ID}
			if c.ewma != nil {
				b.ewma = &ewmaState{shared: c.ewma, average: c.average}
			}
			c.known[cfg.ID] = b
		}
		usable := cfg.Usable && cfg.Weight > 0
		if usable && !b.wasUsable {
			b.rampStart = now
			if initial {
				b.rampStart = now - int64(cfg.SlowStart) // the initial set starts at full weight
			}
			b.current = 0 // a returning backend gets no burst from old SWRR credit
			if b.ewma != nil && !initial {
				// Its latencies before it left (failures that got it taken out, or
				// answers from before a restart) say nothing of how it answers now.
				b.ewma.forget()
			}
		}
		b.wasUsable = usable
		if !usable {
			if cfg.Weight > 0 {
				down = append(down, Backend{ID: cfg.ID, Weight: cfg.Weight})
			}
			continue
		}
		e := entry{b: b, weight: cfg.Weight, ramp: cfg.Ramp}
		if cfg.SlowStart > 0 && now < b.rampStart+int64(cfg.SlowStart) {
			e.rampStart, e.rampLen = b.rampStart, int64(cfg.SlowStart)
			s.rampEnd = max(s.rampEnd, e.rampStart+e.rampLen)
		}
		s.entries = append(s.entries, e)
	}
	if c.maglev && len(s.entries) > 0 {
		s.table = buildTable(s.entries, down, c.seed)
		if c.second {
			s.table2 = buildTable(s.entries, down, P2CSeed(c.seed))
		}
	}
	c.snap.Store(s)
	// Forget removed backends once nothing is in flight on them, after the new
	// snapshot is out: a Pick still reading an older one that chooses a forgotten
	// backend finds its acquire refused, and picks again from the new one, which
	// does not hold it. Its lease is never on an object InFlight no longer sees.
	for id, b := range c.known {
		if !live[id] {
			b.wasUsable = false
			if b.inflight.CompareAndSwap(0, forgotten) {
				delete(c.known, id)
			}
		}
	}
}

// buildTable builds the lookup table over the usable entries and the weighted
// backends that are down (after them, so every table index names an entry: BuildMaglev
// gives the down ones no slot), so that a backend going down moves only its own keys.
func buildTable(entries []entry, down []Backend, seed uint64) []uint32 {
	bs := make([]Backend, len(entries), len(entries)+len(down))
	for i, e := range entries {
		bs[i] = Backend{ID: e.b.id, Weight: e.weight, Usable: true, Ramp: e.ramp}
	}
	bs = append(bs, down...)
	t, err := BuildMaglev(bs, MaglevSize(len(bs)), seed)
	if err != nil {
		// Unreachable: IDs are unique, an entry is usable and MaglevSize is a prime
		// >= len(bs). A panic here means BuildMaglev's contract changed.
		panic(fmt.Sprintf("balance: build maglev table: %v", err))
	}
	return t
}

// InFlight returns the in-flight count for metrics (0 if unknown ID).
func (c *core) InFlight(id string) int {
	c.mu.Lock()
	b := c.known[id]
	c.mu.Unlock()
	if b == nil {
		return 0
	}
	return int(b.inflight.Load())
}

// Estimate returns the backend's latency estimate as Pick would read it now.
func (c *core) Estimate(id string) (time.Duration, bool) {
	if c.ewma == nil {
		return 0, false
	}
	c.mu.Lock()
	b := c.known[id]
	c.mu.Unlock()
	if b == nil {
		return 0, false
	}
	est, seen := b.ewma.read(c.now(), c.ewma.neutral())
	return time.Duration(est), seen
}

// rand returns a source for one Pick. Seeded balancers draw from a counter-based stream
// (reproducible for a single goroutine); unseeded ones from the runtime's per-thread
// generator, which shares no cache line between goroutines.
func (c *core) rand() splitmix {
	if c.seed == 0 {
		return splitmix(rand.Uint64())
	}
	return splitmix(mix64(c.seed + c.rctr.Add(1)*0x9e3779b97f4a7c15))
}

// splitmix is a tiny generator for the few random numbers one Pick needs.
type splitmix uint64

func (s *splitmix) next() uint64 {
	*s += 0x9e3779b97f4a7c15
	return mix64(uint64(*s))
}

// intn returns a number in [0, n) by Lemire's multiply-shift (bias below 2^-32 for the
// sizes used here, cheaper than a division).
func (s *splitmix) intn(n int) int {
	return int((s.next() >> 32) * uint64(n) >> 32)
}

// float returns a number in [0, 1).
func (s *splitmix) float() float64 {
	return float64(s.next()>>11) / (1 << 53)
}

// lease takes an in-flight slot on b, which the Pick for key and skip chose; if
// SetBackends has forgotten b meanwhile, it picks again (from a snapshot without b).
func (c *core) lease(b *backend, key uint64, skip func(id string) bool) (Lease, error) {
	if b.acquire() {
		l := Lease{b: b}
		if b.ewma != nil {
			l.gen = b.ewma.gen.Load()
		}
		return l, nil
	}
	return c.self.Pick(key, skip)
}
