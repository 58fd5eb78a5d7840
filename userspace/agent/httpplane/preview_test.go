package httpplane

import (
	"math"
	"net/netip"
	"testing"

	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/balance"
	"github.com/weir-lb/weir/userspace/config"
)

// service is an http service with backends at 10.0.0.1.. of the given weights
// (0: drained), all healthy.
func service(algo config.Algorithm, weights ...uint32) *plan.Service {
	s := &plan.Service{Config: config.Service{Name: "web", DataPlane: config.DataPlaneHTTP, Algorithm: algo},
		Placement: plan.Placement{Plane: plan.HTTP}, Installed: true}
	for i, w := range weights {
		addr := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)}), 80)
		s.Backends = append(s.Backends, plan.Backend{Config: config.Backend{Addr: addr, Weight: max(w, 1)},
			Healthy: true, Usable: true, Weight: max(w, 1), Drained: w == 0})
	}
	return s
}

// TestTableIsTheBalancers: the share of keys whose backend a change moves, as the
// balancer httplb runs (userspace/balance, fed by backends) picks them, is the
// share weir plan reads off the two tables Table builds.
func TestTableIsTheBalancers(t *testing.T) {
	tests := []struct {
		name       string
		algo       config.Algorithm
		prev, next []uint32
	}{
		{"one of three drained", config.AlgorithmMaglev, []uint32{1, 1, 1}, []uint32{1, 0, 1}},
		{"a fourth added", config.AlgorithmMaglev, []uint32{1, 1, 1}, []uint32{1, 1, 1, 1}},
		{"weight tripled", config.AlgorithmSourceHash, []uint32{1, 1, 1}, []uint32{3, 1, 1}},
		{"unchanged", config.AlgorithmMaglev, []uint32{2, 1}, []uint32{2, 1}},
	}
	p := &Plane{}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prev, next := service(tt.algo, tt.prev...), service(tt.algo, tt.next...)
			prevT, err := p.Table(prev)
			if err != nil {
				t.Fatal(err)
			}
			nextT, err := p.Table(next)
			if err != nil {
				t.Fatal(err)
			}
			want := plan.CompareTables(prevT, nextT).Share
			bal, err := balance.New(string(tt.algo), nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			owners := func(s *plan.Service) []string {
				var in []balance.Backend
				for _, b := range backends(s) {
					in = append(in, balance.Backend{ID: b.Addr.String(), Weight: b.Weight, Usable: b.Usable && b.Weight > 0})
				}
				bal.SetBackends(in)
				out := make([]string, 200_000)
				for k := range out {
					l, err := bal.Pick(uint64(k)*0x9e3779b97f4a7c15, nil)
					if err != nil {
						t.Fatal(err)
					}
					out[k] = l.Backend()
					l.Release(balance.Result{})
				}
				return out
			}
			before, after := owners(prev), owners(next)
			moved := 0
			for k := range before {
				if before[k] != after[k] {
					moved++
				}
			}
			got := float64(moved) / float64(len(before))
			// 200,000 keys: the sampling error is below 0.3%.
			if math.Abs(got-want) > 0.005 {
				t.Errorf("balancer moved %.4f of the keys; the tables say %.4f", got, want)
			}
		})
	}
}

// TestTableOnlyForHashes: the algorithms that pick without a table have none, and
// a hash service with every backend drained has none.
func TestTableOnlyForHashes(t *testing.T) {
	p := &Plane{}
	for _, tt := range []struct {
		s    *plan.Service
		want bool
	}{
		{service(config.AlgorithmRoundRobin, 1, 1), false},
		{service(config.AlgorithmLeastTime, 1, 1), false},
		{service(config.AlgorithmMaglev, 1, 1), true},
		{service(config.AlgorithmMaglev, 0, 0), false},
	} {
		tab, err := p.Table(tt.s)
		if err != nil || (tab != nil) != tt.want {
			t.Errorf("%s, %d backends: table of %d, %v; want one: %t", tt.s.Config.Algorithm, len(tt.s.Backends), len(tab), err, tt.want)
		}
		if tab != nil && len(tab) != int(balance.MaglevSize(2)) {
			t.Errorf("table size %d; want %d", len(tab), balance.MaglevSize(2))
		}
	}
}

// TestTableRamps: while a backend of a maglev service ramps, the plane gives the
// balancer the planner's table ramps, so its share of the table is the step's.
func TestTableRamps(t *testing.T) {
	s := service(config.AlgorithmMaglev, 1, 1, 1)
	s.Backends[2].Ramp = balance.RampFull / 10 // the third at a tenth of its share
	tab, err := (&Plane{}).Table(s)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, a := range tab {
		if a == s.Backends[2].Config.Addr {
			n++
		}
	}
	if got, want := float64(n)/float64(len(tab)), 0.1/2.1; math.Abs(got-want) > 0.001 {
		t.Errorf("the ramping backend holds %.4f of the table; want %.4f", got, want)
	}
}
