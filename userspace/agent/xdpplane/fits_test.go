package xdpplane

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// TestFitsServiceSlots: with every service slot of the real program held, Fits
// lets through the changes that take no new entry (an update in place, a rename
// that takes the old name's entry over) and refuses one that adds an entry
// before the old one leaves (a service moved to another VIP, a new service),
// naming the service and wrapping loader.ErrCapacity, before anything is
// written: what the plane's own writes would then fail on half-way.
func TestFitsServiceSlots(t *testing.T) {
	prog, err := loader.Load(loader.Options{})
	xdptest.Check(t, err)
	t.Cleanup(func() { prog.Close() })
	x := &Plane{prog: prog, links: map[int]string{}, installed: map[loader.ServiceKey]string{}}
	svc := func(name string, i int) plan.Service {
		vip := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), 80)
		b := config.Backend{Addr: netip.MustParseAddrPort("10.9.0.1:80"), MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, Weight: 1}
		return plan.Service{Config: config.Service{Name: name, VIP: vip, Protocol: config.TCP, Mode: config.ModeDSR, TableSize: 7, Backends: []config.Backend{b}},
			Placement: plan.Placement{Plane: plan.XDP}, Installed: true,
			Backends: []plan.Backend{{Config: b, Usable: true, Weight: 1, MAC: b.MAC}}}
	}
	capa := prog.Capacity()
	var running plan.Desired
	for i := range int(capa.Services) {
		s := svc(fmt.Sprintf("s%d", i), i)
		if err := x.Add(&s); err != nil {
			t.Fatalf("add service %d of %d: %v", i, capa.Services, err)
		}
		running.Services = append(running.Services, s)
	}
	first := &running.Services[0]
	weighted := *first
	weighted.Backends = []plan.Backend{first.Backends[0]}
	weighted.Backends[0].Weight = 2
	renamed := *first
	renamed.Config.Name = "renamed"
	moved := svc("s0", int(capa.Services)) // s0 at a VIP no service holds
	added := svc("new", int(capa.Services))
	for _, c := range []struct {
		name string
		ops  []plan.Op
		want string // "" fits
	}{
		{"update in place", []plan.Op{{Kind: plan.Update, Plane: plan.XDP, Prev: first, Next: &weighted}}, ""},
		{"rename", []plan.Op{{Kind: plan.Add, Plane: plan.XDP, Next: &renamed}, {Kind: plan.Remove, Plane: plan.XDP, Prev: first}}, ""},
		{"moved to another VIP", []plan.Op{{Kind: plan.Update, Plane: plan.XDP, Prev: first, Next: &moved}, {Kind: plan.Remove, Plane: plan.XDP, Prev: first}},
			fmt.Sprintf(`service "s0": the XDP program has %d service slots, all held at this point of the change (a service's entry at a new VIP or protocol is added before the old one is removed)`, capa.Services)},
		{"replaced", []plan.Op{{Kind: plan.Add, Plane: plan.XDP, Next: &added}, {Kind: plan.Remove, Plane: plan.XDP, Prev: first}},
			fmt.Sprintf(`service "new": the XDP program has %d service slots, all held`, capa.Services)},
		{"proxy ops", []plan.Op{{Kind: plan.Add, Plane: plan.Proxy, Next: &added}}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := x.Fits(running, c.ops)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("got %v; want it to fit", err)
			case c.want == "":
			case err == nil || !strings.HasPrefix(err.Error(), c.want) || !errors.Is(err, loader.ErrCapacity):
				t.Fatalf("got %v; want an error wrapping loader.ErrCapacity that begins %q", err, c.want)
			}
		})
	}
	// Fits writes nothing: the program holds what it held.
	if n := len(prog.Services()); n != int(capa.Services) {
		t.Errorf("after Fits: %d services in the program; want %d", n, capa.Services)
	}
	if x.installed[Key(&first.Config)] != "s0" {
		t.Errorf("after Fits: %s is %q's; want s0's", Key(&first.Config), x.installed[Key(&first.Config)])
	}
}

// TestFitsOneBackendCostsNothingMore: a change of one backend's state (a health
// check's, a drain's) takes no slot, and Fits lets it through without reading
// what the program holds: the loop runs it at every such change, and copying
// every service's backends each time cost a millisecond and megabytes at the
// program's 16,384. Its allocations stay the same however many services and
// backends the program holds.
func TestFitsOneBackendCostsNothingMore(t *testing.T) {
	prog, err := loader.Load(loader.Options{})
	xdptest.Check(t, err)
	t.Cleanup(func() { prog.Close() })
	x := &Plane{prog: prog, links: map[int]string{}, installed: map[loader.ServiceKey]string{}}
	svc := func(i, backends int) plan.Service {
		vip := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}), 80)
		s := plan.Service{Config: config.Service{Name: fmt.Sprintf("s%d", i), VIP: vip, Protocol: config.TCP, Mode: config.ModeDSR, TableSize: 1031},
			Placement: plan.Placement{Plane: plan.XDP}, Installed: true}
		for j := range backends {
			b := config.Backend{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 9, byte(j >> 8), byte(j)}), 80), MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, Weight: 1}
			s.Config.Backends = append(s.Config.Backends, b)
			s.Backends = append(s.Backends, plan.Backend{Config: b, Usable: true, Weight: 1, MAC: b.MAC})
		}
		if err := x.Add(&s); err != nil {
			t.Fatalf("add service %d: %v", i, err)
		}
		return s
	}
	first := svc(0, 1)
	down := first
	down.Backends = []plan.Backend{first.Backends[0]}
	down.Backends[0].Usable = false
	running := plan.Desired{Services: []plan.Service{first}}
	ops := []plan.Op{{Kind: plan.SetBackend, Plane: plan.XDP, Prev: &first, Next: &down, Backend: first.Backends[0].Config.Addr}}
	allocs := func() float64 {
		return testing.AllocsPerRun(20, func() {
			if err := x.Fits(running, ops); err != nil {
				t.Fatalf("one backend down: got %v; want it to fit", err)
			}
		})
	}
	alone := allocs()
	for i := 1; i < 8; i++ {
		running.Services = append(running.Services, svc(i, 256))
	}
	// One allocation of slack, for whatever else the process allocates meanwhile:
	// reading the program costs dozens (41 here).
	if full := allocs(); full > alone+1 {
		t.Errorf("Fits of one backend's change: %g allocations with 7 more services of 256 backends; want at most %g, as with one service of one backend", full, alone+1)
	}
}

