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
// A server that stops serving on its own (its Serve returned, or its listener
// failed while it drains) is started anew by Revive, which the loop calls when
// Wake tells it, with a backoff from 100 ms doubling to 5 s between tries.
//
// Add, Update, Remove, Commit, Abort and Revive are called from the agent's
// reconcile loop only; Get, View and State may be called from any goroutine
// (status and metrics read them).
package served

import (
	"context"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

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
	// Replace, if set, starts the server that replaces old, running, for s
	// (a setting fixed at listen time changed), as Start would: it may take
	// old's listening sockets over instead of binding new ones, so the
	// connections queued on them are not reset when old retires. If the
	// change is aborted, old serves on; if it has a Reclaim() error method,
	// that is called to put back what the new server set on the sockets.
	// Update calls it with the service's own server; Add, with the running
	// server of another service listening on the same address (Listen), so a
	// renamed service takes its old name's sockets over too.
	Replace func(old S, s *plan.Service) (S, error)
	// Listen, if set, is the address a service's server listens on: Add
	// gives Replace a server of another name on the same address.
	Listen func(c *config.Service) netip.AddrPort
	// Rebuilt says whether a change needs a new server; nil: plan.Rebuilt.
	Rebuilt func(a, b *config.Service) bool
	Log     *slog.Logger
	// What names the plane in logs: "proxy", "http plane".
	What string
	// Wake, if set, is called from any goroutine when a server stops serving
	// on its own: the loop should call Revive soon.
	Wake func()
	// Drained, if set, is called with a retired server once it has drained,
	// under the lock View holds: a plane folds its counters into what the
	// service carries, so they do not go back when a server is replaced.
	Drained func(name string, srv S)

	services map[string]*entry[S] // loop only
	// before is what each service the change in progress touched had when it
	// began (a nil entry: nothing), until Commit or Abort: the loop reads it,
	// and writes it with mu held, so Drained may read it under mu.
	before   map[string]held[S]
	served   atomic.Pointer[map[string]S]
	retiring sync.WaitGroup // servers removed or replaced, draining

	mu       sync.Mutex
	draining map[string][]S // the servers retiring waits for, by service name
	// kept are the servers the change in progress replaced, which serve on
	// until Commit, by service name.
	kept     map[string][]S
	revivals map[string]*revival
}

// revival is how a service whose server stopped on its own is started anew.
type revival struct {
	restarts uint64        // servers started anew by Revive
	wait     time.Duration // the backoff before the next try
	due      time.Time     // the next try; zero: none pending
	why      string        // why the service serves nothing ("": it serves)
}

// The backoff between tries to start a stopped server anew: the first try
// waits firstWait, each further one twice the last, up to maxWait. A server
// that served for stableFor before it stopped starts the backoff again.
const (
	firstWait = 100 * time.Millisecond
	maxWait   = 5 * time.Second
	stableFor = 2 * maxWait
)

// State is what a service's server does, for status and metrics.
type State struct {
	// Down says why the service serves nothing now; "" while it serves.
	Down string
	// Restarts counts the servers started anew after one stopped on its own.
	Restarts uint64
}

// held is a service's server and its settings as a change found them.
type held[S Server] struct {
	e   *entry[S]
	cfg config.Service
}

// failer is a Server that can tell it stopped serving on its own (its
// listener failed) while its Serve still drains what it had accepted: the
// channel Failed returns is closed then.
type failer interface {
	Failed() <-chan struct{}
}

// over reports whether e's server stopped serving on its own: its Serve
// returned, or it is only draining after its listener failed.
func (e *entry[S]) over() bool {
	if e.ended.Load() {
		return true
	}
	f, ok := any(e.srv).(failer)
	if !ok {
		return false
	}
	select {
	case <-f.Failed():
		return true
	default:
		return false
	}
}

type entry[S Server] struct {
	cfg     config.Service
	srv     S
	stop    context.CancelFunc
	started time.Time
	done    chan struct{} // closed when Serve has returned
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
	var h held[S]
	if e := p.services[name]; e != nil {
		h = held[S]{e: e, cfg: e.cfg}
	}
	p.mu.Lock()
	if p.before == nil {
		p.before = make(map[string]held[S])
	}
	p.before[name] = h
	p.mu.Unlock()
}

