package loader

import (
	"encoding/binary"
	"fmt"
	"math/bits"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/userspace/balance"
)

// model_sim_test.go: a pure-Go model of the XDP program's decision (bpf/weir.c and its
// headers), step for step: parse, ICMP error translation, nat replies, VIP match,
// connection table, lookup table, the dsr, nat and tunnel forwarding (with tunnel
// mode's next-hop cache and ICMP "too big" replies), counters. Given the same map
// contents and a frame it predicts the verdict, the output frame, the counters and
// the changes to the connection and nat reverse tables and to the backends' cached
// next hops. FuzzDataPath holds it against the real program; it mirrors the C, bugs
// included, so keep the two in step.
//
// What no model can predict comes in through ModelEnv: the clock and
// bpf_fib_lookup's answer. The model
// assumes bpf_xdp_adjust_head always finds the headroom it asks for (at most 40
// bytes; drivers and BPF_PROG_TEST_RUN leave 256).
//
// Words are read from the frame as the C reads them: network-order bytes loaded as
// native (little-endian) integers, the layout bpf2go's key and value types hold.

// Model is the program's map contents and load-time settings. Run changes the flow
// tables (each kind's IPv4 and IPv6 maps in one Go map keyed by flow_key), the nat port rings
// (NATCursor), the new-flow limit (NewFlowTAT) and the tunnel next-hop cache of
// Backends (hop, hop_ns, hop_len) as the program changes its maps.
type Model struct {
	HashSeed uint32
	// The nat settings (bpf/nat.h's volatile consts) as the program holds them.
	NATAddr4         uint32
	NATAddr6         [4]uint32
	PortMin, PortMax uint16
	TCPIdleNs        uint64
	TCPClosingNs     uint64
	UDPIdleNs        uint64
	HalfOpenNs       uint64
	// The new-flow limit (bpf/select.h): the cost of one flow and the credit that may
	// be drawn ahead, in ns; 0 is no limit. NewFlowTAT is new_flow_limit's word of
	// the CPU that runs the program.
	NewFlowIntervalNs, NewFlowBurstNs uint64
	NewFlowTAT                        uint64
	MaxServices                       uint32 // entries of lookup_tables and service_stats
	MaxBackends                       uint32 // entries of backend_stats, backend_flows and nat_cursor
	Services                          map[bpf.WeirVipKey]bpf.WeirService
	Backends                          []bpf.WeirBackend   // the whole array, index = slot; Run writes tunnel next hops in place
	Tables                            map[uint32][]uint32 // service id -> lookup table: entry 0 the size M, 1..M slots (maglev_p2c: M+1..2M its second)
	PrevTables                        map[uint32][]uint32 // prev_lookup_tables, likewise
	// Load is backend_load by slot; Run adds to it as the program does. Slots past its
	// end (but inside the array) are not modelled: the rig seeds and reads only these.
	Load                       []int64
	LBConntrack, LBHalfOpen    map[bpf.WeirFlowKey]bpf.WeirLbFlow // dsr and tunnel
	NATConntrack, NATHalfOpen  map[bpf.WeirFlowKey]bpf.WeirNatFlow
	NATReverse, NATHalfReverse map[bpf.WeirFlowKey]bpf.WeirNatEntry
	NATCursor                  []uint32        // by nat port ring, backend.nat_ring (MaxBackends entries)
	TxPorts                    map[uint32]bool // tx_ports keys
	IngressIfindex             uint32          // ctx->ingress_ifindex of every Run
}

// ModelEnv is what the model cannot know.
type ModelEnv struct {
	// Now is bpf_ktime_get_coarse_ns as the program reads it.
	Now uint64
	// FIB answers bpf_fib_lookup; nil means no route (drop_no_route). nat asks it for
	// the rewritten packet's next hop, tunnel mode for the outer packet's (Proto 4 or
	// 41, TotLen the outer packet's length, which the kernel checks against the
	// route's MTU).
	FIB func(FIBQuery) FIBAnswer
}

// FIBQuery is what the program asks bpf_fib_lookup.
type FIBQuery struct {
	Family, Proto uint8
	Src, Dst      [4]uint32
	Sport, Dport  uint16 // network order, as native words
	TotLen        uint16
	Ifindex       uint32
}

// FIBAnswer is bpf_fib_lookup's result.
type FIBAnswer struct {
	Result         FIBResult
	SrcMAC, DstMAC [6]byte
	Ifindex        uint32
	MTU            uint16 // with FIBFragNeeded: the route's MTU (mtu_result)
}

// FIBResult is the return code of bpf_fib_lookup, reduced to what the program
// distinguishes.
type FIBResult int

const (
	FIBNoRoute FIBResult = iota // any failure other than those below
	FIBSuccess
	FIBNoNeighbour
	FIBFragNeeded // TotLen exceeds the route's MTU (BPF_FIB_LKUP_RET_FRAG_NEEDED)
)

// Outcome is the model's prediction for one frame.
type Outcome struct {
	Action Action
	Frame  []byte // the frame as the program leaves it
	// Len is the frame's length: every counter below counts one packet of Len bytes.
	Len      uint32
	Reasons  []Reason // global_stats, in the order counted
	Services []uint32 // service_stats indexes counted
	Backends []uint32 // backend_stats indexes counted
	// FlowsOpened and FlowsClosed are backend_flows increments by backend slot.
	FlowsOpened, FlowsClosed []uint32
}

// Constants of bpf/consts.h and the kernel's headers.
const (
	modelContinue        = -1
	maxL3Offset          = 64
	maxL4Offset          = 512
	maxIPv6ExtHeaders    = 4
	natPortTries         = 8 // NAT_PORT_TRIES
	flowFlagClosing      = bpf.WeirFlowFlagsFLOW_F_CLOSING
	flowFlagStale        = bpf.WeirFlowFlagsFLOW_F_STALE
	flowFlagKept         = bpf.WeirFlowFlagsFLOW_F_KEPT
	flowFlagFinClient    = bpf.WeirFlowFlagsFLOW_F_FIN_CLIENT
	flowFlagFinBackend   = bpf.WeirFlowFlagsFLOW_F_FIN_BACKEND
	flowFlagFins         = flowFlagFinClient | flowFlagFinBackend // FLOW_F_FINS
	synDataMax           = 0xffff                                 // SYN_DATA_MAX
	lbFlowClosed         = uint32(bpf.WeirLbFlowBitsLB_FLOW_CLOSED)
	nsecPerSec           = 1_000_000_000
	replyTickShift       = 20  // REPLY_TICK_SHIFT
	replyTicksPerRefresh = 954 // REPLY_TICKS_PER_REFRESH
	protoHopOpts         = 0
	protoICMP            = 1
	protoTCP             = 6
	protoUDP             = 17
	protoRouting         = 43
	protoFragment        = 44
	protoESP             = 50
	protoAH              = 51
	protoICMPv6          = 58
	protoDstOpts         = 60
	tcpFlagFIN           = 0x01
	tcpFlagSYN           = 0x02
	tcpFlagRST           = 0x04
	tcpFlagACK           = 0x10
	etherTypeIPv4        = 0x0800
	etherTypeIPv6        = 0x86dd
	etherTypeVLAN        = 0x8100
	ipv4HeaderLen        = 20
	ipv6HeaderLen        = 40
	icmpHeaderLen        = 8
	ethHeaderLen         = 14
	vlanHeaderLen        = 4
	tcpHeaderLen         = 20
	udpHeaderLen         = 8
	ipv6OptHeaderMinLen  = 2
	ipv6RoutingMinLen    = 4 // through segments left
	maxICMPQuote         = 200
	maxICMPChecked       = 4096 // MAX_ICMP_CHECKED
	protoIPIP            = 4    // IPv4 inside (tunnel.h IPPROTO_IPIP_)
	protoIPv6            = 41   // IPv6 inside
	ipFlagDF             = 0x4000
)

// modelPacket is struct packet of bpf/parse.h.
type modelPacket struct {
	flow      bpf.WeirFlowKey
	len       uint32
	l3, l4    uint32 // __u16 in C; every value fits
	l3Len     uint32 // the IP packet's length as its header says
	tcpFlags  uint8
	icmpError bool
	// The TCP sequence and acknowledgement numbers as the program loads them: network
	// order bytes read as a native (little-endian) word.
	tcpSeq, tcpAck uint32
	vlanTCI        uint16 // the 802.1Q tag's TCI as loaded (network order bytes as a native word); 0: none
}

// run is one packet through the model: the frame being rewritten and what was counted.
type run struct {
	m   *Model
	env ModelEnv
	b   []byte
	out Outcome
}

// setFlows makes t the model's flow tables (the maps, not copies).
func (m *Model) setFlows(t flowTables) {
	m.LBConntrack, m.LBHalfOpen = t.LB, t.LBHalfOpen
	m.NATConntrack, m.NATHalfOpen = t.NAT, t.NATHalfOpen
	m.NATReverse, m.NATHalfReverse = t.Reverse, t.HalfReverse
}

// Run predicts what the program does with frame.
func (m *Model) Run(frame []byte, env ModelEnv) Outcome {
	r := &run{m: m, env: env, b: append([]byte(nil), frame...)}
	r.out.Len = uint32(len(frame))
	r.out.Action = Action(r.program())
	r.out.Frame = r.b
	return r.out
}

