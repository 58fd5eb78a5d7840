package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/freezetest"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// pidReuseEnv runs this test binary as pidReuse, the first process of a pid
// namespace of its own.
const pidReuseEnv = "WEIR_DEMO_TEST_PID_REUSE"

// Exit statuses of pidReuse besides 0 (the second process lived on).
const (
	pidReuseKilled = 3 // stopProc stopped the process that took the pid
	pidReuseMissed = 4 // the second process did not get the pid: try again
)

// TestStopProcReusedPID: a process that stopProc is stopping exits and
// another takes its pid while stopProc waits; stopProc returns at once and
// never signals the other. It runs in a pid namespace of its own, where the
// test can hand the pid on (ns_last_pid) and nothing else takes it.
func TestStopProcReusedPID(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for try := 1; ; try++ {
		cmd := exec.Command(exe, "-test.run", "^$")
		cmd.Env = append(os.Environ(), pidReuseEnv+"=1")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWPID | unix.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		switch {
		case err == nil:
			return
		case errors.As(err, &ee) && ee.ExitCode() == pidReuseMissed && try < 10:
			continue
		case errors.As(err, &ee) && ee.ExitCode() == pidReuseKilled:
			t.Fatalf("stopProc stopped the process that took the pid of the one it stopped: %s", out)
		default:
			t.Fatalf("%v: %s", err, out)
		}
	}
}

// pidReuse, pid 1 of its namespace with a /proc of its own: stopProc stops a
// process, which exits on SIGTERM; a second process takes its pid while
// stopProc waits; the second must live on.
func pidReuse() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := unix.Mount("", "/", "", unix.MS_PRIVATE|unix.MS_REC, ""); err != nil {
		return fail(err)
	}
	if err := unix.Mount("proc", "/proc", "proc", 0, ""); err != nil {
		return fail(err)
	}
	first := exec.Command("sleep", "60")
	if err := first.Start(); err != nil {
		return fail(err)
	}
	pid := first.Process.Pid
	stopped := make(chan error, 1)
	// Exits when stopProc returns.
	go func() { stopped <- stopProc(proc{pid: pid, start: startTime(pid)}) }()
	first.Wait() // SIGTERM from stopProc; its pid is free
	if err := os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(strconv.Itoa(pid-1)), 0); err != nil {
		return fail(err)
	}
	second := exec.Command("sleep", "60")
	if err := second.Start(); err != nil {
		return fail(err)
	}
	if second.Process.Pid != pid {
		second.Process.Kill()
		second.Wait()
		return pidReuseMissed
	}
	secondStart := startTime(pid)
	select {
	case err := <-stopped:
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
	case <-time.After(30 * time.Second):
		return fail(errors.New("stopProc did not return within 30s"))
	}
	// Alive, and when this process stops it, it dies of that, not of a
	// SIGKILL stopProc sent.
	alive := running(pid, secondStart)
	second.Process.Signal(syscall.SIGTERM)
	var ee *exec.ExitError
	if err := second.Wait(); !alive || errors.As(err, &ee) && ee.Sys().(syscall.WaitStatus).Signal() == syscall.SIGKILL {
		return pidReuseKilled
	}
	return 0
}

// noPidfdEnv runs this test binary as noPidfd, where pidfd_open fails.
const noPidfdEnv = "WEIR_DEMO_TEST_NO_PIDFD"

