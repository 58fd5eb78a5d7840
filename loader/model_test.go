package loader

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"math/bits"
	"net"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// FuzzDataPath runs frames built from the fuzz input through the real program
// (BPF_PROG_TEST_RUN) and through the Go model (model_sim_test.go), from the same map
// contents, and fails on any difference: verdict, output bytes, counters by reason,
// per-service, per-backend and per-backend flow counters, and the connection and
// nat reverse tables afterwards; and it judges every frame the program changed by
// its checksums, computed from scratch (checkChecksums).
//
// Each input starts from empty connection and nat reverse tables plus the entries the
// input asks for (a known flow, a port held by another flow, a reply's reverse
// entry, fresh or expired), so every input is independent of the ones before it.
//
// nat's and tunnel mode's next hops come from bpf_fib_lookup. The programs run in a
// network namespace of their own whose one route (fuzzNet) leads to the tunnel
// backends' prefixes over a veth with an MTU of 1280, some of them with resolved
// neighbours; the model's FIB answers as that namespace does (fuzzRig.fib): a
// next hop, an unresolved neighbour, or "fragmentation needed" for a packet above the
// MTU (for tunnel packets and for the nat services with backends in those prefixes),
// and no route for everything else, so the other nat flows end in drop_no_route after
// the rewrite, which BPF_PROG_TEST_RUN returns and the test compares byte for byte. The
// backends' tunnel next-hop cache is seeded per input (fresh, stale, too short, on
// the receiving interface, on the veth in tx_ports, on one not in it) and compared
// afterwards with what the model wrote. Of two loaded programs one hands out
// nat ports from 10000..32767 (the model is given the port the program drew, read
// back from its output, and checks it is in range and was free) and one from the
// single port 20000 (the draw is forced, so port collisions, take-overs of ended
// flows and drop_nat_ports are predicted exactly).
func FuzzDataPath(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add(s.in)
	}
	rig := newFuzzRig(f)
	f.Fuzz(func(t *testing.T, in []byte) {
		rig.check(t, in)
	})
}

// TestFuzzSeedsTakeTheirPath holds seeds of the flood defences to the path their
// name says, so a change to the input layout cannot quietly turn them into seeds of
// something else.
func TestFuzzSeedsTakeTheirPath(t *testing.T) {
	rig := newFuzzRig(t)
	// Seeds that must also not count a reason.
	never := map[string]Reason{"nat tcp syn again after a stale answer keeps its port": ReasonNATNewPort}
	for _, tc := range []struct {
		seed string
		want Reason
	}{
		{"dsr tcp ack v4, half-open flow established", ReasonFlowEstablished},
		{"dsr udp second datagram establishes", ReasonFlowEstablished},
		{"tunnel ack, half-open flow established", ReasonFlowEstablished},
		{"nat tcp ack v4, half-open flow established", ReasonFlowEstablished},
		{"nat udp second datagram establishes", ReasonFlowEstablished},
		{"nat tcp syn again, half-open flow", ReasonFlowHit},
		{"nat half-open flow expired", ReasonFlowNew},
		{"nat syn on a closing flow's 5-tuple", ReasonFlowNew},
		{"nat syn on an established flow", ReasonFlowHit},
		{"nat half-open flow whose port a newer flow took", ReasonFlowNew},
		{"nat reply to a half-open flow", ReasonNATReply},
		{"nat reply to a half-open flow answering its syn", ReasonNATReply},
		{"nat reply to a half-open flow acknowledging its syn's data", ReasonNATReply},
		{"nat reply to a half-open flow, another connection's answer", ReasonPassNATStale},
		{"nat tcp syn again, backend silent: a new port", ReasonNATNewPort},
		{"nat tcp syn again after a stale answer keeps its port", ReasonFlowHit},
		{"nat tcp syn again after a kept stale answer: a new port", ReasonNATNewPort},
		{"nat ring's first port held by a live established flow", ReasonFlowNew},
		{"nat single port held by a live established flow, ring", ReasonDropNATPorts},
		{"nat new flow over the rate limit", ReasonDropFlowRate},
		{"nat new flow within the burst", ReasonFlowNew},
		{"nat established flow over the rate limit", ReasonFlowHit},
		{"dsr new flow over the rate limit, untracked", ReasonFlowUntracked},
		{"tunnel new flow over the rate limit, untracked", ReasonFlowUntracked},
		{"nat known flow, backend's next hop cached", ReasonTX},
		{"nat known flow, backend's next hop cached on wf0", ReasonRedirect},
		{"nat known flow refreshed, backend's next hop stale", ReasonDropNoRoute},
		{"icmp from backend quoting a half-open flow", ReasonICMPTranslated},
		{"icmp from backend quoting a half-open flow, its tcp checksum past the ip packet", ReasonICMPTranslated},
		{"icmp from client side quoting a half-open flow", ReasonICMPTranslated},
		{"icmp parameter problem from backend, v4", ReasonICMPTranslated},
		{"icmp frag needed from backend, v4, 45-byte quote", ReasonICMPTranslated},
		{"icmpv6 packet too big from backend, 61-byte quote", ReasonICMPTranslated},
		{"icmp frag needed from backend, v4, 560-byte quote", ReasonICMPTranslated},
		{"icmpv6 packet too big from client side, dsr flow known, 1,180-byte quote", ReasonICMPToBackend},
		{"icmp quote with ip options", ReasonICMPTranslated},
		{"icmpv6 parameter problem from backend, quote with dest options", ReasonICMPTranslated},
		{"icmpv6 parameter problem from client side, dsr flow unknown, quote with two options headers", ReasonICMPToBackend},
		{"icmpv6 packet too big from backend, quote's ports past 560 bytes", ReasonPassNotService},
		{"icmpv6 packet too big from backend, quote's options header cut", ReasonPassNotService},
		{"icmp frag needed from backend, v4, checksum wrong", ReasonDropICMPChecksum},
		{"icmp time exceeded from client side, v4, checksum wrong", ReasonDropICMPChecksum},
		{"icmpv6 packet too big from client side, dsr flow unknown, checksum wrong", ReasonDropICMPChecksum},
		{"icmp from client side, flow without nat port, checksum wrong", ReasonPassNotService},
		{"icmp frag needed from backend, v4, quoted header's checksum wrong", ReasonDropICMPChecksum},
		{"icmp time exceeded from client side, v4, quote with ip options, its header's checksum not checked", ReasonICMPTranslated},
		{"icmp frag needed from client side, dsr flow known, quoted header's checksum wrong", ReasonDropICMPChecksum},
		{"icmpv6 parameter problem from backend", ReasonICMPTranslated},
		{"icmp parameter problem from client side, v4", ReasonICMPTranslated},
		{"icmp parameter problem from client side, dsr flow known", ReasonICMPToBackend},
		{"icmpv6 parameter problem from client side, dsr flow unknown", ReasonICMPToBackend},
		{"icmp frag needed from client side, dsr flow known", ReasonICMPToBackend},
		{"icmpv6 packet too big from client side, dsr flow unknown", ReasonICMPToBackend},
		{"icmp frag needed from client side, tunnel flow known", ReasonICMPToBackend},
		{"icmp frag needed from client side, tunnel flow known, quote with ip options", ReasonICMPToBackend},
		{"icmpv6 packet too big from client side, tunnel flow unknown, previous table", ReasonICMPToBackend},
		{"icmp port unreachable from client side, tunnel udp flow known", ReasonICMPToBackend},
		{"icmp frag needed from client side, dsr service without backends", ReasonDropNoBackend},
		{"icmp frag needed from client side, dsr flow unknown, previous table", ReasonICMPToBackend},
		{"icmp frag needed from client side, dsr flow known, to an address not the vip", ReasonPassNotService},
		{"icmpv6 packet too big from client side, tunnel flow known, to an address not the vip", ReasonPassNotService},
		{"icmp time exceeded from client side quoting a later fragment, udp flow known", ReasonPassNotService},
		{"icmp time exceeded from client side quoting a first fragment, udp flow known", ReasonICMPToBackend},
		{"icmp frag needed from client side, dsr flow known, ports past the ip packet", ReasonPassNotService},
		{"icmp frag needed from client side, dsr flow known, ports at the ip packet's end", ReasonICMPToBackend},
		{"dsr tcp syn v4, p2c second candidate less loaded", ReasonFlowSecondChoice},
		{"nat tcp syn v4, p2c second candidate less loaded", ReasonFlowSecondChoice},
		{"nat udp v6, p2c second candidate less loaded", ReasonFlowSecondChoice},
		{"tunnel v6 syn, p2c second candidate less loaded", ReasonFlowSecondChoice},
		{"dsr tcp ack v4 of an unknown flow, p2c keeps the first candidate", ReasonFlowNew},
		{"dsr tcp syn again, half-open flow", ReasonFlowHit},
		{"dsr tcp fin, known flow counted closed", ReasonFlowHit},
		{"dsr tcp fin, half-open flow established closing", ReasonFlowEstablished},
		{"fallback dsr ack unknown, previous table disagrees", ReasonFlowFallback},
		{"fallback dsr syn takes the current table", ReasonFlowNew},
		{"fallback dsr previous pick unusable", ReasonFlowNew},
		{"fallback dsr known flow keeps its backend", ReasonFlowHit},
		{"fallback dsr over the rate limit, untracked", ReasonFlowUntracked},
		{"fallback nat ack unknown, previous table disagrees", ReasonFlowFallback},
		{"fallback nat previous pick unusable", ReasonFlowNew},
		{"fallback nat half-open flow expired", ReasonFlowFallback},
		{"fallback tunnel ack unknown, previous table disagrees", ReasonFlowFallback},
		{"fallback tunnel previous pick unusable", ReasonFlowNew},
		{"fallback no current table, draining backend keeps the flow", ReasonFlowFallback},
		{"fallback no current table, syn dropped", ReasonDropNoBackend},
		{"fallback never for udp, previous table disagrees", ReasonFlowNew},
		{"tcp data offset past the packet to vip", ReasonDropMalformedL4},
		{"tcp data offset below 5 to vip, v6", ReasonDropMalformedL4},
		{"udp length below 8 to vip", ReasonDropMalformedL4},
		{"udp length past the packet to vip, nat v6", ReasonDropMalformedL4},
		{"nat new flow, backend's next hop cached on an interface not in tx_ports", ReasonDropNoTXPort},
		{"nat udp v4 too big for the route, df", ReasonNATTooBig},
		{"nat udp v4 too big for the route, no df", ReasonDropTooBig},
		{"nat tcp v6 too big for the route", ReasonNATTooBig},
		{"nat tcp v6 too big, vlan tagged", ReasonNATTooBig},
		{"nat tcp v4 on a backend another service shares", ReasonFlowNew},
		{"nat udp v4 routed backend's reply", ReasonNATReply},
		{"nat reply to a client on vlan 7", ReasonNATReply},
		{"nat tagged reply to an untagged client", ReasonNATReply},
		{"nat tagged reply to a client on vlan 7", ReasonNATReply},
		{"nat udp v6 zero checksum", ReasonDropNoRoute},
		{"icmpv6 port unreachable from backend, quoted udp checksum zero", ReasonICMPTranslated},
		{"icmp port unreachable from backend, v4, quoted udp checksum zero", ReasonICMPTranslated},
		{"tcp syn to a dsr vip in a broadcast frame", ReasonPassL2Group},
		{"ipv6 routing header with segments left to vip", ReasonDropIPv6Extension},
		{"ipv6 routing header with segments left to vip, nat", ReasonDropIPv6Extension},
	} {
		t.Run(tc.seed, func(t *testing.T) {
			i := slices.IndexFunc(fuzzSeeds, func(s struct {
				name string
				in   []byte
			}) bool {
				return s.name == tc.seed
			})
			if i < 0 {
				t.Fatalf("no seed %q", tc.seed)
			}
			got := rig.check(t, fuzzSeeds[i].in)
			if !slices.Contains(got.Reasons, tc.want) {
				t.Errorf("counted %v; want %s among them", got.Reasons, tc.want)
			}
			if not, ok := never[tc.seed]; ok && slices.Contains(got.Reasons, not) {
				t.Errorf("counted %v; want no %s", got.Reasons, not)
			}
		})
	}
}

