package agent

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/agent/bgp"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/agent/xdpplane"
	"github.com/weir-lb/weir/userspace/config"
	"github.com/weir-lb/weir/userspace/httplb"
	"github.com/weir-lb/weir/userspace/proxy"
)

// snapshot is what the loop publishes after each event. It is never modified once
// published: the loop replaces its desired state wholesale on every change.
type snapshot struct {
	cfg     *config.Config
	started time.Time
	running plan.Desired
	reloads []api.ReloadStatus
	// unapplied: health verdicts the planes refused, nil if none.
	unapplied *api.UnappliedHealth
}

func (a *Agent) publish(st *state) {
	snap := &snapshot{cfg: st.cfg, started: st.started, running: st.running, reloads: slices.Clone(st.reloads)}
	if st.unapplied {
		snap.unapplied = &api.UnappliedHealth{Since: st.unappliedSince, Attempts: st.tries, LastError: st.unappliedErr, NextTry: st.retryAt}
	}
	a.snap.Store(snap)
	if a.bgp != nil {
		a.bgp.Announce(bgp.Routes(&st.running, st.drained, a.confirm(st)))
	}
}

// confirm records which running services have had a backend pass an active
// check since the agent started, and returns that as bgp.Routes' confirmed.
// Backends up by health.initial have not: a node whose backends are dead at
// start would announce its VIPs until the checks had failed fall times. A
// service stays confirmed while it runs, whatever backends a reload gives it,
// and one without active checks is confirmed as it runs, so turning them on
// withdraws nothing. The checker remembers a pass (health.Status.Passed) even
// once a failure has ended its run, so a pass between two publishes counts;
// the loop publishes every second, so a first pass that changes no state
// reaches the routes within a second.
//
// A service found unconfirmed is looked at again only once a backend's first
// pass has come (health.Checker.FirstPasses): the loop publishes after every
// event, and with thousands of dead backends at start, each of their
// verdicts would otherwise ask the checker about every one of them.
func (a *Agent) confirm(st *state) func(service string) bool {
	passes := a.checker.FirstPasses()
	confirmed := make(map[string]bool, len(st.running.Services))
	for _, s := range st.running.Services {
		name := s.Name()
		was, seen := st.confirmed[name]
		confirmed[name] = was || s.Config.Health.Type == config.CheckNone ||
			(!seen || passes != st.passesSeen) && slices.ContainsFunc(s.Backends, func(b plan.Backend) bool {
				hs, ok := a.checker.Status(b.ID)
				return ok && hs.Passed
			})
	}
	st.confirmed, st.passesSeen = confirmed, passes
	return func(service string) bool { return confirmed[service] }
}

