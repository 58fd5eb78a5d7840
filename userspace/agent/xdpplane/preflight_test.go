package xdpplane

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/userspace/config"
)

// TestPreflightSpeakerPortAtInterfaceAddress: weir validate on the host names a
// tcp xdp VIP at the interface's own address on bgp.listen_port, where the
// file leaves addresses out, among the problems the agent refuses the file for
// (the file alone cannot know that address); one at another port of that
// address passes.
func TestPreflightSpeakerPortAtInterfaceAddress(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("pfl"), Backends: 1})
	file := func(port int) *config.Config {
		t.Helper()
		cfg, err := config.Parse(fmt.Appendf(nil, `interfaces: [{name: %s}]
bgp: {asn: 65001, router_id: 10.99.99.1, listen_port: 1179, peers: [{address: 10.99.99.2, asn: 65002}]}
services:
  - {name: b, vip: "%s:%d", data_plane: xdp, mode: dsr, backends: [{address: "10.200.0.2:%d", mac: "02:00:00:00:00:02"}]}
`, tp.Balancer.Link, tp.Balancer.IP4, port, port))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	preflight := func(cfg *config.Config) (refused, notes []string) {
		t.Helper()
		if err := tp.Balancer.NS.Do(func() error { refused, notes = Preflight(cfg, "f.yaml"); return nil }); err != nil {
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
