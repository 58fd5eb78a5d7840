// nat.h: full NAT. A client's packet to a nat-mode VIP is DNATed to its backend and
// SNATed to the balancer's own address with a source port unique per (backend,
// protocol); the backend's reply is matched in the nat reverse tables and translated
// back. Both leave by the next hop
// bpf_fib_lookup finds: XDP_TX out of the interface they came in on, XDP_REDIRECT
// through tx_ports otherwise. Backends need no change.
//
// Floods: a new flow lives in NAT_HALF_OPEN / NAT_HALF_REVERSE until its client's next
// packet that is not a SYN (the ACK of the handshake; a UDP flow's second datagram),
// then moves to NAT_CONNTRACK / NAT_REVERSE. A spoofed source never answers, so its flows
// never leave the half-open tables, never evict an established flow, and give their
// ports back to the next new flow that comes round the backend's port ring.
//
// A port handed on that way may still be in use on the backend: the backend answered
// the earlier flow's SYN and keeps its half-open connection (SYN_RECV) for up to a
// minute. Its answers on that port acknowledge the earlier SYN, not the new flow's, so
// they are not the new client's: they go to the host, whose stack resets them, which
// ends the backend's stale connection. The new client's SYN, which the backend met with
// the stale connection, is sent again a second later; it keeps the port, now clear, or
// takes a new one if the backend said nothing (nat_syn_again).
#pragma once

#include "csum.h"
#include "select.h"
#include "toobig.h"

// Runtime switches set by the loader before load.
volatile const __be32 nat_addr4 = 0;         // the balancer's IPv4 source for nat
volatile const __be32 nat_addr6[4] = {};     // and its IPv6 source
volatile const __u16 nat_port_min = DEFAULT_NAT_PORT_MIN; // source ports handed out, host order
volatile const __u16 nat_port_max = DEFAULT_NAT_PORT_MAX;
volatile const __u64 tcp_idle_ns = DEFAULT_TCP_IDLE_S * NSEC_PER_SEC;       // established TCP flow
volatile const __u64 tcp_closing_ns = DEFAULT_TCP_CLOSING_S * NSEC_PER_SEC; // after FIN or RST
volatile const __u64 udp_idle_ns = DEFAULT_UDP_IDLE_S * NSEC_PER_SEC;
volatile const __u64 half_open_ns = DEFAULT_HALF_OPEN_S * NSEC_PER_SEC;     // a flow before its client answers


static __always_inline int is_nat_address(const struct flow_key *f)
{
	if (f->family == FAMILY_IPV4)
		return nat_addr4 != 0 && f->dst[0] == nat_addr4;
	return (nat_addr6[0] | nat_addr6[1] | nat_addr6[2] | nat_addr6[3]) != 0 &&
	       f->dst[0] == nat_addr6[0] && f->dst[1] == nat_addr6[1] &&
	       f->dst[2] == nat_addr6[2] && f->dst[3] == nat_addr6[3];
}

static __always_inline void nat_source(__u8 family, __be32 *addr)
{
	if (family == FAMILY_IPV4) {
		addr[0] = nat_addr4;
		return;
	}
	addr[0] = nat_addr6[0];
	addr[1] = nat_addr6[1];
	addr[2] = nat_addr6[2];
	addr[3] = nat_addr6[3];
}

static __always_inline int tcp_closes(struct packet *p)
{
	return p->flow.proto == IPPROTO_TCP && (p->tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST));
}

#define FLOW_F_FINS (FLOW_F_FIN_CLIENT | FLOW_F_FIN_BACKEND)

// A nat flow's flags are written by both of its directions, on different CPUs at
// once (a FIN each way, crossing): with a plain read-modify-write one side's bit
// could be lost, and the flow then stay counted open for good (its close is counted
// at the second FIN), or be counted closed twice. So every write to a table entry's
// flags is atomic. BPF's atomics work on 32 and 64 bits: flags is the third byte of
// the little-endian word nat_port opens (bpf2go builds bpfel only), whose other bytes
// an OR or AND with them masked out leaves as they are.
_Static_assert(__builtin_offsetof(struct nat_flow, nat_port) % 4 == 0 &&
		       __builtin_offsetof(struct nat_flow, flags) == __builtin_offsetof(struct nat_flow, nat_port) + 2,
	       "nat_flow.flags must be byte 2 of an aligned 32-bit word");

static __always_inline __u32 *flow_flags_word(struct nat_flow *fs)
{
	return (__u32 *)&fs->nat_port;
}

