package fleet

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/freezetest"
	"github.com/weir-lb/weir/internal/heavy"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/agent"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// The nodes' agents are this test binary, re-executed with agentEnv set: the real
// agent (agent.Run, what weir run runs) as a process of its own in each node's
// namespace, so it can be stopped, killed and frozen by PID like a deployed one.
const agentEnv = "WEIR_FLEET_TEST_AGENT"

func TestMain(m *testing.M) {
	if cfg := os.Getenv(agentEnv); cfg != "" {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		err := agent.New(agent.Options{ConfigPath: cfg}).Run(ctx)
		stop()
		if err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	code := m.Run()
	os.RemoveAll(binDir)
	os.Exit(code)
}

var (
	binDir   string
	binOnce  sync.Once
	binPath  string
	binError error
)

// weirBinary builds the weir command once per test process, for the tests that
// drive the real CLI. go test puts its own toolchain first on PATH.
func weirBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		if binDir, binError = os.MkdirTemp("", "weir-fleet-bin-"); binError != nil {
			return
		}
		binPath = filepath.Join(binDir, "weir")
		out, err := exec.Command("go", "build", "-o", binPath, "github.com/weir-lb/weir/cmd/weir").CombinedOutput()
		if err != nil {
			binError = fmt.Errorf("go build ./cmd/weir: %v: %s", err, out)
		}
	})
	if binError != nil {
		t.Fatal(binError)
	}
	return binPath
}

var (
	vip4 = netip.PrefixFrom(topo.FleetVIP4, 32)
	vip6 = netip.PrefixFrom(topo.FleetVIP6, 128)
)

// start builds a fleet for t; a missing BIRD fails the test (never skips).
func start(t *testing.T, o Options) *Fleet {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	o.Dir = t.TempDir()
	o.AgentArgv = func(cfg string) []string { return []string{"env", agentEnv + "=" + cfg, exe} }
	f, err := Start(o)
	if err != nil {
		if strings.Contains(err.Error(), "BIRD") {
			t.Fatal(err) // bird2 is in make deps: its absence is a failure
		}
		xdptest.Check(t, err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("close fleet: %v", err)
		}
	})
	return f
}

