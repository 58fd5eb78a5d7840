// Package httplb is weir's http data plane: it terminates HTTP/1.1, HTTP/2 (over
// TLS with ALPN, and cleartext by prior knowledge or the h2c upgrade) and gRPC, and
// picks a backend for every request, not every connection, through
// userspace/balance. One client connection carrying many HTTP/2 streams is so
// spread over every backend.
//
// Requests are forwarded over pooled upstream connections (http.Transport, one
// per backend; HTTP/2 cleartext to backends that speak it, so many client streams
// become streams over few connections). Bodies stream both ways and are flushed
// as they come; trailers (gRPC's grpc-status) pass through. Nothing here parses
// HTTP: net/http and golang.org/x/net/http2 do.
//
// A Service is made by Listen, served by Serve(ctx) until ctx is done, then shut
// down gracefully: HTTP/2 clients get GOAWAY and in-flight requests finish, up
// to the drain timeout.
package httplb

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"net/textproto"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/h2c"

	"github.com/weir-lb/weir/userspace/balance"
)

// Upstream is the protocol spoken to backends.
type Upstream int

// Upstream protocols.
const (
	// UpstreamAuto speaks HTTP/2 cleartext for requests that came over HTTP/2 and
	// HTTP/1.1 for the others.
	UpstreamAuto Upstream = iota
	UpstreamHTTP1
	UpstreamH2C
)

// HashKind is what the hash algorithms (maglev, source_hash) hash.
type HashKind int

// Hash keys.
const (
	HashSource HashKind = iota // the client's address
	HashHeader                 // a request header's value
	HashCookie                 // a cookie's value
)

// Outcome is what one try at a backend came to, for passive health.
type Outcome int

// Outcomes.
const (
	Success        Outcome = iota // an answer below 500
	ServerError                   // a 5xx answer
	ConnectFailure                // no connection to the backend
	Reset                         // the connection or stream broke
	Timeout                       // no answer in time
)

func (o Outcome) String() string {
	return [...]string{"success", "5xx", "connect failure", "reset", "timeout"}[o]
}

// Observer is told of every try's outcome (passive health) and of every
// finished request (metrics). It is called from request goroutines and must be
// quick and safe for concurrent use.
type Observer interface {
	Try(backend netip.AddrPort, o Outcome)
	Request(backend netip.AddrPort, status int, d time.Duration)
}

// Config is one service's settings.
type Config struct {
	Name   string
	Listen netip.AddrPort
	// TLS, when set, serves TLS with HTTP/2 and HTTP/1.1 by ALPN; nil: cleartext.
	TLS *tls.Config
	// Algorithm is one of balance.Algorithms(); default least_conn.
	Algorithm string
	// LastByte: least_time measures until the response's last byte, not its
	// headers.
	LastByte bool
	// Hash and HashName: the hash key of maglev and source_hash.
	Hash     HashKind
	HashName string
	Upstream Upstream

	ConnectTimeout    time.Duration // default 3s
	TryTimeout        time.Duration // until one try's response headers; 0: none
	Timeout           time.Duration // the whole request; 0: none
	IdleTimeout       time.Duration // a client connection with no request; default 5m
	ReadHeaderTimeout time.Duration // a request's headers; default 10s
	MaxHeaderBytes    int           // default 64 KiB
	// H2Conns is how many HTTP/2 connections each backend's pool spreads its
	// streams over; default 1. More give the streams more read loops and write
	// locks but split the batches the connections coalesce their writes into,
	// which costs more (bench/README.md). Read once, by Listen.
	H2Conns int
	// NetHTTP2 serves HTTP/2 clients through net/http's server and transport
	// only. Without it, cleartext clients that speak HTTP/2 by prior knowledge
	// go to the frame engine (frames.go) when the upstream is HTTP/2 (Upstream
	// auto or h2c); TLS and h2c-upgraded connections are net/http's either way.
	// Kept to compare the two (bench/http). Read once, by Listen.
	NetHTTP2 bool
	// NetHTTP1 serves HTTP/1.1 clients through net/http's server. Without it,
	// they are served by weir's own loop per connection (h1serve.go). Read
	// once, by Listen.
	NetHTTP1 bool
	// Retries is how many other backends a failed request may be tried on.
	Retries int
	// RetryBudget is the share of requests that may be retries; 0 with Retries > 0
	// allows only the budget's floor (a few a second).
	RetryBudget float64
	// RetryGRPC are gRPC methods safe to retry ("/pkg.Svc/Method", "/pkg.Svc/*",
	// "*").
	RetryGRPC []string

	XForwardedFor, Forwarded, XForwardedProto bool
	AccessLog                                 bool

	// ClientKeepalive and BackendKeepalive are TCP keepalive on the accepted
	// client connections and the connections dialed to backends, so one whose
	// peer vanished without a FIN or reset fails after Idle + Count × Interval.
	// Without Enable, Go's defaults hold: 15s idle, 15s interval, 9 probes
	// (30s idle for the HTTP/1.1 pools and net/http's h2c ones). Read once,
	// by Listen.
	ClientKeepalive  net.KeepAliveConfig
	BackendKeepalive net.KeepAliveConfig
	// ClientUserTimeout and BackendUserTimeout set TCP_USER_TIMEOUT on the
	// accepted client connections and the connections dialed to backends when
	// positive: a connection whose sent bytes stay unacknowledged this long
	// (or whose keepalive probes go unanswered this long) fails, where the
	// kernel would retransmit for net.ipv4.tcp_retries2 (about 15 minutes).
	// Rounded up to milliseconds. The client's is set on the listening
	// socket, which accepted sockets inherit; 0: no system call. Read once, by
	// Listen.
	ClientUserTimeout  time.Duration
	BackendUserTimeout time.Duration

	// DrainTimeout bounds how long Serve waits for in-flight requests at
	// shutdown, and how long a draining or removed backend keeps its tunnels;
	// 0: no limit.
	DrainTimeout time.Duration
	Observer     Observer
	Logger       *slog.Logger
	// Seed makes the balancer's random choices reproducible (tests); 0: random.
	Seed uint64
}

