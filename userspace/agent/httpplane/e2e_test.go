package httpplane_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// These tests run the whole agent in this process, without XDP, on loopback:
// real backends (internal/httpbackend: HTTP/1.1, h2c and gRPC), real clients
// (h2load from nghttp2-client, grpc-go, net/http).

// freePort returns a loopback port nobody listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// backendList is the YAML list of bs's addresses.
func backendList(bs []*httpbackend.Backend) string {
	var s []string
	for _, b := range bs {
		s = append(s, "{address: "+b.Addr.String()+"}")
	}
	return "[" + strings.Join(s, ", ") + "]"
}

type running struct {
	a       *agent.Agent
	config  string
	metrics string
	done    chan error
}

// startAgent writes services (YAML list items, indented two spaces) into a
// config and runs the agent on it until cleanup. metrics, if given, is the
// metrics.listen address (default off).
func startAgent(t *testing.T, services string, metrics ...string) *running {
	t.Helper()
	dir := t.TempDir()
	r := &running{config: filepath.Join(dir, "weir.yaml"), done: make(chan error, 1), metrics: "off"}
	if len(metrics) > 0 {
		r.metrics = metrics[0]
	}
	r.writeConfig(t, services)
	var logw io.Writer = io.Discard
	if testing.Verbose() {
		logw = os.Stderr
	}
	r.a = agent.New(agent.Options{ConfigPath: r.config, NoXDP: true, Logger: slog.New(slog.NewTextHandler(logw, nil))})
	ctx, cancel := context.WithCancel(context.Background())
	// Exits when cancel is called at cleanup.
	go func() { r.done <- r.a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-r.done:
			if err != nil {
				t.Errorf("agent: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("agent did not stop within 30s")
		}
	})
	waitfor.Value(t, 10*time.Second, "the agent running", func() (any, bool) {
		select {
		case err := <-r.done:
			t.Fatalf("agent: %v", err)
		default:
		}
		st, err := r.a.Status()
		return err, err == nil && len(st.Services) > 0
	})
	return r
}

// writeConfig (re)writes the agent's config file with services.
func (r *running) writeConfig(t *testing.T, services string) {
	t.Helper()
	cfg := fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: %q}\nservices:\n%s", filepath.Join(filepath.Dir(r.config), "weir.sock"), r.metrics, services)
	if err := os.WriteFile(r.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
}

func (r *running) service(t *testing.T, name string) api.ServiceStatus {
	t.Helper()
	st, err := r.a.Status()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range st.Services {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("service %q not in status", name)
	return api.ServiceStatus{}
}

// h2load runs nghttp2's load generator and returns its summary. A missing h2load
// fails the test: `make deps` installs it (nghttp2-client).
func h2load(t *testing.T, args ...string) h2loadResult {
	t.Helper()
	path, err := exec.LookPath("h2load")
	if err != nil {
		t.Fatalf("h2load not found (Debian nghttp2-client; make deps installs it): %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("h2load %v: %v\n%s", args, err, out)
	}
	return parseH2load(t, string(out))
}

type h2loadResult struct {
	done, succeeded, failed, errored, ok2xx int
	out                                     string
}

var (
	h2reqRE    = regexp.MustCompile(`requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored`)
	h2statusRE = regexp.MustCompile(`status codes: (\d+) 2xx`)
)

func parseH2load(t *testing.T, out string) h2loadResult {
	t.Helper()
	m := h2reqRE.FindStringSubmatch(out)
	s := h2statusRE.FindStringSubmatch(out)
	if m == nil || s == nil {
		t.Fatalf("h2load output not understood:\n%s", out)
	}
	n := func(x string) int { v, _ := strconv.Atoi(x); return v }
	return h2loadResult{done: n(m[3]), succeeded: n(m[4]), failed: n(m[5]), errored: n(m[6]), ok2xx: n(s[1]), out: out}
}

// shares returns each backend's hits since before, as a share of their sum.
func shares(bs []*httpbackend.Backend, before []int64) ([]float64, int64) {
	var total int64
	d := make([]int64, len(bs))
	for i, b := range bs {
		d[i] = b.Hits.Load() - before[i]
		total += d[i]
	}
	out := make([]float64, len(bs))
	for i := range d {
		out[i] = float64(d[i]) / float64(max(total, 1))
	}
	return out, total
}

func hits(bs []*httpbackend.Backend) []int64 {
	out := make([]int64, len(bs))
	for i, b := range bs {
		out[i] = b.Hits.Load()
	}
	return out
}

func get(t *testing.T, c *http.Client, url string) (int, string) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
