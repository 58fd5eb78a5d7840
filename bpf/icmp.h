// icmp.h: ICMP and ICMPv6 errors that quote a nat flow are translated like the flow,
// so path-MTU discovery and "port unreachable" work through the balancer. An error
// from the backend's side comes to the nat address and quotes the packet we sent the
// backend; one from the client's side comes to the VIP and quotes our reply. The
// flow is the quoted packet reversed. An error from the client's side about a dsr or
// tunnel flow goes to the flow's backend unchanged (icmp_to_lb_backend). Either way
// the error's ICMP checksum, and a quoted IPv4 header's own when it has no options,
// must hold first (icmp_checksum_verdict). Anything else is passed untouched.
#pragma once

#include "dsr.h"
#include "nat.h"
#include "tunnel.h"

struct icmp_rewrite {
	__be32 outer_src[4], outer_dst[4]; // new outer addresses
	__be32 inner_src[4], inner_dst[4]; // new addresses of the quoted packet
	__be16 inner_sport, inner_dport;   // and its new ports
};

// icmp_apply writes the new outer and quoted headers; flow is the quoted packet
// reversed (so its dst is the quote's source). The ICMP checksum covers the quoted
// bytes (and, for ICMPv6, a pseudo-header of the outer addresses), so every change
// there is added to it as well.
static __always_inline int icmp_apply(struct xdp_md *ctx, struct packet *p, const struct flow_key *flow,
				      __u32 in3, __u32 in4, const struct icmp_rewrite *rw)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	int v4 = p->flow.family == FAMILY_IPV4;
	int words = v4 ? 1 : 4;
	struct icmp_hdr *icmp;
	__be16 *ports;
	__u16 *l4check = 0;
	__u32 isum, s;

	__u32 l3 = p->l3_off, l4 = p->l4_off;

	if (l3 > MAX_L3_OFFSET || l4 > MAX_L4_OFFSET || in4 > MAX_L4_OFFSET + 48)
		return XDP_ABORTED;
	// The masks change no value (the checks above bound them) but give the verifier a
	// bound that survives the compiler reloading the offsets from the stack; without
	// them 6.18 rejects the header pointers as possibly beyond 64 KiB.
	l3 &= 0x7f;
	l4 &= 0x3ff;
	in3 &= 0x3ff;
	in4 &= 0x7ff;
	icmp = data + l4;
	if ((void *)(icmp + 1) > data_end)
		return XDP_ABORTED;
	isum = csum_start(icmp->check);

	// The quoted TCP or UDP checksum, when the quote reaches it: inside the error's IP
	// packet, as its length says (a quote of 8 bytes past the IP header, RFC 792's
	// least, ends before a TCP checksum, and a trailer in the frame there is no part
	// of it, nor covered by the ICMP checksum).
	if (flow->proto == IPPROTO_TCP) {
		if (data + in4 + 18 <= data_end && within_ip(p, in4, 18))
			l4check = data + in4 + 16;
	} else if (data + in4 + 8 <= data_end && within_ip(p, in4, 8)) {
		l4check = data + in4 + 6;
	}
	// A quoted UDP checksum of zero stays zero, as nat_rewrite leaves it.
	if (l4check && !(flow->proto == IPPROTO_UDP && *l4check == 0)) {
		__u16 old = *l4check, fresh;

		s = csum_start(old);
		for (int i = 0; i < 4; i++) {
			if (i >= words)
				break;
			s = csum_add32(s, flow->dst[i], rw->inner_src[i]);
			s = csum_add32(s, flow->src[i], rw->inner_dst[i]);
		}
		s = csum_add16(s, flow->dport, rw->inner_sport);
		s = csum_add16(s, flow->sport, rw->inner_dport);
		fresh = csum_finish(s);
		if (flow->proto == IPPROTO_UDP && fresh == 0)
			fresh = 0xffff;
		*l4check = fresh;
		isum = csum_add16(isum, old, fresh);
	}

	ports = data + in4;
	if ((void *)(ports + 2) > data_end)
		return XDP_ABORTED;
	isum = csum_add16(isum, ports[0], rw->inner_sport);
	isum = csum_add16(isum, ports[1], rw->inner_dport);
	ports[0] = rw->inner_sport;
	ports[1] = rw->inner_dport;

	if (v4) {
		struct iphdr *iip = data + in3;
		__u16 old;

		if ((void *)(iip + 1) > data_end)
			return XDP_ABORTED;
		old = iip->check;
		s = csum_start(old);
		s = csum_add32(s, iip->saddr, rw->inner_src[0]);
		s = csum_add32(s, iip->daddr, rw->inner_dst[0]);
		iip->check = csum_finish(s);
		isum = csum_add16(isum, old, iip->check);
		isum = csum_add32(isum, iip->saddr, rw->inner_src[0]);
		isum = csum_add32(isum, iip->daddr, rw->inner_dst[0]);
		iip->saddr = rw->inner_src[0];
		iip->daddr = rw->inner_dst[0];
	} else {
		struct ipv6hdr *iip6 = data + in3;

		if ((void *)(iip6 + 1) > data_end)
			return XDP_ABORTED;
		for (int i = 0; i < 4; i++) {
			isum = csum_add32(isum, flow->dst[i], rw->inner_src[i]);
			isum = csum_add32(isum, flow->src[i], rw->inner_dst[i]);
			// ICMPv6's pseudo-header holds the outer addresses.
			isum = csum_add32(isum, p->flow.src[i], rw->outer_src[i]);
			isum = csum_add32(isum, p->flow.dst[i], rw->outer_dst[i]);
		}
		__builtin_memcpy(&iip6->saddr, rw->inner_src, 16);
		__builtin_memcpy(&iip6->daddr, rw->inner_dst, 16);
	}
	icmp->check = csum_finish(isum);

	if (v4) {
		struct iphdr *ip = data + l3;

		if ((void *)(ip + 1) > data_end)
			return XDP_ABORTED;
		s = csum_start(ip->check);
		s = csum_add32(s, ip->saddr, rw->outer_src[0]);
		s = csum_add32(s, ip->daddr, rw->outer_dst[0]);
		ip->check = csum_finish(s);
		ip->saddr = rw->outer_src[0];
		ip->daddr = rw->outer_dst[0];
	} else {
		struct ipv6hdr *ip6 = data + l3;

		if ((void *)(ip6 + 1) > data_end)
			return XDP_ABORTED;
		__builtin_memcpy(&ip6->saddr, rw->outer_src, 16);
		__builtin_memcpy(&ip6->daddr, rw->outer_dst, 16);
	}
	__builtin_memcpy(p->flow.src, rw->outer_src, sizeof(p->flow.src));
	__builtin_memcpy(p->flow.dst, rw->outer_dst, sizeof(p->flow.dst));
	return CONTINUE;
}