// Little-endian loads and stores: the C's native accesses to network-order bytes.
func (r *run) ld16(off uint32) uint16         { return binary.LittleEndian.Uint16(r.b[off:]) }
func (r *run) ld32(off uint32) uint32         { return binary.LittleEndian.Uint32(r.b[off:]) }
func (r *run) st16(off uint32, v uint16)      { binary.LittleEndian.PutUint16(r.b[off:], v) }
func (r *run) st32(off uint32, v uint32)      { binary.LittleEndian.PutUint32(r.b[off:], v) }
func (r *run) fits(off, n uint32) bool        { return uint64(off)+uint64(n) <= uint64(len(r.b)) }
func ntohs(v uint16) uint16                   { return v>>8 | v<<8 }
func (r *run) count(reason Reason)            { r.out.Reasons = append(r.out.Reasons, reason) }
func (r *run) verdict(a Action, s Reason) int { r.count(s); return int(a) }

func (r *run) countService(id uint32) {
	if id < r.m.MaxServices {
		r.out.Services = append(r.out.Services, id)
	}
}

func (r *run) countBackend(id uint32) {
	if id < r.m.MaxBackends {
		r.out.Backends = append(r.out.Backends, id)
	}
}

func (r *run) countFlow(id uint32, opened bool) {
	if id >= r.m.MaxBackends {
		return
	}
	if opened {
		r.loadAdd(id, 1)
	} else {
		r.loadAdd(id, -1)
	}
	if opened {
		r.out.FlowsOpened = append(r.out.FlowsOpened, id)
	} else {
		r.out.FlowsClosed = append(r.out.FlowsClosed, id)
	}
}

// program is weir_xdp.
func (r *run) program() int {
	var p modelPacket
	if a := r.parse(&p); a != modelContinue {
		return a
	}
	if p.icmpError {
		return r.icmpErrorTranslate(&p)
	}
	if r.isNATAddress(&p.flow) {
		if a := r.natReply(&p); a != modelContinue {
			return a
		}
	}
	key := bpf.WeirVipKey{Addr: p.flow.Dst, Port: p.flow.Dport, Proto: p.flow.Proto, Family: p.flow.Family}
	svc, ok := r.m.Services[key]
	if !ok {
		return r.verdict(XDPPass, ReasonPassNotService)
	}
	switch svc.Mode {
	case bpf.WeirModeMODE_NAT:
		return r.natForward(&p, svc)
	case bpf.WeirModeMODE_TUNNEL:
		return r.tunnelForward(&p, svc)
	}
	id, be, a := r.selectBackend(&p, svc)
	if a != modelContinue {
		return a
	}
	r.countService(svc.Id)
	r.countBackend(id)
	return r.forwardDSR(be)
}

// forwardDSR is dsr.h's forward_dsr: the frame came to us, so its destination MAC
// is our source MAC. Its callers count tx whatever it returns.
func (r *run) forwardDSR(be bpf.WeirBackend) int {
	if !r.fits(0, ethHeaderLen) {
		return r.verdict(XDPAborted, ReasonTX)
	}
	copy(r.b[6:12], r.b[0:6])
	copy(r.b[0:6], be.Mac[:])
	return r.verdict(XDPTX, ReasonTX)
}

// parse is bpf/parse.h's parse.
func (r *run) parse(p *modelPacket) int {
	p.len = uint32(len(r.b))
	off := uint32(ethHeaderLen)
	if !r.fits(0, ethHeaderLen) {
		return r.verdict(XDPPass, ReasonPassNotIP)
	}
	proto := binary.BigEndian.Uint16(r.b[12:])
	if proto == etherTypeVLAN {
		if !r.fits(off, vlanHeaderLen) {
			return r.verdict(XDPPass, ReasonPassNotIP)
		}
		proto = binary.BigEndian.Uint16(r.b[off+2:])
		p.vlanTCI = r.ld16(off)
		off += vlanHeaderLen
	}
	p.l3 = off
	if proto != etherTypeIPv4 && proto != etherTypeIPv6 {
		return r.verdict(XDPPass, ReasonPassNotIP)
	}
	if r.b[0]&1 != 0 { // a group MAC
		return r.verdict(XDPPass, ReasonPassL2Group)
	}
	if proto == etherTypeIPv4 {
		return r.parseIPv4(off, p)
	}
	return r.parseIPv6(off, p)
}

func (r *run) parseIPv4(off uint32, p *modelPacket) int {
	if !r.fits(off, ipv4HeaderLen) || r.b[off]>>4 != 4 || r.b[off]&0xf < 5 {
		return r.verdict(XDPPass, ReasonPassMalformedL3)
	}
	ihl := uint32(r.b[off]&0xf) * 4
	totLen := uint32(binary.BigEndian.Uint16(r.b[off+2:]))
	if totLen < ihl || !r.fits(off, totLen) {
		return r.verdict(XDPPass, ReasonPassMalformedL3)
	}
	p.flow.Family = familyIPv4
	p.l3Len = totLen
	p.flow.Proto = r.b[off+9]
	p.flow.Src[0] = r.ld32(off + 12)
	p.flow.Dst[0] = r.ld32(off + 16)
	if binary.BigEndian.Uint16(r.b[off+6:])&0x3fff != 0 {
		return r.vipAddressVerdict(p, ReasonDropFragment)
	}
	return r.parseL4(off+ihl, p)
}

// ipv6SkipExt is parse.h's ipv6_skip_ext: the offset and type of the header after
// the hop-by-hop, routing and destination-options headers from off (the first of
// type next), stopping at a routing header with segments left; false when one is
// cut off by the frame's end.
func (r *run) ipv6SkipExt(off uint32, next uint8) (uint32, uint8, bool) {
	for range maxIPv6ExtHeaders {
		if next != protoHopOpts && next != protoRouting && next != protoDstOpts {
			break
		}
		if !r.fits(off, ipv6OptHeaderMinLen) {
			return off, next, false
		}
		if next == protoRouting {
			if !r.fits(off, ipv6RoutingMinLen) {
				return off, next, false
			}
			if r.b[off+3] != 0 { // segments left
				break
			}
		}
		next = r.b[off]
		off += (uint32(r.b[off+1]) + 1) * 8
	}
	return off, next, true
}

func (r *run) parseIPv6(off uint32, p *modelPacket) int {
	if !r.fits(off, ipv6HeaderLen) || r.b[off]>>4 != 6 {
		return r.verdict(XDPPass, ReasonPassMalformedL3)
	}
	if !r.fits(off+ipv6HeaderLen, uint32(binary.BigEndian.Uint16(r.b[off+4:]))) {
		return r.verdict(XDPPass, ReasonPassMalformedL3)
	}
	p.flow.Family = familyIPv6
	p.l3Len = ipv6HeaderLen + uint32(binary.BigEndian.Uint16(r.b[off+4:]))
	for i := range 4 {
		p.flow.Src[i] = r.ld32(off + 8 + uint32(i)*4)
		p.flow.Dst[i] = r.ld32(off + 24 + uint32(i)*4)
	}
	off, next, ok := r.ipv6SkipExt(off+ipv6HeaderLen, r.b[off+6])
	if !ok {
		return r.vipAddressVerdict(p, ReasonDropMalformedL4)
	}
	p.flow.Proto = next
	// Headers this long are legal, but the rewriting steps bound their offsets.
	if off > maxL4Offset {
		return r.vipAddressVerdict(p, ReasonDropIPv6Extension)
	}
	if next == protoFragment {
		return r.vipAddressVerdict(p, ReasonDropFragment)
	}
	switch next {
	case protoHopOpts, protoRouting, protoDstOpts, protoAH, protoESP:
		return r.vipAddressVerdict(p, ReasonDropIPv6Extension)
	}
	return r.parseL4(off, p)
}

func (r *run) parseL4(off uint32, p *modelPacket) int {
	p.l4 = off
	switch p.flow.Proto {
	case protoTCP:
		if !r.fits(off, tcpHeaderLen) || !withinIP(p, off, tcpHeaderLen) {
			return r.vipAddressVerdict(p, ReasonDropMalformedL4)
		}
		// The data offset: at least the header's 5 words, within the IP packet.
		if doff := uint32(r.b[off+12] >> 4); doff < 5 || !withinIP(p, off, doff*4) {
			return r.vipAddressVerdict(p, ReasonDropMalformedL4)
		}
		p.flow.Sport, p.flow.Dport = r.ld16(off), r.ld16(off+2)
		p.tcpFlags = r.b[off+13]
		p.tcpSeq, p.tcpAck = r.ld32(off+4), r.ld32(off+8)
		return modelContinue
	case protoUDP:
		if !r.fits(off, udpHeaderLen) || !withinIP(p, off, udpHeaderLen) {
			return r.vipAddressVerdict(p, ReasonDropMalformedL4)
		}
		// The length: at least the header's 8 bytes, within the IP packet.
		if n := uint32(binary.BigEndian.Uint16(r.b[off+4:])); n < udpHeaderLen || !withinIP(p, off, n) {
			return r.vipAddressVerdict(p, ReasonDropMalformedL4)
		}
		p.flow.Sport, p.flow.Dport = r.ld16(off), r.ld16(off+2)
		return modelContinue
	}
	if (p.flow.Family == familyIPv4 && p.flow.Proto == protoICMP) ||
		(p.flow.Family == familyIPv6 && p.flow.Proto == protoICMPv6) {
		if r.fits(off, icmpHeaderLen) && withinIP(p, off, icmpHeaderLen) && icmpIsError(p.flow.Family, r.b[off]) {
			p.icmpError = true
			return modelContinue
		}
	}
	return r.verdict(XDPPass, ReasonPassNotService)
}

