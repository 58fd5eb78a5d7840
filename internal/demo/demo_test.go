package demo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/heavy"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/agent"
)

// The demo runs the agent and the kept backends as processes: this test binary,
// re-executed with one of these set, is them.
const (
	agentEnv = "WEIR_DEMO_TEST_AGENT"
	holdEnv  = "WEIR_DEMO_TEST_HOLD"
	// The hold process's namespace prefix, with holdEnv.
	holdPrefixEnv = "WEIR_DEMO_TEST_HOLD_PREFIX"
)

func TestMain(m *testing.M) {
	if cfg := os.Getenv(agentEnv); cfg != "" {
		os.Exit(child(func(ctx context.Context) error { return agent.New(agent.Options{ConfigPath: cfg}).Run(ctx) }))
	}
	if os.Getenv(pidReuseEnv) != "" {
		os.Exit(pidReuse())
	}
	if os.Getenv(noPidfdEnv) != "" {
		os.Exit(noPidfd())
	}
	if os.Getenv(stubbornEnv) != "" {
		os.Exit(stubborn())
	}
	if path := os.Getenv(splitNSEnv); path != "" {
		os.Exit(splitNS(path))
	}
	if st := os.Getenv(holdEnv); st != "" {
		os.Exit(child(func(ctx context.Context) error { return Hold(ctx, st, os.Getenv(holdPrefixEnv)) }))
	}
	// After the agent's and the hold process's: theirs inherit it.
	if dir := os.Getenv(keepRunEnv); dir != "" {
		os.Exit(keepRun(dir))
	}
	os.Exit(m.Run())
}

func child(run func(context.Context) error) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := run(ctx); err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
		return 1
	}
	return 0
}

// testPrefix prefixes the namespaces of the demos these tests run: weir
// demo's own, with NamePrefix, removes those of a demo whose process has
// ended, and these tests' demos run beside cmd/weir's (go test runs packages
// at the same time), which, killed or kept, leave theirs for the next weir
// demo.
const testPrefix = "wdt"

func options(t *testing.T, attach string, out *bytes.Buffer) Options {
	opts, err := testOptions(filepath.Join(t.TempDir(), "demo"), attach, out)
	if err != nil {
		t.Fatal(err)
	}
	return opts
}

// testOptions are the options of a test's demo in dir: its agent and hold
// process are this test binary, and die with it.
func testOptions(dir, attach string, out io.Writer) (Options, error) {
	exe, err := os.Executable()
	if err != nil {
		return Options{}, err
	}
	return Options{Attach: attach, Requests: 90, Out: out, Dir: dir, NamePrefix: testPrefix, DieWithParent: true,
		AgentArgv: func(cfg string) []string { return []string{"env", agentEnv + "=" + cfg, exe} },
		HoldArgv: func(state, prefix string) []string {
			return []string{"env", holdEnv + "=" + state, holdPrefixEnv + "=" + prefix, exe}
		}}, nil
}

// TestDemo runs the whole demo, natively and generically attached: every step
// holds, every request is answered, and nothing is left behind.
func TestDemo(t *testing.T) {
	for _, attach := range []string{"native", "generic"} {
		t.Run(attach, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			var out bytes.Buffer
			opts := options(t, attach, &out)
			rep, err := Run(ctx, opts)
			t.Log("\n" + out.String())
			if err != nil {
				xdptest.Check(t, err)
			}
			if rep.Attach != attach {
				t.Errorf("attached %q; want %q", rep.Attach, attach)
			}
			want := []string{StepRunning, StepKill, StepRevive, StepDrain, StepReloadAdd, StepReloadBroken, StepProxy}
			var got []string
			for _, s := range rep.Steps {
				got = append(got, s.Name)
				if !s.OK {
					t.Errorf("step %q: %s", s.Name, s.Detail)
				}
			}
			if strings.Join(got, ",") != strings.Join(want, ",") {
				t.Errorf("steps: got %v; want %v", got, want)
			}
			for _, r := range rep.Rounds {
				if len(r.Failures) > 0 {
					t.Errorf("%s: %d of %d failed, first: %v", r.Title, len(r.Failures), r.Sent, r.Failures[0])
				}
			}
			// The first round spreads new connections over three equal backends.
			for _, b := range rep.Backends[:3] {
				share := float64(rep.Rounds[0].Answers[b]) / float64(rep.Rounds[0].Sent)
				if share < 0.5/3 || share > 1.5/3 {
					t.Errorf("%s: %s answered %.0f%%; want about a third", rep.Rounds[0].Title, b, 100*share)
				}
				if rep.Rounds[0].Counted[b] < uint64(rep.Rounds[0].Answers[b]) {
					t.Errorf("%s: %s answered %d, the agent counted %d packets to it; want at least one per answer",
						rep.Rounds[0].Title, b, rep.Rounds[0].Answers[b], rep.Rounds[0].Counted[b])
				}
			}
			for _, w := range []string{"$ weir status", "data plane xdp (XDP dsr mode, self-test passed)", "data plane proxy (data_plane: proxy)"} {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q", w)
				}
			}
			checkNothingLeft(t, opts.Dir)
		})
	}
}