// flow_flags_or sets bits in fs->flags and returns the flags from before.
static __always_inline __u8 flow_flags_or(struct nat_flow *fs, __u8 bits)
{
	return (__u8)(__sync_fetch_and_or(flow_flags_word(fs), (__u32)bits << 16) >> 16);
}

// flow_flags_clear clears bits in fs->flags.
static __always_inline void flow_flags_clear(struct nat_flow *fs, __u8 bits)
{
	__sync_fetch_and_and(flow_flags_word(fs), ~((__u32)bits << 16));
}

// closes_flow notes in *flags a FIN or RST (tcp_closes) from the backend if
// from_backend, else from the client, and returns whether the flow is closed now: by
// an RST, or by a FIN when the other side's came before. A FIN alone half-closes
// the flow, which keeps its idle timeout: the other side may send for minutes yet
// (a request sent and half-closed, answered after a long think).
static __always_inline int closes_flow(const struct packet *p, enum flow_flags *flags, int from_backend)
{
	if (p->tcp_flags & TCP_FLAG_RST)
		return 1;
	*flags |= from_backend ? FLOW_F_FIN_BACKEND : FLOW_F_FIN_CLIENT;
	return (*flags & FLOW_F_FINS) == FLOW_F_FINS;
}

// closes_nat_flow is closes_flow for a table entry: exactly one of two FINs that
// cross sees the other's.
static __always_inline int closes_nat_flow(const struct packet *p, struct nat_flow *fs, int from_backend)
{
	__u8 bit = from_backend ? FLOW_F_FIN_BACKEND : FLOW_F_FIN_CLIENT;

	if (p->tcp_flags & TCP_FLAG_RST)
		return 1;
	return ((flow_flags_or(fs, bit) | bit) & FLOW_F_FINS) == FLOW_F_FINS;
}

// An answer to a SYN may acknowledge the data the SYN carried (TCP Fast Open) as well:
// up to this many bytes past syn_answer are the flow's own. Another connection's
// numbers fall in that window once in 65,536.
#define SYN_DATA_MAX 0xffff

// syn_answer is the acknowledgement number that answers p if it is a SYN (its
// sequence number + 1, network order), else 0.
static __always_inline __be32 syn_answer(const struct packet *p)
{
	if (!is_syn(p))
		return 0;
	return bpf_htonl(bpf_ntohl(p->tcp_seq) + 1);
}

static __always_inline int flow_alive(struct nat_flow *fs, __u8 proto, __u64 now)
{
	__u64 idle = udp_idle_ns;

	if (proto == IPPROTO_TCP)
		idle = (fs->flags & FLOW_F_CLOSING) ? tcp_closing_ns : tcp_idle_ns;
	return now - fs->last_seen_ns <= idle;
}

static __always_inline void count_flow(__u32 backend_id, int opened)
{
	struct flow_count *c = bpf_map_lookup_elem(&backend_flows, &backend_id);

	if (!c)
		return;
	if (opened)
		c->opened++;
	else
		c->closed++;
	load_add(backend_id, opened ? 1 : -1);
}

// mark_closing starts a flow's short timeout and counts it closed, once.
static __always_inline void mark_closing(struct nat_flow *fs)
{
	if (flow_flags_or(fs, FLOW_F_CLOSING) & FLOW_F_CLOSING)
		return;
	count_flow(fs->backend_id, 0);
}

