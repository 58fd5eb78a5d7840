package agent_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// fleetNode is one balancer of TestFleetConsistency: an agent in its own topology,
// whose backends have the same addresses as every other node's.
type fleetNode struct {
	tp      *topo.Topology
	dir     string
	agent   *agentProc
	started int // agents started so far, for fresh socket names
}

func (n *fleetNode) start(t *testing.T, seed int, window string) {
	t.Helper()
	n.started++
	cfg := filepath.Join(n.dir, fmt.Sprintf("weir-%d.yaml", n.started))
	socket := filepath.Join(n.dir, fmt.Sprintf("weir-%d.sock", n.started))
	writeConfig(t, cfg, n.tp, socket, func(s string) string {
		return strings.Replace(s, "  hash_seed: 1 ", fmt.Sprintf("  hash_seed: %d\n  detach_on_stop: true\n  previous_table_window: %s ", seed, window), 1)
	})
	n.agent = startAgent(t, n.tp, cfg, socket, false)
}

// ready waits until every backend of every service is usable and every service
// has a lookup table, and returns the status then.
func (n *fleetNode) ready(t *testing.T) api.Status {
	t.Helper()
	var st api.Status
	waitFor(t, "every backend usable on "+n.tp.Name, 15*time.Second, func() bool {
		var err error
		if st, err = n.agent.client.Status(context.Background()); err != nil || !st.XDP.Loaded {
			return false
		}
		for _, s := range st.Services {
			if s.DataPlane != api.PlaneXDP || s.Table == nil || s.Table.Fingerprint == "" {
				return false
			}
			for _, b := range s.Backends {
				if !b.Usable {
					return false
				}
			}
		}
		return true
	})
	return st
}

// fingerprints are a status's lookup-table fingerprints by service.
func fingerprints(st api.Status) map[string]string {
	out := map[string]string{}
	for _, s := range st.Services {
		if s.Table != nil {
			out[s.Name] = s.Table.Fingerprint
		}
	}
	return out
}

