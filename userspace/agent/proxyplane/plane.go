// Package proxyplane is the agent's proxy data plane: one userspace/proxy service
// (listener and splice loops) per service the planner places on the proxy, kept in
// step with the desired backends, and what the proxy sees of its connections fed to
// the health checker as passive signals.
//
// The agent's reconcile loop owns a Plane: Add, Update, SetBackend and Remove are
// called from that loop only. Snapshot may be called from any goroutine (status and
// metrics read it). A removed or replaced service drains in the background, up to
// its drain timeout; Close stops every service and waits for all of them.
package proxyplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
	"github.com/weir-lb/weir/userspace/proxy"
)

// Plane is the proxy data plane.
type Plane struct {
	checker  *health.Checker
	log      *slog.Logger
	services map[string]*service // by name (loop only)
	served   atomic.Pointer[map[string]*proxy.Service]
	retiring sync.WaitGroup // services removed or replaced, draining

	sockmap    *loader.SockMap // in-kernel forwarding, loaded for the first service that uses it
	sockmapErr error           // why it could not be loaded; then every service uses the copy path
}

// service is one running proxy service.
type service struct {
	cfg  config.Service
	px   *proxy.Service
	stop context.CancelFunc
	done chan struct{} // closed when Serve has returned
}

// New returns a proxy plane that reports what its connections see to checker.
func New(checker *health.Checker, log *slog.Logger) *Plane {
	p := &Plane{checker: checker, log: log, services: make(map[string]*service)}
	p.publish()
	return p
}

func (p *Plane) publish() {
	m := make(map[string]*proxy.Service, len(p.services))
	for name, s := range p.services {
		m[name] = s.px
	}
	p.served.Store(&m)
}

// Snapshot returns the named service's connection counters.
func (p *Plane) Snapshot(name string) (proxy.Snapshot, bool) {
	px, ok := (*p.served.Load())[name]
	if !ok {
		return proxy.Snapshot{}, false
	}
	return px.Snapshot(), true
}

// Add starts serving a service: it binds the listener, sets the backends and
// starts accepting.
func (p *Plane) Add(s *plan.Service) error {
	if _, ok := p.services[s.Name()]; ok {
		return p.Update(&plan.Service{Config: p.services[s.Name()].cfg}, s)
	}
	ps, err := p.start(s)
	if err != nil {
		return err
	}
	p.services[s.Name()] = ps
	p.publish()
	return nil
}

