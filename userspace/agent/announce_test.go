package agent

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// TestAnnounceKeptAcrossReload: a VIP announced once its backends' checks
// passed stays announced through a reload that replaces every backend of its
// service, and through one that turns on the checks of a service that had
// none, though no check of the new backends (or the newly checked ones) has
// run yet: the data planes already use them, and a withdrawal would take the
// VIP off the routers of every node reloaded at once. A service the reload
// adds waits for its first check, as every service does at start. The speaker
// has no session here: status shows what it wants announced all the same.
func TestAnnounceKeptAcrossReload(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "weir.yaml")
	ports := make([]string, 3)
	for i := range ports {
		_, ports[i], _ = net.SplitHostPort(freePort(t))
	}
	_, peerPort, _ := net.SplitHostPort(freePort(t)) // no one listens: no session
	dead := freePort(t)
	a1, a2, b := echoBackend(t), echoBackend(t), echoBackend(t)
	write := func(services string) {
		t.Helper()
		cfg := fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\n", filepath.Join(dir, "weir.sock")) +
			"bgp: {asn: 65001, router_id: 127.0.0.1, next_hop: [127.0.0.1], peers: [{address: 127.0.0.1, asn: 65000, port: " + peerPort + "}]}\n" +
			"services:\n" + services
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	service := func(name, ip, port, health string, backends ...string) string {
		s := fmt.Sprintf("- name: %s\n  vip: %s:%s\n  data_plane: proxy\n  health: %s\n  backends:\n", name, ip, port, health)
		for _, be := range backends {
			s += "  - {address: " + be + "}\n"
		}
		return s
	}
	const fast, slow = "{type: tcp, method: connect, interval: 100ms, timeout: 50ms}", "{type: tcp, method: connect, interval: 1h}"
	write(service("web", "127.0.0.1", ports[0], fast, a1) + service("unchecked", "127.0.0.2", ports[1], "{type: none}", b))
	a := runAgent(t, path)
	announced := func() []string {
		st, err := a.Status()
		if err != nil || st.BGP == nil {
			return nil
		}
		var out []string
		for _, r := range st.BGP.Announced {
			out = append(out, r.Prefix)
		}
		return out
	}
	both := []string{"127.0.0.1/32", "127.0.0.2/32"}
	if !waitfor.Cond(10*time.Second, func() bool { return slices.Equal(announced(), both) }) {
		t.Fatalf("announced %v; want %v once web's backend passed a check", announced(), both)
	}

	// web's backend replaced, unchecked's checks turned on (an hour apart: none
	// runs in the test), and a service added on a third VIP.
	write(service("web", "127.0.0.1", ports[0], slow, a2) + service("unchecked", "127.0.0.2", ports[1], slow, b) +
		service("added", "127.0.0.3", ports[2], slow, dead))
	if err := a.Reload(t.Context()); err != nil {
		t.Fatal(err)
	}
	st, err := a.Status()
	if err != nil {
		t.Fatal(err)
	}
	want := []api.WithheldRoute{{Prefix: "127.0.0.3/32", Why: "added: waiting for the first health checks of its backends"}}
	if !slices.Equal(st.BGP.Withheld, want) {
		t.Errorf("withheld after the reload: got %+v; want %+v", st.BGP.Withheld, want)
	}
	if got := announced(); !slices.Equal(got, both) {
		t.Errorf("announced after the reload: got %v; want %v", got, both)
	}
}
