// Package proxy is weir's user-space data plane: a TCP proxy that balances each
// accepted connection onto a backend with userspace/balance and moves its bytes with
// splice(2).
//
// One Service serves one listen address. It is the fallback where XDP can't run and the
// data plane of choice for algorithms that need to see connection ends and response
// times (least_conn, weighted_least_conn, p2c, ewma).
//
// Per connection it picks a backend, dials it with a connect timeout, on a failed dial
// tries other backends (never the same one twice), optionally writes a PROXY protocol
// header, then moves bytes both directions, honouring half-close, until both
// directions have ended or the connection has been idle for the idle timeout. Small
// messages move with read/write, a direction that shows bulk with splice. One event
// loop per listener drives every connection accepted from it (see loop_linux.go). A
// connection holds only its two sockets while it waits; pipes and buffers are pooled
// and held only while bytes are in flight.
package proxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/userspace/balance"
)

// Defaults applied to zero Config fields.
const (
	DefaultAlgorithm      = balance.LeastConn
	DefaultConnectTimeout = 3 * time.Second
	DefaultEjectFor       = 10 * time.Second
)

// Suggested values for the settings whose zero value turns the feature off; the
// package never applies them by itself.
const (
	DefaultIdleTimeout  = 10 * time.Minute
	DefaultDrainTimeout = 30 * time.Second
	DefaultEjectAfter   = 3
)

// MaxUserTimeout is the longest TCP_USER_TIMEOUT the kernel takes: 2^31-1
// milliseconds.
const MaxUserTimeout = math.MaxInt32 * time.Millisecond

var (
	// ErrUnknownBackend is returned for a backend address the service doesn't have.
	ErrUnknownBackend = errors.New("unknown backend")
	// ErrServing is returned by a second call to Serve.
	ErrServing = errors.New("already serving")
)

// Backend is one backend of a service. Its address is its identity (the ID the
// balancer, counters and the agent use).
type Backend struct {
	Addr      netip.AddrPort // the backend's address and port
	Weight    uint32         // relative weight; 0 means 1 (use SetDraining to stop new connections)
	MaxConns  int            // connection limit; 0 takes Config.MaxConnsPerBackend
	SlowStart time.Duration  // ramp the weight up over this long after becoming usable; 0 = off
	Down      bool           // initially not usable, until SetBackendUsable(addr, true)
	// Ramp is the part of its share maglev and source_hash's lookup table gives the
	// backend while its slow start is stepped from outside (balance.Backend.Ramp).
	Ramp uint32
}

// Outcome is how a connection to a backend ended, as reported to an Observer.
type Outcome int

const (
	OutcomeSuccess        Outcome = iota // connected, then both directions ended normally
	OutcomeConnectFailed                 // the dial failed (refused, unreachable)
	OutcomeConnectTimeout                // the dial hit the connect timeout
	OutcomeReset                         // the backend reset or broke the connection mid-stream
	OutcomeIdleTimeout                   // closed by the idle timeout
)

func (o Outcome) String() string {
	switch o {
	case OutcomeSuccess:
		return "success"
	case OutcomeConnectFailed:
		return "connect_failed"
	case OutcomeConnectTimeout:
		return "connect_timeout"
	case OutcomeReset:
		return "reset"
	case OutcomeIdleTimeout:
		return "idle_timeout"
	}
	return "outcome(" + fmt.Sprint(int(o)) + ")"
}

// Observer receives the outcome of every connection attempt to a backend, for example
// to feed a shared health checker's outlier detection. Observe is called on the event
// loop that serves the connection: it must be quick and must not block (it would delay
// every connection of that loop).
type Observer interface {
	Observe(addr netip.AddrPort, out Outcome, connectLatency time.Duration)
}

