// Package plan is the agent's planner: a pure function from what the agent knows
// (the config, each backend's health, runtime overrides, resolved MACs and where
// each service runs) to the state the data planes should be in, and the diff of two
// such states as operations for the planes. It does no I/O and reads no clock (the
// caller passes now), so it is tested without a network or BPF.
//
//	Plan(Input, prev Desired) -> Desired   what should run
//	Diff(prev, next Desired)  -> []Op      what to do to the planes to get there
//
// prev is what runs now: the planner reads from it only what history decides — the
// backends a reload removed that still drain in XDP, and which backends
// all_down: keep_last keeps.
package plan

import (
	"net"
	"net/netip"
	"reflect"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/config"
)

// Plane names a data plane.
type Plane string

// Data planes.
const (
	XDP   Plane = "xdp"
	Proxy Plane = "proxy"
	HTTP  Plane = "http"
)

// Placement is where a service runs and why. The agent decides it (XDP self-tests
// are I/O) when a service is added or must be built anew.
type Placement struct {
	Plane Plane
	Why   string
}

// Health is the health checker's verdict on one backend.
type Health struct {
	State  health.State
	Usable bool // may take new flows (panic mode makes down backends usable)
}

// Override is a runtime change made through the admin API; it lasts until undone
// or the agent restarts, across reloads.
type Override struct {
	Weight    uint32
	SetWeight bool
	Drain     bool
	SetDrain  bool
}

// MAC is what the neighbour table says of a dsr backend's address.
type MAC struct {
	Addr net.HardwareAddr // nil while unknown
	Err  string           // why it is unknown
}

// Input is everything the planner knows.
type Input struct {
	Services  []config.Service
	Placement map[string]Placement // by service name; every service must have one
	Health    map[string]Health    // by backend ID; missing: the backend's initial state
	Overrides map[string]Override  // by backend ID
	MACs      map[netip.Addr]MAC   // dsr backends without a configured MAC
	// FlowIdle is how long the XDP program remembers an idle established flow (as
	// loaded): a backend removed while drain_timeout is 0 (no limit) leaves the
	// program after it, when its flows would be forgotten anyway.
	FlowIdle time.Duration
	Now      time.Time
}

// Desired is the state the data planes should be in: the services in config order.
type Desired struct {
	Services []Service
}

// Service returns the named service, or nil.
func (d *Desired) Service(name string) *Service {
	for i := range d.Services {
		if d.Services[i].Config.Name == name {
			return &d.Services[i]
		}
	}
	return nil
}

// Service is one service as its data plane should serve it.
type Service struct {
	Config config.Service
	Placement
	// Installed: XDP has the service in its program (false while all_down: pass
	// hands its packets to the host's stack). Always true on the proxy.
	Installed bool
	AllDown   bool   // no backend is usable: all_down applies
	Note      string // what all_down or draining is doing, for status and logs
	Backends  []Backend
	// Leaving are backends a reload removed from an XDP service: they stay in the
	// program as draining (no new flows; established flows go on) until their Until.
	// The proxy drains removed backends itself.
	Leaving []Backend
}

// Name is the service's name.
func (s *Service) Name() string { return s.Config.Name }

// Backend returns the service's backend at addr, or nil.
func (s *Service) Backend(addr netip.AddrPort) *Backend {
	for i := range s.Backends {
		if s.Backends[i].Config.Addr == addr {
			return &s.Backends[i]
		}
	}
	return nil
}

// WeightSum is the total weight of the service's backends.
func (s *Service) WeightSum() uint64 {
	sum := uint64(0)
	for _, b := range s.Backends {
		sum += uint64(b.Weight)
	}
	return sum
}

