package api

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// TestWriteTable: each runtime override is marked on the column it changes, every
// backend that takes no new flows says why, and the table fits 120 columns.
func TestWriteTable(t *testing.T) {
	st := Status{Config: "/etc/weir/weir.yaml", XDP: XDPStatus{Loaded: true, Pinned: true, PinPath: "/sys/fs/bpf/weir",
		Interfaces: []InterfaceStatus{{Name: "eth0", Mode: "native"}}},
		Services: []ServiceStatus{{Name: "web", Key: "tcp/10.77.100.1:80", DataPlane: PlaneXDP, Why: "XDP dsr mode, self-test passed",
			Mode: "dsr", Algorithm: "maglev", Table: &TableStatus{Fingerprint: "5e1f0c2a9b7d3e41", Size: 65537,
				Previous: "0a1b2c3d4e5f6071", PreviousAgeSeconds: 190}, Backends: []BackendStatus{
				{Address: "10.77.0.11:80", Health: "up", Usable: true, Weight: 1, ConfigWeight: 1, Drained: true, Override: true, DrainOverride: true,
					MAC: "02:77:00:00:00:0b", Reason: "drained", LastCheck: "ok", LastCheckAgo: "120ms"},
				{Address: "10.77.0.12:80", Health: "up", Usable: true, Weight: 5, ConfigWeight: 1, Override: true, WeightOverride: true,
					MAC: "02:77:00:00:00:0c", LastCheck: "ok", LastCheckAgo: "80ms"},
				{Address: "10.77.0.13:80", Health: "up", Usable: false, Weight: 1, ConfigWeight: 1,
					MACError: "10.77.0.13 on eth0: neighbour resolution pending (the kernel is sending ARP/ND; if this persists the backend is unreachable)",
					Reason:   "mac unknown: 10.77.0.13 on eth0: neighbour resolution pending", LastCheck: "ok", LastCheckAgo: "30ms"},
			}}}}
	var b bytes.Buffer
	st.WriteTable(&b)
	out := b.String()
	for _, want := range []string{
		"10.77.0.11:80  up      true    1                    true (runtime)  02:77",
		"10.77.0.12:80  up      true    5 (runtime; file 1)  false",
		"10.77.0.13:80  up      false   1                    false           unknown",
		"  10.77.0.11:80: drained\n",
		"  10.77.0.13:80: mac unknown: 10.77.0.13 on eth0: neighbour resolution pending\n",
		"  lookup table 5e1f0c2a9b7d3e41, 65537 entries; previous 0a1b2c3d4e5f6071, replaced 3m10s ago\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "file 1)  true") || strings.Contains(out, "(runtime; file 1)  true") {
		t.Errorf("a drain marked the weight column:\n%s", out)
	}
	for _, line := range strings.Split(out, "\n") {
		if len(line) > 120 && !strings.Contains(line, ": ") {
			t.Errorf("line of %d columns; want ≤ 120: %q", len(line), line)
		}
	}
}

// TestWriteTableHealthUnapplied: verdicts the data planes refused are one line,
// saying the backends are shown as before them, with the tries and the error.
func TestWriteTableHealthUnapplied(t *testing.T) {
	at := time.Date(2026, 3, 2, 10, 2, 41, 0, time.UTC)
	st := Status{HealthUnapplied: &UnappliedHealth{Since: at, Attempts: 4, LastError: "set backend: no space left", NextTry: at.Add(15 * time.Second)}}
	var b bytes.Buffer
	st.WriteTable(&b)
	want := "health: verdicts NOT APPLIED since 2026-03-02T10:02:41Z (the backends below are as before them), 4 tries, next at 2026-03-02T10:02:56Z: set backend: no space left\n"
	if !strings.Contains(b.String(), want) {
		t.Errorf("table lacks %q:\n%s", want, b.String())
	}
	b.Reset()
	(Status{}).WriteTable(&b)
	if strings.Contains(b.String(), "health:") {
		t.Errorf("with every verdict applied, the table has a health line:\n%s", b.String())
	}
}

// TestWriteTableHTTP: an http service shows its requests in flight and
// answered, and each backend's in-flight requests, answers, 5xx and the latency
// estimate its algorithm picks by ("-" where it keeps none).
func TestWriteTableHTTP(t *testing.T) {
	st := Status{Services: []ServiceStatus{{Name: "api", Key: "tcp/10.77.100.2:80", DataPlane: PlaneHTTP, Why: "data_plane: http",
		Algorithm: "ewma", Connections: 3, Accepted: 7, InFlight: 12, Tunnels: 2, Requests: 20000, Backends: []BackendStatus{
			{Address: "10.77.0.11:80", Health: "up", Usable: true, Weight: 1, InFlight: 5, Requests: 10000, Classes: map[string]uint64{"2xx": 10000}, Latency: "1.2ms"},
			{Address: "10.77.0.12:80", Health: "ejected", Usable: false, Weight: 1, InFlight: 0, Requests: 10000, Classes: map[string]uint64{"5xx": 7}},
		}}}}
	var b bytes.Buffer
	st.WriteTable(&b)
	out := b.String()
	for _, want := range []string{
		"3 connections, 7 accepted, 12 requests in flight (2 of them tunnels), 20000 answered",
		"in flight  requests  5xx  latency",
		"10.77.0.11:80  up       true    1       false    5          10000     0    1.2ms",
		"10.77.0.12:80  ejected  false   1       false    0          10000     7    -",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}