// TestFleetConsistency runs three agents, each in its own namespaces with the same
// configuration and backends at the same addresses, as nodes behind one router:
// they report the same table fingerprint for every service, and `weir explain`
// gives 10,000 synthetic flows the same backend on each. A node restarted with
// another hash_seed reports other fingerprints, in status and metrics, and sends
// flows elsewhere.
func TestFleetConsistency(t *testing.T) {
	nodes := make([]*fleetNode, 3)
	for i := range nodes {
		tp := topo.NewT(t, topo.Config{Name: topo.UniqueName(fmt.Sprintf("wfc%d", i)), Backends: 3})
		serveBackends(t, tp)
		nodes[i] = &fleetNode{tp: tp, dir: t.TempDir()}
		nodes[i].start(t, 1, "1h")
	}
	statuses := make([]api.Status, len(nodes))
	for i, n := range nodes {
		statuses[i] = n.ready(t)
		if !statuses[i].XDP.Loaded {
			xdptest.SkipOrFail(t, fmt.Errorf("agent could not load XDP: %s", statuses[i].XDP.Reason))
		}
	}
	want := fingerprints(statuses[0])
	if len(want) != 3 {
		t.Fatalf("node 0 fingerprints %v; want one per service (web, web6, dns)", want)
	}
	for i := range nodes {
		if got := fingerprints(statuses[i]); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("node %d fingerprints %v; node 0 has %v", i, got, want)
		}
	}

	// Synthetic clients, the same on every node; web gets 10,000, the others 1,000.
	rng := rand.New(rand.NewPCG(1, 2))
	type flow struct{ service, client string }
	var flows []flow
	for i := range 12000 {
		port := 1024 + rng.IntN(64000)
		switch {
		case i < 10000:
			flows = append(flows, flow{"web", fmt.Sprintf("198.18.%d.%d:%d", rng.IntN(256), rng.IntN(256), port)})
		case i < 11000:
			flows = append(flows, flow{"web6", fmt.Sprintf("[2001:db8::%x:%x]:%d", rng.IntN(1<<16), rng.IntN(1<<16), port)})
		default:
			flows = append(flows, flow{"dns", fmt.Sprintf("198.19.%d.%d:%d", rng.IntN(256), rng.IntN(256), port)})
		}
	}
	explainAll := func(n *fleetNode) []string {
		t.Helper()
		out := make([]string, len(flows))
		for i, f := range flows {
			ex, err := n.agent.client.Explain(context.Background(), f.service, f.client)
			if err != nil {
				t.Fatalf("explain %s %s on %s: %v", f.service, f.client, n.tp.Name, err)
			}
			if ex.New == "" || ex.Fingerprint != want[f.service] && n.started == 1 {
				t.Fatalf("explain %s %s on %s: %+v; want a backend and fingerprint %s", f.service, f.client, n.tp.Name, ex, want[f.service])
			}
			out[i] = ex.New
		}
		return out
	}
	start := time.Now()
	picks := make([][]string, len(nodes))
	for i, n := range nodes {
		picks[i] = explainAll(n)
	}
	t.Logf("%d flows explained on %d nodes in %v", len(flows), len(nodes), time.Since(start).Round(time.Millisecond))
	used := map[string]int{}
	for j := range flows {
		used[picks[0][j]]++
		for i := 1; i < len(nodes); i++ {
			if picks[i][j] != picks[0][j] {
				t.Fatalf("flow %s %s: node %d picks %s, node 0 %s", flows[j].service, flows[j].client, i, picks[i][j], picks[0][j])
			}
		}
	}
	if len(used) != 9 {
		t.Errorf("the flows went to %d backends (%v); want all 9 of the three services", len(used), used)
	}

	// Node 1 alone drains a web backend: it moves that backend's flows and no
	// other, so the nodes still agree on every flow the others send elsewhere.
	ctx := context.Background()
	gone := "10.77.0.11:80"
	webPrint := func(n *fleetNode) string {
		st, err := n.agent.client.Status(ctx)
		if err != nil {
			return ""
		}
		return fingerprints(st)["web"]
	}
	if err := nodes[1].agent.client.Drain(ctx, "web", gone, true); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "node 1's web table without "+gone, 10*time.Second, func() bool {
		fp := webPrint(nodes[1])
		return fp != "" && fp != want["web"]
	})
	moved, others := 0, 0
	for j, f := range flows {
		if f.service != "web" {
			continue
		}
		ex, err := nodes[1].agent.client.Explain(ctx, f.service, f.client)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case ex.New == gone:
			t.Fatalf("flow %s: node 1 still picks %s, which it drained", f.client, gone)
		case picks[0][j] == gone:
			moved++
		case ex.New != picks[0][j]:
			others++
		}
	}
	t.Logf("node 1 drained %s: %d web flows moved off it, %d others picked differently", gone, moved, others)
	if moved == 0 || others != 0 {
		t.Errorf("node 1 drained %s: %d of its flows moved and %d flows of other backends; want some and none", gone, moved, others)
	}
	if err := nodes[1].agent.client.Drain(ctx, "web", gone, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "node 1's web table back", 10*time.Second, func() bool { return webPrint(nodes[1]) == want["web"] })

	// Node 2 comes back with another seed (and a short fallback window): its tables
	// differ, and it says so.
	odd := nodes[2]
	stopAgent(t, odd.agent)
	odd.start(t, 7, "2s")
	st := odd.ready(t)
	got := fingerprints(st)
	for svc, fp := range want {
		if got[svc] == "" || got[svc] == fp {
			t.Errorf("service %s: node with hash_seed 7 has fingerprint %q; want one other than the fleet's %s", svc, got[svc], fp)
		}
	}
	var table strings.Builder
	st.WriteTable(&table)
	if !strings.Contains(table.String(), "lookup table "+got["web"]) {
		t.Errorf("status table lacks the lookup table line of web (%s):\n%s", got["web"], table.String())
	}
	for i, n := range []*fleetNode{nodes[0], odd} {
		m, err := n.agent.client.Metrics(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		fp := want["web"]
		if i == 1 {
			fp = got["web"]
		}
		line := regexp.MustCompile(`weir_service_table_info\{fingerprint="([0-9a-f]*)",service="web"\} 1`).FindStringSubmatch(m)
		if line == nil || line[1] != fp {
			t.Errorf("%s metrics: web's weir_service_table_info %v; want fingerprint %s", n.tp.Name, line, fp)
		}
	}
	differ := 0
	for j, p := range explainAll(odd) {
		if p != picks[0][j] {
			differ++
		}
	}
	// Another seed reshuffles the tables: about two in three flows of three
	// backends land elsewhere.
	if differ < len(flows)/3 {
		t.Errorf("with another hash_seed %d of %d flows go elsewhere; want at least a third", differ, len(flows))
	}
	t.Logf("hash_seed 7: %d of %d flows picked differently", differ, len(flows))

	// A drain changes web's table: status shows the previous generation until the
	// agent's tick expires it at the end of the window.
	if err := odd.agent.client.Drain(context.Background(), "web", "10.77.0.11:80", true); err != nil {
		t.Fatal(err)
	}
	web := func() *api.TableStatus {
		st, err := odd.agent.client.Status(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range st.Services {
			if s.Name == "web" {
				return s.Table
			}
		}
		t.Fatal("status has no service web")
		return nil
	}
	if tb := web(); tb == nil || tb.Previous != got["web"] || tb.Fingerprint == got["web"] {
		t.Errorf("after a drain, web's table %+v; want a new fingerprint and previous %s", tb, got["web"])
	}
	drained := time.Now()
	waitFor(t, "previous table expired", 5*time.Second, func() bool { return web().Previous == "" })
	if d := time.Since(drained); d < 2*time.Second {
		t.Errorf("the previous table expired %v after the change; want the 2s window first", d)
	}
}

// stopAgent stops an agent with weir stop --detach and waits until it has exited.
func stopAgent(t *testing.T, p *agentProc) {
	t.Helper()
	if err := p.client.Stop(context.Background(), true); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.done:
		p.done <- err
		if err != nil {
			t.Fatalf("agent stopped: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("agent did not stop within 15s of weir stop")
	}
}

// TestTableInfoWithoutBackends: an XDP service whose backends all fail their
// checks stays in the program (all_down: drop) with no lookup table, and its
// weir_service_table_info series has the fingerprint "", which the metric's help
// says (an alert comparing the nodes' fingerprints sees such a node differ).
func TestTableInfoWithoutBackends(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wti"), Backends: 3})
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	// No backend serves, so every check fails; without panic mode none is used then.
	writeConfig(t, cfgPath, tp, socket, func(s string) string {
		s = strings.Replace(s, "  hash_seed: 1 ", "  hash_seed: 1\n  detach_on_stop: true ", 1)
		return strings.Replace(s, "    all_down: drop\n", "    all_down: drop\n    panic_threshold: 0\n", 1)
	})
	p := startAgent(t, tp, cfgPath, socket, false)
	xdpStatus(t, p.client)
	series := regexp.MustCompile(`(?m)^weir_service_table_info\{fingerprint="([0-9a-f]*)",service="web"\} 1$`)
	var m string
	waitFor(t, `web's weir_service_table_info with fingerprint ""`, 20*time.Second, func() bool {
		var err error
		m, err = p.client.Metrics(context.Background())
		line := series.FindStringSubmatch(m)
		return err == nil && line != nil && line[1] == ""
	})
	help := regexp.MustCompile(`(?m)^# HELP weir_service_table_info (.*)$`).FindStringSubmatch(m)
	if help == nil || !strings.Contains(help[1], `fingerprint "" while no backend takes new flows`) {
		t.Errorf("help of weir_service_table_info: got %q; want it to say the fingerprint is \"\" while no backend takes new flows", help)
	}
}
