// select.h: chooses the backend of a packet's flow: the connection table first, the
// service's Maglev lookup table on a miss, and records the choice. new_flow_backend is
// the one place a new flow of any mode gets its backend; nat (nat.h) keeps its own
// connection tables and ports around it, dsr and tunnel use select_backend.
#pragma once

#include "flows.h"
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

// new_flow_backend sets *be and *id to the backend a new flow of svc gets, or returns
// a verdict: drop_no_backend when the table gives none that is usable. Every mode
// asks here, so a flow's backend does not depend on its service's mode.
static __always_inline int new_flow_backend(struct packet *p, struct service *svc,
					    struct backend **be, __u32 *id)
{
	*be = lookup_table_pick(p, svc, id);
	if (!*be)
		return verdict(XDP_DROP, STAT_DROP_NO_BACKEND, p->len);
	return CONTINUE;
}

// Runtime switches set by the loader before load: the new-flow rate limit per CPU.
// A new flow costs new_flow_interval_ns of credit, and up to new_flow_burst_ns of
// credit may be drawn ahead; 0 turns the limit off.
volatile const __u64 new_flow_interval_ns = 0;
volatile const __u64 new_flow_burst_ns = 0;

// is_syn: a TCP SYN without ACK, the first packet of a connection.
static __always_inline int is_syn(const struct packet *p)
{
	return p->flow.proto == IPPROTO_TCP &&
	       (p->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;
}

// table_slot is the backend slot a lookup table (an inner map) holds for hash h, or
// -1 if the table is empty or cannot be read.
static __always_inline __s64 table_slot(void *table, __u32 h)
{
	__u32 zero = 0, index, *size, *slot;

	size = bpf_map_lookup_elem(table, &zero);
	if (!size || *size == 0)
		return -1;
	index = 1 + h % *size;
	slot = bpf_map_lookup_elem(table, &index);
	if (!slot)
		return -1;
	return *slot;
}

// miss_backend sets *be and *id to the backend of a packet whose flow the connection
// table does not hold (*event is still flow_new), or of one it starts again
// (flow_reselect), or returns a verdict. A TCP packet that is not a SYN belongs to a
// connection opened before it: here before this node forgot it, or on another node
// whose flows the network moved here (a balancer failed, ECMP rehashed). If the
// service's lookup table changed since, the connection's backend is the one the
// previous generation gives, as long as that backend is usable: it takes it, and
// *event becomes flow_fallback when the current table would have sent it elsewhere.
// Everything else (SYNs, UDP, a flow re-selected because its backend became
// unusable, no previous generation) is a new flow: new_flow_backend. The hash is
// computed once for both tables.
static __always_inline int miss_backend(struct packet *p, struct service *svc, struct backend **be,
					__u32 *id, enum stat_reason *event)
{
	void *prev, *table;
	struct backend *old;
	__s64 slot, cur;
	__u32 h;

	if (*event != STAT_FLOW_NEW || p->flow.proto != IPPROTO_TCP || is_syn(p))
		return new_flow_backend(p, svc, be, id);
	prev = bpf_map_lookup_elem(&prev_lookup_tables, &svc->id);
	if (!prev)
		return new_flow_backend(p, svc, be, id);
	h = flow_hash(&p->flow, svc->flags & SERVICE_F_SOURCE_HASH);
	slot = table_slot(prev, h);
	old = slot < 0 ? 0 : usable_backend((__u32)slot, svc->id);
	if (!old)
		return new_flow_backend(p, svc, be, id);
	table = bpf_map_lookup_elem(&lookup_tables, &svc->id);
	cur = table ? table_slot(table, h) : -1;
	*be = old;
	*id = (__u32)slot;
	if (cur != slot)
		*event = STAT_FLOW_FALLBACK;
	return CONTINUE;
}

// new_flow_allowed reports whether this CPU may record one more new flow now: a
// generic cell rate algorithm (one word per CPU, no division on the packet path).
static __always_inline int new_flow_allowed(__u64 now)
{
	__u32 zero = 0;
	__u64 *tat, t;

	if (!new_flow_interval_ns)
		return 1;
	tat = bpf_map_lookup_elem(&new_flow_limit, &zero);
	if (!tat)
		return 1;
	t = *tat > now ? *tat : now;
	if (t - now > new_flow_burst_ns)
		return 0;
	*tat = t + new_flow_interval_ns;
	return 1;
}

// forget_reused drops the connection-table entry of a SYN's 5-tuple, if any: a SYN
// starts a new connection, which takes the lookup table (as Katran does), and the
// entry of an earlier connection on the same 5-tuple must not shadow it.
static __always_inline void forget_reused(struct packet *p)
{
	if (flow_lookup(LB_CONNTRACK, &p->flow))
		flow_delete(LB_CONNTRACK, &p->flow);
}

// select_backend sets *be to the flow's backend or returns a verdict (dsr and tunnel).
// An established flow keeps its backend while it is usable. A new flow takes the
// lookup table and is recorded half-open; the next packet of it that is not a SYN
// (the client's ACK, a UDP flow's second datagram) moves it to the connection table.
// Over the new-flow rate a new flow is sent by the lookup table unrecorded: it loses
// only stickiness across a table change during its handshake.
static __always_inline int select_backend(struct packet *p, struct service *svc,
					  struct backend **be, __u32 *id)
{
	struct lb_flow *known, fresh = {};
	enum stat_reason event = STAT_FLOW_NEW;
	__u64 now;
	int action;

	if (is_syn(p)) {
		forget_reused(p);
	} else {
		known = flow_lookup(LB_CONNTRACK, &p->flow);
		if (known) {
			*id = known->backend_id;
			*be = usable_backend(*id, svc->id);
			if (*be) {
				count(&global_stats, STAT_FLOW_HIT, p->len);
				return CONTINUE;
			}
			// Its backend became unusable: it starts again as a new flow.
			flow_delete(LB_CONNTRACK, &p->flow);
			event = STAT_FLOW_RESELECT;
		} else {
			known = flow_lookup(LB_HALF_OPEN, &p->flow);
			if (known) {
				*id = known->backend_id;
				*be = usable_backend(*id, svc->id);
				if (*be) {
					fresh = *known;
					flow_update(LB_CONNTRACK, &p->flow, &fresh);
					flow_delete(LB_HALF_OPEN, &p->flow);
					count(&global_stats, STAT_FLOW_ESTABLISHED, p->len);
					return CONTINUE;
				}
				event = STAT_FLOW_RESELECT;
			}
		}
	}

	action = miss_backend(p, svc, be, id, &event);
	if (action != CONTINUE)
		return action;
	now = bpf_ktime_get_coarse_ns();
	if (!new_flow_allowed(now)) {
		count(&global_stats, STAT_FLOW_UNTRACKED, p->len);
		return CONTINUE;
	}
	fresh.backend_id = *id;
	fresh.created_s = now / NSEC_PER_SEC;
	// A failed insert (map full of entries being updated) only costs stickiness: the
	// next packet of the flow takes the same table slot while the table is unchanged.
	flow_update(LB_HALF_OPEN, &p->flow, &fresh);
	count(&global_stats, event, p->len);
	return CONTINUE;
}
