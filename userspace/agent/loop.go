package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"strings"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/agent/httpplane"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/agent/xdpplane"
	"github.com/weir-lb/weir/userspace/config"
)

// state is what the loop owns. Nothing but the loop reads or writes it.
type state struct {
	cfg       *config.Config
	started   time.Time
	placement map[string]plan.Placement // by service name
	health    map[string]plan.Health    // by backend ID, as the checker last said
	overrides map[string]plan.Override  // by backend ID
	macs      map[netip.Addr]plan.MAC   // dsr backends without a configured MAC
	running   plan.Desired              // what the planes run now
	flowIdle  time.Duration             // the XDP program's idle timeout of established TCP flows
	reloads   []api.ReloadStatus        // most recent last, at most maxReloads
	// drained: `weir node drain` withdrew the node's BGP routes, at drainedAt.
	drained   bool
	drainedAt time.Time
	// unapplied: a health verdict the planes refused to take, since
	// unappliedSince; the tick tries it again at retryAt, since the checker
	// sends a verdict only when it changes, backing off from a second to a
	// minute (each failed try's rollback logs). unappliedErr is the last
	// failure logged, so a lasting one is logged once by the loop; status and
	// metrics show it all along.
	unapplied      bool
	unappliedErr   string
	unappliedSince time.Time
	tries          int
	retryAt        time.Time
	retryWait      time.Duration
	// confirmed: the services (by name) one of whose backends has passed an
	// active check since the agent started, as publish saw them; the BGP routes
	// count no other (see confirm). passesSeen is the checker's FirstPasses
	// when confirm last looked.
	confirmed  map[string]bool
	passesSeen uint64
}

func newState(cfg *config.Config) *state {
	return &state{cfg: cfg, started: time.Now(), placement: map[string]plan.Placement{},
		health: map[string]plan.Health{}, overrides: map[string]plan.Override{}, macs: map[netip.Addr]plan.MAC{},
		confirmed: map[string]bool{}}
}

func (st *state) input(cfg *config.Config, placement map[string]plan.Placement, overrides map[string]plan.Override, now time.Time) plan.Input {
	return plan.Input{Services: cfg.Services, Placement: placement, Health: st.health, Overrides: overrides, MACs: st.macs,
		FlowIdle: st.flowIdle, Now: now}
}

// The events the loop takes.
type (
	event any

	// reloadEvent: read the config file again and apply it, or refuse it (also when
	// it would move more than maxMove percent of a service's new flows).
	reloadEvent struct {
		reply   chan error
		maxMove *float64
	}
	// healthEvent: the checker changed its verdict on a backend.
	healthEvent struct{ change health.Change }
	// overrideEvent: a runtime drain or weight for one backend.
	overrideEvent struct {
		service, backend string
		set              func(*plan.Override)
		reply            chan error
	}
	// tickEvent: once a second.
	tickEvent struct{ now time.Time }
	// reviveEvent: start anew the servers of the proxy and the http plane that
	// stopped serving on their own, those whose backoff is over.
	reviveEvent struct{}
	// nodeDrainEvent: withdraw every BGP route of the node, or announce again.
	nodeDrainEvent struct {
		drain bool
		reply chan error
	}
)

// loop takes events until ctx is done, publishing a snapshot after each.
func (a *Agent) loop(ctx context.Context, st *state) {
	defer close(a.loopDone)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	// reviveT fires when a try to start a stopped server anew is due.
	reviveT := time.NewTimer(time.Hour)
	reviveT.Stop()
	defer reviveT.Stop()
	for {
		var ev event
		select {
		case <-ctx.Done():
			return
		case ev = <-a.events:
		case now := <-t.C:
			ev = tickEvent{now}
		case <-a.wake:
			ev = reviveEvent{}
		case <-reviveT.C:
			ev = reviveEvent{}
		}
		// A request is answered after the snapshot is published, so a caller that
		// reads Status after its change returns sees the change.
		var reply chan error
		var err error
		switch ev := ev.(type) {
		case reloadEvent:
			reply, err = ev.reply, a.reload(st, ev.maxMove)
		case planEvent:
			reply, err = ev.reply, a.onPlan(st, ev)
		case healthEvent:
			a.onHealth(st, ev.change)
			a.healthTaken.Add(1)
		case overrideEvent:
			reply, err = ev.reply, a.onOverride(st, ev)
		case tickEvent:
			a.tick(st, ev.now)
		case nodeDrainEvent:
			reply, err = ev.reply, a.onNodeDrain(st, ev.drain)
		case reviveEvent:
			if wait := a.onRevive(st); wait > 0 {
				reviveT.Reset(wait)
			}
		}
		a.publish(st)
		a.handled.Add(1)
		if reply != nil {
			reply <- err
		}
	}
}

