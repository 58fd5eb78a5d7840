package agent_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// planConfig is the plan test's config: service keep (nat, three backends, and
// whatever keepExtra adds) and, unless gone is empty, service gone (nat, two).
const planConfig = `interfaces:
  - name: %s
xdp:
  hash_seed: 5
addresses: [10.77.0.2]
admin:
  socket: %s
metrics:
  listen: "off"
services:
  - name: keep
    vip: 10.77.100.1:9001
    mode: nat
    drain_timeout: 0s%s
    health: {type: tcp, interval: 1s}
    backends:
      - address: 10.77.0.11:9000
      - address: 10.77.0.12:9000
      - address: 10.77.0.13:9000%s
%s`

const goneService = `  - name: gone
    vip: 10.77.100.1:9002
    mode: nat
    health: {type: tcp, interval: 1s}
    backends:
      - address: 10.77.0.11:9000
      - address: 10.77.0.12:9000
`

// TestPlanPredictsReload: with live nat flows through real XDP, weir plan's
// prediction of a change (table slots that move, flows drained and reset) is what
// the reload then does; --max-move refuses the change in plan and reload alike and
// the running config stays in force; and a slow start steps the table towards a
// returning backend while no established flow moves.
func TestPlanPredictsReload(t *testing.T) {
	tp := echoTopology(t, "wpl", 4)
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	write := func(path, slowStart, keepExtra, gone string) []byte {
		t.Helper()
		b := []byte(fmt.Sprintf(planConfig, tp.Balancer.Link, socket, slowStart, keepExtra, gone))
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return b
	}
	cfgA := write(cfgPath, "", "", goneService)
	// B: backend-2 drained, backend-3 added, service gone removed.
	cfgB := write(filepath.Join(dir, "b.yaml"), "", "\n        drain: true\n      - address: 10.77.0.14:9000", "")
	ctx := context.Background()
	p := startAgent(t, tp, cfgPath, socket, false)
	xdpStatus(t, p.client)

	keepVIP, goneVIP := netip.AddrPortFrom(tp.VIP4, 9001), netip.AddrPortFrom(tp.VIP4, 9002)
	open := func(vip netip.AddrPort, n int) []*stream {
		var out []*stream
		for range n {
			s := startStream(t, tp, vip)
			t.Cleanup(func() { close(s.stop); <-s.done; s.conn.Close() })
			out = append(out, s)
		}
		return out
	}
	// 12 streams, more if none reached backend-2 (Maglev over 12 flows leaves it
	// empty about once in 130), which the test needs one on.
	keepStreams, goneStreams := open(keepVIP, 12), open(goneVIP, 3)
	on := map[string]uint64{} // keep's streams per backend name
	for _, s := range keepStreams {
		on[s.backend]++
	}
	for on["backend-2"] == 0 && len(keepStreams) < 60 {
		s := open(keepVIP, 1)[0]
		keepStreams = append(keepStreams, s)
		on[s.backend]++
	}
	if on["backend-2"] == 0 {
		t.Fatalf("no stream of %d reached backend-2 (%v); the test needs one", len(keepStreams), on)
	}
	nKeep := float64(len(keepStreams))
	addrOf := func(name string) string { return fmt.Sprintf("10.77.0.%d:9000", 11+int(name[len(name)-1]-'0')) }

	// The plan.
	plan, err := p.client.Plan(ctx, cfgB, "b.yaml", nil)
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	keep, gone := servicePlan(t, plan, "keep"), servicePlan(t, plan, "gone")
	if keep.Change != api.ChangeUpdated || keep.NewDataPlane != "" || keep.Table == nil {
		t.Fatalf("plan of keep: %+v; want updated in place, with tables", keep)
	}
	for _, f := range keep.Flows {
		name := fmt.Sprintf("backend-%d", int(f.Backend[len("10.77.0.1")]-'1'))
		wantFate := "stay"
		if f.Backend == addrOf("backend-2") {
			wantFate = "drain"
		}
		if f.Flows != on[name] || f.Fate != wantFate {
			t.Errorf("plan of keep, backend %s: %d flows, %s; want %d (the streams on it), %s", f.Backend, f.Flows, f.Fate, on[name], wantFate)
		}
	}
	if keep.Drained != on["backend-2"] || keep.Reset != 0 {
		t.Errorf("plan of keep: drained %d, reset %d; want %d, 0", keep.Drained, keep.Reset, on["backend-2"])
	}
	// Maglev moves the least it can: backend-2's third, and the sixth of the table
	// backend-3's quarter takes from backend-0 and backend-1, half in all.
	if math.Abs(keep.Moved-0.5) > 0.01 || keep.Table.Size != keep.Table.NextSize {
		t.Errorf("plan of keep: moved %.3f of %d -> %d slots; want 0.5 ± 0.01, same size", keep.Moved, keep.Table.Size, keep.Table.NextSize)
	}
	// On keep's own flows: the drained backend's all move, and each of the others'
	// moves or not: a whole number of the streams, at least backend-2's.
	if tm := keep.TrafficMoved; tm == nil || *tm*nKeep < float64(on["backend-2"])-1e-9 || math.Abs(*tm*nKeep-math.Round(*tm*nKeep)) > 1e-9 {
		t.Errorf("plan of keep: traffic moved %v; want k/%d with k >= %d", tm, len(keepStreams), on["backend-2"])
	}
	for _, m := range keep.Table.Moves {
		if m.To == addrOf("backend-2") || m.From == addrOf("backend-3") {
			t.Errorf("plan of keep: move %+v; want nothing to the drained backend-2 or from the new backend-3", m)
		}
	}
	if gone.Change != api.ChangeRemoved || gone.Reset != 3 || gone.Moved != 1 {
		t.Errorf("plan of gone: %s, reset %d, moved %v; want removed, the 3 streams reset, all moved", gone.Change, gone.Reset, gone.Moved)
	}
	var table strings.Builder
	plan.WriteTable(&table)
	t.Logf("weir plan:\n%s", table.String())

	t.Run("max-move refuses", func(t *testing.T) {
		budget := 10.0
		gated, err := p.client.Plan(ctx, cfgB, "b.yaml", &budget)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(gated.OverBudget, []string{"keep", "gone"}) {
			t.Errorf("plan --max-move 10: over budget %v; want [keep gone]", gated.OverBudget)
		}
		os.WriteFile(cfgPath, cfgB, 0o644)
		err = p.client.ReloadWithin(ctx, budget)
		var re *admin.RequestError
		if !errors.As(err, &re) || !strings.Contains(err.Error(), "over the disruption budget") || !strings.Contains(err.Error(), `service "keep" would move`) {
			t.Fatalf("reload --max-move 10: got %v; want it refused, naming keep", err)
		}
		st, _ := p.client.Status(ctx)
		if len(st.Services) != 2 {
			t.Errorf("after the refused reload: %d services; want the running config's 2", len(st.Services))
		}
		for _, s := range append(keepStreams, goneStreams...) {
			s.progress(t, "after the refused reload")
		}
		// The same change, planned again: nothing of it was applied.
		again, err := p.client.Plan(ctx, cfgB, "b.yaml", nil)
		if err != nil {
			t.Fatal(err)
		}
		if k := servicePlan(t, again, "keep"); k.Table.Moved != keep.Table.Moved {
			t.Errorf("plan after the refused reload: %d slots move; want %d as before", k.Table.Moved, keep.Table.Moved)
		}
	})

	// The reload, within a budget it fits (gone moves all its flows).
	os.WriteFile(cfgPath, cfgB, 0o644)
	if err := p.client.ReloadWithin(ctx, 100); err != nil {
		t.Fatalf("reload: %v", err)
	}
	t.Run("reload did as planned", func(t *testing.T) {
		// Flows: the drained backend's stay, counted as active, and every other
		// stream of keep goes on; gone's streams break, all 3.
		for _, s := range keepStreams {
			s.progress(t, "after the reload")
		}
		if b := backendStatus(t, p.client, "keep", addrOf("backend-2")); !b.Drained || b.ActiveFlows != keep.Drained {
			t.Errorf("backend-2 after the reload: drained %v, %d active flows; want drained with the %d planned", b.Drained, b.ActiveFlows, keep.Drained)
		}
		broken := 0
		waitFor(t, "gone's streams break", 15*time.Second, func() bool {
			broken = 0
			for _, s := range goneStreams {
				select {
				case <-s.done:
					broken++
				default:
				}
			}
			return broken == len(goneStreams)
		})
		if uint64(broken) != gone.Reset {
			t.Errorf("gone: %d streams broke; %d were planned reset", broken, gone.Reset)
		}
		// Slots: the table the program holds now is the planned one (planning the
		// running config moves nothing), and going back moves exactly the planned
		// slots the other way.
		same, err := p.client.Plan(ctx, cfgB, "b.yaml", nil)
		if err != nil {
			t.Fatal(err)
		}
		if k := servicePlan(t, same, "keep"); k.Table.Moved != 0 || k.Change != api.ChangeUnchanged {
			t.Errorf("plan of the running config: keep %s, %d slots move; want unchanged, 0", k.Change, k.Table.Moved)
		}
		back, err := p.client.Plan(ctx, cfgA, "a.yaml", nil)
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]int{}
		for _, m := range keep.Table.Moves {
			want[m.To+">"+m.From] = m.Slots
		}
		got := map[string]int{}
		for _, m := range servicePlan(t, back, "keep").Table.Moves {
			got[m.From+">"+m.To] = m.Slots
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("plan back to the first config: moves %v; want the reverse of the planned %v", got, want)
		}
	})

	t.Run("slow start steps, established flows stay", func(t *testing.T) {
		// backend-2 undrained with slow_start 6s: it ramps from a tenth of its share.
		write(cfgPath, "\n    slow_start: 6s", "\n      - address: 10.77.0.14:9000", "")
		start := time.Now()
		if err := p.client.Reload(ctx); err != nil {
			t.Fatalf("reload: %v", err)
		}
		if b := backendStatus(t, p.client, "keep", addrOf("backend-2")); !strings.HasSuffix(b.SlowStart, "to go") {
			t.Errorf("status of backend-2 at the start of its slow start: %q; want how far it is", b.SlowStart)
		}
		var shares []float64
		for time.Since(start) < 8*time.Second {
			shares = append(shares, newFlowShare(t, p.client, "keep", addrOf("backend-2")))
			for _, s := range keepStreams {
				s.progress(t, fmt.Sprintf("%v into the slow start", time.Since(start).Round(time.Second)))
			}
			time.Sleep(500 * time.Millisecond)
		}
		t.Logf("backend-2's share of new flows every ~half second: %.3f", shares)
		// Three backends at full weight and backend-2 at factor f: f/(3+f), so from
		// 3.2% (f 0.1) to 25%; a sample of 1,000 client ports is within ±4%.
		if shares[0] > 0.11 {
			t.Errorf("share at the start of the ramp: %.3f; want about 0.03-0.08", shares[0])
		}
		if last := shares[len(shares)-1]; math.Abs(last-0.25) > 0.05 {
			t.Errorf("share after the ramp: %.3f; want 0.25 ± 0.05", last)
		}
		if b := backendStatus(t, p.client, "keep", addrOf("backend-2")); b.SlowStart != "" {
			t.Errorf("status of backend-2 after its slow start: %q; want none", b.SlowStart)
		}
		steps := 0
		for i := 1; i < len(shares); i++ {
			if shares[i] > shares[i-1]+0.01 {
				steps++
			}
		}
		if steps < 3 {
			t.Errorf("the share rose %d times over the ramp; want at least 3 steps", steps)
		}
		for _, s := range keepStreams {
			if err := s.broken(); err != nil {
				t.Errorf("stream on %s: %v", s.backend, err)
			}
		}
	})
}