// Config is one service. Zero values take the documented defaults, or turn the
// feature off where the field says so; no field takes a negative value.
type Config struct {
	Name      string         // for logs and errors
	Listen    netip.AddrPort // port 0 picks one (see Service.Addr)
	Backends  []Backend      //
	Algorithm string         // one of balance.Algorithms(); default least_conn
	Seed      uint64         // hashing seed for source_hash and maglev, the same on every node
	// HashPort keys source_hash, maglev and maglev_p2c by the client's address and
	// port (the 5-tuple: the rest is the service's own), so a client's connections
	// spread as XDP's `hash: 5tuple` spreads them; false keys them by the client's
	// address alone (affinity). SetHashPort changes it for new connections.
	HashPort bool

	ConnectTimeout time.Duration // per dial attempt; default 3s
	IdleTimeout    time.Duration // no byte either way for this long closes; 0 = no idle timeout
	Retries        int           // more backends tried after a failed dial; 0 = none

	MaxConns           int // per service; excess connections wait in the listen backlog; 0 = no limit
	MaxConnsPerBackend int // default per-backend limit; a full backend is skipped; 0 = no limit

	ProxyProtocol int // 0 off, 1 or 2: PROXY protocol header version sent to backends

	// ClientKeepalive and BackendKeepalive turn TCP keepalive on for the client
	// and the backend sockets when Enable is set, so a connection whose peer
	// vanished without a FIN or reset (a host that lost power, a NAT that forgot
	// the flow) fails after Idle + Count × Interval and frees its slot. Idle and
	// Interval are rounded up to whole seconds; a zero field keeps the kernel's
	// default. The client's are set once on the listeners (accepted sockets
	// inherit them), the backend's on each dialed socket. Off: no system call.
	ClientKeepalive  net.KeepAliveConfig
	BackendKeepalive net.KeepAliveConfig
	// ClientUserTimeout and BackendUserTimeout set TCP_USER_TIMEOUT on the
	// client and the backend sockets when positive: a connection whose sent
	// bytes stay unacknowledged this long (or whose keepalive probes go
	// unanswered this long) fails, where the kernel would retransmit for
	// net.ipv4.tcp_retries2 (about 15 minutes). Rounded up to milliseconds, at
	// most MaxUserTimeout. Set as the keepalive is; 0: no system call.
	ClientUserTimeout  time.Duration
	BackendUserTimeout time.Duration

	DrainTimeout    time.Duration // a draining or removed backend's connections are closed after this; 0 = no limit
	ShutdownTimeout time.Duration // Serve's grace after ctx is done; 0 takes DrainTimeout (and with it, no limit)

	AcceptLoops int // listeners (SO_REUSEPORT), one event loop each; default runtime.GOMAXPROCS(0); ListenFrom may take more over

	EjectAfter int           // consecutive failed dials that eject a backend; 0 = never (passive health off)
	EjectFor   time.Duration // how long an ejected backend gets no new connection; default 10s

	// Redirector, if set, forwards each connection's bytes in the kernel once its
	// backend is connected (loader.SockMap); a connection it fails to pair stays on
	// the copy path. nil: bytes move through the proxy.
	Redirector Redirector

	Observer Observer     // optional
	Logger   *slog.Logger // default slog.Default()
}

// Service proxies one listen address to its backends. Create it with Listen, run it
// with Serve; every other method is safe for concurrent use, before, during and after
// Serve.
type Service struct {
	cfg             Config
	log             *slog.Logger
	client, backend tcpOpts        // the options of either side's sockets, from cfg
	lns             []*listener    // listening sockets, one per loop
	addr            netip.AddrPort // bound address
	bal             balance.Balancer

	sem chan struct{} // MaxConns slots; nil = unlimited

	mu       sync.Mutex                          // serialises backend set changes
	backends []*backend                          // current set, config order; guarded by mu
	leaving  map[netip.AddrPort]*backend         // removed, connections may remain; guarded by mu
	table    atomic.Pointer[map[string]*backend] // current set by address, read lock-free

	loops   atomic.Pointer[[]*loop] // while serving
	killAll atomic.Bool             // shutdown deadline passed: close new arrivals at once

	// drainMu is held (read) by a drain timer while it runs, and taken by
	// Serve at its end to set served: a timer that has fired cannot be stopped,
	// and one running after Serve has returned would close and log for a
	// service that is gone.
	drainMu sync.RWMutex
	served  bool

	// joinMu orders Join with Serve's making of the loops: a loop made
	// before a socket listens leaves it out of its epoll set (a bound socket
	// reports a hang-up there), and Join adds it.
	joinMu sync.Mutex

	wg      sync.WaitGroup // connections being handled
	serving atomic.Bool
	closed  atomic.Bool
	failed  chan struct{} // closed when an event loop failed (Failed)

	hashPort atomic.Bool // see Config.HashPort

	stats   serviceCounters
	lastLog atomic.Int64 // monotonic ns of the last "cannot serve" log line
	dropped atomic.Int64 // "cannot serve" events since that line

	lastRedirectLog atomic.Int64 // monotonic ns of the last "redirect failed" log line
}

