package loader

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/userspace/balance"
)

// preview.go: what `weir plan` reads of the program to tell what a change would move:
// the lookup table a service would get (the very function the program's tables are
// built with), the one it has, and the established flows per backend.

// maglevEntries is a service's Maglev table as indexes into s.Backends, or nil when no
// backend may take new flows.
func maglevEntries(s Service, seed uint64) ([]uint32, error) {
	members := make([]balance.Backend, len(s.Backends))
	usable := 0
	for i, b := range s.Backends {
		// A draining backend keeps its flows (its slot stays usable) but takes no new ones.
		inTable := b.Usable && !b.Draining
		members[i] = balance.Backend{ID: b.Addr.String(), Weight: b.Weight, Usable: inTable, Ramp: b.Ramp}
		if inTable && b.Weight > 0 {
			usable++
		}
	}
	if usable == 0 {
		return nil, nil
	}
	size := s.TableSize
	if size == 0 {
		size = balance.MaglevSize(len(s.Backends))
	}
	entries, err := balance.BuildMaglev(members, size, seed)
	if err != nil {
		return nil, fmt.Errorf("build lookup table: %w", err)
	}
	return entries, nil
}

// LookupTable is the lookup table the program would hold for s with hash seed seed:
// entry i is the backend a new flow whose hash is i modulo the table's size gets. It
// is nil when no backend may take new flows. It touches no map.
func LookupTable(s Service, seed uint32) ([]netip.AddrPort, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	entries, err := maglevEntries(s, uint64(seed))
	if err != nil || entries == nil {
		return nil, err
	}
	out := make([]netip.AddrPort, len(entries))
	for i, e := range entries {
		out[i] = s.Backends[e].Addr
	}
	return out, nil
}

// Table reads the lookup table a service's packets use now, as LookupTable gives it
// (nil when the service has none: no backend takes new flows).
func (p *Program) Table(key ServiceKey) ([]netip.AddrPort, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	st, err := p.serviceLocked(key, "read table of")
	if err != nil {
		return nil, err
	}
	if st.table == nil {
		return nil, nil
	}
	bySlot := st.addrsBySlot()
	var size uint32
	if err := st.table.Lookup(uint32(0), &size); err != nil {
		return nil, fmt.Errorf("read table of %s: %w", key, err)
	}
	keys := make([]uint32, size+1)
	values := make([]uint32, size+1)
	var cursor ebpf.MapBatchCursor
	n, err := st.table.BatchLookup(&cursor, keys, values, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, fmt.Errorf("read table of %s: %w", key, err)
	}
	out := make([]netip.AddrPort, size)
	for i := range n {
		if keys[i] > 0 && keys[i] <= size {
			out[keys[i]-1] = bySlot[values[i]]
		}
	}
	return out, nil
}

// FlowSet is a service's established flows as the connection table holds them.
type FlowSet struct {
	PerBackend map[netip.AddrPort]uint64
	// Hashes are the flows' hashes as the service's lookup table is indexed by them
	// (the 5-tuple's, or the source address's with SourceHash), up to MaxFlowHashes:
	// a sample of the service's own traffic, to tell how a new table would treat
	// flows like today's.
	Hashes []uint32
}

// MaxFlowHashes bounds FlowSet.Hashes (4 MiB).
const MaxFlowHashes = 1 << 20