// withinIP is parse.h's within_ip: Ethernet padding is not a header.
func withinIP(p *modelPacket, off, n uint32) bool { return off+n <= p.l3+p.l3Len }

// icmpIsError is parse.h's icmp_is_error.
func icmpIsError(family, typ uint8) bool {
	if family == familyIPv4 {
		return typ == 3 || typ == 11 || typ == 12
	}
	return typ == 1 || typ == 2 || typ == 3 || typ == 4
}

func (r *run) vipAddressVerdict(p *modelPacket, drop Reason) int {
	if _, ok := r.m.Services[bpf.WeirVipKey{Addr: p.flow.Dst, Family: p.flow.Family}]; ok {
		return r.verdict(XDPDrop, drop)
	}
	return r.verdict(XDPPass, ReasonPassNotVIPL4)
}

// usableBackend is select.h's usable_backend.
func (r *run) usableBackend(id, serviceID uint32) (bpf.WeirBackend, bool) {
	if uint64(id) >= uint64(len(r.m.Backends)) {
		return bpf.WeirBackend{}, false
	}
	be := r.m.Backends[id]
	if be.Flags&backendFlagUsable == 0 || be.ServiceId != serviceID {
		return bpf.WeirBackend{}, false
	}
	return be, true
}

// lookupTablePick returns the slot the service's table gives flow hash h (which 1:
// its second half; set even when its backend is unusable, as the C sets *id) and the
// backend if usable.
func (r *run) lookupTablePick(svc bpf.WeirService, h, which uint32) (uint32, bpf.WeirBackend, bool) {
	table, ok := r.m.Tables[svc.Id]
	if !ok || svc.Id >= r.m.MaxServices || len(table) == 0 || table[0] == 0 {
		return 0, bpf.WeirBackend{}, false
	}
	index := 1 + h%table[0] + which*table[0]
	if uint64(index) >= uint64(len(table)) {
		return 0, bpf.WeirBackend{}, false
	}
	id := table[index]
	be, ok := r.usableBackend(id, svc.Id)
	return id, be, ok
}

// sliceSlot is the slot a table's first half holds for hash h, or -1 where
// select.h's lookup_table_pick sets none.
func sliceSlot(table []uint32, h uint32) int64 {
	if len(table) == 0 || table[0] == 0 {
		return -1
	}
	index := 1 + h%table[0]
	if uint64(index) >= uint64(len(table)) {
		return -1
	}
	return int64(table[index])
}

// missBackend is select.h's miss_backend: the previous generation's pick for a TCP
// packet that is not a SYN and that the connection table does not know.
func (r *run) missBackend(p *modelPacket, svc bpf.WeirService, event *Reason) (uint32, bpf.WeirBackend, int) {
	prev, ok := r.m.PrevTables[svc.Id]
	if *event != ReasonFlowNew || p.flow.Proto != protoTCP || isSYN(p) || !ok || svc.Id >= r.m.MaxServices {
		return r.newFlowBackend(p, svc)
	}
	h := flowHash(&p.flow, r.m.HashSeed, svc.Flags&serviceFlagSourceHash != 0)
	slot := sliceSlot(prev, h)
	var old bpf.WeirBackend
	if slot >= 0 {
		old, ok = r.usableBackend(uint32(slot), svc.Id)
	}
	if slot < 0 || !ok {
		return r.newFlowBackend(p, svc)
	}
	cur := int64(-1)
	if table, ok := r.m.Tables[svc.Id]; ok {
		cur = sliceSlot(table, h)
	}
	if cur != slot {
		*event = ReasonFlowFallback
	}
	return uint32(slot), old, modelContinue
}

// newFlowBackend is select.h's new_flow_backend: the backend every mode gives a new
// flow, or a verdict.
func (r *run) newFlowBackend(p *modelPacket, svc bpf.WeirService) (uint32, bpf.WeirBackend, int) {
	h := flowHash(&p.flow, r.m.HashSeed, svc.Flags&serviceFlagSourceHash != 0)
	id, be, ok := r.lookupTablePick(svc, h, 0)
	if !ok {
		return 0, be, r.verdict(XDPDrop, ReasonDropNoBackend)
	}
	if svc.Flags&serviceFlagP2C == 0 || p.flow.Proto == protoTCP && !isSYN(p) {
		return id, be, modelContinue
	}
	id2, be2, ok := r.lookupTablePick(svc, h, 1)
	if !ok || id2 == id {
		return id, be, modelContinue
	}
	la, oka := r.load(id)
	lb, okb := r.load(id2)
	if oka && okb && balance.PreferSecond(la, uint32(be.Weight), lb, uint32(be2.Weight)) {
		r.count(ReasonFlowSecondChoice)
		return id2, be2, modelContinue
	}
	return id, be, modelContinue
}

// load is backend_load[id]; false if the program's lookup would fail.
func (r *run) load(id uint32) (int64, bool) {
	if id >= r.m.MaxBackends {
		return 0, false
	}
	if int(id) >= len(r.m.Load) {
		panic(fmt.Sprintf("model: backend_load[%d] read; the rig seeds %d entries", id, len(r.m.Load)))
	}
	return r.m.Load[id], true
}

// loadAdd is select.h's load_add.
func (r *run) loadAdd(id uint32, delta int64) {
	if _, ok := r.load(id); ok {
		r.m.Load[id] += delta
	}
}

// lbFlowClosed is select.h's lb_flow_closed on the entry under key in table.
func (r *run) lbFlowClosed(table map[bpf.WeirFlowKey]bpf.WeirLbFlow, key bpf.WeirFlowKey) {
	f := table[key]
	if f.CreatedS&lbFlowClosed != 0 {
		return
	}
	f.CreatedS |= lbFlowClosed
	table[key] = f
	r.loadAdd(f.BackendId, -1)
}

func isSYN(p *modelPacket) bool {
	return p.flow.Proto == protoTCP && p.tcpFlags&(tcpFlagSYN|tcpFlagACK) == tcpFlagSYN
}

// newFlowAllowed is select.h's new_flow_allowed.
func (r *run) newFlowAllowed(now uint64) bool {
	if r.m.NewFlowIntervalNs == 0 {
		return true
	}
	t := max(r.m.NewFlowTAT, now)
	if t-now > r.m.NewFlowBurstNs {
		return false
	}
	r.m.NewFlowTAT = t + r.m.NewFlowIntervalNs
	return true
}

// selectBackend is select.h's select_backend (dsr and tunnel).
func (r *run) selectBackend(p *modelPacket, svc bpf.WeirService) (uint32, bpf.WeirBackend, int) {
	event := ReasonFlowNew
	if isSYN(p) {
		if _, ok := r.m.LBConntrack[p.flow]; ok {
			r.lbFlowClosed(r.m.LBConntrack, p.flow)
			delete(r.m.LBConntrack, p.flow)
		}
		if known, ok := r.m.LBHalfOpen[p.flow]; ok && svc.Flags&serviceFlagP2C != 0 {
			if be, ok := r.usableBackend(known.BackendId, svc.Id); ok {
				r.count(ReasonFlowHit)
				return known.BackendId, be, modelContinue
			}
			event = ReasonFlowReselect
		}
	} else if known, ok := r.m.LBConntrack[p.flow]; ok {
		if be, ok := r.usableBackend(known.BackendId, svc.Id); ok {
			if tcpCloses(p) {
				r.lbFlowClosed(r.m.LBConntrack, p.flow)
			}
			r.count(ReasonFlowHit)
			return known.BackendId, be, modelContinue
		}
		r.lbFlowClosed(r.m.LBConntrack, p.flow)
		delete(r.m.LBConntrack, p.flow)
		event = ReasonFlowReselect
	} else if known, ok := r.m.LBHalfOpen[p.flow]; ok {
		if be, ok := r.usableBackend(known.BackendId, svc.Id); ok {
			r.loadAdd(known.BackendId, 1)
			if tcpCloses(p) {
				known.CreatedS |= lbFlowClosed
				r.loadAdd(known.BackendId, -1)
			}
			r.m.LBConntrack[p.flow] = known
			delete(r.m.LBHalfOpen, p.flow)
			r.count(ReasonFlowEstablished)
			return known.BackendId, be, modelContinue
		}
		event = ReasonFlowReselect
	}
	id, be, a := r.missBackend(p, svc, &event)
	if a != modelContinue {
		return 0, be, a
	}
	if !r.newFlowAllowed(r.env.Now) {
		r.count(ReasonFlowUntracked)
		return id, be, modelContinue
	}
	r.m.LBHalfOpen[p.flow] = bpf.WeirLbFlow{BackendId: id, CreatedS: uint32(r.env.Now/nsecPerSec) &^ lbFlowClosed}
	r.count(event)
	return id, be, modelContinue
}

// The nat side (bpf/nat.h).

func (r *run) isNATAddress(f *bpf.WeirFlowKey) bool {
	if f.Family == familyIPv4 {
		return r.m.NATAddr4 != 0 && f.Dst[0] == r.m.NATAddr4
	}
	a := r.m.NATAddr6
	return a[0]|a[1]|a[2]|a[3] != 0 && f.Dst == a
}