// revive tells the loop that a listening plane's server stopped on its own;
// it may be called from any goroutine and never blocks.
func (a *Agent) revive() {
	select {
	case a.wake <- struct{}{}:
	default: // a wake is pending: the loop will look at every service
	}
}

// onRevive starts anew the servers that stopped on their own and whose backoff
// is over, and returns how long until the next try is due (0: none).
func (a *Agent) onRevive(st *state) time.Duration {
	find := func(pl plan.Plane) func(string) *plan.Service {
		return func(name string) *plan.Service {
			if s := st.running.Service(name); s != nil && s.Plane == pl {
				return s
			}
			return nil
		}
	}
	var next time.Duration
	for _, w := range []time.Duration{a.proxy.Revive(find(plan.Proxy)), a.http.Revive(find(plan.HTTP))} {
		if w > 0 && (next == 0 || w < next) {
			next = w
		}
	}
	return next
}

// post hands the loop an event that needs no answer.
func (a *Agent) post(ctx context.Context, ev event) {
	select {
	case a.events <- ev:
	case <-ctx.Done():
	case <-a.loopDone:
	}
}

// request hands the loop an event and waits for its answer.
func (a *Agent) request(ctx context.Context, ev event, reply chan error) error {
	if !a.running.Load() {
		return ErrNotRunning
	}
	select {
	case a.events <- ev:
	case <-a.loopDone:
		return ErrNotRunning
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-reply:
		return err
	case <-a.loopDone:
		select {
		case err := <-reply:
			return err
		default:
			return ErrNotRunning
		}
	}
}

// Reload reads the config file again and applies it, or, if it is invalid or can't
// be applied, leaves the running one in force and returns why.
func (a *Agent) Reload(ctx context.Context) error {
	reply := make(chan error, 1)
	if err := a.request(ctx, reloadEvent{reply: reply}, reply); err != nil {
		if errors.Is(err, ErrNotRunning) {
			return fmt.Errorf("reload: %w", err)
		}
		return err
	}
	return nil
}

// SetDrain drains a backend (no new flows or connections; established ones stay) or
// ends its drain. The change lasts until undone or the agent restarts; reloads keep
// it.
func (a *Agent) SetDrain(ctx context.Context, service, backend string, drain bool) error {
	reply := make(chan error, 1)
	return a.request(ctx, overrideEvent{service: service, backend: backend, reply: reply,
		set: func(o *plan.Override) { o.Drain, o.SetDrain = drain, true }}, reply)
}

// SetWeight sets a backend's weight (0..65535) at runtime, with the same lifetime as
// SetDrain.
func (a *Agent) SetWeight(ctx context.Context, service, backend string, weight uint32) error {
	if weight > config.MaxWeight {
		return fmt.Errorf("set weight: must be 0..%d, got %d: %w", config.MaxWeight, weight, ErrBadRequest)
	}
	reply := make(chan error, 1)
	return a.request(ctx, overrideEvent{service: service, backend: backend, reply: reply,
		set: func(o *plan.Override) { o.Weight, o.SetWeight = weight, true }}, reply)
}

// SetNodeDrain drains the node (its BGP routes are withdrawn, so the routers send
// it no new flows; the data planes keep serving what still arrives) or ends the
// drain. It lasts until undone or the agent restarts.
func (a *Agent) SetNodeDrain(ctx context.Context, drain bool) error {
	reply := make(chan error, 1)
	return a.request(ctx, nodeDrainEvent{drain: drain, reply: reply}, reply)
}