// Flows reads a service's established flows per backend, as the connection table
// holds them now: the flows a change that removes, drains or takes down a backend
// acts on. nat flows that have seen a FIN or RST, or whose idle timeout has passed
// (the program would treat their next packet as a new flow), are not counted; dsr
// and tunnel flows are counted while the table holds them. Flows not yet past their
// first packet (the half-open table) are not counted either. The table is read while
// the program runs: flows that begin or end meanwhile may be missed.
func (p *Program) Flows(key ServiceKey) (FlowSet, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	st, err := p.serviceLocked(key, "count flows of")
	if err != nil {
		return FlowSet{}, err
	}
	bySlot := st.addrsBySlot()
	out := FlowSet{PerBackend: make(map[netip.AddrPort]uint64)}
	count := func(k *bpf.WeirFlowKey, backendID uint32) {
		if addr, ok := bySlot[backendID]; ok {
			out.PerBackend[addr]++
			if len(out.Hashes) < MaxFlowHashes {
				out.Hashes = append(out.Hashes, flowHash(k, p.opts.HashSeed, st.spec.SourceHash))
			}
		}
	}
	nat := st.spec.Forwarding == ForwardNAT
	var now uint64
	idle := uint64(p.opts.NAT.TCPIdle)
	if key.Protocol == UDP {
		idle = uint64(p.opts.NAT.UDPIdle)
	}
	if nat {
		var ts unix.Timespec
		// The program stamps flows with bpf_ktime_get_coarse_ns, this clock.
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts); err != nil {
			return FlowSet{}, fmt.Errorf("count flows of %s: read the clock: %w", key, err)
		}
		now = uint64(time.Duration(ts.Nano()))
	}
	live := func(f *bpf.WeirNatFlow) bool {
		return f.Flags&bpf.WeirFlowFlagsFLOW_F_CLOSING == 0 && (now < f.LastSeenNs || now-f.LastSeenNs < idle)
	}
	kind := lbConntrack
	if nat {
		kind = natConntrack
	}
	fp := p.flowPairs()[kind]
	vip := bpf.WeirFlowKey{Dst: addrWords(key.VIP.Addr()), Dport: portWord(key.VIP.Port()), Proto: uint8(key.Protocol)}
	toService := func(k bpf.WeirFlowKey) bool { return k.Dst == vip.Dst && k.Dport == vip.Dport && k.Proto == vip.Proto }
	switch v4 := key.VIP.Addr().Is4(); {
	case nat && v4:
		err = countFlows(fp.v4, keyOf4, toService, func(f *bpf.WeirNatFlow) (uint32, bool) { return f.BackendId, live(f) }, count)
	case nat:
		err = countFlows(fp.v6, keyOf6, toService, func(f *bpf.WeirNatFlow) (uint32, bool) { return f.BackendId, live(f) }, count)
	case v4:
		err = countFlows(fp.v4, keyOf4, toService, func(f *bpf.WeirLbFlow) (uint32, bool) { return f.BackendId, true }, count)
	default:
		err = countFlows(fp.v6, keyOf6, toService, func(f *bpf.WeirLbFlow) (uint32, bool) { return f.BackendId, true }, count)
	}
	if err != nil {
		return FlowSet{}, fmt.Errorf("count flows of %s: %w", key, err)
	}
	return out, nil
}

// serviceLocked is the installed service of key, for op; p.mu must be held.
func (p *Program) serviceLocked(key ServiceKey, op string) (*serviceState, error) {
	if err := p.usable(); err != nil {
		return nil, err
	}
	st, ok := p.services[key]
	if !ok {
		return nil, fmt.Errorf("%s %s: %w", op, key, ErrNoService)
	}
	return st, nil
}

// addrsBySlot is the service's backends by slot in the backends map.
func (st *serviceState) addrsBySlot() map[uint32]netip.AddrPort {
	out := make(map[uint32]netip.AddrPort, len(st.slots))
	for addr, id := range st.slots {
		out[id] = addr
	}
	return out
}

// countFlows calls count with the backend of every entry of m that belongs to the
// service (toService, on the key widened by wide) and is counted (of). It reads m in
// batches: one system call per flowBatch entries instead of two per entry.
func countFlows[K, V any](m *ebpf.Map, wide func(K) bpf.WeirFlowKey, toService func(bpf.WeirFlowKey) bool,
	of func(*V) (uint32, bool), count func(*bpf.WeirFlowKey, uint32)) error {
	keys := make([]K, flowBatch)
	values := make([]V, flowBatch)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, values, nil)
		for i := range n {
			if id, ok := of(&values[i]); ok {
				if w := wide(keys[i]); toService(w) {
					count(&w, id)
				}
			}
		}
		switch {
		case errors.Is(err, ebpf.ErrKeyNotExist):
			return nil // the end
		case err != nil:
			return err
		}
	}
}

// flowBatch is how many flow-table entries countFlows reads per system call.
const flowBatch = 4096

// keyOf4 is key4 the other way.
func keyOf4(k bpf.WeirFlowKey4) bpf.WeirFlowKey {
	return bpf.WeirFlowKey{Src: [4]uint32{k.Src}, Dst: [4]uint32{k.Dst}, Sport: k.Sport, Dport: k.Dport,
		Proto: k.Proto, Family: familyIPv4}
}

func keyOf6(k bpf.WeirFlowKey) bpf.WeirFlowKey { return k }
