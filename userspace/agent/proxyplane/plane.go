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
	"syscall"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/agent/served"
	"github.com/weir-lb/weir/userspace/config"
	"github.com/weir-lb/weir/userspace/proxy"
)

// Plane is the proxy data plane.
type Plane struct {
	checker *health.Checker
	log     *slog.Logger
	// Set serves Add, Update, SetBackend and Remove.
	served.Set[*proxy.Service]

	sockmap    *loader.SockMap                              // in-kernel forwarding, loaded for the first service that uses it
	sockmapErr error                                        // why it could not be loaded; then every service uses the copy path
	tally      served.Tally[*proxy.Service, proxy.Snapshot] // counters across listeners

	// Peer finds the running server of another plane (the http plane's)
	// that listens on an address: a service moved here on the same address
	// takes its listening sockets over. Set its Find before the first Add.
	Peer served.Peer[proxy.Sockets]
}

// New returns a proxy plane that reports what its connections see to checker.
func New(checker *health.Checker, log *slog.Logger) *Plane {
	p := &Plane{checker: checker, log: log}
	p.Set = served.Set[*proxy.Service]{Start: p.start, Push: func(px *proxy.Service, s *plan.Service) error {
		if err := push(px, s); err != nil {
			return fmt.Errorf("service %q: %w", s.Name(), err)
		}
		return nil
	}, Replace: p.replace, Listen: func(c *config.Service) netip.AddrPort { return c.Proxy.Listen },
		Drained: p.tally.Drained, Log: log, What: "proxy"}
	p.tally = served.Tally[*proxy.Service, proxy.Snapshot]{Set: &p.Set, Snap: (*proxy.Service).Snapshot, Merge: merge, Idle: idle}
	return p
}

// Snapshot returns the named service's connection counters. The connections
// that listeners it had before (replaced by a reload, or started anew after
// one failed) still serve as they drain are counted in its active ones, per
// backend too; what those listeners counted is counted on, so no counter goes
// back when a listener is replaced.
func (p *Plane) Snapshot(name string) (proxy.Snapshot, bool) { return p.tally.Snapshot(name) }

// Commit ends the change in progress (see served.Set.Commit); a removed
// service's counters go.
func (p *Plane) Commit() {
	p.Set.Commit()
	p.Peer.Commit()
	p.tally.Prune()
}

// Abort undoes the change in progress (see served.Set.Abort); a server of
// another plane whose sockets it took over gets its settings on them back.
func (p *Plane) Abort() {
	p.Set.Abort()
	p.Peer.Abort(p.log)
}

// idle clears a drained listener's active connections.
func idle(s *proxy.Snapshot) {
	s.Active = 0
	for i := range s.Backends {
		s.Backends[i].Active = 0
	}
}

// merge adds src's counters to dst's, and its active connections; a backend
// dst lacks is added only with add (a listener that still drains has
// connections to it).
func merge(dst *proxy.Snapshot, src proxy.Snapshot, add bool) {
	dst.Active += src.Active
	dst.Accepted += src.Accepted
	dst.Unserved += src.Unserved
	dst.AcceptErrors += src.AcceptErrors
	dst.ClientTimeouts += src.ClientTimeouts
	dst.BytesIn += src.BytesIn
	dst.BytesOut += src.BytesOut
	for _, ob := range src.Backends {
		b := served.Entry(&dst.Backends, func(b *proxy.BackendSnapshot) bool { return b.Addr == ob.Addr }, add,
			func() proxy.BackendSnapshot { return proxy.BackendSnapshot{Addr: ob.Addr} })
		if b == nil {
			continue
		}
		b.Active += ob.Active
		b.Connects += ob.Connects
		b.ConnectFailures += ob.ConnectFailures
		b.ConnectTime += ob.ConnectTime
		b.Resets += ob.Resets
		b.IdleTimeouts += ob.IdleTimeouts
		b.Ejections += ob.Ejections
		b.BytesIn += ob.BytesIn
		b.BytesOut += ob.BytesOut
	}
}

// start binds a service's listener and sets its backends; the set starts
// accepting.
func (p *Plane) start(s *plan.Service) (*proxy.Service, error) { return p.replace(nil, s) }

// replace is start for a service whose server old (nil: none) it replaces:
// where old, or else the other plane's server that Peer finds, listens on the
// same address, the new server takes its listening sockets over
// (proxy.ListenFrom).
func (p *Plane) replace(old *proxy.Service, s *plan.Service) (*proxy.Service, error) {
	log := p.log.With("service", s.Name())
	cfg := proxyConfig(&s.Config, observer{p.checker, s.Name()}, log)
	if useSockMap(s.Config.Proxy.SockMap) {
		if r := p.redirector(); r != nil {
			cfg.Redirector = r
		}
	}
	var from proxy.Sockets = old
	if old == nil {
		from, _ = p.Peer.Take(cfg.Listen)
	}
	px, err := proxy.ListenFrom(context.Background(), cfg, from)
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
	return px, nil
}

// Close stops every service, letting each drain up to its timeout, waits for all of
// them, and then unloads the sockmap they may have used.
func (p *Plane) Close() {
	p.Set.Close()
	if p.sockmap != nil {
		if err := p.sockmap.Close(); err != nil {
			p.log.Warn("close sockmap", "err", err)
		}
		p.sockmap = nil
	}
}

// autoSockMap is what sockmap: auto means: the copy and splice path measured faster
// than in-kernel forwarding on short connections, and in-kernel forwarding won only
// on bulk, on a quiet machine (docs/proxy.md); a service's workload is not known when
// it starts, so auto keeps the proxy's own path.
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

// push sets the proxy's backends to the desired ones, and its hash key (which a
// reload changes in place).
func push(px *proxy.Service, s *plan.Service) error {
	px.SetHashPort(s.Config.Hash == config.HashFiveTuple)
	bs := make([]proxy.Backend, 0, len(s.Backends))
	for _, b := range s.Backends {
		bs = append(bs, proxy.Backend{Addr: b.Config.Addr, Weight: max(b.Weight, 1), MaxConns: b.Config.MaxConns,
			SlowStart: s.Config.SlowStart, Down: !b.Usable, Ramp: b.Ramp})
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
		HashPort:           s.Hash == config.HashFiveTuple,
		ConnectTimeout:     px.ConnectTimeout,
		IdleTimeout:        px.IdleTimeout,
		Retries:            px.Retries,
		MaxConns:           px.MaxConns,
		MaxConnsPerBackend: px.MaxConnsPerBackend,
		ProxyProtocol:      px.ProxyProtocol,
		ClientKeepalive:    px.TCPKeepalive.Client.KeepAliveConfig(),
		BackendKeepalive:   px.TCPKeepalive.Backend.KeepAliveConfig(),
		ClientUserTimeout:  px.TCPUserTimeout.Client,
		BackendUserTimeout: px.TCPUserTimeout.Backend,
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