// nat_rewrite sets the packet's addresses and ports and fixes the IPv4 header
// checksum and the TCP/UDP checksum (whose pseudo-header covers the addresses).
static __always_inline int nat_rewrite(struct xdp_md *ctx, struct packet *p,
				       const __be32 *src, __be16 sport,
				       const __be32 *dst, __be16 dport)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 l3 = p->l3_off, l4 = p->l4_off;
	__u16 *check;
	__be16 *ports;
	__u32 sum;
	int words = p->flow.family == FAMILY_IPV4 ? 1 : 4;

	// Offsets come from the stack; bound them so the verifier accepts the pointers.
	if (l3 > MAX_L3_OFFSET || l4 > MAX_L4_OFFSET)
		return XDP_ABORTED;
	ports = data + l4;
	if ((void *)(ports + 2) > data_end)
		return XDP_ABORTED;

	if (p->flow.proto == IPPROTO_TCP) {
		struct tcphdr *tcp = data + l4;

		if ((void *)(tcp + 1) > data_end)
			return XDP_ABORTED;
		check = &tcp->check;
	} else {
		struct udphdr *udp = data + l4;

		if ((void *)(udp + 1) > data_end)
			return XDP_ABORTED;
		check = &udp->check;
	}

	// The L4 checksum: addresses (pseudo-header) and ports. A UDP checksum of zero
	// stays zero, as Linux's own NAT leaves it: over IPv4 it means "none"; over IPv6
	// only a receiver that allows it takes it (RFC 6936, tunnels over UDP), and
	// updated it would become a wrong non-zero checksum that no receiver takes.
	if (!(p->flow.proto == IPPROTO_UDP && *check == 0)) {
		sum = csum_start(*check);
		for (int i = 0; i < 4; i++) {
			if (i >= words)
				break;
			sum = csum_add32(sum, p->flow.src[i], src[i]);
			sum = csum_add32(sum, p->flow.dst[i], dst[i]);
		}
		sum = csum_add16(sum, ports[0], sport);
		sum = csum_add16(sum, ports[1], dport);
		*check = csum_finish(sum);
		if (p->flow.proto == IPPROTO_UDP && *check == 0)
			*check = 0xffff;
	}
	ports[0] = sport;
	ports[1] = dport;

	if (p->flow.family == FAMILY_IPV4) {
		struct iphdr *ip = data + l3;

		if ((void *)(ip + 1) > data_end)
			return XDP_ABORTED;
		sum = csum_start(ip->check);
		sum = csum_add32(sum, ip->saddr, src[0]);
		sum = csum_add32(sum, ip->daddr, dst[0]);
		ip->check = csum_finish(sum);
		ip->saddr = src[0];
		ip->daddr = dst[0];
	} else {
		struct ipv6hdr *ip6 = data + l3;

		if ((void *)(ip6 + 1) > data_end)
			return XDP_ABORTED;
		__builtin_memcpy(&ip6->saddr, src, 16);
		__builtin_memcpy(&ip6->daddr, dst, 16);
	}
	__builtin_memcpy(p->flow.src, src, sizeof(p->flow.src));
	__builtin_memcpy(p->flow.dst, dst, sizeof(p->flow.dst));
	p->flow.sport = sport;
	p->flow.dport = dport;
	return CONTINUE;
}

