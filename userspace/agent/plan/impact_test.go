package plan

import (
	"fmt"
	"math"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/userspace/config"
)

// table is a lookup table of the given owners, each repeated n times in turn.
func table(n int, owners ...netip.AddrPort) []netip.AddrPort {
	var out []netip.AddrPort
	for range n {
		out = append(out, owners...)
	}
	return out
}

func TestCompareTables(t *testing.T) {
	none := netip.AddrPort{}
	tests := []struct {
		name       string
		prev, next []netip.AddrPort
		wantMoved  int
		wantShare  float64
		wantMoves  string
	}{
		{"same", table(5, addrA, addrB), table(5, addrA, addrB), 0, 0, "[]"},
		{"one entry", []netip.AddrPort{addrA, addrB, addrA}, []netip.AddrPort{addrA, addrB, addrB}, 1, 1.0 / 3, "[10.0.0.1:80->10.0.0.2:80 1]"},
		{"a third to a newcomer", table(4, addrA, addrB, addrA), table(4, addrA, addrB, addrC), 4, 1.0 / 3, "[10.0.0.1:80->10.0.0.3:80 4]"},
		{"all down", table(3, addrA), nil, 3, 1, "[10.0.0.1:80->none 3]"},
		{"first usable", nil, table(3, addrA), 3, 1, "[none->10.0.0.1:80 3]"},
		// Sizes 2 and 4: hash h goes to entry h%2 and h%4, so A's and B's halves keep
		// their owner exactly where next repeats prev.
		{"resized, same owners", []netip.AddrPort{addrA, addrB}, []netip.AddrPort{addrA, addrB, addrA, addrB}, 0, 0, "[]"},
		{"resized, a quarter moves", []netip.AddrPort{addrA, addrB}, []netip.AddrPort{addrA, addrB, addrA, addrC}, 1, 0.25, "[10.0.0.2:80->10.0.0.3:80 1]"},
		{"neither", nil, nil, 0, 0, "[]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tc := CompareTables(tt.prev, tt.next)
			if tc.Moved != tt.wantMoved || math.Abs(tc.Share-tt.wantShare) > 1e-9 {
				t.Errorf("moved %d, share %v; want %d, %v", tc.Moved, tc.Share, tt.wantMoved, tt.wantShare)
			}
			moves := "["
			for i, m := range tc.Moves {
				if i > 0 {
					moves += " "
				}
				name := func(a netip.AddrPort) string {
					if a == none {
						return "none"
					}
					return a.String()
				}
				moves += fmt.Sprintf("%s->%s %d", name(m.From), name(m.To), m.Slots)
			}
			if moves += "]"; moves != tt.wantMoves {
				t.Errorf("moves: got %s; want %s", moves, tt.wantMoves)
			}
			if tc.PrevSize != len(tt.prev) || tc.NextSize != len(tt.next) {
				t.Errorf("sizes: got %d, %d; want %d, %d", tc.PrevSize, tc.NextSize, len(tt.prev), len(tt.next))
			}
		})
	}
}

func TestShareChange(t *testing.T) {
	svc := func(weights ...uint32) *Service {
		cs := cfgService("web", vip1, addrA, addrB, addrC)
		for i, w := range weights {
			cs.Backends[i].Weight = w
		}
		cs.Backends = cs.Backends[:len(weights)]
		s := planOne(t, input(Proxy, cs), Desired{})
		return &s
	}
	tests := []struct {
		name       string
		prev, next *Service
		want       float64
	}{
		{"same", svc(1, 1), svc(1, 1), 0},
		{"a third backend", svc(1, 1), svc(1, 1, 1), 1.0 / 3},
		{"one leaves", svc(1, 1, 1), svc(1, 1), 1.0 / 3},
		{"weight doubled", svc(1, 1), svc(2, 1), 2.0/3 - 0.5},
		{"weight 0", svc(1, 1), svc(0, 1), 0.5},
		{"removed", svc(1, 1), nil, 1},
	}
	for _, tt := range tests {
		if got := ShareChange(tt.prev, tt.next); math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("%s: got %v; want %v", tt.name, got, tt.want)
		}
	}
	for _, tt := range []struct {
		name       string
		prev, next *Service
		want       float64
	}{
		{"two alike", svc(1, 1), svc(1, 1), 0.5},
		{"three alike", svc(1, 1, 1), svc(1, 1, 1), 2.0 / 3},
		{"one backend", svc(1), svc(1), 0},
		{"weighted", svc(3, 1), svc(3, 1), 1 - (0.75*0.75 + 0.25*0.25)},
	} {
		if got := IndependentChange(tt.prev, tt.next); math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("independent, %s: got %v; want %v", tt.name, got, tt.want)
		}
	}
}