// onNodeDrain is the node drain event.
func (a *Agent) onNodeDrain(st *state, drain bool) error {
	if a.bgp == nil {
		return fmt.Errorf("node drain: the config has no bgp section, so this node announces nothing to withdraw: %w", ErrBadRequest)
	}
	if st.drained == drain {
		return nil
	}
	st.drained = drain
	st.drainedAt = time.Now()
	a.bgp.SetDrain(drain, st.drainedAt)
	if drain {
		a.log.Warn("node drained: every BGP route withdrawn; flows still arriving are served", "drain_timeout", st.cfg.BGP.DrainTimeout)
	} else {
		a.log.Info("node undrained: routes announced again")
	}
	return nil
}

// start applies the first config to empty planes.
func (a *Agent) start(st *state) error {
	if err := a.xdp.SpeakerPortClashes(st.cfg, a.opts.ConfigPath); err != nil {
		return err
	}
	placement, err := a.place(nil, st.cfg, st.placement)
	if err != nil {
		return err
	}
	a.refreshMACs(st, st.cfg, placement)
	next := plan.Plan(st.input(st.cfg, placement, st.overrides, time.Now()), plan.Desired{})
	if err := a.reconcile(plan.Desired{}, next); err != nil {
		return fieldLines(st.cfg, a.opts.ConfigPath, err)
	}
	st.placement, st.running, st.unapplied = placement, next, false
	a.register(plan.Desired{}, next)
	return nil
}

// reload is the reload event.
func (a *Agent) reload(st *state, maxMove *float64) error {
	start := time.Now()
	cfg, err := config.Load(a.opts.ConfigPath)
	if err == nil {
		err = restartOnly(st.cfg, cfg)
	}
	if err == nil {
		err = a.xdp.SpeakerPortClashes(cfg, a.opts.ConfigPath)
	}
	if err == nil {
		err = a.applyConfig(st, cfg, maxMove)
	}
	rs := api.ReloadStatus{Time: start, OK: err == nil}
	if err != nil {
		rs.Errors = admin.ErrorLines(err)
		a.log.Error("reload rejected: the running config stays in force", "config", a.opts.ConfigPath, "errors", len(rs.Errors))
		for _, e := range rs.Errors {
			a.log.Error("reload: " + e)
		}
	} else {
		a.log.Info("reloaded", "config", a.opts.ConfigPath, "services", len(cfg.Services), "took", time.Since(start))
	}
	a.metrics.Reload(err == nil)
	st.reloads = append(st.reloads, rs)
	if len(st.reloads) > maxReloads {
		st.reloads = st.reloads[1:]
	}
	return err
}

