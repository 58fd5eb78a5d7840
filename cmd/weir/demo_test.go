package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/demo"
	"github.com/weir-lb/weir/internal/heavy"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestDemoStopsQuietly: weir demo and weir demo fleet, stopped while they serve
// (SIGINT to their process group, as a terminal's ^C sends it; SIGTERM to the
// process, as kill sends it), exit 0 with nothing on stderr and one line on
// stdout saying they stopped, report no failed step, and leave none of their
// namespaces, processes or files. A second SIGINT while weir demo cleans up
// cuts it short: exit status 130 and one line on stderr. The demos run the
// agent as their own executable (`weir run`), so they run as the built weir
// binary, not this test's.
func TestDemoStopsQuietly(t *testing.T) {
	heavy.Demo(t)
	bin := buildWeir(t)
	for _, c := range []struct {
		name    string
		args    []string
		serving string // in stdout once traffic flows through the agents
		sig     syscall.Signal
		group   bool // to the process group, as ^C
		heavy   bool // a fleet of agents: alone, as the fleet's own tests
		twice   bool // and again to the process while it cleans up
	}{
		{"demo/SIGINT", []string{"demo"}, "HTTP requests to web (", syscall.SIGINT, true, false, false},
		{"demo/SIGTERM", []string{"demo"}, "HTTP requests to web (", syscall.SIGTERM, false, false, false},
		{"demo/SIGINT twice", []string{"demo"}, "HTTP requests to web (", syscall.SIGINT, true, false, true},
		{"fleet/SIGINT", []string{"demo", "fleet", "--streams", "10"}, "TCP streams from", syscall.SIGINT, true, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.heavy {
				heavy.Alone(t)
			}
			stopDemo(t, bin, c.args, c.serving, c.sig, c.group, c.twice)
		})
	}
}

// TestDemoBesideUsersDemo: the tests' demos keep to a directory, a lock and
// namespaces of their own: one runs, stops and removes what it made while a
// user's demo holds /run/weir-demo.lock (here the test holds it, as a kept
// demo's hold process would; if a user's demo is up, that one does).
func TestDemoBesideUsersDemo(t *testing.T) {
	heavy.Demo(t)
	bin := buildWeir(t)
	f, err := os.OpenFile(demo.DefaultDir+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil && !errors.Is(err, unix.EWOULDBLOCK) {
		t.Fatal(err)
	}
	d := startDemo(t, bin, []string{"demo"}, "HTTP requests to web (")
	if !strings.HasPrefix(d.topology, testPrefix) {
		t.Errorf("the test's demo named its namespaces %s...; want %s...", d.topology, testPrefix)
	}
	d.stop(t, syscall.SIGINT, true, false)
}

// TestDemoOneAtATime: weir demo while another runs refuses at once, exit
// status 1 and one line on stderr naming the running demo's pid, and touches
// nothing of it; so does weir demo down. The first demo's namespaces and
// processes stay, and it ends as usual.
func TestDemoOneAtATime(t *testing.T) {
	heavy.Demo(t)
	bin := buildWeir(t)
	first := startDemo(t, bin, []string{"demo"}, "HTTP requests to web (")
	want := fmt.Sprintf("another weir demo runs (pid %d)", first.cmd.Process.Pid)
	for _, args := range [][]string{{"demo"}, {"demo", "down"}} {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		var stdout, stderr bytes.Buffer
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Env = demoEnv()
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		start := time.Now()
		err := cmd.Run()
		took := time.Since(start)
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Errorf("weir %s while a demo runs: %v after %s; want exit status 1", strings.Join(args, " "), err, took)
		}
		if took > 10*time.Second {
			t.Errorf("weir %s while a demo runs took %s; want it refused at once", strings.Join(args, " "), took)
		}
		if e := strings.TrimSpace(stderr.String()); strings.Count(e, "\n") > 0 || !strings.Contains(e, want) {
			t.Errorf("weir %s: stderr %q; want one line saying %q", strings.Join(args, " "), e, want)
		}
		if stdout.Len() != 0 {
			t.Errorf("weir %s: stdout %q; want nothing", strings.Join(args, " "), stdout.String())
		}
	}
	if now, _ := netns.List(first.topology + "-"); !slices.Equal(now, first.nss) {
		t.Errorf("the running demo's namespaces: got %v; want %v, untouched", now, first.nss)
	}
	for _, p := range first.procs {
		if !p.running() {
			t.Errorf("the running demo's process %d stopped; want it untouched", p.pid)
		}
	}
	first.stop(t, syscall.SIGINT, true, false)
}

