//go:build ignore

// sink.c: the counting end of the benchmark. Attached in native mode to a
// receiving veth, it counts every frame per CPU and drops it (or passes it to
// the stack, for tests that check contents through sockets).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// Set by the loader before load: 1 returns XDP_PASS instead of XDP_DROP.
volatile const __u8 pass = 0;
// Set by the loader before load: if not 0, IPv4 TCP frames from or to this
// port (network order) go to the stack uncounted, so latency probes can cross
// a link whose sink drops the load.
volatile const __u16 pass_port = 0;

// probe is 1 if the frame is IPv4 TCP from or to pass_port.
static __always_inline int probe(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->protocol != IPPROTO_TCP || ip->ihl != 5)
		return 0;
	struct tcphdr *tcp = (void *)(ip + 1);
	if ((void *)(tcp + 1) > end)
		return 0;
	return tcp->source == pass_port || tcp->dest == pass_port;
}

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
	if (pass_port && probe(ctx))
		return XDP_PASS;
	__u32 zero = 0;
	struct counter *c = bpf_map_lookup_elem(&counts, &zero);
	if (c) {
		c->packets++;
		c->bytes += ctx->data_end - ctx->data;
	}
	return pass ? XDP_PASS : XDP_DROP;
}
