//go:build ignore

// generator.c: the packet generator. It runs through BPF_PROG_RUN with
// BPF_F_TEST_XDP_LIVE_FRAMES, so every XDP_TX it returns is a real frame sent
// out of the interface named by the run's ingress_ifindex. Live-frame pages come
// back holding whatever the receivers wrote into them (rewritten MACs, a lower
// TTL, NAT addresses), so every frame is rewritten from a template here, never
// trusted from the previous round.

#include <linux/bpf.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// Overridable capacities.
#define MAX_TEMPLATES 8 // a power of two
// Bytes of a template copied into each frame: the longest header weir sends
// (Ethernet 14 + IPv6 40 + TCP 20 = 74) rounded up to whole 8-byte words.
#define TEMPLATE_BYTES 80
#define TEMPLATE_WORDS (TEMPLATE_BYTES / 8)
// Frames cycle through a schedule of template indexes, so a mix of templates
// is given in 64ths.
#define SCHEDULE_LEN 64
// How far a rate-limited generator may fall behind before it stops catching
// up (a stall is not followed by a burst).
#define MAX_LAG_NS 1000000

// One kind of frame. Its bytes hold the first copy_len bytes of flow 0's
// frame (headers with correct checksums, then zero payload); flow f adds f to
// the last 4 bytes of the source address, whose 17 low bits are zero in the
// template, and fixes both checksums incrementally. Every frame rewrites its
// first min(frame_len, TEMPLATE_BYTES) bytes, and no one writes past those
// (receivers rewrite headers only; the input frame's payload is zeros), so
// the payload a checksum covers is always the template's.
struct template {
	__u8 bytes[TEMPLATE_BYTES + 48]; // the tail copy below reads at offsets the verifier bounds by 128
	__u16 frame_len;   // frame length without FCS
	__u16 copy_len;    // min(frame_len, TEMPLATE_BYTES): bytes copied from the template
	__u16 ip_csum_off; // offset of the IPv4 header checksum; 0 for IPv6
	__u16 l4_csum_off; // offset of the TCP or UDP checksum
	__u16 src_off;     // offset of the source address's last 4 bytes
	__u8 udp;          // 1: a computed checksum of 0 is sent as 0xffff
	__u8 pad[5];
};

// What to send: set by the Go side before a run.
struct gen_config {
	__u32 flows;       // distinct flows (source addresses), 1..131072
	__u32 pad;
	__u64 interval_ns; // per CPU: 0 sends flat out, else ns between frames
	__u8 schedule[SCHEDULE_LEN]; // template index of frame n is schedule[n % 64]
};

// Per-CPU progress, read by the Go side while the generator runs.
struct gen_state {
	__u64 packets; // frames returned as XDP_TX
	__u64 bytes;   // their bytes
	__u64 next_ns; // rate limit: earliest time of the next frame
	__u32 flow[MAX_TEMPLATES]; // next flow index, per template: each kind cycles through every flow
};

// key: template index (host order); value: struct template.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_TEMPLATES);
	__type(key, __u32);
	__type(value, struct template);
} templates SEC(".maps");

// key: 0; value: struct gen_config.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen_config);
} config SEC(".maps");

// key: 0; value: struct gen_state, one per CPU.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen_state);
} state SEC(".maps");

// csum_add adds d to the one's-complement sum behind the 16-bit checksum at
// off (RFC 1624). It returns 0, or -1 if the field is outside the frame.
static __always_inline int csum_add(void *data, void *end, __u32 off, __u32 d, int udp)
{
	off &= 0x7f; // bounded for the verifier; offsets are < TEMPLATE_BYTES
	__u16 *p = data + off;
	if ((void *)(p + 1) > end)
		return -1;
	__u32 s = (~bpf_ntohs(*p)) & 0xffff;
	s += d;
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	__u16 c = ~s & 0xffff;
	if (udp && c == 0)
		c = 0xffff;
	*p = bpf_htons(c);
	return 0;
}

SEC("xdp")
int generate(struct xdp_md *ctx)
{
	__u32 zero = 0;
	struct gen_config *cfg = bpf_map_lookup_elem(&config, &zero);
	struct gen_state *st = bpf_map_lookup_elem(&state, &zero);
	if (!cfg || !st)
		return XDP_ABORTED;

	if (cfg->interval_ns) {
		__u64 now = bpf_ktime_get_ns();
		if (now < st->next_ns)
			return XDP_DROP; // early: the page goes back unsent
		if (now - st->next_ns > MAX_LAG_NS)
			st->next_ns = now;
		st->next_ns += cfg->interval_ns;
	}

	__u32 ti = cfg->schedule[st->packets & (SCHEDULE_LEN - 1)];
	struct template *t = bpf_map_lookup_elem(&templates, &ti);
	if (!t)
		return XDP_ABORTED;

	// Every run starts from the input frame's length (the longest template);
	// shorter templates trim the tail.
	int delta = (int)t->frame_len - (int)(ctx->data_end - ctx->data);
	if (delta && bpf_xdp_adjust_tail(ctx, delta))
		return XDP_ABORTED;

	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u32 words = t->copy_len >> 3;
	for (int i = 0; i < TEMPLATE_WORDS; i++) {
		if (i >= words)
			break;
		if (data + 8 * (i + 1) > end)
			return XDP_ABORTED;
		((__u64 *)data)[i] = ((__u64 *)t->bytes)[i];
	}
	// The last copy_len % 8 bytes. The mask bounds off for the verifier.
	__u32 off = t->copy_len & 0x78;
	if (t->copy_len & 4) {
		if (data + off + 4 > end)
			return XDP_ABORTED;
		*(__u32 *)(data + off) = *(__u32 *)(t->bytes + off);
		off += 4;
	}
	if (t->copy_len & 2) {
		if (data + off + 2 > end)
			return XDP_ABORTED;
		*(__u16 *)(data + off) = *(__u16 *)(t->bytes + off);
		off += 2;
	}
	if (t->copy_len & 1) {
		if (data + off + 1 > end)
			return XDP_ABORTED;
		*(__u8 *)(data + off) = t->bytes[off];
	}

	__u32 *flow = &st->flow[ti & (MAX_TEMPLATES - 1)];
	__u32 f = *flow;
	*flow = f + 1 >= cfg->flows ? 0 : f + 1;
	if (f) {
		__u32 *src = data + (t->src_off & 0x7f);
		if ((void *)(src + 1) > end)
			return XDP_ABORTED;
		*src = bpf_htonl(bpf_ntohl(*src) + f);
		__u32 d = (f >> 16) + (f & 0xffff);
		if (t->ip_csum_off && csum_add(data, end, t->ip_csum_off, d, 0))
			return XDP_ABORTED;
		if (csum_add(data, end, t->l4_csum_off, d, t->udp))
			return XDP_ABORTED;
	}

	st->packets++;
	st->bytes += t->frame_len;
	return XDP_TX;
}
