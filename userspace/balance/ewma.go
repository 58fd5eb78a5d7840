package balance

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// ewmaDecay is the time constant of the latency estimates, Finagle's and Linkerd's
// default: a sample's weight is 1-exp(-elapsed/decay), so the estimate follows the
// time between observations rather than their count, and a fast-serving backend's
// many samples don't wash out a slow one's few.
const ewmaDecay = 10 * time.Second

// averageStep is the least weight a least_time sample carries, as if this much
// time had passed since the last: 1-exp(-0.1s/10s), about 1 %, so a hundred
// samples move the average most of the way.
const averageStep = 100 * time.Millisecond

// failPenaltyFactor: a failed connect counts as a sample this many times the
// balancer-wide average latency, so a backend that refuses connections quickly doesn't
// look fast (the black-hole effect of least-loaded algorithms).
const failPenaltyFactor = 5

// initialEstimate stands in for the balancer-wide average in a failure's penalty
// while no backend has answered yet (Linkerd's default RTT for a new endpoint), so a
// backend that fails its connects before the first answer isn't recorded as fast.
const initialEstimate = 30 * time.Millisecond

// ewmaShared is the balancer-wide latency average, the neutral estimate an idle
// backend's estimate decays toward.
type ewmaShared struct {
	now  func() int64
	bits atomic.Uint64 // float64 ns, read lock-free by Pick

	mu    sync.Mutex
	est   float64
	stamp int64
	seen  bool
}

func newEWMAShared(now func() int64) *ewmaShared { return &ewmaShared{now: now} }

func (g *ewmaShared) neutral() float64 { return math.Float64frombits(g.bits.Load()) }

func (g *ewmaShared) observe(now int64, sample float64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.seen {
		g.est, g.seen = sample, true
	} else {
		g.est = decayToward(g.est, sample, now-g.stamp)
	}
	g.stamp = now
	g.bits.Store(math.Float64bits(g.est))
}

// decayToward moves from old toward target by the share of time elapsed ns has taken.
func decayToward(old, target float64, elapsed int64) float64 {
	if elapsed <= 0 {
		return old
	}
	w := math.Exp(-float64(elapsed) / float64(ewmaDecay))
	return target + (old-target)*w
}

// ewmaState is one backend's peak-EWMA latency estimate.
type ewmaState struct {
	shared  *ewmaShared
	average bool // least_time: no peak, every sample decays in

	mu    sync.Mutex
	est   float64 // ns
	stamp int64   // monotonic ns of the last observation
	seen  bool

	// probed: when Pick last sent the backend a probe (see dueProbe).
	probed perDecay
	// untriedWon: when the backend last won a draw for having no sample (see
	// claimUntried).
	untriedWon perDecay
	// gen counts forget's starts over. A lease carries the generation it was
	// picked in, and an outcome from an earlier one is not a sample: a connection
	// picked before the backend went down and ending after it came back (a
	// request hung until its timeout) tells nothing of the backend as it is now,
	// and its failure, five times the average, would be the fresh estimate's first
	// sample.
	gen atomic.Uint32 // written under mu
}

// perDecay is the time of the last of something allowed once per ewmaDecay,
// taken by one Pick among concurrent ones.
type perDecay struct {
	last atomic.Int64 // 1 + monotonic ns; 0: never
}

// due reports whether ewmaDecay has passed since the last one (or there was none).
func (d *perDecay) due(now int64) bool { return decayedSince(d.last.Load(), now) }

// claim records one at now; false if it is not due or another Pick took it first.
func (d *perDecay) claim(now int64) bool {
	last := d.last.Load()
	return decayedSince(last, now) && d.last.CompareAndSwap(last, now+1)
}

func decayedSince(last, now int64) bool { return last == 0 || now-(last-1) >= int64(ewmaDecay) }

