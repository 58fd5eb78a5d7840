// Package mainthread checks that code which moves its thread into another
// network namespace leaves the process's main thread in its own. The runtime
// cannot end the main thread: a goroutine that exits locked to it parks it for
// good, in whatever namespace it left, and /proc/PID/ns/net is the main
// thread's. Test-only: it never links into the shipped binary.
package mainthread

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
)

const childEnv = "WEIR_MAIN_THREAD_CHILD"

// Child, called first in TestMain, runs fn three times from the main goroutine
// with one P when this process is the child Check starts, and exits: with one
// P, a goroutine fn starts and waits for takes the main thread over from the
// parked main goroutine. It returns at once in any other process.
func Child(fn func() error) {
	if os.Getenv(childEnv) != "1" {
		return
	}
	os.Exit(child(fn))
}

func child(fn func() error) int {
	runtime.GOMAXPROCS(1)
	mainNS := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), os.Getpid())
	before, err := os.Readlink(mainNS)
	if err != nil {
		fmt.Println(err)
		return 2
	}
	for range 3 {
		if err := fn(); err != nil {
			fmt.Println(err)
			return 2
		}
	}
	after, err := os.Readlink(mainNS)
	if err != nil {
		fmt.Println(err)
		return 2
	}
	if after != before {
		fmt.Printf("the main thread stayed in %s, not %s\n", after, before)
		return 1
	}
	fmt.Println("main thread back in", before)
	return 0
}

// Check runs the test binary again as the child Child serves, and fails t
// unless the main thread ended where it began.
func Check(t *testing.T) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v: %s", err, strings.TrimSpace(string(out)))
	}
	t.Log(strings.TrimSpace(string(out)))
}
