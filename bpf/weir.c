//go:build ignore

// weir.c: the XDP entry point. It holds only the order of the steps; each step lives in
// its own header and returns a verdict or CONTINUE.

#include "dsr.h"
#include "icmp.h"
#include "nat.h"
#include "select.h"
#include "tunnel.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

SEC("xdp")
int weir_xdp(struct xdp_md *ctx)
{
	struct packet p = {};
	struct vip_key key = {};
	struct service *svc;
	struct backend *be;
	__u32 backend_id;
	int action;

	action = parse(ctx, &p);
	if (action != CONTINUE)
		return action;

	if (p.icmp_error)
		return icmp_error_translate(ctx, &p);

	// A backend's reply to a nat flow comes back to the balancer's own address.
	if (is_nat_address(&p.flow)) {
		action = nat_reply(ctx, &p);
		if (action != CONTINUE)
			return action;
	}

	__builtin_memcpy(key.addr, p.flow.dst, sizeof(key.addr));
	key.port = p.flow.dport;
	key.proto = p.flow.proto;
	key.family = p.flow.family;
	svc = bpf_map_lookup_elem(&services, &key);
	if (!svc)
		return verdict(XDP_PASS, STAT_PASS_NOT_SERVICE, p.len);

	if (svc->mode == MODE_NAT)
		return nat_forward(ctx, &p, svc);
	if (svc->mode == MODE_TUNNEL)
		return tunnel_forward(ctx, &p, svc);

	action = select_backend(&p, svc, &be, &backend_id);
	if (action != CONTINUE)
		return action;
	count(&service_stats, svc->id, p.len);
	count(&backend_stats, backend_id, p.len);
	action = forward_dsr(ctx, be);
	return verdict(action, STAT_TX, p.len);
}
