//go:build ignore

// decap.c: weir's decapsulation program for tunnel-mode backends on hosts whose kernel
// has no ipip/ip6tnl module. IPIP, IPv6-in-IPv4, IP6IP6 and IPv4-in-IPv6 packets whose
// outer destination is one of this host's addresses (decap_addrs) lose their outer
// header and go up the stack as the client sent them; everything else passes
// untouched. A tunnel packet to us from outside the balancers' prefixes
// (decap_sources, any source unless the loader is told them) is dropped, as is one
// whose headers or lengths do not hold together: its inner packet would otherwise
// reach the stack cut short or with bytes from outside the tunnel packet.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "csum.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

#define FAMILY_IPV4 2
#define FAMILY_IPV6 10

#ifndef MAX_DECAP_ADDRS
#define MAX_DECAP_ADDRS 64 // addresses of this host tunnel packets may be sent to
#endif
#ifndef MAX_DECAP_SOURCES
#define MAX_DECAP_SOURCES 64 // prefixes tunnel packets may come from
#endif

// Key of decap_addrs: an address of this host (network byte order, IPv4 in word 0).
struct decap_key {
	__be32 addr[4];
	__u32 family;
};

// Key of decap_sources, an LPM trie: prefixlen counts the bits of family (all 32 of
// them) and then of addr (network byte order, IPv4 in word 0).
struct decap_source {
	__u32 prefixlen;
	__u32 family;
	__be32 addr[4];
};

enum decap_reason {
	DECAP_OK = 0,     // outer header removed, inner packet passed up
	DECAP_NOT_OURS,   // not a tunnel packet to one of our addresses: passed untouched
	DECAP_MALFORMED,  // a tunnel packet to us with a broken outer header (version,
			  // IPv4 checksum, length past the frame) or an inner packet that is
			  // cut short, of the wrong version or not exactly the outer payload:
			  // dropped
	DECAP_FOREIGN,    // a tunnel packet to us from outside decap_sources: dropped
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

// The prefixes of the balancers tunnel packets may come from; the value is unused.
// The loader holds 0.0.0.0/0 and ::/0 here when it is given none: any source.
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, MAX_DECAP_SOURCES);
	__uint(map_flags, BPF_F_NO_PREALLOC); // LPM tries must not be preallocated
	__type(key, struct decap_source);
	__type(value, __u8);
} decap_sources SEC(".maps");

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

// outer_ok says whether a tunnel packet's outer header, of outer_len bytes with
// tot_len the length it claims and avail bytes of frame from its start, holds
// together: its version, for IPv4 its checksum (the kernel checks both before its own
// tunnel sees the packet), and its length within the frame (what lies past it is
// padding, no part of the packet).
static __always_inline int outer_ok(void *outer, __u32 outer_len, __u32 tot_len, __u32 avail)
{
	if (tot_len > avail || tot_len < outer_len)
		return 0;
	if (outer_len == sizeof(struct iphdr)) {
		struct iphdr *ip = outer;

		return ip->version == 4 && csum_finish(bpf_csum_diff(0, 0, (__be32 *)ip, sizeof(*ip), 0)) == 0;
	}
	return ((struct ipv6hdr *)outer)->version == 6;
}

// inner_ok says whether the inner packet (IPPROTO_IPIP: IPv4, else IPv6) at inner,
// with payload bytes after the outer header, is of its protocol's version and exactly
// that long by its own header, as weir's tunnel sends it. One longer would take bytes
// from outside the tunnel packet (padding, or what a shorter outer length left out),
// and so would an inner IPv4 header longer than the payload, though the frame's
// padding holds it and its length field says the payload's.
static __always_inline int inner_ok(void *inner, __u8 proto, __u32 payload, void *data_end)
{
	if (proto == IPPROTO_IPIP) {
		struct iphdr *ip = inner;

		if ((void *)(ip + 1) > data_end || payload < sizeof(*ip))
			return 0;
		return ip->version == 4 && bpf_ntohs(ip->tot_len) == payload;
	}
	struct ipv6hdr *ip6 = inner;

	if ((void *)(ip6 + 1) > data_end)
		return 0;
	return ip6->version == 6 && sizeof(*ip6) + bpf_ntohs(ip6->payload_len) == payload;
}

SEC("xdp")
int weir_decap(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data, saved;
	struct decap_key key = {};
	struct decap_source src = {};
	__u32 len = data_end - data, outer_len, tot_len;
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
		src.addr[0] = ip->saddr;
		inner = ip->protocol;
		outer_len = sizeof(*ip);
		tot_len = bpf_ntohs(ip->tot_len);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > data_end || (ip6->nexthdr != IPPROTO_IPIP && ip6->nexthdr != IPPROTO_IPV6))
			return done(XDP_PASS, DECAP_NOT_OURS, len);
		__builtin_memcpy(key.addr, &ip6->daddr, 16);
		key.family = FAMILY_IPV6;
		__builtin_memcpy(src.addr, &ip6->saddr, 16);
		inner = ip6->nexthdr;
		outer_len = sizeof(*ip6);
		tot_len = sizeof(*ip6) + bpf_ntohs(ip6->payload_len);
	} else {
		return done(XDP_PASS, DECAP_NOT_OURS, len);
	}
	if (!bpf_map_lookup_elem(&decap_addrs, &key))
		return done(XDP_PASS, DECAP_NOT_OURS, len);
	// Only balancers may put packets into our stack with any source address they like.
	src.prefixlen = 32 + 128;
	src.family = key.family;
	if (!bpf_map_lookup_elem(&decap_sources, &src))
		return done(XDP_DROP, DECAP_FOREIGN, len);
	// A tunnel packet to us from here on: one that does not hold together is dropped,
	// or the stack would get a stub, or an inner packet with bytes not sent in it.
	if (!outer_ok(eth + 1, outer_len, tot_len, len - sizeof(*eth)) ||
	    !inner_ok((void *)(eth + 1) + outer_len, inner, tot_len - outer_len, data_end))
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