// TestDemoAfterKill: weir demo killed (SIGKILL: no cleanup) leaves its agent
// and namespaces; the next weir demo stops and removes them, runs, and ends as
// usual.
func TestDemoAfterKill(t *testing.T) {
	heavy.Demo(t)
	bin := buildWeir(t)
	killed := startDemo(t, bin, []string{"demo"}, "HTTP requests to web (")
	t.Cleanup(func() { removeLeft(t, killed.topology, killed.procs) })
	if err := killed.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-killed.exited:
		killed.done = true
	case <-time.After(time.Minute):
		t.Fatal("weir demo still runs a minute after SIGKILL")
	}
	next := startDemo(t, bin, []string{"demo"}, "HTTP requests to web (")
	for _, p := range killed.procs {
		if p.running() {
			t.Errorf("the killed demo's process %d (%s) still runs while the next serves", p.pid, p.cmdline())
		}
	}
	if left, _ := netns.List(killed.topology + "-"); len(left) != 0 {
		t.Errorf("the killed demo's namespaces %v are left while the next serves", left)
	}
	next.stop(t, syscall.SIGINT, true, false)
}

// TestDemoSignalAfterCleanup: a second SIGINT that comes once weir demo has
// removed everything it made, before it exits, cuts nothing short: the demo
// says it stopped and exits 0, nothing on stderr. The test holds the demo
// there by keeping the pipe of its stdout full, so that its last line waits:
// the pipe is in packet mode (O_DIRECT), one write a slot, and while the demo
// still holds its lock a write that waits gets exactly one slot, so no later
// line can slip through with it. The second SIGINT goes once the demo waits
// to write with its lock let go: that write is its last line, sent after it
// stopped watching for a second signal.
func TestDemoSignalAfterCleanup(t *testing.T) {
	heavy.Demo(t)
	bin := buildWeir(t)
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_DIRECT); err != nil {
		t.Fatal(err)
	}
	// The read end polled, so reads can time out; the write end, the demo's
	// stdout, blocking, so its writes wait instead of failing.
	if err := unix.SetNonblock(fds[0], true); err != nil {
		t.Fatal(err)
	}
	r, w := os.NewFile(uintptr(fds[0]), "stdout-r"), os.NewFile(uintptr(fds[1]), "stdout-w")
	t.Cleanup(func() { r.Close(); w.Close() })
	stderr := newOutput(t, filepath.Join(t.TempDir(), "stderr"))
	d := launchDemo(t, bin, []string{"demo"}, w, stderr)
	cmd, exited := d.cmd, d.exited
	// Before the demo is stopped, should the test give up: its writes fail
	// from now on (weir ignores SIGPIPE) instead of waiting.
	t.Cleanup(func() { r.Close() })
	var out bytes.Buffer
	buf := make([]byte, 4096) // a packet's most; a shorter read drops its rest
	// read reads one packet, waiting up to d: its length, and whether the
	// pipe is at its end.
	read := func(d time.Duration) (int, bool) {
		r.SetReadDeadline(time.Now().Add(d))
		n, err := r.Read(buf)
		out.Write(buf[:n])
		return n, errors.Is(err, io.EOF)
	}
	// drain reads what the demo wrote for up to d, and reports EOF.
	drain := func(d time.Duration) bool {
		deadline := time.Now().Add(d)
		for time.Now().Before(deadline) {
			if _, eof := read(time.Until(deadline)); eof {
				return true
			}
		}
		return false
	}
	// fill writes to the pipe until every slot is taken: the demo's next
	// write waits. Its own open file description of the pipe, non-blocking:
	// the demo's stays blocking, so its write waits instead of failing.
	wfd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", w.Fd()), unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	wfdOpen := true
	t.Cleanup(func() {
		if wfdOpen {
			unix.Close(wfd)
		}
	})
	pad := bytes.Repeat([]byte{'.'}, 4096) // a whole page: nothing joins it
	fill := func() {
		for {
			if _, err := unix.Write(wfd, pad); err != nil {
				return // EAGAIN: full
			}
		}
	}
	name := regexp.MustCompile(`\((w[a-z]+[0-9a-z]+)\.\.\.\)`)
	var topology string
	if !waitfor.Cond(3*time.Minute, func() bool {
		drain(50 * time.Millisecond)
		if m := name.FindStringSubmatch(out.String()); m != nil {
			topology = m[1]
		}
		return topology != "" && strings.Contains(out.String(), "HTTP requests to web (")
	}) {
		t.Fatalf("weir demo did not serve within 3 minutes; stdout:\n%s\nstderr:\n%s", out.String(), stderr.String())
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	fill()
	queued := func() int {
		n, err := unix.IoctlGetInt(fds[0], unix.TIOCINQ) // FIONREAD: the bytes in the pipe
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if !waitfor.Cond(2*time.Minute, func() bool {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("weir demo exited (%v) before the test could signal it after its cleanup", err)
		default:
		}
		if !writing(t, cmd.Process.Pid) {
			return false
		}
		// It waits to write; past its cleanup once its lock is free (it
		// cannot let go while it waits).
		if demoLockFree(t) {
			return true
		}
		// A line from before its cleanup's end: one slot for it, taken
		// before the next look (a write woken but not yet run would
		// otherwise still look waiting, and get a second slot).
		was := queued()
		n, _ := read(time.Second)
		if !waitfor.Cond(time.Minute, func() bool { return queued() > was-n }) {
			t.Fatal("weir demo's waiting write took no slot within a minute")
		}
		return false
	}) {
		t.Fatal("weir demo still holds its lock 2 minutes after SIGINT")
	}
	if left, _ := netns.List(topology + "-"); len(left) != 0 {
		t.Errorf("namespaces left once the demo let go of its lock: %v", left)
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	// Its last line through, the demo exits.
	w.Close()
	unix.Close(wfd)
	wfdOpen = false
	if !waitfor.Cond(time.Minute, func() bool { return drain(50 * time.Millisecond) }) {
		t.Fatal("weir demo's stdout still open a minute after the second SIGINT")
	}
	select {
	case err := <-exited:
		d.done = true
		if err != nil {
			t.Errorf("weir demo after a SIGINT once its cleanup was done: %v; want exit status 0", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("weir demo still runs a minute after its stdout closed")
	}
	if e := stderr.String(); e != "" {
		t.Errorf("stderr: got %q; want nothing", e)
	}
	o := strings.TrimSpace(out.String())
	if last := o[max(strings.LastIndex(o, "\n")+1, len(o)-200):]; !strings.HasPrefix(last, "demo stopped (") {
		t.Errorf("stdout ends %q; want the line saying the demo stopped", last)
	}
}

// writing reports whether a thread of process pid waits in write(2) to its
// stdout.
func writing(t *testing.T, pid int) bool {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/syscall", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range tasks {
		b, _ := os.ReadFile(f)
		// "NR arg0 ...", NR in decimal, the arguments in hex.
		if f := strings.Fields(string(b)); len(f) > 1 && f[0] == strconv.Itoa(unix.SYS_WRITE) && f[1] == "0x1" {
			return true
		}
	}
	return false
}

// demoLockFree reports whether no demo holds the lock of weir demo's directory
// (it takes and releases it).
func demoLockFree(t *testing.T) bool {
	f, err := os.Open(testDemoDir + ".lock")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil
}

// The tests' weir demo keeps to a directory (and its lock, testDemoDir.lock)
// and a namespace prefix of its own, WEIR_DEMO_NAME=testPrefix, so it leaves
// a user's demo alone. The
// cmd/weir tests of every checkout share them, one test at a time
// (heavy.Demo): a test binary killed midway leaves, as a killed weir demo
// does, what the next of these tests' demos removes.
const (
	testDemoDir = "/run/weir-demo-wdc"
	testPrefix  = "wdc"
)

// demoEnv is the environment of the tests' weir demo.
func demoEnv() []string {
	return append(os.Environ(), demo.NameEnv+"="+testPrefix)
}

// demoProc is a process the demo started: its PID and start time (a PID may be
// reused), and the directory of the config it runs on.
type demoProc struct {
	pid     int
	started string
	dir     string
}

// buildWeir builds the weir binary: the demos run the agent as their own
// executable (`weir run`), so they run as the built binary, not a test's.
func buildWeir(t *testing.T) string {
	t.Helper()
	// Its demos may take testPrefix, reserved in weir itself.
	return goBuild(t, "-X github.com/weir-lb/weir/internal/demo.testName="+testPrefix)
}

// goBuild builds the weir binary with ldflags.
func goBuild(t *testing.T, ldflags string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "weir")
	if out, err := exec.Command("go", "build", "-ldflags", ldflags, "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v: %s", err, out)
	}
	return bin
}

