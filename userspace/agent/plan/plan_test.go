package plan

import (
	"bytes"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/config"
)

const (
	noteDrop     = "every backend is down: new flows are dropped (all_down: drop)"
	notePassXDP  = "every backend is down: packets pass to the host's stack (all_down: pass)"
	notePassProx = "every backend is down: the proxy closes new connections (all_down: pass is XDP only)"
	noteKeep     = "every backend is down: keeping the last usable ones (all_down: keep_last)"
	noteKeepNone = "every backend is down and none was ever usable: dropping (all_down: keep_last)"
	noteDrained  = "every usable backend is drained: new flows are refused, established ones continue"
)

func TestPlanHealth(t *testing.T) {
	tests := []struct {
		name        string
		health      *Health // nil: missing from Input.Health
		initial     config.Initial
		wantState   health.State
		wantHealthy bool
	}{
		{"reported up", &up, config.InitialDown, health.Up, true},
		{"reported down", &down, config.InitialUp, health.Down, false},
		{"reported unknown", &Health{State: health.Unknown}, config.InitialUp, health.Unknown, false},
		{"reported ejected", &Health{State: health.Ejected}, config.InitialUp, health.Ejected, false},
		{"panic: down but usable", &Health{State: health.Down, Usable: true}, config.InitialUp, health.Down, true},
		{"missing, initial up", nil, config.InitialUp, health.Up, true},
		{"missing, initial down", nil, config.InitialDown, health.Down, false},
		{"missing, initial unknown", nil, config.InitialUnknown, health.Unknown, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA)
			cs.Backends[0].Initial = tt.initial
			in := input(XDP, cs)
			if tt.health != nil {
				in.Health[ID("web", addrA)] = *tt.health
			}
			s := planOne(t, in, Desired{})
			b := mustBackend(t, &s, addrA)
			if b.ID != "web/10.0.0.1:80" {
				t.Errorf("ID: got %q; want %q", b.ID, "web/10.0.0.1:80")
			}
			if b.Health != tt.wantState {
				t.Errorf("Health: got %v; want %v", b.Health, tt.wantState)
			}
			if b.Healthy != tt.wantHealthy {
				t.Errorf("Healthy: got %v; want %v", b.Healthy, tt.wantHealthy)
			}
			if b.Usable != tt.wantHealthy {
				t.Errorf("Usable: got %v; want %v", b.Usable, tt.wantHealthy)
			}
			if s.AllDown != !tt.wantHealthy {
				t.Errorf("AllDown: got %v; want %v", s.AllDown, !tt.wantHealthy)
			}
		})
	}
}

// With health type none a backend missing from Input.Health is usable whatever its
// initial state.
func TestPlanHealthNone(t *testing.T) {
	for _, initial := range []config.Initial{config.InitialUp, config.InitialDown, config.InitialUnknown} {
		t.Run(string(initial), func(t *testing.T) {
			cs := cfgService("web", vip1, addrA)
			cs.Health.Type = config.CheckNone
			cs.Backends[0].Initial = initial
			s := planOne(t, input(XDP, cs), Desired{})
			b := mustBackend(t, &s, addrA)
			if !b.Healthy || !b.Usable {
				t.Errorf("Healthy, Usable: got %v, %v; want true, true", b.Healthy, b.Usable)
			}
			if s.AllDown {
				t.Errorf("AllDown: got true; want false")
			}
		})
	}
}

// Panic mode: health reports every backend Down but usable; the service is not all
// down.
func TestPlanPanic(t *testing.T) {
	cs := cfgService("web", vip1, addrA, addrB, addrC)
	in := input(XDP, cs)
	in.Health[ID("web", addrA)] = Health{State: health.Down, Usable: true}
	in.Health[ID("web", addrB)] = Health{State: health.Down, Usable: true}
	in.Health[ID("web", addrC)] = Health{State: health.Up, Usable: true}
	s := planOne(t, in, Desired{})
	if got, want := usable(&s), "[10.0.0.1:80 10.0.0.2:80 10.0.0.3:80]"; got != want {
		t.Errorf("usable: got %s; want %s", got, want)
	}
	if s.AllDown || s.Note != "" {
		t.Errorf("AllDown, Note: got %v, %q; want false, \"\"", s.AllDown, s.Note)
	}
}

