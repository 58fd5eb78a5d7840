package plan

import (
	"math"
	"time"

	"github.com/weir-lb/weir/userspace/balance"
	"github.com/weir-lb/weir/userspace/config"
)

// slowstart.go: slow start for the data planes that pick by a lookup table (XDP, and
// the proxy's maglev and source_hash). A table cannot ramp per pick as the proxy's
// other balancers do, so the planner ramps it in steps: each time it plans (the
// agent's loop plans every tick while a backend ramps) a ramping backend's table
// weight is its weight times balance.SlowStartFactor, the same curve the proxy's
// balancers follow. A step only rebuilds the table, which decides new flows: the
// connection table keeps every established flow where it is.

// slowStartScale is how finely a ramp is stepped: while a backend of a service
// ramps, every table weight of the service is its weight times this (less if that
// would pass config.MaxWeight), so a ramping weight-1 backend can hold a tenth of its
// share. Multiplying every weight by one number gives the same Maglev table, so the
// ramp's last step is the table the backend's full weight gives.
const slowStartScale = 100

// SteppedSlowStart reports whether the planner ramps s's backends in table steps
// (XDP; the proxy's maglev and source_hash) rather than its data plane per pick.
func (s *Service) SteppedSlowStart() bool {
	return s.Config.SlowStart > 0 && (s.Plane == XDP || s.Config.Algorithm.XDP())
}

// takesNew reports whether a backend may be given new flows.
func (b *Backend) takesNew() bool { return b.Usable && !b.Drained && b.Weight > 0 }

// TableWeight is the weight the backend's lookup table is built with: its weight,
// or while a backend of its service ramps, the scaled step (see slowStartScale).
func (b *Backend) TableWeight() uint32 {
	if b.RampWeight > 0 {
		return b.RampWeight
	}
	return b.Weight
}

// Ramping reports whether the backend is in its slow start.
func (b *Backend) Ramping() bool { return !b.RampStart.IsZero() }

// SlowStartFactor is the share of its weight's share the backend gets at now: below 1
// while it ramps (see balance.SlowStartFactor).
func (b *Backend) SlowStartFactor(window time.Duration, now time.Time) float64 {
	if !b.Ramping() {
		return 1
	}
	return balance.SlowStartFactor(now.Sub(b.RampStart), window)
}

// applySlowStart starts, steps and ends the ramps of s's backends. A backend ramps
// when it begins to take new flows in a service that ran before on the same plane
// (added by a reload, back up, undrained, weight raised from 0); a new or rebuilt
// service starts at full weight, as the proxy's balancers start theirs. Ramps are
// tracked on every plane (status shows them); table weights are stepped only where
// SteppedSlowStart, the proxy's other balancers ramping by themselves.
func (s *Service) applySlowStart(prev *Service, now time.Time) {
	if s.Config.SlowStart <= 0 || prev == nil || prev.Plane != s.Plane || Rebuilt(&prev.Config, &s.Config) {
		return
	}
	window := s.Config.SlowStart
	var maxWeight uint32
	ramping := false
	for i := range s.Backends {
		b := &s.Backends[i]
		maxWeight = max(maxWeight, b.Weight)
		if !b.takesNew() {
			continue
		}
		switch pb := prev.Backend(b.Config.Addr); {
		case pb == nil || !pb.takesNew():
			b.RampStart = now
		default:
			b.RampStart = pb.RampStart
		}
		if b.Ramping() && now.Sub(b.RampStart) >= window {
			b.RampStart = time.Time{}
		}
		ramping = ramping || b.Ramping()
	}
	if !ramping || !s.SteppedSlowStart() {
		return
	}
	scale := SlowStartScale(maxWeight)
	for i := range s.Backends {
		b := &s.Backends[i]
		b.RampWeight = RampWeight(b.Weight, scale, now.Sub(b.RampStart), window, b.Ramping())
	}
}

// SlowStartScale is what every table weight of a service is multiplied by while one
// of its backends ramps: slowStartScale, or less so the largest weight stays within
// config.MaxWeight.
func SlowStartScale(maxWeight uint32) uint32 {
	if maxWeight == 0 {
		return slowStartScale
	}
	return max(1, min(slowStartScale, config.MaxWeight/maxWeight))
}

// RampWeight is a backend's table weight while its service ramps: weight × scale,
// and for a ramping backend that times balance.SlowStartFactor(elapsed, window),
// rounded, at least 1. Weight 0 stays 0.
func RampWeight(weight, scale uint32, elapsed, window time.Duration, ramping bool) uint32 {
	w := weight * scale
	if w == 0 || !ramping {
		return w
	}
	return max(1, uint32(math.Round(float64(w)*balance.SlowStartFactor(elapsed, window))))
}