// icmp_quote_checksum_verdict checks the quoted IPv4 header's own checksum when the
// header has no options (RFC 5508 REQ-3 a: a NAT SHOULD drop an error whose embedded
// header's checksum fails): the ICMP checksum covers the quote as the router sent it,
// so a header a host or router corrupted before quoting it would pass that one, and
// translated, carry the quote to the flow's other side with the fault kept (the
// translation updates the checksum incrementally). A header with options is not
// checked: a router fills in Record Route and Timestamp options in place and may
// quote the header so changed with the checksum it arrived with (Linux does, for an
// error sent before it forwards), and such an error is as good as any. CONTINUE when
// it holds, when not checked, and for IPv6, whose header has none.
// icmp_error_translate has made sure the whole header lies within the frame (the
// ports after it do).
static __always_inline int icmp_quote_checksum_verdict(struct xdp_md *ctx, struct packet *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 in3 = p->l4_off + sizeof(struct icmp_hdr), sum = 0;
	__u32 *iip;

	if (p->flow.family != FAMILY_IPV4)
		return CONTINUE;
	if (in3 > MAX_L4_OFFSET)
		return XDP_ABORTED;
	// The mask keeps the bound through clang's reloads (see icmp_apply).
	iip = data + (in3 & 0x3ff);
	if ((void *)(iip + 5) > data_end)
		return XDP_ABORTED;
	if ((*(__u8 *)iip & 0xf) != 5)
		return CONTINUE;
#pragma unroll
	for (int i = 0; i < 5; i++)
		sum += (iip[i] & 0xffff) + (iip[i] >> 16);
	if (csum_finish(sum) != 0)
		return verdict(XDP_DROP, STAT_DROP_ICMP_CHECKSUM, p->len);
	return CONTINUE;
}

