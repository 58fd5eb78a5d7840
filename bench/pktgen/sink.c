//go:build ignore

// sink.c: the counting end of the benchmark. Attached in native mode to a
// receiving veth, it counts every frame per CPU and drops it (or passes it to
// the stack, for tests that check contents through sockets).

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// Set by the loader before load: 1 returns XDP_PASS instead of XDP_DROP.
volatile const __u8 pass = 0;

struct counter {
	__u64 packets;
	__u64 bytes;
};

// key: 0; value: struct counter, one per CPU.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct counter);
} counts SEC(".maps");

SEC("xdp")
int sink(struct xdp_md *ctx)
{
	__u32 zero = 0;
	struct counter *c = bpf_map_lookup_elem(&counts, &zero);
	if (c) {
		c->packets++;
		c->bytes += ctx->data_end - ctx->data;
	}
	return pass ? XDP_PASS : XDP_DROP;
}