func checkNothingLeft(t *testing.T, dir string) {
	t.Helper()
	// This process's only: weir demo's own test (cmd/weir) may run beside.
	if left, _ := netns.List(topo.ProcessPrefix(testPrefix)); len(left) != 0 {
		t.Errorf("namespaces left behind: %v", left)
	}
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("%s left behind", dir)
	}
}

// keepOptions: a kept demo's, and a context for its test; Down removes what
// it leaves when the test ends.
func keepOptions(t *testing.T, out *bytes.Buffer) (context.Context, Options) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	opts := options(t, "auto", out)
	opts.Keep = true
	t.Cleanup(func() { Down(opts.Dir, testPrefix) })
	return ctx, opts
}

// TestDemoKeep: --keep leaves the agent and the backends serving; Down removes
// them all.
func TestDemoKeep(t *testing.T) {
	var out bytes.Buffer
	ctx, opts := keepOptions(t, &out)
	_, err := Run(ctx, opts)
	if err != nil {
		t.Log("\n" + out.String())
		xdptest.Check(t, err)
	}
	down := downCommand(opts.Dir)
	for _, w := range []string{"weir status -c " + filepath.Join(opts.Dir, "weir.yaml"), "Remove everything with: " + down + "\n", "curl -s http://10.77.100.1/"} {
		if !strings.Contains(out.String(), w) {
			t.Errorf("output lacks %q", w)
		}
	}
	st, err := readState(opts.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if !running(st.AgentPID, st.AgentStart) || !running(st.HoldPID, st.HoldStart) {
		t.Fatalf("after --keep: agent runs %t, backends run %t; want both", running(st.AgentPID, st.AgentStart), running(st.HoldPID, st.HoldStart))
	}
	if left, _ := netns.List(topo.ProcessPrefix(testPrefix)); len(left) != len(st.Namespaces) {
		t.Errorf("after --keep: namespaces %v; want %v", left, st.Namespaces)
	}
	// A second demo refuses while this one is kept.
	again := options(t, "auto", &bytes.Buffer{})
	again.Dir = opts.Dir
	if _, err := Run(ctx, again); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), down+" removes it") {
		t.Errorf("a demo while one is kept: got %v; want it refused, naming %s", err, down)
	}
	if err := Down(opts.Dir, testPrefix); err != nil {
		t.Fatal(err)
	}
	if running(st.AgentPID, st.AgentStart) || running(st.HoldPID, st.HoldStart) {
		t.Errorf("after Down: agent runs %t, backends run %t; want neither", running(st.AgentPID, st.AgentStart), running(st.HoldPID, st.HoldStart))
	}
	checkNothingLeft(t, opts.Dir)
}