// Backend is one backend as the agent sees it.
type Backend struct {
	Addr   netip.AddrPort
	Weight uint32
	Usable bool // healthy, not drained, weight > 0
	// Draining: drained or weight 0. Besides taking no new requests, its
	// tunnels (WebSocket) are closed after DrainTimeout, as the proxy closes a
	// draining backend's connections; a backend that is only down keeps them.
	Draining  bool
	SlowStart time.Duration
	Ramp      uint32 // the part of its share a lookup table gives it (balance.Backend.Ramp)
}

// Service is one listening http service.
type Service struct {
	cfg      Config      // as Listen had it: the settings fixed while it listens
	tls      *tls.Config // a copy of cfg.TLS, which net/http's server amends (ALPN) as it starts
	log      *slog.Logger
	live     atomic.Pointer[live] // the settings Reconfigure may change
	ln       net.Listener
	socks    []*net.TCPListener // the listening sockets under ln, which a replacement takes over (ListenFrom)
	srv      *http.Server
	upgraded *http.Server   // shuts the h2c-upgraded connections down (see Listen)
	h2       *http2.Server  // serves h2c-upgraded connections
	split    *splitListener // hands clients to the frame engine and the HTTP/1.1 loop
	stats    stats
	failed   chan struct{} // closed when the listener failed (Failed)

	// fresh counts net/http's connections that have not yet read their first
	// request: its server drops a request read once its Shutdown has begun.
	freshMu   sync.Mutex
	fresh     map[net.Conn]struct{}
	freshGone chan struct{} // closed when fresh empties, while waitFresh waits

	h1mu       sync.Mutex
	h1conns    map[*h1Session]struct{} // HTTP/1.1 connections the loop serves
	h1Shutdown atomic.Bool

	fmu       sync.Mutex
	fsessions map[*fsess]bool // the frame engine's client connections
	fshut     bool

	tunMu      sync.Mutex
	tunnels    map[*tunnel]struct{} // upgraded connections joined to a backend (tunnel.go)
	tunClosing bool

	mu       sync.Mutex
	backends map[string]*backend                 // by address; removed ones until a reload finds none of their requests in flight
	byID     atomic.Pointer[map[string]*backend] // backends as last published, read by requests
	// oldBal is the balancer the last change of algorithm replaced: the
	// requests begun before it hold its leases, so they count as in flight
	// too when a removed backend's entry may go.
	oldBal balance.Balancer
	// stopped: Serve has returned (or Close has run); guarded by mu. No
	// request is left to end on a backend's connections, so they are
	// closed at once, with no timer to look again (closeRetiredLocked).
	stopped bool
}

