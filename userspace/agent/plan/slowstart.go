package plan

import (
	"math"
	"time"

	"github.com/weir-lb/weir/userspace/balance"
)

// slowstart.go: slow start for the data planes that pick by a lookup table (XDP, and
// the proxy's maglev and source_hash). A table cannot ramp per pick as the proxy's
// other balancers do, so the planner ramps it in steps: each time it plans (the
// agent's loop plans every tick while a backend ramps) a ramping backend's Ramp is
// balance.SlowStartFactor, the same curve the proxy's balancers follow, and the table
// gives it that part of its weight's share (balance.Backend.Ramp): its weight stays
// in the table's base, so a step moves only its own slots. A step only rebuilds the
// table, which decides new flows: the connection table keeps every established flow
// where it is.

// SteppedSlowStart reports whether the planner ramps s's backends in table steps
// (XDP; the proxy's maglev and source_hash) rather than its data plane per pick.
func (s *Service) SteppedSlowStart() bool {
	return s.Config.SlowStart > 0 && (s.Plane == XDP || s.Config.Algorithm.XDP())
}

// takesNew reports whether a backend may be given new flows.
func (b *Backend) takesNew() bool { return b.Usable && !b.Drained && b.Weight > 0 }

// TableShare is the part of its weight's share the backend's lookup table gives it:
// below 1 while it ramps in table steps (see Ramp).
func (b *Backend) TableShare() float64 {
	if b.Ramp == 0 || b.Ramp >= balance.RampFull {
		return 1
	}
	return float64(b.Ramp) / balance.RampFull
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
// tracked on every plane (status shows them); table shares are stepped only where
// SteppedSlowStart, the proxy's other balancers ramping by themselves.
func (s *Service) applySlowStart(prev *Service, now time.Time) {
	if s.Config.SlowStart <= 0 || prev == nil || prev.Plane != s.Plane || Rebuilt(&prev.Config, &s.Config) {
		return
	}
	window := s.Config.SlowStart
	ramping := false
	for i := range s.Backends {
		b := &s.Backends[i]
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
	for i := range s.Backends {
		if b := &s.Backends[i]; b.Ramping() {
			b.Ramp = Ramp(now.Sub(b.RampStart), window)
		}
	}
}

// Ramp is a ramping backend's balance.Backend.Ramp after elapsed of a slow start of
// window: balance.SlowStartFactor in units of balance.RampFull, rounded, at least 1
// and short of RampFull (which would end the ramp).
func Ramp(elapsed, window time.Duration) uint32 {
	r := math.Round(balance.SlowStartFactor(elapsed, window) * balance.RampFull)
	return uint32(min(max(r, 1), balance.RampFull-1))
}