// fuzzSeeds hold each kind of frame, valid and malformed. The layout of an input
// is decodeFuzz's.
var fuzzSeeds = []struct {
	name string
	in   []byte
}{
	// target, client, sport, flags, opts, ext count [ext...], payload, mutation [args], seeds [args]
	{"dsr tcp syn v4", []byte{0, 0, 0, 0, packet.SYN}},
	{"dsr tcp ack v4, flow known", []byte{0, 0, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0}},
	{"dsr tcp ack v4, flow on an unusable slot", []byte{0, 0, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 3}},
	{"dsr tcp syn v4 overwrites a known flow", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 0, 1, 1}},
	{"dsr udp v4 source hash", []byte{0, 1, 2, 1, 0, 0, 0, 5}},
	{"dsr service without usable backend", []byte{0, 2, 0, 0, packet.SYN}},
	{"dsr tcp syn v6", []byte{0, 3, 1, 0, packet.SYN}},
	{"vlan tagged", []byte{0, 0, 0, 0, packet.SYN, 0x01}},
	{"ipv4 options", []byte{0, 0, 0, 0, packet.SYN, 0xa0}},
	{"ipv4 first fragment to vip", []byte{0, 0, 0, 0, packet.SYN, 0x02}},
	{"ipv4 later fragment to vip", []byte{0, 0, 0, 0, packet.SYN, 0x04}},
	{"ipv4 fragment not to vip", []byte{0, 9, 0, 0, packet.SYN, 0x02}},
	{"ipv6 hop-by-hop, routing, dest options", []byte{0, 3, 0, 0, packet.SYN, 0, 3, 0, 1 | 2<<3, 2}},
	{"ipv6 four long option headers", []byte{0, 3, 0, 0, packet.SYN, 0, 4, 0 | 5<<3, 1, 2 | 9<<3, 2}},
	{"ipv6 five option headers", []byte{0, 3, 0, 0, packet.SYN, 0, 5, 0, 2, 1, 2, 2}},
	{"ipv6 fragment header", []byte{0, 3, 0, 0, packet.SYN, 0, 1, 3}},
	{"ipv6 option then fragment header", []byte{0, 3, 0, 0, packet.SYN, 0, 2, 0, 3}},
	{"ipv6 ah", []byte{0, 3, 0, 0, packet.SYN, 0, 1, 4}},
	{"ipv6 esp", []byte{0, 3, 0, 0, packet.SYN, 0, 1, 5}},
	{"ipv6 no next header", []byte{0, 3, 0, 0, packet.SYN, 0, 1, 6}},
	{"ipv6 option header length past the frame", []byte{0, 3, 0, 0, packet.SYN, 0, 2, 0, 0, 0, 4, 0, 55, 200}},
	{"ipv6 nat, extension headers end beyond 512 bytes", []byte{0, 6, 0, 0, packet.SYN, 0, 2, 0 | 30<<3, 2 | 30<<3}},
	{"ethernet header only", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 1, 0, 0}},
	{"truncated vlan tag", []byte{0, 0, 0, 0, packet.SYN, 0x01, 0, 0, 1, 0, 2}},
	{"truncated ipv4 header", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 1, 0, 26}},
	{"truncated tcp header to vip", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 7, 0, 30}},
	{"tcp data offset past the packet to vip", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 4, 0, 14 + 20 + 12, 0xf0}},
	{"tcp data offset below 5 to vip, v6", []byte{0, 3, 0, 0, packet.SYN, 0, 0, 0, 4, 0, 14 + 40 + 12, 0x20}},
	{"udp length below 8 to vip", []byte{0, 1, 0, 0, 0, 0, 0, 0, 4, 0, 14 + 20 + 5, 4}},
	{"udp length past the packet to vip, nat v6", []byte{0, 7, 0, 0, 0, 0, 0, 0, 4, 0, 14 + 40 + 5, 200}},
	{"truncated udp header not to vip", []byte{0, 10, 0, 0, 0, 0, 0, 0, 7, 0, 44}},
	{"truncated udp header to vip, v6", []byte{0, 7, 0, 0, 0, 0, 0, 0, 7, 0, 44}},
	{"truncated ipv6 header", []byte{0, 3, 0, 0, packet.SYN, 0, 0, 0, 1, 0, 30}},
	{"ipv6 routing header with segments left to vip", []byte{0, 3, 0, 0, packet.SYN, 0, 1, 1, 0, 4, 0, 14 + 40 + 3, 1}},
	{"ipv6 routing header with segments left to vip, nat", []byte{0, 6, 0, 0, packet.SYN, 0, 1, 1, 0, 4, 0, 14 + 40 + 3, 1}},
	{"ipv4 ihl below 5", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 2, 0x44}},
	{"ipv4 version 6 in an ipv4 frame", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 2, 0x65}},
	{"ipv4 ihl past total length", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 2, 0x4f}},
	{"ipv4 total length past the frame", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 3, 40}},
	{"ipv6 payload length past the frame", []byte{0, 3, 0, 0, packet.SYN, 0, 0, 0, 3, 1}},
	{"ipv4 total length ends before the tcp header", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 6, 4}},
	{"ethernet padding after the datagram", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 5, 20}},
	{"icmp echo to vip", []byte{0, 21, 0, 0, 0}},
	{"gre to vip", []byte{0, 22, 0, 0, 0}},
	{"vip, wrong port", []byte{0, 8, 0, 0, packet.SYN}},
	{"nat tcp syn v4", []byte{0, 4, 0, 0, packet.SYN}},
	{"nat tcp syn v4, single port", []byte{1, 4, 0, 0, packet.SYN}},
	{"nat udp v4 zero checksum", []byte{0, 5, 0, 0, 0, 0x08, 0, 3}},
	{"nat tcp v6", []byte{0, 6, 0, 0, packet.ACK}},
	{"nat udp v6", []byte{0, 7, 0, 0, 0, 0, 0, 9}},
	{"nat udp v6 zero checksum", []byte{0, 7, 0, 0, 0, 0x08, 0, 9}},
	{"nat known flow, refreshed", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 1, 1}},
	{"nat known flow, backend's next hop cached", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0x01}},
	{"nat known flow, backend's next hop cached on wf0", []byte{0, 6, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0x02}},
	{"nat known flow refreshed, backend's next hop stale", []byte{0, 5, 0, 0, 0, 0, 0, 0, 0, 3, 0, 1, 1, 0, 0, 0x01 | 1<<2}},
	{"nat new flow, backend's next hop cached, too short", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01 | 2<<4}},
	{"nat new flow, backend's next hop cached on an interface not in tx_ports", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x03}},
	{"nat known flow, fin", []byte{0, 4, 0, 0, packet.FIN | packet.ACK, 0, 0, 0, 0, 1, 0, 1, 0}},
	{"nat known flow expired", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 1, 4}},
	{"nat udp v4 routed", []byte{0, 32, 0, 0, 0, 0, 0, 5}},
	{"nat udp v4 too big for the route, df", []byte{0, 32, 0, 0, 0, 0xa0, 0, 255, 0, 0, 0, 0, 0, 0, 0, 0x40}},
	{"nat udp v4 too big for the route, no df", []byte{0, 32, 0, 0, 0, 0xa0, 0, 255}},
	{"nat tcp v6 too big for the route", []byte{0, 33, 0, 0, packet.ACK, 0, 0, 255}},
	{"nat tcp v6 too big, vlan tagged", []byte{0, 33, 0, 0, packet.ACK, 0x01, 0, 255}},
	{"nat tcp v4 on a backend another service shares", []byte{0, 34, 0, 0, packet.SYN}},
	{"nat udp v4 routed backend's reply", []byte{0, 35, 0, 0, 0, 0, 0, 5, 0, 2}},
	{"nat tcp syn v4, vlan tagged: untagged to the backend", []byte{0, 4, 0, 0, packet.SYN, 0x01}},
	{"nat udp v4 routed, vlan tagged: untagged to the backend", []byte{0, 32, 0, 0, 0, 0x01, 0, 5}},
	{"nat reply to a client on vlan 7", []byte{0, 35, 0, 0, 0, 0, 0, 5, 0, 2, 0, 0, 0, 0, 0xa0}},
	{"nat tagged reply to an untagged client", []byte{0, 35, 0, 0, 0, 0x01, 0, 5, 0, 2, 0, 0, 0, 0, 0x20}},
	{"nat tagged reply to a client on vlan 7", []byte{0, 13, 0, 0, packet.ACK, 0x01, 0, 5, 0, 2, 0, 0, 0, 0, 0xa0}},
	{"nat closing flow expired", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 1, 0x12}},
	{"nat syn on a closing flow's 5-tuple", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 1, 0, 1, 0x10}},
	{"nat syn on an established flow", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 1, 0, 1, 0}},
	{"nat known flow on an unusable backend", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 1, 1, 0}},
	{"nat single port held by a live flow", []byte{1, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 6, 0, 0, 0, 1, 0}},
	{"nat single port held by an ended flow", []byte{1, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 6, 0, 0, 0, 1, 4}},
	{"nat single port held, holder gone", []byte{1, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 2, 0, 0, 0, 1}},
	{"nat single port held by this flow, its backend unusable", []byte{1, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 6, 0, 0, 0, 2 | 1<<2, 0}},
	{"nat reply v4 tcp", []byte{0, 11, 0, 0, packet.SYN | packet.ACK, 0, 0, 0, 0, 6, 0, 0x40, 0}},
	{"nat reply v4 tcp back where the client came from", []byte{0, 11, 0, 0, packet.ACK, 0, 0, 0, 0, 6, 0, 0x40, 0, 0, 0x20}},
	{"nat reply v6 udp back where the client came from", []byte{1, 14, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0x20}},
	{"nat reply v4 tcp rst", []byte{0, 11, 0, 0, packet.RST, 0, 0, 0, 0, 6, 0, 0x40, 0}},
	{"nat reply v4 udp", []byte{0, 12, 1, 0, 0, 0, 0, 4, 0, 2, 0, 0x10}},
	{"nat reply v6 tcp fin", []byte{0, 13, 0, 0, packet.FIN, 0, 0, 0, 0, 6, 0, 0x20, 0}},
	{"nat reply v6 udp", []byte{1, 14, 0, 0, 0, 0, 0, 0, 0, 2}},
	{"untracked packet to the nat address", []byte{0, 11, 0, 0, packet.ACK}},
	{"icmp frag needed from backend, v4", []byte{0, 15, 0, 0, 4 << 3, 0, 0, 255, 0, 2}},
	{"icmp port unreachable from backend, v4 udp, 8-byte quote", []byte{0, 19, 0, 0, 3 << 3, 0, 0, 28, 0, 2}},
	{"icmpv6 packet too big from backend", []byte{0, 16, 0, 0, 1, 0, 0, 255, 0, 2}},
	{"icmpv6 port unreachable from backend, quoted udp checksum zero", []byte{0, 16, 0, 0, 4 << 3, 0x08, 0, 255, 0, 2}},
	{"icmp port unreachable from backend, v4, quoted udp checksum zero", []byte{0, 19, 0, 0, 3 << 3, 0x08, 0, 255, 0, 2}},
	{"icmp time exceeded from client side, v4", []byte{0, 17, 0, 0, 1, 0, 0, 255, 0, 1, 0, 1}},
	{"icmpv6 unreachable from client side", []byte{0, 18, 0, 0, 0, 0, 0, 255, 0, 1, 0, 1}},
	{"icmp from client side, flow without nat port", []byte{0, 20, 0, 0, 0, 0, 0, 255, 0, 1, 0, 0}},
	{"icmp frag needed from client side, dsr flow known", []byte{0, 36, 0, 0, 4 << 3, 0, 0, 255, 0, 1, 0, 1}},
	{"icmp parameter problem from backend, v4", []byte{0, 15, 0, 0, 7, 0, 0, 255, 0, 2}},
	{"icmp frag needed from backend, v4, 45-byte quote", []byte{0, 15, 0, 0, 4 << 3, 0, 0, 45, 0, 2}},
	{"icmpv6 packet too big from backend, 61-byte quote", []byte{0, 16, 0, 0, 1, 0, 0, 61, 0, 2}},
	{"icmp frag needed from backend, v4, 560-byte quote", []byte{0, 15, 0, 0, 4 << 3, 0, 0, 236, 0, 2}},
	{"icmpv6 packet too big from client side, dsr flow known, 1,180-byte quote", []byte{0, 37, 1, 0, 1, 0, 0, 251, 0, 1, 0, 1}},
	{"icmp frag needed from backend, v4, checksum wrong", []byte{0, 15, 0, 0, 4 << 3, 0, 0, 255, 4, 0, 40, 0xff, 2}},
	{"icmp time exceeded from client side, v4, checksum wrong", []byte{0, 17, 0, 0, 1, 0, 0, 255, 4, 0, 40, 0xff, 1, 0, 1}},
	{"icmpv6 packet too big from client side, dsr flow unknown, checksum wrong", []byte{0, 37, 1, 0, 1, 0, 0, 255, 4, 0, 60, 0xff, 0, 0, 0, 0}},
	{"icmp from client side, flow without nat port, checksum wrong", []byte{0, 20, 0, 0, 0, 0, 0, 255, 4, 0, 40, 0xff, 1, 0, 0}},
	{"icmp frag needed from backend, v4, quoted header's checksum wrong", []byte{0, 15, 0, 0, 4 << 3, 0xb0, 0, 255, 0, 2}},
	{"icmp time exceeded from client side, v4, quote with ip options, its header's checksum not checked", []byte{0, 17, 0, 0, 1, 0xc0, 0, 255, 0, 1, 0, 1}},
	{"icmp frag needed from client side, dsr flow known, quoted header's checksum wrong", []byte{0, 36, 0, 0, 4 << 3, 0xb0, 0, 255, 0, 1, 0, 1}},
	{"icmpv6 parameter problem from backend", []byte{0, 16, 0, 0, 6, 0, 0, 255, 0, 2}},
	{"icmp parameter problem from client side, v4", []byte{0, 17, 0, 0, 7, 0, 0, 255, 0, 1, 0, 1}},
	{"icmp parameter problem from client side, dsr flow known", []byte{0, 36, 0, 0, 7, 0, 0, 255, 0, 1, 0, 1}},
	{"icmpv6 parameter problem from client side, dsr flow unknown", []byte{0, 37, 1, 0, 6, 0, 0, 255, 0, 0, 0, 0}},
	{"icmpv6 packet too big from client side, dsr flow unknown", []byte{0, 37, 1, 0, 1, 0, 0, 255, 0, 0, 0, 0}},
	{"icmp frag needed from client side, tunnel flow known", []byte{0, 38, 0, 0, 4 << 3, 0, 0, 255, 0, 1, 0, 1}},
	{"icmp frag needed from client side, tunnel flow known, quote with ip options", []byte{0, 38, 0, 0, 4 << 3, 0x30, 0, 255, 0, 1, 0, 1}},
	{"icmpv6 packet too big from client side, tunnel flow unknown, previous table", []byte{0, 39, 2, 0, 1, 0, 0, 255, 0, 0, 0, 0}},
	{"icmp port unreachable from client side, tunnel udp flow known", []byte{0, 40, 0, 0, 3 << 3, 0, 0, 255, 0, 1, 0, 1}},
	{"icmp frag needed from client side, dsr service without backends", []byte{0, 41, 0, 0, 4 << 3, 0, 0, 255, 0, 0, 0, 0}},
	{"icmp frag needed from client side, dsr flow unknown, previous table", []byte{0, 42, 3, 0, 4 << 3, 0, 0, 255, 0, 0, 0, 0}},
	{"icmp frag needed from client side, dsr flow known, to an address not the vip", []byte{0, 36, 0, 0, 4 << 3, 0x08, 0, 255, 0, 1, 0, 1}},
	{"icmpv6 packet too big from client side, tunnel flow known, to an address not the vip", []byte{0, 39, 0, 0, 1, 0x08, 0, 255, 0, 1, 0, 1}},
	{"icmp time exceeded from client side quoting a later fragment, udp flow known", []byte{0, 40, 0, 0, 1, 0x04, 0, 255, 0, 1, 0, 1}},
	{"icmp time exceeded from client side quoting a first fragment, udp flow known", []byte{0, 40, 0, 0, 1, 0x02, 0, 255, 0, 1, 0, 1}},
	{"icmp frag needed from client side, dsr flow known, ports past the ip packet", []byte{0, 36, 0, 0, 4 << 3, 0, 0, 255, 3, 0xe7, 1, 0, 1}},
	{"icmp frag needed from client side, dsr flow known, ports at the ip packet's end", []byte{0, 36, 0, 0, 4 << 3, 0, 0, 255, 3, 0xe8, 1, 0, 1}},
	{"icmp quote with ip options", []byte{0, 15, 0, 0, 4 << 3, 0x10, 0, 255, 0, 2}},
	{"icmpv6 parameter problem from backend, quote with dest options", []byte{0, 16, 0, 0, 6 | 2<<3, 0x10, 1, 2, 255, 0, 2}},
	{"icmpv6 parameter problem from client side, dsr flow unknown, quote with two options headers", []byte{0, 37, 1, 0, 6 | 2<<3, 0x10, 2, 0, 2, 255, 0, 0, 0, 0}},
	{"icmpv6 packet too big from backend, quote's ports past 560 bytes", []byte{0, 16, 0, 0, 1, 0x10, 2, 0, 2 | 30<<3, 255, 0, 2}},
	{"icmpv6 packet too big from backend, quote's options header cut", []byte{0, 16, 0, 0, 1, 0x10, 1, 2, 41, 0, 2}},
	{"icmp echo reply (not an error)", []byte{0, 15, 0, 0, 3, 0, 0, 255, 0, 2}},
	// Tunnel: targets 24 (IPv4 VIP, TCP; backends 10.78.0.11, 10.78.0.12, fd78::13),
	// 25 (IPv6 VIP, TCP; fd78::11, fd78::12, 10.78.0.13) and 26 (IPv4 VIP, UDP, source
	// hash). A known flow (seeds bit 0) picks the backend by its index (byte 10);
	// .11 and .13 have resolved neighbours, .12 has none. Byte 15 is the cached hop.
	{"tunnel v4 syn by the lookup table", []byte{0, 24, 0, 0, packet.SYN}},
	{"tunnel v4-in-v4, fib next hop cached, redirect", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0}},
	{"tunnel v4-in-v6, fib next hop cached, redirect", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 2}},
	{"tunnel v4-in-v4, neighbour unresolved", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 1}},
	{"tunnel v6-in-v6", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0}},
	{"tunnel v6-in-v4", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 2}},
	{"tunnel v6-in-v6, neighbour unresolved", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 1}},
	{"tunnel udp v4 source hash", []byte{0, 26, 1, 2, 0, 0, 0, 9}},
	{"tunnel vlan tagged", []byte{0, 24, 0, 0, packet.ACK, 0x01, 0, 0, 0, 1, 0}},
	{"tunnel v6 vlan tagged, hop cached", []byte{0, 25, 0, 0, packet.ACK, 0x01, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0x01}},
	{"tunnel v6 with extension headers", []byte{0, 25, 0, 0, packet.ACK, 0, 2, 0, 2 | 2<<3, 0, 0, 1, 0}},
	{"tunnel fresh cached hop on the receiving interface", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0x01}},
	{"tunnel fresh cached hop on an interface in tx_ports", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0x02}},
	{"tunnel fresh cached hop on an interface not in tx_ports", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0x03}},
	{"tunnel fresh cached hop on a backend without neighbour", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0x01}},
	{"tunnel fresh cached hop just now", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0x01 | 3<<2}},
	{"tunnel stale cached hop", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0x01 | 1<<2}},
	{"tunnel cached hop from the future", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0x01 | 2<<2}},
	{"tunnel stale cached hop, neighbour unresolved", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0x01 | 1<<2}},
	{"tunnel cached hop too short (0)", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0x01 | 1<<4}},
	{"tunnel cached hop one byte too short", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0x01 | 2<<4}},
	{"tunnel cached hop exactly long enough", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0x01 | 3<<4}},
	{"tunnel stale cached hop too short", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0x01 | 1<<2 | 1<<4}},
	{"tunnel cached hop on the first backend only", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0x81}},
	{"tunnel ethernet padding", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 5, 30, 1, 0}},
	{"tunnel v6 ethernet padding, hop cached", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 0, 5, 30, 1, 0, 0, 0, 0, 0, 0x01}},
	{"tunnel too big v4 with df", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 255, 0, 1, 0, 0, 0, 0, 0, 0x40}},
	{"tunnel too big v4 without df", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 255, 0, 1, 0}},
	{"tunnel too big v4-in-v6 with df", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 254, 0, 1, 2, 0, 0, 0, 0, 0x40}},
	{"tunnel too big v4 with df and options, vlan", []byte{0, 24, 0, 0, packet.ACK, 0x31, 0, 255, 0, 1, 0, 0, 0, 0, 0, 0x40}},
	{"tunnel too big v4 with df, padded", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 255, 5, 33, 1, 0, 0, 0, 0, 0, 0x40}},
	{"tunnel v4 exactly at the mtu", []byte{0, 24, 0, 0, packet.ACK, 0x50, 0, 253, 0, 1, 0, 0, 0, 0, 0, 0x40}},
	{"tunnel v4 one word above the mtu", []byte{0, 24, 0, 0, packet.ACK, 0x60, 0, 253, 0, 1, 0, 0, 0, 0, 0, 0x40}},
	{"tunnel too big past a fresh cached hop", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 255, 0, 1, 0, 0, 0, 0, 0, 0x41 | 1<<4}},
	{"tunnel too big within a fresh cached hop's length", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 255, 0, 1, 0, 0, 0, 0, 0, 0x01}},
	{"tunnel ipv6 too big", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 255, 0, 1, 0}},
	{"tunnel ipv6 too big, ipv4 outer", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 255, 0, 1, 2}},
	{"tunnel ipv6 too big, vlan", []byte{0, 25, 0, 0, packet.ACK, 0x01, 0, 255, 0, 1, 0}},
	{"tunnel ipv6 too big, extension headers quoted", []byte{0, 25, 0, 0, packet.ACK, 0, 1, 2 << 3, 255, 0, 1, 0}},
	{"tunnel ipv6 too big, quote past 200 bytes", []byte{0, 25, 0, 0, packet.ACK, 0, 1, 20 << 3, 255, 0, 1, 0}},
	{"tunnel ipv6 too big, neighbour unresolved", []byte{0, 25, 0, 0, packet.ACK, 0, 0, 255, 0, 1, 1}},
	{"tunnel udp too big", []byte{0, 26, 0, 0, 0, 0, 0, 255, 0, 0, 0, 0, 0, 0, 0, 0x40}},
	{"tunnel service without backend for the flow's slot", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1, 3}},
	// Half-open flows, the nat port ring and the new-flow limit. Seeds byte 9: bits
	// 3-5 put the flow, the reverse entries, the holder in the half-open tables; bits
	// 6-7 place the port rings. Byte 16 is the new-flow limit's word (program 1).
	{"dsr tcp ack v4, half-open flow established", []byte{0, 0, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 8, 0}},
	{"dsr tcp ack v4, half-open flow on an unusable slot", []byte{0, 0, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 8, 3}},
	{"dsr udp second datagram establishes", []byte{0, 1, 2, 1, 0, 0, 0, 5, 0, 1 | 8}},
	{"tunnel ack, half-open flow established", []byte{0, 24, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 8, 0}},
	{"nat tcp ack v4, half-open flow established", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 2 | 8 | 0x10, 0, 1, 0, 0, 0}},
	{"nat tcp ack v6, half-open flow established, next hop cached", []byte{0, 6, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 2 | 8 | 0x10, 0, 1, 0x40, 0, 0}},
	{"nat udp second datagram establishes", []byte{0, 5, 0, 0, 0, 0, 0, 3, 0, 1 | 2 | 8 | 0x10, 0, 1, 0, 0, 0}},
	{"nat tcp fin, half-open flow established closing", []byte{0, 4, 0, 0, packet.FIN | packet.ACK, 0, 0, 0, 0, 1 | 2 | 8 | 0x10, 0, 1, 0, 0, 0}},
	{"nat tcp syn again, half-open flow", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 1 | 2 | 8 | 0x10, 0, 1, 0, 0, 0}},
	{"nat half-open flow expired", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 2 | 8 | 0x10, 0, 1, 1, 0, 0}},
	{"nat half-open flow whose port a newer flow took", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 2 | 8 | 0x10, 0, 1, 0, 1, 0}},
	{"nat half-open flow on an unusable backend", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 2 | 8 | 0x10, 1, 1, 0, 0, 0}},
	{"nat half-open flow, reverse entry established elsewhere", []byte{0, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 1 | 2 | 8, 0, 1, 0, 0, 0}},
	{"nat reply to a half-open flow", []byte{0, 11, 0, 0, packet.SYN | packet.ACK, 0, 0, 0, 0, 2 | 0x10, 0, 0, 0, 0, 0}},
	// ... tun, tat, loads, handshake (the half-open flows' expected answer and flags).
	{"nat reply to a half-open flow answering its syn", []byte{0, 11, 0, 0, packet.SYN | packet.ACK, 0, 0, 0, 0, 2 | 4 | 0x10 | 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}},
	{"nat reply to a half-open flow acknowledging its syn's data", []byte{0, 11, 0, 0, packet.SYN | packet.ACK, 0, 0, 0, 0, 2 | 4 | 0x10 | 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2}},
	{"nat reply to a half-open flow, another connection's answer", []byte{0, 11, 0, 0, packet.SYN | packet.ACK, 0, 0, 0, 0, 2 | 4 | 0x10 | 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3}},
	{"nat tcp syn again, backend silent: a new port", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 1 | 2 | 8 | 0x10 | 0x40, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2}},
	{"nat tcp syn again after a stale answer keeps its port", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 1 | 2 | 8 | 0x10 | 0x40, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2 | 1<<2}},
	{"nat tcp syn again after a kept stale answer: a new port", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 1 | 2 | 8 | 0x10 | 0x40, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2 | 3<<2}},
	{"nat reply rst to a half-open flow", []byte{0, 11, 0, 0, packet.RST, 0, 0, 0, 0, 2 | 4 | 0x10 | 0x20, 0, 0, 0, 0, 0}},
	{"nat reply v6 udp to a half-open flow", []byte{1, 14, 0, 0, 0, 0, 0, 0, 0, 2 | 0x10}},
	{"nat ring's first port held by a live established flow", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 2 | 4, 0, 0, 0, 1, 0}},
	{"nat ring's first port held by an expired flow", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 2 | 4, 0, 0, 0, 1, 4}},
	{"nat ring's first port held by a half-open flow, taken over", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 2 | 4 | 0x10 | 0x20, 0, 0, 0, 1, 0}},
	{"nat ring one past the seeded port", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 2 | 4 | 0x40, 0, 0, 0, 1, 0}},
	{"nat ring about to wrap", []byte{0, 6, 0, 0, packet.SYN, 0, 0, 0, 0, 0xc0}},
	{"nat single port held by a live established flow, ring", []byte{1, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 2 | 4 | 0x80, 0, 0, 0, 1, 0}},
	{"nat new flow over the rate limit", []byte{1, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2}},
	{"nat new flow within the burst", []byte{1, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}},
	{"nat new flow, limit long idle", []byte{1, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3}},
	{"nat established flow over the rate limit", []byte{1, 4, 0, 0, packet.ACK, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 2}},
	{"dsr new flow over the rate limit, untracked", []byte{1, 0, 0, 0, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2}},
	{"tunnel new flow over the rate limit, untracked", []byte{1, 24, 0, 0, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2}},
	{"icmp from backend quoting a half-open flow", []byte{0, 15, 0, 0, 4 << 3, 0, 0, 255, 0, 2 | 0x10}},
	{"icmp from backend quoting a half-open flow, its tcp checksum past the ip packet", []byte{0, 15, 0, 0, 4 << 3, 0, 0, 255, 3, 0xf4, 2 | 0x10}},
	{"icmp from client side quoting a half-open flow", []byte{0, 17, 0, 0, 1, 0, 0, 255, 0, 1 | 8, 0, 1}},
	// maglev_p2c (services 0, 4, 7, 9): bytes 17-18 give backend slots their loads
	// (fuzzLoads, three bits a slot); each of these makes the flow's first candidate
	// busier than its second.
	{"dsr tcp syn v4, p2c second candidate less loaded", []byte{0, 0, 0, 2, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3}},
	{"nat tcp syn v4, p2c second candidate less loaded", []byte{0, 4, 0, 0, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3}},
	{"nat udp v6, p2c second candidate less loaded", []byte{0, 7, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x18}},
	{"tunnel v6 syn, p2c second candidate less loaded", []byte{0, 25, 0, 0, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3}},
	{"dsr tcp ack v4 of an unknown flow, p2c keeps the first candidate", []byte{0, 0, 0, 2, packet.ACK, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3}},
	{"dsr tcp syn v4, p2c loads tie", []byte{0, 0, 0, 2, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2 | 1<<3}},
	{"dsr tcp syn v4, p2c load unknown", []byte{0, 0, 0, 2, packet.SYN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3 | 4<<3}},
	{"dsr tcp syn again, half-open flow", []byte{0, 0, 0, 0, packet.SYN, 0, 0, 0, 0, 1 | 8, 0}},
	{"dsr tcp fin, known flow counted closed", []byte{0, 0, 0, 0, packet.FIN | packet.ACK, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1}},
	{"dsr tcp fin, half-open flow established closing", []byte{0, 0, 0, 0, packet.FIN | packet.ACK, 0, 0, 0, 0, 1 | 8, 0}},
	{"tunnel rst, known flow on an unusable slot", []byte{0, 25, 0, 0, packet.RST, 0, 0, 0, 0, 1, 3, 0, 0, 0, 0, 0, 0, 0x12, 0x34}},
	// The previous-table fallback: targets 27-31 (services 11-15) changed their tables
	// once (fuzzFirstGenerations). The source ports are ones whose previous pick
	// differs from the current one, or names the backend made unusable since.
	{"fallback dsr ack unknown, previous table disagrees", []byte{0, 27, 0, 128, packet.ACK}},
	{"fallback dsr syn takes the current table", []byte{0, 27, 0, 128, packet.SYN}},
	{"fallback dsr previous pick unusable", []byte{0, 27, 0, 2, packet.ACK}},
	{"fallback dsr known flow keeps its backend", []byte{0, 27, 0, 128, packet.ACK, 0, 0, 0, 0, 1, 0}},
	{"fallback dsr over the rate limit, untracked", []byte{1, 27, 0, 128, packet.ACK, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2}},
	{"fallback nat ack unknown, previous table disagrees", []byte{0, 28, 0, 131, packet.ACK}},
	{"fallback nat previous pick unusable", []byte{0, 28, 0, 0, packet.ACK}},
	{"fallback nat half-open flow expired", []byte{0, 28, 0, 131, packet.ACK, 0, 0, 0, 0, 1 | 2 | 8 | 0x10, 0, 1, 1, 0, 0}},
	{"fallback tunnel ack unknown, previous table disagrees", []byte{0, 29, 0, 133, packet.ACK}},
	{"fallback tunnel previous pick unusable", []byte{0, 29, 0, 128, packet.ACK}},
	{"fallback no current table, draining backend keeps the flow", []byte{0, 30, 0, 0, packet.ACK}},
	{"fallback no current table, syn dropped", []byte{0, 30, 0, 0, packet.SYN}},
	{"fallback never for udp, previous table disagrees", []byte{0, 31, 0, 0, 0}},
	{"raw bytes", []byte{0x0e, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}},
	{"raw ipv4 after ethernet", []byte{0x0c, 0, 0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0, 10, 77, 0, 1, 10, 77, 100, 1}},
	{"raw ipv6 after vlan", []byte{0x0c, 3, 0x60, 0, 0, 0, 0, 0, 6, 64}},
	{"tcp syn to a dsr vip in a broadcast frame", append([]byte{0x0e}, packet.Frame{DstMAC: net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff},
		SrcMAC: clientMAC, Src: netip.AddrPortFrom(fuzzClients4[0], 40000), Dst: netip.AddrPortFrom(fuzzVIPD4, 80), TCPFlags: packet.SYN}.Build()...)},
}

