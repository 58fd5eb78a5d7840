package health

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultMaxInFlight bounds the checks in flight when Checker.MaxInFlight is 0.
// A black-holed backend holds its slot for the whole Timeout, so the bound must
// exceed the sum over such backends of Timeout/Interval, or healthy backends'
// checks start late; 1024 leaves room for a tenth of 10,000 backends
// black-holed at Timeout = Interval while staying far below a 20,000 open-file cap.
const DefaultMaxInFlight = 1024

// maxSlack bounds how early the scheduler starts a check: it starts, in one
// pass, every check due within the slack of now, trading a little earliness
// (nothing next to the interval's jitter) for far fewer timer wakeups when
// thousands of checks are spread over an interval.
const maxSlack = 5 * time.Millisecond

// slackFor is the slack for a given shortest interval: 1/200 of it, capped.
func slackFor(interval time.Duration) time.Duration {
	return min(maxSlack, interval/200)
}

// ErrRunning is returned by Run when the Checker is already running.
var ErrRunning = errors.New("checker already running")

// Checker checks backends and tracks their health. The zero value is ready to
// use; set the exported fields before Run and do not change them afterwards.
// All methods are safe for concurrent use.
type Checker struct {
	// MaxInFlight bounds the number of checks running at once. 0 means
	// DefaultMaxInFlight.
	MaxInFlight int
	// MaxKept bounds the backends whose HTTP checks keep their connection
	// alive between checks, one file descriptor each. The others' checks
	// close their connection after the response, so the next one connects
	// again. 0 means
	// half of the process's open-file limit when Run starts (all of them
	// where the OS has no such limit).
	MaxKept int
	// Dial, when set, opens check connections in place of a net.Dialer, e.g.
	// to check from another network namespace or VRF. Check.Source is then
	// the dialer's business. Syn checks do not use it: their raw sockets
	// live in the network namespace Run was called in.
	Dial func(ctx context.Context, network, address string) (net.Conn, error)
	// SynPorts is the inclusive source port range of syn checks (MethodSyn).
	// The zero value means DefaultSynPorts. Run adds it to the namespace's
	// ip_local_reserved_ports, so the kernel never gives one of these ports to
	// a local connection, and restores the setting when it returns; see
	// Checker.Syn for what it managed.
	SynPorts [2]uint16
	// OnCheck, when set, is called after every completed active check, after
	// its result is applied and before the backend's next check is scheduled;
	// keep it fast. It is not called for checks cut short by Remove or by the
	// end of Run.
	OnCheck func(Result)

	// clock replaces time.Now in tests.
	clock func() time.Time

	// firstPasses counts the backends whose first pass (Status.Passed) came:
	// a caller waiting for one need not look at every backend while it stays.
	firstPasses atomic.Uint64

	mu       sync.RWMutex
	services map[string]*service
	backends map[string]*backend
	due      dueQueue  // backends waiting for their next check
	ejected  ejectHeap // ejected backends by end of ejection
	wake     chan struct{}
	subs     map[*Subscription]struct{}
	running  bool

	// The syn prober of the running Run: opened on Run's goroutine (so in its
	// network namespace) when the first syn check is due, closed when Run
	// returns. synErr says why it could not be opened; syn checks then connect.
	syn     *synProber
	synErr  error
	synOpen bool // opening was tried in this Run

	workers *workers // of the running Run
	kept    int      // backends holding a kept-alive slot (b.slot)
	maxKept int      // of the running Run
}

type service struct {
	name    string
	cfg     Config
	dialer  *net.Dialer
	members map[*backend]struct{}
	up      int // members whose State is Up
	nEject  int // members currently ejected
	panic   bool
}

