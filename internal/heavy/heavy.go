// Package heavy keeps the suite's load-heavy tests from overlapping. `go test ./...`
// runs packages side by side; a SYN flood (two generator threads at full rate) next to
// a fleet of agents behind a BGP router starves the fleet's health checks and BGP
// timers on a 2-core machine, and both tests then fail for what the other did (seen
// in a clean-clone CI run: broken fleet streams, a stalled flood stream). Each such
// test holds a machine-wide lock for its run. Tests only.
package heavy

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// lockPath is shared by every test binary on the machine.
var lockPath = filepath.Join(os.TempDir(), "weir-heavy-test.lock")

// Alone waits until no other heavy test runs, and holds that until t ends.
func Alone(t testing.TB) {
	t.Helper()
	f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		t.Fatalf("heavy-test lock: %v", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		t.Fatalf("heavy-test lock %s: %v", lockPath, err)
	}
	t.Cleanup(func() {
		unix.Flock(int(f.Fd()), unix.LOCK_UN)
		f.Close()
	})
}
