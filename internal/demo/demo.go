// Package demo is weir's built-in demonstration of the agent an operator runs: a
// client, a balancer and backends in network namespaces, the real agent (`weir run`,
// as a process in the balancer's namespace) with a config written for them, and real
// traffic. It shows XDP attached and each service's data plane with the reason,
// requests per backend beside the agent's own counters, a backend whose server dies
// and comes back (timed against the health checks), a drain that keeps an
// established connection, reloads (one adding a backend, one with a broken file),
// and a service on the proxy data plane. `weir demo` prints it; the package's test
// runs it and checks every step. With Keep the topology and the agent stay for the
// operator to try things; Down removes them.
package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// Options of a demo run. Zero values take the defaults.
type Options struct {
	Backends int    // backends the config starts with, default 3 (one more is added by a reload)
	Requests int    // new TCP connections per round, default 300
	Attach   string // XDP attach mode: auto (default), native or generic
	Keep     bool   // leave the topology and the agent running (see Down)
	Out      io.Writer
	// AgentArgv is the command that runs the agent on a config file (weir run -c
	// FILE); Env is added to its environment. Keep also runs HoldArgv (weir demo
	// hold STATE PREFIX, PREFIX NamePrefix), which serves the backends after
	// Run returns.
	AgentArgv func(config string) []string
	HoldArgv  func(state, prefix string) []string
	Env       []string
	// Dir holds the config, the admin socket, logs and the state Down reads.
	// Default /run/weir-demo.
	Dir string
	// DieWithParent has the agent and a kept demo's hold process get SIGTERM
	// when this process dies (Pdeathsig), so a test binary killed midway
	// leaves neither running. Tests only: weir demo --keep leaves them
	// running after it exits.
	DieWithParent bool
	// NamePrefix prefixes the namespaces' names, up to 3 characters; default
	// NamePrefix. A run removes the namespaces of its prefix whose demo has
	// died, a kept demo's too: runs with other directories at the same time
	// (tests) take other prefixes.
	NamePrefix string
}

// Round is one batch of requests and what happened to it.
type Round struct {
	Title    string
	Sent     int
	Answers  map[string]int    // backend name -> requests it answered
	Failures []error           // requests that got no answer
	Counted  map[string]uint64 // backend name -> what the agent counted (XDP packets; proxy connects)
}

// Step is one thing the demo showed, and whether it held.
type Step struct {
	Name   string
	OK     bool
	Detail string
}

// Report is what a run saw.
type Report struct {
	Attach   string   // the attach mode the agent got
	Backends []string // names, in address order
	Rounds   []Round
	Steps    []Step
	Status   api.Status // the agent's status at the end
}

// Step names, in order.
const (
	StepRunning      = "agent running"
	StepKill         = "backend killed"
	StepRevive       = "backend revived"
	StepDrain        = "drain keeps the established connection"
	StepReloadAdd    = "reload adds a backend"
	StepReloadBroken = "broken reload refused"
	StepProxy        = "proxy data plane"
)

// NamePrefix prefixes the demo's namespaces by default; a crashed run's are
// removed at start.
const NamePrefix = "wdm"

// The demo's addresses beyond topo's: a full-nat VIP no backend holds, and the port
// of the proxy service on the balancer's own address.
var NATVIP = netip.MustParseAddr("10.77.100.2")

const (
	httpPort  = topo.HTTPPort
	udpPort   = topo.UDPPort
	proxyPort = 8080
	// Health checks every interval, down after fall failures: a dead backend is
	// out within interval × fall plus a check's timeout.
	checkInterval = 200 * time.Millisecond
	checkTimeout  = 150 * time.Millisecond
	checkFall     = 2
	checkRise     = 2
)

// DefaultDir is where a demo keeps its files.
const DefaultDir = "/run/weir-demo"