func (r *run) natSource(family uint8) [4]uint32 {
	if family == familyIPv4 {
		return [4]uint32{r.m.NATAddr4}
	}
	return r.m.NATAddr6
}

func tcpCloses(p *modelPacket) bool {
	return p.flow.Proto == protoTCP && p.tcpFlags&(tcpFlagFIN|tcpFlagRST) != 0
}

// closesFlow is nat.h's closes_flow.
func closesFlow(p *modelPacket, flags *bpf.WeirFlowFlags, fromBackend bool) bool {
	if p.tcpFlags&tcpFlagRST != 0 {
		return true
	}
	if fromBackend {
		*flags |= flowFlagFinBackend
	} else {
		*flags |= flowFlagFinClient
	}
	return *flags&flowFlagFins == flowFlagFins
}

func (m *Model) flowAlive(fs *bpf.WeirNatFlow, proto uint8, now uint64) bool {
	idle := m.UDPIdleNs
	if proto == protoTCP {
		idle = m.TCPIdleNs
		if fs.Flags&flowFlagClosing != 0 {
			idle = m.TCPClosingNs
		}
	}
	return now-fs.LastSeenNs <= idle
}

// markClosing marks the nat connection-table entry under key closing, once, and
// counts its backend's flow closed.
func (r *run) markClosing(key bpf.WeirFlowKey) {
	fs := r.m.NATConntrack[key]
	if fs.Flags&flowFlagClosing != 0 {
		return
	}
	fs.Flags |= flowFlagClosing
	r.m.NATConntrack[key] = fs
	r.countFlow(fs.BackendId, false)
}

// Incremental checksum updates (bpf/csum.h).
func csumStart(check uint16) uint32                { return uint32(^check) }
func csumAdd16(sum uint32, from, to uint16) uint32 { return sum + uint32(^from) + uint32(to) }
func csumAdd32(sum, from, to uint32) uint32 {
	sum = csumAdd16(sum, uint16(from), uint16(to))
	return csumAdd16(sum, uint16(from>>16), uint16(to>>16))
}
func csumFinish(sum uint32) uint16 {
	sum = sum&0xffff + sum>>16
	sum = sum&0xffff + sum>>16
	return ^uint16(sum)
}

// natRewrite is nat.h's nat_rewrite.
func (r *run) natRewrite(p *modelPacket, src [4]uint32, sport uint16, dst [4]uint32, dport uint16) int {
	l3, l4 := p.l3, p.l4
	words := 4
	if p.flow.Family == familyIPv4 {
		words = 1
	}
	if l3 > maxL3Offset || l4 > maxL4Offset {
		return int(XDPAborted)
	}
	if !r.fits(l4, 4) {
		return int(XDPAborted)
	}
	var check uint32
	if p.flow.Proto == protoTCP {
		if !r.fits(l4, tcpHeaderLen) {
			return int(XDPAborted)
		}
		check = l4 + 16
	} else {
		if !r.fits(l4, udpHeaderLen) {
			return int(XDPAborted)
		}
		check = l4 + 6
	}
	if !(p.flow.Proto == protoUDP && r.ld16(check) == 0) {
		sum := csumStart(r.ld16(check))
		for i := range words {
			sum = csumAdd32(sum, p.flow.Src[i], src[i])
			sum = csumAdd32(sum, p.flow.Dst[i], dst[i])
		}
		sum = csumAdd16(sum, r.ld16(l4), sport)
		sum = csumAdd16(sum, r.ld16(l4+2), dport)
		c := csumFinish(sum)
		if p.flow.Proto == protoUDP && c == 0 {
			c = 0xffff
		}
		r.st16(check, c)
	}
	r.st16(l4, sport)
	r.st16(l4+2, dport)
	if p.flow.Family == familyIPv4 {
		if !r.fits(l3, ipv4HeaderLen) {
			return int(XDPAborted)
		}
		sum := csumStart(r.ld16(l3 + 10))
		sum = csumAdd32(sum, r.ld32(l3+12), src[0])
		sum = csumAdd32(sum, r.ld32(l3+16), dst[0])
		r.st16(l3+10, csumFinish(sum))
		r.st32(l3+12, src[0])
		r.st32(l3+16, dst[0])
	} else {
		if !r.fits(l3, ipv6HeaderLen) {
			return int(XDPAborted)
		}
		for i := range 4 {
			r.st32(l3+8+uint32(i)*4, src[i])
			r.st32(l3+24+uint32(i)*4, dst[i])
		}
	}
	p.flow.Src, p.flow.Dst = src, dst
	p.flow.Sport, p.flow.Dport = sport, dport
	return modelContinue
}

// sendTo is nat.h's send_to.
func (r *run) sendTo(p *modelPacket, hop bpf.WeirNextHop) int {
	if !r.fits(0, ethHeaderLen) {
		return int(XDPAborted)
	}
	copy(r.b[0:6], hop.Dmac[:])
	copy(r.b[6:12], hop.Smac[:])
	if hop.Ifindex == r.m.IngressIfindex {
		return r.verdict(XDPTX, ReasonTX)
	}
	if r.m.TxPorts[hop.Ifindex] {
		return r.verdict(XDPRedirect, ReasonRedirect)
	}
	return r.verdict(XDPDrop, ReasonDropNoTXPort)
}

// hopCached is nat.h's hop_cached.
func hopCached(be *bpf.WeirBackend, totLen uint32, now uint64) (bpf.WeirNextHop, bool) {
	if be.Hop.Ifindex == 0 || now-be.HopNs >= nsecPerSec || totLen > be.HopLen {
		return bpf.WeirNextHop{}, false
	}
	return be.Hop, true
}

// hopRemember is nat.h's hop_remember.
func hopRemember(be *bpf.WeirBackend, hop bpf.WeirNextHop, totLen uint32, now uint64) {
	be.Hop = hop
	if now-be.HopNs >= nsecPerSec {
		be.HopNs = now
		be.HopLen = totLen
	} else if totLen > be.HopLen {
		be.HopLen = totLen
	}
}

// fibHop is nat.h's fib_hop for a packet of totLen bytes with f's addresses and
// ports: the next hop cached in the backend in slot id (none if id is noSlot), else
// the one bpf_fib_lookup finds, which it then caches there. It returns the lookup's
// result (FIBSuccess for a cached hop), the hop on success and the route's MTU on
// FIBFragNeeded.
func (r *run) fibHop(f bpf.WeirFlowKey, totLen, id uint32) (bpf.WeirNextHop, FIBResult, uint32) {
	var be *bpf.WeirBackend
	if uint64(id) < uint64(len(r.m.Backends)) {
		be = &r.m.Backends[id]
	}
	if be != nil {
		if hop, ok := hopCached(be, totLen, r.env.Now); ok {
			return hop, FIBSuccess, 0
		}
	}
	q := FIBQuery{Family: f.Family, Proto: f.Proto, Src: f.Src, Dst: f.Dst,
		Sport: f.Sport, Dport: f.Dport, TotLen: uint16(totLen), Ifindex: r.m.IngressIfindex}
	if q.Family == familyIPv4 {
		q.Src, q.Dst = [4]uint32{q.Src[0]}, [4]uint32{q.Dst[0]}
	}
	ans := r.fib(q)
	if ans.Result != FIBSuccess {
		return bpf.WeirNextHop{}, ans.Result, uint32(ans.MTU)
	}
	hop := bpf.WeirNextHop{Dmac: ans.DstMAC, Smac: ans.SrcMAC, Ifindex: ans.Ifindex}
	if be != nil {
		hopRemember(be, hop, totLen, r.env.Now)
	}
	return hop, FIBSuccess, 0
}

// hopSend is nat.h's hop_send.
func (r *run) hopSend(p *modelPacket, res FIBResult, hop bpf.WeirNextHop) int {
	r.setVLAN(p, 0)
	switch res {
	case FIBNoNeighbour:
		return r.verdict(XDPPass, ReasonPassNoNeighbour)
	case FIBSuccess:
		return r.sendTo(p, hop)
	}
	return r.verdict(XDPDrop, ReasonDropNoRoute)
}

// fibForward is nat.h's fib_forward: the packet as it is, no cache.
func (r *run) fibForward(p *modelPacket) int {
	hop, res, _ := r.fibHop(p.flow, p.len-p.l3, noSlot)
	return r.hopSend(p, res, hop)
}

// noSlot is a backend slot no array has: fib_forward without a cache.
const noSlot = ^uint32(0)

// fib is bpf_fib_lookup.
func (r *run) fib(q FIBQuery) FIBAnswer {
	if r.env.FIB == nil {
		return FIBAnswer{Result: FIBNoRoute}
	}
	return r.env.FIB(q)
}

// cameFrom is nat.h's came_from: the next hop back to where the frame came from.
func (r *run) cameFrom() (bpf.WeirNextHop, bool) {
	var hop bpf.WeirNextHop
	if !r.fits(0, ethHeaderLen) {
		return hop, false
	}
	copy(hop.Dmac[:], r.b[6:12])
	copy(hop.Smac[:], r.b[0:6])
	hop.Ifindex = r.m.IngressIfindex
	return hop, true
}