type backend struct {
	id, addr string
	ap       netip.AddrPort // addr parsed; invalid for a host name, which syn checks cannot use
	svc      *service
	removed  bool
	// gen changes when the check target or kind changes, so the result of a
	// check started before is dropped.
	gen uint64

	dueAt    time.Time
	queued   bool               // in Checker.due
	dueSeq   uint32             // tells b's live entry in Checker.due from stale ones
	inflight context.CancelFunc // non-nil while a check runs
	keep     *keptConn          // the idle kept-alive connection of HTTP checks, nil while one runs
	// slot: b counts against MaxKept, with its connection idle in keep or in
	// use by its check. A slot stays with its backend while the connection
	// lives, so that one backend's check in flight does not hand it to another.
	slot bool
	// The syn check in flight, if any (synPort 0 otherwise): its source
	// port and sequence number in the prober, and what its result needs,
	// kept here so that starting one allocates nothing.
	synPort  uint16
	synSeq   uint32
	synRun   checkRun
	synStart time.Time
	synSrc   srcEntry // the source address of its syn checks, as routing picked it

	active        State
	passes, fails int
	passed        bool // a check of the current target has passed (retarget forgets it)
	last          Result

	state  State
	since  time.Time
	reason string
	// what subscribers were last told
	pubState  State
	pubUsable bool
	pubPanic  bool

	consec       atomic.Int32 // consecutive passive failures
	ejectedUntil time.Time
	ejectIdx     int // index in Checker.ejected, -1 when not ejected
	ejections    int
	returned     time.Time
}

func (c *Checker) now() time.Time {
	if c.clock != nil {
		return c.clock()
	}
	return time.Now()
}

// init makes the zero Checker usable; c.mu must be held.
func (c *Checker) init() {
	if c.services == nil {
		c.services = make(map[string]*service)
		c.backends = make(map[string]*backend)
		c.subs = make(map[*Subscription]struct{})
		c.wake = make(chan struct{}, 1)
	}
}

// poke tells a running scheduler that its queue changed; c.mu must be held.
func (c *Checker) poke() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// SetService creates or reconfigures a service. Reconfiguring keeps every
// backend's state and schedule, except that a shorter interval pulls the next
// checks of this service's backends forward; other services are not touched.
// A change of what one check asks (Check.Kind, Method, Timeout, Source or
// HTTP) restarts the backends' pass and fail counts and drops the results of
// their checks in flight, as a new address does; a change of Interval, Rise,
// Fall, Jitter or Initial alone keeps them.
func (c *Checker) SetService(name string, cfg Config) error {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return fmt.Errorf("set service %q: %w", name, err)
	}
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.init()
	s, ok := c.services[name]
	if !ok {
		s = &service{name: name, members: make(map[*backend]struct{})}
		c.services[name] = s
	}
	old := s.cfg
	s.cfg = cfg
	s.dialer = newDialer(cfg.Check)
	if !ok {
		return nil
	}
	changed := !sameProbe(old.Check, cfg.Check)
	for b := range s.members {
		if changed {
			// The next check asks anew (from the new source, say); one in
			// flight neither counts nor keeps its connection (complete).
			c.retarget(b)
		}
		if old.Check.Kind != cfg.Check.Kind {
			switch {
			case cfg.Check.Kind == None:
				b.active = Up
				c.unqueue(b)
			case old.Check.Kind == None:
				c.queue(b, now.Add(randDuration(cfg.Check.Interval)))
			}
		}
		if b.queued && b.dueAt.Sub(now) > cfg.Check.Interval {
			c.queue(b, now.Add(randDuration(cfg.Check.Interval)))
		}
		if !cfg.Outlier.passive() && b.ejectIdx >= 0 {
			c.unEject(b, now)
		}
		c.settle(b, now, "reconfigured")
	}
	c.settlePanic(s, now)
	c.poke()
	return nil
}

// sameProbe reports whether a and b make the same check of a backend, so that
// a verdict counted under one holds under the other: they differ at most in
// when checks run and how many it takes to change state.
func sameProbe(a, b Check) bool {
	return a.Kind == b.Kind && a.Method == b.Method && a.Timeout == b.Timeout && a.Source == b.Source &&
		a.HTTP.Path == b.HTTP.Path && a.HTTP.Host == b.HTTP.Host && a.HTTP.Body == b.HTTP.Body &&
		slices.Equal(a.HTTP.Status, b.HTTP.Status)
}

// RemoveService removes a service and all its backends.
func (c *Checker) RemoveService(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.services[name]
	if !ok {
		return
	}
	for b := range s.members {
		c.remove(b, c.now())
	}
	delete(c.services, name)
}

