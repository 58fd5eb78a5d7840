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

// is_syn: a TCP SYN without ACK, the first packet of a connection.
static __always_inline int is_syn(const struct packet *p)
{
	return p->flow.proto == IPPROTO_TCP &&
	       (p->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;
}

// lookup_table_pick sets *id to the slot svc's table in tables gives flow hash h
// (which 0: the table, 1: a maglev_p2c table's second) and returns its backend if
// usable. A table without a second half has no entry there: no backend.
static __always_inline struct backend *lookup_table_pick(void *tables, struct service *svc, __u32 h,
							 __u32 which, __u32 *id)
{
	__u32 zero = 0, index, *size, *slot;
	void *table;

	table = bpf_map_lookup_elem(tables, &svc->id);
	if (!table)
		return 0;
	size = bpf_map_lookup_elem(table, &zero);
	if (!size || *size == 0)
		return 0;
	index = 1 + h % *size + (which ? *size : 0);
	slot = bpf_map_lookup_elem(table, &index);
	if (!slot)
		return 0;
	*id = *slot;
	return usable_backend(*id, svc->id);
}

// load_add counts a flow of backend slot id opened (+1) or closed (-1) in backend_load.
static __always_inline void load_add(__u32 id, __s64 delta)
{
	__s64 *active = bpf_map_lookup_elem(&backend_load, &id);

	if (active)
		__sync_fetch_and_add(active, delta);
}

// p2c_second reports whether a new flow should take its second candidate b (slot
// idb) over its first a (slot ida): only when a's active flows per unit of weight
// exceed b's by more than an eighth. Equal loads, loads within the margin, and a
// missing, negative or weightless count keep the first candidate, which is what
// plain maglev and every other node would choose; the margin keeps flows on it
// while the two loads are within an eighth of each other.
static __always_inline int p2c_second(const struct backend *a, __u32 ida, const struct backend *b,
				      __u32 idb)
{
	__s64 *la, *lb;
	__u64 ca, cb;

	if (ida == idb || !a->weight || !b->weight)
		return 0;
	la = bpf_map_lookup_elem(&backend_load, &ida);
	lb = bpf_map_lookup_elem(&backend_load, &idb);
	if (!la || !lb || *la < 0 || *lb < 0)
		return 0;
	// la/wa > lb/wb * 9/8, cross-multiplied: below 2^40 flows and 2^16 weights each
	// product fits in 64 bits.
	ca = (__u64)*la * b->weight * 8;
	cb = (__u64)*lb * a->weight * 9;
	return ca > cb;
}

// new_flow_backend sets *be and *id to the backend a new flow of svc gets, or returns
// a verdict: drop_no_backend when the table gives none that is usable. Every mode
// asks here, so a flow's backend does not depend on its service's mode. A maglev_p2c
// service compares the first candidate with the slot its table's second half gives
// the same hash, for a TCP SYN or any first UDP datagram; a TCP packet that is not a SYN
// started elsewhere (another node, before a restart) and takes the first candidate,
// the one a node that knows nothing of load chooses too.
static __always_inline int new_flow_backend(struct packet *p, struct service *svc,
					    struct backend **be, __u32 *id)
{
	__u32 h = flow_hash(&p->flow, svc->flags & SERVICE_F_SOURCE_HASH), id2 = 0;
	struct backend *be2;

	*be = lookup_table_pick(&lookup_tables, svc, h, 0, id);
	if (!*be)
		return verdict(XDP_DROP, STAT_DROP_NO_BACKEND, p->len);
	if (!(svc->flags & SERVICE_F_P2C))
		return CONTINUE;
	if (p->flow.proto == IPPROTO_TCP && !is_syn(p))
		return CONTINUE;
	be2 = lookup_table_pick(&lookup_tables, svc, h, 1, &id2);
	if (be2 && p2c_second(*be, *id, be2, id2)) {
		*be = be2;
		*id = id2;
		count(&global_stats, STAT_FLOW_SECOND_CHOICE, p->len);
	}
	return CONTINUE;
}

// Runtime switches set by the loader before load: the new-flow rate limit per CPU.
// A new flow costs new_flow_interval_ns of credit, and up to new_flow_burst_ns of
// credit may be drawn ahead; 0 turns the limit off.
volatile const __u64 new_flow_interval_ns = 0;
volatile const __u64 new_flow_burst_ns = 0;

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
// computed once for both tables. maglev_p2c's previous generation gives its first
// table's candidate, the pick such a packet gets from the current tables too.
static __always_inline int miss_backend(struct packet *p, struct service *svc, struct backend **be,
					__u32 *id, enum stat_reason *event)
{
	struct backend *old;
	__u32 h, cur = -1;

	if (*event != STAT_FLOW_NEW || p->flow.proto != IPPROTO_TCP || is_syn(p) ||
	    !bpf_map_lookup_elem(&prev_lookup_tables, &svc->id))
		return new_flow_backend(p, svc, be, id);
	h = flow_hash(&p->flow, svc->flags & SERVICE_F_SOURCE_HASH);
	old = lookup_table_pick(&prev_lookup_tables, svc, h, 0, id);
	if (!old)
		return new_flow_backend(p, svc, be, id);
	*be = old;
	// A slot is below MAX_BACKENDS: cur stays -1 when there is no current table.
	lookup_table_pick(&lookup_tables, svc, h, 0, &cur);
	if (cur != *id)
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

// tcp_fin_or_rst: the client is ending its TCP connection.
static __always_inline int tcp_fin_or_rst(const struct packet *p)
{
	return p->flow.proto == IPPROTO_TCP && (p->tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST));
}

// lb_flow_closed counts an established dsr or tunnel flow closed in backend_load,
// once: the bit it sets in the entry is set by one CPU only.
static __always_inline void lb_flow_closed(struct lb_flow *f)
{
	__u32 old = __sync_fetch_and_or(&f->created_s, LB_FLOW_CLOSED);

	if (!(old & LB_FLOW_CLOSED))
		load_add(f->backend_id, -1);
}

// forget_reused drops the connection-table entry of a SYN's 5-tuple, if any: a SYN
// starts a new connection, which takes the lookup table (as Katran does), and the
// entry of an earlier connection on the same 5-tuple must not shadow it.
static __always_inline void forget_reused(struct packet *p)
{
	struct lb_flow *old = flow_lookup(LB_CONNTRACK, &p->flow);

	if (old) {
		lb_flow_closed(old);
		flow_delete(LB_CONNTRACK, &p->flow);
	}
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
		// With maglev_p2c a SYN sent again keeps the backend its first one got (as
		// nat does): the loads, and so the choice, may have changed since. Plain
		// maglev's choice changes only with the table, which a SYN always takes.
		known = (svc->flags & SERVICE_F_P2C) ? flow_lookup(LB_HALF_OPEN, &p->flow) : 0;
		if (known) {
			*id = known->backend_id;
			*be = usable_backend(*id, svc->id);
			if (*be) {
				count(&global_stats, STAT_FLOW_HIT, p->len);
				return CONTINUE;
			}
			event = STAT_FLOW_RESELECT;
		}
	} else {
		known = flow_lookup(LB_CONNTRACK, &p->flow);
		if (known) {
			*id = known->backend_id;
			*be = usable_backend(*id, svc->id);
			if (*be) {
				// The client's FIN or RST: the best sign of a flow's end dsr and
				// tunnel see (the backend's replies bypass the balancer).
				if (tcp_fin_or_rst(p))
					lb_flow_closed(known);
				count(&global_stats, STAT_FLOW_HIT, p->len);
				return CONTINUE;
			}
			// Its backend became unusable: it starts again as a new flow.
			lb_flow_closed(known);
			flow_delete(LB_CONNTRACK, &p->flow);
			event = STAT_FLOW_RESELECT;
		} else {
			known = flow_lookup(LB_HALF_OPEN, &p->flow);
			if (known) {
				*id = known->backend_id;
				*be = usable_backend(*id, svc->id);
				if (*be) {
					fresh = *known;
					load_add(*id, 1);
					if (tcp_fin_or_rst(p)) {
						fresh.created_s |= LB_FLOW_CLOSED;
						load_add(*id, -1);
					}
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
	fresh.created_s = (now / NSEC_PER_SEC) & ~LB_FLOW_CLOSED;
	// A failed insert (map full of entries being updated) only costs stickiness: the
	// next packet of the flow takes the same table slot while the table is unchanged.
	flow_update(LB_HALF_OPEN, &p->flow, &fresh);
	count(&global_stats, event, p->len);
	return CONTINUE;
}
