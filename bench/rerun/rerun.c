//go:build ignore

// rerun.c: a test-only wrapper that makes BPF_PROG_TEST_RUN's repeat mode honest for
// XDP programs that rewrite or encapsulate their frame. The kernel's repeat loop hands
// every iteration the xdp_buff as the previous iteration left it; rerun, run as the
// outer program, first puts the frame back exactly as it was given (data offset,
// length, bytes), optionally gives it a new flow, then tail-calls the program under
// test. Every program measured through it, floors included, pays the same restore.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

#define FRAME_MAX 512    // longest frame rerun restores
#define OFF_MASK 0x1ff   // bounds the vary offsets below FRAME_MAX for the verifier
#define PUSH_LEN 20      // bytes floor_push prepends, an IPv4 header's worth

// key 0: the program under test, set by the loader of the benchmark.
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} target SEC(".maps");

// Written from Go before a run, read-only to the program.
__u64 frame[FRAME_MAX / 8]; // the frame every iteration starts from, as words (see restore_bytes)
__u32 frame_len;            // its length in bytes, ETH_HLEN..FRAME_MAX
// New flows: byte offsets into the frame of the 16-bit words rerun changes before
// every iteration (all 0: the flow stays the same). The source port becomes
// 1024 + (n & 0x7fff) and the source address's last 16 bits are xored with n >> 15
// for the n-th flow, so 2^31 flows are distinct; the checksums covering them are
// updated incrementally (0: no such checksum, as in IPv6's header).
__u32 vary_sport_off;
__u32 vary_saddr_off;
__u32 vary_l4csum_off;
__u32 vary_l3csum_off;

// Kept by the program. Go zeroes started before every run, and again before
// cilium/ebpf retries a run that a signal interrupted (the retry gets a new buffer).
__u32 started;    // 0 until the run's first iteration has recorded origin
__s64 origin;     // where that iteration found the frame (see rerun)
__u32 flows;      // new flows handed out, over all runs
__u64 runs;       // iterations, over all runs
__u64 tail_moves; // iterations that found the frame's end moved (see rerun)

// restore_bytes copies the saved frame over the packet, 8 bytes at a time: about 7 ns
// for the benchmarks' 118- and 138-byte frames (Linux 6.18, AMD EPYC VM), where
// bpf_xdp_store_bytes takes 24-31 ns, and a __builtin_memcpy that clang cannot prove
// aligned goes byte by byte. The last len % 8 bytes are one more word, ending at the
// frame's end.
static __always_inline int restore_bytes(struct xdp_md *ctx, __u32 len)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u32 words = len / 8, last = (len - 8) & OFF_MASK;

#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < FRAME_MAX / 8; i++) {
		__u64 *w = data + i * 8;

		if (i >= words)
			break;
		if ((void *)(w + 1) > end)
			return -1;
		*w = frame[i];
	}
	if (last > FRAME_MAX - 8 || data + last + 8 > end)
		return -1;
	*(__u64 *)(data + last) = *(__u64 *)((__u8 *)frame + last);
	return 0;
}

// csum_replace2 updates the Internet checksum *check for a 16-bit word changed from
// old to new (RFC 1624 eqn. 3; words as they lie in memory, either byte order).
static __always_inline void csum_replace2(__u16 *check, __u16 old, __u16 new)
{
	__u32 sum = (__u16)~*check;

	sum += (__u16)~old;
	sum += new;
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	*check = ~sum;
}

// word is the 16-bit word at off in the frame, or 0 if it is not inside it.
static __always_inline __u16 *word(void *data, void *end, __u32 off)
{
	__u16 *w = data + (off & OFF_MASK);

	if ((void *)(w + 1) > end)
		return 0;
	return w;
}