// set_vlan gives the frame the 802.1Q tag tci (0: none), whether it carries one now
// or not, and keeps p's offsets in step (p->len stays the frame's length as it came,
// which the counters count). The MACs move by the tag's 4 bytes; the EtherType stays
// where it lies, after the tag if there is one.
static __always_inline int set_vlan(struct xdp_md *ctx, struct packet *p, __be16 tci)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	int tagged = p->l3_off == sizeof(struct ethhdr) + sizeof(struct vlan_hdr);
	struct vlan_hdr *vlan;
	struct ethhdr *eth;
	__u8 macs[2 * ETH_ALEN];
	int delta;

	if (!tagged && !tci)
		return CONTINUE;
	if (tagged && tci) {
		vlan = data + sizeof(struct ethhdr);
		if ((void *)(vlan + 1) > data_end)
			return XDP_ABORTED;
		vlan->tci = tci;
		p->vlan_tci = tci;
		return CONTINUE;
	}
	if (data + sizeof(macs) > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(macs, data, sizeof(macs));
	delta = tagged ? (int)sizeof(struct vlan_hdr) : -(int)sizeof(struct vlan_hdr);
	if (bpf_xdp_adjust_head(ctx, delta))
		return XDP_ABORTED;
	p->l3_off -= delta;
	p->l4_off -= delta;
	p->vlan_tci = tci;
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	vlan = (void *)(eth + 1);
	if ((void *)(vlan + 1) > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(eth, macs, sizeof(macs));
	if (tci) {
		eth->h_proto = ETH_P_8021Q_BE;
		vlan->tci = tci;
	}
	return CONTINUE;
}

// send_to writes the next hop's MACs and sends the frame: XDP_TX out of the interface
// it came in on, XDP_REDIRECT through tx_ports to another. An interface the program
// is not attached to has no tx_ports entry: the packet is dropped and counted so.
// Passing it to the kernel instead would not serve the flow: the backend's answers
// come back on that interface, where no program translates them (and the kernel
// forwards no IPv6 packet from its own address).
static __always_inline int send_to(struct xdp_md *ctx, struct packet *p, const struct next_hop *hop)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	long action;

	if ((void *)(eth + 1) > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(eth->h_dest, hop->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, hop->smac, ETH_ALEN);
	if (hop->ifindex == ctx->ingress_ifindex)
		return verdict(XDP_TX, STAT_TX, p->len);
	action = bpf_redirect_map(&tx_ports, hop->ifindex, XDP_DROP);
	if (action != XDP_REDIRECT)
		return verdict(XDP_DROP, STAT_DROP_NO_TX_PORT, p->len);
	return verdict(XDP_REDIRECT, STAT_REDIRECT, p->len);
}

// hop_cached sets *hop to be's cached next hop if it may carry a packet of tot_len
// bytes now: found less than a second ago, and the packet no longer than the longest
// one the route accepted in that second (a longer one is looked up again, which is how
// the path MTU is checked). The program writes the cache; the loader writes zeros.
static __always_inline int hop_cached(const struct backend *be, __u32 tot_len, __u64 now,
				      struct next_hop *hop)
{
	if (!be->hop.ifindex || now - be->hop_ns >= NSEC_PER_SEC || tot_len > be->hop_len)
		return 0;
	*hop = be->hop;
	return 1;
}

// hop_remember caches the next hop bpf_fib_lookup found for a packet of tot_len bytes.
// A concurrent writer on another CPU stores the same answer; a torn mix of two equal
// next hops is still that next hop.
static __always_inline void hop_remember(struct backend *be, const struct next_hop *hop,
					 __u32 tot_len, __u64 now)
{
	be->hop = *hop;
	if (now - be->hop_ns >= NSEC_PER_SEC) {
		be->hop_ns = now;
		be->hop_len = tot_len;
	} else if (tot_len > be->hop_len) {
		be->hop_len = tot_len;
	}
}

// fib_hop finds the next hop for a packet of tot_len bytes with the addresses and
// ports of f (as it will leave): be's cached one (be may be 0: no cache), else the
// one bpf_fib_lookup finds, which it then caches in be. It returns bpf_fib_lookup's
// answer (BPF_FIB_LKUP_RET_SUCCESS for a cached hop), *hop set on success and *mtu,
// the route's MTU, on BPF_FIB_LKUP_RET_FRAG_NEEDED.
static __always_inline long fib_hop(struct xdp_md *ctx, const struct flow_key *f, __u32 tot_len,
				    struct backend *be, __u64 now, struct next_hop *hop, __u32 *mtu)
{
	long rc;

	if (be && hop_cached(be, tot_len, now, hop))
		return BPF_FIB_LKUP_RET_SUCCESS;
	// Zeroed only here: 64 bytes of stores the cached path need not pay.
	struct bpf_fib_lookup fib = {};

	fib.family = f->family;
	fib.ifindex = ctx->ingress_ifindex;
	fib.l4_protocol = f->proto;
	fib.sport = f->sport;
	fib.dport = f->dport;
	fib.tot_len = tot_len;
	if (f->family == FAMILY_IPV4) {
		fib.ipv4_src = f->src[0];
		fib.ipv4_dst = f->dst[0];
	} else {
		__builtin_memcpy(fib.ipv6_src, f->src, 16);
		__builtin_memcpy(fib.ipv6_dst, f->dst, 16);
	}
	rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), 0);
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		*mtu = fib.mtu_result;
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return rc;
	__builtin_memcpy(hop->dmac, fib.dmac, ETH_ALEN);
	__builtin_memcpy(hop->smac, fib.smac, ETH_ALEN);
	hop->ifindex = fib.ifindex;
	if (be)
		hop_remember(be, hop, tot_len, now);
	return rc;
}

// hop_send sends the (rewritten) packet by what fib_hop answered: to the next hop; to
// the kernel when its neighbour is not resolved yet; dropped without a route. The
// route's interface is one weir is attached to, not a VLAN on it, so a client's tag
// is taken off (the backend's replies get it back from the flow's nat_entry).
static __always_inline int hop_send(struct xdp_md *ctx, struct packet *p, long rc, const struct next_hop *hop)
{
	int action = set_vlan(ctx, p, 0);

	if (action != CONTINUE)
		return action;
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		// The kernel forwards this one and resolves the neighbour for the next.
		return verdict(XDP_PASS, STAT_PASS_NO_NEIGH, p->len);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return verdict(XDP_DROP, STAT_DROP_NO_ROUTE, p->len);
	return send_to(ctx, p, hop);
}