// stopDemo runs weir args, waits until its stdout shows serving, sends sig and
// checks how the demo ends and what it leaves. With twice it sends sig again,
// to the process, until it exits: the second cuts the cleanup short, and the
// test removes what the demo leaves.
func stopDemo(t *testing.T, bin string, args []string, serving string, sig syscall.Signal, group, twice bool) {
	startDemo(t, bin, args, serving).stop(t, sig, group, twice)
}

// runningDemo is a demo the test started, serving: its namespaces and the
// processes in them.
type runningDemo struct {
	cmd            *exec.Cmd
	args           []string
	stdout, stderr output
	exited         chan error
	done           bool // it exited and the test saw it
	topology       string
	nss            []string
	procs          []demoProc
}

// startDemo runs weir args and waits until its stdout shows serving. If the
// test ends with the demo running, SIGTERM stops it (it removes what it made).
func startDemo(t *testing.T, bin string, args []string, serving string) *runningDemo {
	// Files, read while it runs.
	dir := t.TempDir()
	stdout := newOutput(t, filepath.Join(dir, "stdout"))
	d := launchDemo(t, bin, args, stdout.File, newOutput(t, filepath.Join(dir, "stderr")))
	d.stdout = stdout
	name := regexp.MustCompile(`\((w[a-z]+[0-9a-z]+)\.\.\.\)`)
	if !waitfor.Cond(3*time.Minute, func() bool {
		select {
		case err := <-d.exited:
			d.exited <- err
			d.done = true
			t.Fatalf("weir %s exited (%v) before it served; stdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, d.stdout.String(), d.stderr.String())
		default:
		}
		out := d.stdout.String()
		if m := name.FindStringSubmatch(out); m != nil {
			d.topology = m[1]
		}
		return d.topology != "" && strings.Contains(out, serving)
	}) {
		t.Fatalf("weir %s did not serve within 3 minutes; stdout:\n%s\nstderr:\n%s", strings.Join(args, " "), d.stdout.String(), d.stderr.String())
	}
	nss, err := netns.List(d.topology + "-")
	if err != nil || len(nss) == 0 {
		t.Fatalf("namespaces of %s: %v, %v; want some while the demo serves", d.topology, nss, err)
	}
	d.nss = nss
	d.procs = procsIn(t, nss)
	if len(d.procs) == 0 {
		t.Fatalf("no process in %v; want the demo's agents there", nss)
	}
	return d
}

// launchDemo starts weir args, its own process group, writing to stdout and
// stderr. If the test ends with it running, SIGTERM stops it (it removes what
// it made).
func launchDemo(t *testing.T, bin string, args []string, stdout *os.File, stderr output) *runningDemo {
	d := &runningDemo{args: args, exited: make(chan error, 1), stderr: stderr}
	cmd := exec.Command(bin, args...)
	cmd.Env = demoEnv()
	cmd.Stdout, cmd.Stderr = stdout, stderr.File
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d.cmd = cmd
	// Exits when the demo does; the cleanup stops it if the test gives up.
	go func() { d.exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if d.done {
			return
		}
		cmd.Process.Signal(syscall.SIGTERM) // it removes what it made
		select {
		case <-d.exited:
		case <-time.After(2 * time.Minute):
			cmd.Process.Kill()
			<-d.exited
		}
	})
	return d
}