func (p *Plane) start(s *plan.Service) (*service, error) {
	log := p.log.With("service", s.Name())
	cfg := proxyConfig(&s.Config, observer{p.checker, s.Name()}, log)
	if useSockMap(s.Config.Proxy.SockMap) {
		if r := p.redirector(); r != nil {
			cfg.Redirector = r
		}
	}
	px, err := proxy.Listen(context.Background(), cfg)
	if errors.Is(err, syscall.EADDRNOTAVAIL) {
		return nil, fmt.Errorf("%w: the proxy binds %s, which no interface of this host holds (add it to one, or let XDP serve the service)", err, s.Config.Proxy.Listen.Addr())
	}
	if err != nil {
		return nil, err // names the service
	}
	if err := push(px, s); err != nil {
		px.Close()
		return nil, fmt.Errorf("service %q: %w", s.Name(), err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ps := &service{cfg: s.Config, px: px, stop: cancel, done: make(chan struct{})}
	// Exits when ps.stop is called (service removed or replaced, or the plane closes).
	go func() {
		defer close(ps.done)
		if err := px.Serve(ctx); err != nil {
			log.Error("proxy stopped", "err", err)
		}
	}()
	return ps, nil
}

// Update brings a service from prev to next: a new listener when a setting fixed at
// listen time changed (the old one drains), else new backends in place.
func (p *Plane) Update(prev, next *plan.Service) error {
	ps, ok := p.services[next.Name()]
	if !ok {
		return p.Add(next)
	}
	if !plan.Rebuilt(&ps.cfg, &next.Config) {
		if err := push(ps.px, next); err != nil {
			return fmt.Errorf("service %q: %w", next.Name(), err)
		}
		ps.cfg = next.Config
		return nil
	}
	fresh, err := p.start(next)
	if err != nil {
		return err
	}
	p.services[next.Name()] = fresh
	p.publish()
	p.retire(ps)
	return nil
}

// SetBackend applies one backend's change; the proxy takes the whole set at once.
func (p *Plane) SetBackend(prev, next *plan.Service, _ netip.AddrPort) error {
	return p.Update(prev, next)
}

// Remove stops accepting for a service; its connections drain in the background.
// Removing a service the plane does not serve is no error.
func (p *Plane) Remove(s *plan.Service) error {
	ps, ok := p.services[s.Name()]
	if !ok {
		return nil
	}
	delete(p.services, s.Name())
	p.publish()
	p.retire(ps)
	return nil
}

func (p *Plane) retire(ps *service) {
	ps.stop()
	// Exits when the old proxy has finished its connections (up to its drain
	// timeout); Close waits for it.
	p.retiring.Go(func() { <-ps.done })
}

// Close stops every service, letting each drain up to its timeout, and waits for
// all of them, including those retired before.
func (p *Plane) Close() {
	for _, ps := range p.services {
		ps.stop()
	}
	for _, ps := range p.services {
		<-ps.done
	}
	clear(p.services)
	p.publish()
	p.retiring.Wait()
	if p.sockmap != nil {
		if err := p.sockmap.Close(); err != nil {
			p.log.Warn("close sockmap", "err", err)
		}
		p.sockmap = nil
	}
}

// autoSockMap is what sockmap: auto means: the copy and splice path measured faster
// than in-kernel forwarding on every workload of bench/proxy (docs/proxy.md), so auto
// keeps the proxy's own path.
const autoSockMap = false

func useSockMap(m config.SockMap) bool {
	return m == config.SockMapOn || (m == config.SockMapAuto && autoSockMap)
}

// redirector returns the sockmap, loading it the first time. On a host that can't
// load it, it logs why once and returns nil: services then use the copy path.
func (p *Plane) redirector() proxy.Redirector {
	if p.sockmap == nil && p.sockmapErr == nil {
		p.sockmap, p.sockmapErr = loader.LoadSockMap()
		if p.sockmapErr != nil {
			p.log.Warn("in-kernel forwarding unavailable; the proxy copies and splices", "err", p.sockmapErr)
		}
	}
	if p.sockmap == nil {
		return nil
	}
	return p.sockmap
}

// push sets the proxy's backends to the desired ones.
func push(px *proxy.Service, s *plan.Service) error {
	bs := make([]proxy.Backend, 0, len(s.Backends))
	for _, b := range s.Backends {
		bs = append(bs, proxy.Backend{Addr: b.Config.Addr, Weight: max(b.Weight, 1), MaxConns: b.Config.MaxConns,
			SlowStart: s.Config.SlowStart, Down: !b.Usable})
	}
	if err := px.SetBackends(bs); err != nil {
		return err
	}
	var errs []error
	for _, b := range s.Backends {
		addr := b.Config.Addr
		errs = append(errs, px.SetBackendUsable(addr, b.Usable), px.SetDraining(addr, b.Drained || b.Weight == 0))
	}
	return errors.Join(errs...)
}

// proxyConfig translates a service's settings for the proxy.
func proxyConfig(s *config.Service, obs proxy.Observer, log *slog.Logger) proxy.Config {
	px := s.Proxy
	return proxy.Config{
		Name:               s.Name,
		Listen:             px.Listen,
		Algorithm:          string(s.Algorithm),
		ConnectTimeout:     px.ConnectTimeout,
		IdleTimeout:        px.IdleTimeout,
		Retries:            px.Retries,
		MaxConns:           px.MaxConns,
		MaxConnsPerBackend: px.MaxConnsPerBackend,
		ProxyProtocol:      px.ProxyProtocol,
		DrainTimeout:       s.DrainTimeout, // 0: no limit, in both
		// EjectAfter 0: the proxy ejects nothing itself; passive ejection is the
		// health checker's, configured by passive.
		Observer: obs,
		Logger:   log,
	}
}

// observer feeds what the proxy sees of its connections to the health checker.
type observer struct {
	checker *health.Checker
	service string
}

func (o observer) Observe(addr netip.AddrPort, out proxy.Outcome, _ time.Duration) {
	var ho health.Outcome
	switch out {
	case proxy.OutcomeSuccess, proxy.OutcomeIdleTimeout:
		ho = health.Success
	case proxy.OutcomeConnectFailed:
		ho = health.ConnectFailure
	case proxy.OutcomeConnectTimeout:
		ho = health.Timeout
	case proxy.OutcomeReset:
		ho = health.Reset
	default:
		return
	}
	o.checker.Observe(plan.ID(o.service, addr), ho)
}