// fib_forward sends the (rewritten) packet to its next hop, without a cache: an ICMP
// error translated for the other side of a nat flow. One too big for the route is
// dropped like one without: no ICMP error answers an ICMP error.
static __always_inline int fib_forward(struct xdp_md *ctx, struct packet *p)
{
	struct next_hop hop;
	__u32 mtu;

	return hop_send(ctx, p, fib_hop(ctx, &p->flow, p->len - p->l3_off, 0, 0, &hop, &mtu), &hop);
}

// came_from is the next hop back to where the frame came from.
static __always_inline int came_from(struct xdp_md *ctx, struct next_hop *hop)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return -1;
	__builtin_memcpy(hop->dmac, eth->h_source, ETH_ALEN);
	__builtin_memcpy(hop->smac, eth->h_dest, ETH_ALEN);
	hop->ifindex = ctx->ingress_ifindex;
	return 0;
}

// client_key is the key of the client's flow in a nat_entry (its tag left out).
static __always_inline void client_key(struct flow_key *k, const struct nat_client *c)
{
	__builtin_memcpy(k, c, sizeof(*k));
	k->pad[0] = k->pad[1] = 0;
}

// reply_key is the key under which the backend's replies to a nat flow are found.
static __always_inline void reply_key(struct flow_key *rk, const struct packet *p,
				      const struct backend *be, __be16 nat_port)
{
	__builtin_memcpy(rk->src, be->addr, sizeof(rk->src));
	nat_source(p->flow.family, rk->dst);
	rk->sport = be->port;
	rk->dport = nat_port;
	rk->proto = p->flow.proto;
	rk->family = p->flow.family;
}

// flow_key_equal compares two keys word by word (BPF has no memcmp).
static __always_inline int flow_key_equal(const struct flow_key *a, const struct flow_key *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;
	__u32 diff = 0;

#pragma unroll
	for (int i = 0; i < sizeof(*a) / 4; i++)
		diff |= x[i] ^ y[i];
	return diff == 0;
}

// nat_alloc_port claims a source port towards the backend for a new (half-open) flow:
// the next port of the backend's ring (nat_cursor[be->nat_ring], shared by every slot
// holding that backend address, port and protocol) unless a live established flow
// holds it. A port held by a half-open flow, or by one that has ended (expired, moved
// elsewhere), is taken over: the ring reaches it only after every other port of the
// backend was handed out since, so it is the oldest. Long-lived flows sit together
// in the ring (they were handed out one after another), so past a port one of them
// holds the next tries spread over the range instead, from a hash of the flow, and
// find a free port as often as the range has one. Its entry in nat_half_reverse is
// the claim. O(1): NAT_PORT_TRIES ports at most. It returns the
// port (network order), 0 if every port it looked at is held, or -1 if the half-open
// table refused the claim (an LRU whose CPU list has nothing to evict at once, which
// a flood can cause): a retry at another port would meet the same table.
static __always_inline int nat_alloc_port(struct xdp_md *ctx, struct packet *p, struct backend *be,
					     __u32 backend_id, __u64 now)
{
	struct flow_key rk = {}, holder_key;
	struct nat_entry entry = {};
	__u32 range = (__u32)nat_port_max - nat_port_min + 1;
	__u32 *cursor, ring, spread = 0;

	reply_key(&rk, p, be, 0);
	__builtin_memcpy(&entry.client, &p->flow, sizeof(entry.client));
	entry.client.vlan_tci = p->vlan_tci;
	entry.backend_id = backend_id;
	entry.syn_ack = syn_answer(p);
	if (came_from(ctx, &entry.to_client))
		return 0;
	// The ring is the backend's, not the slot's: two services with the same backend
	// claim its ports under the same keys, so they must take them from one ring.
	ring = be->nat_ring;
	cursor = bpf_map_lookup_elem(&nat_cursor, &ring);
	if (!cursor)
		return 0;

	// Kept a real loop (bounded loops verify since Linux 5.3): unrolled, its map
	// operations would multiply the program's size for a path that almost always
	// ends at the first port.
#pragma clang loop unroll(disable)
	for (int i = 0; i < NAT_PORT_TRIES; i++) {
		struct nat_entry *old;
		struct nat_flow *holder;
		__u32 port;

		if (!spread)
			port = __sync_fetch_and_add(cursor, 1) % range;
		else
			port = hash_final(hash_word(spread, i)) % range;
		rk.dport = bpf_htons(nat_port_min + port);
		old = flow_lookup(NAT_REVERSE, &rk);
		if (old) {
			client_key(&holder_key, &old->client);
			holder = flow_lookup(NAT_CONNTRACK, &holder_key);
			if (holder && flow_alive(holder, rk.proto, now) && holder->nat_port == rk.dport &&
			    holder->backend_id == old->backend_id) {
				spread = flow_hash(&p->flow, 0) | 1;
				continue;
			}
			// Ended: its replies must not find it any more.
			flow_delete(NAT_REVERSE, &rk);
		}
		if (flow_update(NAT_HALF_REVERSE, &rk, &entry))
			return -1;
		return rk.dport;
	}
	return 0;
}