// TestDemoInterrupted: a demo stopped midway (^C) removes everything too,
// and nothing of a weir demo's (another prefix) run beside, here a kept one's
// namespace.
func TestDemoInterrupted(t *testing.T) {
	// No cmd/weir test's demo runs meanwhile: it would remove that.
	heavy.Demo(t)
	// A kept demo's of the cmd/weir tests' prefix, named after the demo's
	// process, which has ended (no pid is that large).
	kept, err := netns.New("wdczzzzz0-kept")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kept.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opts := options(t, "auto", &bytes.Buffer{})
	// Interrupt once the agent answers and the first round is under way.
	done := runUntilFirstRound(ctx, t, opts)
	cancel()
	select {
	case err := <-done:
		if err == nil {
			t.Error("an interrupted demo returned no error")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the demo did not stop within 30s of its context ending")
	}
	checkNothingLeft(t, opts.Dir)
	if _, err := os.Stat(kept.Path()); err != nil {
		t.Errorf("a demo with prefix %s removed %s, a kept weir demo's: %v; want it left", testPrefix, kept.Name(), err)
	}
}

// runUntilFirstRound runs a demo with opts and returns once the agent
// answers and the first round is under way, with a channel that gets what Run
// returns.
func runUntilFirstRound(ctx context.Context, t *testing.T, opts Options) <-chan error {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	opts.Out = w
	done := make(chan error, 1)
	// Exits when Run returns.
	go func() { _, err := Run(ctx, opts); w.Close(); done <- err }()
	buf := make([]byte, 4096)
	var seen strings.Builder
	for !strings.Contains(seen.String(), "HTTP requests to web (") {
		n, err := r.Read(buf)
		if err != nil {
			t.Fatalf("demo output ended before its first round: %q", seen.String())
		}
		seen.Write(buf[:n])
	}
	// Exits when Run has closed w.
	go func() {
		for {
			if _, err := r.Read(buf); err != nil {
				return
			}
		}
	}()
	return done
}

// TestDemoAgentKilled: an agent killed while the demo runs fails the demo
// with one line that names the agent's log, which stays, the only thing left:
// the step the demo was in and stopping the agent fail both, and both are on
// that line.
func TestDemoAgentKilled(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	opts := options(t, "auto", &bytes.Buffer{})
	done := runUntilFirstRound(ctx, t, opts)
	st, err := readState(opts.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(st.AgentPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		t.Fatal("the demo did not end within a minute of its agent's death")
	}
	if err == nil || !strings.Contains(err.Error(), "the agent: signal: killed") {
		xdptest.Check(t, err)
		t.Fatalf("a demo whose agent was killed: got %v; want it to say so", err)
	}
	checkLogKept(t, err, opts.Dir, "agent.log", "")
	os.RemoveAll(opts.Dir)
	checkNothingLeft(t, opts.Dir)
}

// TestDemoKeepFails: a kept demo whose backends do not answer again once the
// hold process has them (here a hold process that serves nothing) fails, and
// removes all it made, the hold process too: it holds the demo's lock, which
// a next demo takes.
func TestDemoKeepFails(t *testing.T) {
	var out bytes.Buffer
	ctx, opts := keepOptions(t, &out)
	// Exits within a minute, should the demo leave it.
	opts.HoldArgv = func(string, string) []string { return []string{"sleep", "60"} }
	_, err := Run(ctx, opts)
	if err == nil || !strings.Contains(err.Error(), "did not answer again") {
		t.Log("\n" + out.String())
		xdptest.Check(t, err)
		t.Fatalf("a kept demo whose backends do not answer: got %v; want it to say so", err)
	}
	checkLogKept(t, err, opts.Dir, "hold.log", "")
	lk, err := lock(opts.Dir)
	if err != nil {
		t.Fatalf("the lock after a kept demo failed: %v; want it free", err)
	}
	lk.Close()
	os.RemoveAll(opts.Dir)
	checkNothingLeft(t, opts.Dir)
}

// TestDemoAgentFails: an agent that exits at start (here a shell that writes
// two lines and exits 1) fails the demo with one line naming the agent's log,
// which stays, the only thing left.
func TestDemoAgentFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	opts := options(t, "auto", &out)
	opts.AgentArgv = func(string) []string {
		return []string{"sh", "-c", "echo 'weir: load: it broke' >&2; echo 'and a second line' >&2; exit 1"}
	}
	_, err := Run(ctx, opts)
	checkExited(t, err, "the agent", opts.Dir, "agent.log")
}

// checkExited checks err, from a demo whose process what (its log name, in
// dir) wrote "it broke" and exited 1 at start: one line that says what
// exited, wraps the *exec.ExitError and names the log, which stays, the only
// thing left. It then removes dir.
func checkExited(t *testing.T, err error, what, dir, name string) {
	t.Helper()
	if err == nil || !strings.Contains(err.Error(), what+" exited") {
		t.Fatalf("a demo whose %s exits: got %v; want it to say so", what, err)
	}
	if ee := (*exec.ExitError)(nil); !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Errorf("a demo whose %s exits 1: got %v; want it to wrap the *exec.ExitError", what, err)
	}
	checkLogKept(t, err, dir, name, "it broke")
	os.RemoveAll(dir)
	checkNothingLeft(t, dir)
}

