package topo

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/xdptest"
)

// group owns what a topology built from plain veth pairs creates: its namespaces
// (named <name>-<role>, removed in reverse order) and the XDP_PASS program its
// receiving links carry.
type group struct {
	name       string
	namespaces []*netns.NS
	pass       *ebpf.Program
	closeOnce  sync.Once
	closeErr   error
}

func (g *group) newNS(role string) (*netns.NS, error) {
	ns, err := netns.New(g.name + "-" + role)
	if err != nil {
		return nil, fmt.Errorf("topology %s: %w", g.name, err)
	}
	g.namespaces = append(g.namespaces, ns)
	return ns, nil
}

func (g *group) loadPass() error {
	var err error
	if g.pass, err = passProgram(); err != nil {
		return fmt.Errorf("topology %s: %w", g.name, err)
	}
	return nil
}

// Close removes the namespaces (and with them the links) and the XDP_PASS program.
// It is idempotent.
func (g *group) Close() error {
	g.closeOnce.Do(func() {
		var errs []error
		for i := len(g.namespaces) - 1; i >= 0; i-- {
			errs = append(errs, g.namespaces[i].Close())
		}
		if g.pass != nil {
			errs = append(errs, g.pass.Close())
		}
		g.closeErr = errors.Join(errs...)
	})
	return g.closeErr
}

// newT builds a topology for a test and closes it at cleanup. If the machine cannot
// build it for lack of privileges or kernel support, the test is skipped, or fails
// when WEIR_REQUIRE_XDP=1 (see xdptest); any other error fails the test.
func newT[T interface{ Close() error }](tb testing.TB, build func() (T, error)) T {
	tb.Helper()
	t, err := build()
	if err != nil {
		xdptest.Check(tb, err)
		var zero T
		return zero
	}
	tb.Cleanup(func() {
		if err := t.Close(); err != nil {
			tb.Errorf("close topology: %v", err)
		}
	})
	return t
}