// refresh_flow runs at most once a second per flow: it keeps the flow alive and points
// replies at where the client's packets come from now (a router may have changed).
static __always_inline void refresh_flow(struct xdp_md *ctx, struct packet *p, struct nat_flow *fs,
					 struct backend *be, __u64 now)
{
	struct flow_key rk = {};
	struct nat_entry *rev;

	fs->last_seen_ns = now;
	reply_key(&rk, p, be, fs->nat_port);
	rev = flow_lookup(NAT_REVERSE, &rk);
	if (rev) {
		came_from(ctx, &rev->to_client);
		rev->client.vlan_tci = p->vlan_tci;
	}
}

// nat_send forwards a packet of a flow with a port towards be: rewritten to go from
// the nat address and that port to the backend, to be's next hop (fib_hop, looked up
// for the packet as it will leave). A packet too big for the route is answered with
// ICMP "fragmentation needed" / "packet too big" carrying the route's MTU, quoting the
// packet as the client sent it, so it is not rewritten; without DF it is dropped (XDP
// cannot fragment). A packet without a route is dropped after the rewrite.
static __always_inline int nat_send(struct xdp_md *ctx, struct packet *p, struct backend *be,
				    __be16 port, __u64 now)
{
	struct flow_key out = p->flow;
	// Initialised, though read only once set: otherwise clang (19) may spill an
	// undefined register for it on the paths that do not set it, which the
	// verifier (Linux 6.18) refuses.
	struct next_hop hop = {};
	__u32 mtu = 0;
	int action;
	long rc;

	nat_source(p->flow.family, out.src);
	out.sport = port;
	__builtin_memcpy(out.dst, be->addr, sizeof(out.dst));
	out.dport = be->port;
	rc = fib_hop(ctx, &out, p->len - p->l3_off, be, now, &hop, &mtu);
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return icmp_too_big(ctx, p, mtu, STAT_NAT_TOO_BIG);
	action = nat_rewrite(ctx, p, out.src, port, be->addr, be->port);
	if (action != CONTINUE)
		return action;
	return hop_send(ctx, p, rc, &hop);
}

// nat_syn_again decides for a SYN sent again on a half-open flow that began with a
// SYN and whose backend has not answered it with a SYN-ACK (rev->syn_ack is still
// set): 1 if the flow should start over with a new port. If what came back on the port
// was another connection's (FLOW_F_STALE), the host has been handed it to reset, and
// the port is kept, once. Otherwise the flow starts over: the backend may hold a stale
// connection on this port and not say so (it rate-limits such answers), and a SYN lost
// on the way costs nothing but a port.
static __always_inline int nat_syn_again(struct packet *p, struct nat_flow *hs, struct nat_entry *rev)
{
	if ((hs->flags & (FLOW_F_STALE | FLOW_F_KEPT)) == FLOW_F_STALE) {
		flow_flags_or(hs, FLOW_F_KEPT);
		flow_flags_clear(hs, FLOW_F_STALE);
		rev->syn_ack = syn_answer(p);
		return 0;
	}
	return 1;
}

