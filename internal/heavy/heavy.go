// Package heavy keeps the suite's load-heavy tests from overlapping. `go test ./...`
// runs packages side by side; a SYN flood (two generator threads at full rate) next to
// a fleet of agents behind a BGP router starves the fleet's health checks and BGP
// timers on a 2-core machine, and both tests then fail for what the other did (seen
// in a clean-clone CI run: broken fleet streams, a stalled flood stream). Each such
// test holds a machine-wide lock for its run. Tests only.
//
// It also keeps apart the tests that share what weir demo uses machine-wide (see
// Demo).
package heavy

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// The locks' files are shared by every test binary on the machine.
var (
	lockPath     = filepath.Join(os.TempDir(), "weir-heavy-test.lock")
	demoLockPath = filepath.Join(os.TempDir(), "weir-demo-test.lock")
)

// Alone waits until no other heavy test runs, and holds that until t ends.
func Alone(t testing.TB) {
	t.Helper()
	hold(t, lockPath)
}

// Demo waits until no other test runs weir demo with the tests' directory
// (/run/weir-demo-wdc, which one demo at a time may hold: another is
// refused) or leaves namespaces named as a dead demo's (which a demo removes),
// and holds that until t ends: the cmd/weir tests of two checkouts, say, run
// one after the other. Call it once per test.
func Demo(t testing.TB) {
	t.Helper()
	hold(t, demoLockPath)
}

func hold(t testing.TB, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		t.Fatalf("test lock: %v", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		t.Fatalf("test lock %s: %v", path, err)
	}
	t.Cleanup(func() {
		unix.Flock(int(f.Fd()), unix.LOCK_UN)
		f.Close()
	})
}