// live is what a request reads once at its start: the settings that may change
// while the service listens, the balancer and the retry budget.
type live struct {
	cfg    Config
	bal    balance.Balancer
	budget *retryBudget
	hash   hashBy
}

// hashBy is what a service's requests are hashed by, worked out from its
// Config once, when a configuration is taken (Reconfigure), so a request
// compares and converts no name. Its zero value: the algorithm does not
// hash. Two are equal exactly when they make the same key of a request.
type hashBy struct {
	on   bool // the algorithm hashes
	kind HashKind
	host bool // header:Host (any case): the request's host, r.Host or :authority
	// field is a header's name as net/http keys it (canonical), lower as
	// HTTP/2 sends it; cookie is a cookie's name.
	field, lower, cookie string
}

func newHashBy(cfg *Config) hashBy {
	if !hashes(cfg.Algorithm) {
		return hashBy{}
	}
	h := hashBy{on: true, kind: cfg.Hash}
	switch cfg.Hash {
	case HashHeader:
		if strings.EqualFold(cfg.HashName, "host") {
			h.host = true
		} else {
			h.field, h.lower = textproto.CanonicalMIMEHeaderKey(cfg.HashName), strings.ToLower(cfg.HashName)
		}
	case HashCookie:
		h.cookie = cfg.HashName
	}
	return h
}

// Errors.
var (
	// ErrNoBackend is answered as 503 when no backend is usable.
	ErrNoBackend = balance.ErrNoBackend
)

// Listen binds the service's address (SO_REUSEPORT, so a replacement can bind
// it while this one drains) and prepares its server; Serve starts answering.
func Listen(cfg Config, backends []Backend) (*Service, error) {
	return ListenFrom(cfg, backends, nil)
}

// ListenFrom is Listen for a service that replaces old (nil: none): a server
// of the same address, this package's or another's that can hand its
// listening sockets over (Sockets; a proxy.Service can). If old listens on
// cfg.Listen, the new service takes every one of old's listening sockets over
// (descriptors of its own of them) instead of binding a new one beside them:
// the connections queued on them, and those still in their handshake, are the
// new service's to accept, where closing the sockets would reset them. Old
// goes on accepting on them until its Serve ends, which closes only its own
// descriptors. If the new service is given up while old still runs, old keeps
// accepting. A service that took several sockets over (a proxy's, one per
// event loop) accepts from each in a goroutine of its own.
func ListenFrom(cfg Config, backends []Backend, old Sockets) (*Service, error) {
	cfg.defaults()
	s := &Service{cfg: cfg, tls: cfg.TLS.Clone(), log: cfg.Logger, backends: map[string]*backend{}, failed: make(chan struct{})}
	if err := s.Reconfigure(cfg, backends); err != nil {
		return nil, err
	}
	var lns []net.Listener
	if old != nil {
		for _, fd := range old.ListenFDs(cfg.Listen) {
			if tl, ln := takeOver(fd, &cfg); ln != nil {
				s.socks = append(s.socks, tl)
				lns = append(lns, ln)
			}
		}
	}
	if len(lns) == 0 {
		// KeepAlive -1: Go sets no keepalive on the accepted connections,
		// which inherit the listening socket's (listenOpts).
		lc := net.ListenConfig{KeepAlive: -1, Control: func(_, _ string, c syscall.RawConn) error {
			return control(c, cfg.listenOpts)
		}}
		// Plain TCP, as the proxy's: Go would make it Multipath TCP, whose
		// listening socket refuses TCP_USER_TIMEOUT (ENOPROTOOPT), so that a
		// replacement taking it over could not set its own.
		lc.SetMultipathTCP(false)
		ln, err := lc.Listen(context.Background(), "tcp", cfg.Listen.String())
		if err != nil {
			return nil, fmt.Errorf("service %q: listen %s: %w", cfg.Name, cfg.Listen, err)
		}
		s.socks = []*net.TCPListener{ln.(*net.TCPListener)}
		lns = []net.Listener{ln}
	}
	ln := lns[0]
	if len(lns) > 1 {
		ln = newMergedListener(lns)
	}
	s.ln = coalescingListener{newPatientListener(ln, s), &s.stats}
	if s.framesServe() || !cfg.NetHTTP1 {
		s.split = newSplitListener(s.ln, s)
		s.ln = s.split
		s.stats.countedAtAccept = true
	}
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetHTTP2(true)
	protos.SetUnencryptedHTTP2(cfg.TLS == nil)
	h2 := &http2.Server{MaxConcurrentStreams: 250, IdleTimeout: cfg.IdleTimeout}
	// Connections upgraded from HTTP/1.1 (h2c upgrade) are served by x/net's
	// server, outside net/http's: its shutdown hook, registered on an http.Server
	// of its own, sends them GOAWAY when this one shuts down.
	s.upgraded = &http.Server{}
	s.h2 = h2
	if err := http2.ConfigureServer(s.upgraded, h2); err != nil {
		ln.Close()
		return nil, fmt.Errorf("service %q: %w", cfg.Name, err)
	}
	s.srv = &http.Server{
		Handler:           h2c.NewHandler(s, h2),
		Protocols:         &protos,
		TLSConfig:         s.tls,
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    cfg.MaxHeaderBytes,
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: 250, MaxDecoderHeaderTableSize: 4096, MaxEncoderHeaderTableSize: 4096},
		ErrorLog:          slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelDebug),
		ConnState:         s.connState,
	}
	return s, nil
}

