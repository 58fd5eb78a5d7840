package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// TestPlanAndReloadMaxMove runs the agent (proxy and http planes, on loopback: the
// XDP side is userspace/agent's TestPlanPredictsReload, the http plane's requests in
// flight userspace/agent/httpplane's) and drives weir plan and weir reload against it
// as an operator would: what a change moves, connections included, and --max-move
// refusing it with exit status 1 while the running config stays.
func TestPlanAndReloadMaxMove(t *testing.T) {
	// What each plane prints of the 2 client connections the test holds: the
	// proxy's are on a backend each; the http plane's are no backend's.
	for _, tc := range []struct{ plane, held, removedDrained string }{
		{"proxy", "proxy connections: 2 established, 0 reset, 0 drained", `"drained": 1`},
		{"http", "http client connections: 2 open, 0 closed gracefully", `"drained": 0`},
	} {
		t.Run(tc.plane, func(t *testing.T) { testPlanAndReloadMaxMove(t, tc.plane, tc.held, tc.removedDrained) })
	}
}

func testPlanAndReloadMaxMove(t *testing.T, plane, held, removedDrained string) {
	var backends []string
	for range 3 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		backends = append(backends, ln.Addr().String())
		// Exits when ln is closed at cleanup; each connection is held until the client closes it.
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go func() { io.Copy(io.Discard, c); c.Close() }()
			}
		}()
	}
	vipLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	vip := vipLn.Addr().String()
	vipLn.Close()

	dir := t.TempDir()
	socket := filepath.Join(dir, "weir.sock")
	cfg := func(bs ...string) string {
		s := fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n  - name: web\n    vip: %s\n    data_plane: %s\n    algorithm: round_robin\n    health: {type: tcp, interval: 1s}\n    backends:\n", socket, vip, plane)
		for _, b := range bs {
			s += "      - address: " + b + "\n"
		}
		return s
	}
	running, added, removed := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "added.yaml"), filepath.Join(dir, "removed.yaml")
	for path, body := range map[string]string{running: cfg(backends[:2]...), added: cfg(backends...), removed: cfg(backends[0])} {
		if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var agentLog bytes.Buffer
	// Exits when ctx is cancelled at cleanup.
	go func() { done <- run(ctx, []string{"run", "-c", running, "--no-xdp"}, io.Discard, &agentLog) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent: %v\n%s", err, agentLog.String())
		}
	})
	client := admin.NewClient(socket)
	if !waitfor.Cond(10*time.Second, func() bool {
		st, err := client.Status(context.Background())
		if err != nil || len(st.Services) != 1 {
			return false
		}
		for _, b := range st.Services[0].Backends {
			if !b.Usable {
				return false
			}
		}
		return true
	}) {
		t.Fatalf("agent not serving with both backends up:\n%s", agentLog.String())
	}
	// Two client connections: through the proxy, one on each backend (round robin).
	for range 2 {
		c, err := net.Dial("tcp", vip)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
	}
	if !waitfor.Cond(5*time.Second, func() bool {
		st, err := client.Status(context.Background())
		return err == nil && st.Services[0].Connections == 2
	}) {
		t.Fatal("the service does not hold the 2 connections")
	}

	cli := func(args ...string) (string, string, error) {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), args, &stdout, &stderr)
		return stdout.String(), stderr.String(), err
	}
	tests := []struct {
		name       string
		args       []string
		wantErr    bool
		wantStdout []string
		wantStderr string
	}{
		{"plan an added backend", []string{"plan", "-c", added}, false,
			[]string{"service web  updated  " + plane + "  new " + map[string]string{"proxy": "flows", "http": "requests"}[plane] + " moved 33.33%", held}, ""},
		{"plan within --max-move", []string{"plan", "-c", added, "--max-move", "34"}, false, []string{"within --max-move 34%"}, ""},
		{"plan over --max-move", []string{"plan", "-c", added, "--max-move", "10"}, true,
			[]string{"over --max-move 10%: web"}, "web would move more than --max-move 10%"},
		{"plan a removed backend: its connection drains", []string{"plan", "-c", removed, "--json"}, false,
			[]string{`"fate": "drain"`, removedDrained, `"moved": 0.5`}, ""},
		{"plan the running config", []string{"plan", "-s", socket}, false, []string{"service web  unchanged  " + plane + "  new"}, ""},
		{"bad --max-move", []string{"plan", "-c", added, "--max-move", "150"}, true, nil, "percentage 0..100"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stdout, stderr, err := cli(tt.args...)
			if (err != nil) != tt.wantErr {
				t.Fatalf("%v: got error %v (stderr %q); want error %v", tt.args, err, stderr, tt.wantErr)
			}
			for _, w := range tt.wantStdout {
				if !strings.Contains(stdout, w) {
					t.Errorf("stdout: got\n%s\nwant a line containing %q", stdout, w)
				}
			}
			if !strings.Contains(stderr+fmt.Sprint(err), tt.wantStderr) {
				t.Errorf("stderr %q, error %v; want %q", stderr, err, tt.wantStderr)
			}
		})
	}

	t.Run("reload --max-move", func(t *testing.T) {
		os.WriteFile(running, []byte(cfg(backends...)), 0o644)
		_, stderr, err := cli("reload", "-c", running, "--max-move", "10")
		if err == nil || !strings.Contains(stderr, "reload rejected") || !strings.Contains(stderr, "over the disruption budget") {
			t.Fatalf("reload --max-move 10: got %v, stderr %q; want it rejected over the budget", err, stderr)
		}
		st, err := client.Status(context.Background())
		if err != nil || len(st.Services[0].Backends) != 2 {
			t.Fatalf("after the refused reload: %v, %+v; want the running config's 2 backends", err, st)
		}
		if _, stderr, err := cli("reload", "-c", running, "--max-move", "34"); err != nil {
			t.Fatalf("reload --max-move 34: %v (%s)", err, stderr)
		}
		if st, err := client.Status(context.Background()); err != nil || len(st.Services[0].Backends) != 3 {
			t.Fatalf("after the reload: %v, %+v; want 3 backends", err, st)
		}
	})
}