// vary_flow makes the frame the next new flow.
static __always_inline int vary_flow(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u16 *sport = word(data, end, vary_sport_off);
	__u16 *saddr = word(data, end, vary_saddr_off);
	__u16 port, addr, *check;
	__u32 n = flows++;

	if (!sport || !saddr)
		return -1;
	port = __builtin_bswap16(1024 + (n & 0x7fff));
	addr = *saddr ^ __builtin_bswap16(n >> 15);
	if (vary_l4csum_off) {
		check = word(data, end, vary_l4csum_off);
		if (!check)
			return -1;
		csum_replace2(check, *sport, port);
		csum_replace2(check, *saddr, addr);
	}
	if (vary_l3csum_off) {
		check = word(data, end, vary_l3csum_off);
		if (!check)
			return -1;
		csum_replace2(check, *saddr, addr);
	}
	*sport = port;
	*saddr = addr;
	return 0;
}

SEC("xdp")
int rerun(struct xdp_md *ctx)
{
	__u32 len = frame_len;
	long here, now_len;

	if (len < ETH_HLEN || len > FRAME_MAX)
		return XDP_ABORTED;
	runs++;
	// Where the frame starts now, as a distance from a fixed address (one of our own
	// globals): a pointer minus a pointer is a plain number, which the verifier
	// allows programs loaded with CAP_PERFMON (root). The run's first iteration
	// finds the frame where the kernel put it and records that place.
	here = (long)ctx->data - (long)&origin;
	if (!started) {
		origin = here;
		started = 1;
	}
	// Move the start back: one bpf_xdp_adjust_head every iteration, whatever the
	// last program did (its cost does not depend on the offset, 0 included), so
	// every program pays the same for it.
	if (bpf_xdp_adjust_head(ctx, (int)(origin - here)))
		return XDP_ABORTED;
	// Then the end, only if it moved: no measured path moves it (encapsulation
	// pushes the start), and Go checks tail_moves stays 0, since a program that did
	// would pay a helper call its floor does not.
	now_len = (long)ctx->data_end - (long)ctx->data;
	// Keep clang from folding the length into 32-bit pointer arithmetic, which the
	// verifier rejects (clang 19, Linux 6.18; bpf/tunnel.h does the same).
	asm volatile("" : "+r"(now_len));
	if (now_len != len) {
		tail_moves++;
		if (bpf_xdp_adjust_tail(ctx, (int)len - (int)now_len))
			return XDP_ABORTED;
	}
	if (restore_bytes(ctx, len))
		return XDP_ABORTED;
	if ((vary_sport_off | vary_saddr_off) && vary_flow(ctx))
		return XDP_ABORTED;
	bpf_tail_call(ctx, &target, 0);
	return XDP_ABORTED; // no program under test
}

// swap_macs is the least an XDP forwarder does: send the frame back where it came from.
static __always_inline int swap_macs(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	__u8 tmp[ETH_ALEN];

	if ((void *)(eth + 1) > end)
		return XDP_PASS;
	__builtin_memcpy(tmp, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, tmp, ETH_ALEN);
	return XDP_TX;
}

// floor_tx is the floor every path is compared with: swap the MACs, XDP_TX (the
// same as bench/pktgen's floor_tx).
SEC("xdp")
int floor_tx(struct xdp_md *ctx)
{
	return swap_macs(ctx);
}

// floor_push and floor_push_pull check that restoring a moved frame costs what
// restoring an unmoved one does: floor_push leaves the frame PUSH_LEN bytes longer at
// the front (as tunnel encapsulation does), so rerun moves it back; floor_push_pull
// moves it back itself and runs honestly without rerun too.
SEC("xdp")
int floor_push(struct xdp_md *ctx)
{
	if (bpf_xdp_adjust_head(ctx, -PUSH_LEN))
		return XDP_ABORTED;
	return swap_macs(ctx);
}

SEC("xdp")
int floor_push_pull(struct xdp_md *ctx)
{
	if (bpf_xdp_adjust_head(ctx, -PUSH_LEN))
		return XDP_ABORTED;
	if (bpf_xdp_adjust_head(ctx, PUSH_LEN))
		return XDP_ABORTED;
	return swap_macs(ctx);
}
