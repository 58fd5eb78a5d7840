// Package served keeps the running services of a data plane that listens itself
// (the proxy, the http plane): one server per service, updated in place, or
// replaced by a new one when a setting fixed at listen time changes
// (plan.Rebuilt); replaced and removed servers finish their work in the
// background.
//
// Add, Update and Remove are called from the agent's reconcile loop only; Get
// may be called from any goroutine (status and metrics read it).
package served

import (
	"context"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// Server is one service's running server. Serve returns when ctx is done and
// the server has drained (its own drain timeout bounds that).
type Server interface {
	Serve(ctx context.Context) error
}

// Set is the running servers of one data plane, by service name.
type Set[S Server] struct {
	// Start binds a server for s with its backends set; Serve is called after.
	Start func(s *plan.Service) (S, error)
	// Push gives a running server s's backends (and whatever else it can
	// change in place).
	Push func(srv S, s *plan.Service) error
	// Rebuilt says whether a change needs a new server; nil: plan.Rebuilt.
	Rebuilt func(a, b *config.Service) bool
	Log     *slog.Logger
	// What names the plane in logs: "proxy", "http plane".
	What string

	services map[string]*entry[S] // loop only
	served   atomic.Pointer[map[string]S]
	retiring sync.WaitGroup // servers removed or replaced, draining
}

type entry[S Server] struct {
	cfg  config.Service
	srv  S
	stop context.CancelFunc
	done chan struct{} // closed when Serve has returned
}

// Get returns the named service's server.
func (p *Set[S]) Get(name string) (S, bool) {
	var zero S
	m := p.served.Load()
	if m == nil {
		return zero, false
	}
	srv, ok := (*m)[name]
	return srv, ok
}

func (p *Set[S]) publish() {
	m := make(map[string]S, len(p.services))
	for name, e := range p.services {
		m[name] = e.srv
	}
	p.served.Store(&m)
}

// Add starts serving a service.
func (p *Set[S]) Add(s *plan.Service) error {
	if e, ok := p.services[s.Name()]; ok {
		return p.Update(&plan.Service{Config: e.cfg}, s)
	}
	e, err := p.start(s)
	if err != nil {
		return err
	}
	if p.services == nil {
		p.services = make(map[string]*entry[S])
	}
	p.services[s.Name()] = e
	p.publish()
	return nil
}

func (p *Set[S]) start(s *plan.Service) (*entry[S], error) {
	srv, err := p.Start(s)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &entry[S]{cfg: s.Config, srv: srv, stop: cancel, done: make(chan struct{})}
	// Exits when e.stop is called (service removed or replaced, or the set
	// closes) and the server has drained.
	go func() {
		defer close(e.done)
		if err := srv.Serve(ctx); err != nil {
			p.Log.Error(p.What+" stopped", "service", s.Name(), "err", err)
		}
	}()
	return e, nil
}

// Update brings a service from prev to next: a new server when a setting fixed
// at listen time changed (the old one drains), else new backends in place.
func (p *Set[S]) Update(prev, next *plan.Service) error {
	e, ok := p.services[next.Name()]
	if !ok {
		return p.Add(next)
	}
	rebuilt := p.Rebuilt
	if rebuilt == nil {
		rebuilt = plan.Rebuilt
	}
	if !rebuilt(&e.cfg, &next.Config) {
		if err := p.Push(e.srv, next); err != nil {
			return err
		}
		e.cfg = next.Config
		return nil
	}
	fresh, err := p.start(next)
	if err != nil {
		return err
	}
	p.services[next.Name()] = fresh
	p.publish()
	p.retire(e)
	return nil
}

// SetBackend applies one backend's change: the servers take the whole set.
func (p *Set[S]) SetBackend(prev, next *plan.Service, _ netip.AddrPort) error {
	return p.Update(prev, next)
}

// Remove stops a service's server; it drains in the background. Removing a
// service the set does not serve is no error.
func (p *Set[S]) Remove(s *plan.Service) error {
	e, ok := p.services[s.Name()]
	if !ok {
		return nil
	}
	delete(p.services, s.Name())
	p.publish()
	p.retire(e)
	return nil
}

func (p *Set[S]) retire(e *entry[S]) {
	e.stop()
	// Exits when the old server has drained; Close waits for it.
	p.retiring.Go(func() { <-e.done })
}

// Close stops every server, letting each drain, and waits for all of them,
// including those retired before.
func (p *Set[S]) Close() {
	for _, e := range p.services {
		e.stop()
	}
	for _, e := range p.services {
		<-e.done
	}
	clear(p.services)
	p.publish()
	p.retiring.Wait()
}
