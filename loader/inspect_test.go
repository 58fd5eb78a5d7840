package loader

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/bpf"
)

// inspect_test.go: reading the program's maps back whole and seeding them, for the
// data-plane model (model_sim_test.go) and the tests that hold the program against it.

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
		HalfOpenNs:   uint64(o.HalfOpen),
		MaxServices:  p.objs.ServiceStats.MaxEntries(),
		MaxBackends:  p.objs.BackendStats.MaxEntries(),
		Services:     make(map[bpf.WeirVipKey]bpf.WeirService),
		Tables:       make(map[uint32][]uint32),
		PrevTables:   make(map[uint32][]uint32),
		TxPorts:      make(map[uint32]bool),
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
	flows, err := p.flows()
	if err != nil {
		return nil, err
	}
	m.setFlows(flows)
	ports := make(map[uint32]uint32)
	if err := readAll(p.objs.TxPorts, ports); err != nil {
		return nil, fmt.Errorf("read tx_ports: %w", err)
	}
	for k := range ports {
		m.TxPorts[k] = true
	}
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
		for _, t := range []struct {
			outer *ebpf.Map
			into  map[uint32][]uint32
		}{{p.objs.LookupTables, m.Tables}, {p.objs.PrevLookupTables, m.PrevTables}} {
			table, err := readTable(t.outer, svc.Id)
			if err != nil {
				return nil, err
			}
			if table != nil {
				t.into[svc.Id] = table
			}
		}
	}
	return m, nil
}

// readTable reads the inner map an outer map of lookup tables holds for a service
// (nil if none).
func readTable(outer *ebpf.Map, id uint32) ([]uint32, error) {
	inner, table, err := lookupTable(outer, id)
	if inner != nil {
		inner.Close()
	}
	return table, err
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

// readPerCPU reads the first n entries of a per-CPU array map summed over CPUs, as
// counters (both counter and flow_count are two uint64).
func readPerCPU(m *ebpf.Map, n uint32) ([]Counter, error) {
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, err
	}
	values := make([]bpf.WeirCounter, int(n)*cpus)
	if err := batchLookup(m, n, values); err != nil {
		return nil, err
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

func putPair[V any](fp flowPair, k bpf.WeirFlowKey, v V) error {
	if k.Family == familyIPv4 {
		return fp.v4.Put(key4(k), v)
	}
	return fp.v6.Put(k, v)
}

func deletePair(fp flowPair, k bpf.WeirFlowKey) error {
	var err error
	if k.Family == familyIPv4 {
		err = fp.v4.Delete(key4(k))
	} else {
		err = fp.v6.Delete(k)
	}
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil
	}
	return err
}

// readPair copies both maps of a pair into out, IPv4 keys widened to flow_key.
func readPair[V any](fp flowPair, out map[bpf.WeirFlowKey]V) error {
	var k bpf.WeirFlowKey4
	var v V
	it := fp.v4.Iterate()
	for it.Next(&k, &v) {
		out[keyOf4(k)] = v
	}
	if err := it.Err(); err != nil {
		return err
	}
	return readAll(fp.v6, out)
}

// replacePair makes a pair hold next where it held prev.
func replacePair[V comparable](fp flowPair, prev, next map[bpf.WeirFlowKey]V) error {
	for k := range prev {
		if _, keep := next[k]; !keep {
			if err := deletePair(fp, k); err != nil {
				return err
			}
		}
	}
	for k, v := range next {
		if old, ok := prev[k]; ok && old == v {
			continue
		}
		if err := putPair(fp, k, v); err != nil {
			return err
		}
	}
	return nil
}

// flowTables are the program's flow tables by kind, as a test seeds and reads them
// (both families of a kind in one map).
type flowTables struct {
	LB, LBHalfOpen       map[bpf.WeirFlowKey]bpf.WeirLbFlow
	NAT, NATHalfOpen     map[bpf.WeirFlowKey]bpf.WeirNatFlow
	Reverse, HalfReverse map[bpf.WeirFlowKey]bpf.WeirNatEntry
}

func emptyFlowTables() flowTables {
	return flowTables{
		LB: map[bpf.WeirFlowKey]bpf.WeirLbFlow{}, LBHalfOpen: map[bpf.WeirFlowKey]bpf.WeirLbFlow{},
		NAT: map[bpf.WeirFlowKey]bpf.WeirNatFlow{}, NATHalfOpen: map[bpf.WeirFlowKey]bpf.WeirNatFlow{},
		Reverse: map[bpf.WeirFlowKey]bpf.WeirNatEntry{}, HalfReverse: map[bpf.WeirFlowKey]bpf.WeirNatEntry{},
	}
}

// setFlows replaces the flow tables' contents with next, so a test starts each
// packet from a known state. prev is what the tables hold now (as flows read them),
// so only its keys need deleting.
func (p *Program) setFlows(prev, next flowTables) error {
	fp := p.flowPairs()
	for _, err := range []error{
		replacePair(fp[lbConntrack], prev.LB, next.LB), replacePair(fp[lbHalfOpen], prev.LBHalfOpen, next.LBHalfOpen),
		replacePair(fp[natConntrack], prev.NAT, next.NAT), replacePair(fp[natHalfOpen], prev.NATHalfOpen, next.NATHalfOpen),
		replacePair(fp[natReverse], prev.Reverse, next.Reverse), replacePair(fp[natHalfReverse], prev.HalfReverse, next.HalfReverse),
	} {
		if err != nil {
			return fmt.Errorf("seed flow tables: %w", err)
		}
	}
	return nil
}

// flows reads the flow tables.
func (p *Program) flows() (flowTables, error) {
	t := emptyFlowTables()
	fp := p.flowPairs()
	for _, err := range []error{
		readPair(fp[lbConntrack], t.LB), readPair(fp[lbHalfOpen], t.LBHalfOpen),
		readPair(fp[natConntrack], t.NAT), readPair(fp[natHalfOpen], t.NATHalfOpen),
		readPair(fp[natReverse], t.Reverse), readPair(fp[natHalfReverse], t.HalfReverse),
	} {
		if err != nil {
			return t, fmt.Errorf("read flow tables: %w", err)
		}
	}
	return t, nil
}

// setNATCursors writes the first len(cursors) entries of nat_cursor.
func (p *Program) setNATCursors(cursors []uint32) error {
	if err := writeArray(p.objs.NatCursor, cursors); err != nil {
		return fmt.Errorf("seed nat_cursor: %w", err)
	}
	return nil
}

// writeArray writes the first len(values) entries of an array map.
func writeArray[V any](m *ebpf.Map, values []V) error {
	keys := make([]uint32, len(values))
	for i := range keys {
		keys[i] = uint32(i)
	}
	_, err := m.BatchUpdate(keys, values, nil)
	return err
}

// setLoads writes the first len(loads) entries of backend_load; loads reads them.
func (p *Program) setLoads(loads []int64) error {
	if err := writeArray(p.objs.BackendLoad, loads); err != nil {
		return fmt.Errorf("seed backend_load: %w", err)
	}
	return nil
}

func (p *Program) loads(n uint32) ([]int64, error) {
	l, err := readArray[int64](p.objs.BackendLoad, n)
	if err != nil {
		return nil, fmt.Errorf("read backend_load: %w", err)
	}
	return l, nil
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
