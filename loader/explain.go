package loader

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/userspace/balance"
)

// Explanation says where the program sends a client's flow to a service.
type Explanation struct {
	// New is the backend a new flow from this client address and port would get from
	// the lookup table now (zero if the service has no usable backend).
	New netip.AddrPort
	// Tracked is the backend the connection table holds for this flow, if any.
	Tracked netip.AddrPort
	// HalfOpen says the flow is tracked in the half-open table: its client has sent
	// only its first packet so far (a spoofed source never gets further).
	HalfOpen bool
	// TrackedUsable says whether Tracked may still carry the flow; if not, the flow's
	// next packet is re-selected.
	TrackedUsable bool
	// NATPort is the flow's source port towards its backend (nat mode).
	NATPort uint16
	// Previous is the backend the previous generation of the lookup table gives,
	// while the fallback may use it (zero otherwise): where a TCP packet that is not
	// a SYN goes when no flow table here knows its flow, if that backend is usable.
	Previous netip.AddrPort
	// Fingerprint identifies the current lookup table (TableInfo.Fingerprint):
	// nodes with equal fingerprints give every new flow the same backend.
	Fingerprint string
	// P2C, for a maglev_p2c service, holds the two candidates New was chosen from.
	P2C *Candidates
}

// Candidates are a maglev_p2c flow's two candidates and the active flows the program
// counts for each (backend_load; negative: unknown). A TCP SYN or a UDP flow's first
// datagram takes Second when balance.PreferSecond says so; any other packet that
// misses the connection table takes First.
type Candidates struct {
	First, Second         netip.AddrPort
	FirstLoad, SecondLoad int64
	// SecondWins says New is Second.
	SecondWins bool
}

// Explain answers "where does this client go": the backend the lookup table gives a
// new flow, and the one the connection table holds for an existing flow.
func (p *Program) Explain(key ServiceKey, client netip.AddrPort) (Explanation, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return Explanation{}, err
	}
	st, ok := p.services[key]
	if !ok {
		return Explanation{}, fmt.Errorf("explain %s for %s: %w", key, client, ErrNoService)
	}
	if client.Addr().Is4() != key.VIP.Addr().Is4() {
		return Explanation{}, fmt.Errorf("explain %s for %s: the client's address family differs from the VIP's", key, client)
	}
	var ex Explanation
	fk := flowKey(Flow{Src: client, Dst: key.VIP, Protocol: key.Protocol})
	bySlot := make(map[uint32]Backend, len(st.slots))
	for _, b := range st.spec.Backends {
		bySlot[st.slots[b.Addr]] = b
	}
	ex.Fingerprint = st.fingerprint
	h := flowHash(&fk, p.opts.HashSeed, st.spec.SourceHash)
	if st.table != nil {
		slot, err := tableSlot(st.table, h, 0)
		if err != nil {
			return Explanation{}, fmt.Errorf("explain %s: read table: %w", key, err)
		}
		ex.New = bySlot[slot].Addr
		if st.spec.P2C {
			if ex.P2C, err = p.candidates(st, bySlot, slot, h); err != nil {
				return Explanation{}, fmt.Errorf("explain %s: %w", key, err)
			}
			if ex.P2C.SecondWins {
				ex.New = ex.P2C.Second
			}
		}
	}
	if st.previous != nil && !st.prevSince.IsZero() {
		slot, err := tableSlot(st.previous, h, 0)
		if err != nil {
			return Explanation{}, fmt.Errorf("explain %s: read previous table: %w", key, err)
		}
		ex.Previous = bySlot[slot].Addr
	}
	var found bool
	var slot uint32
	var natPort uint16
	var err error
	fp := p.flowPairs()
	if st.spec.Forwarding == ForwardNAT {
		var f bpf.WeirNatFlow
		if found, err = lookupPair(fp[natConntrack], fk, &f); err == nil && !found {
			found, err = lookupPair(fp[natHalfOpen], fk, &f)
			ex.HalfOpen = found
		}
		slot, natPort = f.BackendId, f.NatPort
	} else {
		var f bpf.WeirLbFlow
		if found, err = lookupPair(fp[lbConntrack], fk, &f); err == nil && !found {
			found, err = lookupPair(fp[lbHalfOpen], fk, &f)
			ex.HalfOpen = found
		}
		slot = f.BackendId
	}
	if err != nil {
		return Explanation{}, fmt.Errorf("explain %s: read connection table: %w", key, err)
	}
	if b, ok := bySlot[slot]; found && ok && st.slots[b.Addr] == slot {
		ex.Tracked = b.Addr
		ex.TrackedUsable = b.Usable
		ex.NATPort = portWord(natPort)
	} else {
		ex.HalfOpen = false
	}
	return ex, nil
}

// tableSlot is the backend slot a lookup table gives flow hash h (which 1: from a
// maglev_p2c table's second half), as bpf/select.h lookup_table_pick reads it.
func tableSlot(table *ebpf.Map, h uint32, which uint32) (uint32, error) {
	var size, slot uint32
	if err := table.Lookup(uint32(0), &size); err != nil {
		return 0, err
	}
	if size == 0 {
		return 0, fmt.Errorf("table of size 0")
	}
	err := table.Lookup(1+h%size+which*size, &slot)
	return slot, err
}

// candidates reads a maglev_p2c flow's second candidate and both loads, and decides
// as bpf/select.h new_flow_backend does for a SYN.
func (p *Program) candidates(st *serviceState, bySlot map[uint32]Backend, first, h uint32) (*Candidates, error) {
	second, err := tableSlot(st.table, h, 1)
	if err != nil {
		return nil, fmt.Errorf("read second table: %w", err)
	}
	c := &Candidates{First: bySlot[first].Addr, Second: bySlot[second].Addr}
	if err := p.objs.BackendLoad.Lookup(first, &c.FirstLoad); err != nil {
		return nil, fmt.Errorf("read load of %s: %w", c.First, err)
	}
	if err := p.objs.BackendLoad.Lookup(second, &c.SecondLoad); err != nil {
		return nil, fmt.Errorf("read load of %s: %w", c.Second, err)
	}
	a, b := bySlot[first], bySlot[second]
	c.SecondWins = first != second && b.Usable && !b.Draining &&
		balance.PreferSecond(c.FirstLoad, a.Weight, c.SecondLoad, b.Weight)
	return c, nil
}
