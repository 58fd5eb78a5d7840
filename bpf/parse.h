// parse.h: reads Ethernet (one optional 802.1Q tag), IPv4 or IPv6 and the TCP or UDP
// ports into struct packet, and decides what happens to what it cannot read.
//
// The rule for malformed input: a packet whose IP header is truncated or inconsistent,
// or that came in a frame to a group MAC, is passed untouched (the kernel judges it);
// a packet to a VIP address that cannot be balanced (fragment, truncated or
// inconsistent L4 header: a TCP data offset or UDP length short of the header or past
// the IP packet; unwalkable IPv6 extension chain, or a routing header with segments
// left) is dropped and counted; anything else not to a service is passed untouched.
// Nothing that fails a check is ever forwarded.
#pragma once

#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>

#include "stats.h"

// CONTINUE is what a step returns when it has no verdict and the pipeline goes on.
#define CONTINUE -1

#define ETH_P_8021Q_BE bpf_htons(ETH_P_8021Q)
#define IP_MF 0x2000
#define IP_OFFSET 0x1fff

#define TCP_FLAG_FIN 0x01
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04
#define TCP_FLAG_ACK 0x10

struct vlan_hdr {
	__be16 tci;
	__be16 proto;
};

struct packet {
	struct flow_key flow;
	__u32 len;       // bytes of the frame, for counters
	__u16 l3_off;    // offset of the IP header in the frame
	__u16 l4_off;    // offset of the TCP/UDP header in the frame
	__u16 l3_len;    // the IP packet's length as its header says (frames may be padded)
	__u8 tcp_flags;  // flags byte of the TCP header; 0 for UDP
	__u8 icmp_error; // an ICMP/ICMPv6 error; l4_off points at its header
	__be32 tcp_seq;  // the TCP sequence and acknowledgement numbers; 0 for UDP
	__be32 tcp_ack;
	__be16 vlan_tci; // the 802.1Q tag's TCI as it came (network order); 0: untagged
};

// The first 8 bytes of every ICMP and ICMPv6 message.
struct icmp_hdr {
	__u8 type;
	__u8 code;
	__be16 check;
	__be32 rest; // unused, pointer, or the next-hop MTU
};

// icmp_is_error: destination unreachable (fragmentation needed among its codes), time
// exceeded and parameter problem for ICMP; destination unreachable, packet too big,
// time exceeded and parameter problem for ICMPv6. They quote the packet that caused
// them, and its sender's stack hands them to the quoted socket (RFC 1122 3.2.2.5:
// a parameter problem MUST be passed to the transport layer). A parameter
// problem's pointer counts bytes of the quote, whose headers keep their lengths
// when translated, so it stays right. Source quench (deprecated, RFC 6633) and
// redirect (about routes, not flows) are no errors here.
static __always_inline int icmp_is_error(__u8 family, __u8 type)
{
	if (family == FAMILY_IPV4)
		return type == 3 || type == 11 || type == 12;
	return type == 1 || type == 2 || type == 3 || type == 4;
}

// vip_address_verdict decides for a packet that cannot be balanced: dropped if its
// destination is a VIP address, passed otherwise.
static __always_inline int vip_address_verdict(struct packet *p, enum stat_reason drop_reason)
{
	struct vip_key key = {};

	__builtin_memcpy(key.addr, p->flow.dst, sizeof(key.addr));
	key.family = p->flow.family;
	if (bpf_map_lookup_elem(&services, &key))
		return verdict(XDP_DROP, drop_reason, p->len);
	return verdict(XDP_PASS, STAT_PASS_NOT_VIP_L4, p->len);
}

// within_ip says whether len bytes at off lie inside the IP packet: Ethernet padding
// after it must not pass for a header.
static __always_inline int within_ip(struct packet *p, __u32 off, __u32 len)
{
	return off + len <= (__u32)p->l3_off + p->l3_len;
}