// icmp_checksum_verdict checks the ICMP checksum of an error the program is about
// to act on: over the whole message, as far as its IP packet's length says, and for
// ICMPv6 the pseudo-header of the outer addresses; then an IPv4 quote's header
// without options (icmp_quote_checksum_verdict). CONTINUE when both hold. A wrong
// one is dropped (RFC 5508 REQ-3: a NAT SHOULD silently drop it): translated, its
// fault would reach the client or backend, whose stack drops it, but only after a
// quote corrupted into another flow's had been sent to that flow's side. Errors
// longer than MAX_ICMP_CHECKED (routers send at most 576 bytes, RFC 1812 4.3.2.3, or
// 1280, RFC 4443 2.4; a frame XDP hands the program is at most a page) are passed.
//
// The sum is taken with bpf_csum_diff in pieces whose offsets are computed from the
// message's ends, not carried from one piece to the next, so the verifier's states
// after each piece differ only in the sum and prune.
static __always_inline int icmp_checksum_verdict(struct xdp_md *ctx, struct packet *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 start = p->l4_off, end = (__u32)p->l3_off + p->l3_len;
	__u32 len, rest, tail, sum = 0;
	void *at;

	if (start > MAX_L4_OFFSET || end < start || end - start > MAX_ICMP_CHECKED)
		return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
	// The masks change no value (the checks above bound them) but keep the bound
	// through clang's reloads (see icmp_apply).
	start &= 0x3ff;
	len = (end - start) & 0x1fff;
	end = start + len;
	rest = len & 127;
	tail = end - rest;
	if (p->flow.family == FAMILY_IPV6) {
		// ICMPv6's pseudo-header: addresses, length, next header.
		for (int i = 0; i < 4; i++) {
			sum += (p->flow.src[i] & 0xffff) + (p->flow.src[i] >> 16);
			sum += (p->flow.dst[i] & 0xffff) + (p->flow.dst[i] >> 16);
		}
		sum += bpf_htons(len) + bpf_htons(IPPROTO_ICMPV6);
	}
	// The last one to three bytes by hand (an odd last byte is the high half of a
	// word padded with zero, which in memory order is its first byte), ...
	if (rest & 2) {
		at = data + ((tail + (rest & 0x7c)) & 0x1fff);
		if (at + 2 > data_end)
			return XDP_ABORTED;
		sum += *(__u16 *)at;
	}
	if (rest & 1) {
		at = data + ((end - 1) & 0x1fff);
		if (at + 1 > data_end)
			return XDP_ABORTED;
		sum += *(__u8 *)at;
	}
	// ... the rest in pieces of 128 bytes, then of 64 down to 4, each a multiple
	// of 4 as bpf_csum_diff takes them.
	for (int i = 0; i < MAX_ICMP_CHECKED / 128; i++) {
		if ((__u32)(i + 1) * 128 > len)
			break;
		at = data + start + i * 128;
		if (at + 128 > data_end)
			return XDP_ABORTED;
		sum = bpf_csum_diff(0, 0, at, 128, sum);
	}
#pragma unroll
	for (__u32 size = 64; size >= 4; size >>= 1) {
		if (!(rest & size))
			continue;
		at = data + ((tail + (rest & ~(2 * size - 1) & 127)) & 0x1fff);
		if (at + size > data_end)
			return XDP_ABORTED;
		sum = bpf_csum_diff(0, 0, at, size, sum);
	}
	if (csum_finish(sum) != 0)
		return verdict(XDP_DROP, STAT_DROP_ICMP_CHECKSUM, p->len);
	return icmp_quote_checksum_verdict(ctx, p);
}