// backend is a backend's live state; removed backends live on while connections hold them.
type backend struct {
	addr     string         // ap.String(): the balancer's and the logs' name for it
	ap       netip.AddrPort // its identity
	sa       *rawSockaddr   // ap for connect(2)
	self     netip.AddrPort // ap as getsockname(2) spells it, if a dial may connect to itself there (selfConnectRisk); else invalid
	cfg      Backend        // guarded by Service.mu
	maxConns atomic.Int64   // 0 = no limit

	usable   bool        // health says usable; guarded by Service.mu
	draining bool        // set to drain or removed; guarded by Service.mu
	removed  atomic.Bool // no longer in the set; written with Service.mu held
	timer    *time.Timer // drain deadline; guarded by Service.mu

	active       atomic.Int64
	consecFails  atomic.Int32
	ejectedUntil atomic.Int64 // monotonic ns

	c backendCounters
}

// Listen validates cfg, builds the balancer and binds the listeners (so connections
// queue in the backlog from now on). Call Serve to accept, or Close to give up.
func Listen(ctx context.Context, cfg Config) (*Service, error) {
	return ListenFrom(ctx, cfg, nil)
}

// ListenFrom is Listen for a service that replaces old (nil: none): a server
// of the same address, this package's or another's that can hand its
// listening sockets over (Sockets; an httplb.Service can). If old listens on
// cfg.Listen, the new service takes every one of old's listening sockets over
// (it holds descriptors of its own of them) instead of binding new ones
// beside them: the connections queued on them, and those still in their
// handshake, are the new service's to accept, where closing the sockets would
// reset them. The new client keepalive setting is applied to the sockets
// (accepted sockets inherit it), and TCP_NODELAY. Old goes on accepting on them
// until its Serve ends, which closes only its own descriptors, and its
// connections drain as at any shutdown. With more loops than old has sockets
// the rest are bound anew; with fewer, the new service runs a loop for each
// socket all the same (loops park in the runtime poller, so the extra ones
// cost nothing while idle and take turns on the Ps when busy): a socket left
// to close with old would reset what is queued on it.
//
// If the new service is given up (Close, or Serve ended) while old still
// runs, old keeps accepting on its sockets; call old's Reclaim to give them
// its own settings back.
func ListenFrom(ctx context.Context, cfg Config, old Sockets) (*Service, error) {
	s, err := newService(cfg)
	if err != nil {
		return nil, err
	}
	var fds []int
	if old != nil {
		fds = old.ListenFDs(s.cfg.Listen)
	}
	if err := s.listen(ctx, fds); err != nil {
		return nil, fmt.Errorf("service %q: %w", cfg.Name, err)
	}
	return s, nil
}

