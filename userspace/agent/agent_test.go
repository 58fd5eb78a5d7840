package agent

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/xdpplane"
	"github.com/weir-lb/weir/userspace/balance"
	"github.com/weir-lb/weir/userspace/config"
)

// config spells the algorithms itself (it imports nothing of the project): the two
// lists must agree.
func TestAlgorithmsAgree(t *testing.T) {
	var got []string
	for _, a := range config.Algorithms() {
		got = append(got, string(a))
	}
	want := balance.Algorithms()
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("config.Algorithms(): got %v; want balance.Algorithms() %v", got, want)
	}
}

// TestRestartOnlyNamesTheField: a reload that changes a setting fixed until
// restart is refused naming that setting, as a config error names its field.
func TestRestartOnlyNamesTheField(t *testing.T) {
	const svc = "services:\n- {name: a, vip: 10.0.0.1:80, backends: [{address: 10.0.0.2:80}]}\n"
	const bgp = "bgp: {asn: 65001, router_id: 10.0.0.1, peers: [{address: 10.0.0.254, asn: 65000, password: s3cret}]}\n"
	parse := func(y string) *config.Config {
		t.Helper()
		cfg, err := config.Parse([]byte(y))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	for _, c := range []struct {
		name, old, next string
		want            []string
	}{
		{"nothing", svc, svc + "  # a comment\n", nil},
		{"services only", svc, "services:\n- {name: b, vip: 10.0.0.1:81, backends: [{address: 10.0.0.3:80}]}\n", nil},
		{"xdp", svc, "xdp: {conntrack_size: 4096}\n" + svc, []string{"xdp.conntrack_size: changed from 0 to 4096; restart weir to apply"}},
		{"two xdp settings", svc, "xdp: {hash_seed: 7, previous_table_window: 0s}\n" + svc,
			[]string{"xdp.hash_seed: changed from 0 to 7", "xdp.previous_table_window: changed from 1h0m0s to 0s"}},
		{"log level", svc, "log: {level: debug}\n" + svc, []string{"log.level: changed from INFO to DEBUG"}},
		{"metrics", svc, "metrics: {listen: \"off\"}\n" + svc, []string{"metrics.listen: changed from 127.0.0.1:9470 to none"}},
		{"admin", svc, "admin: {listen: 127.0.0.1:9999}\n" + svc, []string{"admin.listen: changed from none to 127.0.0.1:9999"}},
		{"interfaces", svc, "interfaces: [{name: eth0}]\n" + svc, []string{"interfaces: changed from none to eth0 (auto)"}},
		{"addresses", svc, "addresses: [192.0.2.7]\n" + svc, []string{"addresses: changed from none to 192.0.2.7"}},
		{"bgp", bgp + svc, strings.Replace(bgp, "65001", "65002", 1) + svc, []string{"bgp.asn: changed from 65001 to 65002"}},
		{"bgp added", svc, bgp + svc, []string{"bgp: added; restart weir to apply"}},
		{"bgp removed", bgp + svc, svc, []string{"bgp: removed; restart weir to apply"}},
		{"bgp peer password", bgp + svc, strings.Replace(bgp, "s3cret", "other", 1) + svc, []string{"bgp.peers[0].password: changed; restart weir to apply"}},
		{"bgp peer asn", bgp + svc, strings.Replace(bgp, "asn: 65000", "asn: 65010", 1) + svc, []string{"bgp.peers[0].asn: changed from 65000 to 65010; restart weir to apply"}},
		{"bgp peer address", bgp + svc, strings.Replace(bgp, "10.0.0.254", "10.0.0.253", 1) + svc, []string{"bgp.peers[0].address: changed from 10.0.0.254 to 10.0.0.253"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := restartOnly(parse(c.old), parse(c.next))
			if c.want == nil {
				if err != nil {
					t.Fatalf("got %v; want none", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("got no error; want %q", c.want)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("got\n%v\nwant a line containing %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "s3cret") || strings.Contains(err.Error(), "other") {
				t.Errorf("got %v; want no peer password in it", err)
			}
		})
	}
}

// TestFieldLinesNameTheServiceOnce: a change the XDP program has no slots for
// is reported at its service's path and line, which name the service, so the
// message does not name it again; each error of a joined one is mapped once,
// and one about a service the file does not have keeps its name. Each still
// wraps loader.ErrCapacity.
func TestFieldLinesNameTheServiceOnce(t *testing.T) {
	cfg, err := config.Parse([]byte("services:\n" +
		"- {name: a, vip: 10.0.0.1:80, backends: [{address: 10.0.0.2:80}]}\n" +
		"- {name: b, vip: 10.0.0.1:81, backends: [{address: 10.0.0.3:80}]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	full := func(service string) error {
		return &xdpplane.CapacityError{Service: service, Err: fmt.Errorf("the XDP program has 2 backend slots: %w", loader.ErrCapacity)}
	}
	msg := "the XDP program has 2 backend slots: " + loader.ErrCapacity.Error()
	for _, c := range []struct {
		name string
		err  error
		want string
	}{
		{"one", full("b"), "f.yaml:3: services[1]: " + msg},
		{"joined", errors.Join(full("a"), errors.New("other")), "f.yaml:2: services[0]: " + msg + "\nother"},
		{"not in the file", full("z"), `service "z": ` + msg},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := fieldLines(cfg, "f.yaml", c.err)
			if got := err.Error(); got != c.want {
				t.Errorf("got %q; want %q", got, c.want)
			}
			// The file and line must not hide the sentinel callers test for.
			if !errors.Is(err, loader.ErrCapacity) {
				t.Errorf("errors.Is(%q, loader.ErrCapacity) = false; want true", err)
			}
		})
	}
}
