//go:build ignore

// sockmap.c: the proxy's in-kernel forwarding. Once the proxy has accepted a client and
// connected to a backend, it puts both sockets into splice_peers, each under the other's
// socket cookie; the stream verdict program then sends every byte a socket receives
// out of its peer, without waking the proxy. The proxy keeps everything else: the
// choice of backend, the connection's accounting, half-close and close.

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

#ifndef MAX_SPLICE_SOCKS
#define MAX_SPLICE_SOCKS 65536 // sockets forwarded at once (two per connection)
#endif

#ifndef SPLICE_SOCK_STATES
// splice_socks' entries: every socket forwarded holds one, and an LRU map evicts
// before it is full: each CPU keeps free entries of its own (up to 128, or on newer
// kernels up to the map's size / CPUs / 2), and one that runs out with the shared
// list short evicts rather than take another CPU's. So twice the sockets: room for
// the CPUs' free lists.
#define SPLICE_SOCK_STATES (2 * MAX_SPLICE_SOCKS)
#endif

// splice_peers: key = socket cookie (host byte order) of a socket the proxy forwards
// from; value = the socket its bytes go out of (its peer in the same connection).
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, MAX_SPLICE_SOCKS);
	__type(key, __u64);
	__type(value, __u64);
} splice_peers SEC(".maps");

// splice_sock: what the program knows of one socket it has seen bytes of.
struct splice_sock {
	__u64 first_ns; // bpf_ktime_get_ns (CLOCK_MONOTONIC) when its first bytes came
	__u8 passed;    // its bytes go to the proxy, not its peer (see splice_socks)
};

// splice_socks: key = socket cookie of a socket the program has seen bytes of; value
// = its splice_sock. The time of its first bytes is the proxy's latency sample (from
// the client's first bytes to the backend's), which it does not see itself. passed:
// the peer was not in splice_peers yet, or no more, so its bytes went to the proxy;
// then all its later bytes go to the proxy as well, so the proxy, which forwards
// those itself, never sees a later byte overtake an earlier one. The proxy deletes
// a socket's entry once it has closed the socket (the program no longer runs for
// it then; before, bytes still arriving would make the entry anew). An entry
// evicted while its socket is forwarded loses its first-byte time and, if passed,
// lets later bytes overtake those the proxy holds: sized by SPLICE_SOCK_STATES.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, SPLICE_SOCK_STATES);
	__type(key, __u64);
	__type(value, struct splice_sock);
} splice_socks SEC(".maps");

SEC("sk_skb/stream_verdict")
int splice_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);

	// A bare FIN comes here as a segment of no bytes. Redirected, the peer's kernel
	// worker sends 0 bytes, takes that for a broken pipe and stops forwarding
	// (sk_psock_backlog, Linux 6.18). The proxy sees the hang-up on the socket
	// itself, so the empty segment is dropped.
	if (skb->len == 0)
		return SK_DROP;
	struct splice_sock *st = bpf_map_lookup_elem(&splice_socks, &cookie);
	if (st && st->passed)
		return SK_PASS;
	__u64 first = st ? st->first_ns : bpf_ktime_get_ns();
	if (!st) {
		struct splice_sock fresh = { .first_ns = first };
		bpf_map_update_elem(&splice_socks, &cookie, &fresh, BPF_NOEXIST);
	}
	if (bpf_sk_redirect_hash(skb, &splice_peers, &cookie, 0) == SK_PASS)
		return SK_PASS; // redirected: out of the peer's send side
	// No peer: hand the bytes to the proxy's socket, and every later byte too.
	struct splice_sock passed = { .first_ns = first, .passed = 1 };
	bpf_map_update_elem(&splice_socks, &cookie, &passed, BPF_ANY);
	return SK_PASS;
}