func TestFlowFates(t *testing.T) {
	base := func(plane Plane) (config.Service, Desired) {
		cs := cfgService("web", vip1, addrA, addrB, addrC)
		cs.Mode = config.ModeNAT
		cs.DrainTimeout = time.Minute
		return cs, Plan(input(plane, cs), Desired{})
	}
	tests := []struct {
		name  string
		plane Plane
		edit  func(cs *config.Service, in *Input) // nil: the service is removed
		want  string                              // fates of A, B, C
		new   string                              // NewDataPlane's start
	}{
		{"unchanged", XDP, func(*config.Service, *Input) {}, "stay stay stay", ""},
		{"C removed: it drains", XDP, func(cs *config.Service, _ *Input) { cs.Backends = cs.Backends[:2] }, "stay stay drain", ""},
		{"C drained", XDP, func(_ *config.Service, in *Input) {
			in.Overrides[ID("web", addrC)] = Override{Drain: true, SetDrain: true}
		}, "stay stay drain", ""},
		{"C weight 0", XDP, func(cs *config.Service, _ *Input) { cs.Backends[2].Weight = 0 }, "stay stay drain", ""},
		{"C down: reset", XDP, func(_ *config.Service, in *Input) { in.Health[ID("web", addrC)] = down }, "stay stay reset", ""},
		{"service removed", XDP, nil, "reset reset reset", ""},
		{"mode nat to dsr: another connection table", XDP, func(cs *config.Service, _ *Input) { cs.Mode = config.ModeDSR }, "reset reset reset", ""},
		{"vip changed", XDP, func(cs *config.Service, _ *Input) { cs.VIP = vip2 }, "reset reset reset", "a new entry in the XDP program"},
		// Settings XDP does not use: the entry is updated in place.
		{"drain_timeout changed", XDP, func(cs *config.Service, _ *Input) { cs.DrainTimeout = time.Hour }, "stay stay stay", ""},
		{"proxy setting changed", XDP, func(cs *config.Service, _ *Input) { cs.Proxy.ConnectTimeout = 9 * time.Second }, "stay stay stay", ""},
		{"moved to the proxy", XDP, func(_ *config.Service, in *Input) { in.Placement["web"] = Placement{Plane: Proxy} }, "reset reset reset", "moves from xdp to proxy"},
		{"all_down pass takes it out", XDP, func(cs *config.Service, in *Input) {
			cs.AllDown = config.AllDownPass
			for _, a := range []netip.AddrPort{addrA, addrB, addrC} {
				in.Health[ID("web", a)] = down
			}
		}, "reset reset reset", ""},
		{"proxy: C removed drains", Proxy, func(cs *config.Service, _ *Input) { cs.Backends = cs.Backends[:2] }, "stay stay drain", ""},
		{"proxy: C down keeps its connections", Proxy, func(_ *config.Service, in *Input) { in.Health[ID("web", addrC)] = down }, "stay stay stay", ""},
		{"proxy: rebuilt drains all", Proxy, func(cs *config.Service, _ *Input) { cs.DrainTimeout = time.Hour }, "drain drain drain", "a new listener on proxy"},
		{"proxy: removed drains all", Proxy, nil, "drain drain drain", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs, prev := base(tt.plane)
			var next *Service
			if tt.edit != nil {
				in := input(tt.plane, cs)
				tt.edit(&in.Services[0], &in)
				d := Plan(in, prev)
				next = &d.Services[0]
			}
			fates := FlowFates(&prev.Services[0], next)
			got := fmt.Sprintf("%s %s %s", fates[addrA], fates[addrB], fates[addrC])
			if got != tt.want {
				t.Errorf("fates of A B C: got %s; want %s", got, tt.want)
			}
			if nd := NewDataPlane(&prev.Services[0], next, Rebuilt); !strings.HasPrefix(nd, tt.new) || (tt.new == "") != (nd == "") {
				t.Errorf("new data plane: %q; want %q...", nd, tt.new)
			}
		})
	}
}