// icmp_to_lb_backend sends an ICMP error from the client's side about a dsr or tunnel
// flow (flow: client -> VIP) to the flow's backend, unchanged, in the service's mode.
// The backend answered the client from the VIP, so a router on the way that could
// not pass an answer on (too big, unreachable) tells the VIP, whose packets come
// here; the backend's stack finds its socket by the quote, so path-MTU discovery
// works through the balancer in these modes too. The backend is the one the flow's
// next packet would get: its connection-table (or half-open) entry's while usable,
// else the lookup table's, as for a packet of a connection opened elsewhere;
// nothing is recorded. Errors quoting any other service are passed. From the service
// on, p carries the flow (and, for TCP, an ACK) in place of the error's own 5-tuple,
// so the selection takes the flow's and the tunnel's flow hash is the flow's; p keeps
// its lengths and icmp_error.
static __always_inline int icmp_to_lb_backend(struct xdp_md *ctx, struct packet *p,
					      const struct flow_key *flow)
{
	enum stat_reason event = STAT_FLOW_NEW;
	struct backend *be = 0;
	struct vip_key key = {};
	struct service *svc;
	struct lb_flow *known;
	__u32 id = 0;
	int action;

	__builtin_memcpy(key.addr, flow->dst, sizeof(key.addr));
	key.port = flow->dport;
	key.proto = flow->proto;
	key.family = flow->family;
	svc = bpf_map_lookup_elem(&services, &key);
	if (!svc || (svc->mode != MODE_DSR && svc->mode != MODE_TUNNEL))
		return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
	action = icmp_checksum_verdict(ctx, p);
	if (action != CONTINUE)
		return action;
	p->flow = *flow;
	// The flow's next packet: for TCP one past the handshake.
	p->tcp_flags = flow->proto == IPPROTO_TCP ? TCP_FLAG_ACK : 0;
	known = flow_lookup(LB_CONNTRACK, flow);
	if (!known)
		known = flow_lookup(LB_HALF_OPEN, flow);
	if (known) {
		id = known->backend_id;
		be = usable_backend(id, svc->id);
		if (!be)
			event = STAT_FLOW_RESELECT;
	}
	if (!be) {
		action = miss_backend(p, svc, &be, &id, &event);
		if (action != CONTINUE)
			return action;
	}
	count(&global_stats, STAT_ICMP_TO_BACKEND, p->len);
	if (svc->mode == MODE_TUNNEL)
		return tunnel_send(ctx, p, svc, be, id);
	count(&service_stats, svc->id, p->len);
	count(&backend_stats, id, p->len);
	return verdict(forward_dsr(ctx, be), STAT_TX, p->len);
}

// icmp_translate rewrites an ICMP error about nat flow (in the direction its table
// is keyed by) for the flow's other side and sends it on: from the backend's side
// (rev, the flow's reverse entry) to the client, from the client's side (fs, its
// entry) to the backend. The quote (IP header at in3, ports at in4) is the flow's
// packet reversed. The rewrite lives here, not in icmp_error_translate, so that its
// stack slots are free on the way to icmp_to_lb_backend and the tunnel's fib lookup
// (the program's deepest path until then).
static __always_inline int icmp_translate(struct xdp_md *ctx, struct packet *p, const struct flow_key *flow,
					  __u32 in3, __u32 in4, const struct nat_entry *rev,
					  const struct nat_flow *fs)
{
	struct icmp_rewrite rw = {};
	int action;

	if (rev) {
		// From the backend's side: the quote is nat:port -> backend.
		__builtin_memcpy(rw.outer_src, rev->client.dst, 16);
		__builtin_memcpy(rw.outer_dst, rev->client.src, 16);
		__builtin_memcpy(rw.inner_src, rev->client.src, 16);
		__builtin_memcpy(rw.inner_dst, rev->client.dst, 16);
		rw.inner_sport = rev->client.sport;
		rw.inner_dport = rev->client.dport;
	} else {
		// From the client's side: the quote is our reply VIP -> client.
		__u32 id = fs->backend_id;
		struct backend *be = bpf_map_lookup_elem(&backends, &id);

		if (!be)
			return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
		nat_source(p->flow.family, rw.outer_src);
		__builtin_memcpy(rw.outer_dst, be->addr, 16);
		__builtin_memcpy(rw.inner_src, be->addr, 16);
		nat_source(p->flow.family, rw.inner_dst);
		rw.inner_sport = be->port;
		rw.inner_dport = fs->nat_port;
	}
	action = icmp_checksum_verdict(ctx, p);
	if (action != CONTINUE)
		return action;
	count(&global_stats, STAT_ICMP_TRANSLATED, p->len);
	action = icmp_apply(ctx, p, flow, in3, in4, &rw);
	if (action != CONTINUE)
		return action;
	return fib_forward(ctx, p);
}

