// consts.h: capacities, defaults, modes, flags and counter indexes shared by the whole
// program. Every capacity here is a default: a build may override it
// (-DCONNTRACK_SIZE=...), and the loader may resize a map before load. What Go needs
// to know is an enum, which bpf2go (-type) turns into Go constants: loader has no
// copies of these numbers.
#pragma once

// Capacities.
#ifndef MAX_SERVICES
#define MAX_SERVICES 1024       // services (VIP, port, protocol); index of per-service arrays
#endif
#ifndef MAX_BACKENDS
#define MAX_BACKENDS 16384      // backend slots over all services
#endif
#ifndef MAX_VIP_ADDRS
#define MAX_VIP_ADDRS 2048      // service keys plus one address-only key per VIP address
#endif
#ifndef CONNTRACK_SIZE
#define CONNTRACK_SIZE 262144   // established flows remembered; the loader resizes it
#endif
#ifndef HALF_OPEN_SIZE
#define HALF_OPEN_SIZE 65536    // flows before their handshake completes; the loader resizes it
#endif
#ifndef MAX_IPV6_EXT_HDRS
#define MAX_IPV6_EXT_HDRS 4     // IPv6 extension headers walked before giving up
#endif
#ifndef MAX_TX_PORTS
#define MAX_TX_PORTS 64         // interfaces a nat packet may be redirected to
#endif
#ifndef NAT_PORT_TRIES
#define NAT_PORT_TRIES 8        // ports of a backend's ring tried for a new nat flow
#endif
#define MAX_L3_OFFSET 64        // Ethernet + VLAN; keeps header offsets provably small
#define MAX_L4_OFFSET 512       // IP header + options or extension headers
#define MAX_ICMP_QUOTE 200      // bytes of the offending packet an ICMPv6 "too big" quotes
#define MAX_ICMP_CHECKED 4096   // longest ICMP error whose checksum is checked (and so acted on)

#define NSEC_PER_SEC 1000000000ull
// nat_reply_refresh's clock: ticks of 2^20 ns (about 1.05 ms), a refresh every
// 954 of them (about 1 s).
#define REPLY_TICK_SHIFT 20
#define REPLY_TICKS_PER_REFRESH 954u

// Defaults the program, the loader and the agent share (Go: bpf.WeirDefaults*). The
// loader sets the nat settings (nat.h) and table sizes before load, these when its
// options leave them zero, and reports what it loaded.
enum defaults {
	DEFAULT_CONNTRACK_SIZE = CONNTRACK_SIZE, // entries of each connection and nat reverse table
	DEFAULT_HALF_OPEN_SIZE = HALF_OPEN_SIZE, // entries of each half-open table
	MIN_HALF_OPEN_SIZE = 1024,        // loader: a resized connection table's half-open tables get
					  // a quarter of its size, at least this
	DEFAULT_NAT_PORT_MIN = 10000,     // nat source ports handed out, host order: clear of
	DEFAULT_NAT_PORT_MAX = 32767,     // Linux's ip_local_port_range (32768..60999)
	DEFAULT_TCP_IDLE_S = 900,         // nat: an established TCP flow's idle timeout
	DEFAULT_TCP_CLOSING_S = 10,       // nat: a TCP flow's after a FIN or RST
	DEFAULT_UDP_IDLE_S = 30,          // nat: a UDP flow's
	DEFAULT_HALF_OPEN_S = 5,          // nat: a flow's before its client answers
};

// bpf2go finds a -type only in the object's BTF, and clang puts an enum there only
// when something uses it; the modes and flags are struct fields' types, stat_reason a
// map's key, and this constant, which nothing reads, is enum defaults' one use.
const enum defaults defaults_btf_anchor __attribute__((used)) = DEFAULT_CONNTRACK_SIZE;

// Forwarding modes, service.mode.
enum mode {
	MODE_DSR = 0,    // rewrite the destination MAC, XDP_TX
	MODE_NAT = 1,    // full NAT both ways
	MODE_TUNNEL = 2, // IPIP / IP6IP6 encapsulation
};

// Flag bits of service.flags.
enum service_flags {
	SERVICE_F_SOURCE_HASH = 1u << 0, // hash the source address only (client affinity)
	SERVICE_F_P2C = 1u << 1,         // maglev_p2c: a new flow takes the less loaded of two candidates
};

// Bits of lb_flow.created_s above its seconds (which fit in 31 bits for 68 years of uptime).
enum lb_flow_bits {
	LB_FLOW_CLOSED = 1u << 31, // the client sent a FIN or RST: counted closed in backend_load once
};

// Its one use, so that clang puts it in BTF and bpf2go (-type) gives it to Go.
const enum lb_flow_bits lb_flow_bits_btf_anchor __attribute__((used)) = LB_FLOW_CLOSED;

// Flag bits of backend.flags, one byte like the field (packed).
enum __attribute__((packed)) backend_flags {
	BACKEND_F_USABLE = 1u << 0, // healthy: may keep and receive flows
};