// The programs' services. Every address is fixed; the fuzz input picks among them.
var (
	fuzzVIPD4 = netip.MustParseAddr("10.77.100.1") // dsr
	fuzzVIPN4 = netip.MustParseAddr("10.77.100.2") // nat
	fuzzVIPD6 = netip.MustParseAddr("fd77:100::1")
	fuzzVIPN6 = netip.MustParseAddr("fd77:100::2")
	fuzzVIPT4 = netip.MustParseAddr("10.77.100.3") // tunnel
	fuzzVIPT6 = netip.MustParseAddr("fd77:100::3")
	fuzzNAT4  = netip.MustParseAddr("10.77.200.1")
	fuzzNAT6  = netip.MustParseAddr("fd77:200::1")
)

const fuzzSinglePort = 20000

func fuzzBackends(v6 bool, port uint16, net3 byte, n int) []Backend {
	out := make([]Backend, n)
	for i := range out {
		a := netip.AddrFrom4([4]byte{10, 77, net3, byte(11 + i)})
		if v6 {
			a = netip.MustParseAddr(fmt.Sprintf("fd77:%x::%x", net3, 0x11+i))
		}
		out[i] = Backend{Addr: netip.AddrPortFrom(a, port), MAC: net.HardwareAddr{2, 0, 0, net3, 1, byte(i)}, Weight: 1, Usable: true}
	}
	return out
}

