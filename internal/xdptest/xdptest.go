// Package xdptest is the skip-or-fail rule of internal/xdpenv for tests: the
// same functions, taking a testing.TB. Only tests import it; code the weir
// binary links uses xdpenv, which does not import package testing.
//
// CI runs as root on a kernel with XDP and sets WEIR_REQUIRE_XDP=1: there a
// test that cannot create a namespace or load or attach an XDP program fails,
// so the end-to-end tests never pass by skipping. Anywhere else (a laptop
// without root, a container without CAP_NET_ADMIN) the test is skipped with
// the reason.
package xdptest

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/xdpenv"
)

// EnvRequire is the environment variable that turns skips into failures.
const EnvRequire = xdpenv.EnvRequire

// Required reports whether WEIR_REQUIRE_XDP=1 is set.
func Required() bool { return xdpenv.Required() }

// SkipOrFail does nothing if err is nil. Otherwise it fails the test if
// WEIR_REQUIRE_XDP=1 and skips it if not, naming err either way. Call it with
// the error of the step that needs privileges or kernel support (creating a
// namespace, loading or attaching a program), not with errors of the code
// under test.
func SkipOrFail(tb testing.TB, err error) {
	tb.Helper()
	xdpenv.SkipOrFail(tb, err)
}

// Unavailable reports whether err says the environment lacks a privilege or
// a kernel feature rather than a bug in what was asked; see xdpenv.Unavailable.
func Unavailable(err error) bool { return xdpenv.Unavailable(err) }

// Check is SkipOrFail for errors that Unavailable accepts, and t.Fatal for
// any other non-nil error.
func Check(tb testing.TB, err error) {
	tb.Helper()
	xdpenv.Check(tb, err)
}

// BPFFS mounts a bpf filesystem of the test's own on a temporary directory and
// returns it; t.Cleanup unmounts it. Pins there outlive the process that made
// them, also one run through `ip netns exec` (which gives it a private /sys).
func BPFFS(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	Check(tb, unix.Mount("bpf", dir, "bpf", 0, "mode=0700"))
	tb.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}
