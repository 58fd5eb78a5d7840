// Package agent is weir's node agent: it reads the config, picks each service's
// data plane (XDP where the host, the algorithm and a self-test allow, else the
// splice proxy), keeps the data planes in step with the health checker, applies
// reloads atomically, and serves the admin API and Prometheus metrics.
//
// Run is synchronous; Reload, SetDrain, SetWeight and Status may be called from
// other goroutines while it runs (the admin API does).
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
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/config"
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

// ErrNotRunning is returned by the methods that need Run to be running.
var ErrNotRunning = errors.New("agent not running")

// Agent runs one node's data planes. Create it with New; Run it once.
type Agent struct {
	opts    Options
	log     *slog.Logger
	checker *health.Checker
	metrics *metrics

	mu       sync.Mutex
	running  bool
	cfg      *config.Config
	xdp      *xdpPlane
	services []*service // config order
	started  time.Time
	reloads  []ReloadStatus // most recent last, at most maxReloads

	retiring sync.WaitGroup // proxies of removed or replaced services, draining

	detachOnStop atomic.Bool        // set by Stop(detach): remove the XDP program at stop
	stopRun      context.CancelFunc // ends Run; set while it runs
}

const maxReloads = 10

// New returns an agent for opts.
func New(opts Options) *Agent {
	a := &Agent{opts: opts, checker: &health.Checker{}}
	a.metrics = newMetrics(a)
	a.checker.OnCheck = a.metrics.observeCheck
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
	adminLn, err := listenUnix(cfg.Admin.Socket)
	if err != nil {
		return fmt.Errorf("run: %w", err)
	}
	defer os.Remove(cfg.Admin.Socket)
	listeners := []net.Listener{adminLn}
	closeAll := func() {
		for _, l := range listeners {
			l.Close()
		}
	}
	if cfg.Admin.Listen != "" {
		l, err := net.Listen("tcp", cfg.Admin.Listen)
		if err != nil {
			closeAll()
			return fmt.Errorf("run: admin.listen: %w", err)
		}
		listeners = append(listeners, l)
	}
	var metricsLn net.Listener
	if cfg.Metrics.Listen != "off" {
		if metricsLn, err = net.Listen("tcp", cfg.Metrics.Listen); err != nil {
			closeAll()
			return fmt.Errorf("run: metrics.listen: %w", err)
		}
	}

	x, err := setupXDP(cfg, a.opts.NoXDP)
	if err != nil {
		closeAll()
		if metricsLn != nil {
			metricsLn.Close()
		}
		return fmt.Errorf("run: %w", err)
	}
	if x.prog != nil {
		a.log.Info("xdp program loaded", "interfaces", x.ifaces, "pinned", x.pinPath, "adopted", x.hadPins)
	} else {
		a.log.Warn("xdp unavailable: services are served by the proxy where they can be", "reason", x.reason)
	}

	stopCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	a.mu.Lock()
	a.xdp, a.started, a.stopRun = x, time.Now(), stopRun
	err = a.apply(cfg)
	if err == nil {
		a.cfg, a.running = cfg, true
		x.dropStale(a.services, a.log)
	}
	a.mu.Unlock()
	if err != nil {
		closeAll()
		if metricsLn != nil {
			metricsLn.Close()
		}
		a.stopAll()
		// A pinned program adopted from the last run keeps serving as it was (apply
		// undid its own writes); one this run made is removed.
		return fmt.Errorf("run: %w", errors.Join(err, x.stop(!x.hadPins)))
	}
	a.log.Info("weir running", "config", a.opts.ConfigPath, "services", len(cfg.Services), "admin", cfg.Admin.Socket, "metrics", cfg.Metrics.Listen)

	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	// Exits when runCtx is done.
	wg.Go(func() {
		if err := a.checker.Run(runCtx); err != nil && !errors.Is(err, context.Canceled) {
			a.log.Error("health checker stopped", "err", err)
		}
	})
	// Exits when runCtx is done.
	wg.Go(func() { a.checker.Watch(runCtx, a.onHealth) })
	// Exits when runCtx is done.
	wg.Go(func() { a.retryMACs(runCtx) })

	adminSrv := &http.Server{Handler: a.adminHandler(), ReadHeaderTimeout: 5 * time.Second}
	servers := []*http.Server{adminSrv}
	for _, l := range listeners {
		// Exits when adminSrv is shut down below.
		wg.Go(func() { adminSrv.Serve(l) })
	}
	if metricsLn != nil {
		msrv := &http.Server{Handler: a.metrics.handler(), ReadHeaderTimeout: 5 * time.Second}
		servers = append(servers, msrv)
		// Exits when msrv is shut down below.
		wg.Go(func() { msrv.Serve(metricsLn) })
	}

	sdNotify("READY=1")
	<-stopCtx.Done()
	sdNotify("STOPPING=1")
	a.log.Info("stopping")
	shutCtx, done := context.WithTimeout(context.Background(), 5*time.Second)
	for _, s := range servers {
		s.Shutdown(shutCtx)
	}
	done()
	cancel()
	wg.Wait()
	a.mu.Lock()
	a.running = false
	a.mu.Unlock()
	a.stopAll()
	detach := cfg.XDP.DetachOnStop || a.detachOnStop.Load()
	if err := x.stop(detach); err != nil {
		return fmt.Errorf("run: stop: %w", err)
	}
	switch {
	case x.prog == nil:
		a.log.Info("stopped: proxies closed")
	case detach || x.pinPath == "":
		a.log.Info("stopped: proxies closed, XDP program detached")
	default:
		a.log.Info("stopped: proxies closed; the XDP program stays attached and balancing, pinned for the next run (weir stop --detach, or xdp.detach_on_stop: true, removes it)", "pin_path", x.pinPath)
	}
	return nil
}