// restartOnly rejects changes a reload cannot apply, each naming its setting and
// both values (a peer's, which holds its password, only by name).
func restartOnly(old, next *config.Config) error {
	var errs []error
	fixed := func(field string, a, b any) {
		if !reflect.DeepEqual(a, b) {
			errs = append(errs, fmt.Errorf("%s: changed from %s to %s; restart weir to apply", field, showSetting(a), showSetting(b)))
		}
	}
	fixed("interfaces", old.Interfaces, next.Interfaces)
	x, y := old.XDP, next.XDP
	fixed("xdp.hash_seed", x.HashSeed, y.HashSeed)
	fixed("xdp.conntrack_size", x.ConntrackSize, y.ConntrackSize)
	fixed("xdp.half_open_size", x.HalfOpenSize, y.HalfOpenSize)
	fixed("xdp.half_open_timeout", x.HalfOpenTimeout, y.HalfOpenTimeout)
	fixed("xdp.new_flow_rate", x.NewFlowRate, y.NewFlowRate)
	fixed("xdp.new_flow_burst", x.NewFlowBurst, y.NewFlowBurst)
	fixed("xdp.previous_table_window", x.PreviousTableWindow, y.PreviousTableWindow)
	fixed("xdp.pin_path", x.PinPath, y.PinPath)
	fixed("xdp.detach_on_stop", x.DetachOnStop, y.DetachOnStop)
	fixed("addresses", old.Addresses, next.Addresses)
	fixed("admin.socket", old.Admin.Socket, next.Admin.Socket)
	fixed("admin.listen", old.Admin.Listen, next.Admin.Listen)
	fixed("metrics.listen", old.Metrics.Listen, next.Metrics.Listen)
	fixed("metrics.public", old.Metrics.Public, next.Metrics.Public)
	fixed("log.format", old.Log.Format, next.Log.Format)
	fixed("log.level", old.Log.Level, next.Log.Level)
	b, c := old.BGP, next.BGP
	switch {
	case b.ASN == 0 && c.ASN != 0:
		errs = append(errs, errors.New("bgp: added; restart weir to apply"))
		b = c // the rest of the section is new, not changed
	case b.ASN != 0 && c.ASN == 0:
		errs = append(errs, errors.New("bgp: removed; restart weir to apply"))
		b = c
	}
	fixed("bgp.asn", b.ASN, c.ASN)
	fixed("bgp.router_id", b.RouterID, c.RouterID)
	fixed("bgp.listen_port", b.ListenPort, c.ListenPort)
	fixed("bgp.next_hop", b.NextHop, c.NextHop)
	fixed("bgp.drain_timeout", b.DrainTimeout, c.DrainTimeout)
	if len(b.Peers) != len(c.Peers) {
		errs = append(errs, fmt.Errorf("bgp.peers: changed from %d to %d peers; restart weir to apply (services' bgp policies reload)", len(b.Peers), len(c.Peers)))
	} else {
		for i := range b.Peers {
			p, q, at := b.Peers[i], c.Peers[i], fmt.Sprintf("bgp.peers[%d]", i)
			fixed(at+".address", p.Address, q.Address)
			fixed(at+".asn", p.ASN, q.ASN)
			fixed(at+".port", p.Port, q.Port)
			fixed(at+".hold_time", p.HoldTime, q.HoldTime)
			fixed(at+".keepalive", p.Keepalive, q.Keepalive)
			fixed(at+".multihop", p.Multihop, q.Multihop)
			if p.Password != q.Password {
				errs = append(errs, fmt.Errorf("%s.password: changed; restart weir to apply", at))
			}
		}
	}
	// A setting not named above still holds a reload back.
	if len(errs) == 0 && (old.XDP != next.XDP || old.Admin != next.Admin || old.Metrics != next.Metrics ||
		old.Log != next.Log || !reflect.DeepEqual(old.BGP, next.BGP)) {
		errs = append(errs, errors.New("xdp, admin, metrics, log or bgp: changed; restart weir to apply"))
	}
	return errors.Join(errs...)
}

