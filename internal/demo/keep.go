package demo

import (
	"context"
	"encoding/json"
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

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/procstat"
	"github.com/weir-lb/weir/internal/topo"
)

// state is what a demo leaves for the next run, should it be killed, and what
// a kept demo leaves for Hold and Down. A process is named by its pid and its
// start time (a pid may be reused).
type state struct {
	Dir        string       `json:"dir"`
	AgentPID   int          `json:"agent_pid"`
	AgentStart string       `json:"agent_start"`
	HoldPID    int          `json:"hold_pid"`
	HoldStart  string       `json:"hold_start"`
	Namespaces []string     `json:"namespaces"`
	Backends   []backend    `json:"backends"`
	VIPs       []netip.Addr `json:"vips"`
}

func statePath(dir string) string { return filepath.Join(dir, "state.json") }

// NameEnv names the environment variable that runs weir demo, and weir demo
// down, beside the default demo: WEIR_DEMO_NAME=NAME (3 letters a-z, not a
// reserved prefix) gives the directory DefaultDir-NAME and the namespace
// prefix NAME (see Place).
const NameEnv = "WEIR_DEMO_NAME"

// testName is the one reserved name Place accepts: set (-ldflags -X) only in
// the weir that cmd/weir's tests build, whose demos run under their own
// reserved prefix; empty in weir itself.
var testName string

// Place is the directory and the namespace prefix of the demo named name:
// DefaultDir and NamePrefix for "", DefaultDir-NAME and NAME for 3 letters a-z
// that are no prefix weir's own tests, benchmarks and demos use
// (topo.ReservedPrefixes) and begin none. A demo removes, as a dead demo's,
// every namespace of its prefix whose demo has exited, and so do those tests
// and weir demo fleet of their own: each directory has a prefix of its own,
// one that no other demo's, and no test's, begins with.
func Place(name string) (dir, prefix string, err error) {
	if name == "" {
		return DefaultDir, NamePrefix, nil
	}
	if !threeLetters(name) {
		return "", "", fmt.Errorf("%s must be 3 letters a-z, got %q", NameEnv, name)
	}
	if reserved(name) && name != testName {
		return "", "", fmt.Errorf("%s=%s is reserved: weir's own tests and demos name their namespaces %s... and remove those whose run has exited, which would remove this demo's; choose 3 other letters a-z", NameEnv, name, name)
	}
	return DefaultDir + "-" + name, name, nil
}

// threeLetters reports whether name is 3 letters a-z, as every demo's
// namespace prefix is.
func threeLetters(name string) bool {
	return len(name) == 3 && strings.Trim(name, "abcdefghijklmnopqrstuvwxyz") == ""
}

// reserved reports whether name is one of topo.ReservedPrefixes or begins
// one: then the names of a demo with the prefix name can look like that
// prefix's.
func reserved(name string) bool {
	return slices.ContainsFunc(topo.ReservedPrefixes, func(p string) bool { return strings.HasPrefix(p, name) })
}

// downCommand is the shell command that removes the kept demo in dir.
func downCommand(dir string) string {
	if name, ok := strings.CutPrefix(filepath.Clean(dir), DefaultDir+"-"); ok {
		if _, _, err := Place(name); err == nil {
			return NameEnv + "=" + name + " weir demo down"
		}
	}
	return "weir demo down"
}

// configPath is the agent's config in dir.
func configPath(dir string) string { return filepath.Join(dir, "weir.yaml") }

func readState(dir string) (state, error) {
	var st state
	b, err := os.ReadFile(statePath(dir))
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return st, fmt.Errorf("%s: %w", statePath(dir), err)
	}
	return st, nil
}

// startTime is field 22 of /proc/PID/stat, when the process started, or "" when
// there is no such process.
func startTime(pid int) string {
	if f := procstat.Fields(strconv.Itoa(pid)); len(f) >= 20 {
		return f[19]
	}
	return ""
}

// state is what the run has made so far: the agent and the namespaces.
func (r *run) state() state {
	st := state{Dir: r.opts.Dir, AgentPID: r.agent.Process.Pid, AgentStart: startTime(r.agent.Process.Pid)}
	for _, h := range r.t.Hosts() {
		st.Namespaces = append(st.Namespaces, h.NS.Name())
	}
	st.Namespaces = append(st.Namespaces, r.t.Bridge.Name())
	return st
}

