package agent_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/config"
)

// fullConfig is a file at the XDP program's backend capacity: 16 dsr services of
// 1,024 backends each (MACs given, no health checks, small tables, so the agent
// starts quickly). weight sets the first backend's weight of s00; replace swaps
// the last backend of s15 for another.
func fullConfig(link, socket string, weight int, replace bool) string {
	const perService = config.MaxXDPBackends / 16
	var b strings.Builder
	fmt.Fprintf(&b, "interfaces: [{name: %s}]\nadmin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n", link, socket)
	for i := range 16 {
		fmt.Fprintf(&b, "  - {name: s%02d, vip: \"10.77.100.%d:80\", data_plane: xdp, mode: dsr, table_size: 1031, health: {type: none}, backends: [", i, i+1)
		for j := range perService {
			last := j
			if i == 15 && j == perService-1 && replace {
				last = perService
			}
			w := 1
			if i == 0 && j == 0 {
				w = weight
			}
			if j > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "{address: \"10.200.%d.%d:80\", mac: \"02:00:00:00:%02x:%02x\", weight: %d}", last/200, last%200+1, last>>8, last&0xff, w)
		}
		b.WriteString("]}\n")
	}
	return b.String()
}

// TestReloadAtCapacityRefusedWhole: with every backend slot of the XDP program
// held, a reload that replaces a backend needs one more slot (the new backend's
// is taken before the replaced one, which drains, frees its own). It is refused
// before anything is written, naming the slots that ran out, the service and the
// way through; the running services keep their tables, and a service the
// reload would have changed first keeps its previous-table fallback as it was,
// rather than having it replaced by a table the reload wrote and rolled back.
func TestReloadAtCapacityRefusedWhole(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("cap"), Backends: 1})
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	write := func(weight int, replace bool) {
		t.Helper()
		if err := os.WriteFile(cfgPath, []byte(fullConfig(tp.Balancer.Link, socket, weight, replace)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(1, false)
	if _, err := config.Load(cfgPath); err != nil {
		t.Fatalf("the full config: %v", err)
	}
	p := startAgent(t, tp, cfgPath, socket, false)
	before := xdpStatus(t, p.client)
	tables := func(st api.Status) map[string]api.TableStatus {
		out := map[string]api.TableStatus{}
		for _, s := range st.Services {
			if s.Table != nil {
				out[s.Name] = *s.Table
			}
		}
		return out
	}
	if n := len(tables(before)); n != 16 {
		t.Fatalf("%d services with a table; want 16", n)
	}

	write(2, true)
	err := p.client.Reload(context.Background())
	if err == nil {
		t.Fatal("reload needing one backend slot more than the program has: got no error; want it refused")
	}
	for _, want := range []string{`service "s15"`, "16384 backend slots", "16385 at once", "drain"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("reload error: got %q; want it to say %q", err, want)
		}
	}
	after, err := p.client.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	got, want := tables(after), tables(before)
	for name := range want {
		// The age of a previous table grows; what it is must not change.
		g, w := got[name], want[name]
		g.PreviousAgeSeconds, w.PreviousAgeSeconds = 0, 0
		if !reflect.DeepEqual(g, w) {
			t.Errorf("service %s: table %+v after the refused reload; want it untouched, %+v", name, g, w)
		}
	}
}
