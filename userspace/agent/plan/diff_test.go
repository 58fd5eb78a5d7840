package plan

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/config"
)

var addrD = netip.MustParseAddrPort("10.0.0.4:80")

// desiredService is a service as Plan makes it when every backend is up.
func desiredService(plane Plane, cs config.Service) Service {
	s := Service{Config: cs, Placement: Placement{Plane: plane, Why: "test"}, Installed: true}
	for _, cb := range cs.Backends {
		s.Backends = append(s.Backends, Backend{ID: ID(cs.Name, cb.Addr), Config: cb, Health: health.Up,
			Healthy: true, Usable: true, Weight: cb.Weight, Drained: cb.Drain, Kept: true})
	}
	return s
}

// clone copies s deeply enough that changing the copy's backends, leavers or
// configured backends leaves s alone.
func clone(s Service) Service {
	s.Config.Backends = slices.Clone(s.Config.Backends)
	s.Backends = slices.Clone(s.Backends)
	s.Leaving = slices.Clone(s.Leaving)
	return s
}

// with is a clone of s changed by mod.
func with(s Service, mod func(*Service)) Service {
	s = clone(s)
	mod(&s)
	return s
}

func desired(services ...Service) Desired { return Desired{Services: services} }

// op is what a test expects of an Op.
type op struct {
	kind    OpKind
	plane   Plane
	service string
	backend netip.AddrPort
}

func (o op) String() string {
	s := fmt.Sprintf("%s %s %s", o.plane, o.kind, o.service)
	if o.backend.IsValid() {
		s += " " + o.backend.String()
	}
	return s
}

