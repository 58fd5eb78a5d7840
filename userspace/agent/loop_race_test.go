package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
)

// syncBuffer is a log sink safe for the agent's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// levels returns the log lines at any of the given levels.
func (s *syncBuffer) levels(want ...string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out strings.Builder
	for _, line := range strings.Split(s.b.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && slices.Contains(want, fmt.Sprint(m["level"])) {
			out.WriteString(line + "\n")
		}
	}
	return out.String()
}

// count returns how many JSON log lines have msg and every attribute of attrs.
func (s *syncBuffer) count(msg string, attrs map[string]string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, line := range strings.Split(s.b.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) != nil || m["msg"] != msg {
			continue
		}
		ok := true
		for k, v := range attrs {
			ok = ok && fmt.Sprint(m[k]) == v
		}
		if ok {
			n++
		}
	}
	return n
}

// TestLoopRace fires health changes, reloads, drains, plans and status reads at a running
// agent at once for a couple of seconds (run it with -race), then checks that every
// event took effect: the final state is what the last event of each kind said, and
// the log holds one line per applied event. The agent serves two proxy services on
// loopback; the backends are real listeners, checked once an hour, so the only
// health changes are the ones the test sends (through the loop's event channel, as
// the checker's watcher does).
func TestLoopRace(t *testing.T) {
	var backends []string
	for range 6 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		// Exits when ln is closed at cleanup.
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		backends = append(backends, ln.Addr().String())
	}
	vips := []string{freePort(t), freePort(t)}
	dir := t.TempDir()
	path := filepath.Join(dir, "weir.yaml")
	writeConfig := func(weight int) {
		t.Helper()
		svc := func(name, vip string, bs []string, firstWeight int) string {
			s := fmt.Sprintf("- name: %s\n  vip: %s\n  data_plane: proxy\n  health: {interval: 1h, initial: up}\n  backends:\n", name, vip)
			for i, b := range bs {
				w := 1
				if i == 0 {
					w = firstWeight
				}
				s += fmt.Sprintf("  - {address: %s, weight: %d}\n", b, w)
			}
			return s
		}
		cfg := fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n", filepath.Join(dir, "weir.sock")) +
			svc("a", vips[0], backends[:3], weight) + svc("b", vips[1], backends[3:], 1)
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeConfig(1)

	logs := &syncBuffer{}
	a := New(Options{ConfigPath: path, NoXDP: true, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	// Exits when ctx is cancelled below.
	go func() { runErr <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	// Running, and the checker's replay of its six backends' state (sent to the
	// loop when the agent starts, from a goroutine of its own) taken: the test's
	// changes must not race with it, or one of them lands on a state the replay
	// set and changes nothing.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := a.Status(); err == nil && a.running.Load() && a.healthTaken.Load() >= uint64(len(backends)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not ready after 10s (running %t, %d of the checker's %d replayed changes taken); log:\n%s",
				a.running.Load(), a.healthTaken.Load(), len(backends), logs.b.String())
		}
		time.Sleep(5 * time.Millisecond)
	}

	const runFor, maxEach = 2 * time.Second, 400
	stop := time.Now().Add(runFor)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}

	// Health: backends 2 and 3 of a go down and up, each from its own goroutine.
	sentHealth := map[string]int{}
	lastHealth := map[string]health.State{}
	for _, b := range backends[1:3] {
		wg.Go(func() {
			n, to := 0, health.Down
			for ; n < maxEach && time.Now().Before(stop); n++ {
				a.post(ctx, healthEvent{health.Change{ID: "a/" + b, Service: "a", From: health.Up, To: to,
					Usable: to == health.Up, Reason: "race-test"}})
				if to == health.Down {
					to = health.Up
				} else {
					to = health.Down
				}
			}
			last := health.Up // to is the one not sent yet
			if to == health.Up {
				last = health.Down
			}
			mu.Lock()
			sentHealth[b], lastHealth[b] = n, last
			mu.Unlock()
		})
	}
	// Drains: backends of b drained and undrained.
	sentDrains := map[string]int{}
	lastDrain := map[string]bool{}
	for _, b := range backends[3:] {
		wg.Go(func() {
			n, drain := 0, true
			for ; n < maxEach && time.Now().Before(stop); n++ {
				if err := a.SetDrain(ctx, "b", b, drain); err != nil {
					fail(fmt.Errorf("drain %s: %w", b, err))
					return
				}
				drain = !drain
			}
			mu.Lock()
			sentDrains[b], lastDrain[b] = n, !drain
			mu.Unlock()
		})
	}
	// The first config, read before the reloads below start rewriting the file
	// (read while one truncates it, it was empty).
	first, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Reloads: a's first backend gets a new weight each time.
	reloads, lastWeight := 0, 1
	wg.Go(func() {
		for w := 2; w < 2+maxEach/4 && time.Now().Before(stop); w++ {
			writeConfig(w)
			if err := a.Reload(ctx); err != nil {
				fail(fmt.Errorf("reload %d: %w", w, err))
				return
			}
			reloads, lastWeight = reloads+1, w
		}
	})
	// Plans of the first config (sent, not read: the reloads rewrite the file):
	// answered in the loop, between the other events, never about a half-applied
	// state (the running services are always a and b).
	wg.Go(func() {
		for time.Now().Before(stop) {
			p, err := a.Plan(ctx, first, "first.yaml", nil)
			if err != nil {
				fail(fmt.Errorf("plan: %w", err))
				return
			}
			if len(p.Services) != 2 || p.Services[0].Change == "added" || p.Services[1].Change == "added" {
				fail(fmt.Errorf("plan: got %+v; want the running services a and b", p.Services))
				return
			}
		}
	})
	// Status reads: always whole.
	for range 2 {
		wg.Go(func() {
			for time.Now().Before(stop) {
				st, err := a.Status()
				if err != nil {
					fail(fmt.Errorf("status: %w", err))
					return
				}
				if len(st.Services) != 2 || len(st.Services[0].Backends) != 3 || len(st.Services[1].Backends) != 3 {
					fail(fmt.Errorf("status: got %d services; want 2 with 3 backends each", len(st.Services)))
					return
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	// Health changes are posted, not answered: a request behind them in the loop's
	// queue returns once they are applied and published.
	if _, err := a.Plan(ctx, first, "first.yaml", nil); err != nil {
		t.Fatal(err)
	}

	st, err := a.Status()
	if err != nil {
		t.Fatal(err)
	}
	byAddr := map[string]struct {
		health  string
		drained bool
		weight  uint32
	}{}
	for _, s := range st.Services {
		for _, b := range s.Backends {
			byAddr[s.Name+"/"+b.Address] = struct {
				health  string
				drained bool
				weight  uint32
			}{b.Health, b.Drained, b.ConfigWeight}
		}
	}
	for _, b := range backends[1:3] {
		if got, want := byAddr["a/"+b].health, lastHealth[b].String(); got != want {
			t.Errorf("a/%s health: got %s; want %s (the last change sent)", b, got, want)
		}
		if got, want := logs.count("backend health", map[string]string{"backend": b, "reason": "race-test"}), sentHealth[b]; got != want {
			t.Errorf("a/%s: %d health changes applied; want %d sent", b, got, want)
		}
	}
	for _, b := range backends[3:] {
		if got, want := byAddr["b/"+b].drained, lastDrain[b]; got != want {
			t.Errorf("b/%s drained: got %t; want %t (the last drain set)", b, got, want)
		}
		if got, want := logs.count("backend changed at runtime", map[string]string{"backend": b}), sentDrains[b]; got != want {
			t.Errorf("b/%s: %d runtime changes applied; want %d made", b, got, want)
		}
	}
	if got := byAddr["a/"+backends[0]].weight; got != uint32(lastWeight) {
		t.Errorf("a/%s config weight: got %d; want %d (the last reload's)", backends[0], got, lastWeight)
	}
	if got := logs.count("reloaded", nil); got != reloads {
		t.Errorf("%d reloads applied; want %d made", got, reloads)
	}
	t.Logf("sent %v health changes, %v drains, %d reloads", sentHealth, sentDrains, reloads)
	if t.Failed() {
		t.Logf("the agent's errors and warnings:\n%s", logs.levels("ERROR", "WARN"))
	}
}

// freePort returns a loopback address whose port was free a moment ago.
func freePort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