// dueProbe reports whether a backend whose last sample was idle ns ago, with
// inflight connections, is due a probe at now: it has nothing in flight, and
// neither a sample nor a probe for ewmaDecay. At light load every connection finds
// every backend idle, and P2C then always prefers the lower estimate: a backend
// that was slow once would get no connection, so no sample to show it is fast
// again, until its estimate had decayed to the others' (measured: one 50 ms first
// answer among 1 ms ones kept a backend out for 50 s under ewma, 80 s under
// least_time, at 100 connections/s). A probe costs a slow backend one connection
// per ewmaDecay.
func (s *ewmaState) dueProbe(now, idle, inflight int64) bool {
	return inflight == 0 && idle >= int64(ewmaDecay) && s.probed.due(now)
}

// claimProbe records a probe sent at now; false if another Pick sent it first.
func (s *ewmaState) claimProbe(now int64) bool { return s.probed.claim(now) }

// claimUntried records that a backend with no sample of its own wins a draw at
// now; false if it has won one in the last ewmaDecay (a backend whose connections
// never bring a sample, one that accepts and never answers, say, would otherwise
// win every draw it is in while nothing is in flight) or another Pick won it
// first (so concurrent Picks send a new backend one connection, not a burst).
func (s *ewmaState) claimUntried(now int64) bool { return s.untriedWon.claim(now) }

// estimate returns the backend's latency estimate at now: the last estimate, decayed
// toward the balancer-wide average by the time since its last observation, so a backend
// nobody has tried for a while (because it was slow once) gets tried again.
func (s *ewmaState) estimate(now int64, neutral float64) float64 {
	est, _ := s.read(now, neutral)
	return est
}

// read is estimate, and whether the backend has had a sample of its own.
func (s *ewmaState) read(now int64, neutral float64) (float64, bool) {
	est, seen, _ := s.look(now, neutral)
	return est, seen
}

// look is read, and how long ago the last sample came (0 if none has).
func (s *ewmaState) look(now int64, neutral float64) (est float64, seen bool, idle int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.seen {
		return neutral, false, 0
	}
	return decayToward(s.est, neutral, now-s.stamp), true, now - s.stamp
}

// forget drops the estimate of a backend that becomes usable again: it starts over
// as a backend with no sample (the balancer-wide average, one draw won once per
// ewmaDecay), as Finagle and Linkerd start a node that rejoins their set. Left, the
// failures that took it out (each five times the average) would keep it out at light
// load until ewmaDecay after its last sample; answers from before a restart would
// flood or starve it by what they said then. Its draw won as a new backend, and its
// last probe, go too: a backend back within ewmaDecay of winning one would otherwise
// win no draw at light load (its estimate, the average, a hair above the tried
// backends') until ewmaDecay after it.
func (s *ewmaState) forget() {
	s.mu.Lock()
	s.est, s.stamp, s.seen = 0, 0, false
	s.gen.Add(1)
	s.mu.Unlock()
	s.untriedWon.last.Store(0)
	s.probed.last.Store(0)
}

// observe records the outcome of a connection picked in generation gen (see gen).
func (s *ewmaState) observe(r Result, gen uint32) {
	sample := float64(r.Latency)
	if r.Failed {
		base := s.shared.neutral()
		if base <= 0 {
			base = float64(initialEstimate)
		}
		sample = max(sample, failPenaltyFactor*base)
	}
	if sample <= 0 {
		return // latency unknown: only the in-flight count changes
	}
	now := s.shared.now()
	s.mu.Lock()
	if s.gen.Load() != gen {
		s.mu.Unlock()
		return // picked before the backend started over
	}
	switch {
	case !s.seen, now-s.stamp >= int64(ewmaDecay):
		// A first sample, or the first after ewmaDecay without one (a probe's):
		// what the estimate said then is too old to weigh against it.
		s.est = sample
	case !s.average && sample > s.est:
		// Peak: a slower sample replaces the estimate at once, so load moves off a
		// slowing backend on its first slow answer rather than after many.
		s.est = sample
	case s.average:
		// Decay by time as ewma does, but with a floor per sample: a busy
		// backend's samples come microseconds apart, and by time alone each
		// would barely move the average.
		s.est = decayToward(s.est, sample, max(now-s.stamp, int64(averageStep)))
	default:
		s.est = decayToward(s.est, sample, now-s.stamp)
	}
	s.stamp, s.seen = now, true
	s.mu.Unlock()
	if !r.Failed {
		s.shared.observe(now, sample)
	}
}