// Stop ends Run as a signal would; with detach the XDP program is detached and its
// pins removed whatever xdp.detach_on_stop says.
func (a *Agent) Stop(detach bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.running || a.stopRun == nil {
		return ErrNotRunning
	}
	if detach {
		a.detachOnStop.Store(true)
	}
	a.log.Info("stop requested through the admin API", "detach", detach)
	a.stopRun()
	return nil
}

// stopAll stops every proxy, including those still draining after a reload, and
// waits for them.
func (a *Agent) stopAll() {
	a.mu.Lock()
	svcs := a.services
	a.services = nil
	a.mu.Unlock()
	for _, s := range svcs {
		if s.stopProxy != nil {
			s.stopProxy()
		}
	}
	for _, s := range svcs {
		s.stop()
	}
	a.retiring.Wait()
}

// stop ends the service's proxy, if it has one, and waits for its Serve to return.
func (s *service) stop() {
	if s.stopProxy != nil {
		s.stopProxy()
		<-s.proxyDone
		s.stopProxy = nil
	}
}

func newLogger(c config.Log, w io.Writer) *slog.Logger {
	if w == nil {
		w = os.Stderr
	}
	var level slog.Level
	level.UnmarshalText([]byte(c.Level))
	opts := &slog.HandlerOptions{Level: level}
	if c.Format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// Reload reads the config file again and applies it, or, if it is invalid or can't
// be applied, leaves the running one in force and returns why.
func (a *Agent) Reload(ctx context.Context) error {
	start := time.Now()
	cfg, err := config.Load(a.opts.ConfigPath)
	a.mu.Lock()
	defer a.mu.Unlock()
	if err == nil && !a.running {
		err = fmt.Errorf("reload: %w", ErrNotRunning)
	}
	if err == nil {
		err = restartOnly(a.cfg, cfg)
	}
	if err == nil {
		err = a.apply(cfg)
	}
	st := ReloadStatus{Time: start, OK: err == nil}
	if err != nil {
		st.Errors = errorLines(err)
		a.log.Error("reload rejected: the running config stays in force", "config", a.opts.ConfigPath, "errors", len(st.Errors))
		for _, e := range st.Errors {
			a.log.Error("reload: " + e)
		}
		a.metrics.reloads.WithLabelValues("error").Inc()
	} else {
		a.cfg = cfg
		a.log.Info("reloaded", "config", a.opts.ConfigPath, "services", len(cfg.Services), "took", time.Since(start))
		a.metrics.reloads.WithLabelValues("ok").Inc()
	}
	a.reloads = append(a.reloads, st)
	if len(a.reloads) > maxReloads {
		a.reloads = a.reloads[1:]
	}
	return err
}

func errorLines(err error) []string {
	var es config.Errors
	if errors.As(err, &es) {
		out := make([]string, len(es))
		for i, e := range es {
			out[i] = e.Error()
		}
		return out
	}
	return []string{err.Error()}
}

// restartOnly rejects changes a reload cannot apply.
func restartOnly(old, next *config.Config) error {
	var errs []error
	if !slices.Equal(old.Interfaces, next.Interfaces) {
		errs = append(errs, errors.New("interfaces: changed; restart weir to apply"))
	}
	if !old.XDP.Equal(next.XDP) {
		errs = append(errs, errors.New("xdp: changed; restart weir to apply"))
	}
	if old.Admin != next.Admin || old.Metrics != next.Metrics || old.Log != next.Log {
		errs = append(errs, errors.New("admin, metrics or log: changed; restart weir to apply"))
	}
	if !slices.Equal(old.Addrs, next.Addrs) {
		errs = append(errs, errors.New("addresses: changed; restart weir to apply"))
	}
	return errors.Join(errs...)
}

// apply makes the running services those of next. Everything that can be checked
// without touching a data plane is checked first (data plane choice, proxy
// listeners); if a data-plane write then fails, what this call changed is undone.
// Called with a.mu held.
func (a *Agent) apply(next *config.Config) (err error) {
	old := make(map[string]*service, len(a.services))
	for _, s := range a.services {
		old[s.cfg.Name] = s
	}
	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()

	type step struct {
		s, prev *service // prev: the running service it replaces or updates
		update  bool
	}
	var steps []step
	var errs []error
	for i := range next.Services {
		cs := next.Services[i]
		prev := old[cs.Name]
		if prev != nil && !needsNew(&prev.cfg, &cs) {
			steps = append(steps, step{s: prev, prev: prev, update: true})
			continue
		}
		plane, why, err := decide(a.xdp, &cs)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		s := &service{cfg: cs, plane: plane, why: why, key: serviceKey(&cs),
			log: a.log.With("service", cs.Name)}
		if plane == PlaneProxy {
			px, err := proxy.Listen(context.Background(), proxyConfig(&cs, observer{a.checker, cs.Name}, s.log))
			if err != nil {
				errs = append(errs, err) // names the service
				continue
			}
			s.px = px
			undo = append(undo, func() { px.Close() })
		}
		steps = append(steps, step{s: s, prev: prev})
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}

	// Health first, so new backends start from the checker's initial verdict.
	keep := make(map[string]bool)
	for i := range next.Services {
		cs := &next.Services[i]
		keep[cs.Name] = true
		if err := a.checker.SetService(cs.Name, healthConfig(cs)); err != nil {
			return fmt.Errorf("service %q: health: %w", cs.Name, err)
		}
	}

	var nextServices []*service
	for i, st := range steps {
		cs := next.Services[i]
		s := st.s
		prevCfg, prevBackends, prevLeaving := s.cfg, s.backends, s.leaving
		if st.update {
			s.cfg = cs
		}
		s.backends = a.backendsFor(&cs, prevBackends, st.prev)
		adopt := !st.update && st.prev != nil && st.prev.plane == PlaneXDP && st.prev.installed &&
			s.plane == PlaneXDP && st.prev.key == s.key
		if adopt {
			s.installed = true // the replaced service's entry is updated in place
			s.leaving = st.prev.leaving
			undo = append(undo, func() { st.prev.push(a.xdp) })
		}
		// Backends the reload removes drain in the program instead of losing their
		// flows at once.
		if s.plane == PlaneXDP && (st.update || adopt) {
			before := prevBackends
			if adopt {
				before = st.prev.backends
			}
			s.leave(before, time.Now())
		}
		if err := s.push(a.xdp); err != nil {
			if st.update {
				s.cfg, s.backends, s.leaving = prevCfg, prevBackends, prevLeaving
			}
			return fmt.Errorf("service %q: %w", cs.Name, err)
		}
		if st.update {
			undo = append(undo, func() { s.cfg, s.backends, s.leaving = prevCfg, prevBackends, prevLeaving; s.push(a.xdp) })
		} else if s.plane == PlaneXDP && !adopt {
			undo = append(undo, func() { a.xdp.prog.DeleteService(s.key) })
		}
		nextServices = append(nextServices, s)
	}

	// Committed: nothing below fails the reload.
	for _, st := range steps {
		s := st.s
		if s.px != nil && s.stopProxy == nil {
			ctx, cancel := context.WithCancel(context.Background())
			s.stopProxy, s.proxyDone = cancel, make(chan struct{})
			px, done := s.px, s.proxyDone
			// Exits when stopProxy is called (service removed or replaced, or the agent stops).
			go func() {
				defer close(done)
				if err := px.Serve(ctx); err != nil {
					s.log.Error("proxy stopped", "err", err)
				}
			}()
		}
		if st.prev != nil && st.prev != s {
			a.retire(st.prev, s)
		}
		// Health registrations of the service's current backends.
		for _, b := range s.backends {
			a.checker.Set(health.Backend{ID: b.id, Service: s.cfg.Name, Addr: b.cfg.CheckAddr.String(), Initial: initialState(b.cfg.Initial)})
		}
		if st.prev != nil {
			for _, b := range st.prev.backends {
				if s.backend(b.cfg.Addr) == nil {
					a.checker.Remove(b.id)
				}
			}
		}
		s.log.Info("service applied", "data_plane", s.plane, "why", s.why, "key", s.key.String(), "backends", len(s.backends))
	}
	for name, s := range old {
		if !keep[name] {
			a.retire(s, nil)
			a.checker.RemoveService(name)
			s.log.Info("service removed")
		}
	}
	a.services = nextServices
	return nil
}

// retire takes a replaced or removed service out of its data plane. A proxy drains
// in the background (its Serve grace); an XDP service is deleted unless its
// replacement holds the same key.
func (a *Agent) retire(s, by *service) {
	if s.plane == PlaneXDP && s.installed && (by == nil || by.plane != PlaneXDP || by.key != s.key) {
		if err := a.xdp.prog.DeleteService(s.key); err != nil {
			s.log.Error("remove from xdp", "err", err)
		}
	}
	if s.stopProxy != nil {
		// Exits when the old proxy has finished its connections (up to its shutdown
		// grace); Run waits for it before returning.
		a.retiring.Go(s.stop)
	}
}

// needsNew says whether a changed service must be built anew rather than updated in
// place: a different VIP or protocol, data plane request, mode, or any proxy setting
// (fixed when the proxy listens).
func needsNew(a, b *config.Service) bool {
	return a.VIPAddr != b.VIPAddr || a.Protocol != b.Protocol || a.DataPlane != b.DataPlane || a.Mode != b.Mode ||
		a.Algorithm != b.Algorithm || a.Proxy.ListenAddr != b.Proxy.ListenAddr ||
		a.Proxy.ConnectTimeout != b.Proxy.ConnectTimeout || a.Proxy.IdleTimeout != b.Proxy.IdleTimeout ||
		*a.Proxy.Retries != *b.Proxy.Retries || a.Proxy.MaxConns != b.Proxy.MaxConns ||
		a.Proxy.MaxConnsPerBackend != b.Proxy.MaxConnsPerBackend || a.Proxy.ProxyProtocol != b.Proxy.ProxyProtocol ||
		*a.DrainTimeout != *b.DrainTimeout
}

// backendsFor builds a service's backend list from its config, carrying over the
// state (health, runtime overrides, MAC) of backends that stay.
func (a *Agent) backendsFor(cs *config.Service, prev []*backend, prevSvc *service) []*backend {
	byAddr := make(map[string]*backend, len(prev))
	for _, b := range prev {
		byAddr[b.cfg.Addr.String()] = b
	}
	if prevSvc != nil && len(prev) == 0 {
		for _, b := range prevSvc.backends {
			byAddr[b.cfg.Addr.String()] = b
		}
	}
	out := make([]*backend, 0, len(cs.Backends))
	for _, cb := range cs.Backends {
		nb := &backend{cfg: cb, id: healthID(cs.Name, cb.Addr)}
		if old, ok := byAddr[cb.Addr.String()]; ok {
			nb.usable, nb.state, nb.kept = old.usable, old.state, old.kept
			nb.weightOverride, nb.drainOverride = old.weightOverride, old.drainOverride
			nb.mac, nb.macErr = old.mac, old.macErr
		} else {
			hc := healthConfig(cs)
			nb.state = hc.Check.Initial
			nb.usable = hc.Check.Initial == health.Up || hc.Check.Kind == health.None
			nb.kept = nb.usable
		}
		if st, ok := a.checker.Status(nb.id); ok {
			nb.usable, nb.state = st.Usable, st.State
		}
		if cs.Mode == config.ModeDSR {
			a.resolve(nb)
		}
		out = append(out, nb)
	}
	return out
}

// resolve fills in a dsr backend's MAC: from the config, or the neighbour table.
func (a *Agent) resolve(b *backend) {
	if b.cfg.MAC != "" {
		b.mac, _ = net.ParseMAC(b.cfg.MAC)
		b.macErr = ""
		return
	}
	if a.xdp == nil || a.xdp.prog == nil {
		return
	}
	mac, err := resolveMAC(b.cfg.Addr.Addr(), a.xdp.links)
	if err != nil {
		if m, ok := a.xdp.adoptedMACs[b.cfg.Addr.Addr()]; ok && b.mac == nil {
			// Keep what the previous run used until the neighbour table answers.
			b.mac, b.macErr = m, ""
			return
		}
		if b.mac == nil {
			b.macErr = err.Error()
		}
		return
	}
	b.mac, b.macErr = mac, ""
}

// retryMACs resolves, every second, the MACs of dsr backends that have none yet,
// ends the drain of removed backends whose time is up, and brings their services
// up to date.
func (a *Agent) retryMACs(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		a.mu.Lock()
		for _, s := range a.services {
			if s.plane != PlaneXDP {
				continue
			}
			// Removed backends whose drain time is up leave the program now.
			changed := s.expireLeaving(time.Now())
			for _, b := range s.backends {
				if b.mac == nil {
					a.resolve(b)
					if b.mac != nil {
						changed = true
						s.log.Info("backend mac resolved", "backend", b.cfg.Address, "mac", b.mac.String())
					}
				}
			}
			if changed {
				if err := s.push(a.xdp); err != nil {
					s.log.Error("apply resolved macs", "err", err)
				}
			}
		}
		a.mu.Unlock()
	}
}