// Flag bits of nat_flow.flags, one byte like the field (packed).
enum __attribute__((packed)) flow_flags {
	FLOW_F_CLOSING = 1u << 0, // an RST, or a FIN each way, was seen: short timeout; counted closed once established
	// nat, half-open flows only (cleared when the flow is established):
	FLOW_F_STALE = 1u << 1,   // the backend answered on the flow's port with another connection's numbers
	FLOW_F_KEPT = 1u << 2,    // a SYN sent again kept the port once after a stale answer
	// A FIN one way half-closes the flow; its other direction may go on for as long as
	// the idle timeout allows.
	FLOW_F_FIN_CLIENT = 1u << 3,  // the client's FIN was seen
	FLOW_F_FIN_BACKEND = 1u << 4, // the backend's FIN was seen
};

// Address families as stored in keys (values of AF_INET / AF_INET6).
#define FAMILY_IPV4 2
#define FAMILY_IPV6 10

// Global counters, indexed by reason (Go: bpf.WeirStatReason*, which loader.Reason
// takes its values from; loader names each one, and a test fails on a reason without one).
enum stat_reason {
	STAT_PASS_NOT_IP = 0,      // not IPv4/IPv6 (ARP, LLDP, QinQ, ...)
	STAT_PASS_MALFORMED_L3,    // IP header truncated or inconsistent: the kernel judges it
	STAT_PASS_NOT_SERVICE,     // not to a configured (VIP, port, protocol)
	STAT_PASS_NOT_VIP_L4,      // fragment or truncated L4 header, not to a VIP address
	STAT_TX,                   // forwarded by XDP_TX
	STAT_DROP_NO_BACKEND,      // service has no usable backend
	STAT_DROP_FRAGMENT,        // IP fragment to a VIP address (no ports to balance by)
	STAT_DROP_MALFORMED_L4,    // truncated TCP/UDP header (or its length past the packet) to a VIP address
	STAT_DROP_IPV6_EXT,        // IPv6 extension header chain we do not walk, to a VIP address
	STAT_FLOW_NEW,             // flow selected from the lookup table
	STAT_FLOW_HIT,             // flow found in the connection table
	STAT_FLOW_RESELECT,        // flow found, but its backend had become unusable
	STAT_REDIRECT,             // nat: forwarded by XDP_REDIRECT to another interface
	STAT_NAT_REPLY,            // nat: a backend's reply translated back to the client
	STAT_PASS_NO_NEIGH,        // nat: next hop not resolved yet: passed so the kernel resolves it
	STAT_DROP_NO_ROUTE,        // nat: no route (or forwarding disabled) towards the next hop
	STAT_DROP_NAT_PORTS,       // nat: no free source port for a new flow
	STAT_ICMP_TRANSLATED,      // nat: an ICMP error quoting a nat flow, translated
	STAT_TUNNEL_TOO_BIG,       // tunnel: too big once encapsulated; ICMP error sent back
	STAT_DROP_TOO_BIG,         // tunnel/nat: too big, and no ICMP error could be made (no DF, odd quote)
	STAT_FLOW_ESTABLISHED,     // a half-open flow's client answered: moved to the connection table
	STAT_FLOW_UNTRACKED,       // dsr/tunnel: over the new-flow rate, sent by the lookup table, not recorded
	STAT_DROP_FLOW_RATE,       // nat: over the new-flow rate, dropped
	STAT_DROP_HALF_OPEN_FULL,  // nat: the half-open table refused a new flow's port claim
	STAT_FLOW_SECOND_CHOICE,   // maglev_p2c: a new flow took its second candidate, the less loaded
	STAT_FLOW_FALLBACK,        // TCP, not a SYN, unknown here: sent by the previous lookup table, which disagrees with the current one
	STAT_PASS_NAT_STALE,       // nat: a backend's packet to a half-open flow's port that does not answer its SYN: passed to the host, which resets it
	STAT_NAT_NEW_PORT,         // nat: a SYN sent again that the backend had not answered, moved to a new source port
	STAT_DROP_NO_TX_PORT,      // nat/tunnel: the next hop is on an interface the program is not attached to (not in tx_ports)
	STAT_NAT_TOO_BIG,          // nat: too big for the route to the backend; ICMP error sent back
	STAT_ICMP_TO_BACKEND,      // dsr/tunnel: an ICMP error quoting a flow's reply, sent on to its backend
	STAT_DROP_ICMP_CHECKSUM,   // nat/dsr/tunnel: an ICMP error quoting a flow, its ICMP (or quoted IPv4 header's, without options) checksum wrong
	STAT_PASS_L2_GROUP,        // an IP packet in a frame to a group (broadcast, multicast) MAC: not sent to this host alone
	STAT_MAX,
};

// global_stats has room for reasons yet to come, so that maps pinned by this version
// stay compatible with the next one.
#define STAT_SLOTS 64
_Static_assert(STAT_MAX <= STAT_SLOTS, "global_stats: raise STAT_SLOTS");
