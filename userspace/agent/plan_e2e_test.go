package agent_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
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
		// Client ports are explained over and over while the ramp steps the table
		// (once a tick); each answer counts for the table that gave it, read with
		// it, so a table's share never mixes two tables however slow the machine.
		// The ramp is sampled until status says it is over, then the final table
		// with all 1,000 ports.
		tables := sampleRamp(t, p.client, "keep", addrOf("backend-2"), start.Add(60*time.Second), func() {
			for _, s := range keepStreams {
				s.progress(t, fmt.Sprintf("%v into the slow start", time.Since(start).Round(time.Second)))
			}
		})
		shares := make([]string, len(tables))
		for i, tb := range tables {
			shares[i] = fmt.Sprintf("%.3f of %d", tb.share(tb.ports()), len(tb.on))
		}
		t.Logf("backend-2's share of new flows over the ramp, by table (of how many ports): %s", shares)
		// Three backends at full weight and backend-2 at factor f: f/(3+f), so from
		// 3.2% (f 0.1) to 25%; a sample of 1,000 client ports is within ±4%. The
		// first table with 50 ports sampled is the reload's own, unless the loop's
		// first tick came within a few tens of milliseconds of it: then the next
		// one (8%, 12% if that tick came late).
		for _, tb := range tables {
			if len(tb.on) >= 50 {
				if share := tb.share(tb.ports()); share > 0.11 {
					t.Errorf("share at the start of the ramp: %.3f of %d ports; want about 0.03-0.08", share, len(tb.on))
				}
				break
			}
		}
		final := tables[len(tables)-1]
		if share := final.share(final.ports()); math.Abs(share-0.25) > 0.05 {
			t.Errorf("share after the ramp: %.3f; want 0.25 ± 0.05", share)
		}
		// A step rises the share on the ports both tables answered: a port backend-2
		// gets stays its own through the ramp, so the rise is the ports it gained.
		// Tables that answered fewer than 100 ports are passed over.
		steps := 0
		prev := &rampTable{}
		for _, tb := range tables {
			if len(tb.on) < 100 {
				continue
			}
			var both []int
			for port := range tb.on {
				if _, ok := prev.on[port]; ok {
					both = append(both, port)
				}
			}
			if len(both) >= 100 && tb.share(both) > prev.share(both)+0.01 {
				steps++
			}
			prev = tb
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

// rampTable is what one lookup table gave the client ports explained while it was
// the program's: by port, whether it gave the backend.
type rampTable struct {
	fingerprint string
	on          map[int]bool
}

func (r *rampTable) ports() []int { return slices.Collect(maps.Keys(r.on)) }

// share is the part of ports the table gave the backend.
func (r *rampTable) share(ports []int) float64 {
	n := 0
	for _, port := range ports {
		if r.on[port] {
			n++
		}
	}
	return float64(n) / float64(max(len(ports), 1))
}

// sampleRamp explains 1,000 client ports of service over and over (weir explain,
// 8 clients at once), and returns what each lookup table the program held gave
// them, in order, until status shows backend's slow start over and the final table
// has answered every port. Each answer is counted for the table that gave it (its
// fingerprint); the ports start again from the first at each new table, so that
// two tables in a row answered the same ports. Between passes it calls between.
// It fails the test if the ramp is not over by deadline.
func sampleRamp(t *testing.T, c *admin.Client, service, backend string, deadline time.Time, between func()) []*rampTable {
	t.Helper()
	const ports, clients = 1000, 8
	var tables []*rampTable
	byPrint := map[string]*rampTable{}
	next := 0
	var mu sync.Mutex
	for pass := 0; ; pass++ {
		over := backendStatus(t, c, service, backend).SlowStart == ""
		if !over && time.Now().After(deadline) {
			t.Fatalf("%s still in its slow start at the deadline; tables sampled: %d", backend, len(tables))
		}
		var wg sync.WaitGroup
		var errs []error
		for range clients {
			wg.Add(1)
			// Exits when the pass has explained its ports.
			go func() {
				defer wg.Done()
				for {
					mu.Lock()
					port := next
					next++
					mu.Unlock()
					if port >= ports {
						return
					}
					ex, err := c.Explain(context.Background(), service, fmt.Sprintf("10.77.0.1:%d", 20000+port))
					mu.Lock()
					if err != nil {
						errs = append(errs, err)
						mu.Unlock()
						return
					}
					tb := byPrint[ex.Fingerprint]
					if tb == nil {
						tb = &rampTable{fingerprint: ex.Fingerprint, on: map[int]bool{}}
						byPrint[ex.Fingerprint] = tb
						tables = append(tables, tb)
						if len(tables) > 1 {
							next = 0 // the new table answers from the first port
						}
					}
					tb.on[port] = ex.New == backend
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		next = 0
		if len(errs) > 0 {
			t.Fatal(errors.Join(errs...))
		}
		if over && len(tables[len(tables)-1].on) == ports {
			return tables
		}
		between()
	}
}
