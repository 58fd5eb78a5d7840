package netns_test

import (
	"os"
	"testing"

	"github.com/weir-lb/weir/internal/mainthread"
	"github.com/weir-lb/weir/internal/netns"
)

func TestMain(m *testing.M) {
	if os.Getenv(leaveEnv) != "" {
		os.Exit(leave())
	}
	mainthread.Child(func() error {
		ns, err := netns.New(testName("main"))
		if err != nil {
			return err
		}
		return ns.Close()
	})
	os.Exit(m.Run())
}

// TestNewLeavesMainThreadAlone checks that New never keeps the process's main
// thread in the namespace it made: the runtime cannot end that thread, so one
// left locked there would stay in the namespace for the process's life (and
// keep it alive after Close), and /proc/PID/ns/net would name it.
func TestNewLeavesMainThreadAlone(t *testing.T) {
	mainthread.Check(t)
}
