package plan

import (
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/userspace/balance"
	"github.com/weir-lb/weir/userspace/config"
)

// tableShares builds the Maglev table the XDP loader would build from the service's
// weights and ramps and returns each backend's share of it.
func tableShares(t *testing.T, s *Service) map[string]float64 {
	t.Helper()
	table := stepTable(t, s)
	out := map[string]float64{}
	for _, id := range table {
		out[id] += 1 / float64(len(table))
	}
	return out
}

// TestSlowStartSteps: a backend added to a running service ramps from a tenth of
// its share to all of it over slow_start, one step per plan, each step's share of
// the real Maglev table within half a percent of the curve the proxy's balancers
// follow; the others' slots of the full-weight table never move, and once the ramp
// is over the table is the full-weight table, entry for entry.
func TestSlowStartSteps(t *testing.T) {
	const window = 10 * time.Second
	tests := []struct {
		name    string
		weights [3]uint32 // A, B and the added C
	}{
		{"equal weights", [3]uint32{1, 1, 1}},
		{"heavy newcomer", [3]uint32{1, 1, 4}},
		{"large weights", [3]uint32{30000, 20000, 65535}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := cfgService("web", vip1, addrA, addrB)
			cs.SlowStart = window
			for i := range cs.Backends {
				cs.Backends[i].Weight = tt.weights[i]
			}
			prev := Plan(input(XDP, cs), Desired{})
			cs.Backends = append(cs.Backends, cfgBackend(addrC))
			cs.Backends[2].Weight = tt.weights[2]
			full := fullTable(t, cs)
			for step := 0; step <= 11; step++ {
				in := input(XDP, cs)
				in.Now = t0.Add(time.Duration(step) * time.Second)
				next := Plan(in, prev)
				s := &next.Services[0]
				c := mustBackend(t, s, addrC)
				f := balance.SlowStartFactor(time.Duration(step)*time.Second, window)
				wc := float64(tt.weights[2]) * f
				want := wc / (float64(tt.weights[0]+tt.weights[1]) + wc)
				if got := tableShares(t, s)[addrC.String()]; math.Abs(got-want) > 0.005 {
					t.Errorf("step %d: C's share of the table: got %.4f; want %.4f ± 0.005", step, got, want)
				}
				if done := step >= 10; c.Ramping() == done {
					t.Errorf("step %d: Ramping: got %v; want %v", step, c.Ramping(), !done)
				}
				if step == 0 && !c.RampStart.Equal(t0) {
					t.Errorf("RampStart: got %v; want %v", c.RampStart, t0)
				}
				table := stepTable(t, s)
				for i, id := range full {
					if id != addrC.String() && table[i] != id {
						t.Fatalf("step %d: slot %d of %s moved to %s; want only C's slots to move", step, i, id, table[i])
					}
				}
				if step >= 10 {
					for _, b := range s.Backends {
						if b.Ramp != 0 {
							t.Errorf("step %d: backend %s: ramp %d; want 0 (the ramp is over)", step, b.Config.Addr, b.Ramp)
						}
					}
					if !slices.Equal(table, full) {
						t.Errorf("step %d: the table differs from the full-weight one; want identical", step)
					}
				}
				prev = next
			}
		})
	}
}

// stepTable is the table (as backend IDs) the XDP loader would build from the
// service's weights and ramps.
func stepTable(t *testing.T, s *Service) []string {
	t.Helper()
	var members []balance.Backend
	for _, b := range s.Backends {
		members = append(members, balance.Backend{ID: b.Config.Addr.String(), Weight: b.Weight, Usable: b.takesNew(), Ramp: b.Ramp})
	}
	return buildIDs(t, members)
}

// fullTable is the table of cs's backends at their full weights.
func fullTable(t *testing.T, cs config.Service) []string {
	t.Helper()
	var members []balance.Backend
	for _, b := range cs.Backends {
		members = append(members, balance.Backend{ID: b.Addr.String(), Weight: b.Weight, Usable: true})
	}
	return buildIDs(t, members)
}

func buildIDs(t *testing.T, members []balance.Backend) []string {
	t.Helper()
	table, err := balance.BuildMaglev(members, balance.DefaultMaglevSize, 1)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, len(table))
	for i, e := range table {
		out[i] = members[e].ID
	}
	return out
}

func TestRamp(t *testing.T) {
	const window = 10 * time.Second
	for _, tt := range []struct {
		elapsed time.Duration
		want    uint32
	}{
		{0, 6554},
		{5 * time.Second, 36045},
		{-time.Second, 6554}, // a clock step back: the floor
		{10 * time.Second, balance.RampFull - 1},
		{9999 * time.Millisecond, 65530},
		{time.Hour, balance.RampFull - 1}, // short of RampFull, which would end it
	} {
		if got := Ramp(tt.elapsed, window); got != tt.want {
			t.Errorf("Ramp(%v, %v): got %d; want %d", tt.elapsed, window, got, tt.want)
		}
	}
}