// replyKey is nat.h's reply_key.
func (r *run) replyKey(p *modelPacket, be bpf.WeirBackend, natPort uint16) bpf.WeirFlowKey {
	return bpf.WeirFlowKey{Src: be.Addr, Dst: r.natSource(p.flow.Family), Sport: be.Port, Dport: natPort,
		Proto: p.flow.Proto, Family: p.flow.Family}
}

// synAnswer is nat.h's syn_answer.
func synAnswer(p *modelPacket) uint32 {
	if !isSYN(p) {
		return 0
	}
	return bits.ReverseBytes32(bits.ReverseBytes32(p.tcpSeq) + 1)
}

// natAllocPort is nat.h's nat_alloc_port. It returns the port in network order (as
// a native word), 0 for none.
func (r *run) natAllocPort(p *modelPacket, be bpf.WeirBackend, id uint32, now uint64) uint16 {
	rk := r.replyKey(p, be, 0)
	toClient, ok := r.cameFrom()
	ring := be.NatRing // the backend's ring, shared by the slots holding it
	if !ok || ring >= uint32(len(r.m.NATCursor)) {
		return 0
	}
	span := uint32(r.m.PortMax) - uint32(r.m.PortMin) + 1
	var spread uint32
	for i := range uint32(natPortTries) {
		var port uint32
		if spread == 0 {
			port = r.m.NATCursor[ring] % span
			r.m.NATCursor[ring]++
		} else {
			port = hashFinal(hashWord(spread, i)) % span
		}
		rk.Dport = ntohs(r.m.PortMin + uint16(port))
		if old, ok := r.m.NATReverse[rk]; ok {
			holder, ok := r.m.NATConntrack[clientKey(old.Client)]
			if ok && r.m.flowAlive(&holder, rk.Proto, now) && holder.NatPort == rk.Dport &&
				holder.BackendId == old.BackendId {
				spread = flowHash(&p.flow, r.m.HashSeed, false) | 1
				continue
			}
			delete(r.m.NATReverse, rk)
		}
		r.m.NATHalfReverse[rk] = bpf.WeirNatEntry{Client: natClient(p.flow, p.vlanTCI), BackendId: id, SynAck: synAnswer(p), ToClient: toClient}
		return rk.Dport
	}
	return 0
}

// natSend is nat.h's nat_send, to the backend be in slot id.
func (r *run) natSend(p *modelPacket, be bpf.WeirBackend, id uint32, port uint16) int {
	out := p.flow
	out.Src, out.Sport, out.Dst, out.Dport = r.natSource(p.flow.Family), port, be.Addr, be.Port
	hop, res, mtu := r.fibHop(out, p.len-p.l3, id)
	if res == FIBFragNeeded {
		// Answered with the client's packet as it came, not rewritten.
		return r.icmpTooBig(p, mtu, ReasonNATTooBig)
	}
	if a := r.natRewrite(p, out.Src, port, be.Addr, be.Port); a != modelContinue {
		return a
	}
	return r.hopSend(p, res, hop)
}

// natSynAgain is nat.h's nat_syn_again, on the half-open entry hs (which the caller
// stores) and the reverse entry under rk.
func (r *run) natSynAgain(p *modelPacket, hs *bpf.WeirNatFlow, rk bpf.WeirFlowKey) bool {
	if hs.Flags&(flowFlagStale|flowFlagKept) == flowFlagStale {
		hs.Flags = hs.Flags&^flowFlagStale | flowFlagKept
		rev := r.m.NATHalfReverse[rk]
		rev.SynAck = synAnswer(p)
		r.m.NATHalfReverse[rk] = rev
		return false
	}
	return true
}

// natHalfOpen is nat.h's nat_half_open.
func (r *run) natHalfOpen(p *modelPacket, svc bpf.WeirService, key bpf.WeirFlowKey, now uint64) int {
	hs, ok := r.m.NATHalfOpen[key]
	if !ok || now-hs.LastSeenNs > r.m.HalfOpenNs {
		return modelContinue
	}
	id := hs.BackendId
	be, ok := r.usableBackend(id, svc.Id)
	if !ok {
		return modelContinue
	}
	rk := r.replyKey(p, be, hs.NatPort)
	rev, ok := r.m.NATHalfReverse[rk]
	if !ok || rev.BackendId != id || clientKey(rev.Client) != key {
		return modelContinue
	}
	if tcpCloses(p) && closesFlow(p, &hs.Flags, false) {
		hs.Flags |= flowFlagClosing
	}
	if isSYN(p) && rev.SynAck != 0 {
		again := r.natSynAgain(p, &hs, rk)
		r.m.NATHalfOpen[key] = hs
		if again {
			delete(r.m.NATHalfReverse, rk)
			r.count(ReasonNATNewPort)
			return modelContinue
		}
	}
	r.countService(svc.Id)
	r.countBackend(id)
	if isSYN(p) {
		r.count(ReasonFlowHit)
		r.m.NATHalfOpen[key] = hs
		return r.natSend(p, be, id, hs.NatPort)
	}
	r.count(ReasonFlowEstablished)
	r.countFlow(id, true)
	if hs.Flags&flowFlagClosing != 0 {
		r.countFlow(id, false)
	}
	hs.LastSeenNs = now
	hs.Flags &= flowFlagClosing | flowFlagFins
	rev.SynAck = 0
	a := r.natSend(p, be, id, hs.NatPort)
	r.m.NATConntrack[key] = hs
	r.m.NATReverse[rk] = rev
	delete(r.m.NATHalfReverse, rk)
	delete(r.m.NATHalfOpen, key)
	return a
}

// natForward is nat.h's nat_forward.
func (r *run) natForward(p *modelPacket, svc bpf.WeirService) int {
	now := r.env.Now
	key := p.flow
	event := ReasonFlowNew
	if fs, known := r.m.NATConntrack[key]; known {
		var (
			be bpf.WeirBackend
			ok bool
		)
		// A SYN on the 5-tuple of a closed flow, or one whose client sent its FIN, is
		// a new connection (nat.h).
		reused := isSYN(p) && fs.Flags&(flowFlagClosing|flowFlagFinClient) != 0
		if !reused && r.m.flowAlive(&fs, p.flow.Proto, now) {
			be, ok = r.usableBackend(fs.BackendId, svc.Id)
		}
		if ok {
			id := fs.BackendId
			if now-fs.LastSeenNs > nsecPerSec {
				r.refreshFlow(p, key, be, now)
			}
			if tcpCloses(p) {
				fs := r.m.NATConntrack[key]
				closed := closesFlow(p, &fs.Flags, false)
				r.m.NATConntrack[key] = fs
				if closed {
					r.markClosing(key)
				}
			}
			r.count(ReasonFlowHit)
			r.countService(svc.Id)
			r.countBackend(id)
			return r.natSend(p, be, id, r.m.NATConntrack[key].NatPort)
		}
		// Expired, reused, or its backend became unusable: the old flow ends here.
		r.markClosing(key)
		delete(r.m.NATConntrack, key)
		if !reused {
			event = ReasonFlowReselect
		}
	} else if a := r.natHalfOpen(p, svc, key, now); a != modelContinue {
		return a
	}
	id, be, a := r.missBackend(p, svc, &event)
	if a != modelContinue {
		return a
	}
	if !r.newFlowAllowed(now) {
		return r.verdict(XDPDrop, ReasonDropFlowRate)
	}
	port := r.natAllocPort(p, be, id, now)
	if port == 0 {
		return r.verdict(XDPDrop, ReasonDropNATPorts)
	}
	fresh := bpf.WeirNatFlow{BackendId: id, NatPort: port, LastSeenNs: now}
	if tcpCloses(p) && closesFlow(p, &fresh.Flags, false) {
		fresh.Flags |= flowFlagClosing
	}
	r.count(event)
	r.countService(svc.Id)
	r.countBackend(id)
	a = r.natSend(p, be, id, port)
	// Recorded whatever the verdict.
	r.m.NATHalfOpen[key] = fresh
	return a
}

// refreshFlow is nat.h's refresh_flow.
func (r *run) refreshFlow(p *modelPacket, key bpf.WeirFlowKey, be bpf.WeirBackend, now uint64) {
	fs := r.m.NATConntrack[key]
	fs.LastSeenNs = now
	r.m.NATConntrack[key] = fs
	rk := r.replyKey(p, be, fs.NatPort)
	if rev, ok := r.m.NATReverse[rk]; ok {
		if hop, ok := r.cameFrom(); ok {
			rev.ToClient = hop
		}
		rev.Client.VlanTci = p.vlanTCI
		r.m.NATReverse[rk] = rev
	}
}

// natReplyRefresh is nat.h's nat_reply_refresh; key is rev's in the reverse table.
func (r *run) natReplyRefresh(p *modelPacket, key bpf.WeirFlowKey, rev bpf.WeirNatEntry, client bpf.WeirFlowKey) {
	now := r.env.Now
	tick := uint32(now >> replyTickShift)
	if tick-rev.SynAck < replyTicksPerRefresh {
		return
	}
	rev.SynAck = tick
	r.m.NATReverse[key] = rev
	if fs, ok := r.m.NATConntrack[client]; ok && fs.BackendId == rev.BackendId && fs.NatPort == p.flow.Dport {
		fs.LastSeenNs = now
		r.m.NATConntrack[client] = fs
	}
}