// Set adds a backend or updates an existing one (its address or service). An
// update keeps the backend's state; a new address restarts its pass/fail
// counts and drops the result of a check in flight to the old one.
func (c *Checker) Set(nb Backend) error {
	if nb.Addr == "" {
		nb.Addr = nb.ID
	}
	if nb.ID == "" {
		return fmt.Errorf("set backend: empty id: %w", ErrInvalidBackend)
	}
	if _, _, err := net.SplitHostPort(nb.Addr); err != nil {
		return fmt.Errorf("set backend %q: address: %w: %w", nb.ID, err, ErrInvalidBackend)
	}
	if nb.Initial != nil {
		switch *nb.Initial {
		case Unknown, Up, Down:
		default: // an active check's verdict is one of these; Ejected is passive
			return fmt.Errorf("set backend %q: initial must be up, down or unknown, got %v: %w", nb.ID, *nb.Initial, ErrInvalidBackend)
		}
	}
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.init()
	s, ok := c.services[nb.Service]
	if !ok {
		return fmt.Errorf("set backend %q: service %q: %w", nb.ID, nb.Service, ErrUnknownService)
	}
	if b, ok := c.backends[nb.ID]; ok {
		if b.addr != nb.Addr {
			b.addr = nb.Addr
			b.ap, _ = netip.ParseAddrPort(nb.Addr)
			c.retarget(b)
		}
		if b.svc != s {
			old := b.svc
			// The old service's check in flight and its kept connection
			// are not the new one's: its result is dropped, as after an
			// address change.
			c.retarget(b)
			if b.ejectIdx >= 0 && !s.cfg.Outlier.passive() {
				// The new service ejects nothing: the ejection ends, as
				// when a service turns ejection off (SetService).
				c.unEject(b, now)
			}
			c.leave(b)
			b.svc = s
			if s.cfg.Check.Kind == None {
				b.active = Up
				c.unqueue(b)
			} else if !b.queued && b.inflight == nil {
				c.queue(b, now.Add(randDuration(s.cfg.Check.Interval)))
			}
			c.join(b)
			c.settlePanic(old, now)
			c.settle(b, now, "moved to service "+s.name)
		}
		return nil
	}
	b := &backend{id: nb.ID, addr: nb.Addr, svc: s, ejectIdx: -1}
	b.ap, _ = netip.ParseAddrPort(nb.Addr)
	b.active = s.cfg.Check.Initial
	if nb.Initial != nil {
		b.active = *nb.Initial
	}
	if s.cfg.Check.Kind == None {
		b.active = Up
	}
	b.state = b.effective()
	b.since = now
	b.reason = "added"
	c.backends[b.id] = b
	c.join(b)
	if s.cfg.Check.Kind != None {
		// A random phase in the first interval keeps thousands of backends
		// added at once from being checked in lockstep.
		c.queue(b, now.Add(randDuration(s.cfg.Check.Interval)))
	}
	if !c.settlePanic(s, now) {
		c.publish(b, now, "added")
	}
	return nil
}

// Remove forgets a backend and cancels its check in flight. It reports whether
// the backend existed. Later Observe calls for it are ignored.
func (c *Checker) Remove(id string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	b, ok := c.backends[id]
	if ok {
		c.remove(b, c.now())
	}
	return ok
}

func (c *Checker) remove(b *backend, now time.Time) {
	b.removed = true
	if b.inflight != nil {
		b.inflight()
	}
	if b.synPort != 0 && c.syn != nil {
		c.syn.drop(b.synPort, b.synSeq)
	}
	c.closeKeptOf(b)
	c.leave(b)
	c.unqueue(b)
	if b.ejectIdx >= 0 {
		heap.Remove(&c.ejected, b.ejectIdx)
	}
	delete(c.backends, b.id)
	for sub := range c.subs {
		sub.forget(b.id)
	}
	c.settlePanic(b.svc, now)
}

// retarget drops what is known of the old check target; c.mu must be held.
func (c *Checker) retarget(b *backend) {
	b.gen++
	b.passes, b.fails, b.passed = 0, 0, false
	c.closeKeptOf(b)
}

// closeKeptOf closes b's idle kept-alive connection, if any, and frees its
// slot; a connection in use by a check is closed when the check ends. c.mu
// must be held.
func (c *Checker) closeKeptOf(b *backend) {
	if b.keep != nil {
		b.keep.conn.Close()
		b.keep = nil
	}
	if b.slot {
		b.slot = false
		c.kept--
	}
}

func (c *Checker) join(b *backend) {
	b.svc.members[b] = struct{}{}
	if b.state == Up {
		b.svc.up++
	}
	if b.ejectIdx >= 0 {
		b.svc.nEject++
	}
}