// TestStopProcWithoutPidfd: where pidfd_open fails (a kernel before 5.3, a
// container whose seccomp filter refuses it, as here a filter of the test's
// own), stopProc still stops the process: SIGTERM, by pid.
func TestStopProcWithoutPidfd(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run", "^$")
	cmd.Env = append(os.Environ(), noPidfdEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
}

// noPidfd refuses pidfd_open to every thread of this process (EPERM, as
// older container runtimes' seccomp profiles do), then has stopProc stop a
// process, which must die of its SIGTERM.
func noPidfd() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	filter := []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}, // seccomp_data.nr
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, K: unix.SYS_PIDFD_OPEN, Jt: 0, Jf: 1},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fail(err)
	}
	if _, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&prog))); errno != 0 {
		return fail(fmt.Errorf("seccomp: %w", errno))
	}
	if fd, err := unix.PidfdOpen(os.Getpid(), 0); !errors.Is(err, unix.EPERM) {
		unix.Close(fd)
		return fail(fmt.Errorf("pidfd_open under the filter: %v; want EPERM", err))
	}
	sleep := exec.Command("sleep", "60")
	if err := sleep.Start(); err != nil {
		return fail(err)
	}
	pid := sleep.Process.Pid
	start := startTime(pid)
	stopped := make(chan error, 1)
	// Exits when stopProc returns.
	go func() { stopped <- stopProc(proc{pid: pid, start: start}) }()
	select {
	case err := <-stopped:
		if err != nil {
			return fail(err)
		}
	case <-time.After(30 * time.Second):
		return fail(errors.New("stopProc did not return within 30s"))
	}
	alive := running(pid, start)
	sleep.Process.Kill()
	err := sleep.Wait()
	var ee *exec.ExitError
	if alive || !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGTERM {
		return fail(fmt.Errorf("stopProc without pidfd_open: the process ran on (%t) and ended with %v; want it stopped by SIGTERM", alive, err))
	}
	return 0
}

// TestDownBadState: a state file that does not parse makes Down fail naming
// the file.
func TestDownBadState(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(statePath(dir), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Down(dir, testPrefix); err == nil || !strings.Contains(err.Error(), statePath(dir)) {
		t.Errorf("Down with a broken state file: got %v; want an error naming %s", err, statePath(dir))
	}
}

// stubbornEnv runs this test binary as stubborn, a process that ignores
// SIGTERM.
const stubbornEnv = "WEIR_DEMO_TEST_STUBBORN"

// stubborn ignores SIGTERM, holds memory enough that the kernel takes a
// while to take its exit through (so a caller that does not wait for it to be
// gone sees it run), says "ready" and sleeps.
func stubborn() int {
	signal.Ignore(syscall.SIGTERM)
	mem, err := unix.Mmap(-1, 0, 256<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE|unix.MAP_POPULATE)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer unix.Munmap(mem)
	fmt.Println("ready")
	time.Sleep(2 * time.Minute) // SIGKILL ends it; its parent's death, should it be left
	return 0
}

// startStubborn starts stubborn with args (after argv[0]; none: -test.run
// ^$) and extra as its fd 3 and on, and waits until it ignores SIGTERM. It
// dies with the test (Pdeathsig, from a thread that lives as long as it
// does). The channel gets what its Wait returns, once it has exited.
func startStubborn(t *testing.T, args []string, extra ...*os.File) (*exec.Cmd, <-chan error) {
	t.Helper()
	return startChild(t, stubbornEnv+"=1", args, extra...)
}

// startChild starts this test binary as the child env (NAME=VALUE) selects,
// as startStubborn says, and waits until it says "ready".
func startChild(t *testing.T, env string, args []string, extra ...*os.File) (*exec.Cmd, <-chan error) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if args == nil {
		args = []string{"-test.run", "^$"}
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), env)
	cmd.ExtraFiles = extra
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	exited, err := start(cmd, syscall.SIGKILL)
	if err != nil {
		t.Fatal(err)
	}
	relay, gone := make(chan error, 1), make(chan struct{})
	// Exits when the process does.
	go func() {
		relay <- <-exited
		close(gone)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-gone
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if line != "ready\n" {
		t.Fatalf("the process (%s) said %q (%v); want ready", env, line, err)
	}
	return cmd, relay
}

// TestStopAgentKillsNamesLog: an agent that does not stop on SIGTERM is
// killed, and the error saying so is one line naming the agent's log.
func TestStopAgentKillsNamesLog(t *testing.T) {
	shortWaits(t)
	dir := t.TempDir()
	r := &run{opts: Options{Dir: dir}}
	r.agent, r.agentErr = startStubborn(t, nil)
	err := r.stopAgent()
	if log := filepath.Join(dir, "agent.log"); err == nil || strings.Contains(err.Error(), "\n") || !strings.HasSuffix(err.Error(), log) {
		t.Errorf("stopAgent of an agent that ignores SIGTERM: got %v; want one line ending in its log's path, %s", err, log)
	}
	if r.agent != nil {
		t.Error("stopAgent left the agent recorded as running")
	}
}