// framesServe reports whether the frame engine serves HTTP/2 clients: their
// requests go to backends over HTTP/2, and net/http's path was not asked for.
func (s *Service) framesServe() bool {
	return !s.cfg.NetHTTP2 && s.cfg.Upstream != UpstreamHTTP1
}

func (c *Config) defaults() {
	if c.Algorithm == "" {
		c.Algorithm = balance.LeastConn
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 3 * time.Second
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = 5 * time.Minute
	}
	if c.ReadHeaderTimeout == 0 {
		c.ReadHeaderTimeout = 10 * time.Second
	}
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = 64 << 10
	}
	if c.H2Conns <= 0 {
		c.H2Conns = 1
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// Addr is the address the service listens on.
func (s *Service) Addr() net.Addr { return s.ln.Addr() }

// Serve answers until ctx is done, then shuts down gracefully: the listener
// closes, the connections accepted by then are served their first request
// (HTTP/2: the streams they open before GOAWAY), HTTP/2 connections get
// GOAWAY, idle HTTP/1.1 connections close, and in-flight requests finish (up
// to DrainTimeout, then their connections close).
// A listener that fails ends it the same way, and Serve returns its error.
func (s *Service) Serve(ctx context.Context) error {
	ln := s.ln
	if s.tls != nil && s.split == nil {
		ln = tls.NewListener(ln, s.tls) // else the split listener does the handshake
	}
	errc := make(chan error, 1)
	if s.split != nil {
		// Exits when the listener closes.
		go s.split.run()
	}
	// Exits when the server is shut down below (or the listener fails).
	go func() { errc <- s.srv.Serve(ln) }()
	var failed error
	select {
	case failed = <-errc:
		// The listener failed: the connections it accepted are not left
		// open (nothing would close them), they drain as at a stop.
		close(s.failed)
	case <-ctx.Done():
	}
	shutCtx, cancel := context.Background(), context.CancelFunc(func() {})
	if s.cfg.DrainTimeout > 0 {
		shutCtx, cancel = context.WithTimeout(shutCtx, s.cfg.DrainTimeout)
	}
	defer cancel()
	if s.split != nil {
		// Stop accepting first, and let the connections accepted by then
		// reach their engine, so that its shutdown serves their first
		// request rather than refuse them.
		s.split.stop(shutCtx.Done())
	}
	// Both at once: each waits for its own connections.
	var wg sync.WaitGroup
	wg.Go(func() { s.upgraded.Shutdown(shutCtx) })
	wg.Go(func() { s.shutdownFrames(shutCtx.Done()) })
	wg.Go(func() { s.shutdownH1(shutCtx.Done()) })
	wg.Go(func() { s.shutdownTunnels(shutCtx.Done()) })
	// net/http's server closes a connection whose first request it reads
	// after its Shutdown began: the connections handed to it are let bring
	// and have answered their first request first, as the loop's are.
	s.waitFresh(shutCtx.Done())
	err := s.srv.Shutdown(shutCtx)
	wg.Wait()
	if err != nil {
		s.srv.Close() // the drain time is up: close what is left
	}
	if failed == nil {
		<-errc
	}
	s.closeBackends()
	if failed != nil {
		return fmt.Errorf("service %q: serve: %w", s.cfg.Name, failed)
	}
	return nil
}

// Failed returns a channel closed when the service's listener fails: it then
// serves no new connection, and its Serve drains what it had and returns the
// error.
func (s *Service) Failed() <-chan struct{} { return s.failed }

// Close stops the service at once, without draining (for a Listen whose Serve
// never ran).
func (s *Service) Close() error {
	err := s.srv.Close()
	s.ln.Close()
	s.closeFrames()
	s.closeH1()
	s.shutdownTunnels(closedChan)
	s.closeBackends()
	return err
}

// backend is one backend's transport and counters.
type backend struct {
	addr netip.AddrPort
	id   string
	h1   *http.Transport
	h2   []*http.Transport // requests go round them (H2Conns)
	h1s  *h1Pool           // HTTP/1.1 requests without a body or with a short one sent whole
	// h2Retire is set while closeIdle closes h2's idle connections: they
	// end with GOAWAY (goAwayConn).
	h2Retire atomic.Bool
	// h2Conns is h2's connections open (goAwayConn).
	h2Conns h2Conns
	// fpool is the frame engine's HTTP/2 connections, made on first use.
	fpool atomic.Pointer[upPool]
	next  atomic.Uint32
	stats backendStats
	// removed: no longer configured; its idle connections are closed.
	removed bool
	// retired: removed, or its service has stopped. No request will take
	// its pooled connections again: those its requests in flight give back
	// are closed as they come (closeRetired), not kept until the pools'
	// idle timeout. Written under Service.mu, read by requests.
	retired atomic.Bool
	// closeAgain looks again for h2 connections to close, closeAgainIn
	// after closeRetired last ran; nil when not armed. Guarded by
	// Service.mu.
	closeAgain   *time.Timer
	closeAgainIn time.Duration
	// drainTimer closes the backend's tunnels DrainTimeout after it began to
	// drain or was removed; nil while it serves. Guarded by Service.mu.
	drainTimer *time.Timer
}

func (s *Service) newBackend(addr netip.AddrPort) *backend {
	b := &backend{addr: addr, id: addr.String()}
	dialer := s.dialer()
	dialer.KeepAlive = 30 * time.Second
	dial := func(ctx context.Context, network, _ string) (net.Conn, error) {
		if b.retired.Load() {
			return nil, &dialError{errRetired}
		}
		c, err := dialer.DialContext(ctx, network, b.id)
		if err != nil {
			return nil, &dialError{err}
		}
		return c, nil
	}
	// The transports' connections are failConns: their readers and writers
	// agree on a backend that stopped acknowledging.
	dialH1 := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return newFailConn(c), nil
	}
	dialH2 := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return newGoAwayConn(newCoalescingConn(newFailConn(c), true), &b.h2Retire, &b.h2Conns), nil
	}
	mk := func(h2c bool) *http.Transport {
		t := &http.Transport{
			DialContext:            dialH1,
			MaxIdleConns:           0,
			MaxIdleConnsPerHost:    1024,
			IdleConnTimeout:        90 * time.Second,
			DisableCompression:     true,
			MaxResponseHeaderBytes: int64(max(s.cfg.MaxHeaderBytes, 64<<10)),
			WriteBufferSize:        32 << 10,
			ReadBufferSize:         32 << 10,
		}
		var p http.Protocols
		if h2c {
			p.SetUnencryptedHTTP2(true)
			t.DialContext = dialH2
			t.HTTP2 = &http.HTTP2Config{MaxReceiveBufferPerStream: 1 << 20, MaxReceiveBufferPerConnection: 4 << 20}
		} else {
			p.SetHTTP1(true)
		}
		t.Protocols = &p
		return t
	}
	b.h1 = mk(false)
	b.h1s = newH1Pool(func(ctx context.Context) (net.Conn, error) {
		c, err := dial(ctx, "tcp", "")
		if err != nil {
			return nil, err
		}
		return rawConnOf(c), nil
	},
		1024, 90*time.Second, int64(max(s.cfg.MaxHeaderBytes, 64<<10)))
	for range s.cfg.H2Conns {
		b.h2 = append(b.h2, mk(true))
	}
	return b
}