type run struct {
	opts     Options
	out      io.Writer
	t        *topo.Topology
	srv      *servers
	backends []backend // all of them, the last added by a reload
	byIP     map[netip.Addr]string
	client   *admin.Client
	cfgPath  string
	agent    *exec.Cmd
	agentErr <-chan error
	lock     *os.File // the directory's, see lock
	logs     []string // the logs in the directory an error names: kept
	rep      Report
}

// Run builds the topology, starts the agent, shows each step and, unless Keep,
// removes everything, whatever happens. When ctx ends midway it stops there,
// removes everything and returns context.Cause(ctx) itself, joined with what it
// could not remove, if anything.
func Run(ctx context.Context, opts Options) (_ Report, err error) {
	defer func() { err = OneLine(err) }()
	if opts.Backends == 0 {
		opts.Backends = 3
	}
	if opts.Requests == 0 {
		opts.Requests = 300
	}
	if opts.Attach == "" {
		opts.Attach = "auto"
	}
	if opts.Dir == "" {
		opts.Dir = DefaultDir
	}
	if opts.NamePrefix == "" {
		opts.NamePrefix = NamePrefix
	}
	r := &run{opts: opts, out: opts.Out, srv: newServers(), byIP: map[netip.Addr]string{}}
	if r.out == nil {
		r.out = io.Discard
	}
	lk, err := lock(opts.Dir)
	if err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	r.lock = lk
	defer func() {
		// A kept demo's hold process holds the lock on.
		lk.Close()
	}()
	// With the lock, what the directory's state names is a dead demo's.
	if err := removeLeftovers(opts.Dir, opts.NamePrefix); err != nil {
		return Report{}, fmt.Errorf("demo: remove what a killed run left: %w", err)
	}
	if err := topo.CleanupStale(opts.NamePrefix); err != nil {
		return Report{}, fmt.Errorf("demo: remove a crashed run's namespaces: %w", err)
	}
	t, err := topo.New(topo.Config{Name: topo.UniqueName(opts.NamePrefix), Backends: opts.Backends + 1})
	if err != nil {
		return Report{}, fmt.Errorf("demo: build topology: %w", err)
	}
	r.t = t
	kept := false
	defer func() {
		if kept {
			return
		}
		if ctx.Err() != nil {
			// What failed once ctx ended failed because it ended.
			err = context.Cause(ctx)
			r.logs = nil
		}
		r.srv.close()
		if cerr := errors.Join(r.stopAgent(), t.Close()); cerr != nil {
			err = errors.Join(err, cerr)
		}
		removeExcept(opts.Dir, r.logs)
	}()
	// Made once the cleanup above would remove it. It is all MkdirAll
	// makes: its parent holds the lock, so it is there.
	if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	vips := []netip.Addr{t.VIP4, t.VIP6}
	for _, h := range t.Backends {
		b := backend{Name: h.Name, NS: h.NS.Name(), IP4: h.IP4, IP6: h.IP6}
		r.backends = append(r.backends, b)
		r.byIP[h.IP4], r.byIP[h.IP6] = h.Name, h.Name
		if err := r.srv.serve(h.NS, b, vips); err != nil {
			return Report{}, fmt.Errorf("demo: %w", err)
		}
	}
	for _, b := range r.backends[:opts.Backends] {
		r.rep.Backends = append(r.rep.Backends, b.Name)
	}
	// nat's next-hop lookups answer only where the kernel would forward.
	if err := t.Balancer.NS.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644)
	}); err != nil {
		return Report{}, fmt.Errorf("demo: enable forwarding: %w", err)
	}

	if err := r.startAgent(ctx); err != nil {
		return r.rep, err
	}
	steps := []func(context.Context) error{r.showServices, r.rounds, r.killAndRevive, r.drain, r.reloads, r.proxy}
	for _, step := range steps {
		if err := step(ctx); err != nil {
			return r.rep, fmt.Errorf("demo: %w", err)
		}
	}
	if r.rep.Status, err = r.client.Status(ctx); err != nil {
		return r.rep, fmt.Errorf("demo: %w", err)
	}
	printReasons(r.out, r.rep.Status.XDPReasons)
	if opts.Keep {
		if err := r.keep(ctx); err != nil {
			return r.rep, fmt.Errorf("demo: keep: %w", err)
		}
		kept = true
	}
	return r.rep, nil
}