// TestStopAgentBoundedAfterKill: an agent that outlives SIGKILL (frozen here
// by a cgroup v1 freezer, as the kernel keeps one in an uninterruptible call)
// is waited for killWait, not for ever: stopAgent returns one line naming its
// pid and log.
func TestStopAgentBoundedAfterKill(t *testing.T) {
	shortWaits(t)
	was := killWait
	killWait = time.Second
	t.Cleanup(func() { killWait = was })
	dir := t.TempDir()
	r := &run{opts: Options{Dir: dir}}
	r.agent, r.agentErr = startStubborn(t, nil)
	pid := r.agent.Process.Pid
	freezetest.Freeze(t, pid)
	done := make(chan error, 1)
	// Exits when stopAgent returns; before, not while the agent was frozen.
	go func() { done <- r.stopAgent() }()
	select {
	case err := <-done:
		want := fmt.Sprintf("the agent (pid %d) did not exit within %s of SIGKILL; its log is %s", pid, killWait, filepath.Join(dir, "agent.log"))
		if err == nil || strings.Contains(err.Error(), "\n") || !strings.HasSuffix(err.Error(), want) {
			t.Errorf("stopAgent of an agent that outlives SIGKILL: got %v; want one line ending %q", err, want)
		}
	case <-time.After(termWait + killWait + 30*time.Second):
		t.Fatalf("stopAgent of an agent that outlives SIGKILL has not returned after %s", termWait+killWait+30*time.Second)
	}
}

// shortWaits makes stopProc wait one second for SIGTERM to work.
func shortWaits(t *testing.T) {
	was := termWait
	termWait = time.Second
	t.Cleanup(func() { termWait = was })
}

// TestStopProcKills: a process that ignores SIGTERM dies of the SIGKILL
// stopProc sends after it: stopProc succeeds, and returns only once the
// process has exited.
func TestStopProcKills(t *testing.T) {
	shortWaits(t)
	cmd, _ := startStubborn(t, nil)
	pid := cmd.Process.Pid
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	err = stopProc(proc{pid: pid, start: startTime(pid)})
	// Readable once every thread of it has exited.
	n, _ := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0)
	if err != nil || n == 0 {
		t.Errorf("stopProc of a process that ignores SIGTERM: got %v, exited %t; want nil, and the process exited", err, n > 0)
	}
}

