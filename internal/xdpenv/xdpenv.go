// Package xdpenv holds the one rule every test that needs network namespaces
// or XDP follows when the machine cannot provide them, without importing
// package testing, so code that the weir binary links (internal/topo, which
// `weir demo` builds on) can carry test helpers that apply it.
//
// CI runs as root on a kernel with XDP and sets WEIR_REQUIRE_XDP=1: there a
// test that cannot create a namespace or load or attach an XDP program fails,
// so the end-to-end tests never pass by skipping. Anywhere else (a laptop
// without root, a container without CAP_NET_ADMIN) the test is skipped with
// the reason.
//
// Tests call it through internal/xdptest, which takes a testing.TB.
package xdpenv

import (
	"errors"
	"os"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// EnvRequire is the environment variable that turns skips into failures.
const EnvRequire = "WEIR_REQUIRE_XDP"

// TB is what the rule needs of a test; *testing.T and *testing.B have it.
type TB interface {
	Helper()
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	Skipf(format string, args ...any)
}

// Required reports whether WEIR_REQUIRE_XDP=1 is set.
func Required() bool { return os.Getenv(EnvRequire) == "1" }

// SkipOrFail does nothing if err is nil. Otherwise it fails the test if
// WEIR_REQUIRE_XDP=1 and skips it if not, naming err either way. Call it with
// the error of the step that needs privileges or kernel support (creating a
// namespace, loading or attaching a program), not with errors of the code
// under test.
func SkipOrFail(tb TB, err error) {
	tb.Helper()
	if err == nil {
		return
	}
	if Required() {
		tb.Fatalf("%s=1 and the environment cannot run this test: %v", EnvRequire, err)
	}
	tb.Skipf("skipping, the environment cannot run this test (set %s=1 to fail instead): %v", EnvRequire, err)
}

// Unavailable reports whether err says the environment lacks a privilege or
// a kernel feature (as opposed to a bug in what was asked): EPERM, EACCES,
// EOPNOTSUPP, ENOSYS, or cilium/ebpf's ErrNotSupported. Helpers such as
// topo.NewT pass such errors to SkipOrFail and fail the test on the others.
//
// A program the verifier rejects is never Unavailable, even though the
// verifier reports EACCES: that is a bug in the program.
func Unavailable(err error) bool {
	if _, ok := errors.AsType[*ebpf.VerifierError](err); ok {
		return false
	}
	return errors.Is(err, unix.EPERM) ||
		errors.Is(err, unix.EACCES) ||
		errors.Is(err, unix.EOPNOTSUPP) ||
		errors.Is(err, unix.ENOSYS) ||
		errors.Is(err, ebpf.ErrNotSupported)
}

// Check is SkipOrFail for errors that Unavailable accepts, and tb.Fatal for
// any other non-nil error.
func Check(tb TB, err error) {
	tb.Helper()
	if err == nil {
		return
	}
	if Unavailable(err) {
		SkipOrFail(tb, err)
		return
	}
	tb.Fatal(err)
}
