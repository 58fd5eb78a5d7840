package served

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// reclaiming is a server that counts its Reclaim calls.
type reclaiming struct {
	server
	reclaims int
	from     *reclaiming // the server Replace started it from; nil: Start did
	ended    bool        // Serve returns at once: it stopped on its own
}

func (r *reclaiming) Reclaim() error { r.reclaims++; return nil }

func (r *reclaiming) Serve(ctx context.Context) error {
	if r.ended {
		return nil
	}
	return r.server.Serve(ctx)
}

// TestReplace: a server a rebuild replaces is handed to Replace, which starts
// its successor (one that stopped on its own is not: Start starts anew), and
// an Abort gives the old server back and has it Reclaim its sockets.
func TestReplace(t *testing.T) {
	endNext := false
	s := &Set[*reclaiming]{
		Start: func(*plan.Service) (*reclaiming, error) { return &reclaiming{ended: endNext}, nil },
		Replace: func(old *reclaiming, _ *plan.Service) (*reclaiming, error) {
			return &reclaiming{from: old}, nil
		},
		Push: func(*reclaiming, *plan.Service) error { return nil },
		Log:  slog.New(slog.DiscardHandler),
		What: "test",
	}
	t.Cleanup(s.Close)
	if err := s.Add(svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	first, _ := s.Get("a")
	if err := s.Update(nil, svc("a", config.AlgorithmEWMA)); err != nil {
		t.Fatal(err)
	}
	second, _ := s.Get("a")
	if second == first || second.from != first {
		t.Fatalf("rebuild: got a server started from %p; want one Replace started from the running one, %p", second.from, first)
	}
	s.Abort()
	if got, _ := s.Get("a"); got != first || first.reclaims != 1 {
		t.Fatalf("abort: got server %p with %d reclaims; want the first, %p, with 1", got, first.reclaims, first)
	}
	// A server that stopped on its own holds no socket to take over.
	endNext = true
	if err := s.Add(svc("b", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	if !waitfor.Cond(10*time.Second, func() bool { return s.services["b"].ended.Load() }) {
		t.Fatal("the server of b did not end")
	}
	if err := s.Update(nil, svc("b", config.AlgorithmEWMA)); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get("b"); got.from != nil {
		t.Errorf("rebuild of an ended server: got one Replace started; want one Start started")
	}
}