// natReply is nat.h's nat_reply.
func (r *run) natReply(p *modelPacket) int {
	established := true
	rev, ok := r.m.NATReverse[p.flow]
	if !ok {
		rev, ok = r.m.NATHalfReverse[p.flow]
		established = false
	}
	if !ok {
		return modelContinue
	}
	client := clientKey(rev.Client)
	stale := !established && rev.SynAck != 0 && p.tcpFlags&tcpFlagACK != 0 &&
		bits.ReverseBytes32(p.tcpAck)-bits.ReverseBytes32(rev.SynAck) > synDataMax
	if tcpCloses(p) || stale {
		if established {
			if fs, ok := r.m.NATConntrack[client]; ok && fs.BackendId == rev.BackendId && fs.NatPort == p.flow.Dport {
				closed := closesFlow(p, &fs.Flags, true)
				r.m.NATConntrack[client] = fs
				if closed {
					r.markClosing(client)
				}
			}
		} else if fs, ok := r.m.NATHalfOpen[client]; ok && fs.BackendId == rev.BackendId && fs.NatPort == p.flow.Dport {
			if stale {
				fs.Flags |= flowFlagStale
			} else if closesFlow(p, &fs.Flags, true) {
				fs.Flags |= flowFlagClosing
			}
			r.m.NATHalfOpen[client] = fs
		}
	}
	if stale {
		return r.verdict(XDPPass, ReasonPassNATStale)
	}
	if !established && rev.SynAck != 0 && p.tcpFlags&(tcpFlagSYN|tcpFlagACK) == tcpFlagSYN|tcpFlagACK {
		rev.SynAck = 0
		r.m.NATHalfReverse[p.flow] = rev
	}
	if established && p.flow.Proto == protoUDP {
		r.natReplyRefresh(p, p.flow, rev, client)
	}
	r.count(ReasonNATReply)
	if a := r.natRewrite(p, client.Dst, client.Dport, client.Src, client.Sport); a != modelContinue {
		return a
	}
	r.setVLAN(p, rev.Client.VlanTci)
	return r.sendTo(p, rev.ToClient)
}

// clientKey is nat.h's client_key: the key of a nat_entry's client flow.
func clientKey(c bpf.WeirNatClient) bpf.WeirFlowKey {
	return bpf.WeirFlowKey{Src: c.Src, Dst: c.Dst, Sport: c.Sport, Dport: c.Dport, Proto: c.Proto, Family: c.Family}
}

// natClient is a nat_entry's client: the flow f as received and its tag tci.
func natClient(f bpf.WeirFlowKey, tci uint16) bpf.WeirNatClient {
	return bpf.WeirNatClient{Src: f.Src, Dst: f.Dst, Sport: f.Sport, Dport: f.Dport, Proto: f.Proto, Family: f.Family, VlanTci: tci}
}

// setVLAN is nat.h's set_vlan: the frame gets the tag tci (0: none). The model
// assumes bpf_xdp_adjust_head succeeds (the frame holds the headers parse read).
func (r *run) setVLAN(p *modelPacket, tci uint16) {
	tagged := p.l3 == ethHeaderLen+vlanHeaderLen
	switch {
	case !tagged && tci == 0:
		return
	case tagged && tci != 0:
		r.st16(ethHeaderLen, tci)
		p.vlanTCI = tci
		return
	}
	var macs [12]byte
	copy(macs[:], r.b[:12])
	delta := -vlanHeaderLen
	if tagged {
		delta = vlanHeaderLen
	}
	r.adjustHead(delta)
	p.l3 = uint32(int(p.l3) - delta)
	p.l4 = uint32(int(p.l4) - delta)
	p.vlanTCI = tci
	copy(r.b[:12], macs[:])
	if tci != 0 {
		binary.BigEndian.PutUint16(r.b[12:], etherTypeVLAN)
		r.st16(ethHeaderLen, tci)
	}
}

// ICMP errors (bpf/icmp.h).

type icmpRewrite struct {
	outerSrc, outerDst, innerSrc, innerDst [4]uint32
	innerSport, innerDport                 uint16
}

// icmpErrorTranslate is icmp.h's icmp_error_translate: it reads the quote into the
// flow it belongs to (the quoted packet reversed) and hands it to icmpTranslate (a
// nat flow) or icmpToLBBackend (from the client's side, any other flow).
func (r *run) icmpErrorTranslate(p *modelPacket) int {
	var flow bpf.WeirFlowKey
	in3 := p.l4 + icmpHeaderLen
	var in4 uint32
	if in3 > maxL4Offset {
		return r.verdict(XDPPass, ReasonPassNotService)
	}
	flow.Family = p.flow.Family
	if p.flow.Family == familyIPv4 {
		if !r.fits(in3, ipv4HeaderLen) || r.b[in3]>>4 != 4 || r.b[in3]&0xf < 5 ||
			binary.BigEndian.Uint16(r.b[in3+6:])&0x1fff != 0 {
			return r.verdict(XDPPass, ReasonPassNotService)
		}
		flow.Src[0], flow.Dst[0] = r.ld32(in3+16), r.ld32(in3+12)
		flow.Proto = r.b[in3+9]
		in4 = in3 + uint32(r.b[in3]&0xf)*4
	} else {
		if !r.fits(in3, ipv6HeaderLen) || r.b[in3]>>4 != 6 {
			return r.verdict(XDPPass, ReasonPassNotService)
		}
		for i := range 4 {
			flow.Src[i] = r.ld32(in3 + 24 + uint32(i)*4)
			flow.Dst[i] = r.ld32(in3 + 8 + uint32(i)*4)
		}
		var ok bool
		in4, flow.Proto, ok = r.ipv6SkipExt(in3+ipv6HeaderLen, r.b[in3+6])
		if !ok || in4 > maxL4Offset+48 {
			return r.verdict(XDPPass, ReasonPassNotService)
		}
	}
	if flow.Proto != protoTCP && flow.Proto != protoUDP {
		return r.verdict(XDPPass, ReasonPassNotService)
	}
	if !r.fits(in4, 4) || !withinIP(p, in4, 4) {
		return r.verdict(XDPPass, ReasonPassNotService)
	}
	flow.Sport, flow.Dport = r.ld16(in4+2), r.ld16(in4)

	if r.isNATAddress(&p.flow) {
		rev, ok := r.m.NATReverse[flow]
		if !ok {
			rev, ok = r.m.NATHalfReverse[flow]
		}
		if !ok {
			return r.verdict(XDPPass, ReasonPassNotService)
		}
		return r.icmpTranslate(p, &flow, in3, in4, &rev, nil)
	}
	if p.flow.Dst != flow.Dst {
		return r.verdict(XDPPass, ReasonPassNotService)
	}
	fs, ok := r.m.NATConntrack[flow]
	if !ok {
		fs, ok = r.m.NATHalfOpen[flow]
	}
	if !ok || fs.NatPort == 0 {
		return r.icmpToLBBackend(p, flow)
	}
	return r.icmpTranslate(p, &flow, in3, in4, nil, &fs)
}

// icmpTranslate is icmp.h's icmp_translate: the rewrite of an error about a nat
// flow, from the backend's side (rev) or the client's (fs), and its send.
func (r *run) icmpTranslate(p *modelPacket, flow *bpf.WeirFlowKey, in3, in4 uint32, rev *bpf.WeirNatEntry, fs *bpf.WeirNatFlow) int {
	var rw icmpRewrite
	if rev != nil {
		rw.outerSrc, rw.outerDst = rev.Client.Dst, rev.Client.Src
		rw.innerSrc, rw.innerDst = rev.Client.Src, rev.Client.Dst
		rw.innerSport, rw.innerDport = rev.Client.Sport, rev.Client.Dport
	} else {
		if uint64(fs.BackendId) >= uint64(len(r.m.Backends)) {
			return r.verdict(XDPPass, ReasonPassNotService)
		}
		be := r.m.Backends[fs.BackendId]
		rw.outerSrc = r.natSource(p.flow.Family)
		rw.outerDst = be.Addr
		rw.innerSrc = be.Addr
		rw.innerDst = r.natSource(p.flow.Family)
		rw.innerSport, rw.innerDport = be.Port, fs.NatPort
	}
	if a := r.icmpChecksumVerdict(p); a != modelContinue {
		return a
	}
	r.count(ReasonICMPTranslated)
	if a := r.icmpApply(p, flow, in3, in4, &rw); a != modelContinue {
		return a
	}
	return r.fibForward(p)
}

// icmpChecksumVerdict is icmp.h's icmp_checksum_verdict: the ICMP checksum of an
// error about to be acted on, over the message as its IP packet's length bounds it
// (ICMPv6: with the pseudo-header of the outer addresses), must hold. The C sums it
// in pieces; the sum is the same.
func (r *run) icmpChecksumVerdict(p *modelPacket) int {
	start, end := p.l4, p.l3+p.l3Len
	if start > maxL4Offset || end < start || end-start > maxICMPChecked {
		return r.verdict(XDPPass, ReasonPassNotService)
	}
	if !r.fits(start, end-start) {
		return int(XDPAborted)
	}
	var sum uint32
	if p.flow.Family == familyIPv6 {
		for i := range 4 {
			sum += p.flow.Src[i]&0xffff + p.flow.Src[i]>>16
			sum += p.flow.Dst[i]&0xffff + p.flow.Dst[i]>>16
		}
		sum += uint32(ntohs(uint16(end-start))) + uint32(ntohs(protoICMPv6))
	}
	for off := start; off+2 <= end; off += 2 {
		sum += uint32(r.ld16(off))
	}
	if (end-start)&1 != 0 {
		sum += uint32(r.b[end-1])
	}
	if csumFinish(sum) != 0 {
		return r.verdict(XDPDrop, ReasonDropICMPChecksum)
	}
	return r.icmpQuoteChecksumVerdict(p)
}