func (c *Checker) leave(b *backend) {
	delete(b.svc.members, b)
	if b.state == Up {
		b.svc.up--
	}
	if b.ejectIdx >= 0 {
		b.svc.nEject--
	}
}

func (c *Checker) queue(b *backend, at time.Time) {
	// The scheduler sleeps until the head of the queue is due: only a new
	// head can need it sooner. (Waking it for every check that completes
	// cost a futex wakeup per check.)
	if c.due.push(b, at) {
		c.poke()
	}
}

func (c *Checker) unqueue(b *backend) { c.due.remove(b) }

func (b *backend) effective() State {
	switch {
	case b.active == Down:
		return Down
	case b.ejectIdx >= 0:
		return Ejected
	}
	return b.active
}

func (b *backend) usable() bool { return b.state == Up || b.svc.panic }

// settle recomputes b's effective state after its active verdict or ejection
// changed, then the service's panic mode, and publishes what changed; c.mu
// must be held.
func (c *Checker) settle(b *backend, now time.Time, reason string) {
	s := b.svc
	st := b.effective()
	if st != b.state {
		if b.state == Up {
			s.up--
		}
		if st == Up {
			s.up++
		}
		b.state, b.since, b.reason = st, now, reason
	}
	if !c.settlePanic(s, now) {
		c.publish(b, now, reason)
	}
}

// settlePanic recomputes the panic mode of s and, if it flipped, publishes
// every member, since each Change carries the service's panic mode. It reports whether it flipped.
func (c *Checker) settlePanic(s *service, now time.Time) bool {
	n := len(s.members)
	p := s.cfg.PanicThreshold > 0 && n > 0 && s.up*100 < s.cfg.PanicThreshold*n
	if p == s.panic {
		return false
	}
	s.panic = p
	reason := fmt.Sprintf("panic: %d of %d backends up, below %d%%: all used", s.up, n, s.cfg.PanicThreshold)
	if !p {
		reason = fmt.Sprintf("panic over: %d of %d backends up", s.up, n)
	}
	for m := range s.members {
		r := reason
		if m.state != m.pubState {
			r = m.reason + "; " + reason
		}
		c.publish(m, now, r)
	}
	return true
}

// publish tells subscribers about b if its state or usability changed since
// they were last told, or if it has never been published; c.mu must be held.
func (c *Checker) publish(b *backend, now time.Time, reason string) {
	u := b.usable()
	if b.state == b.pubState && u == b.pubUsable && b.svc.panic == b.pubPanic && reason != "added" {
		return
	}
	ch := Change{ID: b.id, Service: b.svc.name, From: b.pubState, To: b.state,
		Usable: u, Panic: b.svc.panic, Reason: reason, Time: now}
	b.pubState, b.pubUsable, b.pubPanic = b.state, u, b.svc.panic
	for sub := range c.subs {
		sub.push(ch)
	}
}

// Status returns the status of one backend.
func (c *Checker) Status(id string) (Status, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	b, ok := c.backends[id]
	if !ok {
		return Status{}, false
	}
	return b.status(c.now()), true
}

// FirstPasses counts the first passes of backends (each Status.Passed that
// became true) since the checker was made; it changes whenever one does.
func (c *Checker) FirstPasses() uint64 { return c.firstPasses.Load() }

// Snapshot returns the status of every backend, ordered by service then ID.
func (c *Checker) Snapshot() []Status {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.snapshotLocked()
}

func (c *Checker) snapshotLocked() []Status {
	out := make([]Status, 0, len(c.backends))
	now := c.now()
	for _, b := range c.backends {
		out = append(out, b.status(now))
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Service != out[j].Service {
			return out[i].Service < out[j].Service
		}
		return out[i].ID < out[j].ID
	})
	return out
}

// status is b's Status at now; c.mu must be held.
func (b *backend) status(now time.Time) Status {
	return Status{
		ID: b.id, Service: b.svc.name, Addr: b.addr,
		State: b.state, Active: b.active, Usable: b.usable(), Panic: b.svc.panic,
		Since: b.since, Reason: b.reason,
		Passes: b.passes, Fails: b.fails, Passed: b.passed,
		EjectedUntil: b.ejectedUntil, Ejections: b.multiplier(now),
		Last: b.last,
	}
}

