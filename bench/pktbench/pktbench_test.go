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
	res, err := Run(ctx, SmokeCases(), Options{Runs: 1, Duration: 100 * time.Millisecond, Warmup: 50 * time.Millisecond})
	if err != nil {
		xdptest.Check(t, err)
	}
	for _, r := range res {
		s := r.Samples[0]
		if s.Offered == 0 || s.Forwarded == 0 {
			t.Errorf("%s: offered %.0f, forwarded %.0f frames/s; want both > 0", r.Case.Name(), s.Offered, s.Forwarded)
		}
		t.Logf("%s: offered %.3f Mpps, forwarded %.3f Mpps", r.Case.Name(), s.Offered/1e6, s.Forwarded/1e6)
	}
}
