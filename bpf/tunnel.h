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
#define IP_DF 0x4000

// ipv4_header_checksum computes a fresh checksum of a 20-byte header whose check
// field is zero.
static __always_inline __u16 ipv4_header_checksum(struct iphdr *ip)
{
	__u16 *w = (__u16 *)ip;
	__u32 sum = 0;

#pragma unroll
	for (int i = 0; i < 10; i++)
		sum += w[i];
	return csum_finish(sum);
}

// icmp_too_big turns the frame into an ICMP error back to the client: "fragmentation
// needed" (IPv4, only for packets with DF set; others are dropped, since XDP cannot
// fragment) or "packet too big" (IPv6), quoting the packet's headers, from the VIP.
// mtu is the largest inner packet the tunnel carries. The frame keeps its Ethernet
// header, VLAN tag included, so the reply takes the way the packet came.
static __always_inline int icmp_too_big(struct xdp_md *ctx, struct packet *p, __u32 mtu)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u8 client_mac[ETH_ALEN], our_mac[ETH_ALEN];
	struct ethhdr *eth = data;
	// Masked (values unchanged: parse bounds them) so the verifier keeps a bound on
	// offsets clang reloads from the stack (Linux 6.18, clang 19; see icmp.h).
	__u32 l3 = p->l3_off & 0x1f, l4 = p->l4_off & 0x3ff;
	int v4 = p->flow.family == FAMILY_IPV4;
	int tagged = l3 == sizeof(struct ethhdr) + sizeof(struct vlan_hdr);
	__u32 ip_len = v4 ? sizeof(struct iphdr) : sizeof(struct ipv6hdr);
	__be16 tci = 0, ethertype = bpf_htons(v4 ? ETH_P_IP : ETH_P_IPV6);
	__u32 quote, frame_len;
	__u32 sum = 0;
	void *ip_start, *icmp_start;

	if ((void *)(eth + 1) > data_end || l3 > MAX_L3_OFFSET || l4 > MAX_L4_OFFSET)
		return verdict(XDP_DROP, STAT_DROP_TOO_BIG, p->len);
	if (v4) {
		struct iphdr *ip = data + l3;

		if ((void *)(ip + 1) > data_end || !(ip->frag_off & bpf_htons(IP_DF)))
			return verdict(XDP_DROP, STAT_DROP_TOO_BIG, p->len);
	}
	if (tagged) {
		struct vlan_hdr *vlan = (void *)(eth + 1);

		if ((void *)(vlan + 1) > data_end)
			return verdict(XDP_DROP, STAT_DROP_TOO_BIG, p->len);
		tci = vlan->tci;
	}
	__builtin_memcpy(client_mac, eth->h_source, ETH_ALEN);
	__builtin_memcpy(our_mac, eth->h_dest, ETH_ALEN);
	// RFC 8201: IPv6 never goes below 1280; a path to the backends narrower than
	// 1280 + the outer header leaves such packets undeliverable (see README).
	if (!v4 && mtu < 1280)
		mtu = 1280;

	// Quote the IP header(s) and 8 bytes of TCP/UDP: enough for the client's stack
	// to find its socket.
	quote = l4 - l3 + 8;
	if (quote > MAX_ICMP_QUOTE || l3 + quote > p->len)
		return verdict(XDP_DROP, STAT_DROP_TOO_BIG, p->len);
	// Room for the new IP and ICMP headers in front of the offending IP header; the
	// Ethernet header (and tag) is written anew at the front. Then cut the tail.
	if (bpf_xdp_adjust_head(ctx, -(int)(ip_len + sizeof(struct icmp_hdr))))
		return verdict(XDP_DROP, STAT_DROP_TOO_BIG, p->len);
	{
		void *start = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
		long span = end - start;

		// Keep clang from folding the length into 32-bit pointer arithmetic,
		// which the verifier rejects (clang 19, Linux 6.18).
		asm volatile("" : "+r"(span));
		frame_len = span;
	}
	if (bpf_xdp_adjust_tail(ctx, (int)(l3 + ip_len + sizeof(struct icmp_hdr) + quote) - (int)frame_len))
		return verdict(XDP_DROP, STAT_DROP_TOO_BIG, p->len);

	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	if ((void *)(eth + 1) > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(eth->h_dest, client_mac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, our_mac, ETH_ALEN);
	if (tagged) {
		struct vlan_hdr *vlan = (void *)(eth + 1);

		if ((void *)(vlan + 1) > data_end)
			return XDP_ABORTED;
		eth->h_proto = ETH_P_8021Q_BE;
		vlan->tci = tci;
		vlan->proto = ethertype;
	} else {
		eth->h_proto = ethertype;
	}
	ip_start = data + l3;
	icmp_start = ip_start + ip_len;

	if (v4) {
		struct iphdr *ip = ip_start;
		struct icmp_hdr *icmp = (void *)(ip + 1);

		if ((void *)(icmp + 1) > data_end)
			return XDP_ABORTED;
		*(__u16 *)ip = bpf_htons(0x4500);
		ip->tot_len = bpf_htons(sizeof(*ip) + sizeof(*icmp) + quote);
		ip->id = 0;
		ip->frag_off = 0;
		ip->ttl = 64;
		ip->protocol = IPPROTO_ICMP;
		ip->check = 0;
		ip->saddr = p->flow.dst[0];
		ip->daddr = p->flow.src[0];
		ip->check = ipv4_header_checksum(ip);
		icmp->type = 3; // destination unreachable
		icmp->code = 4; // fragmentation needed
		icmp->check = 0;
		icmp->rest = bpf_htonl(mtu & 0xffff);
	} else {
		struct ipv6hdr *ip6 = ip_start;
		struct icmp_hdr *icmp = (void *)(ip6 + 1);
		__u32 plen = sizeof(*icmp) + quote;

		if ((void *)(icmp + 1) > data_end)
			return XDP_ABORTED;
		*(__be32 *)ip6 = bpf_htonl(0x60000000);
		ip6->payload_len = bpf_htons(plen);
		ip6->nexthdr = IPPROTO_ICMPV6;
		ip6->hop_limit = 64;
		__builtin_memcpy(&ip6->saddr, p->flow.dst, 16);
		__builtin_memcpy(&ip6->daddr, p->flow.src, 16);
		icmp->type = 2; // packet too big
		icmp->code = 0;
		icmp->check = 0;
		icmp->rest = bpf_htonl(mtu);
		// ICMPv6's pseudo-header: addresses, length, next header.
		for (int i = 0; i < 4; i++) {
			sum += (p->flow.src[i] & 0xffff) + (p->flow.src[i] >> 16);
			sum += (p->flow.dst[i] & 0xffff) + (p->flow.dst[i] >> 16);
		}
		sum += bpf_htons(plen) + bpf_htons(IPPROTO_ICMPV6);
	}

	// The ICMP checksum over its header and the quote, a 16-bit word at a time.
	{
		__u16 *w = icmp_start;
		struct icmp_hdr *icmp = icmp_start;

		for (int i = 0; i < (sizeof(struct icmp_hdr) + MAX_ICMP_QUOTE) / 2; i++) {
			if ((void *)(w + i + 1) > data_end)
				break;
			sum += w[i];
		}
		if ((void *)(icmp + 1) > data_end)
			return XDP_ABORTED;
		icmp->check = csum_finish(sum);
	}
	return verdict(XDP_TX, STAT_TUNNEL_TOO_BIG, p->len);
}

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
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return icmp_too_big(ctx, p, fib.mtu_result > outer_len ? fib.mtu_result - outer_len : 0);
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

// tunnel_forward handles a packet to a tunnel-mode service.
static __always_inline int tunnel_forward(struct xdp_md *ctx, struct packet *p, struct service *svc)
{
	struct next_hop hop = {};
	struct backend *be;
	__u32 id, outer_len, tot_len, hash;
	int action, delta;
	void *data, *data_end;
	struct ethhdr *eth;

	action = select_backend(p, svc, &be, &id);
	if (action != CONTINUE)
		return action;
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