// TestFlowFatesLeaving: a backend that already drains stays draining (its flows are
// not counted again), and resets when its drain time is up.
func TestFlowFatesLeaving(t *testing.T) {
	cs := cfgService("web", vip1, addrA, addrB)
	cs.DrainTimeout = time.Minute
	prev := Plan(input(XDP, cs), Desired{})
	cs.Backends = cs.Backends[:1]
	mid := Plan(input(XDP, cs), prev)
	if got := FlowFates(&mid.Services[0], &mid.Services[0])[addrB]; got != Stay {
		t.Errorf("a leaving backend, planned again before its time: got %s; want stay", got)
	}
	in := input(XDP, cs)
	in.Now = t0.Add(2 * time.Minute)
	late := Plan(in, mid)
	if got := FlowFates(&mid.Services[0], &late.Services[0])[addrB]; got != Reset {
		t.Errorf("a leaving backend whose time is up: got %s; want reset", got)
	}
}

func TestTrafficShare(t *testing.T) {
	prev := []netip.AddrPort{addrA, addrB, addrA, addrB}
	next := []netip.AddrPort{addrA, addrB, addrC, addrB}
	tests := []struct {
		name   string
		hashes []uint32
		want   float64
		wantOK bool
	}{
		{"no flows", nil, 0, false},
		{"clustered on the moved entry", []uint32{2, 6, 10}, 1, true},
		{"clustered elsewhere", []uint32{0, 1, 3, 5}, 0, true},
		{"spread", []uint32{0, 1, 2, 3}, 0.25, true},
	}
	for _, tt := range tests {
		got, ok := TrafficShare(prev, next, tt.hashes)
		if got != tt.want || ok != tt.wantOK {
			t.Errorf("%s: got %v, %v; want %v, %v", tt.name, got, ok, tt.want, tt.wantOK)
		}
	}
	if got, _ := TrafficShare(prev, nil, []uint32{1}); got != 1 {
		t.Errorf("to no table: got %v; want 1", got)
	}
}