// Run checks backends until ctx is done, then cancels the checks in flight,
// waits for them and returns nil. Backends and services may be added, changed
// and removed before and while it runs.
func (c *Checker) Run(ctx context.Context) error {
	c.mu.Lock()
	c.init()
	if c.running {
		c.mu.Unlock()
		return ErrRunning
	}
	c.running = true
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.running = false
		c.mu.Unlock()
	}()

	limit := c.MaxInFlight
	if limit <= 0 {
		limit = DefaultMaxInFlight
	}
	c.mu.Lock()
	c.maxKept = c.MaxKept
	if c.maxKept <= 0 {
		c.maxKept = max(1, openFileLimit()/2)
	}
	c.mu.Unlock()
	sem := make(chan struct{}, limit)
	var wg sync.WaitGroup
	c.mu.Lock()
	c.workers = newWorkers()
	c.mu.Unlock()
	defer c.closeKept()
	defer func() {
		c.mu.Lock()
		w := c.workers
		c.workers = nil
		c.mu.Unlock()
		w.close()
	}()
	defer wg.Wait()
	// Before wg.Wait: closing ends the syn checks in flight, whose ends are
	// not counted in wg.
	defer c.closeSyn()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()

	var batch []*backend
	// pending holds connect and HTTP checks that are due but wait for a
	// slot in sem. Run does not block on sem: while every slot is held (by
	// black-holed backends, each until its timeout), SYNs still go out on
	// time, their answers are read and ejections end.
	var pending []*backend
	for {
		now := c.now()
		if c.syn != nil { // Run's goroutine alone sets c.syn: no lock to read it
			c.syn.poll(now)
		}
		var next time.Time
		batch, next = c.takeDue(now, batch[:0])

		var queued *synProber // holds SYNs to flush
		for i, b := range batch {
			if syn := c.synFor(ctx, b); syn != nil {
				// A syn check holds a source port, not a slot: no goroutine,
				// no file. Its SYN goes out with the batch's.
				port, ok := syn.takePort()
				if !ok {
					syn.flush(now) // the queued checks hold ports too
					if port, ok = c.waitPort(ctx, syn); !ok {
						c.requeue(append(pending, batch[i:]...), now)
						return nil
					}
					// The check's time starts when its SYN can go, not
					// when the batch began: the wait would eat its timeout.
					now = c.now()
				}
				c.startSyn(b, syn, port, now)
				queued = syn
				continue
			}
			pending = append(pending, b)
		}
		if queued != nil {
			queued.flush(now)
		}
		started := 0
	slots:
		for _, b := range pending {
			select {
			case sem <- struct{}{}:
			default:
				break slots
			}
			if !c.start(ctx, b, sem, &wg) {
				<-sem
			}
			started++
		}
		pending = append(pending[:0], pending[started:]...)
		if len(batch) > 0 {
			continue
		}
		if c.syn != nil {
			if w, ok := c.syn.wakeAt(); ok && (next.IsZero() || w.Before(next)) {
				next = w
			}
		}

		var tick <-chan time.Time
		if !next.IsZero() {
			timer.Reset(max(0, next.Sub(now)))
			tick = timer.C
		}
		var slot chan<- struct{} // nil (never ready) unless a check waits for one
		if len(pending) > 0 {
			slot = sem
		}
		select {
		case <-ctx.Done():
			c.requeue(pending, now)
			return nil
		case <-tick:
		case <-c.wake:
		case slot <- struct{}{}:
			if !c.start(ctx, pending[0], sem, &wg) {
				<-sem
			}
			pending = append(pending[:0], pending[1:]...)
		}
	}
}

// takeDue ends the ejections due by now and pops the backends whose checks are
// due by now (within the slack), appending them to batch. It returns batch and
// the time of the next event: the next check or the next end of an ejection,
// zero if there is none.
func (c *Checker) takeDue(now time.Time, batch []*backend) ([]*backend, time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.expire(now)
	next := time.Time{}
	for {
		h := c.due.head()
		if h == nil {
			break
		}
		if h.dueAt.After(now.Add(slackFor(h.svc.cfg.Check.Interval))) {
			next = h.dueAt
			break
		}
		batch = append(batch, c.due.take())
	}
	if len(c.ejected) > 0 && (next.IsZero() || c.ejected[0].ejectedUntil.Before(next)) {
		next = c.ejected[0].ejectedUntil
	}
	return batch, next
}

