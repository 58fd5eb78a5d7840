package loader

import (
	"fmt"

	"github.com/weir-lb/weir/bpf"
)

// Capacity is what the program's fixed-size maps hold, as the committed object
// declares them (bpf/consts.h).
type Capacity struct {
	// Services is how many services the program serves at once.
	Services uint32
	// Backends is how many backend slots it has over all services: one for each
	// backend of each service.
	Backends uint32
	// ServiceKeys is the services map's size: a key per service and one per VIP
	// address.
	ServiceKeys uint32
	// Interfaces is how many interfaces a nat packet may be redirected to: every
	// interface the program is attached to.
	Interfaces uint32
}

// ReadCapacity reads the capacities from the object, without loading it (no
// privileges needed).
func ReadCapacity() (Capacity, error) {
	spec, err := bpf.LoadWeir()
	if err != nil {
		return Capacity{}, fmt.Errorf("read xdp program: %w", err)
	}
	return Capacity{
		Services:    spec.Maps[bpf.WeirMapLookupTables].MaxEntries,
		Backends:    spec.Maps[bpf.WeirMapBackends].MaxEntries,
		ServiceKeys: spec.Maps[bpf.WeirMapServices].MaxEntries,
		Interfaces:  spec.Maps[bpf.WeirMapTxPorts].MaxEntries,
	}, nil
}

// Capacity returns the loaded program's capacities, as its maps were created
// (a pinned program keeps the sizes it was first loaded with).
func (p *Program) Capacity() Capacity {
	return Capacity{
		Services:    p.serviceIDs.capacity,
		Backends:    p.backendIDs.capacity,
		ServiceKeys: p.objs.Services.MaxEntries(),
		Interfaces:  p.objs.TxPorts.MaxEntries(),
	}
}
