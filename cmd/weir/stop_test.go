package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/agent/admin"
)

// childArgs, in the environment, makes the test binary run weir with these
// arguments (one a line) instead of the tests: an agent run in a namespace
// through `ip netns exec`, as it would run on a host.
const childArgs = "WEIR_CLI_TEST_ARGS"

func TestMain(m *testing.M) {
	if args, ok := os.LookupEnv(childArgs); ok {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		err := run(ctx, strings.Split(args, "\n"), os.Stdout, os.Stderr)
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, "weir:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

const stopConfig = `interfaces:
  - name: %s
xdp:
  hash_seed: 5
  conntrack_size: 65536
  pin_path: %s
addresses: [%s]
admin:
  socket: %s
metrics:
  listen: "off"
services:
  - name: web
    vip: %s:80
    mode: dsr
    algorithm: maglev
    health: {type: none}
    backends:
      - address: %s:80
`

// TestStopDetachPastAnInvalidFile: an agent leaves its program pinned on a
// namespace's veth at a stop without --detach; its file then fails validation
// in a services field (as a stricter release would refuse it). weir stop
// --detach -c FILE still removes the program and its pins, from the file's
// interfaces and xdp sections, warning with the file's errors; while those
// sections are themselves invalid it refuses and leaves the program be.
func TestStopDetachPastAnInvalidFile(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wsd"), Backends: 1})
	// A bpffs of the test's own: `ip netns exec` gives the agent a private /sys.
	pinPath := filepath.Join(xdptest.BPFFS(t), "weir")
	dir := t.TempDir()
	file, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	valid := fmt.Sprintf(stopConfig, tp.Balancer.Link, pinPath, tp.Balancer.IP4, socket, tp.VIP4, tp.Backends[0].IP4)
	write := func(body string) {
		t.Helper()
		if err := os.WriteFile(file, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(valid)

	agent := startAgent(t, tp.Balancer.NS.Name(), file)
	client := admin.NewClient(socket)
	if !waitfor.Cond(30*time.Second, func() bool {
		st, err := client.Status(context.Background())
		return err == nil && st.XDP.Pinned
	}) {
		t.Fatal("the agent did not serve with its XDP program pinned within 30s")
	}
	if err := client.Stop(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	select {
	case <-agent.done:
		if agent.err != nil {
			t.Fatalf("agent stopped: %v", agent.err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the agent did not exit within 30s of weir stop")
	}
	pinned := func() int {
		entries, _ := os.ReadDir(pinPath)
		return len(entries)
	}
	attached := func() bool {
		out, err := exec.Command("ip", "-n", tp.Balancer.NS.Name(), "link", "show", "dev", tp.Balancer.Link).CombinedOutput()
		if err != nil {
			t.Fatalf("ip link show: %v: %s", err, out)
		}
		return strings.Contains(string(out), "prog/xdp")
	}
	if pinned() == 0 || !attached() {
		t.Fatalf("after weir stop: %d pins, program attached %t; want the program pinned and attached", pinned(), attached())
	}

	stop := func() (string, string, error) {
		var stdout, stderr bytes.Buffer
		err := tp.Balancer.NS.Do(func() error {
			return run(context.Background(), []string{"stop", "--detach", "-c", file}, &stdout, &stderr)
		})
		return stdout.String(), stderr.String(), err
	}
	badService := strings.Replace(valid, "algorithm: maglev", "algorithm: Maglev", 1)

	// Invalid xdp settings are refused, whatever the rest of the file says.
	write(strings.Replace(badService, "conntrack_size: 65536", "conntrack_size: 12", 1))
	if _, _, err := stop(); err == nil || !strings.Contains(err.Error(), file+":5: xdp.conntrack_size: must be") {
		t.Errorf("weir stop --detach with bad xdp settings: got %v; want it refused at xdp.conntrack_size", err)
	}
	if pinned() == 0 || !attached() {
		t.Fatalf("after a refused weir stop --detach: %d pins, program attached %t; want both left", pinned(), attached())
	}

	write(badService)
	stdout, stderr, err := stop()
	if err != nil {
		t.Fatalf("weir stop --detach with a bad service: %v (stderr %s)", err, stderr)
	}
	if !strings.Contains(stdout, "detached and its pins removed") {
		t.Errorf("stdout: got %q; want it to say the program is detached", stdout)
	}
	for _, want := range []string{"warning: " + file + " is invalid", "services[0].algorithm"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr: got %q; want it to contain %q", stderr, want)
		}
	}
	if pinned() != 0 || attached() {
		t.Errorf("after weir stop --detach: %d pins, program attached %t; want neither", pinned(), attached())
	}
}

// agentProcess is `weir run` in a namespace of a test's: done is closed when
// it has exited, err then says how, out holds what it wrote.
type agentProcess struct {
	done chan struct{}
	err  error
	out  bytes.Buffer
}

// startAgent runs `weir run -c file` in the named namespace through `ip netns
// exec`, as it would run on a host; at cleanup it is stopped (SIGTERM) unless
// it exited before, and its output is logged if the test failed.
func startAgent(t *testing.T, ns, file string) *agentProcess {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p := &agentProcess{done: make(chan struct{})}
	cmd := exec.Command("ip", "netns", "exec", ns, exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), childArgs+"=run\n-c\n"+file)
	cmd.Stdout, cmd.Stderr = &p.out, &p.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Exits when the agent does.
	go func() { p.err = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM) // os.ErrProcessDone once it has exited
		<-p.done
		if t.Failed() {
			t.Logf("agent output:\n%s", p.out.String())
		}
	})
	return p
}