// stop sends sig to the demo (to its process group with group) and checks how
// it ends and what it leaves. With twice it sends sig again, to the process,
// until it exits: the second cuts the cleanup short, and the test removes what
// the demo leaves.
func (d *runningDemo) stop(t *testing.T, sig syscall.Signal, group, twice bool) {
	args := d.args
	target := d.cmd.Process.Pid
	if group {
		target = -target
	}
	if err := syscall.Kill(target, sig); err != nil {
		t.Fatal(err)
	}
	if twice {
		cutShort(t, d.cmd.Process.Pid, sig, d.exited, d.stderr, d.topology, d.procs)
		d.done = true
		return
	}
	select {
	case err := <-d.exited:
		d.done = true
		if err != nil {
			t.Errorf("weir %s after %s: %v; want exit status 0", strings.Join(args, " "), sig, err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("weir %s still runs 2 minutes after %s; stdout:\n%s", strings.Join(args, " "), sig, d.stdout.String())
	}
	out := strings.TrimSpace(d.stdout.String())
	if e := d.stderr.String(); e != "" {
		t.Errorf("stderr: got %q; want nothing", e)
	}
	last := out[strings.LastIndex(out, "\n")+1:]
	if !strings.HasPrefix(last, "demo stopped (") || strings.Contains(out, "FAIL") {
		t.Errorf("stdout ends %q (FAIL in it: %t); want one line saying the demo stopped, and no failure", last, strings.Contains(out, "FAIL"))
	}
	if left, _ := netns.List(d.topology + "-"); len(left) != 0 {
		t.Errorf("namespaces left: %v", left)
	}
	for _, p := range d.procs {
		if p.running() {
			t.Errorf("process %d (%s) still runs", p.pid, p.cmdline())
		}
		if _, err := os.Stat(p.dir); p.dir != "" && err == nil {
			t.Errorf("%s left", p.dir)
		}
	}
}

// cutShort sends sig to the demo pid every few milliseconds until it exits
// (signals sent at once may merge into one), then checks that it exited at
// once, status 130, with one line on stderr, and removes what it left: the
// namespaces of topology and the processes of procs.
func cutShort(t *testing.T, pid int, sig syscall.Signal, exited <-chan error, stderr output, topology string, procs []demoProc) {
	t.Cleanup(func() { removeLeft(t, topology, procs) })
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(time.Minute)
	for {
		select {
		case err := <-exited:
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 130 {
				t.Errorf("weir demo after a second %s: %v; want exit status 130", sig, err)
			}
			e := strings.TrimSpace(stderr.String())
			if strings.Contains(e, "\n") || !strings.Contains(e, "cleanup cut short") || !strings.Contains(e, testPrefix+"*") {
				t.Errorf("stderr: got %q; want one line saying the cleanup was cut short and what may be left", e)
			}
			return
		case <-tick.C:
			syscall.Kill(pid, sig)
		case <-deadline:
			t.Fatalf("weir demo still runs a minute after a second %s", sig)
		}
	}
}

// removeLeft kills the processes of procs still running and removes their
// config directories and the namespaces of topology: what a demo whose
// cleanup was cut short, or that was killed, leaves.
func removeLeft(t *testing.T, topology string, procs []demoProc) {
	for _, p := range procs {
		if p.running() {
			syscall.Kill(p.pid, syscall.SIGKILL)
		}
		if p.dir != "" {
			os.RemoveAll(p.dir)
		}
	}
	left, _ := netns.List(topology + "-")
	for _, ns := range left {
		if err := netns.RemoveMounted(ns); err != nil {
			t.Errorf("remove %s: %v", ns, err)
		}
	}
}

// running reports whether the process still runs: it is not another that got
// its pid, and not a zombie (one whose parent died waits for init to reap it).
func (p demoProc) running() bool {
	st, err := os.ReadFile("/proc/" + strconv.Itoa(p.pid) + "/stat")
	if err != nil || startTime(st) != p.started {
		return false
	}
	f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:]))
	return len(f) > 0 && f[0] != "Z"
}

