package agent_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/config"
)

const echoPort = 9000

// serveEcho runs, in each backend namespace, a TCP server on :9000 that first
// writes the backend's name and a newline, then echoes what it reads.
func serveEcho(t *testing.T, tp *topo.Topology) {
	t.Helper()
	var wg sync.WaitGroup
	var lns []net.Listener
	var mu sync.Mutex
	var conns []net.Conn
	for _, h := range tp.Backends {
		ln, err := h.NS.Listen("tcp", fmt.Sprintf(":%d", echoPort))
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		wg.Add(1)
		// Exits when the listener is closed at cleanup.
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
				wg.Add(1)
				// Exits when the client closes its side (or cleanup closes the conn).
				go func() {
					defer wg.Done()
					defer c.Close()
					io.WriteString(c, h.Name+"\n")
					io.Copy(c, c)
				}()
			}
		}()
	}
	t.Cleanup(func() {
		for _, ln := range lns {
			ln.Close()
		}
		// A client's FIN may never arrive (the test removes the balancer's program).
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

// stream keeps one TCP connection busy: it writes a numbered pattern and checks
// that exactly the same bytes come back, until stopped.
type stream struct {
	conn    *net.TCPConn
	backend string
	echoed  atomic.Int64
	done    chan struct{}
	stop    chan struct{}

	// A test checks for a broken stream while the stream may still run (and
	// break on a later step of the test), so the error is guarded.
	mu  sync.Mutex
	err error
}

func (s *stream) fail(err error) {
	s.mu.Lock()
	s.err = err
	s.mu.Unlock()
}

// broken is why the stream stopped, or nil while it runs or if it was stopped.
func (s *stream) broken() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

func startStream(t *testing.T, tp *topo.Topology, vip netip.AddrPort) *stream {
	t.Helper()
	conn, err := tp.DialTCP(context.Background(), vip, 0)
	if err != nil {
		t.Fatalf("dial %s: %v", vip, err)
	}
	conn.SetDeadline(time.Now().Add(3 * time.Second))
	br := bufio.NewReader(conn)
	name, err := br.ReadString('\n')
	if err != nil {
		t.Fatalf("%s: read the backend's name: %v", vip, err)
	}
	conn.SetDeadline(time.Time{})
	s := &stream{conn: conn, backend: strings.TrimSpace(name), done: make(chan struct{}), stop: make(chan struct{})}
	// Exits when stop is closed or the stream breaks.
	go func() {
		defer close(s.done)
		buf := make([]byte, 1024)
		got := make([]byte, 1024)
		for i := 0; ; i++ {
			select {
			case <-s.stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			for j := range buf {
				buf[j] = byte(i + j)
			}
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := conn.Write(buf); err != nil {
				s.fail(fmt.Errorf("write after %d bytes echoed: %w", s.echoed.Load(), err))
				return
			}
			if _, err := io.ReadFull(br, got); err != nil {
				s.fail(fmt.Errorf("read after %d bytes echoed: %w", s.echoed.Load(), err))
				return
			}
			if !bytes.Equal(got, buf) {
				s.fail(fmt.Errorf("echo differs after %d bytes", s.echoed.Load()))
				return
			}
			s.echoed.Add(int64(len(buf)))
		}
	}()
	return s
}

// progress waits until the stream has echoed more than it had, or fails.
func (s *stream) progress(t *testing.T, what string) {
	t.Helper()
	from := s.echoed.Load()
	deadline := time.Now().Add(5 * time.Second)
	for s.echoed.Load() < from+10*1024 {
		select {
		case <-s.done:
			t.Fatalf("%s: stream to %s broke: %v", what, s.backend, s.broken())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: stream to %s stalled at %d bytes", what, s.backend, s.echoed.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// echoOnce opens a new connection, checks the echo, and returns the backend's name.
func echoOnce(tp *topo.Topology, vip netip.AddrPort) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	conn, err := tp.DialTCP(ctx, vip, 0)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(3 * time.Second))
	br := bufio.NewReader(conn)
	name, err := br.ReadString('\n')
	if err != nil {
		return "", err
	}
	if _, err := io.WriteString(conn, "ping"); err != nil {
		return "", err
	}
	got := make([]byte, 4)
	if _, err := io.ReadFull(br, got); err != nil || string(got) != "ping" {
		return "", fmt.Errorf("echo: got %q, %v; want ping", got, err)
	}
	return strings.TrimSpace(name), nil
}

const restartConfig = `interfaces:
  - name: %s
xdp:
  hash_seed: 9
  pin_path: %s
addresses: [10.77.0.2]
admin:
  socket: %s
metrics:
  listen: "off"
services:
  - name: echo-dsr
    vip: 10.77.100.1:9000
    mode: dsr
    health: {type: tcp, interval: 1s}
    backends:
      - address: 10.77.0.11:9000
      - address: 10.77.0.12:9000
      - address: 10.77.0.13:9000
  - name: echo-nat
    vip: 10.77.100.1:9001
    mode: nat
    health: {type: tcp, interval: 1s}
    backends:
      - address: 10.77.0.11:9000
      - address: 10.77.0.12:9000
      - address: 10.77.0.13:9000
`

// TestAgentRestartKeepsFlows: long-lived TCP connections through the XDP path, in
// dsr and nat mode, survive kill -9 of the agent, a restart that fails, and a
// restart byte-exact; new connections work while no agent runs, after the failed
// start and after the new one has adopted the pinned program. weir stop --detach
// then removes the program and its pins.
func TestAgentRestartKeepsFlows(t *testing.T) {
	tp := echoTopology(t, "war", 3)
	// A bpffs of the test's own: `ip netns exec` gives the agent a private /sys, so
	// pins under /sys/fs/bpf would die with each agent process.
	bpffs := xdptest.BPFFS(t)
	pinPath := filepath.Join(bpffs, "weir")

	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	if err := os.WriteFile(cfgPath, []byte(fmt.Sprintf(restartConfig, tp.Balancer.Link, pinPath, socket)), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	first := startAgent(t, tp, cfgPath, socket, false)
	st := xdpStatus(t, first.client)
	if !st.XDP.Pinned || st.XDP.Adopted {
		t.Fatalf("first agent: pinned %t (%s), adopted %t; want pinned, not adopted", st.XDP.Pinned, st.XDP.Reason, st.XDP.Adopted)
	}

	dsrVIP := netip.AddrPortFrom(tp.VIP4, 9000)
	natVIP := netip.AddrPortFrom(tp.VIP4, 9001)
	var streams []*stream
	for _, vip := range []netip.AddrPort{dsrVIP, natVIP} {
		for range 3 {
			s := startStream(t, tp, vip)
			t.Cleanup(func() { close(s.stop); <-s.done; s.conn.Close() })
			streams = append(streams, s)
		}
	}
	for _, s := range streams {
		s.progress(t, "before the kill")
	}
	st, _ = first.client.Status(ctx)
	if n := st.Services[1].ActiveFlows; n < 3 {
		t.Errorf("echo-nat: %d active flows in status; want at least the 3 streams", n)
	}
	local := streams[3].conn.LocalAddr().(*net.TCPAddr).AddrPort()
	before, err := first.client.Explain(ctx, "echo-nat", local.String())
	if err != nil || before.Tracked == "" {
		t.Fatalf("explain the nat stream: %+v, %v; want its tracked backend", before, err)
	}

	// kill -9: nothing of the agent's stop runs.
	first.cmd.Process.Kill()
	werr := <-first.done
	first.done <- werr
	for _, s := range streams {
		s.progress(t, "with the agent killed")
	}
	for _, vip := range []netip.AddrPort{dsrVIP, natVIP} {
		for i := range 5 {
			if _, err := echoOnce(tp, vip); err != nil {
				t.Errorf("new connection %d to %s with the agent killed: %v", i, vip, err)
			}
		}
	}

	// A start that fails leaves the adopted program serving the services it held.
	// The config's one service has as many backends as the program has slots, so
	// it passes validation; but the services the pinned program holds keep theirs
	// until a start succeeds, so the start is refused before its first write (the
	// self-test uses one backend, so only the real change fails).
	var big strings.Builder
	head := fmt.Sprintf(restartConfig, tp.Balancer.Link, pinPath, socket)
	big.WriteString(head[:strings.Index(head, "  - name: echo-dsr")])
	big.WriteString("  - name: big\n    vip: 10.77.100.1:9005\n    mode: nat\n    health: {type: none}\n    backends:\n")
	for i := range config.MaxXDPBackends {
		fmt.Fprintf(&big, "      - address: 10.88.%d.%d:80\n", i/250, 1+i%250)
	}
	if err := os.WriteFile(cfgPath, []byte(big.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	failCtx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(failCtx, "ip", "netns", "exec", tp.Balancer.NS.Name(), exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "WEIR_AGENT_TEST_CONFIG="+cfgPath)
	// The slots the pinned program's services hold are named as such, with the
	// ways through: a reload's advice (remove, then add) cannot help a start.
	bigAt := fmt.Sprintf(`%s:%d: services[0]: the XDP program has `, cfgPath, strings.Count(head[:strings.Index(head, "  - name: echo-dsr")], "\n")+1)
	wantFail := "of the held backend slots are held by services of the pinned program that this file drops"
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), bigAt) || !strings.Contains(string(out), wantFail) {
		t.Fatalf("agent with a service too big for the program: %v, output:\n%s\nwant it to fail at %q, saying %q", err, out, bigAt, wantFail)
	}
	for _, s := range streams {
		s.progress(t, "after a failed start")
	}
	for _, vip := range []netip.AddrPort{dsrVIP, natVIP} {
		if _, err := echoOnce(tp, vip); err != nil {
			t.Errorf("new connection to %s after a failed start: %v", vip, err)
		}
	}
	if err := os.WriteFile(cfgPath, []byte(fmt.Sprintf(restartConfig, tp.Balancer.Link, pinPath, socket)), 0o644); err != nil {
		t.Fatal(err)
	}

	second := startAgent(t, tp, cfgPath, socket, false)
	st, err = second.client.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !st.XDP.Pinned || !st.XDP.Adopted {
		t.Errorf("restarted agent: pinned %t, adopted %t; want both", st.XDP.Pinned, st.XDP.Adopted)
	}
	for _, s := range streams {
		s.progress(t, "after the restart")
	}
	after, err := second.client.Explain(ctx, "echo-nat", local.String())
	if err != nil || after.Tracked != before.Tracked || after.NATPort != before.NATPort {
		t.Errorf("nat stream after the restart: %+v, %v; want still tracked to %s with nat port %d", after, err, before.Tracked, before.NATPort)
	}
	for _, vip := range []netip.AddrPort{dsrVIP, natVIP} {
		seen := map[string]int{}
		for range 30 {
			name, err := echoOnce(tp, vip)
			if err != nil {
				t.Fatalf("new connection to %s after the restart: %v", vip, err)
			}
			seen[name]++
		}
		if len(seen) != 3 {
			t.Errorf("new connections to %s after the restart: %v; want all three backends", vip, seen)
		}
	}
	for _, s := range streams {
		if err := s.broken(); err != nil {
			t.Errorf("stream to %s: %v", s.backend, err)
		}
	}

	// weir stop --detach removes the program and the pins.
	stopAgent(t, second)
	if entries, _ := os.ReadDir(pinPath); len(entries) != 0 {
		t.Errorf("pins left after weir stop --detach: %d entries in %s", len(entries), pinPath)
	}
	if _, err := echoOnce(tp, dsrVIP); err == nil {
		t.Error("new connection to the dsr VIP after weir stop --detach was answered; want the program gone")
	}
}

// TestSecondAgentRefused: a second agent on the interface of a running one exits
// with an error naming the conflict — whether it shares the pin path (the pin lock)
// or not (the interface's XDP hook is taken) — and the first keeps serving.
func TestSecondAgentRefused(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("was"), Backends: 3})
	serveEcho(t, tp)
	bpffs := xdptest.BPFFS(t)
	err := tp.Balancer.NS.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/conf/all/forwarding", []byte("1"), 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	writeCfg := func(name, pinPath string) (string, string) {
		path, socket := filepath.Join(dir, name+".yaml"), filepath.Join(dir, name+".sock")
		if err := os.WriteFile(path, []byte(fmt.Sprintf(restartConfig, tp.Balancer.Link, pinPath, socket)), 0o644); err != nil {
			t.Fatal(err)
		}
		return path, socket
	}
	cfg1, sock1 := writeCfg("first", filepath.Join(bpffs, "weir"))
	first := startAgent(t, tp, cfg1, sock1, false)
	if st, err := first.client.Status(context.Background()); err != nil || !st.XDP.Loaded {
		xdptest.SkipOrFail(t, fmt.Errorf("first agent has no XDP: %+v, %v", st.XDP, err))
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, pinPath, want string
	}{
		{"same pin path", filepath.Join(bpffs, "weir"), "another weir agent runs with this xdp.pin_path"},
		{"own pin path", "/sys/fs/bpf/weir", "interface already has an XDP program: is another weir agent running?"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, sock := writeCfg(strings.ReplaceAll(c.name, " ", "-"), c.pinPath)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, "ip", "netns", "exec", tp.Balancer.NS.Name(), exe, "-test.run=^$")
			cmd.Env = append(os.Environ(), childEnv+"=1", "WEIR_AGENT_TEST_CONFIG="+cfg)
			out, err := cmd.CombinedOutput()
			if err == nil || !strings.Contains(string(out), c.want) {
				t.Errorf("second agent: %v, output:\n%s\nwant exit status non-zero and %q", err, out, c.want)
			}
			if _, err := os.Stat(sock); err == nil {
				t.Errorf("second agent left its admin socket %s", sock)
			}
			if _, err := echoOnce(tp, netip.AddrPortFrom(tp.VIP4, 9001)); err != nil {
				t.Errorf("the first agent's nat service after the second agent failed: %v", err)
			}
			if _, err := first.client.Status(ctx); err != nil {
				t.Errorf("first agent after the second failed: %v", err)
			}
		})
	}
}