// showSetting writes a restart-only setting's value for an operator: "none" for
// an empty list or an unset address.
func showSetting(v any) string {
	var s []string
	switch v := v.(type) {
	case []config.Interface:
		for _, in := range v {
			s = append(s, fmt.Sprintf("%s (%s)", in.Name, in.Attach))
		}
	case []netip.Addr:
		for _, a := range v {
			s = append(s, a.String())
		}
	case netip.AddrPort:
		if v.IsValid() {
			s = append(s, v.String())
		}
	case netip.Addr:
		if v.IsValid() {
			s = append(s, v.String())
		}
	default:
		return fmt.Sprint(v)
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

// applyConfig makes cfg the running config, or changes nothing and says why (also
// when the change would move more than maxMove percent of a service's new flows).
func (a *Agent) applyConfig(st *state, cfg *config.Config, maxMove *float64) error {
	next, placement, overrides, err := a.prepare(st, cfg)
	if err != nil {
		return err
	}
	// One diff for the budget and the apply: a reload checks the very
	// operations it then performs.
	ops := plan.Diff(st.running, next)
	if err := a.withinBudget(st.running, next, ops, maxMove); err != nil {
		return err
	}
	if err := a.http.ReadCertificates(next); err != nil {
		return fieldLines(cfg, a.opts.ConfigPath, err)
	}
	if err := a.reconcileOps(st.running, next, ops); err != nil {
		return fieldLines(cfg, a.opts.ConfigPath, err)
	}
	prev := st.running
	st.cfg, st.placement, st.overrides, st.running, st.unapplied = cfg, placement, overrides, next, false
	a.register(prev, next)
	for id := range st.health {
		if !hasBackend(next, id) {
			delete(st.health, id)
		}
	}
	for i := range next.Services {
		s := &next.Services[i]
		a.log.Info("service applied", "service", s.Name(), "data_plane", s.Plane, "why", s.Why, "backends", len(s.Backends))
	}
	for i := range prev.Services {
		if next.Service(prev.Services[i].Name()) == nil {
			a.log.Info("service removed", "service", prev.Services[i].Name())
		}
	}
	return nil
}

// fieldLines reports each error of err about one service of cfg as `weir
// validate` reports the file's errors, at its field and line of the file at
// file: a certificate pair that does not load (at http.tls), and a change the
// XDP program has no slots for (at the service).
func fieldLines(cfg *config.Config, file string, err error) error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs := j.Unwrap()
		out := make([]error, len(errs))
		for i, e := range errs {
			out[i] = fieldLines(cfg, file, e)
		}
		return errors.Join(out...)
	}
	var ce *httpplane.CertError
	var capa *xdpplane.CapacityError
	switch {
	case errors.As(err, &ce):
		if fe := cfg.TLSPairError(file, ce.Service, ce.Err); fe != nil {
			return fe
		}
	case errors.As(err, &capa):
		// The path names the service: the message without its name.
		if fe := cfg.ServiceError(file, capa.Service, "", capa.Err); fe != nil {
			return fe
		}
	}
	return err
}

// prepare plans cfg against the running state: what applyConfig would apply.
func (a *Agent) prepare(st *state, cfg *config.Config) (plan.Desired, map[string]plan.Placement, map[string]plan.Override, error) {
	placement, err := a.place(st.cfg, cfg, st.placement)
	if err != nil {
		return plan.Desired{}, nil, nil, err
	}
	a.refreshMACs(st, cfg, placement)
	// Overrides last while their backend does.
	overrides := make(map[string]plan.Override)
	for _, s := range cfg.Services {
		for _, b := range s.Backends {
			id := plan.ID(s.Name, b.Addr)
			if o, ok := st.overrides[id]; ok {
				overrides[id] = o
			}
		}
	}
	return plan.Plan(st.input(cfg, placement, overrides, time.Now()), st.running), placement, overrides, nil
}

func hasBackend(d plan.Desired, id string) bool {
	for _, s := range d.Services {
		for _, b := range s.Backends {
			if b.ID == id {
				return true
			}
		}
	}
	return false
}

// place decides where each service of next runs: where it runs now unless it must
// be built anew (see plan.Rebuilt), else by asking the XDP plane.
func (a *Agent) place(old, next *config.Config, running map[string]plan.Placement) (map[string]plan.Placement, error) {
	prev := map[string]*config.Service{}
	if old != nil {
		for i := range old.Services {
			prev[old.Services[i].Name] = &old.Services[i]
		}
	}
	out := make(map[string]plan.Placement, len(next.Services))
	var errs []error
	for i := range next.Services {
		cs := &next.Services[i]
		if p, ok := prev[cs.Name]; ok && !plan.Rebuilt(p, cs) {
			out[cs.Name] = running[cs.Name]
			continue
		}
		pl, err := a.decide(cs)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out[cs.Name] = pl
	}
	return out, errors.Join(errs...)
}