// onHealth applies one health change to the data plane of its service.
func (a *Agent) onHealth(ch health.Change) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, s := range a.services {
		if s.cfg.Name != ch.Service {
			continue
		}
		for _, b := range s.backends {
			if b.id != ch.ID {
				continue
			}
			if b.usable == ch.Usable && b.state == ch.To {
				return
			}
			b.usable, b.state = ch.Usable, ch.To
			wasDown := s.allDown
			err := s.push(a.xdp)
			s.log.Info("backend health", "backend", b.cfg.Address, "state", ch.To.String(), "usable", ch.Usable, "reason", ch.Reason)
			if err != nil {
				s.log.Error("apply health change", "backend", b.cfg.Address, "err", err)
			}
			if s.allDown != wasDown {
				s.log.Warn("service usable backends changed", "all_down", s.allDown, "note", s.note)
			}
			return
		}
	}
}

// SetDrain drains a backend (no new flows or connections; established ones stay) or
// ends its drain. The change lasts until undone or the agent restarts; reloads
// keep it.
func (a *Agent) SetDrain(serviceName, addr string, drain bool) error {
	return a.change(serviceName, addr, func(b *backend) func() {
		prev := b.drainOverride
		b.drainOverride = &drain
		return func() { b.drainOverride = prev }
	}, func(p *loader.Program, s *service, b *backend) error {
		return p.SetBackendDraining(s.key, b.cfg.Addr, b.drained())
	})
}