// TestServedFates: on a plane that serves connections itself, only what the
// plane rebuilds drains everything; the http plane rebuilds less than Rebuilt
// names (here: only for a new drain_timeout), so a retries change stays in place.
func TestServedFates(t *testing.T) {
	httpRebuilt := func(a, b *config.Service) bool { return a.DrainTimeout != b.DrainTimeout }
	tests := []struct {
		name         string
		edit         func(cs *config.Service, in *Input) // nil: removed
		wantReplaced bool
		want         string // fates of A, B, C
		wantNew      string // NewDataPlane's start
	}{
		{"retries: in place", func(cs *config.Service, _ *Input) { cs.HTTP.Retries = 3 }, false, "stay stay stay", ""},
		{"C removed: its requests finish", func(cs *config.Service, _ *Input) { cs.Backends = cs.Backends[:2] }, false, "stay stay drain", ""},
		{"C drained", func(cs *config.Service, _ *Input) { cs.Backends[2].Drain = true }, false, "stay stay drain", ""},
		{"C weight 0", func(cs *config.Service, _ *Input) { cs.Backends[2].Weight = 0 }, false, "stay stay drain", ""},
		{"C down: in flight finish", func(_ *config.Service, in *Input) { in.Health[ID("web", addrC)] = down }, false, "stay stay stay", ""},
		{"new listener", func(cs *config.Service, _ *Input) { cs.DrainTimeout = time.Hour }, true, "drain drain drain", "a new listener on http"},
		{"moved to the proxy", func(_ *config.Service, in *Input) {
			in.Placement["web"] = Placement{Plane: Proxy, Why: "data_plane: proxy"}
		}, true, "drain drain drain", "moves from http to proxy: data_plane: proxy"},
		{"moved to xdp", func(_ *config.Service, in *Input) { in.Placement["web"] = Placement{Plane: XDP, Why: "xdp"} }, true, "drain drain drain", "moves from http to xdp"},
		{"removed", nil, true, "drain drain drain", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA, addrB, addrC)
			cs.DataPlane, cs.Algorithm = config.DataPlaneHTTP, config.AlgorithmRoundRobin
			prev := Plan(input(HTTP, cs), Desired{})
			var next *Service
			if tt.edit != nil {
				in := input(HTTP, cs)
				tt.edit(&in.Services[0], &in)
				d := Plan(in, prev)
				next = &d.Services[0]
			}
			p := &prev.Services[0]
			replaced := Replaced(p, next, httpRebuilt)
			fates := ServedFates(p, next, replaced)
			got := fmt.Sprintf("%s %s %s", fates[addrA], fates[addrB], fates[addrC])
			if replaced != tt.wantReplaced || got != tt.want {
				t.Errorf("replaced %t, fates of A B C %s; want %t, %s", replaced, got, tt.wantReplaced, tt.want)
			}
			if nd := NewDataPlane(p, next, httpRebuilt); !strings.HasPrefix(nd, tt.wantNew) || (tt.wantNew == "") != (nd == "") {
				t.Errorf("new data plane: %q; want %q...", nd, tt.wantNew)
			}
		})
	}
}

// TestShareChangeByAlgorithm: an algorithm that ignores weights moves nothing when
// only a weight changes (weight 0 aside), one that honours them moves the shares
// the weights move.
func TestShareChangeByAlgorithm(t *testing.T) {
	svc := func(algo config.Algorithm, weights ...uint32) *Service {
		cs := cfgService("web", vip1, addrA, addrB, addrC)
		cs.DataPlane, cs.Algorithm = config.DataPlaneHTTP, algo
		for i, w := range weights {
			cs.Backends[i].Weight = w
		}
		cs.Backends = cs.Backends[:len(weights)]
		s := planOne(t, input(HTTP, cs), Desired{})
		return &s
	}
	tests := []struct {
		algo       config.Algorithm
		prev, next []uint32
		want       float64
	}{
		{config.AlgorithmRoundRobin, []uint32{1, 1, 1}, []uint32{3, 1, 1}, 0},
		{config.AlgorithmLeastConn, []uint32{1, 1, 1}, []uint32{3, 1, 1}, 0},
		{config.AlgorithmP2C, []uint32{1, 1, 1}, []uint32{1, 1, 0}, 1.0 / 3},
		{config.AlgorithmEWMA, []uint32{1, 1}, []uint32{1, 1, 1}, 1.0 / 3},
		{config.AlgorithmWeighted, []uint32{1, 1, 1}, []uint32{3, 1, 1}, 2 * (1.0/3 - 0.2)},
		{config.AlgorithmWeightedLeastConn, []uint32{1, 1}, []uint32{3, 1}, 0.25},
		{config.AlgorithmMaglev, []uint32{1, 1}, []uint32{3, 1}, 0.25},
		{config.AlgorithmMaglevP2C, []uint32{1, 1}, []uint32{3, 1}, 0.25},
	}
	for _, tt := range tests {
		got := ShareChange(svc(tt.algo, tt.prev...), svc(tt.algo, tt.next...))
		if math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("%s, weights %v -> %v: moved %v; want %v", tt.algo, tt.prev, tt.next, got, tt.want)
		}
	}
}