// Join makes the sockets that ListenFrom bound beside those it took over
// listen, so they take their share of the connections. Until then they are
// only bound: they take none and belong to no SO_REUSEPORT group, so a
// service given up before (a refused reload) closes them with no connection
// queued on them, where closing a listening socket resets those. The sockets
// taken over serve meanwhile. Join may be called before or while Serve runs,
// from any goroutine; a service whose sockets all listen has nothing to do.
func (s *Service) Join() error {
	s.joinMu.Lock()
	defer s.joinMu.Unlock()
	var errs []error
	for i, ln := range s.lns {
		ln.mu.Lock()
		joined := ln.fd >= 0 && ln.bound
		if joined {
			if err := startListening(ln.fd); err != nil {
				errs = append(errs, err)
				joined = false
			} else {
				ln.bound = false
			}
		}
		ln.mu.Unlock()
		if !joined {
			continue
		}
		// A loop already made skipped the socket: it takes it now.
		if loops := s.loops.Load(); loops != nil {
			l := (*loops)[i]
			l.call(func() { l.watch(ln) })
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("service %q: listen %s: %w", s.cfg.Name, s.cfg.Listen, err)
	}
	return nil
}

// Sockets is a running server whose listening sockets a new one may take
// over (ListenFrom).
type Sockets interface {
	// ListenFDs returns new descriptors (close-on-exec) of the listening
	// sockets the server holds open, if it listens on addr as configured;
	// the caller owns them.
	ListenFDs(addr netip.AddrPort) []int
}

// ListenFDs returns new descriptors of the service's listening sockets that
// are still open, if it listens on addr (see Sockets): those that listen, not
// the ones bound beside them that Join has yet to make listen. A nil service
// has none.
func (s *Service) ListenFDs(addr netip.AddrPort) []int {
	if s == nil || s.cfg.Listen != addr {
		return nil
	}
	var fds []int
	for _, ln := range s.lns {
		if fd := ln.dup(); fd >= 0 {
			fds = append(fds, fd)
		}
	}
	return fds
}

// Reclaim sets the service's client keepalive setting on its listening sockets
// again, which a service that took them over (ListenFrom) and was given up may
// have changed.
func (s *Service) Reclaim() error {
	var errs []error
	for _, ln := range s.lns {
		ln.mu.Lock()
		if ln.fd >= 0 {
			errs = append(errs, retune(ln.fd, s.client))
		}
		ln.mu.Unlock()
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("service %q: listen %s: %w", s.cfg.Name, s.cfg.Listen, err)
	}
	return nil
}

func newService(cfg Config) (*Service, error) {
	if cfg.Algorithm == "" {
		cfg.Algorithm = DefaultAlgorithm
	}
	name := fmt.Sprintf("service %q", cfg.Name)
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"connect_timeout", cfg.ConnectTimeout},
		{"idle_timeout", cfg.IdleTimeout},
		{"drain_timeout", cfg.DrainTimeout},
		{"shutdown_timeout", cfg.ShutdownTimeout},
		{"eject_for", cfg.EjectFor},
		{"client keepalive idle", cfg.ClientKeepalive.Idle},
		{"client keepalive interval", cfg.ClientKeepalive.Interval},
		{"backend keepalive idle", cfg.BackendKeepalive.Idle},
		{"backend keepalive interval", cfg.BackendKeepalive.Interval},
		{"client user timeout", cfg.ClientUserTimeout},
		{"backend user timeout", cfg.BackendUserTimeout},
	} {
		if d.v < 0 {
			return nil, fmt.Errorf("%s: %s must be >= 0, got %v", name, d.field, d.v)
		}
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = DefaultConnectTimeout
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = cfg.DrainTimeout
	}
	if cfg.AcceptLoops == 0 {
		// One loop per P: more loops than Ps only take turns on them. And
		// GOMAXPROCS follows a container's CPU limit where NumCPU does not.
		cfg.AcceptLoops = runtime.GOMAXPROCS(0)
	}
	if cfg.EjectFor == 0 {
		cfg.EjectFor = DefaultEjectFor
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	switch {
	case cfg.AcceptLoops < 0:
		return nil, fmt.Errorf("%s: accept_loops must be >= 0, got %d", name, cfg.AcceptLoops)
	case cfg.EjectAfter < 0:
		return nil, fmt.Errorf("%s: eject_after must be >= 0 (0: never), got %d", name, cfg.EjectAfter)
	case cfg.ProxyProtocol < 0 || cfg.ProxyProtocol > 2:
		return nil, fmt.Errorf("%s: proxy_protocol must be 0, 1 or 2, got %d", name, cfg.ProxyProtocol)
	case cfg.Retries < 0:
		return nil, fmt.Errorf("%s: retries must be >= 0, got %d", name, cfg.Retries)
	case cfg.MaxConns < 0 || cfg.MaxConnsPerBackend < 0:
		return nil, fmt.Errorf("%s: connection limits must be >= 0", name)
	case cfg.ClientKeepalive.Count < 0 || cfg.BackendKeepalive.Count < 0:
		return nil, fmt.Errorf("%s: keepalive counts must be >= 0", name)
	case cfg.ClientUserTimeout > MaxUserTimeout || cfg.BackendUserTimeout > MaxUserTimeout:
		return nil, fmt.Errorf("%s: user timeouts must be at most %v", name, MaxUserTimeout)
	}
	if !cfg.Listen.IsValid() {
		return nil, fmt.Errorf("%s: listen: must be ip:port, got the zero address", name)
	}
	bs, err := checkBackends(cfg.Backends)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	s := &Service{
		cfg:     cfg,
		log:     cfg.Logger.With("service", cfg.Name),
		client:  tcpOpts{cfg.ClientKeepalive, cfg.ClientUserTimeout},
		backend: tcpOpts{cfg.BackendKeepalive, cfg.BackendUserTimeout},
		failed:  make(chan struct{}),
	}
	s.hashPort.Store(cfg.HashPort)
	if cfg.MaxConns > 0 {
		s.sem = make(chan struct{}, cfg.MaxConns)
	}
	s.backends = make([]*backend, len(bs))
	for i, b := range bs {
		s.backends[i] = s.newBackend(b)
	}
	s.bal, err = balance.New(cfg.Algorithm, s.balanceSet(), cfg.Seed)
	if err != nil {
		return nil, fmt.Errorf("%s: algorithm: %w", name, err)
	}
	s.publish()
	return s, nil
}