// closeIdle closes the backend's idle upstream connections. weir's own
// HTTP/1.1 exchange's pool (h1s) and the frame engine's keep none from then on, until
// the backend is configured again; http.Transport's pools keep the connections
// of requests in flight, which closeRetired closes as the requests end.
func (b *backend) closeIdle() {
	b.h1.CloseIdleConnections()
	b.h1s.close()
	// CloseIdleConnections closes them before it returns.
	b.h2Retire.Store(true)
	for _, t := range b.h2 {
		t.CloseIdleConnections()
	}
	b.h2Retire.Store(false)
	if p := b.fpool.Load(); p != nil {
		p.closeIdle()
	}
}

// retire marks be retired and closes its idle connections now, the others as
// their requests end; s.mu is held.
func (s *Service) retire(be *backend) {
	be.retired.Store(true)
	s.closeRetiredLocked(be, true)
}

// unretire lets be keep its connections again (configured again); s.mu is
// held.
func (s *Service) unretire(be *backend) {
	if !be.retired.Load() {
		return
	}
	be.retired.Store(false)
	be.h1s.reopen()
	be.stopCloseAgain()
}

// stopCloseAgain disarms be's close-again timer; Service.mu is held.
func (be *backend) stopCloseAgain() {
	if be.closeAgain != nil {
		be.closeAgain.Stop()
		be.closeAgain = nil
	}
}

