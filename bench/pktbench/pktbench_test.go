package pktbench

import (
	"context"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/xdptest"
)

// TestSmoke runs the smoke cases once, briefly: the line builds, every
// balancer installs and forwards, and frames arrive at its sink. It measures
// nothing.
func TestSmoke(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	opts := Options{Runs: 1, Duration: 300 * time.Millisecond, Warmup: 100 * time.Millisecond}
	res, err := Run(ctx, SmokeCases(), opts)
	if err != nil {
		xdptest.Check(t, err)
	}
	for _, r := range res {
		s := r.Samples[0]
		// On a loaded machine the generator's one long call may start after a
		// window has closed; a case that saw nothing gets two more windows before it
		// counts as broken.
		for try := 0; try < 2 && (s.Offered == 0 || s.Forwarded == 0); try++ {
			again, err := Run(ctx, []Case{r.Case}, opts)
			if err != nil {
				t.Fatal(err)
			}
			s = again[0].Samples[0]
		}
		if s.Offered == 0 || s.Forwarded == 0 {
			t.Errorf("%s: offered %.0f, forwarded %.0f frames/s; want both > 0", r.Case.Name(), s.Offered, s.Forwarded)
		}
		t.Logf("%s: offered %.3f Mpps, forwarded %.3f Mpps", r.Case.Name(), s.Offered/1e6, s.Forwarded/1e6)
	}
}