func fuzzServices() []Service {
	svc := func(vip netip.Addr, port uint16, proto Protocol, fwd Forwarding, bes []Backend) Service {
		return Service{Key: ServiceKey{netip.AddrPortFrom(vip, port), proto}, Forwarding: fwd, TableSize: 31, Backends: bes}
	}
	s := []Service{
		svc(fuzzVIPD4, 80, TCP, ForwardDSR, fuzzBackends(false, 80, 0, 3)),
		svc(fuzzVIPD4, 53, UDP, ForwardDSR, fuzzBackends(false, 53, 0, 2)),
		svc(fuzzVIPD4, 81, TCP, ForwardDSR, fuzzBackends(false, 81, 2, 1)),
		svc(fuzzVIPD6, 80, TCP, ForwardDSR, fuzzBackends(true, 80, 0, 2)),
		svc(fuzzVIPN4, 80, TCP, ForwardNAT, fuzzBackends(false, 8080, 1, 3)),
		svc(fuzzVIPN4, 53, UDP, ForwardNAT, fuzzBackends(false, 5353, 1, 2)),
		svc(fuzzVIPN6, 443, TCP, ForwardNAT, fuzzBackends(true, 8443, 1, 2)),
		svc(fuzzVIPN6, 53, UDP, ForwardNAT, fuzzBackends(true, 5353, 1, 2)),
	}
	s[0].Backends[2].Weight = 0     // usable, but in no table slot: known flows keep it
	s[1].SourceHash = true          // client affinity
	s[2].Backends[0].Usable = false // no usable backend: no table at all
	s[3].Backends[1].Usable = false
	s[4].Backends[1].Usable = false
	// Tunnel services: backends of both families behind each VIP family.
	tunnel := func(port uint16, addrs ...string) []Backend {
		out := make([]Backend, len(addrs))
		for i, a := range addrs {
			out[i] = Backend{Addr: netip.AddrPortFrom(netip.MustParseAddr(a), port), Weight: 1, Usable: true}
		}
		return out
	}
	s = append(s,
		svc(fuzzVIPT4, 80, TCP, ForwardTunnel, tunnel(80, "10.78.0.11", "10.78.0.12", "fd78::13")),
		svc(fuzzVIPT6, 80, TCP, ForwardTunnel, tunnel(80, "fd78::11", "fd78::12", "10.78.0.13")),
		svc(fuzzVIPT4, 53, UDP, ForwardTunnel, tunnel(53, "10.78.0.11", "fd78::11", "fd78::12")),
	)
	s[10].SourceHash = true
	s[10].Backends[2].Usable = false
	// maglev_p2c in every mode, both families and protocols.
	for _, i := range []int{0, 4, 7, 9} {
		s[i].P2C = true
	}
	// Services whose table changed once (fuzzFirstGenerations holds what they had
	// before), so the previous generation is there for the fallback: one backend
	// added and one made unusable since (its old entries fall back to nothing), and
	// one service whose backends all drain, so it has no current table at all; and a
	// UDP service, which never falls back.
	s = append(s,
		svc(fuzzVIPD4, 82, TCP, ForwardDSR, fuzzBackends(false, 82, 3, 4)),
		svc(fuzzVIPN4, 81, TCP, ForwardNAT, fuzzBackends(false, 8081, 4, 4)),
		svc(fuzzVIPT6, 81, TCP, ForwardTunnel, tunnel(81, "fd78::11", "10.78.0.12", "fd78::13", "10.78.0.11")),
		svc(fuzzVIPD6, 81, TCP, ForwardDSR, fuzzBackends(true, 81, 3, 2)),
		svc(fuzzVIPD4, 54, UDP, ForwardDSR, fuzzBackends(false, 54, 3, 3)),
	)
	for _, i := range []int{11, 12, 13} {
		s[i].Backends[1].Usable = false
	}
	s[14].SourceHash = true
	s[14].Backends[0].Draining, s[14].Backends[1].Draining = true, true
	// nat services whose backends the fuzz namespace routes (the tunnel prefixes, MTU
	// fuzzMTU, one backend each with a resolved neighbour and one without): new flows
	// leave by wf0, wait for a neighbour, or are too big for the route. And one whose
	// backend is also service 4's first, whose port ring they share.
	s = append(s,
		svc(fuzzVIPN4, 54, UDP, ForwardNAT, tunnel(5354, "10.78.0.11", "10.78.0.12")),
		svc(fuzzVIPN6, 444, TCP, ForwardNAT, tunnel(8444, "fd78::11", "fd78::12")),
		svc(fuzzVIPN4, 82, TCP, ForwardNAT, fuzzBackends(false, 8080, 1, 1)),
	)
	return s
}