func TestPlanOverrides(t *testing.T) {
	tests := []struct {
		name         string
		cfgWeight    uint32
		cfgDrain     bool
		override     *Override
		wantWeight   uint32
		wantDrained  bool
		wantOverride bool
	}{
		{"none", 5, false, nil, 5, false, false},
		{"none, drained in file", 5, true, nil, 5, true, false},
		{"weight", 5, false, &Override{Weight: 9, SetWeight: true}, 9, false, true},
		{"weight to 0", 5, false, &Override{Weight: 0, SetWeight: true}, 0, false, true},
		{"drain", 5, false, &Override{Drain: true, SetDrain: true}, 5, true, true},
		{"undrain what the file drains", 5, true, &Override{Drain: false, SetDrain: true}, 5, false, true},
		{"weight and drain", 5, false, &Override{Weight: 2, SetWeight: true, Drain: true, SetDrain: true}, 2, true, true},
		{"values without Set flags", 5, false, &Override{Weight: 9, Drain: true}, 5, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA, addrB)
			cs.Backends[0].Weight = tt.cfgWeight
			cs.Backends[0].Drain = tt.cfgDrain
			in := input(XDP, cs)
			if tt.override != nil {
				in.Overrides[ID("web", addrA)] = *tt.override
			}
			s := planOne(t, in, Desired{})
			b := mustBackend(t, &s, addrA)
			if b.Weight != tt.wantWeight {
				t.Errorf("Weight: got %d; want %d", b.Weight, tt.wantWeight)
			}
			if b.Drained != tt.wantDrained {
				t.Errorf("Drained: got %v; want %v", b.Drained, tt.wantDrained)
			}
			if b.Override != tt.wantOverride {
				t.Errorf("Override: got %v; want %v", b.Override, tt.wantOverride)
			}
			if b.Config.Weight != tt.cfgWeight || b.Config.Drain != tt.cfgDrain {
				t.Errorf("Config weight, drain: got %d, %v; want %d, %v (the file's)",
					b.Config.Weight, b.Config.Drain, tt.cfgWeight, tt.cfgDrain)
			}
			other := mustBackend(t, &s, addrB)
			if other.Override || other.Weight != 1 || other.Drained {
				t.Errorf("other backend: got override %v weight %d drained %v; want false 1 false",
					other.Override, other.Weight, other.Drained)
			}
			if want := uint64(tt.wantWeight) + 1; s.WeightSum() != want {
				t.Errorf("WeightSum: got %d; want %d", s.WeightSum(), want)
			}
		})
	}
}

func TestPlanMAC(t *testing.T) {
	tests := []struct {
		name       string
		plane      Plane
		mode       config.Mode
		cfgMAC     net.HardwareAddr
		resolved   *MAC // Input.MACs for the backend's address; nil: none
		wantUsable bool
		wantMAC    net.HardwareAddr
		wantErr    string
	}{
		{"xdp dsr, unresolved", XDP, config.ModeDSR, nil, nil, false, nil, ""},
		{"xdp dsr, resolution failed", XDP, config.ModeDSR, nil, &MAC{Err: "no neighbour entry"}, false, nil, "no neighbour entry"},
		{"xdp dsr, resolved", XDP, config.ModeDSR, nil, &MAC{Addr: macA}, true, macA, ""},
		{"xdp dsr, configured", XDP, config.ModeDSR, macB, nil, true, macB, ""},
		{"xdp dsr, configured wins over resolved", XDP, config.ModeDSR, macB, &MAC{Addr: macA}, true, macB, ""},
		{"proxy dsr, unresolved", Proxy, config.ModeDSR, nil, nil, true, nil, ""},
		{"proxy dsr, resolution failed", Proxy, config.ModeDSR, nil, &MAC{Err: "no neighbour entry"}, true, nil, "no neighbour entry"},
		{"xdp nat ignores MACs", XDP, config.ModeNAT, nil, &MAC{Addr: macA}, true, nil, ""},
		{"xdp tunnel ignores MACs", XDP, config.ModeTunnel, macB, &MAC{Addr: macA}, true, nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA)
			cs.Mode = tt.mode
			cs.Backends[0].MAC = tt.cfgMAC
			in := input(tt.plane, cs)
			in.Health[ID("web", addrA)] = up
			if tt.resolved != nil {
				in.MACs[addrA.Addr()] = *tt.resolved
			}
			s := planOne(t, in, Desired{})
			b := mustBackend(t, &s, addrA)
			if !b.Healthy {
				t.Errorf("Healthy: got false; want true (a MAC is not health)")
			}
			if b.Usable != tt.wantUsable {
				t.Errorf("Usable: got %v; want %v", b.Usable, tt.wantUsable)
			}
			if !bytes.Equal(b.MAC, tt.wantMAC) {
				t.Errorf("MAC: got %v; want %v", b.MAC, tt.wantMAC)
			}
			if b.MACErr != tt.wantErr {
				t.Errorf("MACErr: got %q; want %q", b.MACErr, tt.wantErr)
			}
			if s.AllDown != !tt.wantUsable {
				t.Errorf("AllDown: got %v; want %v", s.AllDown, !tt.wantUsable)
			}
		})
	}
}

