// tunnel.h: IPIP / IP6IP6 encapsulation (the outer family is the backend's, so IPv4
// VIPs may be carried to IPv6 backends and the other way round). The client's packet
// travels unchanged inside an outer header from the balancer's address to the
// backend, which strips it (weir decap, or the kernel's ipip/ip6tnl) and answers the
// client directly. A packet that would no longer fit the path once encapsulated is
// answered with ICMP "fragmentation needed" / ICMPv6 "packet too big", so the client
// lowers its path MTU.
#pragma once

#include "nat.h"

#define IPPROTO_IPIP_ 4   // IPv4 inside
#define IPPROTO_IPV6_ 41  // IPv6 inside

// tunnel_hop finds the next hop for an outer packet of tot_len bytes to be: from the
// backend's cache when it is fresh and has carried packets this long, else from
// bpf_fib_lookup, whose answer it caches. It returns CONTINUE with *hop set, or the
// verdict (the ICMP error for a packet too big).
static __always_inline int tunnel_hop(struct xdp_md *ctx, struct packet *p, struct backend *be,
				      __u32 tot_len, __u32 outer_len, struct next_hop *hop)
{
	__u64 now = bpf_ktime_get_coarse_ns();
	long rc;

	if (hop_cached(be, tot_len, now, hop))
		return CONTINUE;
	// Zeroed only here: 64 bytes of stores the cached path need not pay.
	struct bpf_fib_lookup fib = {};

	fib.family = be->family;
	fib.ifindex = ctx->ingress_ifindex;
	fib.tot_len = tot_len;
	if (be->family == FAMILY_IPV4) {
		fib.l4_protocol = p->flow.family == FAMILY_IPV4 ? IPPROTO_IPIP_ : IPPROTO_IPV6_;
		fib.ipv4_src = nat_addr4;
		fib.ipv4_dst = be->addr[0];
	} else {
		__be32 src[4];

		fib.l4_protocol = p->flow.family == FAMILY_IPV4 ? IPPROTO_IPIP_ : IPPROTO_IPV6_;
		// Read word by word: a memcpy from the volatile const would be folded to its
		// compile-time value (zero) by clang.
		nat_source(FAMILY_IPV6, src);
		__builtin_memcpy(fib.ipv6_src, src, 16);
		__builtin_memcpy(fib.ipv6_dst, be->addr, 16);
	}
	rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), 0);
	// No ICMP error answers an ICMP error (RFC 1122 3.2.2, RFC 4443 2.4).
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED && p->icmp_error)
		return verdict(XDP_DROP, STAT_DROP_TOO_BIG, p->len);
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return icmp_too_big(ctx, p, fib.mtu_result > outer_len ? fib.mtu_result - outer_len : 0,
				    STAT_TUNNEL_TOO_BIG);
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		hop->ifindex = 0; // encapsulate, then let the kernel resolve and send it
		return CONTINUE;
	}
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return verdict(XDP_DROP, STAT_DROP_NO_ROUTE, p->len);
	__builtin_memcpy(hop->dmac, fib.dmac, ETH_ALEN);
	__builtin_memcpy(hop->smac, fib.smac, ETH_ALEN);
	hop->ifindex = fib.ifindex;
	hop_remember(be, hop, tot_len, now);
	return CONTINUE;
}

// tunnel_send puts the packet in an outer header to backend be (slot id) of svc and
// sends it.
static __always_inline int tunnel_send(struct xdp_md *ctx, struct packet *p, struct service *svc,
				       struct backend *be, __u32 id)
{
	struct next_hop hop = {};
	__u32 outer_len, tot_len, hash;
	int action, delta;
	void *data, *data_end;
	struct ethhdr *eth;

	outer_len = be->family == FAMILY_IPV4 ? sizeof(struct iphdr) : sizeof(struct ipv6hdr);
	tot_len = p->l3_len + outer_len;
	action = tunnel_hop(ctx, p, be, tot_len, outer_len, &hop);
	if (action != CONTINUE)
		return action;
	count(&service_stats, svc->id, p->len);
	count(&backend_stats, id, p->len);
	hash = entropy_hash(&p->flow);

	// Room for the outer header between the Ethernet header and the client's packet
	// (a VLAN tag, if there was one, is not carried over).
	delta = (int)(sizeof(struct ethhdr) + outer_len) - (int)(p->l3_off & 0x7f);
	if (bpf_xdp_adjust_head(ctx, -delta))
		return verdict(XDP_DROP, STAT_DROP_NO_ROUTE, p->len);
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	if ((void *)(eth + 1) > data_end)
		return XDP_ABORTED;
	if (!hop.ifindex) {
		// No neighbour yet: the kernel sends it and resolves one for the next packet,
		// so the frame must look addressed to us, as it was. The old MACs are delta
		// bytes on (at least 16: no overlap), until the outer header covers them.
		__u8 *old = data + (delta & 0x3f);

		if ((void *)(old + 2 * ETH_ALEN) > data_end)
			return XDP_ABORTED;
		__builtin_memcpy(eth->h_dest, old, 2 * ETH_ALEN);
	}

	if (be->family == FAMILY_IPV4) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > data_end)
			return XDP_ABORTED;
		eth->h_proto = bpf_htons(ETH_P_IP);
		*(__u16 *)ip = bpf_htons(0x4500);
		ip->tot_len = bpf_htons(tot_len);
		ip->id = (__u16)hash;
		ip->frag_off = bpf_htons(IP_DF);
		ip->ttl = 64;
		ip->protocol = p->flow.family == FAMILY_IPV4 ? IPPROTO_IPIP_ : IPPROTO_IPV6_;
		ip->check = 0;
		ip->saddr = nat_addr4;
		ip->daddr = be->addr[0];
		ip->check = ipv4_header_checksum(ip);
	} else {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > data_end)
			return XDP_ABORTED;
		eth->h_proto = bpf_htons(ETH_P_IPV6);
		// Version 6, and the flow hash in the flow label: entropy for the backend's RSS.
		*(__be32 *)ip6 = bpf_htonl(0x60000000 | (hash & 0xfffff));
		ip6->payload_len = bpf_htons(p->l3_len);
		ip6->nexthdr = p->flow.family == FAMILY_IPV4 ? IPPROTO_IPIP_ : IPPROTO_IPV6_;
		__be32 src[4];

		ip6->hop_limit = 64;
		nat_source(FAMILY_IPV6, src);
		__builtin_memcpy(&ip6->saddr, src, 16);
		__builtin_memcpy(&ip6->daddr, be->addr, 16);
	}
	if (!hop.ifindex)
		return verdict(XDP_PASS, STAT_PASS_NO_NEIGH, p->len);
	return send_to(ctx, p, &hop);
}

// tunnel_forward handles a packet to a tunnel-mode service.
static __always_inline int tunnel_forward(struct xdp_md *ctx, struct packet *p, struct service *svc)
{
	struct backend *be;
	__u32 id;
	int action;

	action = select_backend(p, svc, &be, &id);
	if (action != CONTINUE)
		return action;
	return tunnel_send(ctx, p, svc, be, id);
}