// requeue puts back checks that Run popped but will not start, so that a
// later Run checks them.
func (c *Checker) requeue(bs []*backend, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, b := range bs {
		if !b.removed && !b.queued && b.inflight == nil && b.svc.cfg.Check.Kind != None {
			c.queue(b, now)
		}
	}
}

// start launches the check of b, which was popped from the queue, if it is
// still wanted. The check releases its slot in sem when done.
func (c *Checker) start(ctx context.Context, b *backend, sem chan struct{}, wg *sync.WaitGroup) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := b.svc
	if b.removed || b.queued || b.inflight != nil || s.cfg.Check.Kind == None {
		return false
	}
	cctx, cancel := context.WithCancel(ctx)
	b.inflight = cancel
	p := probe{
		checkRun: checkRun{service: s.name, addr: b.addr, gen: b.gen, scheduled: b.dueAt, method: MethodConnect},
		cfg:      s.cfg.Check,
		dial:     c.Dial,
		dialer:   s.dialer,
		keep:     b.keep,
	}
	b.keep = nil
	if p.dial == nil {
		p.dial = p.dialer.DialContext
	}
	wg.Add(1)
	// Ends when the check ends: its Timeout bounds it, and Remove or the end
	// of Run cancel it sooner.
	c.workers.do(func() {
		defer wg.Done()
		defer func() { <-sem }()
		defer cancel()
		c.check(cctx, b, p)
	})
	return true
}

// workers runs connect and HTTP checks on goroutines that live for the whole
// Run, so that a check does not pay for a new goroutine and the growth of its
// stack. The nil *workers starts a goroutine per check (runFake's tests).
type workers struct {
	jobs chan func()
	wg   sync.WaitGroup
}

func newWorkers() *workers { return &workers{jobs: make(chan func())} }

// do runs f on an idle worker, or a new one if none is idle. The in-flight
// limit of Run bounds the number of workers.
func (w *workers) do(f func()) {
	if w == nil {
		// Exits when f returns.
		go f()
		return
	}
	select {
	case w.jobs <- f:
		return
	default:
	}
	w.wg.Add(1)
	// Exits after workerIdle without a job, or when close closes w.jobs at
	// the end of Run.
	go func() {
		defer w.wg.Done()
		f()
		idle := time.NewTimer(workerIdle)
		defer idle.Stop()
		for {
			select {
			case f, ok := <-w.jobs:
				if !ok {
					return
				}
				f()
				idle.Reset(workerIdle)
			case <-idle.C:
				return
			}
		}
	}()
}

// workerIdle is how long a worker waits for a job before it exits, so the
// workers a burst needed (many black-holed backends at once) do not stay.
const workerIdle = time.Second

// close ends the idle workers and waits for them; every job must be done.
func (w *workers) close() {
	close(w.jobs)
	w.wg.Wait()
}

// check runs one check of b and applies its result.
func (c *Checker) check(ctx context.Context, b *backend, p probe) {
	start := c.now()
	// The timeout counts from the start, not from when the check was queued.
	tctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	err := p.run(tctx)
	cancel()
	c.complete(ctx, b, &p.checkRun, p.keep, start, c.now(), err)
}

