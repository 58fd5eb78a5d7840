// Package agent is weir's node agent. One goroutine, the reconcile loop, owns the
// running state: the config in force, where each service runs, the health
// verdicts, the runtime overrides, the dsr backends' MACs and the data planes.
// Nothing else changes it, and nothing guards it with a mutex.
//
// Events come to the loop on one channel:
//
//   - reload: Reload, from SIGHUP (cmd/weir) or the admin API's POST /v1/reload;
//   - health: every change the health checker publishes (health.Checker.Watch);
//   - override: a drain or weight set through the admin API (SetDrain, SetWeight);
//   - node drain: SetNodeDrain, the node's BGP routes withdrawn or announced again;
//   - tick: once a second, from the loop's own ticker: MACs still unknown are
//     resolved again, backends a reload removed leave XDP when their drain
//     time is up, and previous lookup tables past xdp.previous_table_window
//     stop serving the fallback.
//
// A caller that needs an answer (reload, override) gets it on the reply channel its
// event carries. For every event the loop updates what it knows, then
//
//	plan.Plan(config, health, overrides, ...) -> desired    (userspace/agent/plan, pure)
//	plan.Diff(running, desired)               -> operations
//
// and applies the operations through the Plane interface, which each data plane
// implements: userspace/agent/xdpplane (the XDP program through the loader) and
// userspace/agent/proxyplane (the splice proxy). If a write fails, the loop
// re-applies the previous desired state to what it touched and the event's change
// is refused, so the planes always run one whole desired state. The health checker
// is told of the services and backends that run after each change.
//
// After each event the loop publishes a snapshot (atomic pointer swap): Status,
// Explain, the admin API (userspace/agent/admin) and the Prometheus metrics
// (userspace/agent/metrics) read only that, plus the data planes' live counters.
//
// With a bgp section, each snapshot also becomes the routes the BGP speaker
// (userspace/agent/bgp) announces: bgp.Routes(desired, drained, confirmed), applied on the
// speaker's own goroutine.
//
// Imports point one way: agent -> {plan, xdpplane, proxyplane, bgp, admin,
// metrics, api}; xdpplane, proxyplane and bgp -> plan -> config; admin and metrics
// -> api. Nothing below imports agent.
package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/agent/bgp"
	"github.com/weir-lb/weir/userspace/agent/httpplane"
	"github.com/weir-lb/weir/userspace/agent/metrics"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/agent/proxyplane"
	"github.com/weir-lb/weir/userspace/agent/xdpplane"
	"github.com/weir-lb/weir/userspace/config"
	"github.com/weir-lb/weir/userspace/httplb"
	"github.com/weir-lb/weir/userspace/proxy"
)

// Options of an agent.
type Options struct {
	// ConfigPath is the YAML file; Reload reads it again.
	ConfigPath string
	// NoXDP serves every service with the proxy (udp services then fail to start).
	NoXDP bool
	// Log is where logs go when Logger is nil, in the config's format. Default stderr.
	Log io.Writer
	// Logger, if set, is used as is.
	Logger *slog.Logger
}

// Errors of the agent's methods, shared with the admin API.
var (
	ErrNotRunning = api.ErrNotRunning
	ErrNotFound   = api.ErrNotFound
	ErrBadRequest = api.ErrBadRequest
)

// Plane is what the loop asks of a data plane. It is called from the loop only.
// Each method must be safe to repeat: a rollback re-applies a previous state, so a
// plane may be asked to add what it serves or remove what it does not.
type Plane interface {
	Add(s *plan.Service) error
	Update(prev, next *plan.Service) error
	// SetBackend changes one backend's usability, weight or drain, and nothing else.
	SetBackend(prev, next *plan.Service, backend netip.AddrPort) error
	Remove(s *plan.Service) error
}

// Agent runs one node's data planes. Create it with New; Run it once.
type Agent struct {
	opts    Options
	log     *slog.Logger
	checker *health.Checker
	metrics *metrics.Metrics

	events   chan event
	wake     chan struct{} // a listening plane's server stopped on its own: revive
	loopDone chan struct{} // closed when the loop has ended
	running  atomic.Bool   // the loop takes events
	snap     atomic.Pointer[snapshot]
	handled  atomic.Uint64 // events the loop has handled, for tests
	// healthTaken counts the health changes the loop has taken (the checker's
	// replay of every backend's state when the agent starts comes first), for tests.
	healthTaken atomic.Uint64

	// Set by Run before the loop starts; read-only after.
	xdp    *xdpplane.Plane
	proxy  *proxyplane.Plane
	http   *httpplane.Plane
	planes map[plan.Plane]Plane
	bgp    *bgp.Speaker // nil without a bgp section

	stopRun      context.CancelFunc
	stopMu       sync.Mutex
	detachOnStop atomic.Bool // set by Stop(detach): remove the XDP program at stop
}

