package xdpplane

import (
	"net/netip"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/plan"
)

// Table is the lookup table the program would hold for s (nil: none, every backend
// down or drained, or s kept out by all_down: pass), built by the loader's own
// function, without touching the program.
func (x *Plane) Table(s *plan.Service) ([]netip.AddrPort, error) {
	if !s.Installed {
		return nil, nil
	}
	return loader.LookupTable(spec(s), x.hashSeed)
}

// LiveTable is the lookup table the program holds for s now.
func (x *Plane) LiveTable(s *plan.Service) ([]netip.AddrPort, error) {
	if err := x.available(); err != nil {
		return nil, err
	}
	if x.installed[Key(&s.Config)] != s.Name() {
		return nil, nil
	}
	return x.prog.Table(Key(&s.Config))
}

// Flows counts s's established flows per backend, as the connection table holds
// them, with their hashes.
func (x *Plane) Flows(s *plan.Service) (plan.Flows, error) {
	if err := x.available(); err != nil {
		return plan.Flows{}, err
	}
	if x.installed[Key(&s.Config)] != s.Name() {
		return plan.Flows{}, nil
	}
	fs, err := x.prog.Flows(Key(&s.Config))
	return plan.Flows{PerBackend: fs.PerBackend, Hashes: fs.Hashes}, err
}