// keep hands the backends to a hold process, leaves the agent running and prints
// what to try.
func (r *run) keep(ctx context.Context) error {
	st := r.state()
	st.Backends, st.VIPs = r.backends, []netip.Addr{r.t.VIP4, r.t.VIP6}
	// The hold process binds the same ports: this process lets go first.
	r.srv.close()
	logf, err := os.Create(filepath.Join(r.opts.Dir, "hold.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	if err := writeState(st); err != nil {
		return err
	}
	argv := r.opts.HoldArgv(statePath(r.opts.Dir), r.opts.NamePrefix)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), r.opts.Env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	// It holds the directory's lock on after this process exits, until weir
	// demo down stops it.
	cmd.ExtraFiles = []*os.File{r.lock}
	exited, err := r.start(cmd)
	if err != nil {
		return fmt.Errorf("start the backends' process: %w", err)
	}
	held, gone := false, false
	defer func() {
		if !held && !gone {
			// It holds the lock: a demo that removes what it made stops it.
			cmd.Process.Kill()
			<-exited
		}
	}()
	st.HoldPID, st.HoldStart = cmd.Process.Pid, startTime(cmd.Process.Pid)
	if err := writeState(st); err != nil {
		return err
	}
	if err := setHolder(r.lock, "kept", st.AgentPID); err != nil {
		return err
	}
	// Serving again once a request through the VIP is answered.
	web := netip.AddrPortFrom(r.t.VIP4, httpPort)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := r.get(ctx, web); err == nil {
			break
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the backends did not answer again within 10s; their process's log is %s", r.keepLog("hold.log"))
		}
		select {
		case err := <-exited:
			gone = true
			if err == nil {
				err = errors.New("exit status 0")
			}
			return fmt.Errorf("the backends' process exited: %w; its log is %s", err, r.keepLog("hold.log"))
		case <-time.After(20 * time.Millisecond):
		}
	}
	held = true
	cfg := r.cfgPath
	fmt.Fprintf(r.out, `
The topology and the agent keep running. Try (as root):
  weir status -c %[1]s
  weir explain -c %[1]s web %[2]s:40000
  weir drain -c %[1]s web %[3]s:80     (weir undrain ... ends it)
  ip netns exec %[4]s curl -s http://%[5]s/
  ip netns exec %[6]s curl -s http://127.0.0.1:9470/metrics | grep ^weir_backend_usable
  edit %[1]s, then: weir reload -c %[1]s
The agent logs to %[7]s. Remove everything with: %[8]s
`, cfg, r.t.Client.IP4, r.backends[0].IP4, r.t.Client.NS.Name(), r.t.VIP4, r.t.Balancer.NS.Name(), filepath.Join(r.opts.Dir, "agent.log"), downCommand(r.opts.Dir))
	return nil
}

// writeState replaces the state file whole (a new file renamed over it): the
// hold process reads it while keep adds the hold process's pid.
func writeState(st state) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	tmp := statePath(st.Dir) + ".new"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, statePath(st.Dir))
}

// Hold serves a kept demo's backends, whose namespaces' names begin with
// prefix, until ctx ends (weir demo down sends SIGTERM). It enters only the
// demo's own namespaces: a name the state file gives that is not named as
// the demo names them, or what is at such a name if it is no network
// namespace (a symlink, whatever it points to; a FIFO; a file), is refused
// with an error that says why, before any backend is served; so is a prefix
// no demo has (3 letters a-z).
func Hold(ctx context.Context, path, prefix string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("demo hold: %w", err)
	}
	var st state
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("demo hold: %s: %w", path, err)
	}
	// A shorter prefix ("w", "") would match other names of the same
	// shape: topo.UniqueName("w")'s, a test topology's.
	if !threeLetters(prefix) {
		return fmt.Errorf("demo hold: the prefix must be 3 letters a-z, as a demo's namespaces' is, got %q", prefix)
	}
	nss := make([]*netns.NS, len(st.Backends))
	for i, be := range st.Backends {
		if !demoNS(prefix).MatchString(be.NS) {
			return fmt.Errorf("demo hold: %s: backend %s's namespace %q is not this demo's: its namespaces are named %s<pid><n>-<role>", path, be.Name, be.NS, prefix)
		}
		// Not closed: that would remove the namespace; Down does it.
		if nss[i], err = netns.Open(be.NS); err != nil {
			return fmt.Errorf("demo hold: %s: backend %s: %w", path, be.Name, err)
		}
	}
	srv := newServers()
	defer srv.close()
	for i, be := range st.Backends {
		if err := srv.serve(nss[i], be, st.VIPs); err != nil {
			return fmt.Errorf("demo hold: %w", err)
		}
	}
	<-ctx.Done()
	return nil
}