func TestPlanAllDown(t *testing.T) {
	tests := []struct {
		name  string
		plane Plane
		pol   config.AllDown
		// prev: the health of a, b and c in a plan before this one; nil: no prev.
		prev          []Health
		wantUsable    string
		wantInstalled bool
		wantNote      string
	}{
		{"drop, xdp", XDP, config.AllDownDrop, nil, "[]", true, noteDrop},
		{"drop, proxy", Proxy, config.AllDownDrop, nil, "[]", true, noteDrop},
		{"drop ignores what was usable", XDP, config.AllDownDrop, []Health{up, down, up}, "[]", true, noteDrop},
		{"pass, xdp", XDP, config.AllDownPass, nil, "[]", false, notePassXDP},
		{"pass, proxy", Proxy, config.AllDownPass, nil, "[]", true, notePassProx},
		{"keep_last, xdp", XDP, config.AllDownKeepLast, []Health{up, down, up}, "[10.0.0.1:80 10.0.0.3:80]", true, noteKeep},
		{"keep_last, proxy", Proxy, config.AllDownKeepLast, []Health{down, up, down}, "[10.0.0.2:80]", true, noteKeep},
		{"keep_last, no prev", XDP, config.AllDownKeepLast, nil, "[]", true, noteKeepNone},
		{"keep_last, never usable", XDP, config.AllDownKeepLast, []Health{down, down, down}, "[]", true, noteKeepNone},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA, addrB, addrC)
			cs.AllDown = tt.pol
			addrs := []string{ID("web", addrA), ID("web", addrB), ID("web", addrC)}
			var prev Desired
			if tt.prev != nil {
				in := input(tt.plane, cs)
				for i, h := range tt.prev {
					in.Health[addrs[i]] = h
				}
				prev = Plan(in, Desired{})
			}
			in := input(tt.plane, cs)
			for _, id := range addrs {
				in.Health[id] = down
			}
			s := planOne(t, in, prev)
			if !s.AllDown {
				t.Errorf("AllDown: got false; want true")
			}
			if got := usable(&s); got != tt.wantUsable {
				t.Errorf("usable: got %s; want %s", got, tt.wantUsable)
			}
			if s.Installed != tt.wantInstalled {
				t.Errorf("Installed: got %v; want %v", s.Installed, tt.wantInstalled)
			}
			if s.Note != tt.wantNote {
				t.Errorf("Note: got %q; want %q", s.Note, tt.wantNote)
			}
			for _, b := range s.Backends {
				if b.Healthy {
					t.Errorf("%s: Healthy: got true; want false", b.ID)
				}
			}
		})
	}
}

// keep_last keeps what was usable when some backend last was, however many plans
// ago, and forgets it once some backend is usable again.
func TestPlanKeepLastHistory(t *testing.T) {
	cs := cfgService("web", vip1, addrA, addrB)
	cs.AllDown = config.AllDownKeepLast
	steps := []struct {
		name       string
		a, b       Health
		wantUsable string
		wantKept   string
		wantNote   string
	}{
		{"a up", up, down, "[10.0.0.1:80]", "[10.0.0.1:80]", ""},
		{"both down: a kept", down, down, "[10.0.0.1:80]", "[10.0.0.1:80]", noteKeep},
		{"still down: a still kept", down, down, "[10.0.0.1:80]", "[10.0.0.1:80]", noteKeep},
		{"b up: b alone", down, up, "[10.0.0.2:80]", "[10.0.0.2:80]", ""},
		{"both down: b kept", down, down, "[10.0.0.2:80]", "[10.0.0.2:80]", noteKeep},
		{"both up", up, up, "[10.0.0.1:80 10.0.0.2:80]", "[10.0.0.1:80 10.0.0.2:80]", ""},
	}
	var prev Desired
	for _, st := range steps {
		in := input(XDP, cs)
		in.Health[ID("web", addrA)] = st.a
		in.Health[ID("web", addrB)] = st.b
		prev = Plan(in, prev)
		s := &prev.Services[0]
		if got := usable(s); got != st.wantUsable {
			t.Errorf("%s: usable: got %s; want %s", st.name, got, st.wantUsable)
		}
		if got := kept(s); got != st.wantKept {
			t.Errorf("%s: kept: got %s; want %s", st.name, got, st.wantKept)
		}
		if s.Note != st.wantNote {
			t.Errorf("%s: Note: got %q; want %q", st.name, s.Note, st.wantNote)
		}
	}
}

