package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/agent"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// The agent under test runs as a child process (this test binary, re-executed
// through `ip netns exec` into the balancer's namespace), so that everything it
// does — XDP attach, neighbour lookups, health checks, proxy sockets, bpffs — happens
// in that namespace as it would on a host, and signals reach it as they would.
const childEnv = "WEIR_AGENT_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(child())
	}
	os.Exit(m.Run())
}

func child() int {
	ctx, stop := signalContext()
	defer stop()
	a := agent.New(agent.Options{ConfigPath: os.Getenv("WEIR_AGENT_TEST_CONFIG"), NoXDP: os.Getenv("WEIR_AGENT_TEST_NOXDP") == "1"})
	if err := a.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		return 1
	}
	return 0
}

func signalNotify(ch chan os.Signal) { signal.Notify(ch, syscall.SIGTERM, os.Interrupt) }

func signalContext() (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 1)
	signalNotify(ch)
	// Exits at the first SIGTERM or SIGINT.
	go func() {
		<-ch
		cancel()
	}()
	return ctx, cancel
}

// backends serves HTTP on :80 and UDP on VIP:53 and own:53 in each backend
// namespace, answering with the backend's name, each stoppable on its own.
type backends struct {
	mu      sync.Mutex
	servers map[string]*http.Server
	hosts   map[string]topo.Host
	wg      sync.WaitGroup
}

func serveBackends(t *testing.T, tp *topo.Topology) *backends {
	bs := &backends{servers: map[string]*http.Server{}, hosts: map[string]topo.Host{}}
	var pcs []net.PacketConn
	for _, h := range tp.Backends {
		bs.hosts[h.Name] = h
		if err := bs.serveHTTP(h); err != nil {
			t.Fatal(err)
		}
		for _, ip := range []netip.Addr{tp.VIP4, h.IP4} {
			pc, err := h.NS.ListenPacket("udp", netip.AddrPortFrom(ip, 53).String())
			if err != nil {
				t.Fatal(err)
			}
			bs.wg.Add(1)
			// Exits when pc is closed at cleanup.
			go func() {
				defer bs.wg.Done()
				buf := make([]byte, 512)
				for {
					_, from, err := pc.ReadFrom(buf)
					if err != nil {
						return
					}
					pc.WriteTo([]byte(h.Name), from)
				}
			}()
			pcs = append(pcs, pc)
		}
	}
	t.Cleanup(func() {
		bs.mu.Lock()
		for _, s := range bs.servers {
			s.Close()
		}
		bs.mu.Unlock()
		for _, pc := range pcs {
			pc.Close()
		}
		bs.wg.Wait()
	})
	return bs
}

// serveHTTP serves h's name over HTTP on :80 in its namespace.
func (bs *backends) serveHTTP(h topo.Host) error {
	ln, err := h.NS.Listen("tcp", ":80")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, h.Name)
	}), ReadHeaderTimeout: 5 * time.Second}
	bs.mu.Lock()
	bs.servers[h.Name] = srv
	bs.mu.Unlock()
	bs.wg.Add(1)
	// Exits when srv is closed (kill or cleanup).
	go func() { defer bs.wg.Done(); srv.Serve(ln) }()
	return nil
}

// kill closes a backend's HTTP listener and connections, as a crashed server would.
func (bs *backends) kill(name string) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	bs.servers[name].Close()
}

// revive starts a killed backend's server again.
func (bs *backends) revive(t *testing.T, name string) {
	t.Helper()
	if err := bs.serveHTTP(bs.hosts[name]); err != nil {
		t.Fatal(err)
	}
}

// keepAlive is one HTTP/1.1 connection to the VIP that asks again and again: the
// answers say which backend holds its flow.
type keepAlive struct {
	conn *net.TCPConn
	br   *bufio.Reader
}

