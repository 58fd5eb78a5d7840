package api

import (
	"bytes"
	"os"
	"strings"
	"testing"
	"time"
)

// TestStatusSample: the `weir status` sample in docs/operating.md is what
// status prints for the agent it describes.
func TestStatusSample(t *testing.T) {
	st := Status{Config: "/etc/weir/weir.yaml", Started: time.Date(2026, 3, 2, 9, 14, 5, 0, time.UTC),
		XDP:     XDPStatus{Loaded: true, Pinned: true, PinPath: "/sys/fs/bpf/weir", Interfaces: []InterfaceStatus{{Name: "eth0", Mode: "native"}}},
		Reloads: []ReloadStatus{{Time: time.Date(2026, 3, 2, 10, 2, 41, 0, time.UTC), OK: true}},
		Services: []ServiceStatus{{
			Name: "web", Key: "tcp/192.0.2.10:80", DataPlane: PlaneXDP, Why: "XDP nat mode, self-test passed", Mode: "nat", Algorithm: "maglev",
			HealthMethod: "syn", Packets: 1846130, Bytes: 1211835892, ActiveFlows: 216,
			Table: &TableStatus{Fingerprint: "5e1f0c2a9b7d3e41", Size: 65537},
			Backends: []BackendStatus{
				{Address: "10.0.0.11:80", Health: "up", Usable: true, Weight: 1, ConfigWeight: 1, ActiveFlows: 70, Packets: 614212, Bytes: 403118190, LastCheck: "ok", LastCheckAgo: "1.204s"},
				{Address: "10.0.0.12:80", Health: "up", Usable: true, Weight: 2, ConfigWeight: 2, ActiveFlows: 142, Packets: 1229708, Bytes: 807315585, LastCheck: "ok", LastCheckAgo: "380ms"},
				{Address: "10.0.0.13:80", Health: "up", Usable: true, Weight: 1, ConfigWeight: 1, Drained: true, Override: true, DrainOverride: true, ActiveFlows: 4, Packets: 2210, Bytes: 1402117, Reason: "drained", LastCheck: "ok", LastCheckAgo: "1.9s"},
			}}, {
			Name: "app", Key: "tcp/192.0.2.10:8080", DataPlane: PlaneProxy, Why: "data_plane: proxy", Algorithm: "least_conn",
			HealthMethod: "syn", Connections: 3, Accepted: 4127, Bytes: 88314002,
			Backends: []BackendStatus{
				{Address: "10.0.0.21:8080", Health: "up", Usable: true, Weight: 1, ConfigWeight: 1, Connections: 2, Connects: 2064, Bytes: 44157001, LastCheck: "ok", LastCheckAgo: "640ms"},
				{Address: "10.0.0.22:8080", Health: "down", Usable: false, Weight: 1, ConfigWeight: 1, Connections: 1, Connects: 2063, Bytes: 44157001,
					Reason: "health: down", LastCheck: "connect: connection refused", LastCheckAgo: "1.1s"},
			}}}}
	var b bytes.Buffer
	st.WriteTable(&b)
	if want := docSamples(t, "../../../docs/operating.md", "$ weir status")[0]; b.String() != want {
		t.Errorf("operating.md's status sample:\n%s\nwant what weir status prints:\n%s", want, b.String())
	}
}

// TestPlanSamples: the `weir plan` samples in docs/operating.md are what the
// plan prints for the changes they describe, less the lines the docs elide
// ("...") and the header the second leaves out.
func TestPlanSamples(t *testing.T) {
	traffic := 2.0 / 3
	xdp := []ServicePlan{{
		Service: "keep", Change: "updated", DataPlane: PlaneXDP, NextDataPlane: PlaneXDP, Moved: 0.50005, TrafficMoved: &traffic,
		Table: &TablePlan{Size: 65537, NextSize: 65537, Moved: 32773, Moves: []SlotMove{
			{"10.77.0.11:9000", "10.77.0.14:9000", 5459, 0.0833}, {"10.77.0.12:9000", "10.77.0.14:9000", 5460, 0.0833},
			{"10.77.0.13:9000", "10.77.0.11:9000", 5462, 0.0833}, {"10.77.0.13:9000", "10.77.0.12:9000", 5457, 0.0833},
			{"10.77.0.13:9000", "10.77.0.14:9000", 10926, 0.1667}}},
		FlowKind: "xdp flows", Drained: 4, Flows: []BackendPlan{
			{"10.77.0.11:9000", 3, 0, "stay"}, {"10.77.0.12:9000", 5, 0, "stay"}, {"10.77.0.13:9000", 4, 0, "drain"}, {"10.77.0.14:9000", 0, 0, "stay"}},
	}, {
		Service: "gone", Change: "removed", DataPlane: PlaneXDP, Moved: 1,
		FlowKind: "xdp flows", Reset: 3, Flows: []BackendPlan{{"10.77.0.11:9000", 3, 0, "reset"}, {"10.77.0.12:9000", 0, 0, "reset"}},
	}}
	http := []ServicePlan{{
		Service: "web", Change: "updated", DataPlane: PlaneHTTP, NextDataPlane: PlaneHTTP, Moved: 0.3334,
		Table: &TablePlan{Size: 65537, NextSize: 65537, Moved: 21853, Moves: []SlotMove{
			{"127.0.0.1:39475", "127.0.0.1:33371", 10920, 0.1666}, {"127.0.0.1:39475", "127.0.0.1:40117", 10926, 0.1667}}},
		FlowKind: "http requests in flight", Drained: 12, Clients: &ClientPlan{Open: 24},
		Flows: []BackendPlan{{"127.0.0.1:39475", 12, 0, "drain"}, {"127.0.0.1:33371", 0, 0, "stay"}},
	}}
	samples := docSamples(t, "../../../docs/operating.md", "$ weir plan", "service web  updated  http")
	for i, p := range []Plan{{Config: "b.yaml", Services: xdp}, {Services: http}} {
		var b bytes.Buffer
		p.WriteTable(&b)
		got := b.String()
		if i == 1 {
			_, got, _ = strings.Cut(got, "\n\n") // the sample starts at its service
		}
		if want := samples[i]; got != want {
			t.Errorf("operating.md's plan sample %d:\n%s\nwant what weir plan prints:\n%s", i+1, want, got)
		}
	}
}

// docSamples returns, for each of firsts, the fenced block of the markdown
// file at path whose first line begins so, without that line if it is a
// command ("$ ..."), and without the lines that say "...".
func docSamples(t *testing.T, path string, firsts ...string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(data), "\n")
	out := make([]string, len(firsts))
	for i := 0; i < len(lines); i++ {
		if !strings.HasPrefix(strings.TrimSpace(lines[i]), "```") || i+1 == len(lines) {
			continue
		}
		start := i + 1
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
		}
		for k, first := range firsts {
			if !strings.HasPrefix(lines[start], first) {
				continue
			}
			var b strings.Builder
			for j, l := range lines[start:i] {
				if j == 0 && strings.HasPrefix(l, "$ ") || strings.TrimSpace(l) == "..." {
					continue
				}
				b.WriteString(l + "\n")
			}
			out[k] = b.String()
		}
	}
	for k, first := range firsts {
		if out[k] == "" {
			t.Fatalf("%s has no sample beginning %q", path, first)
		}
	}
	return out
}