// fuzzFirstGenerations are the services (by index into fuzzServices) the rig
// installs first and then changes to fuzzServices' version, keeping this one as
// the previous generation.
func fuzzFirstGenerations() map[int]Service {
	first := map[int]Service{}
	for i, s := range fuzzServices() {
		switch i {
		case 11, 12, 13:
			s.Backends = slices.Clone(s.Backends[:3])
			s.Backends[1].Usable = true
		case 14:
			s.Backends = slices.Clone(s.Backends)
			s.Backends[0].Draining, s.Backends[1].Draining = false, false
		case 15:
			s.Backends = slices.Clone(s.Backends[:2])
		default:
			continue
		}
		first[i] = s
	}
	return first
}

// The fuzz namespace's network (fuzzNet): the tunnel backends' prefixes on a veth
// with this MTU, and the backends with a resolved neighbour.
var (
	fuzzTunnelNets = []netip.Prefix{netip.MustParsePrefix("10.78.0.0/16"), netip.MustParsePrefix("fd78::/32")}
	fuzzVethMAC    = net.HardwareAddr{0x02, 0, 0, 0x78, 0, 0x01}
	fuzzNeighbours = map[netip.Addr]net.HardwareAddr{
		netip.MustParseAddr("10.78.0.11"): {0x02, 0, 0, 0x78, 1, 0x11},
		netip.MustParseAddr("10.78.0.13"): {0x02, 0, 0, 0x78, 1, 0x13},
		netip.MustParseAddr("fd78::11"):   {0x02, 0, 0, 0x78, 2, 0x11},
		netip.MustParseAddr("fd78::13"):   {0x02, 0, 0, 0x78, 2, 0x13},
	}
)

const fuzzMTU = 1280

// fuzzNet sets up the calling thread's (new, empty) network namespace: forwarding on,
// so bpf_fib_lookup looks routes up, and one veth, wf0, with the tunnel prefixes
// routed on it, its MTU fuzzMTU and permanent neighbours for fuzzNeighbours. It
// returns wf0's index.
func fuzzNet() (uint32, error) {
	for _, name := range []string{"net/ipv4/conf/all/forwarding", "net/ipv6/conf/all/forwarding"} {
		if err := os.WriteFile("/proc/sys/"+name, []byte("1"), 0o644); err != nil {
			return 0, fmt.Errorf("sysctl %s=1: %w", name, err)
		}
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "wf0", MTU: fuzzMTU, HardwareAddr: fuzzVethMAC}, PeerName: "wf1"}
	if err := netlink.LinkAdd(veth); err != nil {
		return 0, fmt.Errorf("add veth wf0: %w", err)
	}
	var index int
	for _, name := range []string{"wf1", "wf0"} {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return 0, fmt.Errorf("find %s: %w", name, err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return 0, fmt.Errorf("set %s up: %w", name, err)
		}
		index = l.Attrs().Index
	}
	for _, pfx := range fuzzTunnelNets {
		r := &netlink.Route{LinkIndex: index, Dst: &net.IPNet{IP: pfx.Addr().AsSlice(), Mask: net.CIDRMask(pfx.Bits(), pfx.Addr().BitLen())}}
		if pfx.Addr().Is4() {
			r.Scope = netlink.SCOPE_LINK
		}
		if err := netlink.RouteAdd(r); err != nil {
			return 0, fmt.Errorf("route %s dev wf0: %w", pfx, err)
		}
	}
	for ip, mac := range fuzzNeighbours {
		n := &netlink.Neigh{LinkIndex: index, Family: family2netlink(ip), IP: ip.AsSlice(), HardwareAddr: mac, State: netlink.NUD_PERMANENT}
		if err := netlink.NeighAdd(n); err != nil {
			return 0, fmt.Errorf("neighbour %s dev wf0: %w", ip, err)
		}
	}
	return uint32(index), nil
}

// fib is bpf_fib_lookup as fuzzNet's namespace answers it, for the model.
func (rig *fuzzRig) fib(q FIBQuery) FIBAnswer {
	dst := addrFromWords(q.Dst, q.Family)
	routed := false
	for _, pfx := range fuzzTunnelNets {
		routed = routed || (q.Family == familyIPv4 || q.Family == familyIPv6) && pfx.Contains(dst)
	}
	if !routed {
		return FIBAnswer{Result: FIBNoRoute}
	}
	if q.TotLen > fuzzMTU {
		return FIBAnswer{Result: FIBFragNeeded, MTU: fuzzMTU}
	}
	mac, ok := fuzzNeighbours[dst]
	if !ok {
		return FIBAnswer{Result: FIBNoNeighbour}
	}
	a := FIBAnswer{Result: FIBSuccess, Ifindex: rig.veth}
	copy(a.SrcMAC[:], fuzzVethMAC)
	copy(a.DstMAC[:], mac)
	return a
}

// fuzzTarget is what a structured input's frame is addressed to.
type fuzzTarget struct {
	kind  targetKind
	svc   int // index into fuzzServices; -1 none
	v6    bool
	proto uint8
	dst   netip.AddrPort // toVIP, toOther
}

type targetKind int

const (
	toVIP       targetKind = iota // a service's VIP, or another port or protocol of a VIP address
	toOther                       // an address that is no VIP
	natReply                      // a backend's reply to the nat address
	icmpBackend                   // an ICMP error from the backend's side, to the nat address
	icmpClient                    // an ICMP error from the client's side, to the VIP
)

var fuzzTargets = []fuzzTarget{
	{toVIP, 0, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPD4, 80)},
	{toVIP, 1, false, packet.ProtoUDP, netip.AddrPortFrom(fuzzVIPD4, 53)},
	{toVIP, 2, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPD4, 81)},
	{toVIP, 3, true, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPD6, 80)},
	{toVIP, 4, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPN4, 80)},
	{toVIP, 5, false, packet.ProtoUDP, netip.AddrPortFrom(fuzzVIPN4, 53)},
	{toVIP, 6, true, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPN6, 443)},
	{toVIP, 7, true, packet.ProtoUDP, netip.AddrPortFrom(fuzzVIPN6, 53)},
	{toVIP, -1, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPD4, 8080)},
	{toOther, -1, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzOther4, 80)},
	{toOther, -1, true, packet.ProtoUDP, netip.AddrPortFrom(fuzzOther6, 53)},
	{natReply, 4, false, packet.ProtoTCP, netip.AddrPort{}},
	{natReply, 5, false, packet.ProtoUDP, netip.AddrPort{}},
	{natReply, 6, true, packet.ProtoTCP, netip.AddrPort{}},
	{natReply, 7, true, packet.ProtoUDP, netip.AddrPort{}},
	{icmpBackend, 4, false, packet.ProtoTCP, netip.AddrPort{}},
	{icmpBackend, 7, true, packet.ProtoUDP, netip.AddrPort{}},
	{icmpClient, 5, false, packet.ProtoUDP, netip.AddrPort{}},
	{icmpClient, 6, true, packet.ProtoTCP, netip.AddrPort{}},
	{icmpBackend, 5, false, packet.ProtoUDP, netip.AddrPort{}},
	{icmpClient, 4, false, packet.ProtoTCP, netip.AddrPort{}},
	{toVIP, -1, false, packet.ProtoICMP, netip.AddrPortFrom(fuzzVIPD4, 0)},
	{toVIP, -1, false, 47, netip.AddrPortFrom(fuzzVIPD4, 0)},
	{toVIP, -1, true, packet.ProtoICMPv6, netip.AddrPortFrom(fuzzVIPN6, 0)},
	{toVIP, 8, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPT4, 80)},
	{toVIP, 9, true, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPT6, 80)},
	{toVIP, 10, false, packet.ProtoUDP, netip.AddrPortFrom(fuzzVIPT4, 53)},
	{toVIP, 11, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPD4, 82)},
	{toVIP, 12, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPN4, 81)},
	{toVIP, 13, true, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPT6, 81)},
	{toVIP, 14, true, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPD6, 81)},
	{toVIP, 15, false, packet.ProtoUDP, netip.AddrPortFrom(fuzzVIPD4, 54)},
	{toVIP, 16, false, packet.ProtoUDP, netip.AddrPortFrom(fuzzVIPN4, 54)},
	{toVIP, 17, true, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPN6, 444)},
	{toVIP, 18, false, packet.ProtoTCP, netip.AddrPortFrom(fuzzVIPN4, 82)},
	{natReply, 16, false, packet.ProtoUDP, netip.AddrPort{}},
	// ICMP errors from the client's side about dsr and tunnel flows (from index 36).
	{icmpClient, 0, false, packet.ProtoTCP, netip.AddrPort{}},
	{icmpClient, 3, true, packet.ProtoTCP, netip.AddrPort{}},
	{icmpClient, 8, false, packet.ProtoTCP, netip.AddrPort{}},
	{icmpClient, 13, true, packet.ProtoTCP, netip.AddrPort{}},
	{icmpClient, 10, false, packet.ProtoUDP, netip.AddrPort{}},
	{icmpClient, 2, false, packet.ProtoTCP, netip.AddrPort{}},
	{icmpClient, 11, false, packet.ProtoTCP, netip.AddrPort{}},
}

var (
	// Addresses that are no VIP, nat address or client.
	fuzzOther4, fuzzOther6 = netip.MustParseAddr("10.77.0.99"), netip.MustParseAddr("fd77::99")
	fuzzClients4           = []netip.Addr{netip.MustParseAddr("10.77.0.1"), netip.MustParseAddr("10.77.0.2"), netip.MustParseAddr("192.0.2.7"), netip.MustParseAddr("10.77.0.1")}
	fuzzClients6           = []netip.Addr{netip.MustParseAddr("fd77::1"), netip.MustParseAddr("fd77::2"), netip.MustParseAddr("2001:db8::7"), netip.MustParseAddr("fd77::1")}
	fuzzSports             = []uint16{40000, 40001, fuzzSinglePort, 0}
	// Extension header types an input picks from.
	fuzzExtTypes = []uint8{packet.ProtoHopOpts, packet.ProtoRouting, packet.ProtoDstOpts, packet.ProtoFrag, protoAH, protoESP, 59, 135}
	// Ages of seeded flows, against the rig's timeouts (TCP 100 s, closing 10 s, UDP 30 s):
	// alive, alive and refreshed, closing expired, UDP expired, all expired, in the future.
	fuzzAges = []time.Duration{500 * time.Millisecond, 5 * time.Second, 20 * time.Second, 60 * time.Second, 200 * time.Second, -50 * time.Second}
	// The new-flow limit's word against the single-port program's limit (a flow costs
	// 1 s, 2 s may be drawn ahead): never used (0), due 1.5 s from now (one more flow
	// allowed), 5 s (none), 10 s ago (allowed, and it starts from now).
	fuzzTATs = []time.Duration{0, 1500 * time.Millisecond, 5 * time.Second, -10 * time.Second}
)

// fuzzRig is what one fuzzing process runs inputs against.
type fuzzRig struct {
	progs    [2]*Program // [0]: nat ports 10000..32767, [1]: the single port 20000
	models   [2]*Model   // their static map contents; the tunnel slots' next hops are reset per input
	slots    [2][][]uint32
	cached   [2][]uint32 // every nat and tunnel service's backend slots (next-hop caches)
	services []Service
	nBackend uint32 // backend slots read back: every slot in use and one free
	// What each program's flow tables held after the last input (nil: not known), so
	// the next input deletes only those keys.
	last [2]*flowTables
	// Each model's nat_cursor (MaxBackends entries); an input rewrites the first
	// nBackend, the only ones a lookup table can name.
	cursors [2][]uint32
	ingress uint32 // ifindex the programs see frames come in on: the namespace's lo
	veth    uint32 // wf0's ifindex (fuzzNet), in both programs' tx_ports
	do      chan func()
}

