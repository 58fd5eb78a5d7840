// Package fleet runs a fleet of weir nodes on the namespaced topology of
// topo.Fleet: a real BIRD 2 in the router's namespace peering over eBGP with each
// node's agent (a real `weir run` process in the node's namespace, XDP on its
// fabric link), dsr backends on the fabric, tunnel backends behind the router with
// weir's decapsulation program, and long-lived checksummed TCP streams from the
// client. The fleet tests, `weir demo fleet` and the fleet benchmark use it.
//
// Everything it starts is a process it owns by PID (BIRD, the agents) or a
// program it holds (the decapsulation programs); Close ends them and removes the
// topology.
package fleet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/weir-lb/weir/internal/demo"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// AS numbers of the fleet: the router's, and the one every node shares.
const (
	RouterASN = 65000
	NodeASN   = 65001
	// StreamPort is where the backends serve streams (see Serve).
	StreamPort = 7000
)

// Options of a fleet. Zero values take the defaults.
type Options struct {
	Nodes, DSRBackends, TunnelBackends int // default 3, 2, 2
	ClientAddrs                        int // extra client source addresses, default 64
	// HoldTime is the BGP hold time both sides propose (default 3s, the least BGP
	// allows), so a silent node is withdrawn quickly.
	HoldTime time.Duration
	// Password, if set, signs every session with TCP MD5 (both sides).
	Password string
	// AgentArgv is the command that runs an agent on a config file (weir run -c
	// FILE); Env is added to its environment.
	AgentArgv func(config string) []string
	Env       []string
	// Dir holds the configs, sockets and logs (a test's t.TempDir()).
	Dir string
	// Name names the topology (default topo.UniqueName(topo.FleetPrefix)).
	Name string
}

// Fleet is a running fleet.
type Fleet struct {
	opts   Options
	T      *topo.Fleet
	Nodes  []*Node
	bird   string // the daemon's and its client's paths
	birdc  string
	nft    string
	birdC  *exec.Cmd
	birdCh chan error
	sock   string
	decaps []*loader.Decap
	srv    *Servers
}

// Node is one balancer node: its host and its agent.
type Node struct {
	Index  int
	Host   topo.Host
	Config string // path of its config file
	Socket string
	Client *admin.Client
	cmd    *exec.Cmd
	done   chan error
	log    string
}

// Start builds the topology, starts BIRD and the stream servers and attaches the
// decapsulation program on the tunnel backends. Agents start with StartAgent.
func Start(opts Options) (_ *Fleet, err error) {
	if opts.Nodes == 0 {
		opts.Nodes = 3
	}
	if opts.DSRBackends == 0 {
		opts.DSRBackends = 2
	}
	if opts.TunnelBackends == 0 {
		opts.TunnelBackends = 2
	}
	if opts.ClientAddrs == 0 {
		opts.ClientAddrs = 64
	}
	if opts.HoldTime == 0 {
		opts.HoldTime = 3 * time.Second
	}
	bird, err := sbin("bird")
	if err != nil {
		return nil, fmt.Errorf("fleet: the router runs BIRD 2: %w (apt-get install bird2, or make deps)", err)
	}
	birdc, err := sbin("birdc")
	if err != nil {
		return nil, fmt.Errorf("fleet: the router runs BIRD 2: %w (apt-get install bird2, or make deps)", err)
	}
	nft, err := sbin("nft")
	if err != nil {
		return nil, fmt.Errorf("fleet: the router counts packets per next hop with nftables: %w (apt-get install nftables, or make deps)", err)
	}
	t, err := topo.NewFleet(topo.FleetConfig{Name: opts.Name, Nodes: opts.Nodes, DSRBackends: opts.DSRBackends,
		TunnelBackends: opts.TunnelBackends, ClientAddrs: opts.ClientAddrs})
	if err != nil {
		return nil, err
	}
	f := &Fleet{opts: opts, T: t, srv: NewServers(), bird: bird, birdc: birdc, nft: nft}
	defer func() {
		if err != nil {
			err = demo.OneLine(errors.Join(err, f.Close()))
		}
	}()
	for i, h := range t.Nodes {
		n := &Node{Index: i, Host: h, Config: filepath.Join(opts.Dir, fmt.Sprintf("node%d.yaml", i)),
			Socket: filepath.Join(opts.Dir, fmt.Sprintf("node%d.sock", i)), log: filepath.Join(opts.Dir, fmt.Sprintf("node%d.log", i))}
		n.Client = admin.NewClient(n.Socket)
		f.Nodes = append(f.Nodes, n)
	}
	for _, b := range append(slices.Clone(t.DSR), t.Tunnel...) {
		if err := f.srv.Serve(b.NS, b.Name); err != nil {
			return nil, err
		}
	}
	for _, b := range t.Tunnel {
		d, err := loader.LoadDecap([]netip.Addr{b.IP4, b.IP6})
		if err != nil {
			return nil, fmt.Errorf("fleet: decap on %s: %w", b.Name, err)
		}
		f.decaps = append(f.decaps, d)
		if err := b.NS.Do(func() error { _, err := d.Attach(b.Link, loader.ModeAuto); return err }); err != nil {
			return nil, fmt.Errorf("fleet: decap on %s: %w", b.Name, err)
		}
	}
	if err := f.startBird(); err != nil {
		return nil, err
	}
	return f, nil
}