// Backend is one backend as its data plane should see it.
type Backend struct {
	ID      string // the health checker's: "service/address"
	Config  config.Backend
	Health  health.State
	Healthy bool // health's verdict
	// Usable is what the data plane is told: health's verdict, then all_down, and
	// for XDP dsr a known MAC.
	Usable   bool
	Weight   uint32 // in effect: the override's, else the file's
	Drained  bool   // in effect
	Override bool   // a runtime weight or drain is in effect
	// WeightOverride and DrainOverride say which (status marks that column).
	WeightOverride, DrainOverride bool
	MAC                           net.HardwareAddr
	MACErr                        string
	// Kept: usable the last time some backend was; all_down: keep_last keeps these.
	Kept bool
	// Until is when a leaving backend leaves the program.
	Until time.Time
	// RampStart is when the backend began its slow start (zero: not ramping), and
	// Ramp the part of its share its lookup table gives it meanwhile, in units of
	// balance.RampFull (0: all); see slowstart.go and TableShare.
	RampStart time.Time
	Ramp      uint32
}

// Reason says, in operator words, why a backend takes no new flows ("" if it takes
// them): health, an unknown MAC, a drain, weight 0; or that all_down or panic
// keeps it although its health says otherwise.
func (b *Backend) Reason() string {
	switch {
	case b.Usable && !b.Healthy:
		return "kept by all_down: keep_last although health says " + b.Health.String()
	case !b.Healthy:
		return "health: " + b.Health.String()
	case !b.Usable && b.MACErr != "":
		return "mac unknown: " + b.MACErr
	case !b.Usable:
		return "mac unknown (dsr needs it; weir resolves it every second)"
	case b.Drained:
		return "drained"
	case b.Weight == 0:
		return "weight 0"
	case b.Health != health.Up:
		// The checker calls a backend usable that is not up only in panic.
		return "panic: too few of the service's backends are up, so all are used although health says " + b.Health.String()
	}
	return ""
}

// ID is a backend's identity for the health checker and overrides.
func ID(service string, addr netip.AddrPort) string { return service + "/" + addr.String() }

// Rebuilt says whether a changed service must be built anew rather than updated in
// place: its VIP, protocol, requested data plane, mode, algorithm, drain timeout or
// a proxy or http setting (fixed when the proxy or the http plane listens) changed. The agent decides its
// placement again; the proxy gives it a new listener.
func Rebuilt(a, b *config.Service) bool {
	return a.VIP != b.VIP || a.Protocol != b.Protocol || a.DataPlane != b.DataPlane || a.Mode != b.Mode ||
		a.Algorithm != b.Algorithm || a.Proxy != b.Proxy || a.DrainTimeout != b.DrainTimeout ||
		!reflect.DeepEqual(a.HTTP, b.HTTP)
}

// Plan computes the desired state.
func Plan(in Input, prev Desired) Desired {
	var d Desired
	for _, cs := range in.Services {
		d.Services = append(d.Services, planService(in, cs, prev.Service(cs.Name)))
	}
	return d
}

func planService(in Input, cs config.Service, prev *Service) Service {
	s := Service{Config: cs, Placement: in.Placement[cs.Name], Installed: true}
	xdp := s.Plane == XDP
	needMAC := xdp && cs.Mode == config.ModeDSR
	for _, cb := range cs.Backends {
		b := Backend{ID: ID(cs.Name, cb.Addr), Config: cb, Weight: cb.Weight, Drained: cb.Drain}
		switch h, ok := in.Health[b.ID]; {
		case ok:
			b.Health, b.Healthy = h.State, h.Usable
		case cs.Health.Type == config.CheckNone:
			b.Health, b.Healthy = health.Up, true // as the checker has it
		default:
			b.Health = InitialState(cb.Initial)
			b.Healthy = cb.Initial == config.InitialUp
		}
		if o, ok := in.Overrides[b.ID]; ok {
			if o.SetWeight {
				b.Weight, b.Override, b.WeightOverride = o.Weight, true, true
			}
			if o.SetDrain {
				b.Drained, b.Override, b.DrainOverride = o.Drain, true, true
			}
		}
		b.Kept = b.Healthy && b.Weight > 0
		if prev != nil {
			if pb := prev.Backend(cb.Addr); pb != nil {
				b.Kept = pb.Kept
			}
		}
		if cs.Mode == config.ModeDSR {
			b.MAC = cb.MAC
			if b.MAC == nil {
				m := in.MACs[cb.Addr.Addr()]
				b.MAC, b.MACErr = m.Addr, m.Err
			}
		}
		s.Backends = append(s.Backends, b)
	}
	s.applyAllDown(needMAC)
	s.applySlowStart(prev, in.Now)
	if xdp {
		s.Installed = !(s.AllDown && cs.AllDown == config.AllDownPass)
		if prev != nil && prev.Plane == XDP && prev.Config.VIP == cs.VIP && prev.Config.Protocol == cs.Protocol {
			s.Leaving = leaving(prev, &s, in.Now, in.FlowIdle)
		}
	}
	return s
}