// decide picks the data plane of a service (config.Service.Serving): XDP if it
// may serve the service and can here, else the other plane, if there is one.
func (a *Agent) decide(s *config.Service) (plan.Placement, error) {
	v := s.Serving()
	if v.Else == s.DataPlane {
		// Named by data_plane (proxy, http): XDP has no say.
		return plan.Placement{Plane: plan.Plane(v.Else), Why: "data_plane: " + string(v.Else)}, nil
	}
	xerr := a.xdp.CanServe(s) // why XDP does not serve it, or nil
	switch {
	case v.XDP && xerr == nil:
		return plan.Placement{Plane: plan.XDP, Why: fmt.Sprintf("XDP %s mode, self-test passed", s.Mode)}, nil
	case v.Else == "":
		return plan.Placement{}, fmt.Errorf("service %q: %s: %w", s.Name, v.Why, xerr)
	}
	return plan.Placement{Plane: plan.Plane(v.Else), Why: string(v.Else) + ", because " + xerr.Error()}, nil
}

// refreshMACs asks the neighbour table for the MAC of every dsr backend without a
// configured one. An address that resolved before keeps its MAC while the table has
// no answer.
func (a *Agent) refreshMACs(st *state, cfg *config.Config, placement map[string]plan.Placement) {
	for _, s := range cfg.Services {
		if s.Mode != config.ModeDSR {
			continue
		}
		for _, b := range s.Backends {
			if b.MAC != nil {
				continue
			}
			ip := b.Addr.Addr()
			m := a.xdp.ResolveMAC(ip)
			if m.Addr == nil && st.macs[ip].Addr != nil {
				continue
			}
			st.macs[ip] = m
		}
	}
}

// onHealth is the health event.
func (a *Agent) onHealth(st *state, ch health.Change) {
	st.health[ch.ID] = plan.Health{State: ch.To, Usable: ch.Usable}
	s := st.running.Service(ch.Service)
	if s == nil {
		return
	}
	var b *plan.Backend
	for i := range s.Backends {
		if s.Backends[i].ID == ch.ID {
			b = &s.Backends[i]
		}
	}
	if b == nil || b.Healthy == ch.Usable && b.Health == ch.To {
		if st.unapplied && !healthPending(st) {
			// This verdict undid the refused ones: the planes run what the
			// checker says, and nothing waits for the next try.
			st.unapplied = false
		}
		return
	}
	wasDown := s.AllDown
	err := a.converge(st, time.Now())
	a.log.Info("backend health", "service", ch.Service, "backend", b.Config.Address, "state", ch.To.String(), "usable", ch.Usable, "panic", ch.Panic, "reason", ch.Reason)
	if err != nil {
		a.log.Error("apply health change", "service", ch.Service, "backend", b.Config.Address, "err", err)
		now := time.Now()
		if !st.unapplied {
			st.retryWait, st.unappliedSince, st.tries = time.Second, now, 0
		}
		st.unapplied, st.unappliedErr, st.retryAt = true, err.Error(), now.Add(st.retryWait)
		st.tries++
		return
	}
	if now := st.running.Service(ch.Service); now != nil && now.AllDown != wasDown {
		a.log.Warn("service usable backends changed", "service", ch.Service, "all_down", now.AllDown, "note", now.Note)
	}
}

// healthPending reports whether a running backend's health is not the
// checker's last verdict for it.
func healthPending(st *state) bool {
	for _, s := range st.running.Services {
		for _, b := range s.Backends {
			if h, ok := st.health[b.ID]; ok && (h.State != b.Health || h.Usable != b.Healthy) {
				return true
			}
		}
	}
	return false
}

// onOverride is the drain or weight event.
func (a *Agent) onOverride(st *state, ev overrideEvent) error {
	s := st.running.Service(ev.service)
	if s == nil {
		return fmt.Errorf("service %q: %w (see weir status)", ev.service, ErrNotFound)
	}
	ap, _ := netip.ParseAddrPort(ev.backend)
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	var b *plan.Backend
	for i := range s.Backends {
		if s.Backends[i].Config.Address == ev.backend || s.Backends[i].Config.Addr == ap {
			b = &s.Backends[i]
		}
	}
	if b == nil {
		return fmt.Errorf("service %q: backend %q: %w (see weir status)", ev.service, ev.backend, ErrNotFound)
	}
	overrides := maps.Clone(st.overrides)
	o := overrides[b.ID]
	ev.set(&o)
	overrides[b.ID] = o
	next := plan.Plan(st.input(st.cfg, st.placement, overrides, time.Now()), st.running)
	if err := a.reconcile(st.running, next); err != nil {
		return err
	}
	st.overrides, st.running, st.unapplied = overrides, next, false
	nb := next.Service(ev.service).Backend(b.Config.Addr)
	a.log.Info("backend changed at runtime", "service", ev.service, "backend", b.Config.Address, "weight", nb.Weight, "drained", nb.Drained)
	return nil
}