func newFuzzRig(tb testing.TB) *fuzzRig {
	tb.Helper()
	rig := &fuzzRig{services: fuzzServices(), do: make(chan func())}

	// bpf_fib_lookup looks in the namespace of the thread that test-runs the program;
	// one goroutine stays in the fuzz namespace for all runs.
	ns, err := netns.New(topo.UniqueName("wfz"))
	xdptest.Check(tb, err)
	tb.Cleanup(func() { ns.Close() })
	ready := make(chan error, 1)
	// Runs functions in the namespace until the rig's cleanup closes rig.do.
	go func() {
		err := ns.Do(func() error {
			lo, err := net.InterfaceByName("lo")
			if err != nil {
				return err
			}
			// BPF_PROG_TEST_RUN without a context receives on the namespace's loopback.
			rig.ingress = uint32(lo.Index)
			if rig.veth, err = fuzzNet(); err != nil {
				return err
			}
			ready <- nil
			for fn := range rig.do {
				fn()
			}
			return nil
		})
		if err != nil {
			ready <- err
		}
	}()
	if err := <-ready; err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { close(rig.do) })

	for i := range rig.progs {
		nat := NATOptions{Addr4: fuzzNAT4, Addr6: fuzzNAT6, TCPIdle: 100 * time.Second, TCPClosing: 10 * time.Second,
			UDPIdle: 30 * time.Second, HalfOpen: 2 * time.Second}
		opts := Options{HashSeed: testSeed, ConntrackSize: 4096, NAT: nat, PreviousTableWindow: time.Hour}
		if i == 1 {
			opts.NAT.PortMin, opts.NAT.PortMax = fuzzSinglePort, fuzzSinglePort
			// One new flow a second, two ahead: fuzzTATs straddle the limit.
			opts.NewFlowRate, opts.NewFlowBurst = 1, 2
		}
		p, err := Load(opts)
		xdptest.Check(tb, err)
		tb.Cleanup(func() { p.Close() })
		first := fuzzFirstGenerations()
		for j, s := range rig.services {
			if f, ok := first[j]; ok {
				if err := p.AddService(f); err != nil {
					tb.Fatal(err)
				}
			}
			if err := p.SetService(s); err != nil {
				tb.Fatal(err)
			}
		}
		// wf0 may be redirected to, as if the program were attached to it. A devmap
		// entry names its device in the namespace of the thread that writes it.
		done := make(chan error)
		rig.do <- func() { done <- p.objs.TxPorts.Put(rig.veth, rig.veth) }
		if err := <-done; err != nil {
			tb.Fatalf("tx_ports: add wf0: %v", err)
		}
		m, err := p.Model()
		if err != nil {
			tb.Fatal(err)
		}
		rig.progs[i], rig.models[i] = p, m
		rig.cursors[i] = m.NATCursor
		for _, s := range rig.services {
			st := p.services[s.Key]
			ids := make([]uint32, len(s.Backends))
			for j, b := range s.Backends {
				ids[j] = st.slots[b.Addr]
				rig.nBackend = max(rig.nBackend, ids[j]+2)
			}
			rig.slots[i] = append(rig.slots[i], ids)
			if s.Forwarding == ForwardTunnel || s.Forwarding == ForwardNAT {
				rig.cached[i] = append(rig.cached[i], ids...)
			}
		}
	}
	return rig
}

func coarseNow(tb testing.TB) uint64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts); err != nil {
		tb.Fatal(err)
	}
	return uint64(ts.Nano())
}

// fuzzCase is a decoded input: which program, the frame, the flows to seed, the nat
// port rings' position, the new-flow limit's word and the tunnel backends (every
// tunnel slot, with its next-hop cache as the input sets it).
type fuzzCase struct {
	prog     int
	frame    []byte
	flows    flowTables
	cursor   uint32 // every backend's nat_cursor
	tat      uint64 // every CPU's new_flow_limit
	backends map[uint32]bpf.WeirBackend
	loads    []int64 // backend_load of the slots the rig reads
}

// check runs one input through the program and the model and fails on any
// difference; it returns the model's outcome.
func (rig *fuzzRig) check(t *testing.T, in []byte) Outcome {
	now := coarseNow(t)
	c := rig.decode(in, now)
	p := rig.progs[c.prog]
	prev := rig.last[c.prog]
	rig.last[c.prog] = nil
	if prev == nil {
		all, err := p.flows()
		if err != nil {
			t.Fatal(err)
		}
		prev = &all
	}
	if err := p.setFlows(*prev, c.flows); err != nil {
		t.Fatal(err)
	}
	if err := p.setBackends(c.backends); err != nil {
		t.Fatal(err)
	}
	cursors := rig.cursors[c.prog]
	for i := range rig.nBackend {
		cursors[i] = c.cursor
	}
	if err := p.setNATCursors(cursors[:rig.nBackend]); err != nil {
		t.Fatal(err)
	}
	if err := p.setNewFlowTAT(c.tat); err != nil {
		t.Fatal(err)
	}
	if err := p.setLoads(c.loads); err != nil {
		t.Fatal(err)
	}
	nSvc := uint32(len(rig.services))
	before, err := p.readCounters(nSvc, rig.nBackend)
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		action Action
		out    []byte
		err    error
	}
	done := make(chan struct{})
	rig.do <- func() {
		res.action, res.out, res.err = p.Run(c.frame)
		close(done)
	}
	<-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	later := coarseNow(t)
	after, err := p.readCounters(nSvc, rig.nBackend)
	if err != nil {
		t.Fatal(err)
	}
	got, err := p.flows()
	if err != nil {
		t.Fatal(err)
	}
	gotBackends, err := p.backendSlots(rig.nBackend)
	if err != nil {
		t.Fatal(err)
	}
	gotCursors, err := p.natCursors(rig.nBackend)
	if err != nil {
		t.Fatal(err)
	}
	gotTATs, err := p.newFlowTATs()
	if err != nil {
		t.Fatal(err)
	}
	gotLoads, err := p.loads(rig.nBackend)
	if err != nil {
		t.Fatal(err)
	}
	rig.last[c.prog] = &got

	deltas := func(a, b []Counter) []Counter {
		out := make([]Counter, len(a))
		for i := range a {
			out[i] = Counter{b[i].Packets - a[i].Packets, b[i].Bytes - a[i].Bytes}
		}
		return out
	}
	gotReasons := deltas(before.Reasons, after.Reasons)

	m := *rig.models[c.prog]
	m.setFlows(flowTables{
		LB: maps.Clone(c.flows.LB), LBHalfOpen: maps.Clone(c.flows.LBHalfOpen),
		NAT: maps.Clone(c.flows.NAT), NATHalfOpen: maps.Clone(c.flows.NATHalfOpen),
		Reverse: maps.Clone(c.flows.Reverse), HalfReverse: maps.Clone(c.flows.HalfReverse),
	})
	m.NATCursor = cursors
	m.NewFlowTAT = c.tat
	m.Load = slices.Clone(c.loads)
	m.IngressIfindex = rig.ingress
	// The backends array is shared with the rig's model (a copy per input would cost
	// more than the run): only tunnel slots change, and every input resets them all.
	for id, b := range c.backends {
		m.Backends[id] = b
	}
	env := ModelEnv{Now: now, FIB: rig.fib}
	want := m.Run(c.frame, env)
	report := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("%s\n in  %x\n got %s %x\nwant %s %x", fmt.Sprintf(format, args...), c.frame, res.action, res.out, want.Action, want.Frame)
	}
	if res.action != want.Action {
		report("action %s; want %s", res.action, want.Action)
	}
	if !bytes.Equal(res.out, want.Frame) {
		report("output frame differs")
	}
	if err := checkChecksums(c.frame, res.out, res.action); err != nil {
		report("%v", err)
	}

	wantCounts := func(n int, ids []uint32) []Counter {
		out := make([]Counter, n)
		for _, id := range ids {
			if int(id) >= n {
				t.Fatalf("model counted index %d; the rig reads %d", id, n)
			}
			out[id].Packets++
			out[id].Bytes += uint64(want.Len)
		}
		return out
	}
	reasons := make([]uint32, len(want.Reasons))
	for i, r := range want.Reasons {
		reasons[i] = uint32(r)
	}
	for _, cmp := range []struct {
		what      string
		got, want []Counter
	}{
		{"global_stats", gotReasons, wantCounts(int(reasonMax), reasons)},
		{"service_stats", deltas(before.Services, after.Services), wantCounts(int(nSvc), want.Services)},
		{"backend_stats", deltas(before.Backends, after.Backends), wantCounts(int(rig.nBackend), want.Backends)},
	} {
		if !slices.Equal(cmp.got, cmp.want) {
			report("%s went up by %v; want %v", cmp.what, cmp.got, cmp.want)
		}
	}
	gotFlows := deltas(before.Flows, after.Flows)
	opened, closed := wantCounts(int(rig.nBackend), want.FlowsOpened), wantCounts(int(rig.nBackend), want.FlowsClosed)
	for i := range gotFlows {
		if gotFlows[i].Packets != opened[i].Packets || gotFlows[i].Bytes != closed[i].Packets {
			report("backend_flows[%d] opened/closed went up by %d/%d; want %d/%d", i,
				gotFlows[i].Packets, gotFlows[i].Bytes, opened[i].Packets, closed[i].Packets)
		}
	}

	// Times the model set to now may be anything the program read between the two
	// clock readings around the run.
	near := func(got, want uint64) bool {
		if want == now {
			return got >= now && got <= later
		}
		return got == want
	}
	nearS := func(got, want uint32) bool {
		if want == uint32(now/nsecPerSec) {
			return got >= want && got <= uint32(later/nsecPerSec)
		}
		return got == want
	}
	lbSame := func(g, w bpf.WeirLbFlow) bool { return g.BackendId == w.BackendId && nearS(g.CreatedS, w.CreatedS) }
	natSame := func(g, w bpf.WeirNatFlow) bool {
		return g.BackendId == w.BackendId && g.NatPort == w.NatPort && g.Flags == w.Flags && near(g.LastSeenNs, w.LastSeenNs)
	}
	for _, diff := range []string{
		flowsDiff("lb_conntrack", got.LB, m.LBConntrack, lbSame),
		flowsDiff("lb_half_open", got.LBHalfOpen, m.LBHalfOpen, lbSame),
		flowsDiff("nat_conntrack", got.NAT, m.NATConntrack, natSame),
		flowsDiff("nat_half_open", got.NATHalfOpen, m.NATHalfOpen, natSame),
	} {
		if diff != "" {
			report("%s", diff)
		}
	}
	// An established UDP flow's reverse entry holds the tick of its last refresh
	// (nat_reply_refresh), which the model sets to now's.
	revSame := func(g, w bpf.WeirNatEntry) bool {
		if w.SynAck == uint32(now>>replyTickShift) && g.SynAck >= w.SynAck && g.SynAck <= uint32(later>>replyTickShift) {
			g.SynAck = w.SynAck
		}
		return g == w
	}
	if !maps.EqualFunc(got.Reverse, m.NATReverse, revSame) {
		report("nat_reverse\n got %+v\nwant %+v", got.Reverse, m.NATReverse)
	}
	if !maps.Equal(got.HalfReverse, m.NATHalfReverse) {
		report("nat_half_reverse\n got %+v\nwant %+v", got.HalfReverse, m.NATHalfReverse)
	}
	if !slices.Equal(gotLoads, m.Load) {
		report("backend_load = %v (seeded %v); want %v", gotLoads, c.loads, m.Load)
	}
	if !slices.Equal(gotCursors, m.NATCursor[:rig.nBackend]) {
		report("nat_cursor = %v; want %v", gotCursors, m.NATCursor[:rig.nBackend])
	}
	// One CPU ran the program: its word is the model's, the others' stay as seeded.
	// A word the model set from now may hold any time the program read up to later.
	var moved []uint64
	for _, g := range gotTATs {
		if g != c.tat {
			moved = append(moved, g)
		}
	}
	switch {
	case m.NewFlowTAT == c.tat && len(moved) == 0:
	case m.NewFlowTAT != c.tat && len(moved) == 1 && (moved[0] == m.NewFlowTAT ||
		m.NewFlowTAT == now+m.NewFlowIntervalNs && moved[0] >= m.NewFlowTAT && moved[0] <= later+m.NewFlowIntervalNs):
	default:
		report("new_flow_limit = %v (seeded %d); want one CPU's at %d, or none moved if that is the seed", gotTATs, c.tat, m.NewFlowTAT)
	}
	for i, g := range gotBackends {
		w := m.Backends[i]
		hopNs := g.HopNs
		if near(hopNs, w.HopNs) {
			hopNs = w.HopNs
		}
		g.HopNs = hopNs
		if g != w {
			report("backends[%d] = %+v; want %+v", i, gotBackends[i], w)
		}
	}
	return want
}

// flowsDiff says how a flow table the program holds differs from the model's ("" if
// not at all), with same deciding whether two entries agree.
func flowsDiff[V any](what string, got, want map[bpf.WeirFlowKey]V, same func(g, w V) bool) string {
	if len(got) != len(want) {
		return fmt.Sprintf("%s holds %d entries; want %d:\n got %+v\nwant %+v", what, len(got), len(want), got, want)
	}
	for k, w := range want {
		if g, ok := got[k]; !ok || !same(g, w) {
			return fmt.Sprintf("%s[%+v] = %+v (present %t); want %+v", what, k, g, ok, w)
		}
	}
	return ""
}