// TestDownKillsHold: weir demo down succeeds the first time when the kept
// demo's hold process, which holds the demo's lock, ignores SIGTERM and dies
// of SIGKILL; the lock is free and the directory gone.
func TestDownKillsHold(t *testing.T) {
	shortWaits(t)
	dir := filepath.Join(t.TempDir(), "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	lk, err := lock(dir)
	if err != nil {
		t.Fatal(err)
	}
	hold, _ := startStubborn(t, nil, lk)
	pid := hold.Process.Pid
	err = setHolder(lk, "kept", pid)
	lk.Close()
	if err != nil {
		t.Fatal(err)
	}
	start := startTime(pid)
	if err := writeState(state{Dir: dir, HoldPID: pid, HoldStart: start}); err != nil {
		t.Fatal(err)
	}
	if err := Down(dir, testPrefix); err != nil {
		t.Errorf("Down with a hold process that ignores SIGTERM: %v; want it stopped by SIGKILL, no error", err)
	}
	if running(pid, start) {
		t.Errorf("the hold process %d runs after Down", pid)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after Down: %v; want it removed", dir, err)
	}
	if lk, err := lock(dir); err != nil {
		t.Errorf("the lock after Down: %v; want it free", err)
	} else {
		lk.Close()
	}
}

// startKeptAgent makes a kept demo's directory and starts in it what stands
// for its agent: a process running `run -c DIR/weir.yaml` that ignores
// SIGTERM, which stopProc then kills after a second (shortWaits).
func startKeptAgent(t *testing.T) (dir string, agent *exec.Cmd) {
	t.Helper()
	shortWaits(t)
	dir = filepath.Join(t.TempDir(), "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	agent, _ = startStubborn(t, []string{"run", "-c", configPath(dir)})
	return dir, agent
}

// TestDownOldState: a kept demo whose state file is from before start times
// were recorded (no lock either): Down stops the agent named there, a
// process running `run -c DIR/weir.yaml`, and leaves alone a process that
// has taken the hold process's pid (other arguments).
func TestDownOldState(t *testing.T) {
	dir, agent := startKeptAgent(t)
	agentStart := startTime(agent.Process.Pid)
	other := exec.Command("sleep", "60")
	otherExited, err := start(other, syscall.SIGKILL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Process.Kill(); <-otherExited })
	otherStart := startTime(other.Process.Pid)
	old := fmt.Sprintf(`{"dir": %q, "agent_pid": %d, "hold_pid": %d, "namespaces": []}`, dir, agent.Process.Pid, other.Process.Pid)
	if err := os.WriteFile(statePath(dir), []byte(old), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Down(dir, testPrefix); err != nil {
		t.Errorf("Down with a state file without start times: %v", err)
	}
	if running(agent.Process.Pid, agentStart) {
		t.Errorf("the agent (pid %d, run -c %s) runs after Down; want it stopped", agent.Process.Pid, configPath(dir))
	}
	if !running(other.Process.Pid, otherStart) {
		t.Errorf("the process that took the hold process's pid (sleep 60) stopped; want it left alone")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after Down: %v; want it removed", dir, err)
	}
}

// running reports whether the process pid that started at start runs.
func running(pid int, start string) bool { return proc{pid: pid, start: start}.running() }

// TestKeptNamesDown: a demo refused because a kept demo holds its
// directory's lock names the command that removes that demo; for a demo
// named by WEIR_DEMO_NAME the command, run by a shell, carries the name to
// weir demo down (here env stands in for weir demo down), and for the
// default demo it is weir demo down alone.
func TestKeptNamesDown(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "demo")
	lk, err := lock(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Close()
	if err := setHolder(lk, "kept", 4388); err != nil {
		t.Fatal(err)
	}
	_, err = lock(dir)
	if want := "(weir demo --keep, agent pid 4388); " + downCommand(dir) + " removes it"; !errors.Is(err, ErrBusy) || !strings.HasSuffix(err.Error(), want) {
		t.Fatalf("lock while a kept demo holds it: got %v; want ErrBusy ending %q", err, want)
	}
	if got := downCommand(DefaultDir); got != "weir demo down" {
		t.Errorf("the default demo's command: got %q; want weir demo down", got)
	}
	named, _, err := Place("abc")
	if err != nil {
		t.Fatal(err)
	}
	down, ok := strings.CutSuffix(downCommand(named), "weir demo down")
	if !ok {
		t.Fatalf("%s's command: got %q; want it to end in weir demo down", named, downCommand(named))
	}
	sh := exec.Command("sh", "-c", down+"env")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, NameEnv+"=") {
			sh.Env = append(sh.Env, kv)
		}
	}
	out, err := sh.Output()
	if err != nil || !slices.Contains(strings.Split(string(out), "\n"), NameEnv+"=abc") {
		t.Errorf("%q run by sh: %v; want %s=abc in weir demo down's environment", down+"weir demo down", err, NameEnv)
	}
}

