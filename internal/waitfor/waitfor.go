// Package waitfor is the tests' poll-until-deadline: a condition is checked every
// few milliseconds until it holds or the time is up, instead of sleeping a fixed
// time and hoping. Tests only.
package waitfor

import (
	"testing"
	"time"
)

// Cond polls cond every 2 ms until it is true (true) or timeout passes (false).
func Cond(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
	return true
}

// Value polls cond until it reports ok, or fails the test after timeout with the
// last value cond got and what was wanted.
func Value(t testing.TB, timeout time.Duration, want string, cond func() (got any, ok bool)) {
	t.Helper()
	var got any
	if !Cond(timeout, func() bool {
		var ok bool
		got, ok = cond()
		return ok
	}) {
		t.Fatalf("got %v; want %s (gave up after %v)", got, want, timeout)
	}
}