// checkBackends validates a backend list and returns it normalised.
func checkBackends(in []Backend) ([]Backend, error) {
	out := make([]Backend, len(in))
	seen := make(map[netip.AddrPort]bool, len(in))
	for i, b := range in {
		if !b.Addr.IsValid() {
			return nil, fmt.Errorf("backend %d: address must be ip:port, got the zero address", i)
		}
		if b.MaxConns < 0 {
			return nil, fmt.Errorf("backend %q: max_conns must be >= 0, got %d", b.Addr, b.MaxConns)
		}
		if seen[b.Addr] {
			return nil, fmt.Errorf("backend %q: listed twice", b.Addr)
		}
		seen[b.Addr] = true
		if b.Weight == 0 {
			b.Weight = 1
		}
		out[i] = b
	}
	return out, nil
}

func (s *Service) newBackend(b Backend) *backend {
	sa := sockaddrOf(b.Addr)
	be := &backend{addr: b.Addr.String(), ap: b.Addr, sa: &sa, usable: !b.Down}
	if selfConnectRisk(b.Addr.Port()) {
		be.self = netip.AddrPortFrom(b.Addr.Addr().Unmap().WithZone(""), b.Addr.Port())
	}
	s.configure(be, b)
	return be
}

func (s *Service) configure(be *backend, b Backend) {
	be.cfg = b
	m := b.MaxConns
	if m == 0 {
		m = s.cfg.MaxConnsPerBackend
	}
	be.maxConns.Store(int64(m))
}

// balanceSet is the backend set as the balancer sees it. Called with s.mu held (or
// before the service is shared).
func (s *Service) balanceSet() []balance.Backend {
	out := make([]balance.Backend, len(s.backends))
	for i, b := range s.backends {
		out[i] = balance.Backend{
			ID:        b.addr,
			Weight:    b.cfg.Weight,
			Usable:    b.usable && !b.draining,
			SlowStart: b.cfg.SlowStart,
			Ramp:      b.cfg.Ramp,
		}
	}
	return out
}

// publish makes the current set visible to the connection path. Called with s.mu held.
func (s *Service) publish() {
	t := make(map[string]*backend, len(s.backends))
	for _, b := range s.backends {
		t[b.addr] = b
	}
	s.table.Store(&t)
}