// icmpQuoteChecksumVerdict is icmp.h's icmp_quote_checksum_verdict: a quoted IPv4
// header without options must have a right checksum too.
func (r *run) icmpQuoteChecksumVerdict(p *modelPacket) int {
	if p.flow.Family != familyIPv4 {
		return modelContinue
	}
	in3 := p.l4 + icmpHeaderLen
	if in3 > maxL4Offset || !r.fits(in3, 20) {
		return int(XDPAborted)
	}
	if r.b[in3]&0xf != 5 {
		return modelContinue
	}
	var sum uint32
	for i := range uint32(5) {
		w := r.ld32(in3 + i*4)
		sum += w&0xffff + w>>16
	}
	if csumFinish(sum) != 0 {
		return r.verdict(XDPDrop, ReasonDropICMPChecksum)
	}
	return modelContinue
}

// icmpToLBBackend is icmp.h's icmp_to_lb_backend: an error from the client's side
// about a dsr or tunnel flow goes on unchanged to the backend the flow's next packet
// would get, recording nothing.
func (r *run) icmpToLBBackend(p *modelPacket, flow bpf.WeirFlowKey) int {
	key := bpf.WeirVipKey{Addr: flow.Dst, Port: flow.Dport, Proto: flow.Proto, Family: flow.Family}
	svc, ok := r.m.Services[key]
	if !ok || svc.Mode != bpf.WeirModeMODE_DSR && svc.Mode != bpf.WeirModeMODE_TUNNEL {
		return r.verdict(XDPPass, ReasonPassNotService)
	}
	if a := r.icmpChecksumVerdict(p); a != modelContinue {
		return a
	}
	p.flow = flow
	p.tcpFlags = 0
	if flow.Proto == protoTCP {
		p.tcpFlags = tcpFlagACK
	}
	event := ReasonFlowNew
	var id uint32
	var be bpf.WeirBackend
	usable := false
	known, ok := r.m.LBConntrack[flow]
	if !ok {
		known, ok = r.m.LBHalfOpen[flow]
	}
	if ok {
		id = known.BackendId
		if be, usable = r.usableBackend(id, svc.Id); !usable {
			event = ReasonFlowReselect
		}
	}
	if !usable {
		var a int
		if id, be, a = r.missBackend(p, svc, &event); a != modelContinue {
			return a
		}
	}
	r.count(ReasonICMPToBackend)
	if svc.Mode == bpf.WeirModeMODE_TUNNEL {
		return r.tunnelSend(p, svc, id, be)
	}
	r.countService(svc.Id)
	r.countBackend(id)
	return r.forwardDSR(be)
}

// icmpApply is icmp.h's icmp_apply; flow is the quoted packet reversed.
func (r *run) icmpApply(p *modelPacket, flow *bpf.WeirFlowKey, in3, in4 uint32, rw *icmpRewrite) int {
	v4 := p.flow.Family == familyIPv4
	words := 4
	if v4 {
		words = 1
	}
	l3, l4 := p.l3, p.l4
	if l3 > maxL3Offset || l4 > maxL4Offset || in4 > maxL4Offset+48 {
		return int(XDPAborted)
	}
	if !r.fits(l4, icmpHeaderLen) {
		return int(XDPAborted)
	}
	isum := csumStart(r.ld16(l4 + 2))

	l4check, haveCheck := uint32(0), false
	if flow.Proto == protoTCP {
		if r.fits(in4, 18) && withinIP(p, in4, 18) {
			l4check, haveCheck = in4+16, true
		}
	} else if r.fits(in4, 8) && withinIP(p, in4, 8) {
		l4check, haveCheck = in4+6, true
	}
	if haveCheck && !(flow.Proto == protoUDP && r.ld16(l4check) == 0) {
		old := r.ld16(l4check)
		s := csumStart(old)
		for i := range words {
			s = csumAdd32(s, flow.Dst[i], rw.innerSrc[i])
			s = csumAdd32(s, flow.Src[i], rw.innerDst[i])
		}
		s = csumAdd16(s, flow.Dport, rw.innerSport)
		s = csumAdd16(s, flow.Sport, rw.innerDport)
		fresh := csumFinish(s)
		if flow.Proto == protoUDP && fresh == 0 {
			fresh = 0xffff
		}
		r.st16(l4check, fresh)
		isum = csumAdd16(isum, old, fresh)
	}

	if !r.fits(in4, 4) {
		return int(XDPAborted)
	}
	isum = csumAdd16(isum, r.ld16(in4), rw.innerSport)
	isum = csumAdd16(isum, r.ld16(in4+2), rw.innerDport)
	r.st16(in4, rw.innerSport)
	r.st16(in4+2, rw.innerDport)

	if v4 {
		if !r.fits(in3, ipv4HeaderLen) {
			return int(XDPAborted)
		}
		old := r.ld16(in3 + 10)
		s := csumStart(old)
		s = csumAdd32(s, r.ld32(in3+12), rw.innerSrc[0])
		s = csumAdd32(s, r.ld32(in3+16), rw.innerDst[0])
		r.st16(in3+10, csumFinish(s))
		isum = csumAdd16(isum, old, r.ld16(in3+10))
		isum = csumAdd32(isum, r.ld32(in3+12), rw.innerSrc[0])
		isum = csumAdd32(isum, r.ld32(in3+16), rw.innerDst[0])
		r.st32(in3+12, rw.innerSrc[0])
		r.st32(in3+16, rw.innerDst[0])
	} else {
		if !r.fits(in3, ipv6HeaderLen) {
			return int(XDPAborted)
		}
		for i := range 4 {
			isum = csumAdd32(isum, flow.Dst[i], rw.innerSrc[i])
			isum = csumAdd32(isum, flow.Src[i], rw.innerDst[i])
			isum = csumAdd32(isum, p.flow.Src[i], rw.outerSrc[i])
			isum = csumAdd32(isum, p.flow.Dst[i], rw.outerDst[i])
		}
		for i := range 4 {
			r.st32(in3+8+uint32(i)*4, rw.innerSrc[i])
			r.st32(in3+24+uint32(i)*4, rw.innerDst[i])
		}
	}
	r.st16(l4+2, csumFinish(isum))

	if v4 {
		if !r.fits(l3, ipv4HeaderLen) {
			return int(XDPAborted)
		}
		s := csumStart(r.ld16(l3 + 10))
		s = csumAdd32(s, r.ld32(l3+12), rw.outerSrc[0])
		s = csumAdd32(s, r.ld32(l3+16), rw.outerDst[0])
		r.st16(l3+10, csumFinish(s))
		r.st32(l3+12, rw.outerSrc[0])
		r.st32(l3+16, rw.outerDst[0])
	} else {
		if !r.fits(l3, ipv6HeaderLen) {
			return int(XDPAborted)
		}
		for i := range 4 {
			r.st32(l3+8+uint32(i)*4, rw.outerSrc[i])
			r.st32(l3+24+uint32(i)*4, rw.outerDst[i])
		}
	}
	p.flow.Src, p.flow.Dst = rw.outerSrc, rw.outerDst
	return modelContinue
}

// Tunnel mode (bpf/tunnel.h).

// adjustHead is bpf_xdp_adjust_head: a negative delta grows the frame at the front
// (the new bytes are whatever the headroom held; the program overwrites all of
// them), a positive one cuts it.
func (r *run) adjustHead(delta int) {
	if delta < 0 {
		r.b = append(make([]byte, -delta), r.b...)
		return
	}
	r.b = r.b[delta:]
}

// adjustTail is bpf_xdp_adjust_tail for the shrinking the program does.
func (r *run) adjustTail(delta int) { r.b = r.b[:len(r.b)+delta] }

// ipv4HeaderChecksum is tunnel.h's ipv4_header_checksum of the 20-byte header at
// off, whose check field is zero.
func (r *run) ipv4HeaderChecksum(off uint32) uint16 {
	var sum uint32
	for i := range uint32(10) {
		sum += uint32(r.ld16(off + 2*i))
	}
	return csumFinish(sum)
}

