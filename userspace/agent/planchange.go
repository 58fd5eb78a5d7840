package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/agent/httpplane"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// planchange.go: `weir plan` (what a change would move, applying nothing) and the
// disruption budget of `weir reload --max-move`. Both run in the loop, against the
// running state, so what a plan predicts is what a reload right after it does, and
// a gated reload checks the very state it then applies.

// previewer is what weir plan asks of a data plane about a service: the lookup table
// it holds now and the one it would build for a desired state (nil: it picks without
// a table), and the established flows or connections per backend.
type previewer interface {
	Table(s *plan.Service) ([]netip.AddrPort, error)
	LiveTable(s *plan.Service) ([]netip.AddrPort, error)
	Flows(s *plan.Service) (plan.Flows, error)
}

// rebuilder is a plane that decides itself which changes need a new server (the
// http plane applies more in place than plan.Rebuilt allows for).
type rebuilder interface {
	Rebuilds(a, b *config.Service) bool
}

// rebuilt is plane's notion of a change that needs a new server.
func (a *Agent) rebuilt(plane plan.Plane) func(x, y *config.Service) bool {
	if r, ok := a.planes[plane].(rebuilder); ok {
		return r.Rebuilds
	}
	return plan.Rebuilt
}

// ErrOverBudget: a change would move more than --max-move allows.
var ErrOverBudget = errors.New("over the disruption budget")

// planEvent: compute what a config would change, and apply nothing.
type planEvent struct {
	data    []byte // the config; nil: the agent's config file
	name    string // what to call it in the answer
	maxMove *float64
	out     *api.Plan
	reply   chan error
}

// Plan computes what applying a config would change: data is the file's contents
// (nil: the agent's own config file, as a reload would read it), name what to call
// it, maxMove a budget in percent of each service's new flows (nil: none) that the
// answer's OverBudget is checked against. Nothing is applied.
func (a *Agent) Plan(ctx context.Context, data []byte, name string, maxMove *float64) (api.Plan, error) {
	if maxMove != nil {
		if err := checkMaxMove(*maxMove); err != nil {
			return api.Plan{}, fmt.Errorf("plan: %w", err)
		}
	}
	var out api.Plan
	reply := make(chan error, 1)
	if err := a.request(ctx, planEvent{data: data, name: name, maxMove: maxMove, out: &out, reply: reply}, reply); err != nil {
		return api.Plan{}, err
	}
	return out, nil
}

// ReloadWithin is Reload with a disruption budget: the change is refused, and the
// running config stays in force, if it would move more than maxMove percent of any
// service's new flows (see api.ServicePlan.Moved).
func (a *Agent) ReloadWithin(ctx context.Context, maxMove float64) error {
	if err := checkMaxMove(maxMove); err != nil {
		return fmt.Errorf("reload: %w", err)
	}
	reply := make(chan error, 1)
	if err := a.request(ctx, reloadEvent{reply: reply, maxMove: &maxMove}, reply); err != nil {
		if errors.Is(err, ErrNotRunning) {
			return fmt.Errorf("reload: %w", err)
		}
		return err
	}
	return nil
}

// checkMaxMove refuses a budget that is no percentage (NaN too).
func checkMaxMove(pct float64) error {
	if !(pct >= 0 && pct <= 100) {
		return fmt.Errorf("max_move: must be a percentage 0..100, got %g: %w", pct, ErrBadRequest)
	}
	return nil
}

func (a *Agent) onPlan(st *state, ev planEvent) error {
	file := ev.name
	if ev.data == nil {
		file = a.opts.ConfigPath
	}
	cfg, err := a.planConfig(ev)
	if err == nil {
		err = restartOnly(st.cfg, cfg)
	}
	if err == nil {
		err = a.xdp.SpeakerPortClashes(cfg, file)
	}
	if err != nil {
		return err
	}
	next, _, _, err := a.prepare(st, cfg)
	if err != nil {
		return err
	}
	ops := plan.Diff(st.running, next)
	*ev.out = a.impact(st.running, next, ops, ev.maxMove)
	// What a reload of the file would be refused for after planning it
	// (applyConfig): a certificate pair that does not load, and slots the XDP
	// program does not have.
	refused := errors.Join(httpplane.CheckCertificates(next), a.xdp.Fits(st.running, ops))
	if refused != nil {
		ev.out.Refused = fieldLines(cfg, file, refused).Error()
	}
	ev.out.Config = file
	return nil
}

