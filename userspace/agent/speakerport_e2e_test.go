package agent_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/userspace/config"
)

// TestSpeakerPortAtInterfaceAddress: with addresses left out, the node's own
// address is its interface's, which only the agent knows, so validation lets a
// tcp xdp VIP there on bgp.listen_port pass (it refuses one at an address the
// file names). XDP would take the BGP sessions peers open to that address. A
// reload, weir plan and a start each refuse such a file, naming the VIP's
// field and line, and a refused reload leaves the running services as they
// were. Before, the file was applied and the speaker's port served the VIP's
// backends.
func TestSpeakerPortAtInterfaceAddress(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("bgp"), Backends: 1})
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	base, clash := speakerPortFiles(tp, socket, tp.Balancer.IP4)
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(cfgPath, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The file is valid: validation cannot know the interface's address.
	write(clash)
	if _, err := config.Load(cfgPath); err != nil {
		t.Fatalf("the file with b: %v", err)
	}
	want := fmt.Sprintf(`%s:13: services[1].vip: %s:1179 is the node's own address (on %s, taken as addresses is left out) at bgp.listen_port`,
		cfgPath, tp.Balancer.IP4, tp.Balancer.Link)

	write(base)
	p := startAgent(t, tp, cfgPath, socket, false)
	xdpStatus(t, p.client)
	write(clash)
	if _, err := p.client.Plan(context.Background(), nil, "", nil); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("plan: got %v; want an error saying %q", err, want)
	}
	if err := p.client.Reload(context.Background()); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("reload: got %v; want an error saying %q", err, want)
	}
	st := xdpStatus(t, p.client)
	if len(st.Services) != 1 || st.Services[0].Name != "a" {
		t.Errorf("services after the refused reload: got %+v; want a alone", st.Services)
	}

	// A start with the file is refused the same way, before the agent serves.
	p.cmd.Process.Signal(os.Interrupt)
	select {
	case err := <-p.done:
		p.done <- err // for the cleanup's wait
	case <-time.After(30 * time.Second):
		t.Fatal("the first agent did not stop within 30 s")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", tp.Balancer.NS.Name(), exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "WEIR_AGENT_TEST_CONFIG="+cfgPath)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(string(out), want) {
		t.Errorf("start: got %v, output:\n%s\nwant exit status 1, saying %q", err, out, want)
	}
}

// speakerPortFiles are a config for tp's balancer with a BGP speaker on port
// 1179 and an xdp service a (base), and base with a tcp xdp service b at
// addr:1179 (clash).
func speakerPortFiles(tp *topo.Topology, socket string, addr netip.Addr) (base, clash string) {
	base = fmt.Sprintf(`interfaces: [{name: %s}]
xdp: {detach_on_stop: true}
admin: {socket: %s}
metrics: {listen: "off"}
bgp:
  asn: 65001
  router_id: 10.99.99.1
  listen_port: 1179
  peers: [{address: 10.99.99.2, asn: 65002}]
services:
  - {name: a, vip: "10.77.100.1:80", data_plane: xdp, mode: dsr, health: {type: none},
     backends: [{address: "10.200.0.1:80", mac: "02:00:00:00:00:01"}]}
`, tp.Balancer.Link, socket)
	return base, base + fmt.Sprintf(`  - {name: b, vip: "%s:1179", data_plane: xdp, mode: dsr, health: {type: none},
     backends: [{address: "10.200.0.2:1179", mac: "02:00:00:00:00:02"}]}
`, addr)
}

// TestSpeakerPortAfterAddressChange: the node's own address that a VIP on
// bgp.listen_port must not take is the interface's address when the check
// runs, not when the agent started: after the address changed, weir plan and
// a reload refuse a VIP at the new address and let one at the old address
// through. Before, both checked the address read at start.
func TestSpeakerPortAfterAddressChange(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("spa"), Backends: 1})
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	moved := netip.MustParseAddr("10.77.201.1")
	base, atOld := speakerPortFiles(tp, socket, tp.Balancer.IP4)
	_, atNew := speakerPortFiles(tp, socket, moved)
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(cfgPath, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(base)
	p := startAgent(t, tp, cfgPath, socket, false)
	xdpStatus(t, p.client)

	// The interface's IPv4 address changes: the old one goes, another comes.
	ns, link := tp.Balancer.NS.Name(), tp.Balancer.Link
	out, err := exec.Command("ip", "-n", ns, "-4", "-o", "addr", "show", "dev", link).CombinedOutput()
	if err != nil {
		t.Fatalf("ip addr show: %v: %s", err, out)
	}
	var old string
	for _, f := range strings.Fields(string(out)) {
		if strings.HasPrefix(f, tp.Balancer.IP4.String()+"/") {
			old = f
		}
	}
	if old == "" {
		t.Fatalf("%s on %s: no address %s in %q", ns, link, tp.Balancer.IP4, out)
	}
	for _, args := range [][]string{{"addr", "add", moved.String() + "/32", "dev", link}, {"addr", "del", old, "dev", link}} {
		if out, err := exec.Command("ip", append([]string{"-n", ns}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}

	want := fmt.Sprintf(`%s:13: services[1].vip: %s:1179 is the node's own address (on %s, taken as addresses is left out) at bgp.listen_port`,
		cfgPath, moved, link)
	write(atNew)
	if _, err := p.client.Plan(context.Background(), nil, "", nil); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("plan, VIP at the new address: got %v; want an error saying %q", err, want)
	}
	if err := p.client.Reload(context.Background()); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("reload, VIP at the new address: got %v; want an error saying %q", err, want)
	}
	write(atOld)
	if _, err := p.client.Plan(context.Background(), nil, "", nil); err != nil {
		t.Errorf("plan, VIP at the address the interface no longer has: got %v; want none", err)
	}
}
