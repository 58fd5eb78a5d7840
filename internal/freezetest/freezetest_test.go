package freezetest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// childEnv makes TestKilledRunsGroupThawed this test binary's child, a test
// killed midway: it freezes the pid the variable gives and waits to be
// killed, its cleanup never run.
const childEnv = "WEIR_FREEZETEST_CHILD"

// startSleep starts a process to freeze; it is killed and reaped at cleanup,
// and reaped is closed once it has exited.
func startSleep(t *testing.T) (cmd *exec.Cmd, reaped <-chan struct{}) {
	t.Helper()
	cmd = exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	// Exits when sleep does: killed, at the latest at cleanup.
	go func() {
		cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
	})
	return cmd, done
}

// freezerGroup is the freezer group directory process pid is in.
func freezerGroup(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if _, path, ok := strings.Cut(line, ":freezer:"); ok {
			return filepath.Join(root, path)
		}
	}
	t.Fatalf("pid %d is in no freezer group: %s", pid, b)
	return ""
}

// TestKilledRunsGroupThawed: a test process killed while it kept a process
// frozen (a SIGKILL sent to it pending) leaves that process and its group;
// the next Freeze thaws it, so it dies, and removes the group. A live test's
// group is left alone.
func TestKilledRunsGroupThawed(t *testing.T) {
	if s := os.Getenv(childEnv); s != "" {
		pid, err := strconv.Atoi(s)
		if err != nil {
			t.Fatal(err)
		}
		Freeze(t, pid)
		select {}
	}
	left, leftReaped := startSleep(t)
	live, _ := startSleep(t)
	Freeze(t, live.Process.Pid)
	liveGroup := freezerGroup(t, live.Process.Pid)

	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	child := exec.Command(exe, "-test.run", "^TestKilledRunsGroupThawed$")
	child.Env = append(os.Environ(), childEnv+"="+strconv.Itoa(left.Process.Pid))
	child.Stdout, child.Stderr = os.Stderr, os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	var group string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		group = freezerGroup(t, left.Process.Pid)
		b, _ := os.ReadFile(filepath.Join(group, "freezer.state"))
		if strings.HasPrefix(filepath.Base(group), groupPrefix) && strings.TrimSpace(string(b)) == "FROZEN" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d, 30s after the child began: in %s, %q; want it frozen", left.Process.Pid, group, b)
		}
	}
	// Should the checks below fail: thawed, killed and reaped, removed.
	t.Cleanup(func() {
		release(root, group)
		left.Process.Kill()
		<-leftReaped
		os.Remove(group)
	})
	left.Process.Kill()
	child.Process.Kill()
	child.Wait()

	// The next run's Freeze.
	next, _ := startSleep(t)
	Freeze(t, next.Process.Pid)
	select {
	case <-leftReaped:
	case <-time.After(30 * time.Second):
		t.Fatalf("pid %d, frozen by a killed test and sent SIGKILL, still runs 30s after the next Freeze", left.Process.Pid)
	}
	if _, err := os.Stat(group); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the killed test's group %s after the next Freeze: %v; want it removed", group, err)
	}
	if b, err := os.ReadFile(filepath.Join(liveGroup, "freezer.state")); strings.TrimSpace(string(b)) != "FROZEN" {
		t.Errorf("this live test's group %s after the next Freeze: %q (%v); want it FROZEN still", liveGroup, b, err)
	}
}

// TestFreezeNeedsFreezer: with no cgroup v1 freezer where it is looked for,
// freeze fails saying what the test needs (no skip).
func TestFreezeNeedsFreezer(t *testing.T) {
	none := filepath.Join(t.TempDir(), "freezer")
	thaw, err := freeze(none, os.Getpid())
	if thaw != nil || err == nil || !strings.Contains(err.Error(), "the test needs the cgroup v1 freezer at "+none) {
		t.Errorf("freeze without a freezer: %v (thaw %t); want an error saying the test needs the cgroup v1 freezer at %s", err, thaw != nil, none)
	}
}