func dialKeepAlive(t *testing.T, tp *topo.Topology, vip netip.Addr) *keepAlive {
	t.Helper()
	conn, err := tp.DialTCP(context.Background(), netip.AddrPortFrom(vip, 80), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &keepAlive{conn: conn, br: bufio.NewReader(conn)}
}

func (k *keepAlive) ask() (string, error) {
	k.conn.SetDeadline(time.Now().Add(3 * time.Second))
	return topo.Ask(k.conn, k.br)
}

type agentProc struct {
	cmd    *exec.Cmd
	client *admin.Client
	log    *strings.Builder
	done   chan error
}

func startAgent(t *testing.T, tp *topo.Topology, cfgPath, socket string, noXDP bool) *agentProc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", tp.Balancer.NS.Name(), exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "WEIR_AGENT_TEST_CONFIG="+cfgPath)
	if noXDP {
		cmd.Env = append(cmd.Env, "WEIR_AGENT_TEST_NOXDP=1")
	}
	p := &agentProc{cmd: cmd, client: admin.NewClient(socket), log: &strings.Builder{}, done: make(chan error, 1)}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var logMu sync.Mutex
	logDone := make(chan struct{})
	// Exits when the child's output ends (pw closed after Wait).
	go func() {
		defer close(logDone)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			logMu.Lock()
			p.log.WriteString(sc.Text() + "\n")
			logMu.Unlock()
		}
	}()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Exits when the child exits.
	go func() { err := cmd.Wait(); pw.Close(); p.done <- err }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-p.done
		}
		<-logDone
		if t.Failed() {
			t.Logf("agent log:\n%s", p.log.String())
		}
	})
	// Generous: a start under -race on a loaded machine (a race-built binary
	// verifying and loading the program) took more than 15 s; an agent that
	// fails exits, which ends the wait at once.
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := p.client.Status(context.Background()); err == nil {
			return p
		}
		select {
		case err := <-p.done:
			p.done <- err
			logMu.Lock()
			defer logMu.Unlock()
			xdptest.Check(t, fmt.Errorf("agent exited at start: %v\n%s", err, p.log.String()))
			t.FailNow()
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not answer on %s within 60s", socket)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// writeConfig writes the example config, adapted to the topology, plus edit.
func writeConfig(t *testing.T, path string, tp *topo.Topology, socket string, edit func(string) string) {
	t.Helper()
	b, err := os.ReadFile("../../examples/weir.yaml")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(b), "- name: eth0", "- name: "+tp.Balancer.Link, 1)
	s = strings.Replace(s, "socket: /run/weir/weir.sock", "socket: "+socket, 1)
	if edit != nil {
		s = edit(s)
	}
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

// spread sends n HTTP requests, each on a new connection, and counts answers.
func spread(t *testing.T, tp *topo.Topology, vip netip.Addr, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for range n {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		name, err := tp.Get(ctx, vip)
		cancel()
		if err != nil {
			got["error: "+err.Error()]++
			continue
		}
		got[name]++
	}
	return got
}

func waitFor(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func backendStatus(t *testing.T, c *admin.Client, service, addr string) api.BackendStatus {
	t.Helper()
	st, err := c.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range st.Services {
		if s.Name != service {
			continue
		}
		for _, b := range s.Backends {
			if b.Address == addr {
				return b
			}
		}
	}
	t.Fatalf("status has no backend %s of %s", addr, service)
	return api.BackendStatus{}
}

func TestAgentXDP(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wag"), Backends: 4})
	bs := serveBackends(t, tp)
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	writeConfig(t, cfgPath, tp, socket, nil)
	p := startAgent(t, tp, cfgPath, socket, false)
	ctx := context.Background()

	st := xdpStatus(t, p.client)
	for _, s := range st.Services {
		for _, b := range s.Backends {
			if b.MAC == "" {
				t.Errorf("service %s backend %s: no MAC: %s", s.Name, b.Address, b.MACError)
			}
		}
	}
	var table strings.Builder
	st.WriteTable(&table)
	if !strings.Contains(table.String(), "service web  tcp/10.77.100.1:80  data plane xdp") {
		t.Errorf("status table: got\n%s\nwant a line for service web on xdp", table.String())
	}
	for _, s := range st.Services {
		want := "syn" // tcp checks by root, who has CAP_NET_RAW: auto is syn
		if s.Name == "web" {
			want = "" // http checks
		}
		if s.HealthMethod != want {
			t.Errorf("service %s: got health method %q; want %q", s.Name, s.HealthMethod, want)
		}
	}

	t.Run("balanced", func(t *testing.T) {
		got := spread(t, tp, tp.VIP4, 60)
		for _, name := range []string{"backend-0", "backend-1", "backend-2"} {
			if got[name] < 5 {
				t.Errorf("%s answered %d of 60; want at least 5 (answers %v)", name, got[name], got)
			}
		}
		if got["backend-3"] != 0 || len(got) != 3 {
			t.Errorf("answers: got %v; want only backend-0..2", got)
		}
		if got6 := spread(t, tp, tp.VIP6, 10); len(got6) == 0 || got6["backend-3"] > 0 {
			t.Errorf("IPv6 answers: got %v; want backends 0..2", got6)
		}
		name, err := tp.AskUDP(ctx, netip.AddrPortFrom(tp.VIP4, 53), 0)
		if err != nil || !strings.HasPrefix(name, "backend-") {
			t.Errorf("udp: got %q, %v; want a backend's name", name, err)
		}
		st, _ := p.client.Status(ctx)
		if st.Services[0].Packets == 0 {
			t.Errorf("service web: XDP counted no packets")
		}
	})

	t.Run("backend killed", func(t *testing.T) {
		bs.kill("backend-0")
		start := time.Now()
		// fall 2 × interval 1s + timeout 500ms, plus a check's jitter and slack.
		waitFor(t, "backend-0 marked down", 5*time.Second, func() bool {
			return !backendStatus(t, p.client, "web", "10.77.0.11:80").Usable
		})
		t.Logf("backend-0 marked down after %v", time.Since(start).Round(time.Millisecond))
		got := spread(t, tp, tp.VIP4, 40)
		if got["backend-0"] != 0 || got["backend-1"] == 0 || got["backend-2"] == 0 || len(got) != 2 {
			t.Errorf("answers with backend-0 down: got %v; want only backend-1 and backend-2", got)
		}
	})

	t.Run("reload invalid keeps serving", func(t *testing.T) {
		good, _ := os.ReadFile(cfgPath)
		os.WriteFile(cfgPath, append(good, []byte("\n  - name: broken\n    vip: nonsense\n")...), 0o644)
		err := p.client.Reload(ctx)
		if err == nil || !strings.Contains(err.Error(), "services[3].vip") {
			t.Fatalf("reload of a broken file: got %v; want an error naming services[3].vip", err)
		}
		os.WriteFile(cfgPath, good, 0o644)
		if got := spread(t, tp, tp.VIP4, 20); got["backend-1"]+got["backend-2"] != 20 {
			t.Errorf("answers after a rejected reload: got %v; want all from backend-1 and backend-2", got)
		}
		st, _ := p.client.Status(ctx)
		if n := len(st.Reloads); n == 0 || st.Reloads[n-1].OK {
			t.Errorf("status reloads: got %+v; want the last one rejected", st.Reloads)
		}
	})

	t.Run("reload adds a backend", func(t *testing.T) {
		// Established flows stay where they are through the reload.
		var held []*keepAlive
		var was []string
		for range 6 {
			k := dialKeepAlive(t, tp, tp.VIP4)
			name, err := k.ask()
			if err != nil {
				t.Fatal(err)
			}
			held, was = append(held, k), append(was, name)
		}
		writeConfig(t, cfgPath, tp, socket, func(s string) string {
			return strings.Replace(s, "      - address: 10.77.0.13:80\n        weight: 1\n",
				"      - address: 10.77.0.13:80\n        weight: 1\n      - address: 10.77.0.14:80\n", 1)
		})
		if err := p.client.Reload(ctx); err != nil {
			t.Fatalf("reload: %v", err)
		}
		for i, k := range held {
			if got, err := k.ask(); err != nil || got != was[i] {
				t.Errorf("established connection %d after the reload: got %q, %v; want %q", i, got, err, was[i])
			}
		}
		got := spread(t, tp, tp.VIP4, 60)
		if got["backend-3"] == 0 || got["backend-0"] != 0 || got["backend-1"]+got["backend-2"]+got["backend-3"] != 60 {
			t.Errorf("answers after adding backend-3: got %v; want backend-1..3, none failed", got)
		}
	})

	t.Run("drain keeps established", func(t *testing.T) {
		ask := dialKeepAlive(t, tp, tp.VIP4).ask
		first, err := ask()
		if err != nil {
			t.Fatal(err)
		}
		addr := map[string]string{"backend-1": "10.77.0.12:80", "backend-2": "10.77.0.13:80", "backend-3": "10.77.0.14:80"}[first]
		if err := p.client.Drain(ctx, "web", addr, true); err != nil {
			t.Fatalf("drain %s: %v", addr, err)
		}
		again, err := ask()
		if err != nil || again != first {
			t.Errorf("established connection after draining %s: got %q, %v; want %q", first, again, err, first)
		}
		if got := spread(t, tp, tp.VIP4, 30); got[first] != 0 || len(got) != 2 {
			t.Errorf("new connections with %s drained: got %v; want none to it, none failed", first, got)
		}
	})

	t.Run("drain every backend", func(t *testing.T) {
		k := dialKeepAlive(t, tp, tp.VIP4)
		conn, ask := k.conn, k.ask
		first, err := ask()
		if err != nil {
			t.Fatal(err)
		}
		client := conn.LocalAddr().(*net.TCPAddr).AddrPort().String()
		addrs := []string{"10.77.0.12:80", "10.77.0.13:80", "10.77.0.14:80"}
		for _, a := range addrs {
			if err := p.client.Drain(ctx, "web", a, true); err != nil {
				t.Fatalf("drain %s: %v", a, err)
			}
		}
		if again, err := ask(); err != nil || again != first {
			t.Errorf("established connection with every backend drained: got %q, %v; want %q", again, err, first)
		}
		ex, err := p.client.Explain(ctx, "web", client)
		if err != nil || ex.New != "" || ex.Tracked == "" || !ex.TrackedUsable {
			t.Errorf("explain with every backend drained: %+v, %v; want no backend for a new flow and the tracked one usable", ex, err)
		}
		tctx, cancel := context.WithTimeout(ctx, time.Second)
		if name, err := tp.Get(tctx, tp.VIP4); err == nil {
			t.Errorf("new connection with every backend drained: answered by %s; want none", name)
		}
		cancel()
		for _, a := range addrs {
			if err := p.client.Drain(ctx, "web", a, false); err != nil {
				t.Fatalf("undrain %s: %v", a, err)
			}
		}
		if got := spread(t, tp, tp.VIP4, 10); got["backend-1"]+got["backend-2"]+got["backend-3"] != 10 {
			t.Errorf("new connections after undraining: got %v; want all answered", got)
		}
	})

	t.Run("metrics", func(t *testing.T) {
		m, err := p.client.Metrics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{
			`weir_backend_usable{backend="10.77.0.11:80",service="web"} 0`,
			`weir_service_data_plane{data_plane="xdp",service="web"} 1`,
			`weir_reloads_total{result="error"} 1`,
			`weir_reloads_total{result="ok"} 1`,
			`weir_xdp_packets_total{reason="tx"}`,
		} {
			if !strings.Contains(m, want) {
				t.Errorf("metrics: no line containing %q", want)
			}
		}
	})

	t.Run("reload removes a backend, which drains", func(t *testing.T) {
		// A connection on backend-3, then a reload without it: the connection keeps
		// its backend, new connections avoid it.
		var on3 *keepAlive
		for range 40 {
			k := dialKeepAlive(t, tp, tp.VIP4)
			if name, err := k.ask(); err == nil && name == "backend-3" {
				on3 = k
				break
			}
			k.conn.Close()
		}
		if on3 == nil {
			t.Fatal("no connection of 40 reached backend-3")
		}
		writeConfig(t, cfgPath, tp, socket, nil)
		if err := p.client.Reload(ctx); err != nil {
			t.Fatalf("reload: %v", err)
		}
		if got, err := on3.ask(); err != nil || got != "backend-3" {
			t.Errorf("connection on the removed backend-3: got %q, %v; want it to keep going while it drains", got, err)
		}
		if got := spread(t, tp, tp.VIP4, 30); got["backend-3"] != 0 || got["backend-1"]+got["backend-2"] != 30 {
			t.Errorf("new connections after removing backend-3: got %v; want only backend-1 and backend-2", got)
		}
	})

	t.Run("reload to maglev_p2c", func(t *testing.T) {
		writeConfig(t, cfgPath, tp, socket, func(s string) string {
			return strings.Replace(s, "algorithm: maglev\n    hash: 5tuple\n", "algorithm: maglev_p2c\n    hash: 5tuple\n", 1)
		})
		if err := p.client.Reload(ctx); err != nil {
			t.Fatalf("reload: %v", err)
		}
		st, err := p.client.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if s := st.Services[0]; s.DataPlane != api.PlaneXDP {
			t.Fatalf("service web with maglev_p2c: data plane %s (%s); want xdp", s.DataPlane, s.Why)
		}
		if got := spread(t, tp, tp.VIP4, 30); got["backend-1"]+got["backend-2"] != 30 {
			t.Errorf("new connections with maglev_p2c: got %v; want all answered by backend-1 and backend-2", got)
		}
		ex, err := p.client.Explain(ctx, "web", "10.77.0.1:40000")
		if err != nil {
			t.Fatal(err)
		}
		if c := ex.P2C; c == nil || (ex.New != c.First && ex.New != c.Second) || c.SecondWins != (ex.New == c.Second && c.First != c.Second) {
			t.Errorf("explain with maglev_p2c: %+v, candidates %+v; want two candidates and new one of them", ex, c)
		}
		writeConfig(t, cfgPath, tp, socket, nil)
		if err := p.client.Reload(ctx); err != nil {
			t.Fatalf("reload back to maglev: %v", err)
		}
		if ex, err := p.client.Explain(ctx, "web", "10.77.0.1:40000"); err != nil || ex.P2C != nil {
			t.Errorf("explain with maglev again: %+v, %v; want no candidates", ex, err)
		}
	})

	t.Run("killed backend comes back", func(t *testing.T) {
		bs.revive(t, "backend-0")
		start := time.Now()
		// rise 2 × interval 1s, plus a check's jitter and slack.
		waitFor(t, "backend-0 marked up", 6*time.Second, func() bool {
			return backendStatus(t, p.client, "web", "10.77.0.11:80").Usable
		})
		t.Logf("backend-0 marked up after %v", time.Since(start).Round(time.Millisecond))
		if got := spread(t, tp, tp.VIP4, 60); got["backend-0"] == 0 {
			t.Errorf("answers with backend-0 back: got %v; want some from backend-0", got)
		}
	})
}

func TestAgentProxyFallback(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wap"), Backends: 3})
	serveBackends(t, tp)
	// With XDP off, the VIP must be the balancer's own for the proxy to accept on it.
	err := tp.Balancer.NS.Do(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: tp.VIP4.AsSlice(), Mask: net.CIDRMask(32, 32)}})
	})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	writeConfig(t, cfgPath, tp, socket, func(s string) string {
		s, _, _ = strings.Cut(s, "  - name: web6") // the proxy serves tcp only: no udp service
		// round_robin, so one client's connections take the backends in turn.
		return strings.Replace(s, "algorithm: maglev\n    hash: 5tuple\n", "algorithm: round_robin\n", 1)
	})
	p := startAgent(t, tp, cfgPath, socket, true)
	st, err := p.client.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s := st.Services[0]; s.DataPlane != api.PlaneProxy {
		t.Fatalf("service web: got data plane %s (%s); want proxy", s.DataPlane, s.Why)
	}
	got := spread(t, tp, tp.VIP4, 30)
	if len(got) != 3 || got["backend-0"]+got["backend-1"]+got["backend-2"] != 30 {
		t.Errorf("answers through the proxy: got %v; want all three backends, none failed", got)
	}
}