// tick resolves the MACs still unknown, lets removed backends whose drain time is
// up leave XDP, steps slow starts and ends the fallback of lookup tables replaced
// longer ago than xdp.previous_table_window.
func (a *Agent) tick(st *state, now time.Time) {
	if err := a.xdp.ExpirePreviousTables(now); err != nil {
		a.log.Error("expire previous lookup tables", "err", err)
	}
	changed := ramping(st.running)
	for _, s := range st.running.Services {
		if s.Plane != plan.XDP {
			continue
		}
		for _, l := range s.Leaving {
			changed = changed || !now.Before(l.Until)
		}
		if s.Config.Mode != config.ModeDSR {
			continue
		}
		for _, b := range s.Backends {
			if b.MAC != nil {
				continue
			}
			m := a.xdp.ResolveMAC(b.Config.Addr.Addr())
			st.macs[b.Config.Addr.Addr()] = m
			if m.Addr != nil {
				changed = true
				a.log.Info("backend mac resolved", "service", s.Name(), "backend", b.Config.Address, "mac", m.Addr.String())
			}
		}
	}
	if st.unapplied {
		// The retry applies whatever else changed, too.
		if now.Before(st.retryAt) {
			return
		}
		err := a.converge(st, now)
		if err == nil {
			a.log.Info("health changes applied after an earlier failure")
			return
		}
		st.retryWait = min(2*st.retryWait, time.Minute)
		st.retryAt = now.Add(st.retryWait)
		st.tries++
		if err.Error() != st.unappliedErr {
			a.log.Error("apply health changes again", "err", err, "retry_in", st.retryWait)
			st.unappliedErr = err.Error()
		}
		return
	}
	if changed {
		if err := a.converge(st, now); err != nil {
			a.log.Error("apply resolved macs and drained backends", "err", err)
		}
	}
}

// converge plans with what the loop knows now and applies the difference.
func (a *Agent) converge(st *state, now time.Time) error {
	next := plan.Plan(st.input(st.cfg, st.placement, st.overrides, now), st.running)
	if err := a.reconcile(st.running, next); err != nil {
		return err
	}
	st.running, st.unapplied = next, false
	return nil
}

// staged is a plane that keeps what a change would end (a listening server
// replaced or removed) until the loop commits the change, and on Abort gives it
// back untouched.
type staged interface {
	Commit()
	Abort()
}

// reconcile applies the operations that take the planes from prev to next. If the
// XDP program lacks the slots they need, none is applied. If one fails, the
// staged planes abort, every service the operations so far touched is brought
// back to prev by the same means (a diff from where they are to prev), and the
// error is returned.
func (a *Agent) reconcile(prev, next plan.Desired) error {
	return a.reconcileOps(prev, next, plan.Diff(prev, next))
}

// reconcileOps is reconcile with the operations from prev to next, plan.Diff's,
// already computed.
func (a *Agent) reconcileOps(prev, next plan.Desired, ops []plan.Op) error {
	// A change the XDP program has no slots for is refused before any write;
	// what the caller staged for it (a reload's certificates) is undone.
	if err := a.xdp.Fits(prev, ops); err != nil {
		a.stage(staged.Abort)
		return err
	}
	for i, op := range ops {
		if err := a.do(op); err != nil {
			a.stage(staged.Abort)
			rerr := a.rollBack(prev, next, ops[:i+1])
			a.stage(staged.Commit)
			if rerr != nil {
				a.log.Error("roll back to the running state", "err", rerr)
				return errors.Join(err, fmt.Errorf("roll back: %w", rerr))
			}
			return err
		}
	}
	a.stage(staged.Commit)
	return nil
}