// fuzzReader hands out the input's bytes, zeros once it is used up.
type fuzzReader struct{ b []byte }

func (r *fuzzReader) u8() uint8 {
	if len(r.b) == 0 {
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *fuzzReader) u16() uint16 { return uint16(r.u8())<<8 | uint16(r.u8()) }

func flowKeyOf(src, dst netip.AddrPort, proto uint8) bpf.WeirFlowKey {
	return bpf.WeirFlowKey{Src: addrWords(src.Addr()), Dst: addrWords(dst.Addr()),
		Sport: portWord(src.Port()), Dport: portWord(dst.Port()), Proto: proto, Family: family(dst.Addr())}
}

// decode turns an input into a case. Its layout, byte by byte (missing bytes read
// as 0):
//
//	0  bit 0: program (0: nat port range, 1: single nat port); bits 1-3: 6 raw frame
//	   after an Ethernet header (next byte picks the EtherType), 7 raw frame; else
//	   a structured frame:
//	1  target (fuzzTargets)
//	2  client address (and, for replies and ICMP, backend)
//	3  source port: < 128 picks fuzzSports, else 1024 + 7n
//	4  TCP flags; for ICMP targets the type (low 3 bits) and code (high bits)
//	5  bit 0 VLAN tag, 1 more fragments, 2 fragment offset, 3 UDP checksum 0 (IPv6:
//	   without extension headers; in an ICMP error from the backend's side, the
//	   quote's; in one from the client's side, the error goes to an address that
//	   sent no such reply),
//	   bits 4-7 IPv4 option words (mod 11)
//	6  IPv6 extension headers (mod 7), then one byte each: type (low 3 bits,
//	   fuzzExtTypes) and length in 8-byte units (high 5 bits; 30 and 31 mean 70)
//	7  payload length: < 224 its value mod 32, else 40 bytes per step above;
//	   for ICMP targets the quote's length (255: the whole packet with 8 bytes of
//	   payload; 224-254: the whole packet with its payload as above)
//	8  mutation (mod 8): 1 truncate the frame at 14 + n (2 bytes), 2 set the IP
//	   header's first byte, 3 add n (signed) to the IP length field, 4 set one byte
//	   (2 bytes offset, 1 byte value), 5 append n zero bytes (Ethernet padding), 6 cut
//	   the IPv4 total length to the IP header plus n mod 8 bytes, 7 truncate the frame
//	   at 14 + n (2 bytes) and the IP length field with it
//	9  seeds: bit 0 the packet's own flow is known (or, for ICMP from the client,
//	   the quoted flow), bit 1 a nat reverse entry (the port this flow would take,
//	   for every backend; the reply's or the quote's), bit 2 its holder's
//	   connection-table entry; bits 3, 4, 5 put each of those three in its
//	   half-open table instead (half_open, nat_half_reverse, half_open); bits 6-7
//	   start every backend's nat port ring at the seeded port, the one after it, 0,
//	   or 3 short of wrapping; then bytes: backend, nat port, and age (low 4
//	   bits) and closing (bit 4) of the known flow; holder; the holder's age and
//	   closing, and in bits 5-6 the reverse entries' next hop back to the client
//	   (none, the receiving interface, one not in tx_ports, wf0), bit 7 their
//	   client's VLAN tag (none, 7)
//	15 nat, tunnel: the cached next hop of the target service's backends: bits 0-1
//	   its interface (none, the receiving one, wf0 in tx_ports, one not in
//	   tx_ports), bits 2-3 its age (100 ms, 3 s, 50 s in the future, now), bits 4-5
//	   its length (4096, 0, this packet's outer length - 1, its outer length), bit 6
//	   set DF on an IPv4 frame, bit 7 the first backend only
//	16 the new-flow limit's word on every CPU (fuzzTATs)
//	17-18 backend_load of every slot (fuzzLoads, three bits a slot)
//
// fuzzLoads are the backend_load values an input gives slots: none, either side of
// maglev_p2c's margin (9 against 8 ties, 10 wins), unknown, huge.
var fuzzLoads = []int64{0, 8, 9, 10, -1, 1, 1 << 40, 3}

// loads gives slot i fuzzLoads[sel >> 3(i mod 5) & 7], so the slots of one service
// (at most 3, in a row) take independent values.
func (rig *fuzzRig) loads(sel uint16) []int64 {
	out := make([]int64, rig.nBackend)
	for i := range out {
		out[i] = fuzzLoads[sel>>(3*(i%5))&7]
	}
	return out
}

func (rig *fuzzRig) decode(in []byte, now uint64) fuzzCase {
	r := &fuzzReader{in}
	b0 := r.u8()
	c := fuzzCase{prog: int(b0 & 1), flows: emptyFlowTables(), backends: map[uint32]bpf.WeirBackend{}}
	// Every tunnel slot starts without a cached next hop.
	for _, id := range rig.cached[c.prog] {
		b := rig.models[c.prog].Backends[id]
		b.Hop, b.HopNs, b.HopLen = bpf.WeirNextHop{}, 0, 0
		c.backends[id] = b
	}
	kind := b0 >> 1 & 7
	if kind == 6 || kind == 7 {
		var frame []byte
		if kind == 6 {
			frame = append([]byte{}, lbMAC...)
			frame = append(frame, clientMAC...)
			types := [][]byte{{0x08, 0x00}, {0x86, 0xdd}, {0x81, 0x00, 0, 7, 0x08, 0x00}, {0x81, 0x00, 0, 7, 0x86, 0xdd}, {0x08, 0x06}, {0x88, 0xa8}}
			frame = append(frame, types[int(r.u8())%len(types)]...)
		}
		c.frame = fitFrame(append(frame, r.b...))
		c.loads = rig.loads(0)
		return c
	}

	tg := fuzzTargets[int(r.u8())%len(fuzzTargets)]
	clientSel := int(r.u8())
	client := fuzzClients4[clientSel%4]
	if tg.v6 {
		client = fuzzClients6[clientSel%4]
	}
	sportSel := r.u8()
	sport := fuzzSports[sportSel%4]
	if sportSel >= 128 {
		sport = 1024 + 7*uint16(sportSel)
	}
	flags := r.u8()
	opts := r.u8()
	var ext []uint8
	var extLen []uint8
	if n := int(r.u8() % 7); tg.v6 {
		for range n {
			e := r.u8()
			ext = append(ext, fuzzExtTypes[e&7])
			l := e >> 3
			if l >= 30 {
				l = 70
			}
			extLen = append(extLen, l)
		}
	}
	payloadSel := r.u8()
	payload := make([]byte, payloadSel%32)
	if payloadSel >= 224 {
		payload = make([]byte, 40*int(payloadSel-223))
	}
	for i := range payload {
		payload[i] = byte(i)
	}

	var svc Service
	var slots []uint32
	if tg.svc >= 0 {
		svc = rig.services[tg.svc]
		slots = rig.slots[c.prog][tg.svc]
	}
	natAddr := fuzzNAT4
	if tg.v6 {
		natAddr = fuzzNAT6
	}
	var be Backend
	if len(svc.Backends) > 0 {
		be = svc.Backends[clientSel%len(svc.Backends)]
	}
	// The nat port of the flows the seeds make up.
	natPort := uint16(fuzzSinglePort)
	if c.prog == 0 {
		natPort = 10000 + uint16(sportSel)*89
	}

	f := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Proto: tg.proto, TCPFlags: flags, Payload: payload,
		FragOffset: 0, MoreFrags: opts&2 != 0, IPv6ExtHeaders: ext}
	if opts&1 != 0 {
		f.VLAN = 7
	}
	if opts&4 != 0 {
		f.FragOffset = 185
	}
	if words := int(opts>>4) % 11; words > 0 && !tg.v6 {
		f.IPv4Options = bytes.Repeat([]byte{1}, 4*words)
	}
	var clientFlow bpf.WeirFlowKey // the flow the seeds are about, client -> VIP
	switch tg.kind {
	case toVIP, toOther:
		f.Src, f.Dst = netip.AddrPortFrom(client, sport), tg.dst
		clientFlow = flowKeyOf(f.Src, f.Dst, tg.proto)
	case natReply:
		f.Src, f.Dst = be.Addr, netip.AddrPortFrom(natAddr, natPort)
		clientFlow = flowKeyOf(netip.AddrPortFrom(client, sport), svc.Key.VIP, tg.proto)
	case icmpBackend, icmpClient:
		icmp := &packet.ICMP{Type: []uint8{3, 11, 3, 0, 8, 3, 5, 12}[flags&7], Code: flags >> 3 % 5, Rest: 1400}
		f.Proto = packet.ProtoICMP
		if tg.v6 {
			icmp.Type = []uint8{1, 2, 3, 1, 128, 129, 4, 1}[flags&7]
			f.Proto = packet.ProtoICMPv6
		}
		quoted := packet.Frame{Proto: tg.proto, TCPFlags: packet.SYN | packet.ACK, Payload: payload[:min(len(payload), 8)]}
		if payloadSel >= 224 && payloadSel != 255 {
			quoted.Payload = payload // a long quote, as ICMPv6 errors carry (up to 1,280 bytes in all)
		}
		if tg.kind == icmpBackend {
			// A router between us and the backend answers the packet we sent it.
			quoted.Src, quoted.Dst = netip.AddrPortFrom(natAddr, natPort), be.Addr
			f.Src, f.Dst = netip.AddrPortFrom(be.Addr.Addr(), 0), netip.AddrPortFrom(natAddr, 0)
		} else {
			// The client's side answers our reply: to the VIP, or (opts bit 3) to an
			// address that sent no such reply.
			quoted.Src, quoted.Dst = svc.Key.VIP, netip.AddrPortFrom(client, sport)
			f.Src, f.Dst = netip.AddrPortFrom(client, 0), netip.AddrPortFrom(svc.Key.VIP.Addr(), 0)
			if opts&8 != 0 && tg.v6 {
				f.Dst = netip.AddrPortFrom(fuzzOther6, 0)
			} else if opts&8 != 0 {
				f.Dst = netip.AddrPortFrom(fuzzOther4, 0)
			}
		}
		// The quote takes the options and the fragment bits (opts bits 1 and 2), and
		// in IPv6 with opts bit 4 the extension headers (else the error's own).
		quoted.IPv4Options, quoted.FragOffset, quoted.MoreFrags = f.IPv4Options, f.FragOffset, f.MoreFrags
		f.IPv4Options, f.Payload, f.FragOffset, f.MoreFrags = nil, nil, 0, false
		quoteExtLen := []uint8(nil)
		if tg.v6 && opts&0x10 != 0 {
			quoted.IPv6ExtHeaders, f.IPv6ExtHeaders = f.IPv6ExtHeaders, nil
			quoteExtLen, extLen = extLen, nil
		}
		quote := longExtHeaders(append(make([]byte, ethHeaderLen), quoted.IPPacket()...), false, quoteExtLen)[ethHeaderLen:]
		// From the backend's side, opts bit 3 zeroes a quoted UDP checksum, which the
		// translation keeps at zero; the UDP header ends where the payload starts.
		if opts&8 != 0 && tg.kind == icmpBackend && tg.proto == packet.ProtoUDP {
			at := len(quote) - len(quoted.Payload) - udpHeaderLen
			quote[at+6], quote[at+7] = 0, 0
		}
		if payloadSel < 224 {
			quote = quote[:min(len(quote), int(payloadSel))]
		}
		// opts bits 4-7 at 11 or more (their option words wrap to 0-4) make a quoted
		// IPv4 header's own checksum wrong, which is checked only without options; the
		// ICMP checksum, made over the quote as it is, holds.
		if !tg.v6 && opts>>4 >= 11 && len(quote) >= 12 {
			quote[10] ^= 0x40
		}
		icmp.Quote = quote
		f.ICMP = icmp
		clientFlow = flowKeyOf(netip.AddrPortFrom(client, sport), svc.Key.VIP, tg.proto)
	}
	if opts&8 != 0 && tg.proto == packet.ProtoUDP && (!tg.v6 || len(ext) == 0) && tg.kind != icmpBackend && tg.kind != icmpClient {
		defer func() { // the UDP checksum is written by Build; zero it afterwards
			if l4 := l4Offset(c.frame); l4 > 0 && l4+8 <= len(c.frame) {
				c.frame[l4+6], c.frame[l4+7] = 0, 0
			}
		}()
	}
	frame := f.Build()
	frame = longExtHeaders(frame, f.VLAN != 0, extLen)

	l3 := 14
	if f.VLAN != 0 {
		l3 = 18
	}
	// An ICMP error is the frame's tail; a mutation of the IP length (3, 6, 7) moves
	// its end, and the checksum is made again over what the length leaves, so that
	// the rules on the quote's length are reached (a byte set by 2 or 4 is not
	// covered: the checksum's rule).
	icmpAt := -1
	if f.ICMP != nil {
		icmpAt = len(frame) - icmpHeaderLen - len(f.ICMP.Quote)
	}
	mutation := r.u8() % 8
	if icmpAt >= 0 && (mutation == 3 || mutation == 6 || mutation == 7) {
		defer func() { icmpChecksumAgain(c.frame, l3, icmpAt) }()
	}
	switch mutation {
	case 1:
		frame = frame[:14+int(r.u16())%(len(frame)-13)]
	case 2:
		frame[l3] = r.u8()
	case 3:
		d := uint16(int8(r.u8()))
		if tg.v6 {
			binary.BigEndian.PutUint16(frame[l3+4:], binary.BigEndian.Uint16(frame[l3+4:])+d)
		} else {
			binary.BigEndian.PutUint16(frame[l3+2:], binary.BigEndian.Uint16(frame[l3+2:])+d)
		}
	case 4:
		off := int(r.u16()) % len(frame)
		frame[off] = r.u8()
	case 5:
		frame = append(frame, make([]byte, r.u8()%64)...)
	case 6:
		if !tg.v6 {
			ihl := int(frame[l3]&0xf) * 4
			binary.BigEndian.PutUint16(frame[l3+2:], uint16(ihl+int(r.u8()%8)))
		}
	case 7:
		frame = frame[:14+int(r.u16())%(len(frame)-13)]
		if n := len(frame) - l3; n >= 40 && tg.v6 {
			binary.BigEndian.PutUint16(frame[l3+4:], uint16(n-40))
		} else if n >= 20 && !tg.v6 {
			binary.BigEndian.PutUint16(frame[l3+2:], uint16(n))
		}
	}
	c.frame = fitFrame(frame)

	// Seeds.
	seeds := r.u8()
	beSel, portSel, stateSel, holderSel, holderAge := r.u8(), r.u8(), r.u8(), r.u8(), r.u8()
	age := func(sel uint8) uint64 { return now - uint64(fuzzAges[int(sel&0xf)%len(fuzzAges)]) }
	// Bits 4-6: closing, the client's FIN seen, the backend's FIN seen.
	flowFlags := func(sel uint8) bpf.WeirFlowFlags {
		return bpf.WeirFlowFlags(sel>>4)&flowFlagClosing | bpf.WeirFlowFlags(sel>>2)&flowFlagFins
	}
	// A cached next hop: none, out of the interface frames come in on, another one
	// (not in tx_ports), wf0 (in tx_ports).
	hop := func(sel uint8, dmac net.HardwareAddr) bpf.WeirNextHop {
		h := bpf.WeirNextHop{Ifindex: []uint32{0, rig.ingress, 9, rig.veth}[sel>>5&3]}
		copy(h.Dmac[:], dmac)
		copy(h.Smac[:], lbMAC)
		return h
	}
	// Candidate backend slots: the service's, a free one, one beyond the array.
	candidates := append(slices.Clone(slots), rig.nBackend-1, 1<<20)
	if tg.svc != 0 {
		candidates = append(candidates, rig.slots[c.prog][0][0]) // another service's
	}
	// Bits 3-5 move each seeded entry to the half-open table of its kind; bits 6-7
	// start every port ring at the seeded nat port, the one after it, 0 or just short
	// of wrapping.
	natTable := func(bit uint8) map[bpf.WeirFlowKey]bpf.WeirNatFlow {
		if seeds&bit != 0 {
			return c.flows.NATHalfOpen
		}
		return c.flows.NAT
	}
	lbTable := c.flows.LB
	if seeds&0x08 != 0 {
		lbTable = c.flows.LBHalfOpen
	}
	reverseTable := c.flows.Reverse
	if seeds&0x10 != 0 {
		reverseTable = c.flows.HalfReverse
	}
	c.cursor = []uint32{uint32(natPort) - 10000, uint32(natPort) - 10000 + 1, 0, 1<<32 - 3}[seeds>>6]
	if seeds&1 != 0 && tg.svc >= 0 {
		port := []uint16{0, portWord(natPort), portWord(natPort + 1), portWord(fuzzSinglePort)}[portSel%4]
		id := candidates[int(beSel)%len(candidates)]
		if svc.Forwarding == ForwardNAT {
			natTable(0x08)[clientFlow] = bpf.WeirNatFlow{BackendId: id, NatPort: port, Flags: flowFlags(stateSel),
				LastSeenNs: age(stateSel)}
		} else {
			lbTable[clientFlow] = bpf.WeirLbFlow{BackendId: id, CreatedS: uint32(age(stateSel) / nsecPerSec)}
		}
	}
	if seeds&2 != 0 && tg.svc >= 0 {
		// The holder: this flow, or another client's.
		holder := clientFlow
		if holderSel&1 != 0 {
			holder.Sport = portWord(5555)
		}
		for i, b := range svc.Backends {
			if tg.kind == natReply || tg.kind == icmpBackend {
				if b.Addr != be.Addr {
					continue
				}
			}
			// A reply key has the backend's family (tunnel services mix them).
			if b.Addr.Addr().Is4() != natAddr.Is4() {
				continue
			}
			rk := flowKeyOf(b.Addr, netip.AddrPortFrom(natAddr, natPort), tg.proto)
			holderID := slots[i]
			if holderSel&2 != 0 {
				holderID = candidates[int(holderSel>>2)%len(candidates)]
			}
			var tci uint16
			if holderAge&0x80 != 0 {
				tci = portWord(7) // the client's packets come tagged, VLAN 7
			}
			reverseTable[rk] = bpf.WeirNatEntry{Client: natClient(holder, tci), BackendId: holderID, ToClient: hop(holderAge, clientMAC)}
			if seeds&4 != 0 {
				port := portWord(natPort)
				if holderSel&0x80 != 0 {
					port = portWord(natPort + 1)
				}
				natTable(0x20)[holder] = bpf.WeirNatFlow{BackendId: holderID, NatPort: port,
					Flags: flowFlags(holderAge), LastSeenNs: age(holderAge)}
			}
		}
	}

	tun := r.u8()
	if tun&0x40 != 0 {
		setDF(c.frame)
	}
	if tat := fuzzTATs[int(r.u8())%len(fuzzTATs)]; tat != 0 {
		c.tat = now + uint64(tat)
	}
	c.loads = rig.loads(r.u16())
	if tg.svc >= 0 && (svc.Forwarding == ForwardTunnel || svc.Forwarding == ForwardNAT) {
		ifindex := []uint32{0, rig.ingress, rig.veth, 9}[tun&3]
		at := now - uint64([]time.Duration{100 * time.Millisecond, 3 * time.Second, -50 * time.Second, 0}[tun>>2&3])
		l3Len := ipLength(c.frame)
		for i, b := range svc.Backends {
			if i > 0 && tun&0x80 != 0 {
				break
			}
			outer := uint32(40)
			if b.Addr.Addr().Is4() {
				outer = 20
			}
			v := c.backends[slots[i]]
			v.Hop = bpf.WeirNextHop{Ifindex: ifindex, Dmac: [6]byte{0x02, 0, 0, 0x78, 3, byte(i)}}
			copy(v.Hop.Smac[:], lbMAC)
			v.HopNs = at
			v.HopLen = []uint32{4096, 0, l3Len + outer - 1, l3Len + outer}[tun>>4&3]
			c.backends[slots[i]] = v
		}
	}
	// The handshake of the seeded half-open nat flows: the acknowledgement their
	// reverse entries expect from the backend (none; the frame's; the answer to the
	// frame's SYN, which the frame's ack passes by less than SYN_DATA_MAX, as an
	// answer to a SYN with data would; another connection's; frames carry seq 1000
	// and ack 2000), and what earlier answers left in their flags (stale, kept).
	if sel := r.u8(); sel != 0 {
		synAck := bits.ReverseBytes32([]uint32{0, 2000, 1001, 0x12345678}[sel&3])
		for k, e := range c.flows.HalfReverse {
			e.SynAck = synAck
			c.flows.HalfReverse[k] = e
		}
		extra := []bpf.WeirFlowFlags{0, flowFlagStale, flowFlagKept, flowFlagStale | flowFlagKept}[sel>>2&3]
		for k, fs := range c.flows.NATHalfOpen {
			fs.Flags |= extra
			c.flows.NATHalfOpen[k] = fs
		}
	}
	// When the seeded established flows' backends last refreshed them (UDP; the word
	// is 0 otherwise): never, half a second ago (not again yet), 5 s ago, in ticks.
	if sel := r.u8() % 3; sel != 0 {
		tick := uint32(now>>replyTickShift) - []uint32{0, 477, 4770}[sel]
		for k, e := range c.flows.Reverse {
			if k.Proto == protoUDP {
				e.SynAck = tick
				c.flows.Reverse[k] = e
			}
		}
	}
	return c
}