// Status returns the agent's state as the loop last published it, with the data
// planes' counters read now.
func (a *Agent) Status() (api.Status, error) {
	snap := a.snap.Load()
	if snap == nil {
		return api.Status{}, ErrNotRunning
	}
	stats, haveStats := a.xdp.Stats()
	st := api.Status{Config: a.opts.ConfigPath, Started: snap.started, Reloads: snap.reloads,
		XDP: a.xdp.Status(snap.cfg.XDP.DetachOnStop), HealthUnapplied: snap.unapplied}
	if a.bgp != nil {
		st.BGP = a.bgp.Status()
	}
	if haveStats {
		st.XDPReasons = make(map[string]uint64, len(stats.Reasons))
		for r, c := range stats.Reasons {
			st.XDPReasons[r.String()] = c.Packets
		}
	}
	now := time.Now()
	tables := a.xdp.Tables()
	for i := range snap.running.Services {
		s := &snap.running.Services[i]
		key := xdpplane.Key(&s.Config)
		ss := api.ServiceStatus{Name: s.Name(), Key: key.String(), DataPlane: string(s.Plane), Why: s.Why,
			Algorithm: string(s.Config.Algorithm), AllDown: s.AllDown, Note: s.Note}
		if s.Config.Health.Type == config.CheckTCP {
			ss.HealthMethod = a.healthMethodStatus(s.Name())
		}
		if s.Plane == plan.XDP {
			ss.Mode = string(s.Config.Mode)
			c := stats.Services[key]
			ss.Packets, ss.Bytes = c.Packets, c.Bytes
			if ti, ok := tables[key]; ok && s.Installed {
				ss.Table = &api.TableStatus{Fingerprint: ti.Fingerprint, Size: ti.Size, Previous: ti.Previous}
				if ti.Previous != "" {
					ss.Table.PreviousAgeSeconds = now.Sub(ti.PreviousSince).Round(time.Second).Seconds()
				}
			}
		}
		switch s.Plane {
		case plan.Proxy:
			st := a.proxy.State(s.Name())
			ss.Down, ss.Restarts = st.Down, st.Restarts
		case plan.HTTP:
			st := a.http.State(s.Name())
			ss.Down, ss.Restarts = st.Down, st.Restarts
		}
		var backSnap map[netip.AddrPort]proxy.BackendSnapshot
		if s.Plane == plan.Proxy {
			if snap, ok := a.proxy.Snapshot(s.Name()); ok {
				ss.Connections, ss.Accepted, ss.AcceptErrors = snap.Active, snap.Accepted, snap.AcceptErrors
				ss.ClientTimeouts = snap.ClientTimeouts
				ss.Bytes = snap.BytesIn + snap.BytesOut
				backSnap = make(map[netip.AddrPort]proxy.BackendSnapshot, len(snap.Backends))
				for _, b := range snap.Backends {
					backSnap[b.Addr] = b
				}
			}
		}
		var httpSnap map[netip.AddrPort]httplb.BackendSnapshot
		if s.Plane == plan.HTTP {
			if snap, ok := a.http.Snapshot(s.Name()); ok {
				ss.Connections, ss.Accepted, ss.InFlight, ss.Requests = snap.Connections, snap.Accepted, snap.InFlight, snap.Requests
				ss.Tunnels, ss.AcceptErrors, ss.ClientTimeouts = snap.Tunnels, snap.AcceptErrors, snap.ClientTimeouts
				httpSnap = make(map[netip.AddrPort]httplb.BackendSnapshot, len(snap.Backends))
				for _, b := range snap.Backends {
					httpSnap[b.Addr] = b
				}
			}
		}
		for _, b := range s.Backends {
			bs := api.BackendStatus{Address: b.Config.Addr.String(), Health: b.Health.String(), Usable: b.Usable, Reason: b.Reason(),
				Weight: b.Weight, ConfigWeight: b.Config.Weight, Drained: b.Drained, Override: b.Override,
				WeightOverride: b.WeightOverride, DrainOverride: b.DrainOverride, MACError: b.MACErr}
			if b.MAC != nil {
				bs.MAC = b.MAC.String()
			}
			if s.Plane == plan.XDP {
				c := stats.Backends[key][b.Config.Addr]
				bs.Packets, bs.Bytes = c.Packets, c.Bytes
				if s.Config.Mode == config.ModeNAT {
					bs.ActiveFlows = stats.Flows[key][b.Config.Addr].Active()
					ss.ActiveFlows += bs.ActiveFlows
				}
			}
			if b.Ramping() {
				bs.SlowStart = fmt.Sprintf("%.0f%% of its weight, %s to go", 100*b.SlowStartFactor(s.Config.SlowStart, now),
					b.RampStart.Add(s.Config.SlowStart).Sub(now).Round(time.Second))
			}
			if ps, ok := backSnap[b.Config.Addr]; ok {
				bs.Connections, bs.Connects = ps.Active, ps.Connects
				bs.Bytes = ps.BytesIn + ps.BytesOut
			}
			if hb, ok := httpSnap[b.Config.Addr]; ok {
				httpBackendStatus(&bs, hb)
			}
			if hs, ok := a.checker.Status(b.ID); ok && !hs.Last.Start.IsZero() {
				bs.LastCheck = "ok"
				if hs.Last.Err != nil {
					bs.LastCheck = hs.Last.Err.Error()
				}
				bs.LastCheckAgo = now.Sub(hs.Last.Start).Round(time.Millisecond).String()
			}
			ss.Backends = append(ss.Backends, bs)
		}
		st.Services = append(st.Services, ss)
	}
	return st, nil
}

func httpBackendStatus(bs *api.BackendStatus, hb httplb.BackendSnapshot) {
	bs.InFlight, bs.Tunnels, bs.Requests, bs.Retries = hb.InFlight, hb.Tunnels, hb.Requests, hb.Retries
	bs.Classes = map[string]uint64{}
	for i, n := range hb.Classes {
		name := "none"
		if i > 0 {
			name = fmt.Sprintf("%dxx", i)
		}
		if n > 0 {
			bs.Classes[name] = n
		}
	}
	if hb.HasLatency {
		bs.Latency = hb.Latency.Round(10 * time.Microsecond).String()
	}
}

// Explain answers "where does this client go" for an XDP service: the backend a new
// flow from client (ip:port) would get, and the one an existing flow is pinned to.
// The proxy picks per connection as they come, so it has nothing to explain.
func (a *Agent) Explain(_ context.Context, service, client string) (api.Explanation, error) {
	ap, err := netip.ParseAddrPort(client)
	if err != nil {
		return api.Explanation{}, fmt.Errorf("client %q: want ip:port ([v6]:port for IPv6): %w", client, ErrBadRequest)
	}
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	snap := a.snap.Load()
	if snap == nil {
		return api.Explanation{}, ErrNotRunning
	}
	s := snap.running.Service(service)
	switch {
	case s == nil:
		return api.Explanation{}, fmt.Errorf("service %q: %w (see weir status)", service, ErrNotFound)
	case s.Plane == plan.HTTP:
		return api.Explanation{}, fmt.Errorf("service %q is served by the http plane, which picks a backend for every request as it comes: nothing to explain", service)
	case s.Plane != plan.XDP:
		return api.Explanation{}, fmt.Errorf("service %q is served by the %s, which picks a backend per connection as it comes: nothing to explain", service, s.Plane)
	case ap.Addr().Is4() != s.Config.VIP.Addr().Is4():
		return api.Explanation{}, fmt.Errorf("client %s: the VIP %s is of the other address family: %w", ap, s.Config.VIP.Addr(), ErrBadRequest)
	}
	ex, err := a.xdp.Explain(s, ap)
	if err != nil {
		return api.Explanation{}, fmt.Errorf("explain: %w", err)
	}
	if ex.New == "" {
		var why []string
		if !s.Installed {
			why = append(why, "the service is out of XDP: "+s.Note)
		}
		for _, b := range s.Backends {
			if r := b.Reason(); r != "" {
				why = append(why, b.Config.Addr.String()+" "+r)
			}
		}
		ex.NoBackend = strings.Join(why, "; ")
	}
	return ex, nil
}
