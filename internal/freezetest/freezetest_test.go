package freezetest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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

// freezerGroup is the freezer group directory process pid is in, under the
// freezer mounted at mnt.
func freezerGroup(t *testing.T, mnt string, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if _, path, ok := strings.Cut(line, ":freezer:"); ok {
			return filepath.Join(mnt, path)
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
	liveGroup := freezerGroup(t, root, live.Process.Pid)

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
		group = freezerGroup(t, root, left.Process.Pid)
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

// mountsIn lists the mount points in dir, from /proc/self/mountinfo.
func mountsIn(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var in []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			in = append(in, f[4])
		}
	}
	return in
}

// TestOwnMountRemoved: where the host mounts no freezer, Freeze mounts one of
// its own, and its cleanup leaves neither that mount, nor its directory, nor
// the group; a mount a killed test left is removed by the next Freeze, a live
// test's kept.
func TestOwnMountRemoved(t *testing.T) {
	host := filepath.Join(t.TempDir(), "none")
	own := t.TempDir()

	// A killed test's mount: its pid has exited.
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	left := filepath.Join(own, fmt.Sprintf("%s%d-1", ownPrefix, dead.Process.Pid))
	live := filepath.Join(own, fmt.Sprintf("%s%d-1", ownPrefix, os.Getppid()))
	for _, dir := range []string{left, live} {
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("weir-test-freezer", dir, "cgroup", 0, "freezer"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	}

	var group string
	t.Run("frozen", func(t *testing.T) {
		sleep, _ := startSleep(t)
		freezeAt(t, host, own, sleep.Process.Pid)
		group = freezerGroup(t, live, sleep.Process.Pid) // one hierarchy, in every mount
		b, err := os.ReadFile(filepath.Join(group, "freezer.state"))
		if strings.TrimSpace(string(b)) != "FROZEN" {
			t.Errorf("freezer.state of %s: %q (%v); want FROZEN", group, b, err)
		}
		if m := mountsIn(t, own); !slices.Contains(m, live) || slices.Contains(m, left) || len(m) != 2 {
			t.Errorf("mounts in %s while frozen: %q; want %s and one of Freeze's own, not %s", own, m, live, left)
		}
	})
	if m := mountsIn(t, own); !slices.Equal(m, []string{live}) {
		t.Errorf("mounts in %s after the cleanup: %q; want only %s", own, m, live)
	}
	ents, _ := os.ReadDir(own)
	if len(ents) != 1 || filepath.Join(own, ents[0].Name()) != live {
		t.Errorf("%s after the cleanup holds %v; want only %s", own, ents, live)
	}
	if _, err := os.Stat(group); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("group %s after the cleanup: %v; want it removed", group, err)
	}
}

// TestRemoveGroupGone: a group another test's thawLeft removed first is
// removed: no wait, no error.
func TestRemoveGroupGone(t *testing.T) {
	group := filepath.Join(t.TempDir(), groupPrefix+"1-2")
	start := time.Now()
	if err := removeGroup(group, 5*time.Second); err != nil || time.Since(start) > 4*time.Second {
		t.Errorf("removeGroup of a group already gone: %v after %v; want nil at once", err, time.Since(start))
	}
}