// nat_half_open handles a packet of a half-open flow: a SYN sent again goes the
// same way, unless nat_syn_again says it starts over; any other packet is the client's
// answer, and the flow and its port move to the established tables. CONTINUE if the
// flow is not (or no longer) half-open: it expired, its backend became unusable, a
// newer flow took its port, or it starts over (its port given up; the caller takes the
// packet as a new flow's).
static __always_inline int nat_half_open(struct xdp_md *ctx, struct packet *p, struct service *svc,
					 const struct flow_key *key, __u64 now)
{
	struct nat_flow *hs;
	struct nat_entry *rev;
	struct flow_key rk = {}, claimed;
	struct backend *be;
	__u32 id;
	int action;

	hs = flow_lookup(NAT_HALF_OPEN, key);
	if (!hs || now - hs->last_seen_ns > half_open_ns)
		return CONTINUE;
	id = hs->backend_id;
	be = usable_backend(id, svc->id);
	if (!be)
		return CONTINUE;
	reply_key(&rk, p, be, hs->nat_port);
	rev = flow_lookup(NAT_HALF_REVERSE, &rk);
	if (!rev || rev->backend_id != id)
		return CONTINUE;
	client_key(&claimed, &rev->client);
	if (!flow_key_equal(&claimed, key))
		return CONTINUE;
	if (tcp_closes(p) && closes_nat_flow(p, hs, 0))
		flow_flags_or(hs, FLOW_F_CLOSING);
	if (is_syn(p) && rev->syn_ack && nat_syn_again(p, hs, rev)) {
		flow_delete(NAT_HALF_REVERSE, &rk);
		count(&global_stats, STAT_NAT_NEW_PORT, p->len);
		return CONTINUE;
	}
	count(&service_stats, svc->id, p->len);
	count(&backend_stats, id, p->len);
	if (is_syn(p)) {
		count(&global_stats, STAT_FLOW_HIT, p->len);
		return nat_send(ctx, p, be, hs->nat_port, now);
	}

	count(&global_stats, STAT_FLOW_ESTABLISHED, p->len);
	count_flow(id, 1);
	if (hs->flags & FLOW_F_CLOSING)
		count_flow(id, 0);
	hs->last_seen_ns = now;
	flow_flags_clear(hs, (__u8) ~(FLOW_F_CLOSING | FLOW_F_FINS));
	rev->syn_ack = 0;
	action = nat_send(ctx, p, be, hs->nat_port, now);
	// The entries move as they are (map values are copied in place: no stack copy).
	flow_update(NAT_CONNTRACK, key, hs);
	flow_update(NAT_REVERSE, &rk, rev);
	flow_delete(NAT_HALF_REVERSE, &rk);
	flow_delete(NAT_HALF_OPEN, key);
	return action;
}

// nat_forward handles a client's packet to a nat-mode service.
static __always_inline int nat_forward(struct xdp_md *ctx, struct packet *p, struct service *svc)
{
	struct nat_flow *fs, fresh = {};
	struct flow_key key = p->flow;
	enum stat_reason event = STAT_FLOW_NEW;
	struct backend *be = 0;
	__u64 now = bpf_ktime_get_coarse_ns();
	__u32 id = 0;
	int port, action;

	fs = flow_lookup(NAT_CONNTRACK, &key);
	if (fs) {
		// A SYN on the 5-tuple of a flow that is closed or whose client has sent its
		// FIN is a new connection (the client reused its port): it takes the lookup
		// table and a port of its own, and is counted opened when it is established.
		int reused = is_syn(p) && (fs->flags & (FLOW_F_CLOSING | FLOW_F_FIN_CLIENT));

		if (!reused && flow_alive(fs, p->flow.proto, now))
			be = usable_backend(fs->backend_id, svc->id);
		if (be) {
			id = fs->backend_id;
			if (now - fs->last_seen_ns > NSEC_PER_SEC)
				refresh_flow(ctx, p, fs, be, now);
			if (tcp_closes(p) && closes_nat_flow(p, fs, 0))
				mark_closing(fs);
			count(&global_stats, STAT_FLOW_HIT, p->len);
			count(&service_stats, svc->id, p->len);
			count(&backend_stats, id, p->len);
			return nat_send(ctx, p, be, fs->nat_port, now);
		}
		// Expired, reused, or its backend became unusable: the old flow ends here,
		// and this packet starts a new one.
		mark_closing(fs);
		flow_delete(NAT_CONNTRACK, &key);
		if (!reused)
			event = STAT_FLOW_RESELECT;
	} else {
		action = nat_half_open(ctx, p, svc, &key, now);
		if (action != CONTINUE)
			return action;
	}

	action = miss_backend(p, svc, &be, &id, &event);
	if (action != CONTINUE)
		return action;
	if (!new_flow_allowed(now))
		return verdict(XDP_DROP, STAT_DROP_FLOW_RATE, p->len);
	port = nat_alloc_port(ctx, p, be, id, now);
	if (port < 0)
		return verdict(XDP_DROP, STAT_DROP_HALF_OPEN_FULL, p->len);
	if (!port)
		return verdict(XDP_DROP, STAT_DROP_NAT_PORTS, p->len);
	fresh.backend_id = id;
	fresh.nat_port = port;
	fresh.last_seen_ns = now;
	if (tcp_closes(p) && closes_flow(p, &fresh.flags, 0))
		fresh.flags |= FLOW_F_CLOSING;
	count(&global_stats, event, p->len);
	count(&service_stats, svc->id, p->len);
	count(&backend_stats, id, p->len);
	action = nat_send(ctx, p, be, port, now);
	// Recorded whatever the verdict: a packet passed for neighbour resolution has
	// already claimed its port, and the next one must find the flow.
	flow_update(NAT_HALF_OPEN, &key, &fresh);
	return action;
}