func kept(s *Service) string {
	c := *s
	c.Backends = nil
	for _, b := range s.Backends {
		b.Usable = b.Kept
		c.Backends = append(c.Backends, b)
	}
	return usable(&c)
}

func TestPlanKept(t *testing.T) {
	tests := []struct {
		name     string
		prevA    *Health // a's health in the plan before; nil: no prev
		a, b     Health
		weightA  uint32
		wantKept bool // a's
	}{
		{"usable", nil, up, up, 1, true},
		{"down while another is usable", nil, down, up, 1, false},
		{"weight 0 while another is usable", nil, up, up, 0, false},
		{"was usable, now down while another is usable", &up, down, up, 1, false},
		{"was usable, all down now", &up, down, down, 1, true},
		{"was down, all down now", &down, down, down, 1, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA, addrB)
			cs.Backends[0].Weight = tt.weightA
			var prev Desired
			if tt.prevA != nil {
				in := input(XDP, cs)
				in.Health[ID("web", addrA)] = *tt.prevA
				in.Health[ID("web", addrB)] = down
				prev = Plan(in, Desired{})
			}
			in := input(XDP, cs)
			in.Health[ID("web", addrA)] = tt.a
			in.Health[ID("web", addrB)] = tt.b
			s := planOne(t, in, prev)
			if got := mustBackend(t, &s, addrA).Kept; got != tt.wantKept {
				t.Errorf("Kept: got %v; want %v", got, tt.wantKept)
			}
		})
	}
}

// A backend is carried by address: Kept follows it when another backend joins or
// leaves the service in the same plan.
func TestPlanKeptByAddress(t *testing.T) {
	cs := cfgService("web", vip1, addrA, addrB)
	cs.AllDown = config.AllDownKeepLast
	in := input(Proxy, cs)
	in.Health[ID("web", addrA)] = down
	in.Health[ID("web", addrB)] = up
	prev := Plan(in, Desired{})

	next := cfgService("web", vip1, addrC, addrB)
	next.AllDown = config.AllDownKeepLast
	in = input(Proxy, next)
	in.Health[ID("web", addrC)] = down
	in.Health[ID("web", addrB)] = down
	s := planOne(t, in, prev)
	if got, want := usable(&s), "[10.0.0.2:80]"; got != want {
		t.Errorf("usable: got %s; want %s", got, want)
	}
	if s.Note != noteKeep {
		t.Errorf("Note: got %q; want %q", s.Note, noteKeep)
	}
}

func TestPlanDrained(t *testing.T) {
	tests := []struct {
		name     string
		drainCfg [3]bool
		drainOvr [3]bool
		health   [3]Health
		wantNote string
	}{
		{"none drained", [3]bool{}, [3]bool{}, [3]Health{up, up, up}, ""},
		{"one drained", [3]bool{true}, [3]bool{}, [3]Health{up, up, up}, ""},
		{"all drained in the file", [3]bool{true, true, true}, [3]bool{}, [3]Health{up, up, up}, noteDrained},
		{"all drained by override", [3]bool{}, [3]bool{true, true, true}, [3]Health{up, up, up}, noteDrained},
		{"usable ones drained, a down one not", [3]bool{true, true}, [3]bool{}, [3]Health{up, up, down}, noteDrained},
		{"a drained one usable, undrained ones down", [3]bool{true}, [3]bool{}, [3]Health{up, down, down}, noteDrained},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA, addrB, addrC)
			in := input(XDP, cs)
			for i := range cs.Backends {
				cs.Backends[i].Drain = tt.drainCfg[i]
				id := ID("web", cs.Backends[i].Addr)
				in.Health[id] = tt.health[i]
				if tt.drainOvr[i] {
					in.Overrides[id] = Override{Drain: true, SetDrain: true}
				}
			}
			in.Services = []config.Service{cs}
			s := planOne(t, in, Desired{})
			if s.AllDown {
				t.Errorf("AllDown: got true; want false")
			}
			if !s.Installed {
				t.Errorf("Installed: got false; want true")
			}
			if s.Note != tt.wantNote {
				t.Errorf("Note: got %q; want %q", s.Note, tt.wantNote)
			}
			for i, b := range s.Backends {
				if b.Usable != tt.health[i].Usable {
					t.Errorf("%s: Usable: got %v; want %v (draining is not being down)", b.ID, b.Usable, tt.health[i].Usable)
				}
			}
		})
	}
}

