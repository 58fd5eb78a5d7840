package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

func TestHealthMethod(t *testing.T) {
	auto := health.MethodConnect
	if haveNetRaw() {
		auto = health.MethodSyn
	}
	tests := []struct {
		typ    config.CheckType
		method config.CheckMethod
		want   health.Method
	}{
		{config.CheckTCP, config.MethodAuto, auto},
		{config.CheckTCP, config.MethodSyn, health.MethodSyn},
		{config.CheckTCP, config.MethodConnect, health.MethodConnect},
		{config.CheckHTTP, config.MethodAuto, health.MethodConnect},
		{config.CheckHTTP, config.MethodConnect, health.MethodConnect},
		{config.CheckNone, config.MethodAuto, health.MethodConnect},
	}
	for _, tt := range tests {
		if got := healthMethod(tt.typ, tt.method); got != tt.want {
			t.Errorf("healthMethod(%s, %s): got %v; want %v", tt.typ, tt.method, got, tt.want)
		}
	}
}

// TestHealthVerdictReachesProxy: a backend whose checks fail is down in status
// and gets no connection from the proxy (with no retry, one sent to it would
// fail); a reload that leaves its check as it was keeps it down, with no
// return to its initial up in between; once it listens again it is up and
// served.
func TestHealthVerdictReachesProxy(t *testing.T) {
	live, dead, vip := echoBackend(t), freePort(t), freePort(t)
	path := filepath.Join(t.TempDir(), "weir.yaml")
	write := func(liveWeight int) {
		t.Helper()
		writeCheckedProxy(t, path, vip, "  algorithm: round_robin\n  panic_threshold: 0\n  proxy: {retries: 0}\n",
			fmt.Sprintf("{address: %s, weight: %d}", live, liveWeight), fmt.Sprintf("{address: %s}", dead))
	}
	write(1)
	var changes atomic.Int32 // health changes the agent applied
	a := runAgentLogged(t, path, slog.New(onMessage{"backend health", func() { changes.Add(1) }}))
	status := func(addr string) api.BackendStatus {
		t.Helper()
		st, err := a.Status()
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range st.Services[0].Backends {
			if b.Address == addr {
				return b
			}
		}
		t.Fatalf("status: no backend %s", addr)
		return api.BackendStatus{}
	}
	served := func(during string) {
		t.Helper()
		for i := range 10 {
			if err := dialEcho(t, vip).ask(fmt.Sprint(during, i)); err != nil {
				t.Fatalf("%s: connection %d: %v; want every one served by the live backend", during, i, err)
			}
		}
	}
	waitfor.Value(t, 10*time.Second, "the dead backend down and unusable", func() (any, bool) {
		b := status(dead)
		return b, b.Health == "down" && !b.Usable
	})
	served("dead down")

	write(2)
	before, reloaded := changes.Load(), time.Now()
	if err := a.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if b := status(dead); b.Health != "down" || b.Usable {
		t.Errorf("right after a reload that kept its check: got health %s, usable %t; want down, unusable", b.Health, b.Usable)
	}
	// Once a check that started after the reload has been applied, a flap
	// (back to the initial up, then down again) would have been logged.
	id := plan.ID("a", netip.MustParseAddrPort(dead))
	waitfor.Value(t, 10*time.Second, "a check of the dead backend after the reload", func() (any, bool) {
		st, _ := a.checker.Status(id)
		return st.Last.Start, st.Last.Start.After(reloaded)
	})
	if n := changes.Load() - before; n != 0 {
		t.Errorf("health changes applied across a reload that kept the check: got %d; want 0", n)
	}
	served("after the reload")

	churn.EchoAt(t, dead)
	waitfor.Value(t, 10*time.Second, "the revived backend up and usable", func() (any, bool) {
		b := status(dead)
		return b, b.Health == "up" && b.Usable
	})
	served("both up")
}

// TestPanicShownInStatus: in panic (here 1 of 3 backends up, below the
// default 50 %) the down backends are used, and status says why, as it does
// for a backend all_down: keep_last keeps.
func TestPanicShownInStatus(t *testing.T) {
	path := filepath.Join(t.TempDir(), "weir.yaml")
	var backends []string
	for _, addr := range []string{echoBackend(t), freePort(t), freePort(t)} {
		backends = append(backends, fmt.Sprintf("{address: %s}", addr))
	}
	writeCheckedProxy(t, path, freePort(t), "", backends...)
	a := runAgent(t, path)
	waitfor.Value(t, 10*time.Second, "both dead backends down", func() (any, bool) {
		st, err := a.Status()
		if err != nil {
			t.Fatal(err)
		}
		down := 0
		for _, b := range st.Services[0].Backends {
			if b.Health == "down" {
				down++
			}
		}
		return st.Services[0].Backends, down == 2
	})
	st, _ := a.Status()
	for _, b := range st.Services[0].Backends {
		if b.Health != "down" {
			continue
		}
		if !b.Usable || !strings.HasPrefix(b.Reason, "panic: ") {
			t.Errorf("%s, down in panic: got usable %t, reason %q; want usable, with a reason saying panic", b.Address, b.Usable, b.Reason)
		}
	}
}

// writeCheckedProxy writes to path a config of one proxy service "a" at vip,
// its backends checked by connect every 100ms (a failure takes one down, a
// pass brings it up), with the service's further settings extra (indented
// lines) and the backends given as flow maps.
func writeCheckedProxy(t *testing.T, path, vip, extra string, backends ...string) {
	t.Helper()
	cfg := fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n", filepath.Join(filepath.Dir(path), "weir.sock")) +
		fmt.Sprintf("- name: a\n  vip: %s\n  data_plane: proxy\n", vip) + extra +
		"  health: {type: tcp, method: connect, interval: 100ms, timeout: 50ms, rise: 1, fall: 1}\n  backends:\n"
	for _, b := range backends {
		cfg += "  - " + b + "\n"
	}
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
}