// complete applies the result of a check p of b that ran from start to end and
// schedules the next one; keep is the connection an HTTP check leaves to
// reuse, if any. ctx is the check's own (Remove cancels it) or Run's.
func (c *Checker) complete(ctx context.Context, b *backend, p *checkRun, keep *keptConn, start, end time.Time, err error) {
	res := Result{ID: b.id, Service: p.service, Addr: p.addr, Method: p.method,
		Scheduled: p.scheduled, Start: start, Duration: end.Sub(start), Err: err}

	c.mu.Lock()
	// A check cut short by Remove or by the end of Run, however Run's context
	// ended (cancelled or past its deadline), is no result.
	stale := b.removed || b.gen != p.gen || ctx.Err() != nil || errors.Is(err, errSynClosed)
	if !stale {
		c.record(b, res, end)
	}
	switch {
	case keep != nil && !stale && b.keep == nil && b.svc.cfg.Check.Kind == HTTP && keep.source == b.svc.cfg.Check.Source &&
		(b.slot || c.kept < c.maxKept):
		b.keep = keep
		if !b.slot {
			b.slot = true
			c.kept++
		}
	case keep != nil:
		keep.conn.Close()
		fallthrough
	default:
		if b.slot && b.keep == nil && !stale {
			// The check ended without a connection to keep: the slot is
			// free for another backend.
			b.slot = false
			c.kept--
		}
	}
	c.mu.Unlock()
	if !stale && c.OnCheck != nil {
		c.OnCheck(res)
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	b.inflight = nil
	b.synPort = 0
	if b.removed || b.svc.cfg.Check.Kind == None {
		return
	}
	// Fixed rate from the scheduled time, so a late start does not push every
	// later check back; a check that overran its interval is followed at once.
	iv := b.svc.cfg.Check.Interval
	j := b.svc.cfg.Check.Jitter
	next := p.scheduled.Add(time.Duration(float64(iv) * (1 + j*(2*rand.Float64()-1))))
	if b.gen != p.gen {
		// Retargeted while in flight: check the new target soon.
		next = end.Add(randDuration(iv))
	}
	if next.Before(end) {
		next = end
	}
	c.queue(b, next)
}

// record applies the result of an active check; c.mu must be held.
func (c *Checker) record(b *backend, res Result, now time.Time) {
	b.last = res
	if res.Err == nil {
		b.passes++
		b.fails = 0
		if !b.passed {
			b.passed = true
			c.firstPasses.Add(1)
		}
	} else {
		b.fails++
		b.passes = 0
	}
	cfg := b.svc.cfg.Check
	reason := ""
	switch {
	case b.active != Down && res.Err != nil && (b.active == Unknown || b.fails >= cfg.Fall):
		b.active = Down
		reason = res.Err.Error()
	case b.active != Up && res.Err == nil && (b.active == Unknown || b.passes >= cfg.Rise):
		b.active = Up
		reason = fmt.Sprintf("%d consecutive checks passed", b.passes)
	default:
		return
	}
	c.settle(b, now, reason)
}

func randDuration(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return rand.N(d)
}

// ejectHeap orders ejected backends by the end of their ejection. It keeps each
// backend's position in it, so a backend can be removed in O(log n).
type ejectHeap = backendHeap[byEjectionEnd]

// heapField says which time a backendHeap orders by and where a backend keeps its
// position in that heap.
type heapField interface {
	at(b *backend) time.Time
	index(b *backend) *int
}

type byEjectionEnd struct{}

func (byEjectionEnd) at(b *backend) time.Time { return b.ejectedUntil }
func (byEjectionEnd) index(b *backend) *int   { return &b.ejectIdx }

// backendHeap is a container/heap of backends ordered by F's time.
type backendHeap[F heapField] []*backend

func (h backendHeap[F]) Len() int { return len(h) }
func (h backendHeap[F]) Less(i, j int) bool {
	var f F
	return f.at(h[i]).Before(f.at(h[j]))
}
func (h backendHeap[F]) Swap(i, j int) {
	var f F
	h[i], h[j] = h[j], h[i]
	*f.index(h[i]) = i
	*f.index(h[j]) = j
}
func (h *backendHeap[F]) Push(x any) {
	var f F
	b := x.(*backend)
	*f.index(b) = len(*h)
	*h = append(*h, b)
}
func (h *backendHeap[F]) Pop() any {
	var f F
	old := *h
	b := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	*f.index(b) = -1
	return b
}

// synFor returns the syn prober that b's next check goes through, opening it
// on the first call of a Run, or nil if b is checked otherwise (its method,
// kind or host-name address) or the prober could not be opened. Only Run's
// goroutine calls it, so the raw sockets and the port reservation belong to
// the network namespace Run was called in.
func (c *Checker) synFor(ctx context.Context, b *backend) *synProber {
	c.mu.Lock()
	defer c.mu.Unlock()
	cfg := b.svc.cfg.Check
	if b.removed || cfg.Kind != TCP || cfg.Method != MethodSyn || !b.ap.IsValid() {
		return nil
	}
	if !c.synOpen {
		c.synOpen = true
		ports := c.synPorts()
		if ports[0] == 0 || ports[0] > ports[1] {
			c.syn, c.synErr = nil, fmt.Errorf("syn ports %d-%d: want 1 <= first <= last: %w", ports[0], ports[1], ErrInvalidConfig)
		} else {
			c.syn, c.synErr = openSyn(ports, func(b *backend, err error, at time.Time) {
				c.complete(ctx, b, &b.synRun, nil, b.synStart, at, err)
			})
		}
	}
	return c.syn
}

func (c *Checker) synPorts() [2]uint16 {
	if c.SynPorts == ([2]uint16{}) {
		return DefaultSynPorts
	}
	return c.SynPorts
}

// startSyn queues the SYN of b's check from port, if the check is still
// wanted, for the prober's next flush; the answer, or the timeout, completes it.
func (c *Checker) startSyn(b *backend, syn *synProber, port uint16, now time.Time) {
	c.mu.Lock()
	s := b.svc
	if b.removed || b.queued || b.inflight != nil || s.cfg.Check.Kind == None {
		c.mu.Unlock()
		syn.putPort(port)
		return
	}
	seq := newSeq()
	b.inflight, b.synPort, b.synSeq = synInFlight, port, seq
	b.synRun = checkRun{service: s.name, addr: b.addr, gen: b.gen, scheduled: b.dueAt, method: MethodSyn}
	b.synStart = now
	dst, source, timeout := b.ap, s.cfg.Check.Source, s.cfg.Check.Timeout
	c.mu.Unlock()
	syn.queue(now, b, dst, source, port, seq, timeout)
	// A Remove between the unlock and queue found no check on the port to drop;
	// without this the port stayed taken until the check's timeout.
	c.mu.Lock()
	removed := b.removed
	c.mu.Unlock()
	if removed {
		syn.drop(port, seq)
	}
}

// synInFlight marks a backend's syn check in flight; Remove drops the check
// from the prober by its port (remove), so there is nothing to cancel.
func synInFlight() {}

// waitPort waits, reading answers, until a syn check ends and frees its port,
// or ctx is done (ok false). All of the range is in flight: the checks wait
// for their answers or timeouts rather than fail.
func (c *Checker) waitPort(ctx context.Context, syn *synProber) (port uint16, ok bool) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		now := c.now()
		syn.poll(now)
		if port, ok := syn.takePort(); ok {
			return port, true
		}
		w, _ := syn.wakeAt()
		t.Reset(max(synMinPoll, w.Sub(now)))
		select {
		case <-t.C:
		case <-ctx.Done():
			return 0, false
		}
	}
}