// TestDownLeavesOthersNamespace: Down removes only namespaces named as its
// demo names them, whatever the state file says: one a user made, one named
// as another demo's (here cmd/weir's tests'), and one named as a longer
// prefix's that begins with the demo's, all named in a state file edited by
// hand, are left.
func TestDownLeavesOthersNamespace(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	var nss []*netns.NS
	// The first of the tests' prefix, so that if this test is killed the
	// next removes it; the other with this process's pid, which no other
	// demo removes while it runs.
	// The last is named as a longer prefix's (testPrefix+"x"): its pid,
	// "x" and 4 digits, is no pid.
	for _, name := range []string{topo.UniqueName(testPrefix) + "-user", topo.ProcessPrefix("wdc") + "z-lb", testPrefix + "x" + topo.ProcessPrefix("")[1:] + "z-lb"} {
		ns, err := netns.New(name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ns.Close() })
		nss = append(nss, ns)
	}
	var names []string
	for _, ns := range nss {
		names = append(names, ns.Name())
	}
	if err := writeState(state{Dir: dir, Namespaces: names}); err != nil {
		t.Fatal(err)
	}
	if err := Down(dir, testPrefix); err != nil {
		t.Errorf("Down: %v", err)
	}
	for _, ns := range nss {
		if _, err := os.Stat(ns.Path()); err != nil {
			t.Errorf("the namespace %s after Down: %v; want it left", ns.Name(), err)
		}
	}
}

// TestDownLeavesOthersProcesses: Down stops only processes of its demo,
// whatever the state file says: an agent that runs in none of the demo's
// namespaces, and a hold process that does not hold the demo's lock, both
// named (by pid and start time) in a state file edited by hand, run on.
func TestDownLeavesOthersProcesses(t *testing.T) {
	shortWaits(t)
	dir := filepath.Join(t.TempDir(), "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	var procs []proc
	for range 2 {
		cmd := exec.Command("sleep", "60")
		exited, err := start(cmd, syscall.SIGKILL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); <-exited })
		procs = append(procs, proc{pid: cmd.Process.Pid, start: startTime(cmd.Process.Pid)})
	}
	st := state{Dir: dir, AgentPID: procs[0].pid, AgentStart: procs[0].start, HoldPID: procs[1].pid, HoldStart: procs[1].start}
	if err := writeState(st); err != nil {
		t.Fatal(err)
	}
	if err := Down(dir, testPrefix); err != nil {
		t.Errorf("Down: %v", err)
	}
	for _, p := range procs {
		if !p.running() {
			t.Errorf("the process %d (sleep 60) stopped; want it left alone", p.pid)
		}
	}
}

// splitNSEnv runs this test binary as splitNS, its main thread in a network
// namespace of its own and another thread in the one at the path it names.
const splitNSEnv = "WEIR_DEMO_TEST_SPLIT_NS"

func init() {
	if os.Getenv(splitNSEnv) != "" {
		runtime.LockOSThread() // the main goroutine keeps the main thread
	}
}

// splitNS is as the agent is once its self-test has run on the main thread:
// that thread in a scratch namespace (/proc/PID/ns/net shows it), the others
// in the namespace at path. It says "ready" and sleeps.
func splitNS(path string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return fail(err)
	}
	entered := make(chan error, 1)
	// Exits with the process: its thread stays in the namespace.
	go func() {
		runtime.LockOSThread()
		f, err := os.Open(path)
		if err == nil {
			err = unix.Setns(int(f.Fd()), unix.CLONE_NEWNET)
		}
		entered <- err
		select {}
	}()
	if err := <-entered; err != nil {
		return fail(err)
	}
	fmt.Println("ready")
	time.Sleep(2 * time.Minute) // SIGTERM ends it; its parent's death, should it be left
	return 0
}