const maxReloads = 10

// New returns an agent for opts.
func New(opts Options) *Agent {
	a := &Agent{opts: opts, checker: &health.Checker{}, events: make(chan event),
		wake: make(chan struct{}, 1), loopDone: make(chan struct{})}
	a.metrics = metrics.New(a.Status)
	a.checker.OnCheck = a.metrics.ObserveCheck
	return a
}

// Run loads the config, sets up the data planes and serves until ctx is done (or
// Stop is called), then stops what it started: proxies finish their connections (up
// to their drain timeout); the XDP program stays attached and pinned for the next
// run unless xdp.detach_on_stop or Stop(true) asks to detach it, or it could not be
// pinned.
func (a *Agent) Run(ctx context.Context) (err error) {
	cfg, err := config.Load(a.opts.ConfigPath)
	if err != nil {
		return err
	}
	a.log = a.opts.Logger
	if a.log == nil {
		a.log = newLogger(cfg.Log, a.opts.Log)
	}

	// Listeners first: a second agent fails here, before it touches anything.
	ls, err := listen(cfg)
	if err != nil {
		return fmt.Errorf("run: %w", err)
	}
	defer os.Remove(cfg.Admin.Socket)

	if cfg.Metrics.Public {
		a.log.Warn("metrics are served to the network (metrics.public: true): anyone who reaches the address reads every service and backend", "listen", cfg.Metrics.Listen)
	}
	x, err := xdpplane.Setup(ctx, cfg, a.opts.NoXDP)
	if err != nil {
		ls.close()
		return fmt.Errorf("run: %w", err)
	}
	if x.Loaded() {
		a.log.Info("xdp program loaded", "interfaces", x.Interfaces(), "pinned", x.PinPath(), "adopted", x.Adopted())
	} else {
		a.log.Warn("xdp unavailable: services are served by the proxy where they can be", "reason", x.Reason())
	}
	a.xdp, a.proxy = x, proxyplane.New(a.checker, a.log)
	a.http = httpplane.New(a.checker, a.log, a.metrics.ObserveRequest)
	a.proxy.Wake, a.http.Wake = a.revive, a.revive
	pairPlanes(a.proxy, a.http)
	a.planes = map[plan.Plane]Plane{plan.XDP: x, plan.Proxy: a.proxy, plan.HTTP: a.http}

	st := newState(cfg)
	st.flowIdle = x.FlowIdle()
	if err := a.start(st); err != nil {
		ls.close()
		a.proxy.Close()
		a.http.Close()
		// A pinned program adopted from the last run keeps serving: the rollback
		// removed what this run added and left the entries the program held (as
		// this run wrote them, so an unchanged service is as it was); one this run
		// made is removed.
		return fmt.Errorf("run: %w", errors.Join(err, x.Stop(!x.Adopted())))
	}
	x.DropUnowned(a.log)
	if cfg.BGP.ASN != 0 {
		a.bgp = bgp.New(cfg.BGP, a.log)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	a.stopMu.Lock()
	a.stopRun = cancel
	a.stopMu.Unlock()
	// Running before the first snapshot: a caller that sees the services in Status
	// may send the loop requests at once (they wait for it to start reading).
	a.running.Store(true)
	a.publish(st)
	a.log.Info("weir running", "config", a.opts.ConfigPath, "services", len(cfg.Services), "admin", cfg.Admin.Socket, "metrics", cfg.Metrics.Listen)

	var wg sync.WaitGroup
	// Exits when runCtx is done.
	wg.Go(func() {
		if err := a.checker.Run(runCtx); err != nil && !errors.Is(err, context.Canceled) {
			a.log.Error("health checker stopped", "err", err)
		}
	})
	// Exits when runCtx is done: each change becomes an event for the loop.
	wg.Go(func() {
		a.checker.Watch(runCtx, func(ch health.Change) { a.post(runCtx, healthEvent{ch}) })
	})
	if a.bgp != nil {
		// Exits when runCtx is done, after closing its sessions (which withdraws
		// the routes before the data planes stop).
		wg.Go(func() {
			if err := a.bgp.Run(runCtx); err != nil {
				a.log.Error("bgp speaker stopped: this node announces nothing", "err", err)
			}
		})
	}
	servers := ls.serve(&wg, admin.Handler(a, a.metrics.Handler()), a.metrics.Handler())

	sdNotify("READY=1")
	a.loop(runCtx, st) // until runCtx is done
	sdNotify("STOPPING=1")
	a.log.Info("stopping")
	a.running.Store(false)
	shutCtx, done := context.WithTimeout(context.Background(), 5*time.Second)
	for _, s := range servers {
		s.Shutdown(shutCtx)
	}
	done()
	cancel()
	wg.Wait()
	a.snap.Store(nil)
	a.proxy.Close()
	a.http.Close()
	detach := cfg.XDP.DetachOnStop || a.detachOnStop.Load()
	if err := x.Stop(detach); err != nil {
		return fmt.Errorf("run: stop: %w", err)
	}
	switch {
	case !x.Loaded():
		a.log.Info("stopped: proxies closed")
	case detach || x.PinPath() == "":
		a.log.Info("stopped: proxies closed, XDP program detached")
	default:
		a.log.Info("stopped: proxies closed; the XDP program stays attached and balancing, pinned for the next run (weir stop --detach, or xdp.detach_on_stop: true, removes it)", "pin_path", x.PinPath())
	}
	return nil
}

// Stop ends Run as a signal would; with detach the XDP program is detached and its
// pins removed whatever xdp.detach_on_stop says.
func (a *Agent) Stop(detach bool) error {
	a.stopMu.Lock()
	defer a.stopMu.Unlock()
	if !a.running.Load() || a.stopRun == nil {
		return ErrNotRunning
	}
	if detach {
		a.detachOnStop.Store(true)
	}
	a.log.Info("stop requested through the admin API", "detach", detach)
	a.stopRun()
	return nil
}

func newLogger(c config.Log, w io.Writer) *slog.Logger {
	if w == nil {
		w = os.Stderr
	}
	opts := &slog.HandlerOptions{Level: c.Level}
	if c.Format == config.LogJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// listeners are the admin and metrics listeners, opened before anything else.
type listeners struct {
	admin   []net.Listener
	metrics net.Listener
}

func listen(cfg *config.Config) (*listeners, error) {
	ls := &listeners{}
	l, err := admin.ListenUnix(cfg.Admin.Socket)
	if err != nil {
		return nil, err
	}
	ls.admin = append(ls.admin, l)
	if cfg.Admin.Listen.IsValid() {
		l, err := listenTCP(cfg.Admin.Listen)
		if err != nil {
			ls.close()
			return nil, fmt.Errorf("admin.listen: %w%s", err, addrHint(cfg.Admin.Listen.Addr(), err))
		}
		ls.admin = append(ls.admin, l)
	}
	if cfg.Metrics.Listen.IsValid() {
		if ls.metrics, err = listenTCP(cfg.Metrics.Listen); err != nil {
			ls.close()
			return nil, fmt.Errorf("metrics.listen: %w%s", err, addrHint(cfg.Metrics.Listen.Addr(), err))
		}
	}
	return ls, nil
}

// listenTCP listens on a plain TCP socket, as the data planes do: Go would
// make it Multipath TCP where the kernel has it, whose listening socket
// refuses some TCP options.
func listenTCP(at netip.AddrPort) (net.Listener, error) {
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	return lc.Listen(context.Background(), "tcp", at.String())
}

// addrHint names the likely cause of a bind failing for want of the address.
func addrHint(a netip.Addr, err error) string {
	if !errors.Is(err, syscall.EADDRNOTAVAIL) {
		return ""
	}
	if a.IsLoopback() {
		return " (is the loopback interface up in this network namespace? ip link set lo up)"
	}
	return fmt.Sprintf(" (no interface of this host holds %s)", a)
}

func (ls *listeners) close() {
	for _, l := range ls.admin {
		l.Close()
	}
	if ls.metrics != nil {
		ls.metrics.Close()
	}
}

// serve starts the admin and metrics servers; each exits when shut down.
func (ls *listeners) serve(wg *sync.WaitGroup, adminHandler, metricsHandler http.Handler) []*http.Server {
	adminSrv := &http.Server{Handler: adminHandler, ReadHeaderTimeout: 5 * time.Second}
	servers := []*http.Server{adminSrv}
	for _, l := range ls.admin {
		// Exits when adminSrv is shut down.
		wg.Go(func() { adminSrv.Serve(l) })
	}
	if ls.metrics != nil {
		msrv := &http.Server{Handler: metricsHandler, ReadHeaderTimeout: 5 * time.Second}
		servers = append(servers, msrv)
		// Exits when msrv is shut down.
		wg.Go(func() { msrv.Serve(ls.metrics) })
	}
	return servers
}

// pairPlanes lets a service that moves between the proxy and the http plane on
// the same address take the other plane's listening sockets over, as a
// reload on one plane does: the connections queued on them are not reset.
func pairPlanes(px *proxyplane.Plane, h *httpplane.Plane) {
	px.Peer.Find = func(at netip.AddrPort) (proxy.Sockets, bool) { return h.ListeningOn(at) }
	h.Peer.Find = func(at netip.AddrPort) (httplb.Sockets, bool) { return px.ListeningOn(at) }
}