func (a *Agent) planConfig(ev planEvent) (*config.Config, error) {
	if ev.data == nil {
		return config.Load(a.opts.ConfigPath)
	}
	return config.ParseFile(ev.data, ev.name)
}

// withinBudget refuses a change from prev to next (ops: plan.Diff(prev, next))
// that moves more than maxMove percent of a service's new flows.
func (a *Agent) withinBudget(prev, next plan.Desired, ops []plan.Op, maxMove *float64) error {
	if maxMove == nil {
		return nil
	}
	p := a.impact(prev, next, ops, maxMove)
	if len(p.OverBudget) == 0 {
		return nil
	}
	var over []string
	for _, s := range p.Services {
		if overBudget(&s, *maxMove) {
			over = append(over, fmt.Sprintf("service %q would move %.2f%% of its new flows", s.Service, 100*s.Moved))
		}
	}
	return fmt.Errorf("%s, more than --max-move %g%%: %w (see weir plan)", strings.Join(over, "; "), *maxMove, ErrOverBudget)
}

func overBudget(s *api.ServicePlan, maxMove float64) bool {
	// Slack for rounding only: shares are ratios of table entries, and --max-move 5
	// must let exactly 5% through.
	return 100*s.Moved > maxMove+1e-9
}

// impact is what going from prev to next (ops: plan.Diff(prev, next)) does to
// each service: the services of next in config order, then those prev has and
// next does not. An XDP service renamed with its VIP and protocol kept is one
// service updated: its new name takes the program's entry over in place.
func (a *Agent) impact(prev, next plan.Desired, ops []plan.Op, maxMove *float64) api.Plan {
	out := api.Plan{MaxMove: maxMove}
	changed := map[string]bool{}
	for _, op := range ops {
		changed[op.Service()] = true
	}
	renamed := map[string]bool{} // prev's names
	for i := range next.Services {
		n := &next.Services[i]
		p := prev.Service(n.Name())
		if p == nil {
			p = renamedFrom(prev, next, n)
		}
		sp := a.serviceImpact(p, n, changed[n.Name()])
		if p != nil && p.Name() != n.Name() {
			renamed[p.Name()], sp.RenamedFrom = true, p.Name()
		}
		out.Services = append(out.Services, sp)
	}
	for i := range prev.Services {
		if p := &prev.Services[i]; next.Service(p.Name()) == nil && !renamed[p.Name()] {
			out.Services = append(out.Services, a.serviceImpact(p, nil, true))
		}
	}
	if maxMove != nil {
		for i := range out.Services {
			if overBudget(&out.Services[i], *maxMove) {
				out.OverBudget = append(out.OverBudget, out.Services[i].Service)
			}
		}
	}
	return out
}

// renamedFrom is the service of prev, gone from next, whose XDP entry n (new in
// next) takes over; nil if none.
func renamedFrom(prev, next plan.Desired, n *plan.Service) *plan.Service {
	for i := range prev.Services {
		if p := &prev.Services[i]; next.Service(p.Name()) == nil && sameXDPEntry(p, n) {
			return p
		}
	}
	return nil
}

func (a *Agent) serviceImpact(p, n *plan.Service, changed bool) api.ServicePlan {
	var sp api.ServicePlan
	switch {
	case p == nil:
		sp.Service, sp.Change, sp.NextDataPlane = n.Name(), api.ChangeAdded, string(n.Plane)
		return sp // no traffic yet: nothing moves
	case n == nil:
		sp.Service, sp.Change, sp.DataPlane, sp.Moved = p.Name(), api.ChangeRemoved, string(p.Plane), 1
	default:
		sp.Service, sp.DataPlane, sp.NextDataPlane = n.Name(), string(p.Plane), string(n.Plane)
		sp.Change = api.ChangeUnchanged
		if changed {
			sp.Change = api.ChangeUpdated
		}
		sp.NewDataPlane = plan.NewDataPlane(p, n, a.rebuilt(p.Plane))
		sp.Moved = plan.ShareChange(p, n)
		if p.Plane != n.Plane || hashes(p) != hashes(n) || rehashed(p, n) {
			sp.Moved = plan.IndependentChange(p, n)
		}
	}
	flows := a.flowImpact(&sp, p, n)
	if n == nil {
		return sp
	}
	if prevT, nextT, ok := a.tables(p, n); ok {
		tc := plan.CompareTables(prevT, nextT)
		sp.Table = tablePlan(tc)
		if rehashed(p, n) {
			// Slot for slot the tables say nothing: a flow's slot changes with its
			// key, and today's flows' hashes are under the old one.
			return sp
		}
		sp.Moved = tc.Share
		if share, ok := plan.TrafficShare(prevT, nextT, flows.Hashes); ok {
			sp.TrafficMoved = &share
		}
	}
	return sp
}