// failed records step name as failed with err, or returns err when ctx has
// ended: then the step did not fail, the demo was stopped.
func (r *run) failed(ctx context.Context, name string, err error) error {
	if ctx.Err() != nil {
		return err
	}
	r.step(name, false, "%v", err)
	return nil
}

func (r *run) step(name string, ok bool, format string, args ...any) {
	detail := fmt.Sprintf(format, args...)
	r.rep.Steps = append(r.rep.Steps, Step{Name: name, OK: ok, Detail: detail})
	mark := "ok  "
	if !ok {
		mark = "FAIL"
	}
	fmt.Fprintf(r.out, "\n[%s] %s: %s\n", mark, name, detail)
}

// writeConfig writes the agent's config with the first n backends, or a broken
// file.
func (r *run) writeConfig(n int, broken bool) error {
	if broken {
		return os.WriteFile(r.cfgPath, []byte("services:\n- name: web\n  vip: 10.77.100.1:80\n   mode: dsr\n"), 0o644)
	}
	var b strings.Builder
	t := r.t
	fmt.Fprintf(&b, `# Written by weir demo for its namespaced topology.
interfaces: [{name: %s, attach: %s}]
addresses: [%s, %s]
xdp: {hash_seed: 1, pin_path: /sys/fs/bpf/weir-demo, detach_on_stop: true}
admin: {socket: %s}
metrics: {listen: 127.0.0.1:9470}
services:
`, t.Balancer.Link, r.opts.Attach, t.Balancer.IP4, t.Balancer.IP6, filepath.Join(r.opts.Dir, "weir.sock"))
	health := fmt.Sprintf("{type: %%s, interval: %s, timeout: %s, fall: %d, rise: %d}", checkInterval, checkTimeout, checkFall, checkRise)
	svc := func(name, vip, extra, check string, port uint16, v6 bool) {
		fmt.Fprintf(&b, "- name: %s\n  vip: %q\n%s  health: %s\n  backends:\n", name, vip, extra, fmt.Sprintf(health, check))
		for _, be := range r.backends[:n] {
			ip := be.IP4
			if v6 {
				ip = be.IP6
			}
			fmt.Fprintf(&b, "  - {address: %q", netip.AddrPortFrom(ip, port).String())
			if port != httpPort {
				fmt.Fprintf(&b, ", check_address: %q", netip.AddrPortFrom(ip, httpPort).String())
			}
			b.WriteString("}\n")
		}
	}
	svc("web", netip.AddrPortFrom(t.VIP4, httpPort).String(), "  mode: dsr\n", "http", httpPort, false)
	svc("web6", netip.AddrPortFrom(t.VIP6, httpPort).String(), "  mode: dsr\n", "http", httpPort, true)
	svc("dns", netip.AddrPortFrom(t.VIP4, udpPort).String(), "  protocol: udp\n  mode: dsr\n  algorithm: source_hash\n", "tcp", udpPort, false)
	svc("web-nat", netip.AddrPortFrom(NATVIP, httpPort).String(), "  mode: nat\n", "http", httpPort, false)
	svc("app", netip.AddrPortFrom(t.Balancer.IP4, proxyPort).String(), "  data_plane: proxy\n  algorithm: least_conn\n", "http", httpPort, false)
	return os.WriteFile(r.cfgPath, []byte(b.String()), 0o644)
}