// echoTopology is a topology of n echo backends (serveEcho) whose balancer forwards
// IPv4, as nat's next-hop lookups need.
func echoTopology(t *testing.T, prefix string, n int) *topo.Topology {
	t.Helper()
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName(prefix), Backends: n})
	serveEcho(t, tp)
	err := tp.Balancer.NS.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/conf/all/forwarding", []byte("1"), 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return tp
}

// xdpStatus is the agent's status, once it is known to serve every service with XDP
// (it fails the test, or skips it where XDP may be missing, otherwise).
func xdpStatus(t *testing.T, c *admin.Client) api.Status {
	t.Helper()
	st, err := c.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !st.XDP.Loaded {
		xdptest.SkipOrFail(t, fmt.Errorf("agent could not load XDP: %s", st.XDP.Reason))
	}
	for _, s := range st.Services {
		if s.DataPlane != api.PlaneXDP {
			t.Fatalf("service %s: data plane %s (%s); want xdp", s.Name, s.DataPlane, s.Why)
		}
	}
	return st
}

func servicePlan(t *testing.T, p api.Plan, name string) api.ServicePlan {
	t.Helper()
	for _, s := range p.Services {
		if s.Service == name {
			return s
		}
	}
	t.Fatalf("plan has no service %s: %+v", name, p)
	return api.ServicePlan{}
}

// newFlowShare is backend's share of the backends XDP's table gives new flows from
// 1,000 client ports (weir explain).
func newFlowShare(t *testing.T, c *admin.Client, service, backend string) float64 {
	t.Helper()
	n := 0
	const ports = 1000
	for port := range ports {
		ex, err := c.Explain(context.Background(), service, fmt.Sprintf("10.77.0.1:%d", 20000+port))
		if err != nil {
			t.Fatal(err)
		}
		if ex.New == backend {
			n++
		}
	}
	return float64(n) / ports
}
