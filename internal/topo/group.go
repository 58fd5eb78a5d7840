package topo

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/xdpenv"
)

// TB is what NewT, NewRoutedT and NewTwoArmedT need of a test; *testing.T and
// *testing.B have it. The package declares it rather than importing testing,
// so the weir binary, whose demo builds on this package, does not link testing.
type TB interface {
	Helper()
	Cleanup(func())
	Errorf(format string, args ...any)
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	Skipf(format string, args ...any)
}

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
// when WEIR_REQUIRE_XDP=1 (see xdpenv); any other error fails the test.
func newT[T interface{ Close() error }](tb TB, build func() (T, error)) T {
	tb.Helper()
	t, err := build()
	if err != nil {
		xdpenv.Check(tb, err)
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
