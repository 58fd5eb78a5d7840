package loader

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/bpf"
)

// Reason is why the program counted a packet (bpf/consts.h enum stat_reason).
type Reason uint32

const (
	ReasonPassNotIP         = Reason(bpf.WeirStatReasonSTAT_PASS_NOT_IP)
	ReasonPassMalformedL3   = Reason(bpf.WeirStatReasonSTAT_PASS_MALFORMED_L3)
	ReasonPassNotService    = Reason(bpf.WeirStatReasonSTAT_PASS_NOT_SERVICE)
	ReasonPassNotVIPL4      = Reason(bpf.WeirStatReasonSTAT_PASS_NOT_VIP_L4)
	ReasonTX                = Reason(bpf.WeirStatReasonSTAT_TX)
	ReasonDropNoBackend     = Reason(bpf.WeirStatReasonSTAT_DROP_NO_BACKEND)
	ReasonDropFragment      = Reason(bpf.WeirStatReasonSTAT_DROP_FRAGMENT)
	ReasonDropMalformedL4   = Reason(bpf.WeirStatReasonSTAT_DROP_MALFORMED_L4)
	ReasonDropIPv6Extension = Reason(bpf.WeirStatReasonSTAT_DROP_IPV6EXT)
	ReasonFlowNew           = Reason(bpf.WeirStatReasonSTAT_FLOW_NEW)
	ReasonFlowHit           = Reason(bpf.WeirStatReasonSTAT_FLOW_HIT)
	ReasonFlowReselect      = Reason(bpf.WeirStatReasonSTAT_FLOW_RESELECT)
	ReasonRedirect          = Reason(bpf.WeirStatReasonSTAT_REDIRECT)
	ReasonNATReply          = Reason(bpf.WeirStatReasonSTAT_NAT_REPLY)
	ReasonPassNoNeighbour   = Reason(bpf.WeirStatReasonSTAT_PASS_NO_NEIGH)
	ReasonDropNoRoute       = Reason(bpf.WeirStatReasonSTAT_DROP_NO_ROUTE)
	ReasonDropNATPorts      = Reason(bpf.WeirStatReasonSTAT_DROP_NAT_PORTS)
	ReasonICMPTranslated    = Reason(bpf.WeirStatReasonSTAT_ICMP_TRANSLATED)
	ReasonTunnelTooBig      = Reason(bpf.WeirStatReasonSTAT_TUNNEL_TOO_BIG)
	ReasonDropTooBig        = Reason(bpf.WeirStatReasonSTAT_DROP_TOO_BIG)
	ReasonFlowEstablished   = Reason(bpf.WeirStatReasonSTAT_FLOW_ESTABLISHED)
	ReasonFlowUntracked     = Reason(bpf.WeirStatReasonSTAT_FLOW_UNTRACKED)
	ReasonDropFlowRate      = Reason(bpf.WeirStatReasonSTAT_DROP_FLOW_RATE)
	ReasonDropHalfOpenFull  = Reason(bpf.WeirStatReasonSTAT_DROP_HALF_OPEN_FULL)
	ReasonFlowSecondChoice  = Reason(bpf.WeirStatReasonSTAT_FLOW_SECOND_CHOICE)
	ReasonFlowFallback      = Reason(bpf.WeirStatReasonSTAT_FLOW_FALLBACK)
	ReasonPassNATStale      = Reason(bpf.WeirStatReasonSTAT_PASS_NAT_STALE)
	ReasonNATNewPort        = Reason(bpf.WeirStatReasonSTAT_NAT_NEW_PORT)
	ReasonDropNoTXPort      = Reason(bpf.WeirStatReasonSTAT_DROP_NO_TX_PORT)
	ReasonNATTooBig         = Reason(bpf.WeirStatReasonSTAT_NAT_TOO_BIG)
	ReasonICMPToBackend     = Reason(bpf.WeirStatReasonSTAT_ICMP_TO_BACKEND)
	ReasonDropICMPChecksum  = Reason(bpf.WeirStatReasonSTAT_DROP_ICMP_CHECKSUM)
	ReasonPassL2Group       = Reason(bpf.WeirStatReasonSTAT_PASS_L2GROUP)
	reasonMax               = Reason(bpf.WeirStatReasonSTAT_MAX)
)