// Backends of weight 0 take no new flows, so they do not keep a service from being
// all down.
func TestPlanWeightZero(t *testing.T) {
	tests := []struct {
		name          string
		weights       [2]uint32
		override      *Override // on a
		pol           config.AllDown
		wantAllDown   bool
		wantInstalled bool
		wantNote      string
	}{
		{"both weight 0, drop", [2]uint32{0, 0}, nil, config.AllDownDrop, true, true, noteDrop},
		{"both weight 0, pass", [2]uint32{0, 0}, nil, config.AllDownPass, true, false, notePassXDP},
		{"one weight 0", [2]uint32{0, 1}, nil, config.AllDownPass, false, true, ""},
		{"weight 0 by override", [2]uint32{1, 0}, &Override{Weight: 0, SetWeight: true}, config.AllDownDrop, true, true, noteDrop},
		{"weight 1 by override", [2]uint32{0, 0}, &Override{Weight: 1, SetWeight: true}, config.AllDownPass, false, true, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA, addrB)
			cs.AllDown = tt.pol
			cs.Backends[0].Weight, cs.Backends[1].Weight = tt.weights[0], tt.weights[1]
			in := input(XDP, cs)
			in.Health[ID("web", addrA)] = up
			in.Health[ID("web", addrB)] = up
			if tt.override != nil {
				in.Overrides[ID("web", addrA)] = *tt.override
			}
			s := planOne(t, in, Desired{})
			if s.AllDown != tt.wantAllDown {
				t.Errorf("AllDown: got %v; want %v", s.AllDown, tt.wantAllDown)
			}
			if s.Installed != tt.wantInstalled {
				t.Errorf("Installed: got %v; want %v", s.Installed, tt.wantInstalled)
			}
			if s.Note != tt.wantNote {
				t.Errorf("Note: got %q; want %q", s.Note, tt.wantNote)
			}
		})
	}
}

