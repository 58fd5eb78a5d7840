// maps.h: every map of the program, what its key and value are, and who writes it.
// The loader writes services, backends and lookup tables; the program writes the
// connection table and counters.
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "structs.h"

// (VIP, port, protocol) and address-only keys -> service.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_VIP_ADDRS);
	__type(key, struct vip_key);
	__type(value, struct service);
} services SEC(".maps");

// Backend slot -> backend.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct backend);
} backends SEC(".maps");

// One Maglev lookup table: entry 0 holds the table size M (a prime), entries 1..M the
// backend slots; a maglev_p2c service's holds its second table (built from a seed
// derived from hash_seed, userspace/balance P2CSeed) in entries M+1..2M, so a slot's
// two owners are independent draws. Its size travels inside the table, so swapping
// the whole inner map is the one atomic step of a table update: a packet sees the old
// table (or pair) or the new one. BPF_F_INNER_MAP lets tables of different sizes share
// the outer map.
struct lookup_table {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_INNER_MAP);
	__type(key, __u32);
	__type(value, __u32);
};

// Service id -> that service's current lookup table.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, MAX_SERVICES);
	__type(key, __u32);
	__array(values, struct lookup_table);
} lookup_tables SEC(".maps");

// Backend slot -> its active flows as this node sees them: +1 when a flow is
// established, -1 when it is counted closed (nat: as backend_flows; dsr and tunnel: the
// client's first FIN or RST, a reselection, or a SYN reusing its 5-tuple). One word
// shared by all CPUs (atomic add), so maglev_p2c reads it with one lookup; the loader
// zeroes it when it gives the slot to a backend. A negative value (flows of the slot's
// previous backend closing) counts as unknown.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_BACKENDS);
	__type(key, __u32);
	__type(value, __s64);
} backend_load SEC(".maps");

// The flow tables. Each kind comes twice: an IPv4 table keyed by flow_key4 and an
// IPv6 one keyed by flow_key (flows.h picks). A flow is recorded half-open on its first
// packet and established with its client's next packet that is not a SYN (select.h,
// nat.h): a spoofed source never sends one, so a flood of new 5-tuples churns the
// half-open tables and never evicts an established flow. All are LRU: when full, the
// least recently used flow is forgotten. Each CPU keeps its own LRU list
// (BPF_F_NO_COMMON_LRU, as Katran does): inserting a flow takes no lock shared with
// other CPUs, and lookups still see every CPU's flows.
#define FLOW_TABLE(name, key_type, value_type, size)		\
	struct {						\
		__uint(type, BPF_MAP_TYPE_LRU_HASH);		\
		__uint(max_entries, size);			\
		__uint(map_flags, BPF_F_NO_COMMON_LRU);		\
		__type(key, key_type);				\
		__type(value, value_type);			\
	} name SEC(".maps")

// dsr and tunnel flows -> backend.
FLOW_TABLE(lb_conntrack4, struct flow_key4, struct lb_flow, CONNTRACK_SIZE);
FLOW_TABLE(lb_conntrack6, struct flow_key, struct lb_flow, CONNTRACK_SIZE);
FLOW_TABLE(lb_half_open4, struct flow_key4, struct lb_flow, HALF_OPEN_SIZE);
FLOW_TABLE(lb_half_open6, struct flow_key, struct lb_flow, HALF_OPEN_SIZE);

// nat flows -> backend, source port and next hop.
FLOW_TABLE(nat_conntrack4, struct flow_key4, struct nat_flow, CONNTRACK_SIZE);
FLOW_TABLE(nat_conntrack6, struct flow_key, struct nat_flow, CONNTRACK_SIZE);
FLOW_TABLE(nat_half_open4, struct flow_key4, struct nat_flow, HALF_OPEN_SIZE);
FLOW_TABLE(nat_half_open6, struct flow_key, struct nat_flow, HALF_OPEN_SIZE);

// nat: the backend's reply 5-tuple (backend addr:port -> nat addr:port) -> the client's
// flow; the half-open ones hold a half-open flow's claim on its port, which moves to
// the established ones with its flow.
FLOW_TABLE(nat_reverse4, struct flow_key4, struct nat_entry, CONNTRACK_SIZE);
FLOW_TABLE(nat_reverse6, struct flow_key, struct nat_entry, CONNTRACK_SIZE);
FLOW_TABLE(nat_half_reverse4, struct flow_key4, struct nat_entry, HALF_OPEN_SIZE);
FLOW_TABLE(nat_half_reverse6, struct flow_key, struct nat_entry, HALF_OPEN_SIZE);

// New-flow rate limit, per CPU: the theoretical arrival time (ns, the coarse clock) of
// the next new flow in a generic cell rate algorithm; see new_flow_allowed.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} new_flow_limit SEC(".maps");

// Service id -> packets and bytes forwarded, per CPU.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SERVICES);
	__type(key, __u32);
	__type(value, struct counter);
} service_stats SEC(".maps");

// Backend slot -> packets and bytes forwarded, per CPU.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct counter);
} backend_stats SEC(".maps");

// enum stat_reason -> packets and bytes, per CPU (STAT_SLOTS entries, STAT_MAX used).
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_SLOTS);
	__type(key, enum stat_reason);
	__type(value, struct counter);
} global_stats SEC(".maps");

// nat: port ring (backend.nat_ring: one per backend address, port and protocol,
// whichever slots hold it) -> where that backend's ring of source ports goes on: a new
// flow takes port nat_port_min + (cursor++ % range), skipping ports that established
// flows hold. Ports come round oldest first, so the port a new flow looks at is the
// one most likely to be free. Shared by all CPUs (atomic add); host byte order.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_BACKENDS);
	__type(key, __u32);
	__type(value, __u32);
} nat_cursor SEC(".maps");

// Backend slot -> nat flows opened and closed, per CPU.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct flow_count);
} backend_flows SEC(".maps");

// ifindex -> ifindex: the interfaces the program is attached to, which a nat packet
// may leave by (the loader fills it on attach).
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__uint(max_entries, MAX_TX_PORTS);
	__type(key, __u32);
	__type(value, __u32);
} tx_ports SEC(".maps");

// Service id -> the lookup table its current one replaced, while that generation is
// younger than the loader's previous-table window (the loader deletes it then; it
// is never filled with the window 0). Same inner maps as lookup_tables: the loader
// moves the replaced table here as it swaps the new one in (select.h miss_backend).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, MAX_SERVICES);
	__type(key, __u32);
	__array(values, struct lookup_table);
} prev_lookup_tables SEC(".maps");