// tryEnded is told that a request's try on be is over, its answer's body
// closed: the connection it took is back in its pool, or closed. A retired
// backend's is closed now.
func (s *Service) tryEnded(be *backend) {
	if be.retired.Load() {
		s.closeRetired(be, true)
	}
}

// Retired backends' h2 connections are looked at again after a request ends,
// first closeAgainFirst later, then at doubling intervals up to closeAgainLast.
const (
	closeAgainFirst = 10 * time.Millisecond
	closeAgainLast  = 1280 * time.Millisecond
)

// closeRetired closes a retired backend's idle connections (ended: a request
// on it ended, or it was retired just now).
func (s *Service) closeRetired(be *backend, ended bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if be.retired.Load() { // else configured again meanwhile
		s.closeRetiredLocked(be, ended)
	}
}

// closeRetiredLocked is closeRetired with s.mu held. Go's HTTP/2 transport
// lets go of the stream of a request broken off (its client gone, a timeout)
// a moment after RoundTrip returns, on a goroutine of its own, and its
// connection is idle only then: while h2 connections are open, it looks
// again, closeAgainFirst later, then at doubling intervals for about 2.5 s. A
// connection still open after that carries a request in flight, whose end
// looks again. Once the service has stopped, what is left of the requests is
// on its way out: h2's connections are closed at once, busy or not.
func (s *Service) closeRetiredLocked(be *backend, ended bool) {
	be.closeIdle()
	if s.stopped {
		be.stopCloseAgain()
		be.h2Retire.Store(true) // an orderly end: GOAWAY NO_ERROR
		be.h2Conns.closeAll()
		be.h2Retire.Store(false)
		return
	}
	switch {
	case ended:
		be.closeAgainIn = closeAgainFirst
	case be.closeAgainIn < closeAgainLast:
		be.closeAgainIn *= 2
	default:
		be.closeAgainIn = 0
	}
	if be.h2Conns.count() == 0 || be.closeAgainIn == 0 {
		be.stopCloseAgain()
		return
	}
	if be.closeAgain == nil {
		be.closeAgain = time.AfterFunc(be.closeAgainIn, func() { s.closeRetired(be, false) })
	} else {
		be.closeAgain.Reset(be.closeAgainIn)
	}
}

// errRetired is the dial a retired backend is refused: its requests in flight
// finish on the connections it has, and it gets no new one. The request goes
// to another backend, as the same try (forward).
var errRetired = errors.New("the backend is retired: no new connection")

// dialError marks a failure to connect: the request was never sent, so any
// request may be retried elsewhere.
type dialError struct{ err error }

func (e *dialError) Error() string { return "connect: " + e.err.Error() }
func (e *dialError) Unwrap() error { return e.err }

// ErrRebuild is returned by Reconfigure for a change that needs a new listener.
var ErrRebuild = errors.New("the change needs a new listener")