// Down removes what a kept demo left in dir, whose namespaces' names begin
// with prefix (Options.Dir and Options.NamePrefix; "" for the defaults): it
// stops the agent and the backends' process, then removes the namespaces. It
// refuses while a demo runs there.
func Down(dir, prefix string) (err error) {
	defer func() { err = OneLine(err) }()
	if dir == "" {
		dir = DefaultDir
	}
	if prefix == "" {
		prefix = NamePrefix
	}
	lk, err := lock(dir)
	if errors.Is(err, ErrBusy) && kept(dir) {
		lk, err = takeKept(dir)
	}
	if err != nil {
		return fmt.Errorf("demo down: %w", err)
	}
	defer lk.Close()
	if _, err := os.Stat(statePath(dir)); errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("demo down: no kept demo (%s does not exist)", statePath(dir))
	}
	if err := removeLeftovers(dir, prefix); err != nil {
		return fmt.Errorf("demo down: %w", err)
	}
	return nil
}

// takeKept stops the hold process of the kept demo in dir, which holds dir's
// lock, and takes the lock once it is gone.
func takeKept(dir string) (*os.File, error) {
	st, err := readState(dir)
	if err != nil {
		return nil, err
	}
	if err := stopProc(st.hold(dir)); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		lk, err := lock(dir)
		if !errors.Is(err, ErrBusy) || time.Now().After(deadline) {
			return lk, err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// removeLeftovers removes what the state in dir names, if any, of the demo
// whose namespaces' names begin with prefix: its processes, then its
// namespaces, then what a demo makes in dir (removeExcept). The caller holds
// dir's lock. What the state names but is not that demo's (a hand-edited
// state file can name anything) is left: a namespace not named as its
// namespaces are, an agent in none of them.
func removeLeftovers(dir, prefix string) error {
	st, err := readState(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var nss []string
	for _, name := range st.Namespaces {
		if demoNS(prefix).MatchString(name) {
			nss = append(nss, name)
		}
	}
	var errs []error
	for _, p := range []proc{st.agent(dir, nss), st.hold(dir)} {
		if err := stopProc(p); err != nil {
			errs = append(errs, err)
		}
	}
	for _, name := range nss {
		// Not opened first: what is at the name may be no namespace (a
		// FIFO, whose open blocks; a device).
		if err := netns.RemoveMounted(name); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	removeExcept(dir, nil)
	return nil
}

// demoNS matches the names of the namespaces a demo with prefix makes, and so
// the only ones removeLeftovers removes: its topology's name
// (topo.UniqueName(prefix): 5 base-36 digits of pid, the first 0, 1 or 2, and
// 1 or 2 of sequence) and a role. A longer prefix that begins with prefix
// goes on with a letter, where no pid does: its names do not match.
func demoNS(prefix string) *regexp.Regexp {
	return regexp.MustCompile(`^` + regexp.QuoteMeta(prefix) + `[0-2][0-9a-z]{4}[0-9a-z]{1,2}-(client|lb|br|be[0-9]+)$`)
}

// How long stopProc (and stopAgent) waits for a process to exit after
// SIGTERM, before it sends SIGKILL, and after SIGKILL.
var (
	termWait = 15 * time.Second
	killWait = 5 * time.Second
)

// proc is a process a demo left, as its state names it: by pid and start
// time, and what only that demo's process is (ours: the agent runs in one of
// the demo's namespaces or on its config, the hold process holds its lock);
// or, in a state file from before start times were recorded, by pid and the
// arguments it runs with after argv[0] (`run -c DIR/weir.yaml`, `demo hold
// DIR/state.json`), which only a weir agent or hold process on the demo's
// own files has. A pid whose process does not match is another's.
type proc struct {
	pid   int
	start string
	ours  func(pid int) bool
	args  []string
}

// agent and hold are the processes st names, left in dir. The agent runs in
// one of the namespaces nss or, should they have been removed from under it
// (`ip netns delete`, another program's cleanup of the prefix), on the demo's
// config: it is still the demo's to stop.
func (st state) agent(dir string, nss []string) proc {
	args := []string{"run", "-c", configPath(dir)}
	return proc{st.AgentPID, st.AgentStart, func(pid int) bool { return inNamespace(pid, nss) || runsWith(pid, args) }, args}
}

func (st state) hold(dir string) proc {
	return proc{st.HoldPID, st.HoldStart, func(pid int) bool { return holds(pid, lockPath(dir)) }, []string{"demo", "hold", statePath(dir)}}
}

// inNamespace reports whether a thread of process pid is in one of the
// network namespaces mounted at /run/netns/<name> for each name in nss. Any
// thread, not only the main one /proc/PID/ns/net shows: an agent may have
// its main thread elsewhere (weir's own self-test gives threads back where
// they were since it switches them back, but an older agent's did not).
func inNamespace(pid int, nss []string) bool {
	var want []os.FileInfo
	for _, name := range nss {
		// Lstat: a symlink there is no namespace of the demo's, whatever it
		// points to; a namespace's bind mount is seen through.
		if fi, err := os.Lstat(filepath.Join(netns.RunDir, name)); err == nil {
			want = append(want, fi)
		}
	}
	tasks := filepath.Join("/proc", strconv.Itoa(pid), "task")
	ents, _ := os.ReadDir(tasks)
	return slices.ContainsFunc(ents, func(e os.DirEntry) bool {
		fi, err := os.Stat(filepath.Join(tasks, e.Name(), "ns", "net"))
		return err == nil && slices.ContainsFunc(want, func(w os.FileInfo) bool { return os.SameFile(fi, w) })
	})
}

// holds reports whether process pid has the file at path open.
func holds(pid int, path string) bool {
	want, err := os.Stat(path)
	if err != nil {
		return false
	}
	fds := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, _ := os.ReadDir(fds)
	return slices.ContainsFunc(ents, func(e os.DirEntry) bool {
		fi, err := os.Stat(filepath.Join(fds, e.Name()))
		return err == nil && os.SameFile(want, fi)
	})
}

// running reports whether p runs: pid is its process (not another that took
// the pid) and not a zombie (one that has exited, not yet reaped).
func (p proc) running() bool {
	f := procstat.Fields(strconv.Itoa(p.pid))
	if len(f) < 20 || f[0] == "Z" {
		return false
	}
	if p.start != "" {
		return f[19] == p.start && (p.ours == nil || p.ours(p.pid))
	}
	return runsWith(p.pid, p.args)
}

// runsWith reports whether process pid runs with args (not empty) after
// argv[0].
func runsWith(pid int, args []string) bool {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	argv := strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
	return len(args) > 0 && len(argv) == len(args)+1 && slices.Equal(argv[1:], args)
}

// stopProc stops p: SIGTERM, up to termWait to exit, then SIGKILL; it
// returns once the process has exited, reaped or not, and fails only if it
// still runs killWait after SIGKILL. It signals and waits through a pidfd
// opened before it checks that the pid is p's, so a process that has taken
// the pid since is never signalled, not even one that takes it while stopProc
// waits. Where there is no pidfd_open (a kernel before 5.3, a container whose
// seccomp filter refuses it) it goes by pid (stopPID).
func stopProc(p proc) error {
	if p.pid <= 0 {
		return nil
	}
	fd, err := unix.PidfdOpen(p.pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil // gone
	}
	if err != nil {
		return stopPID(p)
	}
	defer unix.Close(fd)
	if !p.running() {
		return nil // gone, or the pid another's now
	}
	for _, sig := range []unix.Signal{unix.SIGTERM, unix.SIGKILL} {
		if unix.PidfdSendSignal(fd, sig, nil, 0) != nil {
			return nil // it has just exited
		}
		if pidfdExited(fd, waitAfter(sig)) {
			return nil
		}
	}
	return fmt.Errorf("pid %d still runs %s after SIGKILL", p.pid, killWait)
}

// waitAfter is how long stopProc waits for a process to exit after sig.
func waitAfter(sig unix.Signal) time.Duration {
	if sig == unix.SIGKILL {
		return killWait
	}
	return termWait
}

// pidfdExited waits up to d for the process of the pidfd fd to exit, and
// reports whether it has.
func pidfdExited(fd int, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		// Readable once the process has exited.
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, int(max(time.Until(deadline).Milliseconds(), 0)))
		if n > 0 {
			return true
		}
		if !errors.Is(err, unix.EINTR) || time.Now().After(deadline) {
			return false
		}
	}
}

// stopPID is stopProc by pid, for where there is no pidfd: it looks at the
// process before each signal and while it waits, so only a process that
// takes the pid between a look and the signal after it can be signalled.
func stopPID(p proc) error {
	for _, sig := range []unix.Signal{unix.SIGTERM, unix.SIGKILL} {
		if !p.running() || unix.Kill(p.pid, sig) != nil {
			return nil
		}
		deadline := time.Now().Add(waitAfter(sig))
		for p.running() && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
	}
	if p.running() {
		return fmt.Errorf("pid %d still runs %s after SIGKILL", p.pid, killWait)
	}
	return nil
}