// TestFitsStartCountsDroppedPinnedSlots: at a start on an adopted program, the
// services the program held that the file drops keep their slots until the
// start succeeds, and the refusal counts theirs alone: not those of a service
// the file keeps that the start has not reached yet (listed after the one
// where the slots run out), nor those of one it is taking over. Either way it
// gives a start's ways through, not a reload's.
func TestFitsStartCountsDroppedPinnedSlots(t *testing.T) {
	// svc is service i with the n backends numbered from first.
	svc := func(name string, i, first, n int) plan.Service {
		s := plan.Service{Config: config.Service{Name: name, VIP: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}), 80),
			Protocol: config.TCP, Mode: config.ModeDSR, TableSize: 65537}, Placement: plan.Placement{Plane: plan.XDP}, Installed: true}
		for j := first; j < first+n; j++ {
			b := config.Backend{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 9, byte(j >> 8), byte(j)}), 80), MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, Weight: 1}
			s.Config.Backends = append(s.Config.Backends, b)
			s.Backends = append(s.Backends, plan.Backend{Config: b, Usable: true, Weight: 1, MAC: b.MAC})
		}
		return s
	}
	// adopted is a plane on a program that holds pinned, as a run that
	// adopted it finds them.
	adopted := func(pinned ...*plan.Service) *Plane {
		prog, err := loader.Load(loader.Options{})
		xdptest.Check(t, err)
		t.Cleanup(func() { prog.Close() })
		x := &Plane{prog: prog, links: map[int]string{}, installed: map[loader.ServiceKey]string{}}
		for _, s := range pinned {
			if err := x.Add(s); err != nil {
				t.Fatal(err)
			}
		}
		x.installed, x.adopted = map[loader.ServiceKey]string{}, map[loader.ServiceKey]bool{}
		for _, s := range pinned {
			x.adopted[Key(&s.Config)] = true
		}
		return x
	}
	add := func(ss ...*plan.Service) (ops []plan.Op) {
		for _, s := range ss {
			ops = append(ops, plan.Op{Kind: plan.Add, Plane: plan.XDP, Next: s})
		}
		return ops
	}
	const backends = 16384 // config.MaxXDPBackends, the program's
	ways := "start with the file the program was loaded with and reload to this one"
	kept, dropped := svc("kept", 1, 0, 3), svc("dropped", 2, 3, 3)
	// The file needs one slot less than the program has; dropped's 3 are too many.
	big := svc("big", 3, 100, backends-3-1)
	// kept's backends replaced: its new ones are taken before its old ones free
	// theirs, as in a reload.
	bigger, replaced := svc("big", 3, 100, backends-3), svc("kept", 1, 6, 3)
	for _, c := range []struct {
		name    string
		pinned  []*plan.Service
		ops     []plan.Op
		want    string
		wantNot string
	}{
		{"a kept service after", []*plan.Service{&kept, &dropped}, add(&big, &kept),
			`service "big": the XDP program has 16384 backend slots, and this start needs 16386 at once: 6 held, 16380 more for this service's new backends; 3 of the held backend slots are held by services of the pinned program that this file drops`, ""},
		{"a kept service replacing its backends", []*plan.Service{&kept}, add(&bigger, &replaced),
			`service "kept": the XDP program has 16384 backend slots, and this start needs 16387 at once: 16384 held, 3 more for this service's new backends: ` + ways, "held by services of the pinned program"},
	} {
		t.Run(c.name, func(t *testing.T) {
			x := adopted(c.pinned...)
			if got := x.prog.Capacity().Backends; got != backends {
				t.Fatalf("the program has %d backend slots; this test wants %d", got, backends)
			}
			err := x.Fits(plan.Desired{}, c.ops)
			if err == nil || !strings.HasPrefix(err.Error(), c.want) || !strings.Contains(err.Error(), ways) || !errors.Is(err, loader.ErrCapacity) ||
				c.wantNot != "" && strings.Contains(err.Error(), c.wantNot) {
				t.Fatalf("got %v; want an error wrapping loader.ErrCapacity that begins %q and says %q", err, c.want, ways)
			}
		})
	}
}