const rejectedConfig = `interfaces:
  - name: %s
xdp:
  hash_seed: 5
addresses: [10.77.0.2]
admin:
  socket: %s
metrics:
  listen: "off"
services:
  - name: %s
    vip: 10.77.100.1:%d
    mode: nat
    health: {type: tcp, interval: 1s}
    backends:
      - address: 10.77.0.11:9000
      - address: 10.77.0.12:9000
  - name: z
    vip: 10.77.100.1:9002
    mode: nat
    health: {type: tcp, interval: 1s}
    backends:
      - address: 10.77.0.11:9000%s
`

// TestReloadKeepsXDPFlows: a reload that renames an XDP service, or moves it to
// another VIP, and then fails on a later service (z would keep only a backend
// whose runtime weight is 0) is refused, and the service's established flows and
// new connections go on as before: the rollback gives a renamed entry back to its
// old owner, and the old VIP's entry is left alone until every write that may
// fail has succeeded. A rename alone is planned as the in-place update it is
// (nothing moves, no flow is reset), so --max-move 0 lets it through.
func TestReloadKeepsXDPFlows(t *testing.T) {
	tp := echoTopology(t, "wrr", 2)
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	write := func(name string, port int, zExtra string) {
		t.Helper()
		b := fmt.Sprintf(rejectedConfig, tp.Balancer.Link, socket, name, port, zExtra)
		if err := os.WriteFile(cfgPath, []byte(b), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a", 9001, "\n      - address: 10.77.0.12:9000")
	ctx := context.Background()
	p := startAgent(t, tp, cfgPath, socket, false)
	xdpStatus(t, p.client)
	if err := p.client.Weight(ctx, "z", "10.77.0.11:9000", 0); err != nil {
		t.Fatalf("weight: %v", err)
	}
	vip := netip.AddrPortFrom(tp.VIP4, 9001)
	var streams []*stream
	for range 3 {
		s := startStream(t, tp, vip)
		t.Cleanup(func() { close(s.stop); <-s.done; s.conn.Close() })
		streams = append(streams, s)
	}
	for _, c := range []struct {
		what string
		name string
		port int
	}{
		{"moved to another VIP", "a", 9003},
		{"renamed", "b", 9001},
	} {
		write(c.name, c.port, "")
		if err := p.client.Reload(ctx); err == nil {
			t.Fatalf("a %s and z's last backend at weight 0: reload got no error; want it refused", c.what)
		}
		for _, s := range streams {
			s.progress(t, "after a refused reload of a "+c.what)
		}
		if _, err := echoOnce(tp, vip); err != nil {
			t.Errorf("new connection to a after a refused reload of a %s: %v", c.what, err)
		}
	}

	write("b", 9001, "\n      - address: 10.77.0.12:9000")
	pl, err := p.client.Plan(ctx, nil, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(pl.Services) != 2 {
		t.Errorf("plan of a rename: %d services; want b and z", len(pl.Services))
	}
	if b := servicePlan(t, pl, "b"); b.Change != api.ChangeUpdated || b.RenamedFrom != "a" || b.NewDataPlane != "" || b.Moved != 0 || b.Reset != 0 {
		t.Errorf("plan of a rename: b %s (renamed from %q), new data plane %q, %.0f%% moved, %d flows reset; want updated from a in place, nothing moved or reset",
			b.Change, b.RenamedFrom, b.NewDataPlane, 100*b.Moved, b.Reset)
	}
	if err := p.client.ReloadWithin(ctx, 0); err != nil {
		t.Fatalf("reload --max-move 0 of a rename: %v", err)
	}
	for _, s := range streams {
		s.progress(t, "after the rename")
	}
}