// mayServe reports whether name is served, or was when the change in progress
// began, which Abort may give it back; p.mu is held.
func (p *Set[S]) mayServe(name string) bool {
	if _, ok := p.Get(name); ok {
		return true
	}
	return p.before[name].e != nil
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
	start := p.Start
	if d := p.donor(s); d != nil {
		start = func(s *plan.Service) (S, error) { return p.Replace(d.srv, s) }
	}
	e, err := p.start(s, start)
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

// donor returns a running server of another service that listens where s
// will: s is a rename (or takes the address of a service the change removes
// or moves away), and its server takes the donor's listening sockets over.
// The donor's service is held: a refused change gives it its settings on
// them back (Abort). Nil if there is none, or no Replace or Listen.
func (p *Set[S]) donor(s *plan.Service) *entry[S] {
	if p.Replace == nil || p.Listen == nil {
		return nil
	}
	name, d := p.listening(p.Listen(&s.Config), s.Name())
	if d != nil {
		p.hold(name)
	}
	return d
}

// listening returns a running server listening on at, of a service other
// than except, and that service's name; nil if there is none (or at has port
// 0: each server binds a port of its own there).
func (p *Set[S]) listening(at netip.AddrPort, except string) (string, *entry[S]) {
	if at.Port() == 0 {
		return "", nil
	}
	for name, e := range p.services {
		if name != except && !e.over() && p.Listen(&e.cfg) == at {
			return name, e
		}
	}
	// Removed by the change in progress, it still serves until Commit.
	for name, h := range p.before {
		if h.e != nil && name != except && p.services[name] != h.e && !h.e.over() && p.Listen(&h.cfg) == at {
			return name, h.e
		}
	}
	return "", nil
}

// ListeningOn returns the running server that listens on at, if any (Listen
// must be set): a server of another plane that a service moves to on the same
// address takes its listening sockets over. Called from the loop only.
func (p *Set[S]) ListeningOn(at netip.AddrPort) (S, bool) {
	var zero S
	if p.Listen == nil {
		return zero, false
	}
	if _, e := p.listening(at, ""); e != nil {
		return e.srv, true
	}
	return zero, false
}

func (p *Set[S]) start(s *plan.Service, start func(*plan.Service) (S, error)) (*entry[S], error) {
	srv, err := start(s)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &entry[S]{cfg: s.Config, srv: srv, stop: cancel, started: time.Now(), done: make(chan struct{})}
	// Exits when e.stop is called (service removed or replaced, or the set
	// closes) and the server has drained.
	go func() {
		defer close(e.done)
		err := srv.Serve(ctx)
		e.ended.Store(true)
		if ctx.Err() == nil {
			why := "its server stopped"
			if err != nil {
				why = err.Error()
			}
			p.stopped(s.Name(), why)
		}
		if err != nil {
			p.Log.Error(p.What+" stopped", "service", s.Name(), "err", err)
		}
	}()
	if f, ok := any(srv).(failer); ok {
		// Exits when the listener fails or Serve returns.
		go func() {
			select {
			case <-f.Failed():
				if ctx.Err() == nil {
					p.stopped(s.Name(), "its listener failed")
				}
			case <-e.done:
			}
		}()
	}
	return e, nil
}

// stopped notes why name's server stopped serving on its own, and wakes the
// loop to start it anew. A stale note (the server was replaced meanwhile) is
// dropped by Revive, which looks at the running server itself.
func (p *Set[S]) stopped(name, why string) {
	p.mu.Lock()
	r := p.revival(name)
	if r.why == "" || r.why == "its listener failed" {
		r.why = why
	}
	p.mu.Unlock()
	if p.Wake != nil {
		p.Wake()
	}
}

// revival returns name's revival, made on first use; p.mu is held.
func (p *Set[S]) revival(name string) *revival {
	if p.revivals == nil {
		p.revivals = make(map[string]*revival)
	}
	r := p.revivals[name]
	if r == nil {
		r = &revival{}
		p.revivals[name] = r
	}
	return r
}

// Revive starts anew the servers that stopped serving on their own, those
// whose backoff is over; find gives a service's desired state (nil: none).
// It returns how long until the next try is due, 0 if none is.
func (p *Set[S]) Revive(find func(name string) *plan.Service) time.Duration {
	now := time.Now()
	var next time.Duration
	soon := func(d time.Duration) {
		if next == 0 || d < next {
			next = d
		}
	}
	for name, e := range p.services {
		if !e.over() {
			// A note from a server the service no longer has (replaced
			// as it stopped) says nothing of the one it has.
			p.mu.Lock()
			if r := p.revivals[name]; r != nil {
				r.due, r.why = time.Time{}, ""
			}
			p.mu.Unlock()
			continue
		}
		s := find(name)
		if s == nil {
			continue
		}
		p.mu.Lock()
		r := p.revival(name)
		if r.why == "" {
			r.why = "its server stopped"
		}
		if r.due.IsZero() {
			switch {
			case r.wait == 0 || now.Sub(e.started) >= stableFor:
				r.wait = firstWait
			default:
				r.wait = min(2*r.wait, maxWait)
			}
			r.due = now.Add(r.wait)
		}
		due, why, try := r.due, r.why, r.restarts+1
		p.mu.Unlock()
		if wait := due.Sub(now); wait > 0 {
			soon(wait)
			continue
		}
		fresh, err := p.start(s, p.Start)
		if err == nil {
			p.join(fresh.srv) // no change to abort
		}
		p.mu.Lock()
		if err != nil {
			r.why = err.Error()
			r.wait = min(2*r.wait, maxWait)
			r.due = now.Add(r.wait)
			wait := r.wait
			p.mu.Unlock()
			p.Log.Error(p.What+": start anew a service that stopped serving", "service", name, "reason", why, "err", err, "retry_in", wait)
			soon(wait)
			continue
		}
		p.Log.Warn(p.What+": started anew a service that stopped serving", "service", name, "reason", why, "restart", try)
		r.restarts++
		r.due, r.why = time.Time{}, ""
		// The old server is draining before the new one is published, in
		// one step for View: counters neither drop nor count twice.
		p.services[name] = fresh
		p.publish()
		p.retireLocked(e)
		p.mu.Unlock()
	}
	return next
}

// State returns what the named service's server does.
func (p *Set[S]) State(name string) State {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.revivals[name]
	if r == nil {
		return State{}
	}
	return State{Down: r.why, Restarts: r.restarts}
}

// View calls f with the named service's server, and those replaced or
// removed that still serve or drain, under the lock Drained is called with.
func (p *Set[S]) View(name string, f func(srv S, ok bool, others []S)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	srv, ok := p.Get(name)
	others := p.draining[name]
	if len(p.kept[name]) > 0 {
		others = append(slices.Clone(others), p.kept[name]...)
	}
	f(srv, ok, others)
}

// Update brings a service from prev to next: a new server when a setting fixed
// at listen time changed (the old one drains) or the running one stopped
// serving on its own (it drains what it had), else new backends in place. A
// service whose server stopped takes a change of no such setting even when
// its new server cannot start: it stays down, for Revive to start anew.
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
	over, rebuild := e.over(), rebuilt(&e.cfg, &next.Config)
	if !over && !rebuild {
		if err := p.Push(e.srv, next); err != nil {
			return err
		}
		e.cfg = next.Config
		return nil
	}
	start := p.Start
	if from := p.from(e, over, next); from != nil {
		start = func(s *plan.Service) (S, error) { return p.Replace(from.srv, s) }
	}
	fresh, err := p.start(next, start)
	if err != nil && over && !rebuild {
		// What the server binds is as before: the change is no reason
		// for the start to fail, and is taken; Revive tries again.
		e.cfg = next.Config
		p.mu.Lock()
		p.revival(next.Name()).why = err.Error()
		p.mu.Unlock()
		return nil
	}
	if err != nil {
		return err
	}
	// In one step for View: the old server's counters are not missed.
	p.mu.Lock()
	p.services[next.Name()] = fresh
	p.publish()
	if p.before[next.Name()].e == e {
		if p.kept == nil {
			p.kept = make(map[string][]S)
		}
		p.kept[next.Name()] = append(p.kept[next.Name()], e.srv)
	} else {
		p.retireLocked(e) // the change started it
	}
	p.mu.Unlock()
	return nil
}