// TestDownStopsAgentOffMainThread: Down stops an agent whose main thread is
// in another namespace than the demo's (its self-test's, which the runtime
// kept) while its other threads are in the demo's: it is the demo's agent.
func TestDownStopsAgentOffMainThread(t *testing.T) {
	shortWaits(t)
	dir := filepath.Join(t.TempDir(), "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	ns, err := netns.New(topo.UniqueName(testPrefix) + "-lb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	cmd, _ := startChild(t, splitNSEnv+"="+ns.Path(), nil)
	pid := cmd.Process.Pid
	main, _ := os.Stat(filepath.Join("/proc", strconv.Itoa(pid), "ns", "net"))
	if fi, _ := os.Stat(ns.Path()); main == nil || fi == nil || os.SameFile(main, fi) {
		t.Fatalf("the process's main thread is in %s; want it elsewhere", ns.Name())
	}
	started := startTime(pid)
	if err := writeState(state{Dir: dir, AgentPID: pid, AgentStart: started, Namespaces: []string{ns.Name()}}); err != nil {
		t.Fatal(err)
	}
	if err := Down(dir, testPrefix); err != nil {
		t.Errorf("Down: %v", err)
	}
	if running(pid, started) {
		t.Errorf("the agent (pid %d), its main thread in another namespace, runs after Down; want it stopped", pid)
	}
}

// TestDownStopsAgentOfRemovedNamespaces: Down stops the kept demo's agent
// (named by pid and start time, running `run -c DIR/weir.yaml`) also when
// its namespaces have been removed from under it (`ip netns delete`, or
// another program's cleanup of the prefix): no thread of it is then in a
// namespace the state names, but its arguments name the demo's config.
func TestDownStopsAgentOfRemovedNamespaces(t *testing.T) {
	dir, agent := startKeptAgent(t)
	pid := agent.Process.Pid
	started := startTime(pid)
	gone := topo.ProcessPrefix(testPrefix) + "zz-lb" // no such namespace
	if err := writeState(state{Dir: dir, AgentPID: pid, AgentStart: started, Namespaces: []string{gone}}); err != nil {
		t.Fatal(err)
	}
	if err := Down(dir, testPrefix); err != nil {
		t.Errorf("Down: %v", err)
	}
	if running(pid, started) {
		t.Errorf("the agent (pid %d, run -c %s), its namespace %s removed, runs after Down; want it stopped", pid, configPath(dir), gone)
	}
}

// TestDownOpensNothing: Down removes what is at a name of the demo's under
// /run/netns without opening it: a FIFO there (here one a hand-edited state
// file names, as the demo would its namespace) is removed, and does not
// block Down until a writer comes.
func TestDownOpensNothing(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// This process's pid: no other demo removes it while it runs.
	name := topo.ProcessPrefix(testPrefix) + "zy-lb"
	if err := os.MkdirAll(netns.RunDir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(netns.RunDir, name)
	if err := unix.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(path) })
	if err := writeState(state{Dir: dir, Namespaces: []string{name}}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	// Exits when Down returns; should it block opening the FIFO, the
	// cleanup below opens it for writing, which lets it go on.
	go func() { done <- Down(dir, testPrefix) }()
	t.Cleanup(func() {
		select {
		case <-done:
		default:
			if fd, err := unix.Open(path, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0); err == nil {
				unix.Close(fd)
			}
			<-done
		}
	})
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Down: %v", err)
		}
		done <- err // for the cleanup
	case <-time.After(30 * time.Second):
		t.Fatalf("Down with a FIFO at %s: still running after 30s; want it to return", path)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the FIFO %s after Down: %v; want it removed", path, err)
	}
}

// TestDownLeavesAgentOfSymlink: a name of the demo's under /run/netns that
// is a symlink (here to the network namespace of a process a hand-edited
// state file names as the agent) is no namespace of the demo's: Down removes
// the link and leaves the process, which runs in what it points to, alone.
func TestDownLeavesAgentOfSymlink(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	exited, err := start(cmd, syscall.SIGKILL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
	p := proc{pid: cmd.Process.Pid, start: startTime(cmd.Process.Pid)}
	// This process's pid: no other demo removes it while it runs.
	if err := os.MkdirAll(netns.RunDir, 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(netns.RunDir, topo.ProcessPrefix(testPrefix)+"zx-lb")
	if err := os.Symlink(fmt.Sprintf("/proc/%d/ns/net", p.pid), link); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(link) })
	if err := writeState(state{Dir: dir, AgentPID: p.pid, AgentStart: p.start, Namespaces: []string{filepath.Base(link)}}); err != nil {
		t.Fatal(err)
	}
	if err := Down(dir, testPrefix); err != nil {
		t.Errorf("Down: %v", err)
	}
	if !p.running() {
		t.Errorf("the process %d (sleep 60), in the namespace the symlink %s points to, stopped; want it left alone", p.pid, link)
	}
	if _, err := os.Lstat(link); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the symlink %s after Down: %v; want it removed", link, err)
	}
}