// startAgent writes the config and runs the agent in the balancer's namespace.
func (r *run) startAgent(ctx context.Context) error {
	r.cfgPath = configPath(r.opts.Dir)
	if err := r.writeConfig(r.opts.Backends, false); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	logf, err := os.Create(filepath.Join(r.opts.Dir, "agent.log"))
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer logf.Close()
	argv := append([]string{"netns", "exec", r.t.Balancer.NS.Name()}, r.opts.AgentArgv(r.cfgPath)...)
	cmd := exec.Command("ip", argv...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), r.opts.Env...)
	// Its own session: a terminal's ^C reaches the demo, which stops the agent in
	// order (and --keep leaves it running after the demo exits).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	exited, err := r.start(cmd)
	if err != nil {
		return fmt.Errorf("demo: start the agent: %w", err)
	}
	r.agent, r.agentErr = cmd, exited
	// What the next run removes if this one is killed.
	if err := writeState(r.state()); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	r.client = admin.NewClient(filepath.Join(r.opts.Dir, "weir.sock"))
	fmt.Fprintf(r.out, "weir demo: client, balancer and %d backends in network namespaces (%s...); the agent runs `%s` in %s\n",
		len(r.t.Backends), r.t.Name, strings.Join(r.opts.AgentArgv(r.cfgPath), " "), r.t.Balancer.NS.Name())
	start := time.Now()
	deadline := start.Add(30 * time.Second)
	for {
		st, err := r.client.Status(ctx)
		if err == nil && st.AllChecked() {
			r.rep.Attach = attachMode(st)
			r.step(StepRunning, st.XDP.Loaded, "XDP %s on %s, %d services up in %s", attachWord(st), r.t.Balancer.Link, len(st.Services), time.Since(start).Round(time.Millisecond))
			return nil
		}
		select {
		case aerr := <-r.agentErr:
			r.agent = nil // reported here, not again by stopAgent
			return fmt.Errorf("demo: the agent exited: %w; its log is %s", aerr, r.keepLog("agent.log"))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("demo: the agent did not answer within 30s (last: %v); its log is %s", err, r.keepLog("agent.log"))
		}
	}
}

// start starts cmd and returns what its Wait returns, once it has exited.
// With DieWithParent cmd gets SIGTERM when this process dies.
func (r *run) start(cmd *exec.Cmd) (<-chan error, error) {
	var sig syscall.Signal
	if r.opts.DieWithParent {
		sig = syscall.SIGTERM
	}
	return start(cmd, sig)
}

// start starts cmd and returns what its Wait returns, once it has exited.
// With deathSig, cmd gets it when this process dies. The kernel sends that
// when the thread that started cmd ends, and the runtime ends a thread that a
// goroutine left locked (a namespace helper does when it cannot switch its
// thread back): so cmd starts on a thread locked to a goroutine of its own,
// which lives until cmd exits.
func start(cmd *exec.Cmd, deathSig syscall.Signal) (<-chan error, error) {
	if deathSig != 0 {
		if cmd.SysProcAttr == nil {
			cmd.SysProcAttr = &syscall.SysProcAttr{}
		}
		cmd.SysProcAttr.Pdeathsig = deathSig
	}
	started, exited := make(chan error, 1), make(chan error, 1)
	// Exits when cmd does: for a kept demo, when this process does.
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		err := cmd.Start()
		started <- err
		if err == nil {
			exited <- cmd.Wait()
		}
	}()
	return exited, <-started
}

func attachMode(st api.Status) string {
	for _, i := range st.XDP.Interfaces {
		if i.Mode != "" {
			return i.Mode
		}
	}
	return ""
}

func attachWord(st api.Status) string {
	if !st.XDP.Loaded {
		return "not loaded (" + st.XDP.Reason + ")"
	}
	return "attached (" + attachMode(st) + ")"
}

// keepLog is the path of the log name in the demo's directory, which the demo
// keeps when it removes the rest: an error names it.
func (r *run) keepLog(name string) string {
	if !slices.Contains(r.logs, name) {
		r.logs = append(r.logs, name)
	}
	return filepath.Join(r.opts.Dir, name)
}

// files are the names a demo gives what it makes in its directory: all it
// removes there.
var files = []string{"weir.yaml", "weir.sock", "agent.log", "hold.log", "state.json", "state.json.new"}