// from returns the running server whose listening sockets the server that
// Update starts for next takes over (Replace): e's, the service's own, where
// next listens as e does and e serves; where next listens elsewhere, the
// donor there (two services swap their names or addresses, or one takes the
// address of one removed). Nil: none, the new server binds anew.
func (p *Set[S]) from(e *entry[S], over bool, next *plan.Service) *entry[S] {
	if p.Replace == nil {
		return nil
	}
	if p.Listen == nil || p.Listen(&e.cfg) == p.Listen(&next.Config) {
		if over {
			return nil
		}
		return e
	}
	return p.donor(next)
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
// in the background, and those it started make every socket they bound listen
// (Join).
func (p *Set[S]) Commit() {
	var started []S
	p.mu.Lock()
	for name, h := range p.before {
		if h.e != nil && p.services[name] != h.e {
			p.retireLocked(h.e)
		}
		if e := p.services[name]; e != nil && e != h.e {
			started = append(started, e.srv)
		}
		// A service the change gave a new server serves again (until
		// Commit, Abort could give it back the one that stopped).
		if e, r := p.services[name], p.revivals[name]; e != nil && r != nil && !e.over() {
			r.due, r.why = time.Time{}, ""
		}
	}
	clear(p.before)
	clear(p.kept)
	for name := range p.revivals {
		if _, ok := p.services[name]; !ok {
			delete(p.revivals, name)
		}
	}
	p.mu.Unlock()
	for _, srv := range started {
		p.join(srv)
	}
}

// joiner is a Server that a replacement (Replace) may start with sockets
// bound beside those it took over that listen only once Join is called:
// until the change is committed, so an aborted one closes them with nothing
// queued on them.
type joiner interface {
	Join() error
}

// join makes srv's sockets all listen, if it has such.
func (p *Set[S]) join(srv S) {
	if j, ok := any(srv).(joiner); ok {
		if err := j.Join(); err != nil {
			p.Log.Warn(p.What+": a listening socket serves no connection", "err", err)
		}
	}
}

// Abort undoes the change in progress: the servers it started are closed (they
// drain what they accepted), and each service it touched has the server and
// settings it had before again. A server pushed new backends in place keeps
// them until the caller pushes the old ones (the agent's rollback does).
func (p *Set[S]) Abort() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for name, h := range p.before {
		if cur := p.services[name]; cur != nil && cur != h.e {
			p.retireLocked(cur)
		}
		if h.e == nil {
			delete(p.services, name)
			continue
		}
		h.e.cfg = h.cfg
		p.services[name] = h.e
		// A replacement that took the sockets over, or failed to start
		// after it did, may have changed their settings.
		if r, ok := any(h.e.srv).(reclaimer); ok {
			if err := r.Reclaim(); err != nil {
				p.Log.Warn(p.What+": the listener's settings were not put back", "service", name, "err", err)
			}
		}
	}
	clear(p.before)
	clear(p.kept)
	p.publish()
}