// TestDemoFailedStartLeavesNoDir: a demo that fails before it has anything
// to show (here its topology cannot be built: too many backends) leaves no
// directory behind, nor one below a parent that does not exist: the lock
// beside the directory needs the parent, so the demo makes no parents.
func TestDemoFailedStartLeavesNoDir(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	opts := options(t, "auto", &bytes.Buffer{})
	opts.Backends = topo.MaxBackends
	if _, err := Run(ctx, opts); err == nil || !strings.Contains(err.Error(), "build topology") {
		t.Errorf("a demo with %d backends: got %v; want its topology refused", opts.Backends, err)
	}
	checkNothingLeft(t, opts.Dir)
	opts = options(t, "auto", &bytes.Buffer{})
	parent := filepath.Join(filepath.Dir(opts.Dir), "no", "such")
	opts.Dir = filepath.Join(parent, "demo")
	if _, err := Run(ctx, opts); err == nil {
		t.Errorf("a demo in %s: got no error; want it refused", opts.Dir)
	}
	if _, err := os.Stat(filepath.Dir(parent)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after a demo in %s: %v; want it not made", filepath.Dir(parent), opts.Dir, err)
	}
}

// checkLogKept checks that err is one line naming the log name in dir, and
// that the log, holding want, is all that is left in dir.
func checkLogKept(t *testing.T, err error, dir, name, want string) {
	t.Helper()
	path := filepath.Join(dir, name)
	if strings.Contains(err.Error(), "\n") || !strings.HasSuffix(err.Error(), path) {
		t.Errorf("error: got %q; want one line ending in the log's path, %s", err, path)
	}
	if b, err := os.ReadFile(path); err != nil || !strings.Contains(string(b), want) {
		t.Errorf("%s: %q, %v; want it kept, with %q", path, b, err, want)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 || ents[0].Name() != name {
		t.Errorf("left in %s: %v; want only %s", dir, ents, name)
	}
}

// TestDemoKeepHoldExits: a kept demo whose hold process exits at start
// (here a shell that writes a line and exits 1) fails at once with one line
// that says so, wraps the exit status and names the process's log, which
// stays, the only thing left.
func TestDemoKeepHoldExits(t *testing.T) {
	var out bytes.Buffer
	ctx, opts := keepOptions(t, &out)
	opts.HoldArgv = func(string, string) []string {
		return []string{"sh", "-c", "echo 'weir: demo hold: it broke' >&2; exit 1"}
	}
	_, err := Run(ctx, opts)
	checkExited(t, err, "the backends' process", opts.Dir, "hold.log")
}

// keepRunEnv runs this test binary as keepRun, a test that keeps a demo in
// the directory it names.
const keepRunEnv = "WEIR_DEMO_TEST_KEEP_RUN"

// keepRun keeps a demo in dir, as TestDemoKeep does, and then waits to be
// killed.
func keepRun(dir string) int {
	opts, err := testOptions(dir, "auto", os.Stdout)
	if err == nil {
		opts.Keep = true
		_, err = Run(context.Background(), opts)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("kept")
	time.Sleep(5 * time.Minute)
	return 0
}

// TestDemoDiesWithTest: a test binary killed (SIGKILL) while its kept demo
// runs leaves neither the agent nor the hold process running: they get
// SIGTERM as it dies.
func TestDemoDiesWithTest(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "demo")
	// What the killed test leaves, if anything.
	t.Cleanup(func() { removeLeftovers(dir, testPrefix) })
	cmd := exec.Command(exe, "-test.run", "^$")
	cmd.Env = append(os.Environ(), keepRunEnv+"="+dir)
	outf, err := os.Create(filepath.Join(t.TempDir(), "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer outf.Close()
	cmd.Stdout, cmd.Stderr = outf, outf
	output := func() string { b, _ := os.ReadFile(outf.Name()); return string(b) }
	// Should this test die first, from a thread that lives as long as the
	// child: SIGKILL from the kernel when any other thread ended would kill
	// it before the test does.
	exited, err := start(cmd, syscall.SIGKILL)
	if err != nil {
		t.Fatal(err)
	}
	gone := false // exited received
	t.Cleanup(func() {
		cmd.Process.Kill()
		if !gone {
			<-exited
		}
	})
	var st state
	if !waitfor.Cond(2*time.Minute, func() bool {
		select {
		case err := <-exited:
			gone = true
			t.Fatalf("the test keeping a demo exited: %v; its output:\n%s", err, output())
		default:
		}
		st, err = readState(dir)
		return err == nil && strings.Contains(output(), "\nkept\n")
	}) {
		t.Fatalf("no kept demo within 2 minutes; output:\n%s", output())
	}
	if !running(st.AgentPID, st.AgentStart) || !running(st.HoldPID, st.HoldStart) {
		t.Fatalf("the kept demo: agent runs %t, hold process runs %t; want both", running(st.AgentPID, st.AgentStart), running(st.HoldPID, st.HoldStart))
	}
	cmd.Process.Kill()
	if !waitfor.Cond(30*time.Second, func() bool {
		return !running(st.AgentPID, st.AgentStart) && !running(st.HoldPID, st.HoldStart)
	}) {
		t.Errorf("30s after the test was killed: agent runs %t, hold process runs %t; want neither",
			running(st.AgentPID, st.AgentStart), running(st.HoldPID, st.HoldStart))
	}
}

// checkRefused checks that a demo in dir, and Down, refuse it with an error
// that holds want.
func checkRefused(ctx context.Context, t *testing.T, dir, want string) {
	t.Helper()
	opts := options(t, "auto", &bytes.Buffer{})
	opts.Dir = dir
	// A demo that takes dir anyway fails at once, and removes what it can.
	opts.AgentArgv = func(string) []string { return []string{"sh", "-c", "exit 1"} }
	if _, err := Run(ctx, opts); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("a demo in %s: got %v; want it refused: %q", dir, err, want)
	}
	if err := Down(dir, testPrefix); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("Down in %s: got %v; want it refused: %q", dir, err, want)
	}
}

// TestLockSymlink: a demo, and Down, refuse a directory whose lock's path
// (DIR.lock) is a symlink, and leave the file it points to as it was: they
// would write through it.
func TestLockSymlink(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	base := t.TempDir()
	target := filepath.Join(base, "target")
	if err := os.WriteFile(target, []byte("mine"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(base, "link.lock")); err != nil {
		t.Fatal(err)
	}
	checkRefused(ctx, t, filepath.Join(base, "link"), "link.lock is a symlink")
	if b, err := os.ReadFile(target); string(b) != "mine" {
		t.Errorf("%s after the demo and Down: %q, %v; want it untouched", target, b, err)
	}
	if left, _ := netns.List(topo.ProcessPrefix(testPrefix)); len(left) != 0 {
		t.Errorf("namespaces left behind: %v", left)
	}
}

// TestDemoDirKeepsUsersFile: a kept demo's directory holding a file of the
// user's beside the demo's (an editor's backup of the config it invites the
// user to edit) is still the demo's: Down removes the kept demo, and the next
// demo takes the directory; both remove only the demo's files and leave the
// user's.
func TestDemoDirKeepsUsersFile(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	opts := options(t, "auto", &bytes.Buffer{})
	if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	backup := configPath(opts.Dir) + "~"
	for _, path := range []string{configPath(opts.Dir), backup} {
		if err := os.WriteFile(path, []byte("mine"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := writeState(state{Dir: opts.Dir}); err != nil {
		t.Fatal(err)
	}
	if err := Down(opts.Dir, testPrefix); err != nil {
		t.Errorf("Down with a user's %s beside the kept demo's files: %v; want it done", filepath.Base(backup), err)
	}
	if _, err := os.Stat(statePath(opts.Dir)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after Down: %v; want it removed", statePath(opts.Dir), err)
	}
	opts.AgentArgv = func(string) []string { return []string{"sh", "-c", "echo it broke; exit 1"} }
	if _, err := Run(ctx, opts); err == nil || !strings.Contains(err.Error(), "the agent exited") {
		t.Errorf("the next demo: got %v; want it to take the directory (and its agent to exit)", err)
	}
	if b, err := os.ReadFile(backup); string(b) != "mine" {
		t.Errorf("%s after Down and a demo: %q, %v; want it untouched", backup, b, err)
	}
	// The failed agent's log stays, for the error names it.
	if ents, _ := os.ReadDir(opts.Dir); len(ents) != 2 || ents[0].Name() != "agent.log" || ents[1].Name() != filepath.Base(backup) {
		t.Errorf("left in %s: %v; want only agent.log and %s", opts.Dir, ents, filepath.Base(backup))
	}
	if left, _ := netns.List(topo.ProcessPrefix(testPrefix)); len(left) != 0 {
		t.Errorf("namespaces left behind: %v", left)
	}
}