// sbin finds a daemon's binary on PATH or in /usr/sbin, where Debian puts BIRD
// (and which a non-login root PATH may lack).
func sbin(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	return exec.LookPath("/usr/sbin/" + name)
}

// birdConf is the router's BIRD config: an eBGP session to every node (the nodes
// dial; the router is passive), and the kernel protocol merging equal BGP paths
// into one multipath route per VIP. error wait time is what docs/fleet.md
// recommends: BIRD's default (60 s, then up to 300 s) keeps a node whose session
// BIRD ended (a hold timer expiry) out for a minute after it answers again.
func (f *Fleet) birdConf() string {
	var b strings.Builder
	hold := int(f.opts.HoldTime / time.Second)
	password := ""
	if f.opts.Password != "" {
		password = fmt.Sprintf("  password %q;\n", f.opts.Password)
	}
	fmt.Fprintf(&b, `# Written by weir's fleet harness.
router id %s;
log "%s" all;
protocol device { scan time 1; }
protocol kernel kernel4 { ipv4 { import none; export all; }; merge paths on; }
protocol kernel kernel6 { ipv6 { import none; export all; }; merge paths on; }
template bgp node {
  local %s as %d;
  passive on;
  hold time %d;
  keepalive time %d;
  connect retry time 1;
  error wait time 5, 60;
%s  ipv4 { import all; export none; };
  ipv6 { import all; export none; };
}
`, f.T.Router.IP4, filepath.Join(f.opts.Dir, "bird.log"), f.T.Router.IP4, RouterASN, hold, max(1, hold/3), password)
	for i, n := range f.T.Nodes {
		fmt.Fprintf(&b, "protocol bgp node%d from node { neighbor %s as %d; }\n", i, n.IP4, NodeASN)
	}
	return b.String()
}

func (f *Fleet) startBird() error {
	conf := filepath.Join(f.opts.Dir, "bird.conf")
	if err := os.WriteFile(conf, []byte(f.birdConf()), 0o644); err != nil {
		return fmt.Errorf("fleet: %w", err)
	}
	f.sock = filepath.Join(f.opts.Dir, "bird.ctl")
	out, err := os.Create(f.birdOut())
	if err != nil {
		return fmt.Errorf("fleet: %w", err)
	}
	defer out.Close()
	cmd := exec.Command("ip", "netns", "exec", f.T.RouterNS.Name(), f.bird, "-f", "-c", conf, "-s", f.sock)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("fleet: start bird: %w", err)
	}
	f.birdC, f.birdCh = cmd, make(chan error, 1)
	// Exits when BIRD does.
	go func() { f.birdCh <- cmd.Wait() }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := f.Birdc("show status"); err == nil {
			return nil
		}
		select {
		case err := <-f.birdCh:
			f.birdCh <- err
			return fmt.Errorf("fleet: bird exited: %w; %s", err, logLine("its output", f.birdOut()))
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("fleet: bird did not answer on its control socket within 10s; %s", logLine("its output", f.birdOut()))
		}
	}
}