static __always_inline int parse_l4(void *data, void *data_end, __u32 off, struct packet *p)
{
	p->l4_off = off;
	if (p->flow.proto == IPPROTO_TCP) {
		struct tcphdr *tcp = data + off;

		// A data offset below the header's 5 words, or past the IP packet, is no
		// TCP header the backend would take either.
		if ((void *)(tcp + 1) > data_end || !within_ip(p, off, sizeof(*tcp)) || tcp->doff < 5 ||
		    !within_ip(p, off, tcp->doff * 4))
			return vip_address_verdict(p, STAT_DROP_MALFORMED_L4);
		p->flow.sport = tcp->source;
		p->flow.dport = tcp->dest;
		// Byte 13 of the TCP header holds the flags.
		p->tcp_flags = ((__u8 *)tcp)[13];
		p->tcp_seq = tcp->seq;
		p->tcp_ack = tcp->ack_seq;
		return CONTINUE;
	}
	if (p->flow.proto == IPPROTO_UDP) {
		struct udphdr *udp = data + off;

		// A length below the header's 8 bytes or past the IP packet: the same.
		if ((void *)(udp + 1) > data_end || !within_ip(p, off, sizeof(*udp)) ||
		    bpf_ntohs(udp->len) < sizeof(*udp) || !within_ip(p, off, bpf_ntohs(udp->len)))
			return vip_address_verdict(p, STAT_DROP_MALFORMED_L4);
		p->flow.sport = udp->source;
		p->flow.dport = udp->dest;
		return CONTINUE;
	}
	if ((p->flow.family == FAMILY_IPV4 && p->flow.proto == IPPROTO_ICMP) ||
	    (p->flow.family == FAMILY_IPV6 && p->flow.proto == IPPROTO_ICMPV6)) {
		struct icmp_hdr *icmp = data + off;

		if ((void *)(icmp + 1) <= data_end && within_ip(p, off, sizeof(*icmp)) &&
		    icmp_is_error(p->flow.family, icmp->type)) {
			p->icmp_error = 1;
			return CONTINUE;
		}
	}
	// Other ICMP and every other protocol: not balanced by this program.
	return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
}

static __always_inline int parse_ipv4(void *data, void *data_end, __u32 off, struct packet *p)
{
	struct iphdr *ip = data + off;
	__u32 ihl_bytes;

	if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl < 5)
		return verdict(XDP_PASS, STAT_PASS_MALFORMED_L3, p->len);
	ihl_bytes = ip->ihl * 4;
	if (bpf_ntohs(ip->tot_len) < ihl_bytes || data + off + bpf_ntohs(ip->tot_len) > data_end)
		return verdict(XDP_PASS, STAT_PASS_MALFORMED_L3, p->len);

	p->flow.family = FAMILY_IPV4;
	p->l3_len = bpf_ntohs(ip->tot_len);
	p->flow.proto = ip->protocol;
	p->flow.src[0] = ip->saddr;
	p->flow.dst[0] = ip->daddr;
	if (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET))
		return vip_address_verdict(p, STAT_DROP_FRAGMENT);
	// Options are skipped by the header length; the backend's stack reads them.
	return parse_l4(data, data_end, off + ihl_bytes, p);
}

// ipv6_skip_ext walks the hop-by-hop, routing and destination-options headers (at
// most MAX_IPV6_EXT_HDRS) from *off, the first of type next, and leaves *off at the
// header after them. It returns that header's type, or -1 when one is cut off by the
// frame's end. It stops at a routing header with segments left, and returns its
// type: the packet's destination address is a waypoint, not where it is going, nor
// the address its TCP/UDP checksum covers (RFC 8200 4.4, 8.1), so it is no flow's
// packet to a VIP.
static __always_inline int ipv6_skip_ext(void *data, void *data_end, __u32 *off, __u8 next)
{
#pragma unroll
	for (int i = 0; i < MAX_IPV6_EXT_HDRS; i++) {
		struct ipv6_opt_hdr *ext;

		if (next != IPPROTO_HOPOPTS && next != IPPROTO_ROUTING && next != IPPROTO_DSTOPTS)
			break;
		ext = data + *off;
		if ((void *)(ext + 1) > data_end)
			return -1;
		if (next == IPPROTO_ROUTING) {
			struct ipv6_rt_hdr *rt = (void *)ext;

			if ((void *)(rt + 1) > data_end)
				return -1;
			if (rt->segments_left)
				break;
		}
		next = ext->nexthdr;
		*off += (ext->hdrlen + 1) * 8;
	}
	return next;
}