// ErrStopped is returned by SetBackends and Reconfigure once the service has
// stopped: its backends stay retired, and no connection is kept or dialled
// again.
var ErrStopped = errors.New("the service has stopped")

// Fixed reports whether two configs differ in a setting fixed while the service
// listens (address, TLS, the server's and the pools' limits and timeouts), which
// Reconfigure cannot change.
func Fixed(a, b Config) bool {
	return a.Name != b.Name || a.Listen != b.Listen || a.TLS != b.TLS || a.NetHTTP2 != b.NetHTTP2 || a.NetHTTP1 != b.NetHTTP1 || a.ConnectTimeout != b.ConnectTimeout ||
		a.IdleTimeout != b.IdleTimeout || a.ReadHeaderTimeout != b.ReadHeaderTimeout ||
		a.MaxHeaderBytes != b.MaxHeaderBytes || a.DrainTimeout != b.DrainTimeout ||
		a.ClientKeepalive != b.ClientKeepalive || a.BackendKeepalive != b.BackendKeepalive ||
		a.ClientUserTimeout != b.ClientUserTimeout || a.BackendUserTimeout != b.BackendUserTimeout
}

// Reconfigure applies new settings and backends in place: client connections
// stay open (no GOAWAY), requests in flight finish with the settings they
// started with, and later ones take the new. The balancer is kept, with its
// latency estimates, unless the algorithm changed. A change Fixed reports is
// refused with ErrRebuild; any, once the service has stopped, with
// ErrStopped.
func (s *Service) Reconfigure(cfg Config, backends []Backend) error {
	cfg.defaults()
	cfg.TLS = s.cfg.TLS // compared by the caller; the certificate is loaded once
	if Fixed(s.cfg, cfg) {
		return fmt.Errorf("service %q: %w", cfg.Name, ErrRebuild)
	}
	prev := s.live.Load()
	l := &live{cfg: cfg, hash: newHashBy(&cfg)}
	if prev != nil && prev.cfg.Algorithm == cfg.Algorithm && prev.cfg.Seed == cfg.Seed {
		l.bal = prev.bal
	} else {
		bal, err := balance.New(cfg.Algorithm, nil, cfg.Seed)
		if err != nil {
			return fmt.Errorf("service %q: %w", cfg.Name, err)
		}
		l.bal = bal
	}
	if prev != nil && prev.cfg.RetryBudget == cfg.RetryBudget {
		l.budget = prev.budget
	} else {
		l.budget = newRetryBudget(cfg.RetryBudget)
	}
	if err := s.setBackends(l.bal, backends); err != nil {
		return err
	}
	s.live.Store(l)
	return nil
}

// SetBackends replaces the backend set. Backends that stay keep their pooled
// connections, in-flight counts and latency estimates; a backend that is no
// longer usable (drained, ejected, removed) gets no new requests, and its
// in-flight ones finish. Once the service has stopped, a set is refused with
// ErrStopped. Safe for concurrent use with requests.
func (s *Service) SetBackends(bs []Backend) error {
	return s.setBackends(s.live.Load().bal, bs)
}

func (s *Service) setBackends(bal balance.Balancer, bs []Backend) error {
	// A set refused changes nothing: checked whole before any backend is.
	seen := make(map[netip.AddrPort]bool, len(bs))
	for _, b := range bs {
		if seen[b.Addr] {
			return fmt.Errorf("service %q: backend %s: listed twice", s.cfg.Name, b.Addr)
		}
		seen[b.Addr] = true
	}
	in := make([]balance.Backend, 0, len(bs))
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return fmt.Errorf("service %q: %w", s.cfg.Name, ErrStopped)
	}
	if l := s.live.Load(); l != nil && l.bal != bal {
		s.oldBal = l.bal // Reconfigure's new balancer replaces it
	}
	for _, b := range bs {
		be := s.backends[b.Addr.String()]
		if be == nil {
			be = s.newBackend(b.Addr)
			s.backends[be.id] = be
		}
		be.removed = false
		s.unretire(be)
		s.drainTunnels(be, b.Draining)
		in = append(in, balance.Backend{ID: be.id, Weight: b.Weight, Usable: b.Usable && b.Weight > 0, SlowStart: b.SlowStart, Ramp: b.Ramp})
	}
	bal.SetBackends(in)
	for id, be := range s.backends {
		if !seen[be.addr] {
			// In-flight requests keep their connections until they end; idle
			// ones close now. The entry goes now if nothing is in flight on
			// it, else at a later reload that finds nothing in flight (kept,
			// it is retired all the same, and taken up again if configured
			// again meanwhile).
			be.removed = true
			s.retire(be)
			s.drainTunnels(be, true)
			if bal.InFlight(id) == 0 && (s.oldBal == nil || s.oldBal.InFlight(id) == 0) {
				delete(s.backends, id)
			}
		}
	}
	byID := maps.Clone(s.backends)
	s.byID.Store(&byID)
	return nil
}

