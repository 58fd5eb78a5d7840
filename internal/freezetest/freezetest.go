// Package freezetest freezes a test's child process, so that it acts on no
// signal until thawed: as a process the kernel keeps in an uninterruptible
// call does, SIGKILL included.
package freezetest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// root is where the cgroup v1 freezer is mounted on a host that mounts each
// controller of its own (this project's machines). Where the host has not,
// Freeze mounts it for the test at a directory of its own in ownDir, named
// ownPrefix<test pid>-..., and unmounts and removes it at cleanup.
const (
	root      = "/sys/fs/cgroup/freezer"
	ownDir    = "/run"
	ownPrefix = "weir-test-freezer-"
)

// groupPrefix begins the name of each group Freeze makes, which goes on with
// the test process's pid and the frozen process's: weir-test-<owner>-<pid>.
const groupPrefix = "weir-test-"

// Freeze puts process pid in a cgroup v1 freezer group of its own and
// freezes it: it then acts on no signal, SIGKILL included, until thawed. At
// cleanup it is thawed, and the group removed once it has left. A group a
// test process killed before its cleanup left (its process frozen for good)
// is thawed and removed first. Without the freezer the test fails saying so.
func Freeze(t testing.TB, pid int) {
	t.Helper()
	freezeAt(t, root, ownDir, pid)
}

// freezeAt is Freeze with the host's freezer looked for at host, and one of
// the test's own mounted in own where the host has none.
func freezeAt(t testing.TB, host, own string, pid int) {
	t.Helper()
	dir, unmount := freezerRoot(host, own)
	if unmount != nil {
		// Registered first, so it runs after the thaw below.
		t.Cleanup(func() {
			if err := unmount(); err != nil {
				t.Error(err)
			}
		})
	}
	thaw, err := freeze(dir, pid)
	if thaw != nil {
		t.Cleanup(func() {
			if err := thaw(); err != nil {
				t.Error(err)
			}
		})
	}
	if err != nil {
		t.Fatal(err)
	}
}

// freezerRoot is where the cgroup v1 freezer is mounted: the host's at host,
// else one mounted at a new directory in own, which unmount unmounts and
// removes (every mount of the freezer shows the one hierarchy, so groups are
// shared with the host's and other tests' mounts). Mounts that test processes
// which have exited left in own are removed first. Where none can be mounted
// (a host whose freezer the cgroup v2 hierarchy holds refuses) it is host, and
// freeze says what the test needs.
func freezerRoot(host, own string) (dir string, unmount func() error) {
	if _, err := os.Stat(filepath.Join(host, "cgroup.procs")); err == nil {
		return host, nil
	}
	unmountLeft(own)
	dir, err := os.MkdirTemp(own, fmt.Sprintf("%s%d-", ownPrefix, os.Getpid()))
	if err != nil {
		return host, nil
	}
	if err := unix.Mount("weir-test-freezer", dir, "cgroup", 0, "freezer"); err != nil {
		os.Remove(dir)
		return host, nil
	}
	return dir, func() error {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("freezetest: unmount %s: %w", dir, err)
		}
		return os.Remove(dir)
	}
}

// unmountLeft unmounts and removes the freezer mounts in own that test
// processes which have exited made (killed before their cleanup); a live
// test's is left alone.
func unmountLeft(own string) {
	ents, _ := os.ReadDir(own)
	for _, e := range ents {
		if pid, ok := owner(e.Name(), ownPrefix); ok && !alive(pid) {
			dir := filepath.Join(own, e.Name())
			unix.Unmount(dir, unix.MNT_DETACH)
			os.Remove(dir)
		}
	}
}

// owner is the test process's pid that name, prefix<pid>-..., begins with.
func owner(name, prefix string) (pid int, ok bool) {
	rest, ok := strings.CutPrefix(name, prefix)
	s, _, _ := strings.Cut(rest, "-")
	pid, err := strconv.Atoi(s)
	return pid, ok && err == nil && pid > 0
}

// freeze is Freeze with the freezer mounted at root; thaw, once the group is
// made, undoes it.
func freeze(root string, pid int) (thaw func() error, err error) {
	if _, err := os.Stat(filepath.Join(root, "cgroup.procs")); err != nil {
		return nil, fmt.Errorf("freezetest: the test needs the cgroup v1 freezer at %s (mount -t cgroup -o freezer freezer %s): %w", root, root, err)
	}
	thawLeft(root)
	group := filepath.Join(root, fmt.Sprintf("%s%d-%d", groupPrefix, os.Getpid(), pid))
	if err := os.Mkdir(group, 0o755); err != nil {
		return nil, fmt.Errorf("freezetest: %w", err)
	}
	thaw = func() error {
		release(root, group)
		return removeGroup(group, 30*time.Second)
	}
	if err := write(group, "cgroup.procs", strconv.Itoa(pid)); err != nil {
		return thaw, fmt.Errorf("freezetest: %w", err)
	}
	if err := write(group, "freezer.state", "FROZEN"); err != nil {
		return thaw, fmt.Errorf("freezetest: %w", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := os.ReadFile(filepath.Join(group, "freezer.state"))
		if err == nil && strings.TrimSpace(string(b)) == "FROZEN" {
			return thaw, nil
		}
		if time.Now().After(deadline) {
			return thaw, fmt.Errorf("freezetest: freezer.state %q (%v) 30s after FROZEN; want FROZEN", b, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// thawLeft thaws and removes the groups under root that test processes
// which have exited made: killed before their cleanup, they left their
// processes frozen, a SIGKILL they had been sent pending for ever. A live
// test's group is left alone.
func thawLeft(root string) {
	ents, _ := os.ReadDir(root)
	for _, e := range ents {
		if pid, ok := owner(e.Name(), groupPrefix); !ok || alive(pid) {
			continue
		}
		group := filepath.Join(root, e.Name())
		release(root, group)
		removeGroup(group, 5*time.Second)
	}
}

// removeGroup removes group, released, within: busy until its processes
// have left (thawed, one dies of a SIGKILL it has been sent, or moves
// back). A group already gone is done: two tests' thawLeft may find the same
// one.
func removeGroup(group string, within time.Duration) error {
	deadline := time.Now().Add(within)
	for err := os.Remove(group); err != nil && !errors.Is(err, os.ErrNotExist); err = os.Remove(group) {
		if time.Now().After(deadline) {
			return fmt.Errorf("freezetest: %s after thawing: %w", within, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// release thaws group and moves its processes back to root.
func release(root, group string) {
	write(group, "freezer.state", "THAWED")
	b, _ := os.ReadFile(filepath.Join(group, "cgroup.procs"))
	for _, pid := range strings.Fields(string(b)) {
		write(root, "cgroup.procs", pid)
	}
}

func write(dir, file, value string) error {
	return os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644)
}

// alive reports whether process pid exists.
func alive(pid int) bool {
	err := unix.Kill(pid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}
