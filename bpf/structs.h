// structs.h: the layouts shared by the program, its maps and (through bpf2go) the Go
// loader. Addresses and ports are in network byte order everywhere; an IPv4 address
// takes the first word of a 16-byte address and the other three words are zero.
#pragma once

#include <linux/types.h>

#include "consts.h"

// Key of the services map: a VIP, its port and protocol. The loader also stores an
// address-only key (port 0, proto 0) for every VIP address, so that fragments and
// truncated packets to a VIP can be dropped instead of passed to a stack that does
// not own the address.
struct vip_key {
	__be32 addr[4];
	__be16 port;
	__u8 proto;   // IPPROTO_TCP, IPPROTO_UDP; 0 in an address-only key
	__u8 family;  // FAMILY_IPV4 or FAMILY_IPV6
};

// Value of the services map.
struct service {
	__u32 id;     // index into lookup_tables and service_stats
	enum service_flags flags; // SERVICE_F_* bits (4 bytes)
	enum mode mode;           // MODE_* (4 bytes)
};

// A next hop: the MACs to write and the interface to leave by (0: not known).
struct next_hop {
	__u8 dmac[6];
	__u8 smac[6];
	__u32 ifindex;
};

// Value of the backends map (an array indexed by backend slot).
struct backend {
	__be32 addr[4];
	__be16 port;
	__u8 family;
	enum backend_flags flags; // BACKEND_F_* bits (1 byte)
	__u8 mac[6];    // next hop for dsr
	__u16 weight;   // its configured weight (1..65535 in a table): maglev_p2c compares load per weight
	__u32 service_id; // owning service: a flow whose slot was reused elsewhere is re-selected
	// nat and tunnel: the next hop towards the backend as bpf_fib_lookup found it,
	// reused for a second (hop_ns) for packets no longer than hop_len, the longest it
	// accepted; a longer packet is looked up again, which is how the path MTU is
	// checked (nat.h hop_cached). The program writes these; the loader writes zeros.
	struct next_hop hop;
	__u64 hop_ns;
	__u32 hop_len;
	// nat: the port ring (index of nat_cursor) this backend's source ports come from,
	// one per backend address, port and protocol: every slot holding the same backend
	// (two services on it) shares it, as they share its port claims
	// (nat_half_reverse's key has no slot). The loader sets it.
	__u32 nat_ring;
};

// A flow's 5-tuple as received, as the program holds it, and the key of the IPv6
// flow tables.
struct flow_key {
	__be32 src[4];
	__be32 dst[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 family;
	__u8 pad[2];
};

// Key of the IPv4 flow tables: an IPv4 flow_key without its 24 bytes of zeros and its
// family, so more flows fit in cache and the hash covers 16 bytes, not 40.
struct flow_key4 {
	__be32 src;
	__be32 dst;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};

// Value of the dsr and tunnel flow tables: all a flow needs to keep its backend.
struct lb_flow {
	__u32 backend_id;
	__u32 created_s; // bpf_ktime_get_coarse_ns at insertion, in seconds; bit 31 is LB_FLOW_CLOSED
};

// Value of the nat flow tables.
struct nat_flow {
	__u32 backend_id;
	__be16 nat_port;    // the source port towards the backend
	enum flow_flags flags; // FLOW_F_* bits (1 byte)
	__u8 pad;
	__u64 last_seen_ns; // bpf_ktime_get_coarse_ns: insertion, then the client's packets at
			    // most once a second once established
};

// The client's side of a nat flow in a nat_entry: its flow as received (client ->
// VIP), laid out as a flow_key (nat.h client_key makes the key of it), and the 802.1Q
// tag its packets came with, which the backend's replies get back. The tag sits where
// a flow_key has padding, so entries an older weir wrote read as untagged.
struct nat_client {
	__be32 src[4];
	__be32 dst[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 family;
	__be16 vlan_tci; // the tag's TCI, network order; 0: untagged (a tag of TCI 0 says nothing)
};

_Static_assert(sizeof(struct nat_client) == sizeof(struct flow_key) &&
		       __builtin_offsetof(struct nat_client, vlan_tci) == __builtin_offsetof(struct flow_key, pad),
	       "nat_client must be a flow_key with its padding named");

// Value of the nat reverse tables, whose key is the backend's reply 5-tuple
// (backend -> nat address:port).
struct nat_entry {
	struct nat_client client; // the client's flow as received (client -> VIP) and its VLAN tag
	__u32 backend_id;
	// Half-open TCP flows begun by a SYN, until the backend's SYN-ACK: the
	// acknowledgement number that answers the SYN (the client's initial sequence number
	// + 1, network order). 0 otherwise, and for the one SYN in 2^32 whose answer is 0,
	// which then goes unchecked. Established UDP flows: the tick (coarse clock >> 20,
	// wrapping) the backend's packets last refreshed the flow (nat_reply_refresh).
	__be32 syn_ack;
	// Replies go back to where the client's packets come from: the MAC they came from
	// (the client or its router), the interface they came in on and their VLAN tag
	// (client.vlan_tci), refreshed with the flow once a second, so no reply needs a
	// route lookup.
	struct next_hop to_client;
};

// Per-CPU count of a backend's nat flows; active = opened - closed, summed over CPUs.
// A flow the LRU forgets without a FIN or RST stays counted as open.
struct flow_count {
	__u64 opened;
	__u64 closed;
};

// Per-CPU packet and byte counter.
struct counter {
	__u64 packets;
	__u64 bytes;
};