// closeSyn closes the prober of the Run that ends, which ends its checks in
// flight; their backends are queued again for the next Run.
func (c *Checker) closeSyn() {
	c.mu.Lock()
	syn := c.syn
	c.syn, c.synOpen = nil, false
	c.mu.Unlock()
	if syn != nil {
		syn.close()
	}
}

// closeKept closes every idle kept-alive HTTP check connection.
func (c *Checker) closeKept() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, b := range c.backends {
		c.closeKeptOf(b)
	}
}

// Method reports how the TCP checks of a service are made: MethodSyn, or
// MethodConnect, with the reason when syn was asked for and the Checker could
// not open its raw sockets. HTTP checks, and services with checks off, report
// MethodConnect.
func (c *Checker) Method(service string) (Method, error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	s, ok := c.services[service]
	if !ok {
		return MethodConnect, fmt.Errorf("method of service %q: %w", service, ErrUnknownService)
	}
	if s.cfg.Check.Kind != TCP || s.cfg.Check.Method != MethodSyn {
		return MethodConnect, nil
	}
	if c.synErr != nil {
		return MethodConnect, fmt.Errorf("syn checks unavailable, connecting instead: %w", c.synErr)
	}
	return MethodSyn, nil
}

// SynStatus describes the raw sockets of syn checks.
type SynStatus struct {
	// Open: the running Run has its raw sockets (it opens them when the
	// first syn check is due). Err says why they could not be opened.
	Open bool
	Err  error
	// Ports is the source port range; Excluded counts its ports left out
	// because a local socket held them when Run opened the sockets.
	Ports    [2]uint16
	Excluded int
	// ReserveErr says why the range could not be added to
	// ip_local_reserved_ports (nil: it is reserved, by Run or before).
	ReserveErr error
}

// Syn reports the state of syn checks' raw sockets.
func (c *Checker) Syn() SynStatus {
	c.mu.RLock()
	defer c.mu.RUnlock()
	st := SynStatus{Open: c.syn != nil, Err: c.synErr, Ports: c.synPorts()}
	if c.syn != nil {
		st.Excluded, st.ReserveErr = c.syn.excludedPorts(), c.syn.reserveError()
	}
	return st
}
