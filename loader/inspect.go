package loader

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/bpf"
)

// inspect.go: reading the program's maps back whole, for the data-plane model
// (model.go) and the tests that hold the program against it.

// Model returns a model of the program (see Model) holding its current map contents
// and load-time settings, so that Model.Run predicts what the program does with a
// frame now. The maps are read as the kernel holds them, lookup tables through the
// outer map, not from the loader's own records.
func (p *Program) Model() (*Model, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return nil, err
	}
	o := p.opts.NAT
	m := &Model{
		HashSeed:     p.opts.HashSeed,
		PortMin:      o.PortMin,
		PortMax:      o.PortMax,
		TCPIdleNs:    uint64(o.TCPIdle),
		TCPClosingNs: uint64(o.TCPClosing),
		UDPIdleNs:    uint64(o.UDPIdle),
		MaxServices:  p.objs.ServiceStats.MaxEntries(),
		MaxBackends:  p.objs.BackendStats.MaxEntries(),
		Services:     make(map[bpf.WeirVipKey]bpf.WeirService),
		Tables:       make(map[uint32][]uint32),
		Conntrack:    make(map[bpf.WeirFlowKey]bpf.WeirFlowState),
		NATReverse:   make(map[bpf.WeirFlowKey]bpf.WeirNatEntry),
		TxPorts:      make(map[uint32]bool),
	}
	if o.Addr4.IsValid() {
		m.NATAddr4 = addrWords(o.Addr4)[0]
	}
	if o.Addr6.IsValid() {
		m.NATAddr6 = addrWords(o.Addr6)
	}
	if err := readAll(p.objs.Services, m.Services); err != nil {
		return nil, fmt.Errorf("read services: %w", err)
	}
	if err := readAll(p.objs.Conntrack, m.Conntrack); err != nil {
		return nil, fmt.Errorf("read conntrack: %w", err)
	}
	if err := readAll(p.objs.NatReverse, m.NATReverse); err != nil {
		return nil, fmt.Errorf("read nat_reverse: %w", err)
	}
	ports := make(map[uint32]uint32)
	if err := readAll(p.objs.TxPorts, ports); err != nil {
		return nil, fmt.Errorf("read tx_ports: %w", err)
	}
	for k := range ports {
		m.TxPorts[k] = true
	}
	var err error
	if m.Backends, err = readArray[bpf.WeirBackend](p.objs.Backends, p.objs.Backends.MaxEntries()); err != nil {
		return nil, fmt.Errorf("read backends: %w", err)
	}
	for _, svc := range m.Services {
		if _, done := m.Tables[svc.Id]; done {
			continue
		}
		var inner *ebpf.Map
		err := p.objs.LookupTables.Lookup(svc.Id, &inner)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read lookup table of service id %d: %w", svc.Id, err)
		}
		table, err := readArray[uint32](inner, inner.MaxEntries())
		inner.Close()
		if err != nil {
			return nil, fmt.Errorf("read lookup table of service id %d: %w", svc.Id, err)
		}
		m.Tables[svc.Id] = table
	}
	return m, nil
}

// readAll copies a hash map into out.
func readAll[K comparable, V any](m *ebpf.Map, out map[K]V) error {
	var k K
	var v V
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	return it.Err()
}

// readArray reads the first n entries of an array map.
func readArray[V any](m *ebpf.Map, n uint32) ([]V, error) {
	keys := make([]uint32, n)
	values := make([]V, n)
	var cursor ebpf.MapBatchCursor
	got, err := m.BatchLookup(&cursor, keys, values, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, err
	}
	if got != int(n) {
		return nil, fmt.Errorf("batch lookup: %d of %d entries", got, n)
	}
	return values, nil
}

// readPerCPU reads the first n entries of a per-CPU array map summed over CPUs, as
// counters (both counter and flow_count are two uint64).
func readPerCPU(m *ebpf.Map, n uint32) ([]Counter, error) {
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, err
	}
	keys := make([]uint32, n)
	values := make([]bpf.WeirCounter, int(n)*cpus)
	var cursor ebpf.MapBatchCursor
	got, err := m.BatchLookup(&cursor, keys, values, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, err
	}
	if got != int(n) {
		return nil, fmt.Errorf("batch lookup: %d of %d entries", got, n)
	}
	out := make([]Counter, n)
	for i := range out {
		for _, v := range values[i*cpus : (i+1)*cpus] {
			out[i].Packets += v.Packets
			out[i].Bytes += v.Bytes
		}
	}
	return out, nil
}