// TestPlanVerdictSaysEveryReason: a plan both over --max-move and refused for
// the XDP program's slots says both on stderr, as its table does; before, only
// the budget line was printed, and an operator who cut the change to fit the
// budget met the refusal only at the reload. (An agent at the program's slot
// limit is userspace/agent's TestReloadAtCapacityRefusedWhole.)
func TestPlanVerdictSaysEveryReason(t *testing.T) {
	refused := `/etc/weir/weir.yaml:20: services[15]: the XDP program has 16384 backend slots, and this change needs 16385 at once`
	for _, tc := range []struct {
		name string
		plan api.Plan
		want []string
	}{
		{"both", api.Plan{OverBudget: []string{"web"}, Refused: refused}, []string{
			"weir: plan: web would move more than --max-move 5% of new flows",
			"weir: plan: a reload would be refused: " + refused}},
		{"over budget", api.Plan{OverBudget: []string{"web", "db"}}, []string{"weir: plan: web, db would move more than --max-move 5% of new flows"}},
		{"refused", api.Plan{Refused: refused}, []string{"weir: plan: a reload would be refused: " + refused}},
		{"neither", api.Plan{}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			err := planVerdict(&stderr, tc.plan, 5)
			want, wantErr := "", error(nil)
			if tc.want != nil {
				want, wantErr = strings.Join(tc.want, "\n")+"\n", errReported
			}
			if got := stderr.String(); got != want {
				t.Errorf("stderr: got %q; want %q", got, want)
			}
			if err != wantErr {
				t.Errorf("error: got %v; want %v", err, wantErr)
			}
		})
	}
}
