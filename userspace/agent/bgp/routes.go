// Package bgp is the node's BGP speaker: GoBGP (github.com/osrg/gobgp/v4) embedded as
// a library, fed by the agent's desired state. The agent's loop publishes a desired
// state after every event; Routes turns it into the VIP routes the node should
// announce (a pure function), and Speaker.Announce hands them to the speaker, which
// adds and withdraws the difference while its sessions run.
//
// A VIP (/32 or /128) is announced while at least one service on it has a usable
// backend that passes its health checks (and one of whose backends has passed a
// check since the agent started), on a data plane that took it (an XDP service passed its self-test when it
// was placed); it is withdrawn when none has, when the node is drained, and when the
// agent stops (the sessions end with a Cease notification). A process that dies
// without stopping closes its TCP sessions through the kernel, so the routers
// withdraw at once; a node that stops answering without closing them (frozen, or
// its link or kernel gone) is withdrawn by the routers' hold timers.
package bgp

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// Route is one VIP route the node announces.
type Route struct {
	Prefix      netip.Prefix
	Services    []string // the services that keep it up, in config order
	Communities []uint32 // ASN<<16 | value
	MED         uint32
	LocalPref   uint32
}

// Withheld is a VIP that is not announced, and why.
type Withheld struct {
	Prefix netip.Prefix
	Why    string
}

func (r *Route) equal(o *Route) bool {
	return r.Prefix == o.Prefix && slices.Equal(r.Communities, o.Communities) && r.MED == o.MED && r.LocalPref == o.LocalPref
}

// Routes returns the routes the node should announce for d, by prefix in config
// order, and the VIPs it should not, with why. drained withdraws everything.
// confirmed reports whether one of a service's backends (by service name) has
// passed an active check since the agent started: backends that start up
// (health.initial: up) keep their service's VIP withdrawn until a check has
// confirmed one, so a node whose backends are dead at start never announces.
// Once confirmed, a service counts the backends a reload gives it at once, as
// the data planes do.
func Routes(d *plan.Desired, drained bool, confirmed func(service string) bool) ([]Route, []Withheld) {
	var routes []Route
	var withheld []Withheld
	why := map[netip.Prefix][]string{}
	for i := range d.Services {
		s := &d.Services[i]
		if !s.Config.BGP.Enabled {
			continue
		}
		addr := s.Config.VIP.Addr()
		p := netip.PrefixFrom(addr, addr.BitLen())
		reason := ""
		switch {
		case drained:
			reason = "the node is drained (weir node undrain announces again)"
		case !s.Installed:
			reason = fmt.Sprintf("%s: out of the data plane: %s", s.Name(), s.Note)
		case !usable(s):
			reason = s.Name() + ": no backend usable and up"
		case s.Config.Health.Type != config.CheckNone && !confirmed(s.Name()):
			reason = s.Name() + ": waiting for the first health checks of its backends"
		}
		j := slices.IndexFunc(routes, func(r Route) bool { return r.Prefix == p })
		if reason != "" {
			if !slices.Contains(why[p], reason) {
				why[p] = append(why[p], reason)
			}
			continue
		}
		if j < 0 {
			a := s.Config.BGP
			routes = append(routes, Route{Prefix: p, Communities: a.Communities, MED: a.MED, LocalPref: a.LocalPref})
			j = len(routes) - 1
		}
		routes[j].Services = append(routes[j].Services, s.Name())
	}
	for i := range d.Services {
		addr := d.Services[i].Config.VIP.Addr()
		p := netip.PrefixFrom(addr, addr.BitLen())
		if w, ok := why[p]; ok && !slices.ContainsFunc(routes, func(r Route) bool { return r.Prefix == p }) &&
			!slices.ContainsFunc(withheld, func(x Withheld) bool { return x.Prefix == p }) {
			withheld = append(withheld, Withheld{Prefix: p, Why: strings.Join(w, "; ")})
		}
	}
	return routes, withheld
}

// usable reports whether s has a backend that may take new flows and passes its
// health checks: panic mode and all_down: keep_last send flows to backends that are
// down, but a node whose backends are all down attracts nothing.
func usable(s *plan.Service) bool {
	if s.AllDown {
		return false
	}
	for _, b := range s.Backends {
		if b.Usable && b.Health == health.Up && b.Weight > 0 && !b.Drained {
			return true
		}
	}
	return false
}