// startAgents starts every node's agent at once.
func startAgents(t *testing.T, ctx context.Context, f *Fleet) {
	t.Helper()
	errs := make(chan error, len(f.Nodes))
	for i := range f.Nodes {
		go func() { errs <- f.StartAgent(ctx, i) }()
	}
	for range f.Nodes {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// TestAnnounceWithdraw: three nodes announce the VIP and the router installs one
// route with three next hops; a service whose backends all fail health is
// withdrawn within its checks' fall; weir node drain withdraws one node and undrain
// brings it back; a stopped agent withdraws at once, a killed one as soon as its
// kernel closes the session, and a frozen one when the router's hold timer runs
// out, and is taken back soon after it resumes.
func TestAnnounceWithdraw(t *testing.T) {
	heavy.Alone(t)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	// Every session is signed (TCP MD5), as routers commonly require.
	f := start(t, Options{Password: "weir-fleet"})
	interval, fall := 200*time.Millisecond, 2
	if err := f.WriteConfigs(ServiceOptions{Mode: "dsr", VIP: topo.FleetVIP4, Backends: f.T.DSR, Interval: interval, Fall: fall, HashSeed: 7, V6: true}); err != nil {
		t.Fatal(err)
	}
	startAgents(t, ctx, f)
	all := f.NodeIPs(0, 1, 2)
	if _, err := f.WaitNextHops(ctx, vip4, all, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	// The IPv6 VIP goes over the IPv4 sessions with the nodes' IPv6 next hops.
	var all6 []netip.Addr
	for _, n := range f.T.Nodes {
		all6 = append(all6, n.IP6)
	}
	if _, err := f.WaitNextHops(ctx, vip6, all6, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	bird, err := f.BirdNextHops(vip4)
	if err != nil || !slices.Equal(bird, all) {
		t.Errorf("birdc: next hops %v (%v); want %v", bird, err, all)
	}
	route := f.KernelRoute(vip4)
	if strings.Count(route, "nexthop via") != 3 || !strings.Contains(route, "proto bird") {
		t.Errorf("ip route show %s: %q; want one multipath route from bird with 3 next hops", vip4, route)
	}
	comm, _ := f.Birdc("show route " + vip4.String() + " all")
	if !strings.Contains(comm, "(65000,1)") {
		t.Errorf("birdc show route all: want the service's community (65000,1):\n%s", comm)
	}
	st, err := f.Nodes[0].Client.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.BGP == nil || len(st.BGP.Peers) != 1 || st.BGP.Peers[0].State != "established" || st.BGP.Peers[0].Uptime == "" ||
		len(st.BGP.Announced) != 2 || st.BGP.Announced[0].Prefix != vip4.String() || st.BGP.Announced[1].Prefix != vip6.String() {
		t.Errorf("status bgp: got %+v; want one established peer with an uptime, %s and %s announced", st.BGP, vip4, vip6)
	}
	m, err := f.Nodes[0].Client.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`weir_bgp_peer_established{peer="10.80.0.254"} 1`, `weir_bgp_route_announced{prefix="10.80.100.1/32"} 1`, "weir_node_drained 0"} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics: no line %q", want)
		}
	}

	t.Run("one node's checks fail", func(t *testing.T) {
		// Node 0 alone loses its way to the backends (a more specific unreachable
		// route beats the fabric's), so its checks fail while the others' pass: the
		// router keeps the VIP through the other two.
		n0 := f.T.Nodes[0].NS.Name()
		var added [][]string
		for _, b := range f.T.DSR {
			for _, a := range []netip.Addr{b.IP4, b.IP6} {
				args := []string{"-n", n0, "route", "add", "unreachable", netip.PrefixFrom(a, a.BitLen()).String()}
				if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
					t.Fatalf("ip %v: %v: %s", args, err, out)
				}
				added = append(added, args)
			}
		}
		hold := time.Duration(fall+1)*interval*11/10 + interval + time.Second
		took, err := f.WaitNextHops(ctx, vip4, f.NodeIPs(1, 2), hold)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("node 0 withdrawn %s after its checks began to fail (bound %s)", took, hold)
		for _, args := range added {
			args[3] = "del"
			if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
				t.Fatalf("ip %v: %v: %s", args, err, out)
			}
		}
		if _, err := f.WaitNextHops(ctx, vip4, all, 5*time.Second); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("all backends fail health", func(t *testing.T) {
		for _, b := range f.T.DSR {
			f.srv.Kill(b.Name)
		}
		// Down after fall failed checks, each at most interval (+ jitter) apart and
		// timing out after 3/4 interval; then the route's withdrawal reaches the
		// router.
		hold := time.Duration(fall+1)*interval*11/10 + interval + time.Second
		took, err := f.WaitNextHops(ctx, vip4, nil, hold)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("withdrawn %s after the backends died (bound %s)", took, hold)
		if _, err := f.WaitNextHops(ctx, vip6, nil, time.Second); err != nil {
			t.Fatal(err)
		}
		st, _ := f.Nodes[1].Client.Status(ctx)
		if st.BGP == nil || len(st.BGP.Announced) != 0 || len(st.BGP.Withheld) != 2 || !strings.Contains(st.BGP.Withheld[0].Why, "no backend usable and up") {
			t.Errorf("status bgp: got %+v; want nothing announced and both VIPs withheld for want of a usable backend", st.BGP)
		}
		for _, b := range f.T.DSR {
			if err := f.srv.Serve(b.NS, b.Name); err != nil {
				t.Fatal(err)
			}
		}
		if took, err := f.WaitNextHops(ctx, vip4, all, 5*time.Second); err != nil {
			t.Fatal(err)
		} else {
			t.Logf("announced again %s after the backends came back", took)
		}
	})

	t.Run("node drain", func(t *testing.T) {
		// Through the real CLI: weir node drain --wait returns once drain_timeout
		// (2s here) has passed, the routes withdrawn all along.
		weir := weirBinary(t)
		sock := f.Nodes[1].Socket
		start := time.Now()
		drain := exec.CommandContext(ctx, weir, "node", "drain", "--wait", "-s", sock)
		var out strings.Builder
		drain.Stdout, drain.Stderr = &out, &out
		if err := drain.Start(); err != nil {
			t.Fatal(err)
		}
		if _, err := f.WaitNextHops(ctx, vip4, f.NodeIPs(0, 2), 5*time.Second); err != nil {
			t.Fatal(err)
		}
		st, _ := f.Nodes[1].Client.Status(ctx)
		if st.BGP == nil || !st.BGP.Drained || st.BGP.DrainUntil.Sub(st.BGP.DrainedSince) != 2*time.Second {
			t.Errorf("status bgp: got %+v; want drained with 2s (drain_timeout) to serve what still arrives", st.BGP)
		}
		m, _ := f.Nodes[1].Client.Metrics(ctx)
		if !strings.Contains(m, "weir_node_drained 1") {
			t.Error("metrics: want weir_node_drained 1")
		}
		if err := drain.Wait(); err != nil {
			t.Fatalf("weir node drain --wait: %v: %s", err, out.String())
		}
		if took := time.Since(start); took < 2*time.Second || !strings.Contains(out.String(), "drain_timeout has passed") {
			t.Errorf("weir node drain --wait returned after %s with %q; want after drain_timeout (2s), saying so", took, out.String())
		}
		status, err := exec.CommandContext(ctx, weir, "status", "-s", sock).CombinedOutput()
		if err != nil || !strings.Contains(string(status), "node DRAINED since") || !strings.Contains(string(status), "withdrawn 10.80.100.1/32: the node is drained") {
			t.Errorf("weir status: %v:\n%s\nwant the drain and the withdrawn VIP", err, status)
		}
		if out, err := exec.CommandContext(ctx, weir, "node", "undrain", "-s", sock).CombinedOutput(); err != nil {
			t.Fatalf("weir node undrain: %v: %s", err, out)
		}
		if _, err := f.WaitNextHops(ctx, vip4, all, 5*time.Second); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("stopped agent", func(t *testing.T) {
		if err := f.StopAgent(2); err != nil {
			t.Fatal(err)
		}
		took, err := f.WaitNextHops(ctx, vip4, f.NodeIPs(0, 1), time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("withdrawn %s after the agent stopped", took)
	})

	t.Run("killed agent", func(t *testing.T) {
		if err := f.Signal(1, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		f.WaitAgent(1, 5*time.Second)
		// The kernel closes the dead process's session, and BIRD withdraws on the
		// close; the hold time bounds it in any case.
		took, err := f.WaitNextHops(ctx, vip4, f.NodeIPs(0), f.opts.HoldTime+time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("withdrawn %s after SIGKILL", took)
	})

	t.Run("frozen agent: hold timer", func(t *testing.T) {
		if err := f.Signal(0, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		took, err := f.WaitNextHops(ctx, vip4, nil, f.opts.HoldTime+2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("withdrawn %s after the agent froze (hold time %s)", took, f.opts.HoldTime)
		// The hold timer runs from the last keepalive the router got, at most a
		// keepalive interval (1s) before the freeze.
		if took < f.opts.HoldTime/2 {
			t.Errorf("withdrawn after %s, before the hold time (%s) could have run out: something else closed the session", took, f.opts.HoldTime)
		}
		if out := f.BirdLog(); !strings.Contains(out, "Hold timer expired") {
			t.Errorf("bird log: want a hold timer expiry:\n%s", out)
		}
		// Resumed, it is taken back after BIRD's error wait time (5 s in the
		// harness's config, as docs/fleet.md recommends; 60 s by BIRD's default),
		// its speaker's next dial and its health checks.
		if err := f.Signal(0, syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		took, err = f.WaitNextHops(ctx, vip4, f.NodeIPs(0), 20*time.Second)
		if err != nil {
			t.Fatalf("%v\nbird log:\n%s", err, f.BirdLog())
		}
		t.Logf("announced again %s after the agent resumed", took)
	})
}

// run is one service's streams in a node-failure test.
type run struct {
	so     ServiceOptions
	ss     *Streams
	owners []int // node per stream before the failure
}

// startRuns starts 60 streams to each service and waits until all are halfway,
// calling mid first (after they dialled) if it is not nil.
func startRuns(t *testing.T, ctx context.Context, f *Fleet, svcs []ServiceOptions, mid func()) []*run {
	t.Helper()
	var runs []*run
	for _, so := range svcs {
		runs = append(runs, &run{so: so, ss: f.StartStreams(ctx, netip.AddrPortFrom(so.VIP, StreamPort), streamOpts(60))})
	}
	if mid != nil {
		mid()
	}
	for _, r := range runs {
		var err error
		if r.owners, err = f.Owners(ctx, r.so.Name, r.ss.Locals()); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range runs {
		select {
		case <-r.ss.Halfway():
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		}
	}
	return runs
}

// killBusiest kills the node that carries the most streams (its agent SIGKILLed,
// its link deleted) and waits until the router has dropped it from every VIP.
func killBusiest(t *testing.T, ctx context.Context, f *Fleet, runs []*run) int {
	t.Helper()
	total := make([]int, len(f.Nodes))
	for _, r := range runs {
		for i, n := range shareOf(r.owners, len(f.Nodes)) {
			total[i] += n
		}
	}
	victim := 0
	for i, n := range total {
		if n > total[victim] {
			victim = i
		}
	}
	if err := f.Signal(victim, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	f.WaitAgent(victim, 5*time.Second)
	if err := f.T.DeleteNodeLink(victim); err != nil {
		t.Fatal(err)
	}
	var rest []int
	for i := range f.Nodes {
		if i != victim {
			rest = append(rest, i)
		}
	}
	for _, r := range runs {
		took, err := f.WaitNextHops(ctx, netip.PrefixFrom(r.so.VIP, 32), f.NodeIPs(rest...), f.opts.HoldTime+time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: node %d killed with %d of its streams; the router withdrew it in %s", r.so.Name, victim, shareOf(r.owners, len(f.Nodes))[victim], took)
	}
	return victim
}

// announced waits until the router has every service's VIP through every node.
func announced(t *testing.T, ctx context.Context, f *Fleet, svcs []ServiceOptions) {
	t.Helper()
	for _, so := range svcs {
		if _, err := f.WaitNextHops(ctx, netip.PrefixFrom(so.VIP, 32), f.NodeIPs(All(len(f.Nodes))...), 10*time.Second); err != nil {
			t.Fatal(err)
		}
	}
}

// TestNodeFailure: 60 long-lived streams to each of a dsr, a tunnel and a nat
// service, spread by the router's ECMP over three nodes. The node carrying the most
// dies (its agent SIGKILLed and its link deleted); the router moves its flows to
// the others. In dsr and tunnel mode they send them to the same backends (same
// tables, no shared state), and every stream completes with every byte intact. In
// nat mode the backends answer the dead node's own address, so every stream it
// carried is lost.
func TestNodeFailure(t *testing.T) {
	heavy.Alone(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	f := start(t, Options{})
	svcs := []ServiceOptions{
		{Name: "dsr", Mode: "dsr", VIP: topo.FleetVIP4, Backends: f.T.DSR, HashSeed: 7},
		{Name: "tunnel", Mode: "tunnel", VIP: topo.FleetVIP4Tunnel, Backends: f.T.Tunnel},
		{Name: "nat", Mode: "nat", VIP: topo.FleetVIP4NAT, Backends: f.T.DSR},
	}
	if err := f.WriteConfigs(svcs...); err != nil {
		t.Fatal(err)
	}
	startAgents(t, ctx, f)
	announced(t, ctx, f, svcs)
	runs := startRuns(t, ctx, f, svcs, nil)
	for _, r := range runs {
		share := shareOf(r.owners, len(f.Nodes))
		t.Logf("%s: streams per node before the failure: %v", r.so.Name, share)
		for i, n := range share {
			if n == 0 {
				t.Errorf("%s: node %d carries no stream: the router's ECMP did not spread the flows (%v)", r.so.Name, i, share)
			}
		}
	}
	victim := killBusiest(t, ctx, f, runs)
	for _, r := range runs {
		out := r.ss.Wait()
		dead := shareOf(r.owners, len(f.Nodes))[victim]
		if r.so.Mode == "nat" {
			lost := 0
			for k, s := range out {
				if r.owners[k] == victim && s.Err == nil {
					t.Errorf("nat stream %s carried by the dead node survived: its backend answers that node's address", s.Local)
				}
				if s.Err != nil {
					lost++
				}
			}
			t.Logf("nat: %d of %d streams lost (the dead node carried %d; flows the router moved between live nodes are lost too)", lost, len(out), dead)
			continue
		}
		if n, first := Failed(out); n > 0 {
			t.Errorf("%s: %d of %d streams broke; the first: %v", r.so.Name, n, len(out), first)
		}
		after, err := f.Owners(ctx, r.so.Name, r.ss.Locals())
		if err != nil {
			t.Fatal(err)
		}
		moved := 0
		for k := range r.owners {
			if r.owners[k] == victim && after[k] >= 0 && after[k] != victim {
				moved++
			}
		}
		t.Logf("%s: %d of the dead node's %d streams finished on the others (%v)", r.so.Name, moved, dead, shareOf(after, len(f.Nodes)))
		if moved == 0 {
			t.Errorf("%s: none of the dead node's streams was tracked by another node afterwards", r.so.Name)
		}
	}
}

// TestNodeFailureWithBackendChange: streams to a dsr and a tunnel service run, one
// backend is added to each on every node, then the busiest node dies. The flows the
// router moves reach nodes that never saw them, whose lookup tables now differ from
// the ones that placed them: with the previous-table fallback they keep their
// backend, without it those whose slot moved to the new backend are reset by it.
// The shares that survive are logged for both.
func TestNodeFailureWithBackendChange(t *testing.T) {
	heavy.Alone(t)
	for _, fallback := range []bool{true, false} {
		name := "fallback"
		if !fallback {
			name = "no_fallback"
		}
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			f := start(t, Options{DSRBackends: 3, TunnelBackends: 3})
			svcs := []ServiceOptions{
				{Name: "dsr", Mode: "dsr", VIP: topo.FleetVIP4, Backends: f.T.DSR[:2], HashSeed: 7},
				{Name: "tunnel", Mode: "tunnel", VIP: topo.FleetVIP4Tunnel, Backends: f.T.Tunnel[:2]},
			}
			if !fallback {
				svcs[0].ExtraXDP = "previous_table_window: 0s"
			}
			if err := f.WriteConfigs(svcs...); err != nil {
				t.Fatal(err)
			}
			startAgents(t, ctx, f)
			announced(t, ctx, f, svcs)
			runs := startRuns(t, ctx, f, svcs, func() {
				svcs[0].Backends, svcs[1].Backends = f.T.DSR, f.T.Tunnel
				// 15 s for every node's new backends to pass their checks:
				// 5 s was too short beside other tests' load.
				if err := f.Reload(ctx, 15*time.Second, svcs...); err != nil {
					t.Fatal(err)
				}
			})
			victim := killBusiest(t, ctx, f, runs)
			allBroken := 0
			for _, r := range runs {
				out := r.ss.Wait()
				broken, first := Failed(out)
				allBroken += broken
				t.Logf("%s, fallback %t: %d of %d streams survived a backend added and node %d (%d streams) killed",
					r.so.Name, fallback, len(out)-broken, len(out), victim, shareOf(r.owners, len(f.Nodes))[victim])
				if fallback && broken > 0 {
					t.Errorf("%s: with the fallback, %d streams broke; the first: %v", r.so.Name, broken, first)
				}
			}
			// Read once the streams are over: the moved flows' packets reach
			// the other nodes only after the router has moved them.
			var fallbacks uint64
			for i, n := range f.Nodes {
				if i == victim {
					continue
				}
				if st, err := n.Client.Status(ctx); err == nil {
					fallbacks += st.XDPReasons["flow_fallback"]
				}
			}
			// Each moved stream lands in a slot that went to the new backend with
			// odds of about a third; over both services' moved streams, that none
			// does is too rare to happen by chance (below 10^-6).
			if !fallback && allBroken == 0 {
				t.Error("without the fallback every stream survived: the test moved no flow whose slot went to the new backend")
			}
			t.Logf("%d packets took the previous table on the surviving nodes", fallbacks)
			if fallback && fallbacks == 0 {
				t.Error("with the fallback, no packet took the previous table: the test did not move a flow whose slot changed")
			}
		})
	}
}

// TestDemo runs `weir demo fleet` as the CLI does and checks what it reports.
func TestDemo(t *testing.T) {
	heavy.Alone(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := Demo(ctx, DemoOptions{Out: &out, Dir: t.TempDir(), Streams: 30,
		AgentArgv: func(cfg string) []string { return []string{"env", agentEnv + "=" + cfg, exe} }})
	t.Log("\n" + out.String())
	if err != nil {
		xdptest.Check(t, err)
	}
	if len(rep.NextHops) != 3 || len(rep.After) != 2 || slices.Contains(rep.After, rep.NextHops[rep.Killed]) {
		t.Errorf("next hops: %v, then %v after node %d died; want 3, then the other 2", rep.NextHops, rep.After, rep.Killed)
	}
	for i, n := range rep.RouterPackets {
		if n == 0 {
			t.Errorf("the router's counters show no packet to node %d: %v", i, rep.RouterPackets)
		}
	}
	if rep.Streams != 30 || rep.Broken != 0 {
		t.Errorf("streams: %d, %d broken (%v); want 30 intact", rep.Streams, rep.Broken, rep.FirstError)
	}
	for _, want := range []string{"nexthop via 10.80.0.1", "established", "announced 10.80.100.1/32", "streams finished: 30 of 30 intact"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output: no %q", want)
		}
	}
}

// TestAgentExitsOneLine: a node's agent that exits at start (here a shell
// that writes two lines and exits 1) fails StartAgent with one line that names
// the agent's log and quotes its last line, and that wraps the exit status.
func TestAgentExitsOneLine(t *testing.T) {
	ns, err := netns.New(topo.UniqueName("wfe"))
	xdptest.Check(t, err)
	t.Cleanup(func() { ns.Close() })
	dir := t.TempDir()
	n := &Node{Host: topo.Host{NS: ns}, Socket: filepath.Join(dir, "node0.sock"), log: filepath.Join(dir, "node0.log")}
	n.Client = admin.NewClient(n.Socket)
	f := &Fleet{Nodes: []*Node{n}, opts: Options{Dir: dir, AgentArgv: func(string) []string {
		return []string{"sh", "-c", "echo 'weir: load: it broke' >&2; echo 'and a second line' >&2; exit 1"}
	}}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = f.StartAgent(ctx, 0)
	if err == nil || strings.Contains(err.Error(), "\n") || !strings.Contains(err.Error(), n.log) || !strings.Contains(err.Error(), "and a second line") {
		t.Errorf("StartAgent of an agent that exits: got %q; want one line naming %s and quoting its last line", err, n.log)
	}
	if ee := (*exec.ExitError)(nil); !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Errorf("StartAgent of an agent that exits 1: got %q; want it to wrap the *exec.ExitError", err)
	}
}

// TestBirdExitsOneLine: a BIRD that exits at start (here a script that writes
// a line and exits 1) fails the fleet with one line that names BIRD's output
// and quotes its last line, and that wraps the exit status.
func TestBirdExitsOneLine(t *testing.T) {
	ns, err := netns.New(topo.UniqueName("wfe"))
	xdptest.Check(t, err)
	t.Cleanup(func() { ns.Close() })
	dir := t.TempDir()
	bird := filepath.Join(dir, "bird")
	if err := os.WriteFile(bird, []byte("#!/bin/sh\necho 'bird: it broke' >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	f := &Fleet{T: &topo.Fleet{RouterNS: ns}, opts: Options{Dir: dir}, bird: bird, birdc: "false"}
	err = f.startBird()
	out := filepath.Join(dir, "bird.out")
	if err == nil || strings.Contains(err.Error(), "\n") || !strings.Contains(err.Error(), out) || !strings.Contains(err.Error(), "it broke") {
		t.Errorf("startBird of a BIRD that exits: got %q; want one line naming %s and quoting its last line", err, out)
	}
	if ee := (*exec.ExitError)(nil); !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Errorf("startBird of a BIRD that exits 1: got %q; want it to wrap the *exec.ExitError", err)
	}
}

// TestDemoFailsOneLineKeepsLog: weir demo fleet whose node 0 agent ignores
// SIGTERM and never answers, and whose other agents exit at start, fails
// with one line, the exit and the cleanup's own error (node 0 still ran 15 s
// after SIGTERM) separated by "; ", naming a log it keeps in its otherwise
// removed directory.
func TestDemoFailsOneLineKeepsLog(t *testing.T) {
	heavy.Alone(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, err := Demo(ctx, DemoOptions{Streams: 1, AgentArgv: func(cfg string) []string {
		// The others exit once node 0 ignores SIGTERM: the first exit
		// stops the demo.
		ready := filepath.Join(filepath.Dir(cfg), "node0.ready")
		if strings.HasSuffix(cfg, "node0.yaml") {
			return []string{"sh", "-c", "trap '' TERM; touch " + ready + "; exec sleep 1000"}
		}
		return []string{"sh", "-c", "until [ -e " + ready + " ]; do sleep 0.02; done; echo 'weir: it broke' >&2; exit 1"}
	}})
	log := regexp.MustCompile(`/run/weir-demo-fleet-[^/ ]+/node[12]\.log`).FindString(fmt.Sprint(err))
	if log != "" {
		t.Cleanup(func() { os.RemoveAll(filepath.Dir(log)) })
	}
	if err == nil || strings.Contains(err.Error(), "\n") || log == "" || !strings.Contains(err.Error(), "agent exited") || !strings.Contains(err.Error(), "still runs after 15s") {
		t.Fatalf("Demo: got %q; want one line naming node 1's or 2's log, its exit and node 0's stop", err)
	}
	if b, err := os.ReadFile(log); err != nil || !strings.Contains(string(b), "it broke") {
		t.Errorf("the log the error names, %s: %q, %v; want it kept, saying it broke", log, b, err)
	}
	ents, _ := os.ReadDir(filepath.Dir(log))
	for _, e := range ents {
		if path := filepath.Join(filepath.Dir(log), e.Name()); !strings.Contains(err.Error(), path) {
			t.Errorf("%s left; want only the logs the error names", path)
		}
	}
}

// TestStopAgentBoundedAfterKill: an agent that outlives SIGKILL (frozen here,
// as the kernel keeps one in an uninterruptible call) is waited for killWait,
// not for ever: StopAgent returns one line naming its pid and its log, which
// weir demo fleet then keeps.
func TestStopAgentBoundedAfterKill(t *testing.T) {
	shortWaits(t)
	dir := t.TempDir()
	cmd, done, log := startFrozen(t, dir, "node0.log")
	f := &Fleet{Nodes: []*Node{{cmd: cmd, done: done, log: log}}}
	err := returnsWithin(t, "StopAgent", func() error { return f.StopAgent(0) }, termWait+killWait)
	want := fmt.Sprintf("fleet: node 0's agent (pid %d) did not exit within %s of SIGKILL; its log is %s, ending %q", cmd.Process.Pid, killWait, log, "weir: stuck")
	if err == nil || err.Error() != want {
		t.Errorf("StopAgent of an agent that outlives SIGKILL: got %v; want %q", err, want)
	}
}

// TestCloseBoundedAfterBirdKill: BIRD outliving SIGKILL is waited for
// killWait, and Close's error names its pid and its output, which weir demo
// fleet then keeps.
func TestCloseBoundedAfterBirdKill(t *testing.T) {
	shortWaits(t)
	dir := t.TempDir()
	cmd, done, out := startFrozen(t, dir, "bird.out")
	f := &Fleet{opts: Options{Dir: dir}, T: &topo.Fleet{}, srv: NewServers(), birdC: cmd, birdCh: done}
	err := returnsWithin(t, "Close", f.Close, 2*killWait)
	want := fmt.Sprintf("fleet: bird (pid %d) did not exit within %s of SIGKILL; its output is %s, ending %q", cmd.Process.Pid, killWait, out, "weir: stuck")
	if err == nil || err.Error() != want {
		t.Errorf("Close with a BIRD that outlives SIGKILL: got %v; want %q", err, want)
	}
}

// shortWaits makes StopAgent and Close wait a second for SIGTERM and for
// SIGKILL to work.
func shortWaits(t *testing.T) {
	wasTerm, wasKill := termWait, killWait
	termWait, killWait = time.Second, time.Second
	t.Cleanup(func() { termWait, killWait = wasTerm, wasKill })
}

// startFrozen starts a process that outlives SIGKILL: frozen until cleanup,
// which thaws, kills and reaps it. done gets its exit; its log, name in dir,
// ends "weir: stuck".
func startFrozen(t *testing.T, dir, name string) (cmd *exec.Cmd, done chan error, log string) {
	t.Helper()
	log = filepath.Join(dir, name)
	if err := os.WriteFile(log, []byte("weir: started\nweir: stuck\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd = exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done, reaped := make(chan error, 1), make(chan struct{})
	// Exits when sleep does: killed, at the latest at cleanup once thawed.
	go func() {
		done <- cmd.Wait()
		close(reaped)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-reaped
	})
	freezetest.Freeze(t, cmd.Process.Pid)
	return cmd, done, log
}

// returnsWithin is what fn returns, which must be within bound (and 30 s
// for a loaded machine).
func returnsWithin(t *testing.T, what string, fn func() error, bound time.Duration) error {
	t.Helper()
	done := make(chan error, 1)
	// Exits when fn returns; before the bounds, not while a process was frozen.
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-time.After(bound + 30*time.Second):
		t.Fatalf("%s has not returned after %s", what, bound+30*time.Second)
		return nil
	}
}

// TestRouterRestartAndReload: reloads that remove and add a VIP and change a
// VIP's communities, a reset of one BGP session, and the router restarting. The
// routes follow, and come back, with no agent restarted; the VIP a change does not
// concern keeps its three next hops throughout.
func TestRouterRestartAndReload(t *testing.T) {
	heavy.Alone(t)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	f := start(t, Options{})
	dsr := ServiceOptions{Name: "dsr", Mode: "dsr", VIP: topo.FleetVIP4, Backends: f.T.DSR, HashSeed: 7}
	tun := ServiceOptions{Name: "tunnel", Mode: "tunnel", VIP: topo.FleetVIP4Tunnel, Backends: f.T.Tunnel, HashSeed: 7}
	if err := f.WriteConfigs(dsr, tun); err != nil {
		t.Fatal(err)
	}
	startAgents(t, ctx, f)
	announced(t, ctx, f, []ServiceOptions{dsr, tun})
	all := f.NodeIPs(All(len(f.Nodes))...)
	vipTun := netip.PrefixFrom(topo.FleetVIP4Tunnel, 32)
	pids := make([]int, len(f.Nodes))
	for i, n := range f.Nodes {
		pids[i] = n.cmd.Process.Pid
	}

	t.Run("reload", func(t *testing.T) {
		steady := watchNextHops(t, f, vipTun, all)
		tun.Communities = []string{"65000:7", "65000:8"}
		if err := f.Reload(ctx, 15*time.Second, tun); err != nil {
			t.Fatal(err)
		}
		if _, err := f.WaitNextHops(ctx, vip4, nil, 5*time.Second); err != nil {
			t.Fatalf("a reload without the dsr service: %v", err)
		}
		if _, err := f.WaitNextHops(ctx, vipTun, all, time.Second); err != nil {
			t.Fatal(err)
		}
		waitBird(t, f, vipTun, "(65000,7) (65000,8)", 5*time.Second)
		if err := f.Reload(ctx, 15*time.Second, tun, dsr); err != nil {
			t.Fatal(err)
		}
		if _, err := f.WaitNextHops(ctx, vip4, all, 10*time.Second); err != nil {
			t.Fatalf("a reload that adds the dsr service back: %v", err)
		}
		waitBird(t, f, vip4, "(65000,1)", 5*time.Second)
		steady.stop()
	})

	t.Run("session reset", func(t *testing.T) {
		steady := watchNextHops(t, f, vip4, f.NodeIPs(1, 2))
		reset := time.Now()
		if _, err := f.Birdc("restart node0"); err != nil {
			t.Fatal(err)
		}
		// Node 0's speaker dials again (GoBGP waits 5 s after a session fell).
		if !waitfor.Cond(20*time.Second, func() bool {
			st, err := f.Nodes[0].Client.Status(ctx)
			return err == nil && st.BGP != nil && len(st.BGP.Peers) == 1 && st.BGP.Peers[0].State == "established" && st.BGP.Peers[0].Since.After(reset)
		}) {
			t.Fatalf("node 0's session not established again within 20s of birdc restart node0\nbird log:\n%s", f.BirdLog())
		}
		for _, p := range []netip.Prefix{vip4, vipTun} {
			if _, err := f.WaitNextHops(ctx, p, all, 5*time.Second); err != nil {
				t.Fatal(err)
			}
		}
		steady.stop()
	})

	t.Run("router restarts", func(t *testing.T) {
		if err := f.RestartBird(); err != nil {
			t.Fatal(err)
		}
		for _, p := range []netip.Prefix{vip4, vipTun} {
			took, err := f.WaitNextHops(ctx, p, all, 20*time.Second)
			if err != nil {
				t.Fatalf("%v\nbird log:\n%s", err, f.BirdLog())
			}
			t.Logf("%s back through every node %s after BIRD restarted", p, took)
		}
	})

	for i, n := range f.Nodes {
		if n.cmd == nil || n.cmd.Process.Pid != pids[i] {
			t.Errorf("node %d's agent is not the one started: the routes came back by a restart", i)
		}
	}
}

// nextHopWatch polls the router's route to a prefix until stop.
type nextHopWatch struct {
	t    *testing.T
	done chan struct{}
	out  chan string // the first next hops seen that ok refused, or ""
}

// watchNextHops checks, until stop, that the router's route to prefix keeps
// the next hops want (a superset of them is allowed: a node coming back).
func watchNextHops(t *testing.T, f *Fleet, prefix netip.Prefix, want []netip.Addr) *nextHopWatch {
	t.Helper()
	return watchRoute(t, f, prefix, func(got []netip.Addr) bool {
		return !slices.ContainsFunc(want, func(a netip.Addr) bool { return !slices.Contains(got, a) })
	})
}

// watchRoute checks, until stop, that ok accepts every set of next hops the
// router's route to prefix has.
func watchRoute(t *testing.T, f *Fleet, prefix netip.Prefix, ok func([]netip.Addr) bool) *nextHopWatch {
	t.Helper()
	w := &nextHopWatch{t: t, done: make(chan struct{}), out: make(chan string, 1)}
	// Exits at stop (or at cleanup, should the test end first).
	go func() {
		bad := ""
		for {
			got, err := f.KernelNextHops(prefix)
			if bad == "" && (err != nil || !ok(got)) {
				bad = fmt.Sprintf("%v (%v) at %s", got, err, time.Now().Format("15:04:05.000"))
			}
			select {
			case <-w.done:
				w.out <- bad
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() {
		select {
		case <-w.done:
		default:
			close(w.done)
			<-w.out
		}
	})
	return w
}

// stop ends the watch and fails the test if the route was ever refused.
func (w *nextHopWatch) stop() {
	w.t.Helper()
	close(w.done)
	if bad := <-w.out; bad != "" {
		w.t.Errorf("the router's route went where it should not: %s", bad)
	}
}

// waitBird waits until BIRD's routes to prefix, with their attributes, say want.
func waitBird(t *testing.T, f *Fleet, prefix netip.Prefix, want string, within time.Duration) {
	t.Helper()
	var out string
	if !waitfor.Cond(within, func() bool {
		out, _ = f.Birdc("show route " + prefix.String() + " all")
		return strings.Count(out, want) == len(f.Nodes)
	}) {
		t.Errorf("birdc show route %s all: want %q on each of the %d routes:\n%s", prefix, want, len(f.Nodes), out)
	}
}

// TestStartWithBackendsDown: agents that start while every backend is down never
// announce the VIP, though their backends start up (health.initial: up, the
// default) until their checks fail fall times: the routers would send the node
// flows it can only drop. Once a backend answers, the VIP is announced.
func TestStartWithBackendsDown(t *testing.T) {
	heavy.Alone(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	f := start(t, Options{})
	// Three failed checks a second apart: seconds in which a node would announce.
	so := ServiceOptions{Mode: "dsr", VIP: topo.FleetVIP4, Backends: f.T.DSR, HashSeed: 7, Interval: time.Second, Fall: 3}
	if err := f.WriteConfigs(so); err != nil {
		t.Fatal(err)
	}
	for _, b := range f.T.DSR {
		f.srv.Kill(b.Name)
	}
	never := watchRoute(t, f, vip4, func(got []netip.Addr) bool { return len(got) == 0 })
	startAgents(t, ctx, f)
	if !waitfor.Cond(15*time.Second, func() bool {
		for _, n := range f.Nodes {
			st, err := n.Client.Status(ctx)
			if err != nil || len(st.Services) != 1 || slices.ContainsFunc(st.Services[0].Backends, func(b api.BackendStatus) bool { return b.Health != "down" }) || st.BGP == nil || len(st.BGP.Peers) != 1 || st.BGP.Peers[0].State != "established" {
				return false
			}
		}
		return true
	}) {
		t.Fatal("the nodes did not all see their backends down with their sessions established within 15s")
	}
	never.stop()
	for _, b := range f.T.DSR {
		if err := f.srv.Serve(b.NS, b.Name); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.WaitNextHops(ctx, vip4, f.NodeIPs(All(len(f.Nodes))...), 10*time.Second); err != nil {
		t.Fatal(err)
	}
}

// TestWrongASN: node 0's bgp.asn is not the one the router expects. BIRD refuses
// its session and logs why; node 0's status shows the refusal; the other nodes
// carry the VIP.
func TestWrongASN(t *testing.T) {
	heavy.Alone(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	f := start(t, Options{})
	if err := f.WriteConfigs(ServiceOptions{Mode: "dsr", VIP: topo.FleetVIP4, Backends: f.T.DSR, HashSeed: 7}); err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(f.Nodes[0].Config)
	if err != nil {
		t.Fatal(err)
	}
	own := fmt.Sprintf("  asn: %d\n", NodeASN)
	if !strings.Contains(string(cfg), own) {
		t.Fatalf("node 0's config has no %q", own)
	}
	if err := os.WriteFile(f.Nodes[0].Config, []byte(strings.Replace(string(cfg), own, fmt.Sprintf("  asn: %d\n", NodeASN+1), 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	startAgents(t, ctx, f)
	if _, err := f.WaitNextHops(ctx, vip4, f.NodeIPs(1, 2), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	var peer api.PeerStatus
	if !waitfor.Cond(15*time.Second, func() bool {
		st, err := f.Nodes[0].Client.Status(ctx)
		if err != nil || st.BGP == nil || len(st.BGP.Peers) != 1 {
			return false
		}
		peer = st.BGP.Peers[0]
		return peer.LastError != ""
	}) {
		t.Errorf("node 0's peer: got %+v; want the refusal as its last error", peer)
	}
	t.Logf("node 0's peer: %s, last error %q", peer.State, peer.LastError)
	if !waitfor.Cond(5*time.Second, func() bool { return strings.Contains(f.BirdLog(), "Bad peer AS") }) {
		t.Errorf("bird log: want Bad peer AS:\n%s", f.BirdLog())
	}
	for _, l := range strings.Split(f.BirdLog(), "\n") {
		if strings.Contains(l, "Bad peer AS") {
			t.Logf("bird: %s", l)
			break
		}
	}
}