// applyAllDown decides which backends the data plane is told are usable.
func (s *Service) applyAllDown(needMAC bool) {
	// Draining is not being down: a drained backend keeps its established flows
	// whatever all_down says, and a service whose every backend is drained takes no
	// new flows but keeps serving the ones it has.
	some, undrained := false, false
	for i := range s.Backends {
		b := &s.Backends[i]
		b.Usable = b.Healthy && (!needMAC || b.MAC != nil)
		if b.Usable && b.Weight > 0 {
			some = true
			undrained = undrained || !b.Drained
		}
	}
	s.AllDown = !some
	if some {
		if !undrained {
			s.Note = "every usable backend is drained: new flows are refused, established ones continue"
		}
		for i := range s.Backends {
			b := &s.Backends[i]
			b.Kept = b.Usable && b.Weight > 0
		}
		return
	}
	// Healthy backends without a MAC make the service unusable, not down: say so.
	for _, b := range s.Backends {
		if b.Healthy && b.Weight > 0 && needMAC && b.MAC == nil {
			s.Note = "no backend is usable: the healthy ones have no known MAC (dsr; see each backend's reason): new flows are dropped"
			if s.Config.AllDown == config.AllDownPass {
				s.Note = "no backend is usable: the healthy ones have no known MAC (dsr; see each backend's reason): packets pass to the host's stack (all_down: pass)"
			}
			return
		}
	}
	switch s.Config.AllDown {
	case config.AllDownKeepLast:
		kept := false
		for i := range s.Backends {
			b := &s.Backends[i]
			if b.Kept && (!needMAC || b.MAC != nil) {
				b.Usable, kept = true, true
			}
		}
		s.Note = "every backend is down: keeping the last usable ones (all_down: keep_last)"
		if !kept {
			s.Note = "every backend is down and none was ever usable: dropping (all_down: keep_last)"
		}
	case config.AllDownPass:
		if s.Plane == XDP {
			s.Note = "every backend is down: packets pass to the host's stack (all_down: pass)"
		} else {
			s.Note = "every backend is down: the proxy closes new connections (all_down: pass is XDP only)"
		}
	default:
		s.Note = "every backend is down: new flows are dropped (all_down: drop)"
	}
}

// leaving is prev's leavers whose time is not up and that did not come back, and
// the backends prev had that next does not, draining until now + drain_timeout.
func leaving(prev, next *Service, now time.Time, flowIdle time.Duration) []Backend {
	d := next.Config.DrainTimeout
	if d == 0 {
		d = flowIdle
	}
	var out []Backend
	for _, l := range prev.Leaving {
		if now.Before(l.Until) && next.Backend(l.Config.Addr) == nil {
			out = append(out, l)
		}
	}
	for _, b := range prev.Backends {
		if next.Backend(b.Config.Addr) == nil {
			b.Until = now.Add(d)
			b.Drained = true
			out = append(out, b)
		}
	}
	return out
}

// InitialState is the health state a backend starts in.
func InitialState(i config.Initial) health.State {
	switch i {
	case config.InitialUp:
		return health.Up
	case config.InitialDown:
		return health.Down
	}
	return health.Unknown
}