// rehashed reports whether a service that hashes on both sides changes its hash
// key (hash: 5tuple or source; http.hash_by): a new flow or request then lands in
// a slot independent of the one it had, so new flows move as independent picks
// would, table or no table.
func rehashed(p, n *plan.Service) bool {
	return hashes(p) && hashes(n) && (p.Config.Hash != n.Config.Hash || p.Config.HTTP.HashBy != n.Config.HTTP.HashBy)
}

// tables are the lookup table p runs with now and the one n would get, when both run
// on one plane that picks by a table (ok false otherwise, or if either is unknown).
func (a *Agent) tables(p, n *plan.Service) (prevT, nextT []netip.AddrPort, ok bool) {
	pv, isPV := a.planes[p.Plane].(previewer)
	if !isPV || p.Plane != n.Plane || !hashes(p) || !hashes(n) {
		return nil, nil, false
	}
	prevT, err := pv.LiveTable(p)
	if err != nil {
		a.log.Warn("plan: read the lookup table", "service", p.Name(), "err", err)
		return nil, nil, false
	}
	if nextT, err = pv.Table(n); err != nil {
		a.log.Warn("plan: build the lookup table", "service", n.Name(), "err", err)
		return nil, nil, false
	}
	return prevT, nextT, prevT != nil || nextT != nil
}

// hashes reports whether s picks by a lookup table (a nil one then meaning no
// backend): always on XDP, with maglev and source_hash elsewhere. A change between
// a table and a pick without one moves new flows as independent picks would.
func hashes(s *plan.Service) bool { return s.Plane == plan.XDP || s.Config.Algorithm.XDP() }

func tablePlan(tc plan.TableChange) *api.TablePlan {
	t := &api.TablePlan{Size: tc.PrevSize, NextSize: tc.NextSize, Moved: tc.Moved}
	for _, m := range tc.Moves {
		t.Moves = append(t.Moves, api.SlotMove{From: addrString(m.From), To: addrString(m.To), Slots: m.Slots, Share: m.Share})
	}
	return t
}

func addrString(a netip.AddrPort) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}

// flowImpact fills in what the change does to p's established flows, and returns
// them.
func (a *Agent) flowImpact(sp *api.ServicePlan, p, n *plan.Service) plan.Flows {
	sp.FlowKind = string(p.Plane) + " connections"
	switch p.Plane {
	case plan.XDP:
		sp.FlowKind = "xdp flows"
	case plan.HTTP:
		sp.FlowKind = "http requests in flight"
	}
	pv, ok := a.planes[p.Plane].(previewer)
	if !ok {
		sp.FlowsError = "the " + string(p.Plane) + " plane does not count them"
		return plan.Flows{}
	}
	flows, err := pv.Flows(p)
	if err != nil {
		sp.FlowsError = err.Error()
		return plan.Flows{}
	}
	var fates map[netip.AddrPort]plan.Fate
	if p.Plane == plan.HTTP {
		// Client connections are no backend's: only a new listener closes them.
		replaced := plan.Replaced(p, n, a.rebuilt(p.Plane))
		fates = plan.ServedFates(p, n, replaced)
		sp.Clients = &api.ClientPlan{Open: flows.Clients}
		if replaced {
			sp.Clients.Closed = flows.Clients
		}
	} else {
		fates = plan.FlowFates(p, n)
	}
	add := func(b *plan.Backend) {
		addr := b.Config.Addr
		bp := api.BackendPlan{Backend: addr.String(), Flows: flows.PerBackend[addr], Tunnels: flows.Tunnels[addr], Fate: string(fates[addr])}
		switch fates[addr] {
		case plan.Reset:
			sp.Reset += bp.Flows
		case plan.Drain:
			sp.Drained += bp.Flows
			sp.DrainedTunnels += bp.Tunnels
		}
		sp.Flows = append(sp.Flows, bp)
	}
	for i := range p.Backends {
		add(&p.Backends[i])
	}
	for i := range p.Leaving {
		add(&p.Leaving[i])
	}
	return flows
}

// ramping reports whether a backend of d is in a slow start the planner steps.
func ramping(d plan.Desired) bool {
	for _, s := range d.Services {
		for _, b := range s.Backends {
			if b.Ramping() {
				return true
			}
		}
	}
	return false
}