// nat_reply_refresh keeps a flow alive by its backend's packets, as its client's
// keep it (at most once a second): a UDP client that only listens (a stream it
// asked for once) would otherwise see its flow expire under the stream, and the
// ring could hand the flow's port to another client of that backend while the
// stream still comes. A TCP client acknowledges what it gets, so TCP needs none.
// The reverse entry remembers when it last did, so a stream costs the connection
// table one lookup a second, not one a packet.
static __always_inline void nat_reply_refresh(const struct packet *p, struct nat_entry *rev,
					      const struct flow_key *client)
{
	__u64 now = bpf_ktime_get_coarse_ns();
	__u32 tick = now >> REPLY_TICK_SHIFT; // a shift, not a division, on every reply
	struct nat_flow *fs;

	if (tick - rev->syn_ack < REPLY_TICKS_PER_REFRESH)
		return;
	rev->syn_ack = tick;
	fs = flow_lookup(NAT_CONNTRACK, client);
	if (fs && fs->backend_id == rev->backend_id && fs->nat_port == p->flow.dport)
		fs->last_seen_ns = now;
}

// nat_reply translates a backend's reply back to the client, or returns CONTINUE for
// a packet to the nat address that is not a tracked reply (the host's own traffic).
// A packet to a half-open flow's port that acknowledges something other than the
// flow's SYN (and the data it may carry) belongs to a connection an earlier flow on
// that port left on the backend: it is passed to the host, whose stack resets that
// connection (see the top of this file).
static __always_inline int nat_reply(struct xdp_md *ctx, struct packet *p)
{
	struct nat_entry *rev;
	struct flow_key client;
	__be16 vlan_tci;
	int action, established = 1, stale;

	rev = flow_lookup(NAT_REVERSE, &p->flow);
	if (!rev) {
		rev = flow_lookup(NAT_HALF_REVERSE, &p->flow);
		established = 0;
	}
	if (!rev)
		return CONTINUE;
	client_key(&client, &rev->client);
	vlan_tci = rev->client.vlan_tci;
	stale = !established && rev->syn_ack && (p->tcp_flags & TCP_FLAG_ACK) &&
		bpf_ntohl(p->tcp_ack) - bpf_ntohl(rev->syn_ack) > SYN_DATA_MAX;
	if (tcp_closes(p) || stale) {
		struct nat_flow *fs;

		if (established)
			fs = flow_lookup(NAT_CONNTRACK, &client);
		else
			fs = flow_lookup(NAT_HALF_OPEN, &client);
		// Only if the flow still goes to this backend by this port: a late FIN or
		// RST from a backend the flow has left must not close its new entry.
		if (fs && fs->backend_id == rev->backend_id && fs->nat_port == p->flow.dport) {
			if (stale)
				flow_flags_or(fs, FLOW_F_STALE);
			else if (closes_nat_flow(p, fs, 1)) {
				if (established)
					mark_closing(fs);
				else
					flow_flags_or(fs, FLOW_F_CLOSING);
			}
		}
	}
	if (stale)
		return verdict(XDP_PASS, STAT_PASS_NAT_STALE, p->len);
	// The backend's SYN-ACK to the flow's SYN: a SYN sent again now means the
	// SYN-ACK was lost on the way to the client, and keeps the port.
	if (!established && rev->syn_ack &&
	    (p->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == (TCP_FLAG_SYN | TCP_FLAG_ACK))
		rev->syn_ack = 0;
	if (established && p->flow.proto == IPPROTO_UDP)
		nat_reply_refresh(p, rev, &client);
	count(&global_stats, STAT_NAT_REPLY, p->len);
	action = nat_rewrite(ctx, p, client.dst, client.dport, client.src, client.sport);
	if (action != CONTINUE)
		return action;
	// Back with the tag the client's packets came with (or none).
	action = set_vlan(ctx, p, vlan_tci);
	if (action != CONTINUE)
		return action;
	return send_to(ctx, p, &rev->to_client);
}
