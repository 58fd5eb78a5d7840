package netns

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
)

const mainThreadChildEnv = "WEIR_NETNS_MAIN_THREAD_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(mainThreadChildEnv) == "1" {
		os.Exit(newFromMainGoroutine())
	}
	os.Exit(m.Run())
}

// newFromMainGoroutine makes namespaces from the main goroutine with one P, so
// the goroutine that New starts runs on the main thread (the main goroutine
// parks at once and hands the thread over), then says whether the main thread
// is back in the namespace it started in.
func newFromMainGoroutine() int {
	runtime.GOMAXPROCS(1)
	mainNS := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), os.Getpid())
	before, err := os.Readlink(mainNS)
	if err != nil {
		fmt.Println(err)
		return 2
	}
	for i := range 3 {
		ns, err := New(fmt.Sprintf("weirnstest%d-main%d", os.Getpid(), i))
		if err != nil {
			fmt.Println(err)
			return 2
		}
		if err := ns.Close(); err != nil {
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

// TestNewLeavesMainThreadAlone checks that New never keeps the process's main
// thread in the namespace it made: the runtime cannot end that thread, so one
// left locked there would stay in the namespace for the process's life (and
// keep it alive after Close), and /proc/PID/ns/net would name it.
func TestNewLeavesMainThreadAlone(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), mainThreadChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v: %s", err, strings.TrimSpace(string(out)))
	}
	t.Log(strings.TrimSpace(string(out)))
}