var reasonNames = [...]string{
	ReasonPassNotIP:         "pass_not_ip",
	ReasonPassMalformedL3:   "pass_malformed_l3",
	ReasonPassNotService:    "pass_not_service",
	ReasonPassNotVIPL4:      "pass_not_vip_l4",
	ReasonTX:                "tx",
	ReasonDropNoBackend:     "drop_no_backend",
	ReasonDropFragment:      "drop_fragment",
	ReasonDropMalformedL4:   "drop_malformed_l4",
	ReasonDropIPv6Extension: "drop_ipv6_extension",
	ReasonFlowNew:           "flow_new",
	ReasonFlowHit:           "flow_hit",
	ReasonFlowReselect:      "flow_reselect",
	ReasonRedirect:          "redirect",
	ReasonNATReply:          "nat_reply",
	ReasonPassNoNeighbour:   "pass_no_neighbour",
	ReasonDropNoRoute:       "drop_no_route",
	ReasonDropNATPorts:      "drop_nat_ports",
	ReasonICMPTranslated:    "icmp_translated",
	ReasonTunnelTooBig:      "tunnel_too_big",
	ReasonDropTooBig:        "drop_too_big",
	ReasonFlowEstablished:   "flow_established",
	ReasonFlowUntracked:     "flow_untracked",
	ReasonDropFlowRate:      "drop_flow_rate",
	ReasonDropHalfOpenFull:  "drop_half_open_full",
	ReasonFlowSecondChoice:  "flow_second_choice",
	ReasonFlowFallback:      "flow_fallback",
	ReasonPassNATStale:      "pass_nat_stale",
	ReasonNATNewPort:        "nat_new_port",
	ReasonDropNoTXPort:      "drop_no_tx_port",
	ReasonNATTooBig:         "nat_too_big",
	ReasonICMPToBackend:     "icmp_to_backend",
	ReasonDropICMPChecksum:  "drop_icmp_checksum",
	ReasonPassL2Group:       "pass_l2_group",
}

func (r Reason) String() string {
	if int(r) < len(reasonNames) && reasonNames[r] != "" {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", uint32(r))
}

// Reasons lists every reason the program counts.
func Reasons() []Reason {
	out := make([]Reason, reasonMax)
	for i := range out {
		out[i] = Reason(i)
	}
	return out
}

// Counter is packets and bytes summed over CPUs.
type Counter struct {
	Packets, Bytes uint64
}

// Stats is a snapshot of the program's counters.
type Stats struct {
	Reasons  map[Reason]Counter
	Services map[ServiceKey]Counter
	Backends map[ServiceKey]map[netip.AddrPort]Counter
	// Flows counts each nat backend's flows. A flow the connection table forgets
	// without a FIN or RST (LRU pressure) stays counted as active.
	Flows map[ServiceKey]map[netip.AddrPort]FlowCount
}

// FlowCount is a backend's nat flows since it was added.
type FlowCount struct {
	Opened, Closed uint64
}

// Active is the number of flows opened and not yet closed.
func (f FlowCount) Active() uint64 {
	if f.Closed > f.Opened {
		return 0
	}
	return f.Opened - f.Closed
}

// Stats reads every counter. Counters of a service or backend start at zero when it
// is added.
func (p *Program) Stats() (Stats, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return Stats{}, err
	}
	st := Stats{
		Reasons:  make(map[Reason]Counter, reasonMax),
		Services: make(map[ServiceKey]Counter, len(p.services)),
		Backends: make(map[ServiceKey]map[netip.AddrPort]Counter, len(p.services)),
		Flows:    make(map[ServiceKey]map[netip.AddrPort]FlowCount, len(p.services)),
	}
	for _, r := range Reasons() {
		c, err := sumCounter(p.objs.GlobalStats, uint32(r))
		if err != nil {
			return Stats{}, fmt.Errorf("read counter %s: %w", r, err)
		}
		st.Reasons[r] = c
	}
	for key, s := range p.services {
		c, err := sumCounter(p.objs.ServiceStats, s.id)
		if err != nil {
			return Stats{}, fmt.Errorf("read counters of service %s: %w", key, err)
		}
		st.Services[key] = c
		backends := make(map[netip.AddrPort]Counter, len(s.slots))
		flows := make(map[netip.AddrPort]FlowCount, len(s.slots))
		for addr, id := range s.slots {
			if backends[addr], err = sumCounter(p.objs.BackendStats, id); err != nil {
				return Stats{}, fmt.Errorf("read counters of backend %s of service %s: %w", addr, key, err)
			}
			var perCPU []bpf.WeirFlowCount
			if err := p.objs.BackendFlows.Lookup(id, &perCPU); err != nil {
				return Stats{}, fmt.Errorf("read flow counts of backend %s of service %s: %w", addr, key, err)
			}
			var fc FlowCount
			for _, v := range perCPU {
				fc.Opened += v.Opened
				fc.Closed += v.Closed
			}
			flows[addr] = fc
		}
		st.Backends[key] = backends
		st.Flows[key] = flows
	}
	return st, nil
}

func sumCounter(m *ebpf.Map, index uint32) (Counter, error) {
	var perCPU []bpf.WeirCounter
	if err := m.Lookup(index, &perCPU); err != nil {
		return Counter{}, err
	}
	var c Counter
	for _, v := range perCPU {
		c.Packets += v.Packets
		c.Bytes += v.Bytes
	}
	return c, nil
}

// zeroCounters resets a per-CPU slot whose value is all counters (counter or
// flow_count: both are two uint64).
func (p *Program) zeroCounters(m *ebpf.Map, index uint32) error {
	zero := make([]bpf.WeirCounter, ebpf.MustPossibleCPU())
	if err := m.Put(index, zero); err != nil {
		return fmt.Errorf("reset counters: %w", err)
	}
	return nil
}