// Leaving: the backends a reload removed from an XDP service, planned step by step.
func TestPlanLeaving(t *testing.T) {
	web := func(mod func(*config.Service), addrs ...netip.AddrPort) config.Service {
		s := cfgService("web", vip1, addrs...)
		if mod != nil {
			mod(&s)
		}
		return s
	}
	noLimit := func(s *config.Service) { s.DrainTimeout = 0 }
	otherVIP := func(s *config.Service) { s.VIP = vip2 }
	udp := func(s *config.Service) { s.Protocol = config.UDP }
	dsr := func(s *config.Service) { s.Mode = config.ModeDSR; s.Backends[0].MAC = macA }
	sec := time.Second
	type step struct {
		svc         config.Service
		plane       Plane
		at          time.Duration // since t0
		wantLeaving string        // address@Until-t0
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"removed", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[10.0.0.2:80@31s]"},
		}},
		{"drain_timeout 0", []step{
			{web(noLimit, addrA, addrB), XDP, 0, "[]"},
			{web(noLimit, addrA), XDP, sec, "[10.0.0.2:80@" + (sec + flowIdle).String() + "]"},
		}},
		{"Until does not move", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[10.0.0.2:80@31s]"},
			{web(nil, addrA), XDP, 10 * sec, "[10.0.0.2:80@31s]"},
			{web(nil, addrA), XDP, 31*sec - 1, "[10.0.0.2:80@31s]"},
		}},
		{"leaves at Until", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[10.0.0.2:80@31s]"},
			{web(nil, addrA), XDP, 31 * sec, "[]"},
		}},
		{"leaves after Until", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[10.0.0.2:80@31s]"},
			{web(nil, addrA), XDP, time.Hour, "[]"},
		}},
		{"comes back", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[10.0.0.2:80@31s]"},
			{web(nil, addrA, addrB), XDP, 2 * sec, "[]"},
		}},
		{"each leaver its own Until", []step{
			{web(nil, addrA, addrB, addrC), XDP, 0, "[]"},
			{web(nil, addrA, addrC), XDP, sec, "[10.0.0.2:80@31s]"},
			{web(nil, addrA), XDP, 5 * sec, "[10.0.0.2:80@31s 10.0.0.3:80@35s]"},
			{web(nil, addrA), XDP, 32 * sec, "[10.0.0.3:80@35s]"},
		}},
		{"one comes back, one stays", []step{
			{web(nil, addrA, addrB, addrC), XDP, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[10.0.0.2:80@31s 10.0.0.3:80@31s]"},
			{web(nil, addrA, addrC), XDP, 2 * sec, "[10.0.0.2:80@31s]"},
		}},
		{"mode changes, key does not", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(dsr, addrA), XDP, sec, "[10.0.0.2:80@31s]"},
		}},
		{"VIP changes", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(otherVIP, addrA), XDP, sec, "[]"},
		}},
		{"VIP changes with leavers", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[10.0.0.2:80@31s]"},
			{web(otherVIP, addrA), XDP, 2 * sec, "[]"},
		}},
		{"protocol changes", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(udp, addrA), XDP, sec, "[]"},
		}},
		{"moves to the proxy", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(nil, addrA), Proxy, sec, "[]"},
		}},
		{"moves to the proxy with leavers", []step{
			{web(nil, addrA, addrB), XDP, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[10.0.0.2:80@31s]"},
			{web(nil, addrA), Proxy, 2 * sec, "[]"},
		}},
		{"moves to XDP", []step{
			{web(nil, addrA, addrB), Proxy, 0, "[]"},
			{web(nil, addrA), XDP, sec, "[]"},
		}},
		{"proxy", []step{
			{web(nil, addrA, addrB), Proxy, 0, "[]"},
			{web(nil, addrA), Proxy, sec, "[]"},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var prev Desired
			for i, st := range tt.steps {
				in := input(st.plane, st.svc)
				in.Now = t0.Add(st.at)
				prev = Plan(in, prev)
				s := &prev.Services[0]
				if got := leavers(s); got != st.wantLeaving {
					t.Errorf("step %d: Leaving: got %s; want %s", i, got, st.wantLeaving)
				}
				for _, l := range s.Leaving {
					if !l.Drained {
						t.Errorf("step %d: leaver %s: Drained: got false; want true", i, l.ID)
					}
					if s.Backend(l.Config.Addr) != nil {
						t.Errorf("step %d: leaver %s is also a backend", i, l.ID)
					}
				}
			}
		})
	}
}

// A leaver keeps what the data plane was told of it, draining.
func TestPlanLeaverState(t *testing.T) {
	cs := cfgService("web", vip1, addrA, addrB)
	cs.Backends[1].Weight = 7
	in := input(XDP, cs)
	in.Health[ID("web", addrB)] = up
	prev := Plan(in, Desired{})

	in = input(XDP, cfgService("web", vip1, addrA))
	in.Now = t0.Add(time.Second)
	s := planOne(t, in, prev)
	if len(s.Leaving) != 1 {
		t.Fatalf("Leaving: got %d; want 1", len(s.Leaving))
	}
	l := s.Leaving[0]
	if l.ID != "web/10.0.0.2:80" || !l.Usable || !l.Healthy || l.Weight != 7 || !l.Drained {
		t.Errorf("leaver: got ID %q usable %v healthy %v weight %d drained %v; want \"web/10.0.0.2:80\" true true 7 true",
			l.ID, l.Usable, l.Healthy, l.Weight, l.Drained)
	}
	if got := prev.Services[0].Backends[1]; got.Drained || !got.Until.IsZero() {
		t.Errorf("prev's backend: got drained %v until %v; want false, zero (prev is not modified)", got.Drained, got.Until)
	}
}