// RestartBird stops BIRD as its service manager would (SIGTERM: it ends its
// sessions with a Cease) and starts it again on the same config.
func (f *Fleet) RestartBird() error {
	if err := f.stopBird(); err != nil {
		return err
	}
	return f.startBird()
}

// stopBird ends BIRD with SIGTERM, or SIGKILL if it lingers.
func (f *Fleet) stopBird() error {
	if f.birdC == nil {
		return nil
	}
	defer func() { f.birdC = nil }()
	f.birdC.Process.Signal(syscall.SIGTERM)
	if exited(f.birdCh) {
		return nil
	}
	f.birdC.Process.Kill()
	if exited(f.birdCh) {
		return nil
	}
	return fmt.Errorf("fleet: bird (pid %d) did not exit within %s of SIGKILL; %s", f.birdC.Process.Pid, killWait, logLine("its output", f.birdOut()))
}

// Birdc runs one birdc command on the router's control socket.
func (f *Fleet) Birdc(command string) (string, error) {
	out, err := exec.Command(f.birdc, append([]string{"-s", f.sock}, strings.Fields(command)...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("birdc %s: %w: %s", command, err, out)
	}
	return string(out), nil
}

var viaRE = regexp.MustCompile(`via (\S+)`)

// BirdNextHops is the next hops BIRD has learnt over BGP for prefix
// (`birdc show route for PREFIX`), sorted.
func (f *Fleet) BirdNextHops(prefix netip.Prefix) ([]netip.Addr, error) {
	out, err := f.Birdc("show route " + prefix.String())
	if err != nil {
		return nil, err
	}
	return parseVia(out), nil
}

// KernelNextHops is the router kernel's next hops for prefix (`ip route show`),
// sorted: one for a plain route, each nexthop of a multipath one.
func (f *Fleet) KernelNextHops(prefix netip.Prefix) ([]netip.Addr, error) {
	fam := "-4"
	if prefix.Addr().Is6() {
		fam = "-6"
	}
	out, err := exec.Command("ip", "-n", f.T.RouterNS.Name(), fam, "route", "show", prefix.String()).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("ip route show %s: %w: %s", prefix, err, out)
	}
	return parseVia(string(out)), nil
}

// KernelRoute is `ip route show PREFIX` in the router, as printed.
func (f *Fleet) KernelRoute(prefix netip.Prefix) string {
	out, _ := exec.Command("ip", "-n", f.T.RouterNS.Name(), "route", "show", prefix.String()).CombinedOutput()
	return strings.TrimSpace(string(out))
}

func parseVia(out string) []netip.Addr {
	var hops []netip.Addr
	for _, m := range viaRE.FindAllStringSubmatch(out, -1) {
		if a, err := netip.ParseAddr(m[1]); err == nil && !slices.Contains(hops, a) {
			hops = append(hops, a)
		}
	}
	slices.SortFunc(hops, netip.Addr.Compare)
	return hops
}

