//go:build ignore

// floor.c: the least an XDP forwarder can do, the benchmark's floors. floor_tx
// swaps the Ethernet addresses and sends the frame back out (XDP_TX), the path
// weir's dsr mode takes; floor_redirect writes the next hop's addresses and
// sends the frame out of another interface through a devmap (XDP_REDIRECT), the
// path weir's nat and tunnel modes take to backends behind another link.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// Set by the loader before load: the addresses floor_redirect writes (source:
// the outgoing link's MAC; destination: its next hop's).
volatile const __u8 redirect_smac[ETH_ALEN] = {};
volatile const __u8 redirect_dmac[ETH_ALEN] = {};

// key: 0; value: the ifindex floor_redirect sends out of (host order), in the
// namespace of whoever filled it.
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} out_port SEC(".maps");

SEC("xdp")
int floor_tx(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return XDP_PASS;
	__u8 tmp[ETH_ALEN];
	__builtin_memcpy(tmp, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, tmp, ETH_ALEN);
	return XDP_TX;
}

SEC("xdp")
int floor_redirect(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return XDP_PASS;
	// Byte by byte: a memcpy from a volatile const would be folded to its
	// compile-time value (zero) by clang.
	for (int i = 0; i < ETH_ALEN; i++) {
		eth->h_dest[i] = redirect_dmac[i];
		eth->h_source[i] = redirect_smac[i];
	}
	return bpf_redirect_map(&out_port, 0, XDP_DROP);
}