// backend returns the backend a pick named, from the copy the last SetBackends
// published: requests look it up without a lock.
func (s *Service) backend(id string) *backend {
	return (*s.byID.Load())[id]
}

// closeBackends retires every backend of a service that has stopped, and
// closes their connections.
func (s *Service) closeBackends() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopped = true
	for _, b := range s.backends {
		s.retire(b) // requests broken off at the drain's end may still be on their way out
		s.drainTunnels(b, false)
	}
}

// BackendSnapshot is one backend's counters.
type BackendSnapshot struct {
	Addr     netip.AddrPort
	InFlight int
	Tunnels  int // of InFlight, upgraded connections joined to it (WebSocket)
	// Latency is the estimate the algorithm picks by (ewma, least_time); 0 with
	// HasLatency false for the others, or before any sample.
	Latency    time.Duration
	HasLatency bool
	Requests   uint64
	Retries    uint64
	// Classes counts answers by status class: 1xx..5xx at 1..5; at 0 requests
	// that got no answer from the backend (the plane answered 502/504 itself).
	Classes [6]uint64
}

// Snapshot is the service's counters.
type Snapshot struct {
	Connections int64  // client connections open now
	Accepted    uint64 // client connections accepted
	InFlight    int64  // requests in flight now
	Tunnels     int64  // upgraded connections joined to a backend now (WebSocket; counted in InFlight too)
	Requests    uint64 // requests answered
	NoBackend   uint64 // answered 503: no backend usable
	// AcceptErrors counts the accept errors waited out (no descriptor or
	// memory left), as the proxy's Snapshot.AcceptErrors.
	AcceptErrors uint64
	// ClientTimeouts counts client connections the kernel gave up on because
	// the client stopped acknowledging (ETIMEDOUT: TCP keepalive probes, or
	// bytes sent to it, unanswered), as the proxy's Snapshot.ClientTimeouts.
	ClientTimeouts uint64
	Backends       []BackendSnapshot
}

// Snapshot returns the service's counters now.
func (s *Service) Snapshot() Snapshot {
	sn := Snapshot{Connections: s.stats.conns.Load(), Accepted: s.stats.accepted.Load(),
		InFlight: s.stats.inflight.Load(), Requests: s.stats.requests.Load(), NoBackend: s.stats.noBackend.Load(),
		AcceptErrors: s.stats.acceptErrors.Load(), ClientTimeouts: s.stats.clientTimeouts.Load()}
	s.tunMu.Lock()
	sn.Tunnels = int64(len(s.tunnels))
	var tunnelsOf map[*backend]int
	if len(s.tunnels) > 0 {
		tunnelsOf = map[*backend]int{}
		for t := range s.tunnels {
			tunnelsOf[t.be]++
		}
	}
	s.tunMu.Unlock()
	s.mu.Lock()
	bs := make([]*backend, 0, len(s.backends))
	for _, b := range s.backends {
		if !b.removed {
			bs = append(bs, b)
		}
	}
	s.mu.Unlock()
	slices.SortFunc(bs, func(a, b *backend) int { return a.addr.Compare(b.addr) })
	bal := s.live.Load().bal
	for _, b := range bs {
		bsn := BackendSnapshot{Addr: b.addr, InFlight: bal.InFlight(b.id), Tunnels: tunnelsOf[b], Requests: b.stats.requests.Load(),
			Retries: b.stats.retries.Load()}
		bsn.Latency, bsn.HasLatency = bal.Estimate(b.id)
		for i := range bsn.Classes {
			bsn.Classes[i] = b.stats.classes[i].Load()
		}
		sn.Backends = append(sn.Backends, bsn)
	}
	return sn
}