// removeExcept removes what a demo makes in dir (files) but what keep names,
// then dir if nothing is left: never anything a demo did not make. What is
// left (a kept log, a user's editor backup of the config) stays, and the
// next demo takes dir as it is.
func removeExcept(dir string, keep []string) {
	for _, name := range files {
		if !slices.Contains(keep, name) {
			os.Remove(filepath.Join(dir, name))
		}
	}
	os.Remove(dir) // fails while anything is left in it
}

// stopAgent ends the agent (SIGTERM, as systemd would), waits for it up to
// termWait and then kills it, and waits up to killWait for that: a process
// the kernel holds (frozen, or in an uninterruptible call) may outlive
// SIGKILL, and the demo goes on without it, naming its pid.
func (r *run) stopAgent() error {
	if r.agent == nil {
		return nil
	}
	r.agent.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-r.agentErr:
		r.agent = nil
		if err != nil {
			return fmt.Errorf("demo: the agent: %w; its log is %s", err, r.keepLog("agent.log"))
		}
		return nil
	case <-time.After(termWait):
		r.agent.Process.Kill()
		pid := r.agent.Process.Pid
		r.agent = nil
		select {
		case <-r.agentErr:
			return fmt.Errorf("demo: the agent did not stop within %s of SIGTERM: killed; its log is %s", termWait, r.keepLog("agent.log"))
		case <-time.After(killWait):
			return fmt.Errorf("demo: the agent (pid %d) did not exit within %s of SIGKILL; its log is %s", pid, killWait, r.keepLog("agent.log"))
		}
	}
}

// lineError is an error whose text is on one line: what errors.Join puts on
// lines of their own is separated by "; ".
type lineError struct{ err error }

func (e lineError) Error() string { return strings.ReplaceAll(e.err.Error(), "\n", "; ") }
func (e lineError) Unwrap() error { return e.err }

// OneLine is err with its text on one line, for weir demo and weir demo
// fleet print an error as one line; errors.Is and errors.As see through it.
func OneLine(err error) error {
	if err == nil || !strings.Contains(err.Error(), "\n") {
		return err
	}
	return lineError{err}
}

// showServices prints the agent's own status.
func (r *run) showServices(ctx context.Context) error {
	st, err := r.client.Status(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintln(r.out, "\n$ weir status")
	st.WriteTable(r.out)
	return nil
}

// get fetches http://dst/ from the client over a new connection and returns the
// body (the answering backend's name).
func (r *run) get(ctx context.Context, dst netip.AddrPort) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+dst.String()+"/", nil)
	if err != nil {
		return "", err
	}
	resp, err := r.t.HTTPClient().Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: status %s", dst, resp.Status)
	}
	return string(body), nil
}