func TestDiff(t *testing.T) {
	web := desiredService(XDP, cfgService("web", vip1, addrA, addrB, addrC))
	webProxy := with(web, func(s *Service) { s.Plane = Proxy })
	api := desiredService(Proxy, cfgService("api", vip2, addrA))
	leaver := web.Backends[2]
	leaver.Drained, leaver.Until = true, t0.Add(time.Minute)
	webLeaving := with(web, func(s *Service) {
		s.Config.Backends = s.Config.Backends[:2]
		s.Backends = s.Backends[:2]
		s.Leaving = []Backend{leaver}
	})

	tests := []struct {
		name       string
		prev, next Desired
		want       []op
	}{
		{"empty", desired(), desired(), nil},
		{"identical", desired(web, api), desired(clone(web), clone(api)), nil},
		{"identical leavers", desired(webLeaving), desired(clone(webLeaving)), nil},

		{"added, xdp", desired(), desired(web), []op{{Add, XDP, "web", netip.AddrPort{}}}},
		{"added, proxy", desired(), desired(api), []op{{Add, Proxy, "api", netip.AddrPort{}}}},
		{"removed, xdp", desired(web), desired(), []op{{Remove, XDP, "web", netip.AddrPort{}}}},
		{"removed, proxy", desired(api), desired(), []op{{Remove, Proxy, "api", netip.AddrPort{}}}},

		{"mode changed", desired(web), desired(with(web, func(s *Service) { s.Config.Mode = config.ModeTunnel })),
			[]op{{Update, XDP, "web", netip.AddrPort{}}}},
		// The new entry is written with the updates; the old one, with its flows,
		// leaves with the removals, after every write that may fail.
		{"VIP changed", desired(web), desired(with(web, func(s *Service) { s.Config.VIP = vip2 })),
			[]op{{Update, XDP, "web", netip.AddrPort{}}, {Remove, XDP, "web", netip.AddrPort{}}}},
		{"proxy setting changed", desired(api), desired(with(api, func(s *Service) { s.Config.Proxy.Retries = 3 })),
			[]op{{Update, Proxy, "api", netip.AddrPort{}}}},
		{"moved xdp to proxy", desired(web), desired(webProxy),
			[]op{{Add, Proxy, "web", netip.AddrPort{}}, {Remove, XDP, "web", netip.AddrPort{}}}},
		{"moved proxy to xdp", desired(webProxy), desired(web),
			[]op{{Add, XDP, "web", netip.AddrPort{}}, {Remove, Proxy, "web", netip.AddrPort{}}}},

		{"backend added", desired(web), desired(with(web, func(s *Service) {
			cb := cfgBackend(addrD)
			s.Config.Backends = append(s.Config.Backends, cb)
			s.Backends = append(s.Backends, desiredService(XDP, cfgService("web", vip1, addrD)).Backends[0])
		})), []op{{Update, XDP, "web", netip.AddrPort{}}}},
		{"backend removed", desired(web), desired(with(web, func(s *Service) {
			s.Config.Backends = s.Config.Backends[:2]
			s.Backends = s.Backends[:2]
		})), []op{{Update, XDP, "web", netip.AddrPort{}}}},

		{"weight changed", desired(web), desired(with(web, func(s *Service) {
			s.Backends[1].Weight, s.Backends[1].Override = 9, true
		})), []op{{SetBackend, XDP, "web", addrB}}},
		{"drained", desired(web), desired(with(web, func(s *Service) {
			s.Backends[2].Drained, s.Backends[2].Override = true, true
		})), []op{{SetBackend, XDP, "web", addrC}}},
		{"became unusable", desired(web), desired(with(web, func(s *Service) {
			b := &s.Backends[0]
			b.Health, b.Healthy, b.Usable = health.Down, false, false
		})), []op{{SetBackend, XDP, "web", addrA}}},
		{"became usable, proxy", desired(with(api, func(s *Service) { s.Backends[0].Usable = false })), desired(api),
			[]op{{SetBackend, Proxy, "api", addrA}}},
		{"MAC resolved", desired(web), desired(with(web, func(s *Service) { s.Backends[1].MAC = macA })),
			[]op{{SetBackend, XDP, "web", addrB}}},
		{"two backends changed", desired(web), desired(with(web, func(s *Service) {
			s.Backends[0].Usable = false
			s.Backends[2].Usable = false
		})), []op{{Update, XDP, "web", netip.AddrPort{}}}},
		{"weight of one, drain of another", desired(web), desired(with(web, func(s *Service) {
			s.Backends[0].Weight = 3
			s.Backends[1].Drained = true
		})), []op{{Update, XDP, "web", netip.AddrPort{}}}},

		{"health state name only", desired(web), desired(with(web, func(s *Service) {
			s.Backends[0].Health = health.Down // panic mode: still usable
		})), nil},
		{"healthy only (keep_last keeps it)", desired(web), desired(with(web, func(s *Service) {
			s.Backends[0].Health, s.Backends[0].Healthy = health.Down, false
		})), nil},
		{"note only", desired(web), desired(with(web, func(s *Service) { s.Note = noteDrained })), nil},
		{"status only", desired(web), desired(with(web, func(s *Service) {
			s.Why = "self-test passed"
			s.Backends[0].MACErr = "no neighbour entry"
			s.Backends[1].Kept = false
			s.Backends[2].Override = true
		})), nil},

		{"installed flips", desired(web), desired(with(web, func(s *Service) { s.Installed = false })),
			[]op{{Update, XDP, "web", netip.AddrPort{}}}},
		{"installed flips with one backend (all_down: pass)", desired(with(web, func(s *Service) {
			s.Config.AllDown = config.AllDownPass
			s.Config.Backends, s.Backends = s.Config.Backends[:1], s.Backends[:1]
			s.Backends[0].Usable, s.Installed, s.AllDown = false, false, true
		})), desired(with(web, func(s *Service) {
			s.Config.AllDown = config.AllDownPass
			s.Config.Backends, s.Backends = s.Config.Backends[:1], s.Backends[:1]
		})), []op{{Update, XDP, "web", netip.AddrPort{}}}},

		{"leaver added", desired(web), desired(webLeaving), []op{{Update, XDP, "web", netip.AddrPort{}}}},
		{"leaver gone", desired(webLeaving), desired(with(webLeaving, func(s *Service) { s.Leaving = nil })),
			[]op{{Update, XDP, "web", netip.AddrPort{}}}},
		{"leaver changed", desired(webLeaving), desired(with(webLeaving, func(s *Service) { s.Leaving[0].Usable = false })),
			[]op{{Update, XDP, "web", netip.AddrPort{}}}},
		{"leaver's health changed", desired(webLeaving), desired(with(webLeaving, func(s *Service) { s.Leaving[0].Healthy = false })),
			[]op{{Update, XDP, "web", netip.AddrPort{}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkDiff(t, tt.prev, tt.next, tt.want)
		})
	}
}

// Proxy adds and updates go first, then XDP's, then every removal: services that
// changed plane in next's order, then those gone in prev's.
func TestDiffOrder(t *testing.T) {
	svc := func(name string, plane Plane) Service {
		return desiredService(plane, cfgService(name, vip1, addrA, addrB))
	}
	xUpd, pSet := svc("x-upd", XDP), svc("p-set", Proxy)
	xGone, pGone := svc("x-gone", XDP), svc("p-gone", Proxy)
	toProxy, toXDP := svc("to-proxy", XDP), svc("to-xdp", Proxy)
	same := svc("same", XDP)
	prev := desired(pGone, toProxy, xUpd, same, pSet, xGone, toXDP)
	next := desired(
		with(xUpd, func(s *Service) { s.Config.Mode = config.ModeDSR }),
		svc("x-new", XDP),
		with(toProxy, func(s *Service) { s.Plane = Proxy }),
		clone(same),
		with(pSet, func(s *Service) { s.Backends[1].Usable = false }),
		with(toXDP, func(s *Service) { s.Plane = XDP }),
		svc("p-new", Proxy),
	)
	checkDiff(t, prev, next, []op{
		{Add, Proxy, "to-proxy", netip.AddrPort{}},
		{SetBackend, Proxy, "p-set", addrB},
		{Add, Proxy, "p-new", netip.AddrPort{}},
		{Update, XDP, "x-upd", netip.AddrPort{}},
		{Add, XDP, "x-new", netip.AddrPort{}},
		{Add, XDP, "to-xdp", netip.AddrPort{}},
		{Remove, XDP, "to-proxy", netip.AddrPort{}},
		{Remove, Proxy, "to-xdp", netip.AddrPort{}},
		{Remove, Proxy, "p-gone", netip.AddrPort{}},
		{Remove, XDP, "x-gone", netip.AddrPort{}},
	})
}

// checkDiff checks Diff(prev, next) against want, and that each op points at the
// right states: Prev into prev, Next into next, on the plane they are on.
func checkDiff(t *testing.T, prev, next Desired, want []op) {
	t.Helper()
	ops := Diff(prev, next)
	var got []op
	for _, o := range ops {
		got = append(got, op{o.Kind, o.Plane, o.Service(), o.Backend})
	}
	if !slices.Equal(got, want) {
		t.Fatalf("got %v; want %v", got, want)
	}
	for _, o := range ops {
		p, n := prev.Service(o.Service()), next.Service(o.Service())
		wantPrev, wantNext := p, n
		switch o.Kind {
		case Add:
			wantPrev = nil
		case Remove:
			wantNext = nil
		}
		if o.Prev != wantPrev {
			t.Errorf("%v: Prev: got %p; want %p", o, o.Prev, wantPrev)
		}
		if o.Next != wantNext {
			t.Errorf("%v: Next: got %p; want %p", o, o.Next, wantNext)
		}
		if o.Prev != nil && o.Kind == Remove && o.Plane != o.Prev.Plane {
			t.Errorf("%v: plane: got %s; want prev's %s", o, o.Plane, o.Prev.Plane)
		}
		if o.Next != nil && o.Plane != o.Next.Plane {
			t.Errorf("%v: plane: got %s; want next's %s", o, o.Plane, o.Next.Plane)
		}
		if o.Kind == Update || o.Kind == SetBackend {
			if o.Prev.Plane != o.Next.Plane {
				t.Errorf("%v: prev plane %s, next plane %s; want the same", o, o.Prev.Plane, o.Next.Plane)
			}
		}
	}
	// Diff only reads: applying it twice gives the same answer.
	if again := Diff(prev, next); len(again) != len(ops) {
		t.Errorf("second Diff: got %d ops; want %d", len(again), len(ops))
	}
}

// Plan then Diff, as the agent runs them: what each kind of event asks of the
// planes.
func TestPlanDiff(t *testing.T) {
	two := cfgService("web", vip1, addrA, addrB)
	one := cfgService("web", vip1, addrA)
	onePass := cfgService("web", vip1, addrA)
	onePass.AllDown = config.AllDownPass
	keepLast := cfgService("web", vip1, addrA, addrB)
	keepLast.AllDown = config.AllDownKeepLast
	type step struct {
		svc    config.Service
		health map[netip.AddrPort]Health // missing: up
		ovr    map[netip.AddrPort]Override
		at     time.Duration
	}
	none := netip.AddrPort{}
	tests := []struct {
		name       string
		prev, next step
		want       []op
	}{
		{"nothing changed", step{svc: two}, step{svc: two, at: time.Second}, nil},
		{"a backend goes down", step{svc: two}, step{svc: two, health: map[netip.AddrPort]Health{addrB: down}},
			[]op{{SetBackend, XDP, "web", addrB}}},
		{"the only backend goes down (drop)", step{svc: one}, step{svc: one, health: map[netip.AddrPort]Health{addrA: down}},
			[]op{{SetBackend, XDP, "web", addrA}}},
		{"the only backend goes down (pass)", step{svc: onePass}, step{svc: onePass, health: map[netip.AddrPort]Health{addrA: down}},
			[]op{{Update, XDP, "web", none}}},
		{"the only backend comes back (pass)", step{svc: onePass, health: map[netip.AddrPort]Health{addrA: down}}, step{svc: onePass},
			[]op{{Update, XDP, "web", none}}},
		{"the last usable one goes down (keep_last)",
			step{svc: keepLast, health: map[netip.AddrPort]Health{addrB: down}},
			step{svc: keepLast, health: map[netip.AddrPort]Health{addrA: down, addrB: down}}, nil},
		{"weight override", step{svc: two}, step{svc: two, ovr: map[netip.AddrPort]Override{addrA: {Weight: 4, SetWeight: true}}},
			[]op{{SetBackend, XDP, "web", addrA}}},
		{"drain override", step{svc: two}, step{svc: two, ovr: map[netip.AddrPort]Override{addrB: {Drain: true, SetDrain: true}}},
			[]op{{SetBackend, XDP, "web", addrB}}},
		{"health state changes, usability does not (panic)",
			step{svc: two, health: map[netip.AddrPort]Health{addrA: {State: health.Down, Usable: true}}},
			step{svc: two, health: map[netip.AddrPort]Health{addrA: {State: health.Unknown, Usable: true}}}, nil},
		{"reload removes a backend", step{svc: two}, step{svc: one}, []op{{Update, XDP, "web", none}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			run := func(st step, prev Desired) Desired {
				in := input(XDP, st.svc)
				in.Now = t0.Add(st.at)
				for _, cb := range st.svc.Backends {
					h, ok := st.health[cb.Addr]
					if !ok {
						h = up
					}
					in.Health[ID("web", cb.Addr)] = h
				}
				for a, o := range st.ovr {
					in.Overrides[ID("web", a)] = o
				}
				return Plan(in, prev)
			}
			prev := run(tt.prev, Desired{})
			checkDiff(t, prev, run(tt.next, prev), tt.want)
		})
	}
}

// A leaver's time running out is an Update with nothing else changed; time passing
// before it is nothing.
func TestPlanDiffLeaverExpires(t *testing.T) {
	steps := []struct {
		svc  config.Service
		at   time.Duration
		want []op
	}{
		{cfgService("web", vip1, addrA, addrB), 0, []op{{Add, XDP, "web", netip.AddrPort{}}}},
		{cfgService("web", vip1, addrA), time.Second, []op{{Update, XDP, "web", netip.AddrPort{}}}},
		{cfgService("web", vip1, addrA), 30 * time.Second, nil},
		{cfgService("web", vip1, addrA), 31 * time.Second, []op{{Update, XDP, "web", netip.AddrPort{}}}},
		{cfgService("web", vip1, addrA), 40 * time.Second, nil},
	}
	var prev Desired
	for i, st := range steps {
		in := input(XDP, st.svc)
		in.Now = t0.Add(st.at)
		next := Plan(in, prev)
		t.Run(fmt.Sprintf("step %d", i), func(t *testing.T) { checkDiff(t, prev, next, st.want) })
		prev = next
	}
}

func TestOpString(t *testing.T) {
	web := desiredService(XDP, cfgService("web", vip1, addrA))
	tests := []struct {
		op   Op
		want string
	}{
		{Op{Kind: Add, Plane: Proxy, Next: &web}, "proxy add web"},
		{Op{Kind: Update, Plane: XDP, Prev: &web, Next: &web}, "xdp update web"},
		{Op{Kind: SetBackend, Plane: XDP, Prev: &web, Next: &web, Backend: addrA}, "xdp set-backend web 10.0.0.1:80"},
		{Op{Kind: Remove, Plane: XDP, Prev: &web}, "xdp remove web"},
		{Op{Kind: OpKind(9), Plane: XDP, Prev: &web}, "xdp OpKind(9) web"},
	}
	for _, tt := range tests {
		t.Run(tt.want, func(t *testing.T) {
			if got := tt.op.String(); got != tt.want {
				t.Errorf("got %q; want %q", got, tt.want)
			}
		})
	}
}
