package httpplane

import (
	"fmt"
	"net/netip"

	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/balance"
	"github.com/weir-lb/weir/userspace/config"
)

// preview.go: what weir plan asks of the http plane. Requests are balanced one by
// one, so what a change moves is new requests (by the algorithm's table or the
// backends' shares), and what it touches is the requests in flight and the client
// connections, which belong to no backend.

// Table is the Maglev table the service's balancer would build for s (maglev and
// source_hash; nil for the other algorithms, which pick without one, and when no
// backend takes new requests): built as userspace/balance builds it, over the
// backends this plane gives it, so weir plan compares the very tables.
func (p *Plane) Table(s *plan.Service) ([]netip.AddrPort, error) {
	if !s.Config.Algorithm.XDP() {
		return nil, nil
	}
	// As the balancer's snapshot has them: every backend with a weight, up or down
	// (the table spills a down one's slots); the table's order of them is by ID.
	var members []balance.Backend
	var addrs []netip.AddrPort
	usable := false
	for _, b := range backends(s) {
		if b.Weight == 0 {
			continue
		}
		usable = usable || b.Usable
		members = append(members, balance.Backend{ID: b.Addr.String(), Weight: b.Weight, Usable: b.Usable, Ramp: b.Ramp})
		addrs = append(addrs, b.Addr)
	}
	if !usable {
		return nil, nil
	}
	// The agent gives httplb no seed: its balancers hash with seed 0.
	idx, err := balance.BuildMaglev(members, balance.MaglevSize(len(members)), 0)
	if err != nil {
		return nil, fmt.Errorf("service %q: %w", s.Name(), err)
	}
	out := make([]netip.AddrPort, len(idx))
	for i, j := range idx {
		out[i] = addrs[j]
	}
	return out, nil
}

// LiveTable is the table the running service's balancer holds: the one Table
// gives for the state this plane last pushed to it, which is s (the agent's
// running state), as the table is a pure function of the backends pushed. nil when
// the plane does not serve s.
func (p *Plane) LiveTable(s *plan.Service) ([]netip.AddrPort, error) {
	if _, ok := p.Get(s.Name()); !ok {
		return nil, nil
	}
	return p.Table(s)
}

// Flows counts s's requests in flight per backend (and of them, tunnels) and its
// client connections.
func (p *Plane) Flows(s *plan.Service) (plan.Flows, error) {
	snap, ok := p.Snapshot(s.Name())
	if !ok {
		return plan.Flows{}, nil
	}
	out := plan.Flows{PerBackend: make(map[netip.AddrPort]uint64, len(snap.Backends)), Clients: uint64(max(snap.Connections, 0))}
	for _, b := range snap.Backends {
		if b.InFlight > 0 {
			out.PerBackend[b.Addr] = uint64(b.InFlight)
		}
		if b.Tunnels > 0 {
			if out.Tunnels == nil {
				out.Tunnels = map[netip.AddrPort]uint64{}
			}
			out.Tunnels[b.Addr] = uint64(b.Tunnels)
		}
	}
	return out, nil
}

// Rebuilds says whether a change from a to b gives the service a new listener
// (the old one drains: HTTP/2 clients get GOAWAY, HTTP/1.1 ones are closed after
// their request), where anything else is applied in place.
func (p *Plane) Rebuilds(a, b *config.Service) bool { return rebuilt(a, b) }