// SetWeight sets a backend's weight (0..65535) at runtime, with the same lifetime
// as SetDrain.
func (a *Agent) SetWeight(serviceName, addr string, weight uint32) error {
	if weight > config.MaxWeight {
		return fmt.Errorf("set weight: must be 0..%d, got %d", config.MaxWeight, weight)
	}
	return a.change(serviceName, addr, func(b *backend) func() {
		prev := b.weightOverride
		b.weightOverride = &weight
		return func() { b.weightOverride = prev }
	}, func(p *loader.Program, s *service, b *backend) error {
		return p.SetBackendWeight(s.key, b.cfg.Addr, b.weight())
	})
}

// ErrNotFound is returned for an unknown service or backend.
var ErrNotFound = errors.New("not found")

// change applies a runtime change to one backend: set changes the agent's record
// (and returns its undo); direct writes just that change to an installed XDP
// service, which moves only that backend's share of the lookup table. When the
// change makes the service's usable set change shape (all_down starts or ends),
// the whole service is pushed instead.
func (a *Agent) change(serviceName, addr string, set func(*backend) (undo func()), direct func(*loader.Program, *service, *backend) error) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.running {
		return ErrNotRunning
	}
	for _, s := range a.services {
		if s.cfg.Name != serviceName {
			continue
		}
		for _, b := range s.backends {
			if b.cfg.Address != addr && b.cfg.Addr.String() != addr {
				continue
			}
			undo := set(b)
			var err error
			if s.plane == PlaneXDP && s.installed {
				wasDown := s.allDown
				spec, install := s.xdpSpec()
				if s.allDown == wasDown && install && weightSum(spec) > 0 {
					err = direct(a.xdp.prog, s, b)
				} else {
					err = s.push(a.xdp)
				}
			} else {
				err = s.push(a.xdp)
			}
			if err != nil {
				undo()
				s.push(a.xdp)
				return err
			}
			s.log.Info("backend changed at runtime", "backend", b.cfg.Address, "weight", b.weight(), "drained", b.drained())
			return nil
		}
		return fmt.Errorf("service %q: backend %q: %w (see weir status)", serviceName, addr, ErrNotFound)
	}
	return fmt.Errorf("service %q: %w (see weir status)", serviceName, ErrNotFound)
}

