// Package freezetest freezes a test's child process, so that it acts on no
// signal until thawed: as a process the kernel keeps in an uninterruptible
// call does, SIGKILL included.
package freezetest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Freeze puts process pid in a cgroup v1 freezer group of its own and
// freezes it: it then acts on no signal, SIGKILL included, until thawed. At
// cleanup it is thawed, and the group removed once it has left.
func Freeze(t testing.TB, pid int) {
	t.Helper()
	root := "/sys/fs/cgroup/freezer"
	group := filepath.Join(root, fmt.Sprintf("weir-test-%d", pid))
	if err := os.Mkdir(group, 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(dir, file, value string) error {
		return os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644)
	}
	t.Cleanup(func() {
		write(group, "freezer.state", "THAWED")
		write(root, "cgroup.procs", strconv.Itoa(pid))
		// Busy until the process has left: thawed, it dies of a SIGKILL
		// it has been sent, or moves back.
		deadline := time.Now().Add(30 * time.Second)
		for err := os.Remove(group); err != nil; err = os.Remove(group) {
			if time.Now().After(deadline) {
				t.Errorf("30s after thawing: %v", err)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	if err := write(group, "cgroup.procs", strconv.Itoa(pid)); err != nil {
		t.Fatal(err)
	}
	if err := write(group, "freezer.state", "FROZEN"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := os.ReadFile(filepath.Join(group, "freezer.state"))
		if err == nil && strings.TrimSpace(string(b)) == "FROZEN" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("freezer.state %q (%v) 30s after FROZEN; want FROZEN", b, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