// Plan keeps config order, takes each service's placement, and reads from prev only
// the service of the same name.
func TestPlanServices(t *testing.T) {
	a := cfgService("a", vip1, addrA)
	b := cfgService("b", vip2, addrA)
	in := input(XDP, a, b)
	in.Placement["b"] = Placement{Plane: Proxy, Why: "algorithm"}
	in.Health[ID("a", addrA)] = up
	in.Health[ID("b", addrA)] = down
	d := Plan(in, Desired{})
	if len(d.Services) != 2 || d.Services[0].Name() != "a" || d.Services[1].Name() != "b" {
		t.Fatalf("services: got %v; want [a b]", names(d))
	}
	if got := d.Service("b").Placement; got != (Placement{Plane: Proxy, Why: "algorithm"}) {
		t.Errorf("b placement: got %+v; want {proxy algorithm}", got)
	}
	if d.Service("a").AllDown || !d.Service("b").AllDown {
		t.Errorf("AllDown a, b: got %v, %v; want false, true", d.Service("a").AllDown, d.Service("b").AllDown)
	}
	if d.Service("c") != nil {
		t.Errorf("Service(c): got %v; want nil", d.Service("c"))
	}
	if got := Plan(Input{}, d); len(got.Services) != 0 {
		t.Errorf("no services: got %v; want []", names(got))
	}
}

func names(d Desired) []string {
	var out []string
	for i := range d.Services {
		out = append(out, d.Services[i].Name())
	}
	return out
}

func TestInitialState(t *testing.T) {
	for _, tc := range []struct {
		in   config.Initial
		want health.State
	}{
		{config.InitialUp, health.Up},
		{config.InitialDown, health.Down},
		{config.InitialUnknown, health.Unknown},
	} {
		if got := InitialState(tc.in); got != tc.want {
			t.Errorf("InitialState(%q): got %v; want %v", tc.in, got, tc.want)
		}
	}
}

// TestPlanTruth: when healthy dsr backends take no flows for want of a MAC, the
// note says so (not "every backend is down"), and each backend's Reason names the
// real cause, so status, explain and the note cannot disagree.
func TestPlanTruth(t *testing.T) {
	cs := cfgService("web", netip.MustParseAddrPort("10.0.0.1:80"), netip.MustParseAddrPort("10.0.0.2:80"), netip.MustParseAddrPort("10.0.0.3:80"))
	cs.Mode = config.ModeDSR
	in := input(XDP, cs)
	in.MACs[netip.MustParseAddr("10.0.0.2")] = MAC{Err: "10.0.0.2 on eth0: neighbour resolution pending"}
	in.Health[ID("web", netip.MustParseAddrPort("10.0.0.3:80"))] = Health{State: health.Down}
	s := planOne(t, in, Desired{})
	if !s.AllDown || !strings.HasPrefix(s.Note, "no backend is usable: the healthy ones have no known MAC") {
		t.Errorf("AllDown %t, note %q; want all down, naming the MACs", s.AllDown, s.Note)
	}
	for addr, want := range map[string]string{
		"10.0.0.2:80": "mac unknown: 10.0.0.2 on eth0: neighbour resolution pending",
		"10.0.0.3:80": "health: down",
	} {
		b := mustBackend(t, &s, netip.MustParseAddrPort(addr))
		if got := b.Reason(); got != want {
			t.Errorf("%s reason: got %q; want %q", addr, got, want)
		}
	}
	// Drained, weight 0, kept by keep_last.
	cases := []struct {
		name string
		b    Backend
		want string
	}{
		{"usable", Backend{Healthy: true, Usable: true, Weight: 1, Health: health.Up}, ""},
		{"drained", Backend{Healthy: true, Usable: true, Weight: 1, Drained: true}, "drained"},
		{"weight 0", Backend{Healthy: true, Usable: true}, "weight 0"},
		{"kept", Backend{Usable: true, Weight: 1, Health: health.Down}, "kept by all_down: keep_last although health says down"},
		{"panic", Backend{Healthy: true, Usable: true, Weight: 1, Health: health.Down}, "panic: too few of the service's backends are up, so all are used although health says down"},
		{"panic, drained", Backend{Healthy: true, Usable: true, Weight: 1, Health: health.Unknown, Drained: true}, "drained"},
	}
	for _, c := range cases {
		if got := c.b.Reason(); got != c.want {
			t.Errorf("%s: got %q; want %q", c.name, got, c.want)
		}
	}
}