// statsSnapshot reads the XDP counters, if any.
func (a *Agent) xdpStats() (loader.Stats, bool) {
	if a.xdp == nil || a.xdp.prog == nil {
		return loader.Stats{}, false
	}
	st, err := a.xdp.prog.Stats()
	return st, err == nil
}

// Explanation says where the XDP data plane sends a client's flow to a service.
type Explanation struct {
	Service string `json:"service"`
	Client  string `json:"client"`
	// New is the backend a new flow from the client would get now; "" if none is
	// in the lookup table (every backend down or drained).
	New string `json:"new"`
	// Tracked is the backend the connection table holds for this flow, if any, and
	// whether it may still carry it (if not, the flow's next packet is re-selected).
	Tracked       string `json:"tracked,omitempty"`
	TrackedUsable bool   `json:"tracked_usable,omitempty"`
	// HalfOpen: the flow has sent only its first packet so far; it moves to the
	// connection table with its client's next one.
	HalfOpen bool `json:"half_open,omitempty"`
	// NATPort is the flow's source port towards its backend (nat mode).
	NATPort uint16 `json:"nat_port,omitempty"`
}

// Explain answers "where does this client go" for an XDP service: the backend a
// new flow from client (ip:port) would get, and the one an existing flow is pinned
// to. The proxy picks per connection as they come, so it has nothing to explain.
func (a *Agent) Explain(serviceName, client string) (Explanation, error) {
	ap, err := netip.ParseAddrPort(client)
	if err != nil {
		return Explanation{}, fmt.Errorf("explain: client %q: want ip:port ([v6]:port for IPv6): %w", client, ErrBadRequest)
	}
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.running {
		return Explanation{}, ErrNotRunning
	}
	for _, s := range a.services {
		if s.cfg.Name != serviceName {
			continue
		}
		if s.plane != PlaneXDP {
			return Explanation{}, fmt.Errorf("explain: service %q is served by the %s, which picks a backend per connection as it comes: nothing to explain", serviceName, s.plane)
		}
		if ap.Addr().Is4() != s.key.VIP.Addr().Is4() {
			return Explanation{}, fmt.Errorf("explain: client %s: the VIP %s is of the other address family: %w", ap, s.key.VIP.Addr(), ErrBadRequest)
		}
		ex := Explanation{Service: serviceName, Client: ap.String()}
		if !s.installed {
			return ex, nil // all_down: pass: the host's stack gets the packets
		}
		le, err := a.xdp.prog.Explain(s.key, ap)
		if err != nil {
			return Explanation{}, fmt.Errorf("explain: %w", err)
		}
		if le.New.IsValid() {
			ex.New = le.New.String()
		}
		if le.Tracked.IsValid() {
			ex.Tracked, ex.TrackedUsable, ex.NATPort = le.Tracked.String(), le.TrackedUsable, le.NATPort
			ex.HalfOpen = le.HalfOpen
		}
		return ex, nil
	}
	return Explanation{}, fmt.Errorf("service %q: %w (see weir status)", serviceName, ErrNotFound)
}

// ErrBadRequest is returned for a malformed argument.
var ErrBadRequest = errors.New("bad request")