func (p demoProc) cmdline() []byte {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(p.pid) + "/cmdline")
	return bytes.ReplaceAll(b, []byte{0}, []byte{' '})
}

// output is a file the demo writes to and the test reads while it runs.
type output struct{ *os.File }

func newOutput(t *testing.T, path string) output {
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return output{f}
}

// String is what was written so far.
func (o output) String() string {
	b, _ := os.ReadFile(o.Name())
	return string(b)
}

// procsIn lists the processes with a thread in one of the network namespaces
// nss. Any thread: the agent's self-test enters a scratch namespace on a
// thread it throws away, and when that is the main thread the runtime keeps
// it there, so /proc/PID/ns/net (the main thread's) may not be the agent's
// namespace.
func procsIn(t *testing.T, nss []string) []demoProc {
	t.Helper()
	inodes := map[uint64]bool{}
	for _, ns := range nss {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(netns.RunDir, ns), &st); err != nil {
			t.Fatal(err)
		}
		inodes[st.Ino] = true
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []demoProc
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		tasks, _ := filepath.Glob(filepath.Join("/proc", e.Name(), "task", "*", "ns", "net"))
		if !slices.ContainsFunc(tasks, func(path string) bool {
			var st syscall.Stat_t
			return syscall.Stat(path, &st) == nil && inodes[st.Ino]
		}) {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		p := demoProc{pid: pid, started: startTime(stat)}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		argv := strings.Split(string(cmdline), "\x00")
		for i, a := range argv {
			if a == "-c" && i+1 < len(argv) {
				p.dir = filepath.Dir(argv[i+1])
			}
		}
		out = append(out, p)
	}
	return out
}