// WaitNextHops polls the router's kernel until prefix has exactly want (sorted)
// as next hops, and returns how long that took.
func (f *Fleet) WaitNextHops(ctx context.Context, prefix netip.Prefix, want []netip.Addr, within time.Duration) (time.Duration, error) {
	start := time.Now()
	deadline := start.Add(within)
	want = slices.Clone(want)
	slices.SortFunc(want, netip.Addr.Compare)
	for {
		got, err := f.KernelNextHops(prefix)
		if err == nil && slices.Equal(got, want) {
			return time.Since(start), nil
		}
		if time.Now().After(deadline) {
			bird, _ := f.Birdc("show route " + prefix.String() + " all")
			return time.Since(start), fmt.Errorf("router: %s next hops %v, want %v (after %s; err %v)\nip route: %s\nbirdc:\n%s",
				prefix, got, want, within, err, f.KernelRoute(prefix), bird)
		}
		select {
		case <-ctx.Done():
			return time.Since(start), ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// NodeIPs are the nodes' fabric addresses, the next hops the router learns.
func (f *Fleet) NodeIPs(nodes ...int) []netip.Addr {
	var out []netip.Addr
	for _, i := range nodes {
		out = append(out, f.T.Nodes[i].IP4)
	}
	return out
}

// All is 0..n-1.
func All(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// ServiceOptions are what one service of a fleet config says. The node-wide
// settings (HashSeed, ExtraXDP) are the first service's.
type ServiceOptions struct {
	Name     string // default "stream"
	Mode     string // dsr, tunnel or nat
	VIP      netip.Addr
	Backends []topo.Host // the backends of the service
	// Interval and Fall of the health checks (default 200ms and 2).
	Interval time.Duration
	Fall     int
	HashSeed uint32
	// Extra is more YAML for the xdp section, e.g. "previous_table_window: 30s".
	ExtraXDP string
	// Communities are the service's bgp.communities (default RouterASN:1).
	Communities []string
	// V6 adds the service <Name>6 on FleetVIP6 with the backends' IPv6 addresses,
	// announced over the IPv4 sessions with the node's IPv6 address as next hop.
	V6 bool
}

// WriteConfigs writes every node's config with the services svcs.
func (f *Fleet) WriteConfigs(svcs ...ServiceOptions) error {
	for _, n := range f.Nodes {
		if err := os.WriteFile(n.Config, []byte(f.config(n, svcs)), 0o644); err != nil {
			return fmt.Errorf("fleet: %w", err)
		}
	}
	return nil
}

func (f *Fleet) config(n *Node, svcs []ServiceOptions) string {
	var b strings.Builder
	first := svcs[0]
	extra := ""
	if first.ExtraXDP != "" {
		extra = ", " + first.ExtraXDP
	}
	hold := f.opts.HoldTime
	pw := ""
	if f.opts.Password != "" {
		pw = fmt.Sprintf(", password: %q", f.opts.Password)
	}
	nextHop := ""
	if slices.ContainsFunc(svcs, func(so ServiceOptions) bool { return so.V6 }) {
		nextHop = fmt.Sprintf("  next_hop: [%q]\n", n.Host.IP6.String())
	}
	fmt.Fprintf(&b, `# Written by weir's fleet harness for node %d.
interfaces: [{name: %s, attach: native}]
addresses: [%s, %s]
xdp: {hash_seed: %d, pin_path: /sys/fs/bpf/weir-%s-n%d, detach_on_stop: true%s}
admin: {socket: %s}
metrics: {listen: "off"}
bgp:
  asn: %d
  router_id: %s
  drain_timeout: 2s
%s  peers:
  - {address: %s, asn: %d, hold_time: %s, keepalive: %s%s}
services:
`, n.Index, n.Host.Link, n.Host.IP4, n.Host.IP6, first.HashSeed, f.T.Name, n.Index, extra, n.Socket,
		NodeASN, n.Host.IP4, nextHop, f.T.Router.IP4, RouterASN, hold, max(time.Second, (hold/3).Truncate(time.Second)), pw)
	service := func(so ServiceOptions, name string, vip netip.Addr, v6 bool) {
		fmt.Fprintf(&b, "- name: %s\n  vip: %q\n  mode: %s\n  health: {type: tcp, interval: %s, timeout: %s, fall: %d, rise: 1}\n  bgp: {communities: [%s]}\n  backends:\n",
			name, netip.AddrPortFrom(vip, StreamPort).String(), so.Mode, so.Interval, so.Interval*3/4, so.Fall, quoted(so.Communities))
		for _, be := range so.Backends {
			ip := be.IP4
			if v6 {
				ip = be.IP6
			}
			fmt.Fprintf(&b, "  - {address: %q}\n", netip.AddrPortFrom(ip, StreamPort).String())
		}
	}
	for _, so := range svcs {
		if so.Name == "" {
			so.Name = "stream"
		}
		if so.Interval == 0 {
			so.Interval = 200 * time.Millisecond
		}
		if so.Fall == 0 {
			so.Fall = 2
		}
		if len(so.Communities) == 0 {
			so.Communities = []string{fmt.Sprintf("%d:1", RouterASN)}
		}
		service(so, so.Name, so.VIP, false)
		if so.V6 {
			service(so, so.Name+"6", topo.FleetVIP6, true)
		}
	}
	return b.String()
}

// quoted is ss as the items of a YAML flow sequence, each quoted.
func quoted(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = strconv.Quote(s)
	}
	return strings.Join(q, ", ")
}

// StartAgent starts node i's agent on its config and waits until it answers and
// has checked every backend once.
func (f *Fleet) StartAgent(ctx context.Context, i int) error {
	n := f.Nodes[i]
	logf, err := os.OpenFile(n.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("fleet: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command("ip", append([]string{"netns", "exec", n.Host.NS.Name()}, f.opts.AgentArgv(n.Config)...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), f.opts.Env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("fleet: start node %d's agent: %w", i, err)
	}
	n.cmd, n.done = cmd, make(chan error, 1)
	// Exits when the agent process does.
	go func() { n.done <- cmd.Wait() }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, err := n.Client.Status(ctx)
		if err == nil && st.AllChecked() {
			return nil
		}
		select {
		case aerr := <-n.done:
			n.done <- aerr
			n.cmd = nil
			return fmt.Errorf("fleet: node %d's agent exited: %w; %s", i, aerr, logLine("its log", n.log))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("fleet: node %d's agent did not answer within 30s (%v); %s", i, err, logLine("its log", n.log))
		}
	}
}

// logLine names a child process's log at path, what, and quotes its last
// line: one line, for an error. weir demo fleet keeps the logs its error
// names when it removes its directory.
func logLine(what, path string) string {
	lines := strings.Split(strings.TrimSpace(tail(path, 40)), "\n")
	return fmt.Sprintf("%s is %s, ending %q", what, path, lines[len(lines)-1])
}

// Signal sends sig to node i's agent (by its PID).
func (f *Fleet) Signal(i int, sig syscall.Signal) error {
	n := f.Nodes[i]
	if n.cmd == nil {
		return fmt.Errorf("fleet: node %d runs no agent", i)
	}
	return n.cmd.Process.Signal(sig)
}

// WaitAgent waits for node i's agent to exit and returns its exit error.
func (f *Fleet) WaitAgent(i int, within time.Duration) error {
	n := f.Nodes[i]
	if n.cmd == nil {
		return nil
	}
	select {
	case err := <-n.done:
		n.cmd = nil
		return err
	case <-time.After(within):
		return fmt.Errorf("fleet: node %d's agent still runs after %s", i, within)
	}
}

// How long StopAgent waits for an agent to exit after SIGTERM, and after
// SIGKILL; Close waits for BIRD after SIGTERM as after SIGKILL.
var (
	termWait = 15 * time.Second
	killWait = 5 * time.Second
)

// StopAgent ends node i's agent with SIGTERM (SIGCONT first, should it be
// stopped), or SIGKILL if it lingers. An agent the kernel keeps after SIGKILL
// (frozen, or in an uninterruptible call) is waited for killWait, then left
// with an error naming its pid and its log.
func (f *Fleet) StopAgent(i int) error {
	n := f.Nodes[i]
	if n.cmd == nil {
		return nil
	}
	n.cmd.Process.Signal(syscall.SIGCONT)
	n.cmd.Process.Signal(syscall.SIGTERM)
	if err := f.WaitAgent(i, termWait); err != nil {
		if n.cmd != nil {
			pid := n.cmd.Process.Pid
			n.cmd.Process.Kill()
			n.cmd = nil
			if !exited(n.done) {
				return fmt.Errorf("fleet: node %d's agent (pid %d) did not exit within %s of SIGKILL; %s", i, pid, killWait, logLine("its log", n.log))
			}
		}
		return err
	}
	return nil
}

// exited waits up to killWait for what done says, a process's exit, and
// reports whether it came.
func exited(done <-chan error) bool {
	select {
	case <-done:
		return true
	case <-time.After(killWait):
		return false
	}
}

// Close stops the agents, BIRD and the servers, detaches the decapsulation
// programs and removes the topology.
func (f *Fleet) Close() error {
	var errs []error
	for i := range f.Nodes {
		if err := f.StopAgent(i); err != nil && !isSignalExit(err) {
			errs = append(errs, err)
		}
	}
	if err := f.stopBird(); err != nil {
		errs = append(errs, err)
	}
	f.srv.Close()
	for _, d := range f.decaps {
		errs = append(errs, d.Close())
	}
	f.decaps = nil
	errs = append(errs, f.T.Close())
	return errors.Join(errs...)
}

func isSignalExit(err error) bool {
	var ee *exec.ExitError
	return errors.As(err, &ee)
}

// tail returns the last lines of a file, for error messages.
func tail(path string, n int) string {
	fh, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer fh.Close()
	var lines []string
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}

// birdOut is the file BIRD's stdout and stderr go to.
func (f *Fleet) birdOut() string { return filepath.Join(f.opts.Dir, "bird.out") }

// BirdLog is the tail of BIRD's log.
func (f *Fleet) BirdLog() string { return tail(filepath.Join(f.opts.Dir, "bird.log"), 30) }

// Reload writes every node's config for svcs and reloads every running agent,
// then waits until each has every backend of svcs checked and usable.
func (f *Fleet) Reload(ctx context.Context, within time.Duration, svcs ...ServiceOptions) error {
	if err := f.WriteConfigs(svcs...); err != nil {
		return err
	}
	backends := 0
	for _, so := range svcs {
		backends += len(so.Backends)
		if so.V6 {
			backends += len(so.Backends) // WriteConfigs writes its IPv6 twin with every backend too
		}
	}
	deadline := time.Now().Add(within)
	for i, n := range f.Nodes {
		if n.cmd == nil {
			continue
		}
		if err := n.Client.Reload(ctx); err != nil {
			return fmt.Errorf("fleet: node %d: reload: %w", i, err)
		}
		for {
			st, err := n.Client.Status(ctx)
			if err == nil && st.AllChecked() && usableCount(st) == backends {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("fleet: node %d: not every backend usable within %s (%v)", i, within, err)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	return nil
}

func usableCount(st api.Status) int {
	n := 0
	for _, s := range st.Services {
		for _, b := range s.Backends {
			if b.Usable {
				n++
			}
		}
	}
	return n
}

// Servers are the backends' stream servers (kill one to fail its health checks).
func (f *Fleet) Servers() *Servers { return f.srv }

// WaitAnnounced polls the node's status until it announces n routes, and returns
// how long that took.
func (n *Node) WaitAnnounced(ctx context.Context, routes int, within time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		st, err := n.Client.Status(ctx)
		if err == nil && st.BGP != nil && len(st.BGP.Announced) == routes {
			return time.Since(start), nil
		}
		if time.Since(start) > within {
			return time.Since(start), fmt.Errorf("fleet: node %d: not %d routes announced within %s (%v)", n.Index, routes, within, err)
		}
		select {
		case <-ctx.Done():
			return time.Since(start), ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// CountNextHops adds an nftables counter in the router for each node: the packets
// to vip that the router's ECMP sent to that node's next hop (rt ip nexthop).
func (f *Fleet) CountNextHops(vip netip.Addr) error {
	var b strings.Builder
	b.WriteString("table ip wfleet {\n  chain forward {\n    type filter hook forward priority 0; policy accept;\n")
	for _, n := range f.T.Nodes {
		fmt.Fprintf(&b, "    ip daddr %s rt ip nexthop %s counter\n", vip, n.IP4)
	}
	b.WriteString("  }\n}\n")
	cmd := exec.Command("ip", "netns", "exec", f.T.RouterNS.Name(), f.nft, "-f", "-")
	cmd.Stdin = strings.NewReader(b.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("fleet: router counters: nft: %w: %s", err, out)
	}
	return nil
}

var counterRE = regexp.MustCompile(`nexthop (\S+) counter packets (\d+)`)

// NextHopPackets reads the counters CountNextHops made, by node.
func (f *Fleet) NextHopPackets() ([]uint64, error) {
	out, err := exec.Command("ip", "netns", "exec", f.T.RouterNS.Name(), f.nft, "list", "chain", "ip", "wfleet", "forward").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("fleet: router counters: nft: %w: %s", err, out)
	}
	counts := make([]uint64, len(f.T.Nodes))
	for _, m := range counterRE.FindAllStringSubmatch(string(out), -1) {
		for i, n := range f.T.Nodes {
			if m[1] == n.IP4.String() {
				counts[i], _ = strconv.ParseUint(m[2], 10, 64)
			}
		}
	}
	return counts, nil
}
