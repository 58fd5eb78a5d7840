// toobig.h: the ICMP error weir makes itself, for a client's packet too big for the
// path to its backend (nat: the route's MTU; tunnel: what the route leaves once the
// outer header is added): "fragmentation needed" or "packet too big", from the VIP,
// sent back the way the packet came, so the client lowers its path MTU.
#pragma once

#include "csum.h"
#include "parse.h"

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
// fragment) or "packet too big" (IPv6), quoting the packet's headers, from the VIP,
// and counts it under sent. p is the client's packet as it came (nat: before the
// rewrite). mtu is the largest such packet the path carries. The frame keeps its
// Ethernet header, VLAN tag included, so the reply takes the way the packet came.
static __always_inline int icmp_too_big(struct xdp_md *ctx, struct packet *p, __u32 mtu,
					enum stat_reason sent)
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
	return verdict(XDP_TX, sent, p->len);
}