// startTime is field 22 of /proc/PID/stat, when the process started.
func startTime(stat []byte) string {
	// The command name, field 2, is in parentheses and may hold spaces.
	s := string(stat)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 20 {
		return ""
	}
	return f[19]
}

// TestDemoName: WEIR_DEMO_NAME moves weir demo, and weir demo down, beside
// the default demo: to /run/weir-demo-NAME and namespaces named NAME...;
// unset, they keep to /run/weir-demo and wdm. A name that is not 3 letters
// a-z, or is a path, or is a prefix weir's own tests and demos use (wdm, wfl,
// the tests' wdt and wdc...: their namespaces, or a kept named demo's, would
// be removed as a dead run's) is refused with one line on stderr and exit
// status 1; the tests' own weir takes testPrefix.
func TestDemoName(t *testing.T) {
	for _, c := range []struct{ name, wantDir, wantPrefix string }{
		{"", demo.DefaultDir, demo.NamePrefix},
		{"abc", demo.DefaultDir + "-abc", "abc"},
	} {
		t.Setenv(demo.NameEnv, c.name)
		if dir, prefix, err := demoPlace(); err != nil || dir != c.wantDir || prefix != c.wantPrefix {
			t.Errorf("%s=%q: got %q, %q, %v; want %q, %q", demo.NameEnv, c.name, dir, prefix, err, c.wantDir, c.wantPrefix)
		}
	}
	bad := []string{"ab", "abcd", "Abc", "ab1", "../", "a/b", "/tmp/x", " ab"}
	reserved := []string{demo.NamePrefix, "wfl", testPrefix, "wdt", "wta"}
	for _, name := range append(bad, reserved...) {
		// Before a bad name reaches weir demo, which as root would run.
		t.Setenv(demo.NameEnv, name)
		if dir, _, err := demoPlace(); err == nil {
			t.Fatalf("%s=%q: got %q; want it refused", demo.NameEnv, name, dir)
		}
	}
	// weir as shipped: the tests' weir takes testPrefix.
	bin := goBuild(t, "")
	for _, name := range append(bad, reserved...) {
		for _, args := range [][]string{{"demo"}, {"demo", "down"}} {
			t.Run(fmt.Sprintf("%q/%s", name, strings.Join(args, " ")), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				var stdout, stderr bytes.Buffer
				cmd := exec.CommandContext(ctx, bin, args...)
				cmd.Env = append(os.Environ(), demo.NameEnv+"="+name)
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				err := cmd.Run()
				var ee *exec.ExitError
				if !errors.As(err, &ee) || ee.ExitCode() != 1 {
					t.Errorf("got %v; want exit status 1", err)
				}
				want := demo.NameEnv + " must be 3 letters a-z, got " + strconv.Quote(name)
				if slices.Contains(reserved, name) {
					want = demo.NameEnv + "=" + name + " is reserved"
				}
				if e := strings.TrimSuffix(stderr.String(), "\n"); strings.Contains(e, "\n") || !strings.Contains(e, want) {
					t.Errorf("stderr %q; want one line saying %q", stderr.String(), want)
				}
				if stdout.Len() != 0 {
					t.Errorf("stdout %q; want nothing", stdout.String())
				}
			})
		}
	}
}

// TestDemoHoldRefusesPrefix: weir demo hold, run by a kept demo with its
// namespace prefix, refuses a PREFIX no demo of this weir can have (one of
// the prefixes weir's own tests and demos use, as WEIR_DEMO_NAME refuses
// them) with an error naming the argument, before it reads the state file;
// a demo's own prefix (wdm, or a name WEIR_DEMO_NAME takes) gets past that
// check to the state file.
func TestDemoHoldRefusesPrefix(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state.json") // none: the prefix is checked first
	for _, c := range []struct{ prefix, want string }{
		{"wfl", `PREFIX "wfl" is no demo's`},
		{"wta", `PREFIX "wta" is no demo's`},
		{testPrefix, `PREFIX "` + testPrefix + `" is no demo's`},
		{"w", `PREFIX "w" is no demo's`},
		{demo.NamePrefix, state},
		{"abc", state},
	} {
		t.Run(c.prefix, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), []string{"demo", "hold", state, c.prefix}, &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("weir demo hold STATE %s: got %v; want an error saying %q", c.prefix, err, c.want)
			}
		})
	}
}
