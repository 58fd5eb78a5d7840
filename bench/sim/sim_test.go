package main

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// TestDeterministic: the same configuration and seed give the same numbers.
func TestDeterministic(t *testing.T) {
	cfg := config{backends: uniform(5), balancers: 3, policy: "ewma", util: 0.8, jobs: 5000, warmup: 500, seed: 9}
	a, b := run(cfg), run(cfg)
	if !reflect.DeepEqual(a, b) {
		t.Errorf("two runs with seed 9 differ: %+v and %+v; want identical", a, b)
	}
	cfg.seed = 10
	if c := run(cfg); reflect.DeepEqual(a, c) {
		t.Errorf("seeds 9 and 10 gave identical runs; want the seed to matter")
	}
}

// TestFinishSkipsPauses checks service across GC pauses.
func TestFinishSkipsPauses(t *testing.T) {
	s := backendSpec{mean: 1, period: 10, pause: 2, phase: 0}
	tests := []struct {
		start, work, want float64
	}{
		{0, 1, 3},   // starts in a pause: waits until 2
		{5, 1, 6},   // no pause in the way
		{9, 2, 13},  // 1 before the pause at 10, 1 after it ends at 12
		{2, 20, 26}, // two pauses crossed: 8 + 8 + 4
	}
	for _, tt := range tests {
		if got := s.finish(tt.start, tt.work); got != tt.want {
			t.Errorf("finish(%v, %v) = %v; want %v", tt.start, tt.work, got, tt.want)
		}
	}
}

// TestBallsIntoBins: two choices cut the maximum load well below one choice.
func TestBallsIntoBins(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	one, two := ballsIntoBins(10000, 1, rng), ballsIntoBins(10000, 2, rng)
	if two >= one {
		t.Errorf("max load with two choices %d; want below one choice's %d", two, one)
	}
}

// TestQuickRun runs every experiment at the quick scale and checks the files appear.
func TestQuickRun(t *testing.T) {
	if testing.Short() {
		t.Skip("writes plots; about a second")
	}
	dir := t.TempDir()
	report, err := simulate(dir, quickScale, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(report) == 0 {
		t.Errorf("empty report")
	}
	for _, f := range []string{"max-load.png", "herd-p99.png", "slowdown-share-k1.png", "util-p99-gc.png"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("plot %s: %v", f, err)
		}
	}
}

// TestMaglevP2CLongConnections: with one backend holding connections three times as
// long, maglev_p2c sends it less than maglev's third and evens out open connections;
// plain maglev never takes a second candidate.
func TestMaglevP2CLongConnections(t *testing.T) {
	for _, k := range []int{1, 16} {
		cfg := config{backends: connBackends(), balancers: k, util: 100.0 / 5 / 3, infinite: true, jobs: 20000, warmup: 2000, seed: 3}
		cfg.policy = "maglev"
		mg := run(cfg)
		cfg.policy = "maglev_p2c"
		p2 := run(cfg)
		if p2.maxOverMean >= mg.maxOverMean || p2.share[connSlow] >= mg.share[connSlow] {
			t.Errorf("K=%d: maglev_p2c max/mean %.2f, slow share %.3f; want both below maglev's %.2f, %.3f",
				k, p2.maxOverMean, p2.share[connSlow], mg.maxOverMean, mg.share[connSlow])
		}
		if mg.second != 0 || p2.second == 0 {
			t.Errorf("K=%d: second-candidate share maglev %.3f, maglev_p2c %.3f; want 0 and > 0", k, mg.second, p2.second)
		}
	}
}
