// dsr.h: L2 direct server return. The frame goes back out of the interface it came in
// on, addressed to the backend's MAC; the backend holds the VIP on loopback and answers
// the client itself.
#pragma once

#include "parse.h"

static __always_inline int forward_dsr(struct xdp_md *ctx, struct backend *be)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return XDP_ABORTED;
	// The frame was addressed to us, so its destination MAC is our source MAC.
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, be->mac, ETH_ALEN);
	return XDP_TX;
}
