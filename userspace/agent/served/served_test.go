package served

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// server stands in for a listening data plane's server: it serves until its
// context is done, then drains for drain.
type server struct {
	name    string
	pushes  atomic.Int32
	stopped atomic.Bool
	drain   time.Duration
}

func (s *server) Serve(ctx context.Context) error {
	<-ctx.Done()
	time.Sleep(s.drain)
	s.stopped.Store(true)
	return nil
}

func svc(name string, algo config.Algorithm) *plan.Service {
	return &plan.Service{Config: config.Service{Name: name, Algorithm: algo, DataPlane: config.DataPlaneHTTP}}
}

// TestSet: a change plan.Rebuilt (or the set's own rule) calls for gets a new
// server while the old one drains (and Draining shows it); any other is pushed
// to the running one; Remove and Close stop what they should, and Close waits
// for every drain.
func TestSet(t *testing.T) {
	var started []*server
	failNext := false
	s := &Set[*server]{
		Start: func(p *plan.Service) (*server, error) {
			if failNext {
				return nil, errors.New("bind: address in use")
			}
			srv := &server{name: p.Name(), drain: 50 * time.Millisecond}
			started = append(started, srv)
			return srv, nil
		},
		Push: func(srv *server, _ *plan.Service) error { srv.pushes.Add(1); return nil },
		Log:  slog.New(slog.DiscardHandler),
		What: "test",
	}
	if err := s.Add(svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	first, _ := s.Get("a")
	// Same settings but the backends: pushed in place.
	if err := s.Update(nil, svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get("a"); got != first || first.pushes.Load() != 1 {
		t.Fatalf("in-place update: server replaced or not pushed (pushes %d)", first.pushes.Load())
	}
	// The algorithm is fixed for plan.Rebuilt: a new server, the old one drains.
	if err := s.Update(nil, svc("a", config.AlgorithmEWMA)); err != nil {
		t.Fatal(err)
	}
	second, _ := s.Get("a")
	if second == first || len(started) != 2 {
		t.Fatalf("rebuild: got the same server; want a new one")
	}
	// Committed, the old one drains, and is seen draining until it is done.
	s.Commit()
	if d := s.Draining("a"); len(d) != 1 || d[0] != first {
		t.Errorf("draining after the rebuild: got %v; want the first server", d)
	}
	// A set with its own rule keeps the server for the same change.
	s.Rebuilt = func(a, b *config.Service) bool { return a.Name != b.Name }
	if err := s.Update(nil, svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get("a"); got != second || second.pushes.Load() != 1 {
		t.Errorf("own rule: server replaced or not pushed")
	}
	// A failed start leaves the running server in place.
	s.Rebuilt = nil
	failNext = true
	if err := s.Update(nil, svc("a", config.AlgorithmP2C)); err == nil {
		t.Errorf("update with a failing start: got no error")
	}
	failNext = false
	if got, _ := s.Get("a"); got != second || second.stopped.Load() {
		t.Errorf("after a failed rebuild: the running server was replaced or stopped")
	}
	if err := s.Remove(svc("a", config.AlgorithmP2C)); err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Get("a"); ok {
		t.Errorf("removed service still served")
	}
	if err := s.Remove(svc("a", config.AlgorithmP2C)); err != nil {
		t.Errorf("removing twice: %v; want no error", err)
	}
	if err := s.Add(svc("b", config.AlgorithmP2C)); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if d := s.Draining("a"); len(d) != 0 {
		t.Errorf("draining after Close: got %v; want none", d)
	}
	for _, srv := range started {
		if !srv.stopped.Load() {
			t.Errorf("server %s still running after Close; want every one drained", srv.name)
		}
	}
}

// TestSetAbort: a replaced or removed server serves on until Commit retires it;
// Abort closes what the change started and gives each service its server back.
func TestSetAbort(t *testing.T) {
	var started []*server
	s := &Set[*server]{
		Start: func(p *plan.Service) (*server, error) {
			srv := &server{name: p.Name()}
			started = append(started, srv)
			return srv, nil
		},
		Push: func(*server, *plan.Service) error { return nil },
		Log:  slog.New(slog.DiscardHandler),
		What: "test",
	}
	defer s.Close()
	for _, name := range []string{"a", "b"} {
		if err := s.Add(svc(name, config.AlgorithmRoundRobin)); err != nil {
			t.Fatal(err)
		}
	}
	s.Commit()
	a, _ := s.Get("a")
	b, _ := s.Get("b")
	change := func() {
		t.Helper()
		for _, err := range []error{s.Update(nil, svc("a", config.AlgorithmEWMA)), s.Update(nil, svc("a", config.AlgorithmP2C)),
			s.Remove(svc("b", config.AlgorithmRoundRobin)), s.Add(svc("c", config.AlgorithmRoundRobin))} {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	change()
	s.Abort()
	if got, _ := s.Get("a"); got != a {
		t.Errorf("a after Abort: got server %p; want the one it had, %p", got, a)
	}
	if got, _ := s.Get("b"); got != b {
		t.Errorf("b after Abort: got server %p; want the one it had, %p", got, b)
	}
	if _, ok := s.Get("c"); ok {
		t.Errorf("c after Abort: served; want gone")
	}
	waitStopped := func(srv *server, want bool) {
		t.Helper()
		for deadline := time.Now().Add(time.Second); srv.stopped.Load() != want && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		if srv.stopped.Load() != want {
			t.Errorf("server %s (%p): stopped %t; want %t", srv.name, srv, !want, want)
		}
	}
	for _, srv := range started[2:] {
		waitStopped(srv, true)
	}
	// Abort must not stop a and b: the servers it stopped have stopped, and
	// a and b stay up for a while longer (a stop is asynchronous).
	for deadline := time.Now().Add(100 * time.Millisecond); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if a.stopped.Load() || b.stopped.Load() {
			t.Fatalf("after Abort: a stopped %t, b stopped %t; want both serving", a.stopped.Load(), b.stopped.Load())
		}
	}

	change()
	s.Commit()
	waitStopped(a, true)
	waitStopped(b, true)
	if got, _ := s.Get("a"); got != started[len(started)-2] {
		t.Errorf("a after Commit: got %p; want the last server started for it", got)
	}
}

// failing is a server whose listener failed while it still drains what it
// had accepted: Failed says so before its Serve returns (on release).
type failing struct {
	failed  chan struct{}
	release chan struct{}
}

func (s *failing) Serve(ctx context.Context) error {
	<-s.release
	return errors.New("accept: the listener failed")
}

func (s *failing) Failed() <-chan struct{} { return s.failed }

// failingSet returns a set of failing servers, each appended to started;
// a start fails with startErr's error.
func failingSet(t *testing.T, started *[]*failing, startErr func() error) *Set[*failing] {
	s := &Set[*failing]{
		Start: func(p *plan.Service) (*failing, error) {
			if err := startErr(); err != nil {
				return nil, err
			}
			srv := &failing{failed: make(chan struct{}), release: make(chan struct{})}
			*started = append(*started, srv)
			return srv, nil
		},
		Push: func(*failing, *plan.Service) error { return nil },
		Log:  slog.New(slog.DiscardHandler),
		What: "test",
	}
	t.Cleanup(s.Close)
	t.Cleanup(func() {
		for _, srv := range *started {
			close(srv.release)
		}
	})
	return s
}

// TestSetFailedWhileDraining: a server whose listener failed is replaced by
// the next change though its Serve has not returned yet (it drains what it
// had, for up to its drain time, or for ever with none): the change is not
// pushed to a server that accepts nothing, and the old one is seen draining.
func TestSetFailedWhileDraining(t *testing.T) {
	var started []*failing
	s := failingSet(t, &started, func() error { return nil })
	if err := s.Add(svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	first, _ := s.Get("a")
	close(first.failed)
	if err := s.Update(nil, svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	if got, _ := s.Get("a"); got == first || len(started) != 2 {
		t.Fatalf("a change to a service whose listener failed went to the failed server; want a new one")
	}
	if d := s.Draining("a"); len(d) != 1 || d[0] != first {
		t.Errorf("draining after the failed server was replaced: got %v; want it", d)
	}
}

// TestSetRevive: a server whose listener failed is started anew by Revive,
// not before its backoff (100 ms, then twice as long after each failed
// start); State says why the service serves nothing until then, and counts
// the restart once it is made.
func TestSetRevive(t *testing.T) {
	var started []*failing
	fails := 0
	s := failingSet(t, &started, func() error {
		if len(started) > 0 && fails < 2 {
			fails++
			return errors.New("listen: address in use")
		}
		return nil
	})
	a := svc("a", config.AlgorithmRoundRobin)
	if err := s.Add(a); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	find := func(string) *plan.Service { return a }
	if wait := s.Revive(find); wait != 0 {
		t.Errorf("Revive with every server serving: next try in %v; want none (0)", wait)
	}
	close(started[0].failed)
	begin := time.Now()
	var waits []time.Duration
	for len(started) < 2 && time.Since(begin) < 10*time.Second {
		if wait := s.Revive(find); wait > 0 {
			if len(waits) == 0 || wait > waits[len(waits)-1] {
				waits = append(waits, wait)
			}
			if fails == 2 && len(started) == 1 {
				if st := s.State("a"); st.Down != "listen: address in use" || st.Restarts != 0 {
					t.Errorf("state while the start fails: %+v; want the start's error, no restart", st)
				}
			}
			time.Sleep(wait)
		}
	}
	if len(started) != 2 {
		t.Fatalf("after 10s: %d servers started; want the failed one started anew", len(started))
	}
	// The tries were due 100 ms, then 200 ms, then 400 ms apart.
	if took := time.Since(begin); took < 700*time.Millisecond {
		t.Errorf("restarted after %v with 2 failed starts; want at least 700ms of backoff", took)
	}
	if len(waits) == 0 || waits[0] > 100*time.Millisecond {
		t.Errorf("first waits %v; want the first at most 100ms", waits)
	}
	if got, _ := s.Get("a"); got != started[1] {
		t.Errorf("a's server after the restart: got %p; want the new one, %p", got, started[1])
	}
	if st := s.State("a"); st != (State{Restarts: 1}) {
		t.Errorf("state after the restart: %+v; want serving, 1 restart", st)
	}
	if d := s.Draining("a"); len(d) != 1 || d[0] != started[0] {
		t.Errorf("draining after the restart: got %v; want the failed server", d)
	}
}

// TestSetStaleStop: a server that stops on its own after a change replaced
// it (before the change is committed) does not leave its service shown as
// down once Revive has looked: the service's own server serves.
func TestSetStaleStop(t *testing.T) {
	var started []*failing
	s := failingSet(t, &started, func() error { return nil })
	if err := s.Add(svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	if err := s.Update(nil, svc("a", config.AlgorithmEWMA)); err != nil {
		t.Fatal(err)
	}
	close(started[0].failed) // the replaced one, serving until Commit
	deadline := time.Now().Add(10 * time.Second)
	for s.State("a").Down == "" && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	s.Commit()
	if wait := s.Revive(func(string) *plan.Service { return svc("a", config.AlgorithmEWMA) }); wait != 0 {
		t.Errorf("Revive: next try in %v; want none", wait)
	}
	if st := s.State("a"); st != (State{}) || len(started) != 2 {
		t.Errorf("after Revive: state %+v, %d servers started; want serving, no restart, 2", st, len(started))
	}
}

// TestSetAbortKeepsDown: a change that replaced a server which stopped on its
// own, then aborted, gives the service back that server, which serves
// nothing: State says so still (and Revive starts it anew), as it says once
// such a change is committed that the new server serves.
func TestSetAbortKeepsDown(t *testing.T) {
	var started []*failing
	s := failingSet(t, &started, func() error { return nil })
	if err := s.Add(svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	close(started[0].failed)
	waitDown := func(what string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for s.State("a").Down == "" && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if st := s.State("a"); st.Down == "" {
			t.Fatalf("state %s: %+v; want down", what, st)
		}
	}
	waitDown("after the listener failed")

	if err := s.Update(nil, svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	s.Abort()
	if got, _ := s.Get("a"); got != started[0] {
		t.Fatalf("a after Abort: got %p; want the failed server back, %p", got, started[0])
	}
	if st := s.State("a"); st.Down == "" {
		t.Errorf("state after the change was aborted: %+v; want down (its server failed)", st)
	}

	if err := s.Update(nil, svc("a", config.AlgorithmRoundRobin)); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	if st := s.State("a"); st != (State{}) {
		t.Errorf("state after a change gave it a new server: %+v; want serving", st)
	}
}
