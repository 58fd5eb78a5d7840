package xdpplane

import (
	"os"
	"testing"

	"github.com/weir-lb/weir/internal/mainthread"
)

func TestMain(m *testing.M) {
	var s scratchNS
	mainthread.Child(func() error { return s.run(func(int) error { return nil }) })
	os.Exit(m.Run())
}

// TestScratchLeavesMainThreadAlone checks that the self-test's scratch namespace
// never keeps the process's main thread: the runtime cannot end that thread, so
// one left locked there would stay in the scratch namespace for the agent's life,
// and /proc/PID/ns/net, which tools such as `ip netns identify` and `nsenter -t`
// read, would name it instead of the agent's own namespace.
func TestScratchLeavesMainThreadAlone(t *testing.T) {
	mainthread.Check(t)
}