// TestPlaceRefusesReserved: a demo name that is a prefix weir's own tests,
// benchmarks or demos use, or begins one (wfc, of wfc0), is refused with one
// line naming the variable: those runs remove their prefix's namespaces whose
// run has exited, which would take a kept demo of that name with them.
func TestPlaceRefusesReserved(t *testing.T) {
	names := []string{NamePrefix, testPrefix, topo.FleetPrefix, "wfc"}
	for _, p := range topo.ReservedPrefixes {
		if len(p) == 3 {
			names = append(names, p)
		}
	}
	for _, name := range names {
		dir, _, err := Place(name)
		if err == nil {
			t.Errorf("Place(%q) = %q; want it refused", name, dir)
			continue
		}
		if want := NameEnv + "=" + name + " is reserved"; !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("Place(%q): %q; want one line saying %q", name, err, want)
		}
	}
	if _, _, err := Place("wfd"); err != nil {
		t.Errorf("Place(wfd): %v; want it accepted", err)
	}
}

// TestHoldEntersOnlyDemoNamespaces: the backends' process enters only its
// demo's namespaces, whatever the state file names: a namespace named
// otherwise, and at a name of the demo's a symlink to a namespace, a FIFO
// (whose open would block) and a plain file, are each refused at once with
// an error saying why; so is a prefix no demo has, here "w", whose names a
// test topology's namespace (topo.New's default) has.
func TestHoldEntersOnlyDemoNamespaces(t *testing.T) {
	other, err := netns.New(topo.UniqueName(testPrefix) + "-user")
	xdptest.Check(t, err)
	t.Cleanup(func() { other.Close() })
	testTopo, err := netns.New(topo.UniqueName("w") + "-be0")
	xdptest.Check(t, err)
	t.Cleanup(func() { testTopo.Close() })
	at := func(make func(path string) error) string {
		name := topo.UniqueName(testPrefix) + "-be0"
		path := filepath.Join(netns.RunDir, name)
		if err := make(path); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(path) })
		return name
	}
	for _, c := range []struct{ what, ns, prefix, want string }{
		{"another's namespace", other.Name(), testPrefix, "is not this demo's"},
		{"a symlink", at(func(p string) error { return os.Symlink(other.Path(), p) }), testPrefix, "is a symlink, not a network namespace"},
		{"a FIFO", at(func(p string) error { return unix.Mkfifo(p, 0o600) }), testPrefix, "is not a namespace file (nsfs)"},
		{"a file", at(func(p string) error { return os.WriteFile(p, nil, 0o600) }), testPrefix, "is not a namespace file (nsfs)"},
		{"the prefix w", testTopo.Name(), "w", `the prefix must be 3 letters a-z, as a demo's namespaces' is, got "w"`},
	} {
		t.Run(c.what, func(t *testing.T) {
			dir := t.TempDir()
			st := state{Dir: dir, Backends: []backend{{Name: "be0", NS: c.ns, IP4: netip.MustParseAddr("10.77.1.10"), IP6: netip.MustParseAddr("fd77:1::10")}},
				VIPs: []netip.Addr{netip.MustParseAddr("10.77.100.1")}}
			if err := writeState(st); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			done := make(chan error, 1)
			// Exits when Hold returns: at once, or when ctx ends.
			go func() { done <- Hold(ctx, statePath(dir), c.prefix) }()
			select {
			case err := <-done:
				named := c.ns
				if c.prefix != testPrefix {
					named = strconv.Quote(c.prefix)
				}
				if err == nil || !strings.Contains(err.Error(), named) || !strings.Contains(err.Error(), c.want) {
					t.Errorf("Hold with %s (%s): got %v; want an error naming %s that says %q", c.what, c.ns, err, named, c.want)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("Hold with %s (%s) has not returned after 30s", c.what, c.ns)
			}
		})
	}
}