// icmp_error_translate handles an ICMP error (p->icmp_error set by parse): it reads
// the quote into the flow it belongs to (the quoted packet reversed, in the direction
// the flow's tables are keyed by) and hands it to icmp_translate (a nat flow) or
// icmp_to_lb_backend (from the client's side, any other flow).
static __always_inline int icmp_error_translate(struct xdp_md *ctx, struct packet *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct flow_key flow = {};
	__u32 in3 = p->l4_off + sizeof(struct icmp_hdr), in4;
	struct nat_entry *rev = 0;
	struct nat_flow *fs = 0;
	__be16 *ports;

	if (in3 > MAX_L4_OFFSET)
		return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
	flow.family = p->flow.family;
	if (p->flow.family == FAMILY_IPV4) {
		struct iphdr *iip = data + in3;

		// The ports follow the quote's IP options, as they follow a packet's (RFC 5508
		// REQ-3 b: a NAT MUST read past them). A quote of a later fragment is left to
		// the kernel: its bytes where the ports would be are data, and name no flow.
		if ((void *)(iip + 1) > data_end || iip->version != 4 || iip->ihl < 5 ||
		    (iip->frag_off & bpf_htons(IP_OFFSET)))
			return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
		flow.src[0] = iip->daddr;
		flow.dst[0] = iip->saddr;
		flow.proto = iip->protocol;
		in4 = in3 + iip->ihl * 4;
	} else {
		struct ipv6hdr *iip6 = data + in3;
		int next;

		if ((void *)(iip6 + 1) > data_end || iip6->version != 6)
			return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
		__builtin_memcpy(flow.src, &iip6->daddr, 16);
		__builtin_memcpy(flow.dst, &iip6->saddr, 16);
		// The ports follow the quote's extension headers, walked as parse_ipv6 walks a
		// packet's: a parameter problem about one of them (RFC 4443 3.4, code 2: an
		// unrecognized option) quotes them. icmp_apply takes the ports no deeper than
		// MAX_L4_OFFSET + 48.
		in4 = in3 + sizeof(*iip6);
		next = ipv6_skip_ext(data, data_end, &in4, iip6->nexthdr);
		if (next < 0 || in4 > MAX_L4_OFFSET + 48)
			return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
		flow.proto = next;
	}
	if (flow.proto != IPPROTO_TCP && flow.proto != IPPROTO_UDP)
		return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
	// The ports (and so the quoted IP header before them) must lie inside the error's
	// IP packet: bytes after it in the frame (padding) are no part of the quote.
	ports = data + in4;
	if ((void *)(ports + 2) > data_end || !within_ip(p, in4, 4))
		return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
	flow.sport = ports[1];
	flow.dport = ports[0];

	if (is_nat_address(&p->flow)) {
		// From the backend's side: the quote is nat:port -> backend, the flow's reply key.
		rev = flow_lookup(NAT_REVERSE, &flow);
		if (!rev)
			rev = flow_lookup(NAT_HALF_REVERSE, &flow);
		if (!rev)
			return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
	} else {
		// From the client's side: the quote is a reply VIP -> client, and the error
		// goes where that reply came from (RFC 792, RFC 4443 2.2): one sent to any
		// other address is not the VIP's, and is passed.
		if (p->flow.dst[0] != flow.dst[0] || p->flow.dst[1] != flow.dst[1] ||
		    p->flow.dst[2] != flow.dst[2] || p->flow.dst[3] != flow.dst[3])
			return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p->len);
		fs = flow_lookup(NAT_CONNTRACK, &flow);
		if (!fs)
			fs = flow_lookup(NAT_HALF_OPEN, &flow);
		if (!fs || !fs->nat_port)
			return icmp_to_lb_backend(ctx, p, &flow);
	}
	return icmp_translate(ctx, p, &flow, in3, in4, rev, fs);
}