// dataPlaneCounters are the program's counters, summed over CPUs: every reason, and
// the first entries of the per-service and per-backend arrays.
type dataPlaneCounters struct {
	Reasons, Services, Backends, Flows []Counter // Flows: Packets opened, Bytes closed
}

func (p *Program) readCounters(services, backends uint32) (dataPlaneCounters, error) {
	var c dataPlaneCounters
	var err error
	if c.Reasons, err = readPerCPU(p.objs.GlobalStats, uint32(reasonMax)); err != nil {
		return c, fmt.Errorf("read global_stats: %w", err)
	}
	if c.Services, err = readPerCPU(p.objs.ServiceStats, services); err != nil {
		return c, fmt.Errorf("read service_stats: %w", err)
	}
	if c.Backends, err = readPerCPU(p.objs.BackendStats, backends); err != nil {
		return c, fmt.Errorf("read backend_stats: %w", err)
	}
	if c.Flows, err = readPerCPU(p.objs.BackendFlows, backends); err != nil {
		return c, fmt.Errorf("read backend_flows: %w", err)
	}
	return c, nil
}

// setFlows empties the connection and nat reverse tables and fills them with the
// given entries, so a test starts each packet from a known state.
func (p *Program) setFlows(conntrack map[bpf.WeirFlowKey]bpf.WeirFlowState, reverse map[bpf.WeirFlowKey]bpf.WeirNatEntry) error {
	if err := clearMap[bpf.WeirFlowKey, bpf.WeirFlowState](p.objs.Conntrack); err != nil {
		return fmt.Errorf("clear conntrack: %w", err)
	}
	if err := clearMap[bpf.WeirFlowKey, bpf.WeirNatEntry](p.objs.NatReverse); err != nil {
		return fmt.Errorf("clear nat_reverse: %w", err)
	}
	for k, v := range conntrack {
		if err := p.objs.Conntrack.Put(k, v); err != nil {
			return fmt.Errorf("seed conntrack: %w", err)
		}
	}
	for k, v := range reverse {
		if err := p.objs.NatReverse.Put(k, v); err != nil {
			return fmt.Errorf("seed nat_reverse: %w", err)
		}
	}
	return nil
}

// setBackends writes backend slots whole, in one batch (the tests seed tunnel next
// hops).
func (p *Program) setBackends(backends map[uint32]bpf.WeirBackend) error {
	if len(backends) == 0 {
		return nil
	}
	keys := make([]uint32, 0, len(backends))
	values := make([]bpf.WeirBackend, 0, len(backends))
	for id, b := range backends {
		keys = append(keys, id)
		values = append(values, b)
	}
	if _, err := p.objs.Backends.BatchUpdate(keys, values, nil); err != nil {
		return fmt.Errorf("seed backends: %w", err)
	}
	return nil
}

// backendSlots reads the first n slots of the backends array.
func (p *Program) backendSlots(n uint32) ([]bpf.WeirBackend, error) {
	b, err := readArray[bpf.WeirBackend](p.objs.Backends, n)
	if err != nil {
		return nil, fmt.Errorf("read backends: %w", err)
	}
	return b, nil
}

// flows reads the connection and nat reverse tables.
func (p *Program) flows() (map[bpf.WeirFlowKey]bpf.WeirFlowState, map[bpf.WeirFlowKey]bpf.WeirNatEntry, error) {
	ct := make(map[bpf.WeirFlowKey]bpf.WeirFlowState)
	rev := make(map[bpf.WeirFlowKey]bpf.WeirNatEntry)
	if err := readAll(p.objs.Conntrack, ct); err != nil {
		return nil, nil, fmt.Errorf("read conntrack: %w", err)
	}
	if err := readAll(p.objs.NatReverse, rev); err != nil {
		return nil, nil, fmt.Errorf("read nat_reverse: %w", err)
	}
	return ct, rev, nil
}

func clearMap[K comparable, V any](m *ebpf.Map) error {
	all := make(map[K]V)
	if err := readAll(m, all); err != nil {
		return err
	}
	for k := range all {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}