// icmpTooBig is toobig.h's icmp_too_big: the frame becomes an ICMP "fragmentation
// needed" (IPv4 with DF only) or ICMPv6 "packet too big" back to the client, from
// the VIP, quoting the IP header(s) and 8 bytes of TCP/UDP.
func (r *run) icmpTooBig(p *modelPacket, mtu uint32, sent Reason) int {
	l3, l4 := p.l3&0x1f, p.l4&0x3ff
	v4 := p.flow.Family == familyIPv4
	tagged := l3 == ethHeaderLen+4
	ipLen := uint32(ipv6HeaderLen)
	etherType := uint16(etherTypeIPv6)
	if v4 {
		ipLen, etherType = ipv4HeaderLen, etherTypeIPv4
	}
	if !r.fits(0, ethHeaderLen) || l3 > maxL3Offset || l4 > maxL4Offset {
		return r.verdict(XDPDrop, ReasonDropTooBig)
	}
	if v4 && (!r.fits(l3, ipv4HeaderLen) || binary.BigEndian.Uint16(r.b[l3+6:])&ipFlagDF == 0) {
		return r.verdict(XDPDrop, ReasonDropTooBig)
	}
	var tci [2]byte
	if tagged {
		if !r.fits(ethHeaderLen, 4) {
			return r.verdict(XDPDrop, ReasonDropTooBig)
		}
		copy(tci[:], r.b[ethHeaderLen:ethHeaderLen+2])
	}
	var clientMAC, ourMAC [6]byte
	copy(clientMAC[:], r.b[6:12])
	copy(ourMAC[:], r.b[0:6])
	// RFC 8201: IPv6 never goes below 1280.
	if !v4 && mtu < 1280 {
		mtu = 1280
	}

	quote := l4 - l3 + 8
	if quote > maxICMPQuote || l3+quote > p.len {
		return r.verdict(XDPDrop, ReasonDropTooBig)
	}
	r.adjustHead(-int(ipLen + icmpHeaderLen))
	r.adjustTail(int(l3+ipLen+icmpHeaderLen+quote) - len(r.b))

	copy(r.b[0:6], clientMAC[:])
	copy(r.b[6:12], ourMAC[:])
	if tagged {
		binary.BigEndian.PutUint16(r.b[12:], 0x8100)
		copy(r.b[14:16], tci[:])
		binary.BigEndian.PutUint16(r.b[16:], etherType)
	} else {
		binary.BigEndian.PutUint16(r.b[12:], etherType)
	}
	var sum uint32
	if v4 {
		ip, icmp := l3, l3+ipv4HeaderLen
		binary.BigEndian.PutUint16(r.b[ip:], 0x4500)
		binary.BigEndian.PutUint16(r.b[ip+2:], uint16(ipv4HeaderLen+icmpHeaderLen+quote))
		r.st16(ip+4, 0)
		r.st16(ip+6, 0)
		r.b[ip+8] = 64
		r.b[ip+9] = protoICMP
		r.st16(ip+10, 0)
		r.st32(ip+12, p.flow.Dst[0])
		r.st32(ip+16, p.flow.Src[0])
		r.st16(ip+10, r.ipv4HeaderChecksum(ip))
		r.b[icmp], r.b[icmp+1] = 3, 4 // destination unreachable, fragmentation needed
		r.st16(icmp+2, 0)
		binary.BigEndian.PutUint32(r.b[icmp+4:], mtu&0xffff)
	} else {
		ip6, icmp := l3, l3+ipv6HeaderLen
		plen := icmpHeaderLen + quote
		binary.BigEndian.PutUint32(r.b[ip6:], 0x60000000)
		binary.BigEndian.PutUint16(r.b[ip6+4:], uint16(plen))
		r.b[ip6+6] = protoICMPv6
		r.b[ip6+7] = 64
		for i := range uint32(4) {
			r.st32(ip6+8+4*i, p.flow.Dst[i])
			r.st32(ip6+24+4*i, p.flow.Src[i])
		}
		r.b[icmp], r.b[icmp+1] = 2, 0 // packet too big
		r.st16(icmp+2, 0)
		binary.BigEndian.PutUint32(r.b[icmp+4:], mtu)
		// ICMPv6's pseudo-header: addresses, length, next header.
		for i := range 4 {
			sum += p.flow.Src[i]&0xffff + p.flow.Src[i]>>16
			sum += p.flow.Dst[i]&0xffff + p.flow.Dst[i]>>16
		}
		sum += uint32(ntohs(uint16(plen))) + uint32(ntohs(protoICMPv6))
	}
	// The ICMP checksum over its header and the quote, a 16-bit word at a time.
	icmp := l3 + ipLen
	for i := range uint32((icmpHeaderLen + maxICMPQuote) / 2) {
		if !r.fits(icmp+2*i, 2) {
			break
		}
		sum += uint32(r.ld16(icmp + 2*i))
	}
	r.st16(icmp+2, csumFinish(sum))
	return r.verdict(XDPTX, sent)
}

// tunnelHop is tunnel.h's tunnel_hop: the next hop for an outer packet of totLen
// bytes, from backend id's cache when fresh and long enough, else from
// bpf_fib_lookup, whose answer it caches in the backends array. A zero Ifindex means
// "not resolved: hand the packet to the kernel".
func (r *run) tunnelHop(p *modelPacket, id, totLen, outerLen uint32) (bpf.WeirNextHop, int) {
	be := &r.m.Backends[id]
	now := r.env.Now
	if hop, ok := hopCached(be, totLen, now); ok {
		return hop, modelContinue
	}
	q := FIBQuery{Family: be.Family, Proto: protoIPv6, TotLen: uint16(totLen), Ifindex: r.m.IngressIfindex}
	if p.flow.Family == familyIPv4 {
		q.Proto = protoIPIP
	}
	if be.Family == familyIPv4 {
		q.Src, q.Dst = [4]uint32{r.m.NATAddr4}, [4]uint32{be.Addr[0]}
	} else {
		q.Src, q.Dst = r.m.NATAddr6, be.Addr
	}
	ans := r.fib(q)
	switch ans.Result {
	case FIBFragNeeded:
		if p.icmpError {
			return bpf.WeirNextHop{}, r.verdict(XDPDrop, ReasonDropTooBig)
		}
		mtu := uint32(0)
		if uint32(ans.MTU) > outerLen {
			mtu = uint32(ans.MTU) - outerLen
		}
		return bpf.WeirNextHop{}, r.icmpTooBig(p, mtu, ReasonTunnelTooBig)
	case FIBNoNeighbour:
		return bpf.WeirNextHop{}, modelContinue
	case FIBSuccess:
	default:
		return bpf.WeirNextHop{}, r.verdict(XDPDrop, ReasonDropNoRoute)
	}
	hop := bpf.WeirNextHop{Dmac: ans.DstMAC, Smac: ans.SrcMAC, Ifindex: ans.Ifindex}
	hopRemember(be, hop, totLen, now)
	return hop, modelContinue
}

// tunnelForward is tunnel.h's tunnel_forward: select as dsr does, find the next
// hop, put the outer header (the backend's family, from the balancer's own address,
// the flow hash in the IPv4 ID or IPv6 flow label) between the Ethernet header and
// the client's packet, and send it.
func (r *run) tunnelForward(p *modelPacket, svc bpf.WeirService) int {
	if _, ok := r.cameFrom(); !ok {
		return int(XDPAborted)
	}
	id, be, a := r.selectBackend(p, svc)
	if a != modelContinue {
		return a
	}
	return r.tunnelSend(p, svc, id, be)
}

// tunnelSend is tunnel.h's tunnel_send.
func (r *run) tunnelSend(p *modelPacket, svc bpf.WeirService, id uint32, be bpf.WeirBackend) int {
	back, ok := r.cameFrom()
	if !ok {
		return int(XDPAborted)
	}
	outerLen := uint32(ipv6HeaderLen)
	if be.Family == familyIPv4 {
		outerLen = ipv4HeaderLen
	}
	totLen := p.l3Len + outerLen
	hop, a := r.tunnelHop(p, id, totLen, outerLen)
	if a != modelContinue {
		return a
	}
	r.countService(svc.Id)
	r.countBackend(id)
	hash := entropyHash(&p.flow)
	inner := uint8(protoIPv6)
	if p.flow.Family == familyIPv4 {
		inner = protoIPIP
	}

	// Room for the outer header; a VLAN tag is not carried over.
	r.adjustHead(-(int(ethHeaderLen+outerLen) - int(p.l3&0x7f)))
	ip := uint32(ethHeaderLen)
	if be.Family == familyIPv4 {
		binary.BigEndian.PutUint16(r.b[12:], etherTypeIPv4)
		binary.BigEndian.PutUint16(r.b[ip:], 0x4500)
		binary.BigEndian.PutUint16(r.b[ip+2:], uint16(totLen))
		r.st16(ip+4, uint16(hash))
		binary.BigEndian.PutUint16(r.b[ip+6:], ipFlagDF)
		r.b[ip+8] = 64
		r.b[ip+9] = inner
		r.st16(ip+10, 0)
		r.st32(ip+12, r.m.NATAddr4)
		r.st32(ip+16, be.Addr[0])
		r.st16(ip+10, r.ipv4HeaderChecksum(ip))
	} else {
		binary.BigEndian.PutUint16(r.b[12:], etherTypeIPv6)
		binary.BigEndian.PutUint32(r.b[ip:], 0x60000000|hash&0xfffff)
		binary.BigEndian.PutUint16(r.b[ip+4:], uint16(p.l3Len))
		r.b[ip+6] = inner
		r.b[ip+7] = 64
		for i := range uint32(4) {
			r.st32(ip+8+4*i, r.m.NATAddr6[i])
			r.st32(ip+24+4*i, be.Addr[i])
		}
	}
	if hop.Ifindex == 0 {
		// No neighbour yet: the kernel sends it; the frame looks addressed to us, as it was.
		copy(r.b[0:6], back.Smac[:])
		copy(r.b[6:12], back.Dmac[:])
		return r.verdict(XDPPass, ReasonPassNoNeighbour)
	}
	return r.sendTo(p, hop)
}
