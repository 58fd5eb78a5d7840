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
		HashSeed:       p.opts.HashSeed,
		PortMin:        o.PortMin,
		PortMax:        o.PortMax,
		TCPIdleNs:      uint64(o.TCPIdle),
		TCPClosingNs:   uint64(o.TCPClosing),
		UDPIdleNs:      uint64(o.UDPIdle),
		HalfOpenNs:     uint64(o.HalfOpen),
		MaxServices:    p.objs.ServiceStats.MaxEntries(),
		MaxBackends:    p.objs.BackendStats.MaxEntries(),
		Services:       make(map[bpf.WeirVipKey]bpf.WeirService),
		Tables:         make(map[uint32][]uint32),
		Conntrack:      make(map[bpf.WeirFlowKey]bpf.WeirFlowState),
		HalfOpen:       make(map[bpf.WeirFlowKey]bpf.WeirFlowState),
		NATReverse:     make(map[bpf.WeirFlowKey]bpf.WeirNatEntry),
		NATHalfReverse: make(map[bpf.WeirFlowKey]bpf.WeirNatEntry),
		TxPorts:        make(map[uint32]bool),
	}
	m.NewFlowIntervalNs, m.NewFlowBurstNs = p.opts.flowLimitNs()
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
	if err := readAll(p.objs.HalfOpen, m.HalfOpen); err != nil {
		return nil, fmt.Errorf("read half_open: %w", err)
	}
	if err := readAll(p.objs.NatHalfReverse, m.NATHalfReverse); err != nil {
		return nil, fmt.Errorf("read nat_half_reverse: %w", err)
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
	if m.NATCursor, err = readArray[uint32](p.objs.NatCursor, p.objs.NatCursor.MaxEntries()); err != nil {
		return nil, fmt.Errorf("read nat_cursor: %w", err)
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

// flowTables are the program's flow tables, as a test seeds and reads them.
type flowTables struct {
	Conntrack, HalfOpen  map[bpf.WeirFlowKey]bpf.WeirFlowState
	Reverse, HalfReverse map[bpf.WeirFlowKey]bpf.WeirNatEntry
}

func (p *Program) flowMaps() []struct {
	name  string
	m     *ebpf.Map
	state bool // value is a flow_state (else a nat_entry)
} {
	return []struct {
		name  string
		m     *ebpf.Map
		state bool
	}{
		{"conntrack", p.objs.Conntrack, true}, {"half_open", p.objs.HalfOpen, true},
		{"nat_reverse", p.objs.NatReverse, false}, {"nat_half_reverse", p.objs.NatHalfReverse, false},
	}
}

func (t *flowTables) states(i int) map[bpf.WeirFlowKey]bpf.WeirFlowState {
	return [...]map[bpf.WeirFlowKey]bpf.WeirFlowState{t.Conntrack, t.HalfOpen}[i]
}

func (t *flowTables) entries(i int) map[bpf.WeirFlowKey]bpf.WeirNatEntry {
	return [...]map[bpf.WeirFlowKey]bpf.WeirNatEntry{t.Reverse, t.HalfReverse}[i-2]
}

// setFlows replaces the flow tables' contents with next, so a test starts each
// packet from a known state. prev is what the tables hold now (as flows read them),
// so only its keys need deleting.
func (p *Program) setFlows(prev, next flowTables) error {
	for i, fm := range p.flowMaps() {
		var err error
		if fm.state {
			err = replaceEntries(fm.m, prev.states(i), next.states(i))
		} else {
			err = replaceEntries(fm.m, prev.entries(i), next.entries(i))
		}
		if err != nil {
			return fmt.Errorf("seed %s: %w", fm.name, err)
		}
	}
	return nil
}

// replaceEntries makes m hold next where it held prev.
func replaceEntries[V comparable](m *ebpf.Map, prev, next map[bpf.WeirFlowKey]V) error {
	for k := range prev {
		if _, keep := next[k]; keep {
			continue
		}
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	for k, v := range next {
		if old, ok := prev[k]; ok && old == v {
			continue
		}
		if err := m.Put(k, v); err != nil {
			return err
		}
	}
	return nil
}

// flows reads the flow tables.
func (p *Program) flows() (flowTables, error) {
	t := flowTables{
		Conntrack: make(map[bpf.WeirFlowKey]bpf.WeirFlowState), HalfOpen: make(map[bpf.WeirFlowKey]bpf.WeirFlowState),
		Reverse: make(map[bpf.WeirFlowKey]bpf.WeirNatEntry), HalfReverse: make(map[bpf.WeirFlowKey]bpf.WeirNatEntry),
	}
	for i, fm := range p.flowMaps() {
		var err error
		if fm.state {
			err = readAll(fm.m, t.states(i))
		} else {
			err = readAll(fm.m, t.entries(i))
		}
		if err != nil {
			return t, fmt.Errorf("read %s: %w", fm.name, err)
		}
	}
	return t, nil
}

// setNATCursors writes the first len(cursors) entries of nat_cursor.
func (p *Program) setNATCursors(cursors []uint32) error {
	keys := make([]uint32, len(cursors))
	for i := range keys {
		keys[i] = uint32(i)
	}
	if _, err := p.objs.NatCursor.BatchUpdate(keys, cursors, nil); err != nil {
		return fmt.Errorf("seed nat_cursor: %w", err)
	}
	return nil
}

// natCursors reads the first n entries of nat_cursor.
func (p *Program) natCursors(n uint32) ([]uint32, error) {
	c, err := readArray[uint32](p.objs.NatCursor, n)
	if err != nil {
		return nil, fmt.Errorf("read nat_cursor: %w", err)
	}
	return c, nil
}

// setNewFlowTAT sets every CPU's new-flow limit word; newFlowTATs reads them.
func (p *Program) setNewFlowTAT(tat uint64) error {
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return err
	}
	v := make([]uint64, cpus)
	for i := range v {
		v[i] = tat
	}
	if err := p.objs.NewFlowLimit.Put(uint32(0), v); err != nil {
		return fmt.Errorf("seed new_flow_limit: %w", err)
	}
	return nil
}

func (p *Program) newFlowTATs() ([]uint64, error) {
	var v []uint64
	if err := p.objs.NewFlowLimit.Lookup(uint32(0), &v); err != nil {
		return nil, fmt.Errorf("read new_flow_limit: %w", err)
	}
	return v, nil
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
