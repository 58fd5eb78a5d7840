//go:build ignore

// decap.c: weir's decapsulation program for tunnel-mode backends on hosts whose kernel
// has no ipip/ip6tnl module. IPIP, IPv6-in-IPv4, IP6IP6 and IPv4-in-IPv6 packets whose
// outer destination is one of this host's addresses (decap_addrs) lose their outer
// header and go up the stack as the client sent them; everything else passes
// untouched.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

#define FAMILY_IPV4 2
#define FAMILY_IPV6 10

#ifndef MAX_DECAP_ADDRS
#define MAX_DECAP_ADDRS 64 // addresses of this host tunnel packets may be sent to
#endif

// Key of decap_addrs: an address of this host (network byte order, IPv4 in word 0).
struct decap_key {
	__be32 addr[4];
	__u32 family;
};

enum decap_reason {
	DECAP_OK = 0,     // outer header removed, inner packet passed up
	DECAP_NOT_OURS,   // not a tunnel packet to one of our addresses: passed untouched
	DECAP_MALFORMED,  // a tunnel packet to us whose inner header is cut short: dropped
	DECAP_MAX,
};

struct decap_counter {
	__u64 packets;
	__u64 bytes;
};

// This host's addresses that tunnel packets may be sent to; the value is unused.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_DECAP_ADDRS);
	__type(key, struct decap_key);
	__type(value, __u8);
} decap_addrs SEC(".maps");

// enum decap_reason -> packets and bytes, per CPU.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DECAP_MAX);
	__type(key, enum decap_reason);
	__type(value, struct decap_counter);
} decap_stats SEC(".maps");

static __always_inline int done(int action, enum decap_reason reason, __u32 bytes)
{
	__u32 key = reason;
	struct decap_counter *c = bpf_map_lookup_elem(&decap_stats, &key);

	if (c) {
		c->packets++;
		c->bytes += bytes;
	}
	return action;
}

SEC("xdp")
int weir_decap(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data, saved;
	struct decap_key key = {};
	__u32 len = data_end - data, outer_len;
	__u8 inner;

	if ((void *)(eth + 1) > data_end)
		return done(XDP_PASS, DECAP_NOT_OURS, len);
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > data_end || ip->ihl != 5 ||
		    (ip->protocol != IPPROTO_IPIP && ip->protocol != IPPROTO_IPV6) ||
		    (ip->frag_off & bpf_htons(0x3fff)))
			return done(XDP_PASS, DECAP_NOT_OURS, len);
		key.addr[0] = ip->daddr;
		key.family = FAMILY_IPV4;
		inner = ip->protocol;
		outer_len = sizeof(*ip);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > data_end || (ip6->nexthdr != IPPROTO_IPIP && ip6->nexthdr != IPPROTO_IPV6))
			return done(XDP_PASS, DECAP_NOT_OURS, len);
		__builtin_memcpy(key.addr, &ip6->daddr, 16);
		key.family = FAMILY_IPV6;
		inner = ip6->nexthdr;
		outer_len = sizeof(*ip6);
	} else {
		return done(XDP_PASS, DECAP_NOT_OURS, len);
	}
	if (!bpf_map_lookup_elem(&decap_addrs, &key))
		return done(XDP_PASS, DECAP_NOT_OURS, len);
	// The inner header must be there, or the stack would get a stub.
	if (data + sizeof(*eth) + outer_len + (inner == IPPROTO_IPIP ? sizeof(struct iphdr) : sizeof(struct ipv6hdr)) > data_end)
		return done(XDP_DROP, DECAP_MALFORMED, len);

	saved = *eth;
	saved.h_proto = bpf_htons(inner == IPPROTO_IPIP ? ETH_P_IP : ETH_P_IPV6);
	if (bpf_xdp_adjust_head(ctx, outer_len))
		return done(XDP_DROP, DECAP_MALFORMED, len);
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	if ((void *)(eth + 1) > data_end)
		return XDP_ABORTED;
	*eth = saved;
	return done(XDP_PASS, DECAP_OK, len);
}
