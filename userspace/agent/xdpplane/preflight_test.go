package xdpplane

import (
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/userspace/config"
)

// TestPreflightSpeakerPortAtInterfaceAddress: weir validate on the host names a
// tcp VIP XDP may serve at the interface's own address on bgp.listen_port, where the
// file leaves addresses out, among the problems the agent refuses the file for
// (the file alone cannot know that address); one at another port of that
// address passes, and so does one XDP does not serve here (its proxy listens
// elsewhere).
func TestPreflightSpeakerPortAtInterfaceAddress(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("pfl"), Backends: 1})
	file := func(port int) *config.Config {
		t.Helper()
		cfg, err := config.Parse(fmt.Appendf(nil, `interfaces: [{name: %s}]
bgp: {asn: 65001, router_id: 10.99.99.1, listen_port: 1179, peers: [{address: 10.99.99.2, asn: 65002}]}
services:
  - {name: b, vip: "%s:%d", mode: dsr, proxy: {listen: "127.0.0.1:%d"}, backends: [{address: "10.200.0.2:%d", mac: "02:00:00:00:00:02"}]}
`, tp.Balancer.Link, tp.Balancer.IP4, port, port+1, port))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	preflight := func(cfg *config.Config) (refused, notes []string) {
		t.Helper()
		if err := tp.Balancer.NS.Do(func() error { refused, notes = Preflight(cfg, "f.yaml", false); return nil }); err != nil {
			t.Fatal(err)
		}
		return refused, notes
	}
	want := fmt.Sprintf("f.yaml:4: services[0].vip: %s:1179 is the node's own address (on %s, taken as addresses is left out) at bgp.listen_port",
		tp.Balancer.IP4, tp.Balancer.Link)
	said := func(out []string) bool {
		return slices.ContainsFunc(out, func(l string) bool { return strings.HasPrefix(l, want) })
	}
	if refused, notes := preflight(file(1179)); !said(refused) {
		t.Errorf("VIP on bgp.listen_port: got refused %q, notes %q; want a refusal beginning %q", refused, notes, want)
	}
	refused, notes := preflight(file(80))
	if out := append(refused, notes...); slices.ContainsFunc(out, func(l string) bool { return strings.Contains(l, "bgp.listen_port") }) {
		t.Errorf("VIP on another port: got %q; want nothing about bgp.listen_port", out)
	}

	// Where XDP serves nothing the VIP is the proxy's, which leaves the
	// speaker's port alone (the agent refuses nothing then): with --no-xdp.
	if err := tp.Balancer.NS.Do(func() error { refused, notes = Preflight(file(1179), "f.yaml", true); return nil }); err != nil {
		t.Fatal(err)
	}
	noXDP := "f.yaml:4: services[0]: XDP unavailable: XDP disabled (--no-xdp)"
	if len(refused) != 0 || !slices.ContainsFunc(notes, func(l string) bool {
		return strings.HasPrefix(l, noXDP) && strings.HasSuffix(l, "so it falls back to the proxy (data_plane auto)")
	}) {
		t.Errorf("--no-xdp, VIP on bgp.listen_port: got refused %q, notes %q; want no refusal and a note beginning %q", refused, notes, noXDP)
	}

	// A process without CAP_NET_ADMIN (weir validate run by a user) checks as
	// the agent, which has it, takes the file: the VIP is XDP's there, so the
	// same refusal, and a note that this process lacks the privileges.
	if err := tp.Balancer.NS.Do(func() error {
		return withoutCapNetAdmin(func() { refused, notes = Preflight(file(1179), "f.yaml", false) })
	}); err != nil {
		t.Fatal(err)
	}
	lacks := "f.yaml: checked as the agent takes the file with the privileges XDP needs, which this process lacks (check privileges: missing [CAP_NET_ADMIN]"
	if !said(refused) || !slices.ContainsFunc(notes, func(l string) bool { return strings.HasPrefix(l, lacks) }) ||
		slices.ContainsFunc(append(refused, notes...), func(l string) bool { return strings.Contains(l, "XDP unavailable") }) {
		t.Errorf("no CAP_NET_ADMIN, VIP on bgp.listen_port: got refused %q, notes %q; want a refusal beginning %q, a note beginning %q and nothing about XDP unavailable", refused, notes, want, lacks)
	}
}

// withoutCapNetAdmin runs fn on the calling thread, locked, with CAP_NET_ADMIN
// out of the thread's effective set (it stays permitted, so it comes back). A
// thread whose set cannot be restored stays locked, so the runtime ends it.
func withoutCapNetAdmin(fn func()) error {
	runtime.LockOSThread()
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("capget: %w", err)
	}
	saved := data
	data[capNetAdmin/32].Effective &^= 1 << (capNetAdmin % 32)
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("drop CAP_NET_ADMIN: %w", err)
	}
	fn()
	if err := unix.Capset(&hdr, &saved[0]); err != nil {
		return fmt.Errorf("restore CAP_NET_ADMIN: %w", err)
	}
	runtime.UnlockOSThread()
	return nil
}

// TestSpeakerPortClashesNotWithAddresses: a file that lists addresses names
// the node's own addresses itself (validation checks a VIP at them), so the
// interface's are not taken for them and a VIP there passes.
func TestSpeakerPortClashesNotWithAddresses(t *testing.T) {
	file := func(addresses string) *config.Config {
		t.Helper()
		cfg, err := config.Parse([]byte("interfaces: [{name: eth0}]\n" + addresses +
			"bgp: {asn: 65001, router_id: 10.99.99.1, listen_port: 1179, peers: [{address: 10.99.99.2, asn: 65002}]}\n" +
			"services:\n- {name: b, vip: '192.0.2.5:1179', data_plane: xdp, mode: dsr, backends: [{address: '10.200.0.2:1179', mac: '02:00:00:00:00:02'}]}\n"))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	host := []netip.Addr{netip.MustParseAddr("192.0.2.5")}
	if err := speakerPortClashes(file(""), host, "f.yaml"); err == nil {
		t.Errorf("addresses left out: got no error; want the VIP at the interface's address refused")
	}
	if err := speakerPortClashes(file("addresses: [192.0.2.77]\n"), host, "f.yaml"); err != nil {
		t.Errorf("addresses listed: got %v; want none", err)
	}
}
