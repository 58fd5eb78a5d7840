package agent

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"testing"

	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// recordingPlane stands in for a data plane (XDP and the proxy need a kernel and
// sockets; this test is about the loop's rollback alone): it keeps the services it
// was given and fails the operation failOn names, after applying it, as a partial
// write would.
type recordingPlane struct {
	services map[string]plan.Service
	failOn   string // "add a", "update b", ...
}

func (p *recordingPlane) fail(kind plan.OpKind, name string) error {
	if p.failOn == fmt.Sprintf("%s %s", kind, name) {
		return errors.New("injected failure")
	}
	return nil
}

func (p *recordingPlane) Add(s *plan.Service) error {
	p.services[s.Name()] = *s
	return p.fail(plan.Add, s.Name())
}

func (p *recordingPlane) Update(_, next *plan.Service) error {
	p.services[next.Name()] = *next
	return p.fail(plan.Update, next.Name())
}

func (p *recordingPlane) SetBackend(_, next *plan.Service, _ netip.AddrPort) error {
	p.services[next.Name()] = *next
	return p.fail(plan.SetBackend, next.Name())
}

func (p *recordingPlane) Remove(s *plan.Service) error {
	delete(p.services, s.Name())
	return p.fail(plan.Remove, s.Name())
}

// TestReconcileRollsBack: whichever write fails, the planes end up running the
// previous desired state again, and the error is returned.
func TestReconcileRollsBack(t *testing.T) {
	svc := func(name string, plane plan.Plane, weights ...uint32) plan.Service {
		s := plan.Service{Config: config.Service{Name: name, VIP: netip.MustParseAddrPort("192.0.2.1:80")},
			Placement: plan.Placement{Plane: plane}, Installed: true}
		for i, w := range weights {
			addr := netip.AddrPortFrom(netip.MustParseAddr("192.0.2.10"), uint16(80+i))
			s.Config.Backends = append(s.Config.Backends, config.Backend{Addr: addr, Weight: w})
			s.Backends = append(s.Backends, plan.Backend{ID: plan.ID(name, addr), Config: s.Config.Backends[i], Weight: w, Usable: true})
		}
		return s
	}
	prev := plan.Desired{Services: []plan.Service{
		svc("web", plan.Proxy, 1, 1),
		svc("dns", plan.XDP, 1, 1),
		svc("old", plan.XDP, 1),
		svc("moves", plan.XDP, 1),
	}}
	overridden := svc("dns", plan.XDP, 1, 1)
	overridden.Backends = slices.Clone(overridden.Backends)
	overridden.Backends[1].Weight, overridden.Backends[1].Override = 5, true
	next := plan.Desired{Services: []plan.Service{
		svc("web", plan.Proxy, 2, 1, 1), // backend added: update
		overridden,                      // one weight at runtime: set-backend
		svc("new", plan.XDP, 1),         // added
		svc("moves", plan.Proxy, 1),     // to the proxy: add there, remove from XDP
	}}
	for _, failOn := range []string{"add moves", "update web", "set-backend dns", "add new", "remove old", "remove moves"} {
		t.Run(failOn, func(t *testing.T) {
			planes := map[plan.Plane]*recordingPlane{plan.XDP: {services: map[string]plan.Service{}}, plan.Proxy: {services: map[string]plan.Service{}}}
			for _, s := range prev.Services {
				planes[s.Plane].services[s.Name()] = s
			}
			a := &Agent{log: slog.New(slog.NewTextHandler(io.Discard, nil)), planes: map[plan.Plane]Plane{}}
			for k, p := range planes {
				a.planes[k] = p
			}
			planeOf := map[string]plan.Plane{"add moves": plan.Proxy, "update web": plan.Proxy, "remove moves": plan.XDP}
			pl, ok := planeOf[failOn]
			if !ok {
				pl = plan.XDP
			}
			planes[pl].failOn = failOn

			err := a.reconcile(prev, next)
			if err == nil {
				t.Fatal("reconcile: got no error; want the injected failure")
			}
			for kind, p := range planes {
				want := map[string]plan.Service{}
				for _, s := range prev.Services {
					if s.Plane == kind {
						want[s.Name()] = s
					}
				}
				if !reflect.DeepEqual(p.services, want) {
					t.Errorf("%s plane after the rollback: got %v; want %v", kind, slices.Sorted(maps.Keys(p.services)), slices.Sorted(maps.Keys(want)))
					for name, s := range p.services {
						if w, ok := want[name]; ok && !reflect.DeepEqual(s, w) {
							t.Errorf("%s plane, service %s: got %+v; want %+v", kind, name, s.Backends, w.Backends)
						}
					}
				}
			}
		})
	}
	t.Run("no failure", func(t *testing.T) {
		planes := map[plan.Plane]*recordingPlane{plan.XDP: {services: map[string]plan.Service{}}, plan.Proxy: {services: map[string]plan.Service{}}}
		for _, s := range prev.Services {
			planes[s.Plane].services[s.Name()] = s
		}
		a := &Agent{log: slog.New(slog.NewTextHandler(io.Discard, nil)), planes: map[plan.Plane]Plane{plan.XDP: planes[plan.XDP], plan.Proxy: planes[plan.Proxy]}}
		if err := a.reconcile(prev, next); err != nil {
			t.Fatal(err)
		}
		for kind, p := range planes {
			var got []string
			for _, name := range slices.Sorted(maps.Keys(p.services)) {
				got = append(got, name)
			}
			var want []string
			for _, s := range next.Services {
				if s.Plane == kind {
					want = append(want, s.Name())
				}
			}
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Errorf("%s plane: got %v; want %v", kind, got, want)
			}
		}
	})
}
