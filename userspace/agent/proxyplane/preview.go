package proxyplane

import (
	"net/netip"

	"github.com/weir-lb/weir/userspace/agent/plan"
)

// Table: the proxy's balancers keep their own tables (and most pick without one), so
// weir plan compares the backends' shares of the weights instead.
func (p *Plane) Table(*plan.Service) ([]netip.AddrPort, error) { return nil, nil }

// LiveTable: see Table.
func (p *Plane) LiveTable(*plan.Service) ([]netip.AddrPort, error) { return nil, nil }

// Flows counts s's open connections per backend.
func (p *Plane) Flows(s *plan.Service) (plan.Flows, error) {
	snap, ok := p.Snapshot(s.Name())
	if !ok {
		return plan.Flows{}, nil
	}
	out := plan.Flows{PerBackend: make(map[netip.AddrPort]uint64, len(snap.Backends))}
	for _, b := range snap.Backends {
		if b.Active > 0 {
			out.PerBackend[b.Addr] = uint64(b.Active)
		}
	}
	return out, nil
}
