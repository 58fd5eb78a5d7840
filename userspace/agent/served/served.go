// Package served keeps the running services of a data plane that listens itself
// (the proxy, the http plane): one server per service, updated in place, or
// replaced by a new one when a setting fixed at listen time changes
// (plan.Rebuilt); replaced and removed servers finish their work in the
// background.
//
// A change is two-phase: a server that Update replaces or Remove removes goes on
// serving until Commit retires it, and Abort closes what the change started and
// gives every service back the server it had, untouched (its connections and
// counters too), so a change the agent refuses loses nothing.
//
// Add, Update, Remove, Commit and Abort are called from the agent's reconcile
// loop only; Get may be called from any goroutine (status and metrics read it).
package served

import (
	"context"
	"log/slog"
	"net/netip"
	"slices"
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
	// before is what each service the change in progress touched had when it
	// began (a nil entry: nothing), until Commit or Abort (loop only).
	before   map[string]held[S]
	served   atomic.Pointer[map[string]S]
	retiring sync.WaitGroup // servers removed or replaced, draining

	mu       sync.Mutex
	draining map[string][]S // the servers retiring waits for, by service name
}

// held is a service's server and its settings as a change found them.
type held[S Server] struct {
	e   *entry[S]
	cfg config.Service
}

// failer is a Server that can tell it stopped serving on its own (its
// listener failed) while its Serve still drains what it had accepted.
type failer interface {
	Failed() bool
}

// over reports whether e's server stopped serving on its own: its Serve
// returned, or it is only draining after its listener failed.
func (e *entry[S]) over() bool {
	if e.ended.Load() {
		return true
	}
	f, ok := any(e.srv).(failer)
	return ok && f.Failed()
}

type entry[S Server] struct {
	cfg  config.Service
	srv  S
	stop context.CancelFunc
	done chan struct{} // closed when Serve has returned
	// ended is set as Serve returns, before its error is logged: a server
	// that stopped on its own (its listener failed) takes no change in
	// place, and the next one starts it anew.
	ended atomic.Bool
}

// Draining returns the named service's servers that were replaced or removed
// and still finish their work (connections, requests).
func (p *Set[S]) Draining(name string) []S {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.draining[name])
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

// hold remembers what name has before the change in progress first touches it.
func (p *Set[S]) hold(name string) {
	if _, ok := p.before[name]; ok {
		return
	}
	if p.before == nil {
		p.before = make(map[string]held[S])
	}
	var h held[S]
	if e := p.services[name]; e != nil {
		h = held[S]{e: e, cfg: e.cfg}
	}
	p.before[name] = h
}

// drop ends a server the change no longer serves: at once if the change
// started it, else when the change is committed.
func (p *Set[S]) drop(name string, e *entry[S]) {
	if p.before[name].e != e {
		p.retire(e)
	}
}

// Add starts serving a service.
func (p *Set[S]) Add(s *plan.Service) error {
	if e, ok := p.services[s.Name()]; ok {
		return p.Update(&plan.Service{Config: e.cfg}, s)
	}
	p.hold(s.Name())
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
		err := srv.Serve(ctx)
		e.ended.Store(true)
		if err != nil {
			p.Log.Error(p.What+" stopped", "service", s.Name(), "err", err)
		}
	}()
	return e, nil
}

// Update brings a service from prev to next: a new server when a setting fixed
// at listen time changed (the old one drains) or the running one stopped
// serving on its own (it drains what it had), else new backends in place.
func (p *Set[S]) Update(prev, next *plan.Service) error {
	e, ok := p.services[next.Name()]
	if !ok {
		return p.Add(next)
	}
	p.hold(next.Name())
	rebuilt := p.Rebuilt
	if rebuilt == nil {
		rebuilt = plan.Rebuilt
	}
	if !e.over() && !rebuilt(&e.cfg, &next.Config) {
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
	p.drop(next.Name(), e)
	return nil
}

// SetBackend applies one backend's change: the servers take the whole set.
func (p *Set[S]) SetBackend(prev, next *plan.Service, _ netip.AddrPort) error {
	return p.Update(prev, next)
}

// Remove stops a service's server; once the change is committed it drains in
// the background. Removing a service the set does not serve is no error.
func (p *Set[S]) Remove(s *plan.Service) error {
	e, ok := p.services[s.Name()]
	if !ok {
		return nil
	}
	p.hold(s.Name())
	delete(p.services, s.Name())
	p.publish()
	p.drop(s.Name(), e)
	return nil
}

// Commit ends the change in progress: the servers it replaced or removed drain
// in the background.
func (p *Set[S]) Commit() {
	for name, h := range p.before {
		if h.e != nil && p.services[name] != h.e {
			p.retire(h.e)
		}
	}
	clear(p.before)
}

// Abort undoes the change in progress: the servers it started are closed (they
// drain what they accepted), and each service it touched has the server and
// settings it had before again. A server pushed new backends in place keeps
// them until the caller pushes the old ones (the agent's rollback does).
func (p *Set[S]) Abort() {
	for name, h := range p.before {
		if cur := p.services[name]; cur != nil && cur != h.e {
			p.retire(cur)
		}
		if h.e == nil {
			delete(p.services, name)
			continue
		}
		h.e.cfg = h.cfg
		p.services[name] = h.e
	}
	clear(p.before)
	p.publish()
}

func (p *Set[S]) retire(e *entry[S]) {
	e.stop()
	name := e.cfg.Name
	p.mu.Lock()
	if p.draining == nil {
		p.draining = make(map[string][]S)
	}
	p.draining[name] = append(p.draining[name], e.srv)
	p.mu.Unlock()
	// Exits when the old server has drained; Close waits for it.
	p.retiring.Go(func() {
		<-e.done
		p.mu.Lock()
		defer p.mu.Unlock()
		p.draining[name] = slices.DeleteFunc(p.draining[name], func(s S) bool { return any(s) == any(e.srv) })
		if len(p.draining[name]) == 0 {
			delete(p.draining, name)
		}
	})
}

// Close stops every server, letting each drain, and waits for all of them,
// including those retired before. A change in progress is committed first.
func (p *Set[S]) Close() {
	p.Commit()
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