// listen binds the service's listening sockets, one per loop, after taking
// over the sockets of fds (see ListenFrom), which it owns.
func (s *Service) listen(ctx context.Context, fds []int) error {
	ap := s.cfg.Listen
	for _, fd := range fds {
		s.lns = append(s.lns, &listener{fd: fd})
	}
	for _, fd := range fds {
		if err := adopt(fd, s.client); err != nil {
			s.closeListeners()
			return fmt.Errorf("listen %s: %w", ap, err)
		}
	}
	if len(s.lns) > 0 {
		if err := s.bound(ap); err != nil {
			return err
		}
		ap = netip.AddrPortFrom(ap.Addr(), s.addr.Port())
	}
	for len(s.lns) < s.cfg.AcceptLoops {
		if err := ctx.Err(); err != nil {
			s.closeListeners()
			return err
		}
		// Beside sockets taken over, until Join: a service given up
		// (a refused reload) closes them with nothing queued.
		ln, err := bindListener(ap, s.client, len(fds) > 0)
		if err != nil {
			s.closeListeners()
			return fmt.Errorf("listen %s: %w", ap, err)
		}
		s.lns = append(s.lns, ln)
		if len(s.lns) == 1 {
			if err := s.bound(ap); err != nil {
				return err
			}
			ap = netip.AddrPortFrom(ap.Addr(), s.addr.Port()) // the others join the same port, even if it was 0
		}
	}
	return nil
}

// bound sets s.addr to the address the first listening socket is bound to,
// for listen address ap; if it cannot, it closes the sockets.
func (s *Service) bound(ap netip.AddrPort) error {
	var err error
	if s.addr, err = getsocknameRaw(s.lns[0].fd); err != nil {
		s.closeListeners()
		return fmt.Errorf("listen %s: getsockname: %w", ap, err)
	}
	if ap.Addr().Zone() != "" {
		s.addr = netip.AddrPortFrom(s.addr.Addr().WithZone(ap.Addr().Zone()), s.addr.Port())
	}
	return nil
}

func (s *Service) closeListeners() {
	for _, ln := range s.lns {
		ln.close()
	}
}

// Addr is the bound listen address.
func (s *Service) Addr() netip.AddrPort { return s.addr }

// Failed returns a channel closed when an event loop of the service failed:
// it then accepts no new connection, its listeners are closed, and its Serve
// lets the other loops' connections finish (up to ShutdownTimeout) and returns
// the error.
func (s *Service) Failed() <-chan struct{} { return s.failed }

// Close releases the listeners of a Service whose Serve was never called. (Serve owns
// them once called and closes them itself.)
func (s *Service) Close() error {
	if s.serving.Load() || !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	s.closeListeners()
	return nil
}

// Serve accepts and proxies connections until ctx is done, then shuts down gracefully:
// it stops accepting, lets connections finish for up to ShutdownTimeout, closes the
// rest, and returns once every goroutine it started has ended. It returns nil after a
// shutdown caused by ctx, or the error that stopped an event loop.
func (s *Service) Serve(ctx context.Context) error {
	if !s.serving.CompareAndSwap(false, true) {
		return fmt.Errorf("service %q: serve: %w", s.cfg.Name, ErrServing)
	}
	if s.closed.Load() {
		return fmt.Errorf("service %q: serve: %w", s.cfg.Name, net.ErrClosed)
	}
	s.joinMu.Lock()
	loops := make([]*loop, 0, len(s.lns))
	for i, ln := range s.lns {
		l, err := newLoop(s, ln)
		if err != nil {
			for _, l := range loops {
				l.ln.close()
				l.ep.Close()
				unix.Close(l.wake)
			}
			for _, ln := range s.lns[i:] {
				ln.close()
			}
			s.joinMu.Unlock()
			return fmt.Errorf("service %q: serve: %w", s.cfg.Name, err)
		}
		loops = append(loops, l)
	}
	s.loops.Store(&loops)
	s.joinMu.Unlock()
	var running sync.WaitGroup
	errc := make(chan error, len(loops))
	for _, l := range loops {
		running.Add(1)
		// Exits when the loop is told to quit (below, after the shutdown), or fails.
		go func() {
			defer running.Done()
			if err := l.run(); err != nil {
				errc <- err
			}
		}()
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
		err = fmt.Errorf("service %q: %w", s.cfg.Name, err)
	}
	for _, l := range loops {
		l.call(l.stopAccepting)
	}
	if err != nil {
		// Every listener is closed (the failed loop's as it ended): a
		// replacement does not share the port with one nobody serves.
		close(s.failed)
	}

	// Grace: let connections end by themselves, then close the rest.
	done := make(chan struct{})
	// Exits when every connection has ended; after the grace they are all forced
	// closed, so that happens promptly.
	go func() {
		s.wg.Wait()
		close(done)
	}()
	var grace <-chan time.Time
	if s.cfg.ShutdownTimeout > 0 {
		t := time.NewTimer(s.cfg.ShutdownTimeout)
		defer t.Stop()
		grace = t.C
	}
	select {
	case <-done:
	case <-grace:
		n := s.killConns(nil)
		s.log.Warn("shutdown grace ended: closed connections still open", "grace", s.cfg.ShutdownTimeout, "closed", n)
		<-done
	}
	for _, l := range loops {
		l.do(func() { l.quit = true })
	}
	running.Wait()
	s.mu.Lock()
	for _, b := range s.backends {
		if b.timer != nil {
			b.timer.Stop()
		}
	}
	for _, b := range s.leaving {
		if b.timer != nil {
			b.timer.Stop()
		}
	}
	s.mu.Unlock()
	s.drainMu.Lock()
	s.served = true
	s.drainMu.Unlock()
	return err
}

