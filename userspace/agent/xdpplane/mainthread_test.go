package xdpplane

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
)

const mainThreadChildEnv = "WEIR_XDPPLANE_MAIN_THREAD_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(mainThreadChildEnv) == "1" {
		os.Exit(scratchFromMainGoroutine())
	}
	os.Exit(m.Run())
}

// scratchFromMainGoroutine makes and enters the scratch namespace from the main
// goroutine with one P, so the goroutine the scratch namespace starts runs on the
// main thread (the main goroutine parks at once and hands the thread over), then
// says whether the main thread is back in the namespace it started in.
func scratchFromMainGoroutine() int {
	runtime.GOMAXPROCS(1)
	mainNS := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), os.Getpid())
	before, err := os.Readlink(mainNS)
	if err != nil {
		fmt.Println(err)
		return 2
	}
	var s scratchNS
	defer s.close()
	for range 3 {
		if err := s.run(func(int) error { return nil }); err != nil {
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

// TestScratchLeavesMainThreadAlone checks that the self-test's scratch namespace
// never keeps the process's main thread: the runtime cannot end that thread, so
// one left locked there would stay in the scratch namespace for the agent's life,
// and /proc/PID/ns/net, which tools such as `ip netns identify` and `nsenter -t`
// read, would name it instead of the agent's own namespace.
func TestScratchLeavesMainThreadAlone(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), mainThreadChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v: %s", err, strings.TrimSpace(string(out)))
	}
	t.Log(strings.TrimSpace(string(out)))
}
