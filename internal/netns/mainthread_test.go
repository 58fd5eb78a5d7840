package netns

import (
	"fmt"
	"os"
	"testing"

	"github.com/weir-lb/weir/internal/mainthread"
)

func TestMain(m *testing.M) {
	seq := 0
	mainthread.Child(func() error {
		seq++
		ns, err := New(fmt.Sprintf("weirnstest%d-main%d", os.Getpid(), seq))
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