static __always_inline int parse_ipv6(void *data, void *data_end, __u32 off, struct packet *p)
{
	struct ipv6hdr *ip6 = data + off;
	int next;

	if ((void *)(ip6 + 1) > data_end || ip6->version != 6)
		return verdict(XDP_PASS, STAT_PASS_MALFORMED_L3, p->len);
	if (data + off + sizeof(*ip6) + bpf_ntohs(ip6->payload_len) > data_end)
		return verdict(XDP_PASS, STAT_PASS_MALFORMED_L3, p->len);

	p->flow.family = FAMILY_IPV6;
	p->l3_len = sizeof(*ip6) + bpf_ntohs(ip6->payload_len);
	__builtin_memcpy(p->flow.src, &ip6->saddr, sizeof(p->flow.src));
	__builtin_memcpy(p->flow.dst, &ip6->daddr, sizeof(p->flow.dst));
	off += sizeof(*ip6);

	// The ports follow the hop-by-hop, routing and destination options headers.
	next = ipv6_skip_ext(data, data_end, &off, ip6->nexthdr);
	if (next < 0)
		return vip_address_verdict(p, STAT_DROP_MALFORMED_L4);
	p->flow.proto = next;
	// Headers this long are legal, but the rewriting steps bound their offsets.
	if (off > MAX_L4_OFFSET)
		return vip_address_verdict(p, STAT_DROP_IPV6_EXT);
	if (next == IPPROTO_FRAGMENT)
		return vip_address_verdict(p, STAT_DROP_FRAGMENT);
	// Past the headers walked, a routing header with segments left, AH or ESP.
	if (next == IPPROTO_HOPOPTS || next == IPPROTO_ROUTING || next == IPPROTO_DSTOPTS ||
	    next == IPPROTO_AH || next == IPPROTO_ESP)
		return vip_address_verdict(p, STAT_DROP_IPV6_EXT);
	return parse_l4(data, data_end, off, p);
}

// parse fills p from the frame or returns a verdict.
static __always_inline int parse(struct xdp_md *ctx, struct packet *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	__u32 off = sizeof(*eth);
	__be16 proto;

	p->len = data_end - data;
	if ((void *)(eth + 1) > data_end)
		return verdict(XDP_PASS, STAT_PASS_NOT_IP, p->len);
	proto = eth->h_proto;
	if (proto == ETH_P_8021Q_BE) {
		struct vlan_hdr *vlan = data + off;

		if ((void *)(vlan + 1) > data_end)
			return verdict(XDP_PASS, STAT_PASS_NOT_IP, p->len);
		proto = vlan->proto;
		p->vlan_tci = vlan->tci;
		off += sizeof(*vlan);
	}
	p->l3_off = off;
	// A frame to a group MAC (broadcast, multicast: the I/G bit) was not sent to this
	// host alone: every host that took it would balance it, and its destination MAC,
	// which dsr sends from and nat answers from, is no source MAC. The kernel judges it.
	// The check is made in each family's branch: made once before them, the compiled
	// program cost the verifier (Linux 6.18) about 115,000 instructions more, 55-64%
	// of its limit instead of 45-54% (TestVerifierHeadroom).
	if (proto == bpf_htons(ETH_P_IP)) {
		if (eth->h_dest[0] & 1)
			return verdict(XDP_PASS, STAT_PASS_L2_GROUP, p->len);
		return parse_ipv4(data, data_end, off, p);
	}
	if (proto == bpf_htons(ETH_P_IPV6)) {
		if (eth->h_dest[0] & 1)
			return verdict(XDP_PASS, STAT_PASS_L2_GROUP, p->len);
		return parse_ipv6(data, data_end, off, p);
	}
	// ARP, LLDP, a second VLAN tag (QinQ), ...
	return verdict(XDP_PASS, STAT_PASS_NOT_IP, p->len);
}