// reclaimer is a Server whose listening sockets a replacement may have taken
// over (Replace) and changed: Reclaim sets its own settings on them again.
type reclaimer interface {
	Reclaim() error
}

// Peer finds servers of another plane whose sockets a service that moves to
// this plane on the same address takes over, and remembers them until the
// change in progress ends: Abort gives them their settings back (Reclaim).
// Loop only.
type Peer[T any] struct {
	// Find, if set, returns the other plane's running server that listens
	// on an address, if any.
	Find func(at netip.AddrPort) (T, bool)
	lent []T
}

// Take returns the other plane's server listening on at, if any, and
// remembers it.
func (p *Peer[T]) Take(at netip.AddrPort) (T, bool) {
	var zero T
	if p.Find == nil {
		return zero, false
	}
	srv, ok := p.Find(at)
	if !ok {
		return zero, false // not a typed nil in an interface T
	}
	p.lent = append(p.lent, srv)
	return srv, true
}

// Commit forgets the servers taken from.
func (p *Peer[T]) Commit() { p.lent = nil }

// Abort calls Reclaim on the servers taken from that have it, logging what
// fails, and forgets them.
func (p *Peer[T]) Abort(log *slog.Logger) {
	for _, srv := range p.lent {
		if r, ok := any(srv).(reclaimer); ok {
			if err := r.Reclaim(); err != nil {
				log.Warn("the listener's settings were not put back", "err", err)
			}
		}
	}
	p.lent = nil
}

func (p *Set[S]) retire(e *entry[S]) {
	p.mu.Lock()
	p.retireLocked(e)
	p.mu.Unlock()
}

// retireLocked stops e and counts it draining until it has; p.mu is held.
func (p *Set[S]) retireLocked(e *entry[S]) {
	e.stop()
	name := e.cfg.Name
	if p.draining == nil {
		p.draining = make(map[string][]S)
	}
	p.draining[name] = append(p.draining[name], e.srv)
	// Exits when the old server has drained; Close waits for it.
	p.retiring.Go(func() {
		<-e.done
		p.mu.Lock()
		defer p.mu.Unlock()
		p.draining[name] = slices.DeleteFunc(p.draining[name], func(s S) bool { return any(s) == any(e.srv) })
		if len(p.draining[name]) == 0 {
			delete(p.draining, name)
		}
		if p.Drained != nil {
			p.Drained(name, e.srv)
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