// call runs f on the loop and waits for it; it returns at once if the loop has ended.
func (l *loop) call(f func()) {
	done := make(chan struct{})
	if l.do(func() { f(); close(done) }) {
		<-done
	}
}

// takeSlot takes a MaxConns slot for a connection loop l is about to accept. If there
// is none it marks l paused and reports false; releaseSlot resumes it.
func (s *Service) takeSlot(l *loop) bool {
	if s.sem == nil {
		return true
	}
	select {
	case s.sem <- struct{}{}:
		return true
	default:
	}
	l.paused.Store(true)
	// A slot released before the store above found no paused loop: look again.
	select {
	case s.sem <- struct{}{}:
		l.paused.Store(false)
		return true
	default:
		return false
	}
}

// releaseSlot gives a MaxConns slot back and resumes the loops waiting for one.
func (s *Service) releaseSlot() {
	if s.sem == nil {
		return
	}
	<-s.sem
	for _, l := range *s.loops.Load() {
		if l.paused.CompareAndSwap(true, false) {
			l.do(func() {
				l.acceptMore = true
			})
		}
	}
}

// SetBackends replaces the backend set. Backends that stay keep their state and
// connections; new ones start usable unless Down; removed ones get no new connections
// and their connections are closed after DrainTimeout.
func (s *Service) SetBackends(bs []Backend) error {
	bs, err := checkBackends(bs)
	if err != nil {
		return fmt.Errorf("service %q: set backends: %w", s.cfg.Name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old := make(map[netip.AddrPort]*backend, len(s.backends))
	for _, b := range s.backends {
		old[b.ap] = b
	}
	if s.leaving == nil {
		s.leaving = make(map[netip.AddrPort]*backend)
	}
	next := make([]*backend, 0, len(bs))
	for _, nb := range bs {
		if b, ok := old[nb.Addr]; ok {
			s.configure(b, nb)
			delete(old, nb.Addr)
			next = append(next, b)
			continue
		}
		if b, ok := s.leaving[nb.Addr]; ok {
			// Back while connections of its removal last: the same backend again,
			// so they count against its limits, and its drain is called off.
			delete(s.leaving, nb.Addr)
			s.stopDrain(b)
			b.removed.Store(false)
			b.usable = !nb.Down
			b.ejectedUntil.Store(0)
			b.consecFails.Store(0)
			s.configure(b, nb)
			next = append(next, b)
			continue
		}
		next = append(next, s.newBackend(nb))
	}
	for ap, b := range s.leaving {
		if b.active.Load() == 0 {
			s.stopDrain(b)
			delete(s.leaving, ap)
		}
	}
	for _, b := range old {
		b.removed.Store(true)
		s.startDrain(b)
		s.leaving[b.ap] = b
	}
	s.backends = next
	s.bal.SetBackends(s.balanceSet())
	s.publish()
	return nil
}

// SetHashPort sets whether new connections hash by the client's port too (see
// Config.HashPort); connections already established keep their backends.
func (s *Service) SetHashPort(on bool) { s.hashPort.Store(on) }

// SetDraining sets a backend draining (no new connections; existing ones closed after
// DrainTimeout) or back to normal.
func (s *Service) SetDraining(addr netip.AddrPort, draining bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.find(addr)
	if b == nil {
		return fmt.Errorf("service %q: drain %q: %w", s.cfg.Name, addr, ErrUnknownBackend)
	}
	if b.draining == draining {
		return nil
	}
	if draining {
		s.startDrain(b)
	} else {
		s.stopDrain(b)
	}
	s.bal.SetBackends(s.balanceSet())
	return nil
}

// SetBackendUsable is how active health checks mark a backend up or down. A backend
// that is down gets no new connections; its established ones are left alone.
func (s *Service) SetBackendUsable(addr netip.AddrPort, usable bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.find(addr)
	if b == nil {
		return fmt.Errorf("service %q: set usable %q: %w", s.cfg.Name, addr, ErrUnknownBackend)
	}
	if b.usable == usable {
		return nil
	}
	b.usable = usable
	if usable {
		b.ejectedUntil.Store(0)
		b.consecFails.Store(0)
	}
	s.bal.SetBackends(s.balanceSet())
	return nil
}

// find returns the current backend with that address, or nil. Called with s.mu held.
func (s *Service) find(addr netip.AddrPort) *backend {
	for _, b := range s.backends {
		if b.ap == addr {
			return b
		}
	}
	return nil
}

// startDrain arms b's drain deadline. Called with s.mu held.
func (s *Service) startDrain(b *backend) {
	b.draining = true
	if b.timer != nil || s.cfg.DrainTimeout == 0 {
		return
	}
	// Assigned to b.timer under s.mu before the timer's function can read it
	// (that takes s.mu too).
	var t *time.Timer
	t = time.AfterFunc(s.cfg.DrainTimeout, func() {
		s.drainMu.RLock()
		defer s.drainMu.RUnlock()
		// Called off while this waited to run (Stop came too late), perhaps with
		// a drain of its own begun since: that one's timer is b's now.
		s.mu.Lock()
		stale := b.timer != t
		s.mu.Unlock()
		if s.served || stale {
			return
		}
		if n := s.killConns(b); n > 0 {
			s.log.Info("drain timeout: closed connections", "backend", b.addr, "closed", n)
		}
	})
	b.timer = t
}

// stopDrain ends b's drain, and calls off its deadline. Called with s.mu held.
func (s *Service) stopDrain(b *backend) {
	b.draining = false
	if b.timer != nil {
		b.timer.Stop()
		b.timer = nil
	}
}

// killConns closes the connections to backend b (every connection if b is nil) and
// returns how many.
func (s *Service) killConns(b *backend) int {
	if b == nil {
		s.killAll.Store(true)
	}
	loops := s.loops.Load()
	if loops == nil {
		return 0
	}
	n := 0
	for _, l := range *loops {
		l.call(func() { n += l.kill(b) })
	}
	return n
}

// noteUnserved counts a client that could not be served and logs it, at most one line
// a second with the number of events since the previous line.
func (s *Service) noteUnserved(err error) {
	s.stats.unserved.Add(1)
	n := s.dropped.Add(1)
	now := monotonic()
	last := s.lastLog.Load()
	if now-last < int64(time.Second) || !s.lastLog.CompareAndSwap(last, now) {
		return
	}
	s.dropped.Add(-n)
	s.log.Warn("closed client connections that could not be served", "count", n, "err", err)
}

// noteRedirectFailed logs, at most once a second, that a connection could not be
// paired for in-kernel forwarding (it is served by the copy path).
func (s *Service) noteRedirectFailed(err error) {
	now := monotonic()
	last := s.lastRedirectLog.Load()
	// last is 0 until the first line: that one is never held back, even in the
	// process's first second (the clock counts from the package's start).
	if last != 0 && now-last < int64(time.Second) || !s.lastRedirectLog.CompareAndSwap(last, now) {
		return
	}
	s.log.Warn("in-kernel forwarding failed; connections use the copy path", "err", err)
}

var epoch = time.Now()

// monotonic is nanoseconds on the monotonic clock.
func monotonic() int64 { return int64(time.Since(epoch)) }