// round sends n requests with ask (8 at a time) and reads what the agent counted
// for service before and after.
func (r *run) round(ctx context.Context, service, title string, n int, ask func(i int) (string, error)) (Round, error) {
	before, err := r.client.Status(ctx)
	if err != nil {
		return Round{}, err
	}
	rd := Round{Title: title, Sent: n, Answers: map[string]int{}, Counted: map[string]uint64{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan int)
	for range 8 {
		// Exits when work is closed.
		wg.Go(func() {
			for i := range work {
				name, err := ask(i)
				mu.Lock()
				if err != nil {
					rd.Failures = append(rd.Failures, err)
				} else {
					rd.Answers[name]++
				}
				mu.Unlock()
			}
		})
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	after, err := r.client.Status(ctx)
	if err != nil {
		return Round{}, err
	}
	counted := func(st api.Status) map[string]uint64 {
		m := map[string]uint64{}
		for _, s := range st.Services {
			if s.Name != service {
				continue
			}
			for _, b := range s.Backends {
				ap := netip.MustParseAddrPort(b.Address)
				v := b.Packets
				if s.DataPlane == api.PlaneProxy {
					v = b.Connects
				}
				m[r.byIP[ap.Addr()]] = v
			}
		}
		return m
	}
	was := counted(before)
	for name, v := range counted(after) {
		rd.Counted[name] = v - was[name]
	}
	r.rep.Rounds = append(r.rep.Rounds, rd)
	r.printRound(rd, service)
	return rd, nil
}

func (r *run) printRound(rd Round, service string) {
	fmt.Fprintf(r.out, "\n%s\n", rd.Title)
	tw := tabwriter.NewWriter(r.out, 0, 0, 2, ' ', tabwriter.AlignRight)
	what := "xdp packets"
	if service == "app" {
		what = "proxy connects"
	}
	fmt.Fprintf(tw, "backend\taddress\tanswered\tshare\t%s\t\n", what)
	seen := map[string]bool{}
	for _, b := range r.backends {
		seen[b.Name] = rd.Answers[b.Name] > 0 || rd.Counted[b.Name] > 0 || slices.Contains(r.rep.Backends, b.Name)
	}
	for _, b := range r.backends {
		if !seen[b.Name] {
			continue
		}
		share := 0.0
		if rd.Sent > 0 {
			share = 100 * float64(rd.Answers[b.Name]) / float64(rd.Sent)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.1f%%\t%d\t\n", b.Name, b.IP4, rd.Answers[b.Name], share, rd.Counted[b.Name])
	}
	fmt.Fprintf(tw, "failed\t\t%d\t\t\t\n", len(rd.Failures))
	tw.Flush()
	if len(rd.Failures) > 0 {
		fmt.Fprintf(r.out, "first failure: %v\n", rd.Failures[0])
	}
}

// rounds: every XDP service with all backends up.
func (r *run) rounds(ctx context.Context) error {
	n, t := r.opts.Requests, r.t
	web := netip.AddrPortFrom(t.VIP4, httpPort)
	if _, err := r.round(ctx, "web", fmt.Sprintf("%d HTTP requests to web (%s, dsr), each on a new TCP connection", n, web), n,
		func(int) (string, error) { return r.get(ctx, web) }); err != nil {
		return err
	}
	web6 := netip.AddrPortFrom(t.VIP6, httpPort)
	if _, err := r.round(ctx, "web6", fmt.Sprintf("%d HTTP requests to web6 (%s, dsr)", n/3, web6), n/3,
		func(int) (string, error) { return r.get(ctx, web6) }); err != nil {
		return err
	}
	dns := netip.AddrPortFrom(t.VIP4, udpPort)
	if _, err := r.round(ctx, "dns", fmt.Sprintf("%d UDP queries to dns (%s, dsr) from distinct ports of one client: source_hash sends one client address to one backend", n/3, dns), n/3,
		func(i int) (string, error) { return t.AskUDP(ctx, dns, uint16(30000+i)) }); err != nil {
		return err
	}
	nat := netip.AddrPortFrom(NATVIP, httpPort)
	_, err := r.round(ctx, "web-nat", fmt.Sprintf("%d HTTP requests to web-nat (%s, full nat: the backends see the balancer, not the client)", n, nat), n,
		func(int) (string, error) { return r.get(ctx, nat) })
	return err
}

// waitBackend polls the agent until the backend's health is want, and says how
// long that took.
func (r *run) waitBackend(ctx context.Context, service string, addr netip.AddrPort, usable bool, within time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		st, err := r.client.Status(ctx)
		if err != nil {
			return 0, err
		}
		for _, s := range st.Services {
			for _, b := range s.Backends {
				if s.Name == service && b.Address == addr.String() && b.Usable == usable {
					return time.Since(start), nil
				}
			}
		}
		if time.Since(start) > within {
			return time.Since(start), fmt.Errorf("backend %s of %s not usable=%t within %s", addr, service, usable, within)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// killAndRevive: a backend's server dies; health marks it down, new connections
// avoid it; it comes back.
func (r *run) killAndRevive(ctx context.Context) error {
	victim := r.backends[0]
	addr := netip.AddrPortFrom(victim.IP4, httpPort)
	web := netip.AddrPortFrom(r.t.VIP4, httpPort)
	bound := checkInterval*checkFall + checkTimeout
	fmt.Fprintf(r.out, "\nkilling %s's HTTP server (%s)\n", victim.Name, addr)
	r.srv.kill(victim.Name)
	took, err := r.waitBackend(ctx, "web", addr, false, 10*bound)
	if err != nil {
		return r.failed(ctx, StepKill, err)
	}
	rd, err := r.round(ctx, "web", fmt.Sprintf("%d HTTP requests to web with %s down", r.opts.Requests, victim.Name), r.opts.Requests,
		func(int) (string, error) { return r.get(ctx, web) })
	if err != nil {
		return err
	}
	r.step(StepKill, rd.Answers[victim.Name] == 0 && len(rd.Failures) == 0,
		"health marked %s down %s after its server died (checks every %s, down after %d failures: at most about %s); %d of %d new connections went to it, %d failed",
		victim.Name, took.Round(time.Millisecond), checkInterval, checkFall, bound, rd.Answers[victim.Name], rd.Sent, len(rd.Failures))

	if err := r.srv.serveHTTP(victim.Name); err != nil {
		return err
	}
	took, err = r.waitBackend(ctx, "web", addr, true, 10*(checkInterval*checkRise+checkTimeout))
	if err != nil {
		return r.failed(ctx, StepRevive, err)
	}
	rd, err = r.round(ctx, "web", fmt.Sprintf("%d HTTP requests to web with %s back", r.opts.Requests, victim.Name), r.opts.Requests,
		func(int) (string, error) { return r.get(ctx, web) })
	if err != nil {
		return err
	}
	r.step(StepRevive, rd.Answers[victim.Name] > 0 && len(rd.Failures) == 0,
		"%s back in service %s after its server restarted (up after %d passing checks); it answered %d of %d",
		victim.Name, took.Round(time.Millisecond), checkRise, rd.Answers[victim.Name], rd.Sent)
	return nil
}

// drain: an established keep-alive connection to a backend goes on after the
// backend is drained; new connections avoid it.
func (r *run) drain(ctx context.Context) error {
	target := r.backends[1]
	addr := netip.AddrPortFrom(target.IP4, httpPort)
	web := netip.AddrPortFrom(r.t.VIP4, httpPort)
	// Ask the agent which client port lands on target. The ports are above
	// the kernel's ephemeral range (32768-60999 in the client's namespace): in
	// it, an earlier round's connection in TIME_WAIT could hold the port, and
	// the bind fail.
	port := uint16(0)
	for p := uint16(61000); p < 62000; p++ {
		ex, err := r.client.Explain(ctx, "web", netip.AddrPortFrom(r.t.Client.IP4, p).String())
		if err != nil {
			return err
		}
		if ex.New == addr.String() {
			port = p
			break
		}
	}
	if port == 0 {
		r.step(StepDrain, false, "no client port in 61000..61999 maps to %s", addr)
		return nil
	}
	c, err := r.t.DialTCP(ctx, web, port)
	if err != nil {
		return err
	}
	defer c.Close()
	br := bufio.NewReader(c)
	ask := func() (string, error) {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		return topo.Ask(c, br)
	}
	first, err := ask()
	if err != nil {
		return fmt.Errorf("keep-alive request: %w", err)
	}
	fmt.Fprintf(r.out, "\n$ weir drain web %s   (a keep-alive connection from %s:%d is open to %s)\n", addr, r.t.Client.IP4, port, first)
	if err := r.client.Drain(ctx, "web", addr.String(), true); err != nil {
		return err
	}
	second, err := ask()
	if err != nil {
		second = "error: " + err.Error()
	}
	rd, err := r.round(ctx, "web", fmt.Sprintf("%d HTTP requests to web with %s drained", r.opts.Requests, target.Name), r.opts.Requests,
		func(int) (string, error) { return r.get(ctx, web) })
	if err != nil {
		return err
	}
	if err := r.client.Drain(ctx, "web", addr.String(), false); err != nil {
		return err
	}
	r.step(StepDrain, first == target.Name && second == target.Name && rd.Answers[target.Name] == 0 && len(rd.Failures) == 0,
		"the open connection was answered by %s before and %s after the drain; %d of %d new connections went to %s (undrained again)",
		first, second, rd.Answers[target.Name], rd.Sent, target.Name)
	return nil
}

// reloads: one adds the spare backend, one is a broken file.
func (r *run) reloads(ctx context.Context) error {
	added := r.backends[len(r.backends)-1]
	web := netip.AddrPortFrom(r.t.VIP4, httpPort)
	if err := r.writeConfig(len(r.backends), false); err != nil {
		return err
	}
	fmt.Fprintf(r.out, "\n$ weir reload   (the config now lists %s too)\n", added.Name)
	if err := r.client.Reload(ctx); err != nil {
		return r.failed(ctx, StepReloadAdd, fmt.Errorf("reload: %w", err))
	}
	if _, err := r.waitBackend(ctx, "web", netip.AddrPortFrom(added.IP4, httpPort), true, 5*time.Second); err != nil {
		return r.failed(ctx, StepReloadAdd, err)
	}
	r.rep.Backends = append(r.rep.Backends, added.Name)
	rd, err := r.round(ctx, "web", fmt.Sprintf("%d HTTP requests to web after the reload", r.opts.Requests), r.opts.Requests,
		func(int) (string, error) { return r.get(ctx, web) })
	if err != nil {
		return err
	}
	r.step(StepReloadAdd, rd.Answers[added.Name] > 0 && len(rd.Failures) == 0,
		"%s answered %d of %d new connections", added.Name, rd.Answers[added.Name], rd.Sent)

	if err := r.writeConfig(0, true); err != nil {
		return err
	}
	fmt.Fprintln(r.out, "\n$ weir reload   (the file now has an indentation error)")
	rerr := r.client.Reload(ctx)
	var re *admin.RequestError
	refused := errors.As(rerr, &re)
	if err := r.writeConfig(len(r.backends), false); err != nil { // the good file back, for --keep
		return err
	}
	rd, err = r.round(ctx, "web", fmt.Sprintf("%d HTTP requests to web after the refused reload", r.opts.Requests/3), r.opts.Requests/3,
		func(int) (string, error) { return r.get(ctx, web) })
	if err != nil {
		return err
	}
	msg := fmt.Sprint(rerr)
	if refused {
		msg = strings.Join(re.Errors, "; ")
	}
	r.step(StepReloadBroken, refused && len(rd.Failures) == 0,
		"refused with %q; the running config kept serving (%d of %d answered)", msg, rd.Sent-len(rd.Failures), rd.Sent)
	return nil
}

// proxy: a service on the proxy data plane with least connections.
func (r *run) proxy(ctx context.Context) error {
	dst := netip.AddrPortFrom(r.t.Balancer.IP4, proxyPort)
	st, err := r.client.Status(ctx)
	if err != nil {
		return err
	}
	why := ""
	for _, s := range st.Services {
		if s.Name == "app" {
			why = fmt.Sprintf("data plane %s (%s), algorithm %s", s.DataPlane, s.Why, s.Algorithm)
		}
	}
	rd, err := r.round(ctx, "app", fmt.Sprintf("%d HTTP requests to app (%s, the splice proxy, least_conn)", r.opts.Requests, dst), r.opts.Requests,
		func(int) (string, error) { return r.get(ctx, dst) })
	if err != nil {
		return err
	}
	served := 0
	for _, n := range rd.Answers {
		if n > 0 {
			served++
		}
	}
	r.step(StepProxy, len(rd.Failures) == 0 && served == len(r.rep.Backends) && strings.Contains(why, "proxy"),
		"%s; %d backends answered, %d failed", why, served, len(rd.Failures))
	return nil
}

func printReasons(out io.Writer, reasons map[string]uint64) {
	fmt.Fprintf(out, "\nXDP program counters (weir status --json: xdp_packets_by_reason)\n")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "reason\tpackets\t")
	keys := make([]string, 0, len(reasons))
	for k, v := range reasons {
		if v > 0 {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(tw, "%s\t%d\t\n", k, reasons[k])
	}
	tw.Flush()
}
