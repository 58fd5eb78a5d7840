package loader

import (
	"errors"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/bpf"
)

// flowmaps.go: the program's flow tables, each kind a pair of maps (IPv4 keyed by
// flow_key4, IPv6 by flow_key), addressed through one flow_key.

// The kinds of flow table, each a pair of maps (IPv4, IPv6); index of flowPairs.
const (
	lbConntrack = iota
	lbHalfOpen
	natConntrack
	natHalfOpen
	natReverse
	natHalfReverse
	flowKinds
)

// flowPair is one kind of flow table: the IPv4 map (flow_key4 keys) and the IPv6 one
// (flow_key keys).
type flowPair struct {
	name   string
	v4, v6 *ebpf.Map
}

func (p *Program) flowPairs() [flowKinds]flowPair {
	o := &p.objs
	return [flowKinds]flowPair{
		{"lb_conntrack", o.LbConntrack4, o.LbConntrack6}, {"lb_half_open", o.LbHalfOpen4, o.LbHalfOpen6},
		{"nat_conntrack", o.NatConntrack4, o.NatConntrack6}, {"nat_half_open", o.NatHalfOpen4, o.NatHalfOpen6},
		{"nat_reverse", o.NatReverse4, o.NatReverse6}, {"nat_half_reverse", o.NatHalfReverse4, o.NatHalfReverse6},
	}
}

// key4 is bpf/flows.h's flow_key4_of.
func key4(k bpf.WeirFlowKey) bpf.WeirFlowKey4 {
	return bpf.WeirFlowKey4{Src: k.Src[0], Dst: k.Dst[0], Sport: k.Sport, Dport: k.Dport, Proto: k.Proto}
}

// lookupPair looks k up in the map of its family.
func lookupPair[V any](fp flowPair, k bpf.WeirFlowKey, v *V) (bool, error) {
	var err error
	if k.Family == familyIPv4 {
		err = fp.v4.Lookup(key4(k), v)
	} else {
		err = fp.v6.Lookup(k, v)
	}
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	return err == nil, err
}
