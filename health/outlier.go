package health

import (
	"container/heap"
	"fmt"
	"time"
)

// Observe records what a data plane saw of one connection to backend id.
// Outlier.Consecutive failures in a row eject the backend (see Outlier); a
// Success ends the run. Outcomes for unknown or removed backends are ignored,
// since connections outlive the backends they went to. It is cheap enough to
// call for every connection: successes and failures below the threshold take
// a read lock and an atomic operation.
func (c *Checker) Observe(id string, o Outcome) {
	c.mu.RLock()
	b := c.backends[id]
	threshold := int32(0)
	if b != nil {
		threshold = int32(b.svc.cfg.Outlier.Consecutive)
	}
	c.mu.RUnlock()
	if b == nil || threshold <= 0 {
		return
	}
	if o == Success {
		// Load first: most successes find the count at zero already, and a
		// load does not bounce the cache line between CPUs as a store does.
		if b.consec.Load() != 0 {
			b.consec.Store(0)
		}
		return
	}
	if b.consec.Add(1) < threshold {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.eject(b, o, c.now())
}

// eject ejects b after a run of passive failures ending with o, unless it is
// gone, already ejected, or the service's MaxEjectionPercent forbids it; c.mu
// must be held.
func (c *Checker) eject(b *backend, o Outcome, now time.Time) {
	n := b.consec.Swap(0)
	s := b.svc
	out := s.cfg.Outlier
	if b.removed || b.ejectIdx >= 0 || !out.passive() || n < int32(out.Consecutive) {
		return
	}
	// Envoy's rule: the first ejection is always allowed, later ones only
	// while the ejected share stays within the cap.
	if s.nEject > 0 && (s.nEject+1)*100 > out.MaxEjectionPercent*len(s.members) {
		return
	}
	b.ejections = b.multiplier(now)
	// The multiplier stops growing once its ejection reaches MaxEjection (as
	// Envoy's does): past that a longer streak would lengthen no ejection,
	// only the time the backend then needs in service to be treated as new.
	if out.BaseEjection*time.Duration(b.ejections) < out.MaxEjection {
		b.ejections++
	}
	d := min(out.BaseEjection*time.Duration(b.ejections), out.MaxEjection)
	b.ejectedUntil = now.Add(d)
	heap.Push(&c.ejected, b)
	s.nEject++
	c.poke()
	c.settle(b, now, fmt.Sprintf("ejected for %v after %d consecutive failures (last: %v)", d, n, o))
}

// multiplier is b's ejection multiplier at now: while b is back in service it
// decays by one for every BaseEjection spent there, so a backend that fails
// once a day is not ejected for MaxEjection each time. c.mu must be held.
func (b *backend) multiplier(now time.Time) int {
	base := b.svc.cfg.Outlier.BaseEjection
	if b.ejectIdx >= 0 || b.returned.IsZero() || base <= 0 {
		return b.ejections
	}
	return max(0, b.ejections-int(now.Sub(b.returned)/base))
}

// unEject ends b's ejection at the time at without settling it; c.mu must be
// held. The backend is back in service from at, so its multiplier decays from
// then, however the ejection ended: ran out, or ended early by a service that
// no longer ejects.
func (c *Checker) unEject(b *backend, at time.Time) {
	heap.Remove(&c.ejected, b.ejectIdx)
	b.svc.nEject--
	b.ejectedUntil = time.Time{}
	b.returned = at
}

// expire ends the ejections due by now; c.mu must be held. A backend whose
// active checks say down stays down.
func (c *Checker) expire(now time.Time) {
	for len(c.ejected) > 0 && !c.ejected[0].ejectedUntil.After(now) {
		b := c.ejected[0]
		c.unEject(b, b.ejectedUntil)
		c.settle(b, now, "ejection ended")
	}
}