// stage calls f on every staged plane.
func (a *Agent) stage(f func(staged)) {
	for _, pl := range a.planes {
		if s, ok := pl.(staged); ok {
			f(s)
		}
	}
}

func (a *Agent) do(op plan.Op) error {
	pl := a.planes[op.Plane]
	var err error
	switch op.Kind {
	case plan.Add:
		err = pl.Add(op.Next)
	case plan.Update:
		err = pl.Update(op.Prev, op.Next)
	case plan.SetBackend:
		err = pl.SetBackend(op.Prev, op.Next, op.Backend)
	case plan.Remove:
		err = pl.Remove(op.Prev)
	default:
		err = fmt.Errorf("%s: unknown operation", op)
	}
	// A service that fell back to the proxy fails there for a reason the operator
	// did not choose: name the fallback's cause too.
	if err != nil && op.Plane == plan.Proxy && op.Next != nil {
		if cause, ok := strings.CutPrefix(op.Next.Why, "proxy, because "); ok {
			err = fmt.Errorf("%w (it fell back to the proxy because %s)", err, cause)
		}
	}
	return err
}

// rollBack re-applies prev to the services that done touched: from the state they
// may be in (next's, the failed operation's included), back to prev's.
func (a *Agent) rollBack(prev, next plan.Desired, done []plan.Op) error {
	touched := map[string]bool{}
	for _, op := range done {
		touched[op.Service()] = true
	}
	// A service of next that took over the XDP entry of another name (a rename
	// keeps the VIP's entry and its flows) touched that one too: it is given its
	// entry back before the new name leaves.
	for i := range prev.Services {
		p := &prev.Services[i]
		for j := range next.Services {
			if n := &next.Services[j]; touched[n.Name()] && n.Name() != p.Name() && sameXDPEntry(p, n) {
				touched[p.Name()] = true
			}
		}
	}
	var mid plan.Desired
	for _, s := range next.Services {
		if touched[s.Name()] {
			mid.Services = append(mid.Services, s)
		} else if p := prev.Service(s.Name()); p != nil {
			mid.Services = append(mid.Services, *p)
		}
	}
	for _, s := range prev.Services {
		if next.Service(s.Name()) == nil && !touched[s.Name()] {
			mid.Services = append(mid.Services, s)
		}
	}
	var errs []error
	for _, op := range plan.Diff(mid, prev) {
		if err := a.do(op); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", op, err))
		}
	}
	return errors.Join(errs...)
}

// sameXDPEntry reports whether a and b would be the same entry of the XDP program.
func sameXDPEntry(a, b *plan.Service) bool {
	return a.Plane == plan.XDP && b.Plane == plan.XDP && xdpplane.Key(&a.Config) == xdpplane.Key(&b.Config)
}

// register tells the health checker which services and backends run now.
func (a *Agent) register(prev, next plan.Desired) {
	for i := range next.Services {
		s := &next.Services[i]
		if err := a.checker.SetService(s.Name(), healthConfig(&s.Config)); err != nil {
			a.log.Error("health checks", "service", s.Name(), "err", err)
			continue
		}
		for _, b := range s.Backends {
			init := plan.InitialState(b.Config.Initial)
			if err := a.checker.Set(health.Backend{ID: b.ID, Service: s.Name(), Addr: b.Config.CheckAddr.String(), Initial: &init}); err != nil {
				a.log.Error("health checks", "service", s.Name(), "backend", b.Config.Address, "err", err)
			}
		}
	}
	for i := range prev.Services {
		p := &prev.Services[i]
		n := next.Service(p.Name())
		if n == nil {
			a.checker.RemoveService(p.Name())
			continue
		}
		for _, b := range p.Backends {
			if n.Backend(b.Config.Addr) == nil {
				a.checker.Remove(b.ID)
			}
		}
	}
}
