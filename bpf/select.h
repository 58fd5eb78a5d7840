// select.h: chooses the backend of a packet's flow: the connection table first, the
// service's Maglev lookup table on a miss, and records the choice.
#pragma once

#include "hash.h"
#include "parse.h"

static __always_inline struct backend *usable_backend(__u32 id, __u32 service_id)
{
	struct backend *be = bpf_map_lookup_elem(&backends, &id);

	if (!be || !(be->flags & BACKEND_F_USABLE) || be->service_id != service_id)
		return 0;
	return be;
}

static __always_inline struct backend *lookup_table_pick(struct packet *p, struct service *svc,
							 __u32 *id)
{
	__u32 zero = 0, h, index, *size, *slot;
	void *table;

	table = bpf_map_lookup_elem(&lookup_tables, &svc->id);
	if (!table)
		return 0;
	size = bpf_map_lookup_elem(table, &zero);
	if (!size || *size == 0)
		return 0;
	h = flow_hash(&p->flow, svc->flags & SERVICE_F_SOURCE_HASH);
	index = 1 + h % *size;
	slot = bpf_map_lookup_elem(table, &index);
	if (!slot)
		return 0;
	*id = *slot;
	return usable_backend(*id, svc->id);
}

// select_backend sets *be to the flow's backend or returns a verdict.
static __always_inline int select_backend(struct packet *p, struct service *svc,
					  struct backend **be, __u32 *id)
{
	struct flow_state *known, fresh = {};
	enum stat_reason event = STAT_FLOW_NEW;

	// A SYN starts a new connection: it always takes the lookup table and overwrites
	// any stale entry of a reused 5-tuple (as Katran does). Other packets use the
	// connection table, so established flows survive table changes.
	if (!(p->flow.proto == IPPROTO_TCP &&
	      (p->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN)) {
		known = bpf_map_lookup_elem(&conntrack, &p->flow);
		if (known) {
			*id = known->backend_id;
			*be = usable_backend(*id, svc->id);
			if (*be) {
				count(&global_stats, STAT_FLOW_HIT, p->len);
				return CONTINUE;
			}
			event = STAT_FLOW_RESELECT;
		}
	}

	*be = lookup_table_pick(p, svc, id);
	if (!*be)
		return verdict(XDP_DROP, STAT_DROP_NO_BACKEND, p->len);
	fresh.backend_id = *id;
	fresh.created_ns = bpf_ktime_get_coarse_ns();
	// A failed insert (map full of entries being updated) only costs stickiness: the
	// next packet of the flow takes the same table slot while the table is unchanged.
	bpf_map_update_elem(&conntrack, &p->flow, &fresh, BPF_ANY);
	count(&global_stats, event, p->len);
	return CONTINUE;
}