// TestSlowStartTriggers: what starts a ramp, and what does not.
func TestSlowStartTriggers(t *testing.T) {
	tests := []struct {
		name   string
		plane  Plane
		algo   config.Algorithm
		window time.Duration
		// prev and next change the service between the two plans; prev nil: the
		// second plan is the first.
		prev, next func(cs *config.Service, in *Input)
		want       bool // C ramps in the second plan
		unstepped  bool // and its table ramp stays 0
	}{
		{name: "added by a reload", plane: XDP, window: time.Minute,
			prev: func(cs *config.Service, in *Input) { cs.Backends = cs.Backends[:2] }, want: true},
		{name: "back up after down", plane: XDP, window: time.Minute,
			prev: func(cs *config.Service, in *Input) { in.Health[ID("web", addrC)] = down }, want: true},
		{name: "undrained", plane: XDP, window: time.Minute,
			prev: func(cs *config.Service, in *Input) {
				in.Overrides[ID("web", addrC)] = Override{Drain: true, SetDrain: true}
			}, want: true},
		{name: "weight raised from 0", plane: XDP, window: time.Minute,
			prev: func(cs *config.Service, in *Input) { cs.Backends[2].Weight = 0 }, want: true},
		{name: "proxy maglev steps too", plane: Proxy, algo: config.AlgorithmMaglev, window: time.Minute,
			prev: func(cs *config.Service, in *Input) { cs.Backends = cs.Backends[:2] }, want: true},
		{name: "proxy round robin: tracked, ramped per pick by the balancer", plane: Proxy, algo: config.AlgorithmRoundRobin, window: time.Minute,
			prev: func(cs *config.Service, in *Input) { cs.Backends = cs.Backends[:2] }, want: true, unstepped: true},
		{name: "slow_start off", plane: XDP,
			prev: func(cs *config.Service, in *Input) { cs.Backends = cs.Backends[:2] }},
		{name: "first plan: full weight", plane: XDP, window: time.Minute},
		{name: "unchanged", plane: XDP, window: time.Minute, prev: func(*config.Service, *Input) {}},
		{name: "rebuilt service: full weight", plane: XDP, window: time.Minute,
			prev: func(cs *config.Service, in *Input) { cs.Backends = cs.Backends[:2]; cs.Mode = config.ModeDSR }},
		{name: "down now", plane: XDP, window: time.Minute,
			prev: func(cs *config.Service, in *Input) { cs.Backends = cs.Backends[:2] },
			next: func(cs *config.Service, in *Input) { in.Health[ID("web", addrC)] = down }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mk := func(edit func(*config.Service, *Input)) Input {
				cs := cfgService("web", vip1, addrA, addrB, addrC)
				cs.Mode = config.ModeNAT
				if tt.algo != "" {
					cs.Algorithm = tt.algo
				}
				cs.SlowStart = tt.window
				in := input(tt.plane, cs)
				if edit != nil {
					edit(&in.Services[0], &in)
				}
				return in
			}
			var prev Desired
			if tt.prev != nil {
				prev = Plan(mk(tt.prev), Desired{})
			}
			in := mk(tt.next)
			in.Now = t0.Add(time.Second)
			s := planOne(t, in, prev)
			if got := mustBackend(t, &s, addrC).Ramping(); got != tt.want {
				t.Errorf("C ramping: got %v; want %v", got, tt.want)
			}
			if !tt.want || tt.unstepped {
				for _, b := range s.Backends {
					if b.Ramp != 0 {
						t.Errorf("backend %s: ramp %d; want 0 (nothing ramps in table steps)", b.Config.Addr, b.Ramp)
					}
				}
			}
		})
	}
}

// TestSlowStartSteppedDiff: a step changes only table ramps, which Diff turns into
// an operation, so the agent's tick rebuilds the table; once the ramp is over,
// planning again changes nothing.
func TestSlowStartSteppedDiff(t *testing.T) {
	cs := cfgService("web", vip1, addrA, addrB)
	cs.SlowStart = 2 * time.Second
	prev := Plan(input(XDP, cs), Desired{})
	cs.Backends = append(cs.Backends, cfgBackend(addrC))
	var kinds []string
	for step := range 4 {
		in := input(XDP, cs)
		in.Now = t0.Add(time.Duration(step) * time.Second)
		next := Plan(in, prev)
		var ops []string
		for _, op := range Diff(prev, next) {
			ops = append(ops, op.Kind.String())
		}
		kinds = append(kinds, "["+strings.Join(ops, " ")+"]")
		prev = next
	}
	// The ramp's end too changes C alone: one backend's operation, not a service update.
	want := "[update] [set-backend] [set-backend] []"
	if got := strings.Join(kinds, " "); got != want {
		t.Errorf("operations per step: got %s; want %s", got, want)
	}
}