// setDF sets "don't fragment" in a frame's IPv4 header, and its checksum.
func setDF(b []byte) {
	l3 := 14
	if len(b) >= 14 && binary.BigEndian.Uint16(b[12:]) == 0x8100 {
		l3 = 18
	}
	if len(b) < l3+20 || b[l3]>>4 != 4 {
		return
	}
	b[l3+6] |= 0x40
	if ihl := int(b[l3]&0xf) * 4; ihl >= 20 && len(b) >= l3+ihl {
		b[l3+10], b[l3+11] = 0, 0
		binary.BigEndian.PutUint16(b[l3+10:], packet.Checksum(b[l3:l3+ihl]))
	}
}

// ipLength is the IP packet's length as the header of a frame the rig built says
// (0 if it is cut before).
func ipLength(b []byte) uint32 {
	l3 := 14
	if len(b) >= 14 && binary.BigEndian.Uint16(b[12:]) == 0x8100 {
		l3 = 18
	}
	switch {
	case len(b) >= l3+20 && b[l3]>>4 == 4:
		return uint32(binary.BigEndian.Uint16(b[l3+2:]))
	case len(b) >= l3+40 && b[l3]>>4 == 6:
		return 40 + uint32(binary.BigEndian.Uint16(b[l3+4:]))
	}
	return 0
}

// fitFrame pads a frame to the 14 bytes BPF_PROG_TEST_RUN needs and cuts it to
// what it takes without fragments.
func fitFrame(b []byte) []byte {
	if len(b) < 14 {
		b = append(b, make([]byte, 14-len(b))...)
	}
	return b[:min(len(b), 3000)]
}

// l4Offset is the L4 header's offset in a frame the rig built (no extension headers).
// icmpChecksumAgain writes the checksum of the ICMP message at off in b anew, over
// the bytes up to the IP packet's end as its length says (ICMPv6: with the
// pseudo-header); it leaves b alone where that end is outside the frame or before
// the ICMP header's end.
func icmpChecksumAgain(b []byte, l3, off int) {
	end := l3 + int(ipLength(b))
	if end > len(b) || off+icmpHeaderLen > end || ipLength(b) == 0 {
		return
	}
	b[off+2], b[off+3] = 0, 0
	msg := b[off:end]
	if b[l3]>>4 == 6 {
		pseudo := append(append([]byte{}, b[l3+8:l3+40]...), 0, 0)
		pseudo = binary.BigEndian.AppendUint16(pseudo, uint16(len(msg)))
		msg = append(append(pseudo, 0, 0, 0, protoICMPv6), msg...)
	}
	binary.BigEndian.PutUint16(b[off+2:], packet.Checksum(msg))
}

func l4Offset(b []byte) int {
	l3 := 14
	if binary.BigEndian.Uint16(b[12:]) == 0x8100 {
		l3 = 18
	}
	if len(b) < l3+20 {
		return 0
	}
	if b[l3]>>4 == 4 {
		return l3 + int(b[l3]&0xf)*4
	}
	return l3 + 40
}

// longExtHeaders lengthens the IPv6 extension headers packet.Frame wrote (8 bytes
// each) to the given lengths in 8-byte units beyond the first 8.
func longExtHeaders(b []byte, vlan bool, lens []uint8) []byte {
	l3 := 14
	if vlan {
		l3 = 18
	}
	for i := len(lens) - 1; i >= 0; i-- {
		if lens[i] == 0 {
			continue
		}
		at := l3 + 40 + 8*i
		extra := make([]byte, 8*int(lens[i]))
		b = slices.Insert(b, at+8, extra...)
		b[at+1] = lens[i]
		pl := binary.BigEndian.Uint16(b[l3+4:])
		binary.BigEndian.PutUint16(b[l3+4:], pl+uint16(len(extra)))
	}
	return b
}
