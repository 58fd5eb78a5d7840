// flows.h: lookups, updates and deletes in the flow tables (maps.h), which come in
// pairs: IPv4 flows in a table keyed by the 16-byte flow_key4, IPv6 flows in one keyed
// by flow_key. Callers name a pair (LB_CONNTRACK, ...) and pass the flow_key.
#pragma once

#include "maps.h"

#define LB_CONNTRACK &lb_conntrack4, &lb_conntrack6
#define LB_HALF_OPEN &lb_half_open4, &lb_half_open6
#define NAT_CONNTRACK &nat_conntrack4, &nat_conntrack6
#define NAT_HALF_OPEN &nat_half_open4, &nat_half_open6
#define NAT_REVERSE &nat_reverse4, &nat_reverse6
#define NAT_HALF_REVERSE &nat_half_reverse4, &nat_half_reverse6

static __always_inline void flow_key4_of(struct flow_key4 *k4, const struct flow_key *k)
{
	k4->src = k->src[0];
	k4->dst = k->dst[0];
	k4->sport = k->sport;
	k4->dport = k->dport;
	k4->proto = k->proto;
	k4->pad[0] = k4->pad[1] = k4->pad[2] = 0;
}

static __always_inline void *flow_lookup(void *map4, void *map6, const struct flow_key *k)
{
	struct flow_key4 k4;

	if (k->family != FAMILY_IPV4)
		return bpf_map_lookup_elem(map6, k);
	flow_key4_of(&k4, k);
	return bpf_map_lookup_elem(map4, &k4);
}

static __always_inline long flow_update(void *map4, void *map6, const struct flow_key *k,
					const void *value)
{
	struct flow_key4 k4;

	if (k->family != FAMILY_IPV4)
		return bpf_map_update_elem(map6, k, value, BPF_ANY);
	flow_key4_of(&k4, k);
	return bpf_map_update_elem(map4, &k4, value, BPF_ANY);
}

static __always_inline long flow_delete(void *map4, void *map6, const struct flow_key *k)
{
	struct flow_key4 k4;

	if (k->family != FAMILY_IPV4)
		return bpf_map_delete_elem(map6, k);
	flow_key4_of(&k4, k);
	return bpf_map_delete_elem(map4, &k4);
}
