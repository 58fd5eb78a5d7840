package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/config"
	"github.com/weir-lb/weir/userspace/proxy"
)

// Data planes as status reports them.
const (
	PlaneXDP   = "xdp"
	PlaneProxy = "proxy"
	PlaneNone  = "none"
)

var zeroMAC = net.HardwareAddr{0, 0, 0, 0, 0, 0}

// service is one configured service as the agent runs it. Guarded by Agent.mu.
type service struct {
	cfg      config.Service
	plane    string
	why      string
	key      loader.ServiceKey
	backends []*backend
	log      *slog.Logger

	// xdp
	installed bool // in the loader (false while all_down: pass keeps it out)
	// proxy
	px        *proxy.Service
	stopProxy context.CancelFunc
	proxyDone chan struct{}

	allDown bool
	note    string // what all_down is doing, or the last error applying the service

	// leaving are backends a reload removed from an XDP service: they stay in the
	// program as draining (no new flows, their established flows continue) until
	// their time is up. The proxy drains removed backends itself.
	leaving []leavingBackend
}

type leavingBackend struct {
	b     *backend
	until time.Time
}

// backend is one backend of a service. Guarded by Agent.mu.
type backend struct {
	cfg    config.Backend
	id     string // health checker ID: "service/address"
	usable bool   // per health
	state  health.State

	weightOverride *uint32 // set through the admin API; survives reloads
	drainOverride  *bool

	mac    net.HardwareAddr // dsr: resolved or configured; nil when unknown
	macErr string
	kept   bool // last pushed as usable (for all_down: keep_last)
}

func (b *backend) weight() uint32 {
	if b.weightOverride != nil {
		return *b.weightOverride
	}
	return uint32(*b.cfg.Weight)
}

func (b *backend) drained() bool {
	if b.drainOverride != nil {
		return *b.drainOverride
	}
	return b.cfg.Drain
}

func (s *service) backend(addr netip.AddrPort) *backend {
	for _, b := range s.backends {
		if b.cfg.Addr == addr {
			return b
		}
	}
	return nil
}

func healthID(service string, addr netip.AddrPort) string { return service + "/" + addr.String() }

func serviceKey(s *config.Service) loader.ServiceKey {
	proto := loader.TCP
	if s.Protocol == "udp" {
		proto = loader.UDP
	}
	return loader.ServiceKey{VIP: s.VIPAddr, Protocol: proto}
}

// healthConfig translates a service's settings for the health checker.
func healthConfig(s *config.Service) health.Config {
	h := s.Health
	hc := health.Config{
		Check: health.Check{
			Kind:     health.Kind(h.Type),
			Interval: h.Interval.D(),
			Timeout:  h.Timeout.D(),
			Rise:     *h.Rise,
			Fall:     *h.Fall,
			Jitter:   *h.Jitter,
			HTTP:     health.HTTPCheck{Path: h.Path, Host: h.Host, Body: h.ExpectBody},
		},
		Outlier: health.Outlier{
			Consecutive:        *s.Passive.Consecutive,
			BaseEjection:       s.Passive.BaseEjection.D(),
			MaxEjection:        s.Passive.MaxEjection.D(),
			MaxEjectionPercent: *s.Passive.MaxEjectionPercent,
		},
		PanicThreshold: *s.PanicThreshold,
	}
	if hc.Check.Jitter == 0 {
		hc.Check.Jitter = -1 // health's 0 means its default; the config's 0 means off
	}
	if hc.Outlier.Consecutive == 0 {
		hc.Outlier.Consecutive = -1
	}
	if hc.PanicThreshold == 0 {
		hc.PanicThreshold = -1
	}
	for _, r := range h.Status {
		hc.Check.HTTP.Status = append(hc.Check.HTTP.Status, health.StatusRange{Min: r.Min, Max: r.Max})
	}
	switch h.Initial {
	case "up":
		hc.Check.Initial = health.Up
	case "down":
		hc.Check.Initial = health.Down
	}
	return hc
}

// initialState is a backend's own initial health state, nil to take its service's.
func initialState(s string) *health.State {
	var st health.State
	switch s {
	case "up":
		st = health.Up
	case "down":
		st = health.Down
	case "unknown":
		st = health.Unknown
	default:
		return nil
	}
	return &st
}

// decide picks the data plane of a service: see config.DataPlaneAuto.
func decide(x *xdpPlane, s *config.Service) (plane, why string, err error) {
	if s.DataPlane == config.DataPlaneProxy {
		return PlaneProxy, "data_plane: proxy", nil
	}
	xerr := x.canServe(s)
	switch {
	case xerr == nil:
		return PlaneXDP, fmt.Sprintf("XDP %s mode, self-test passed", s.Mode), nil
	case s.DataPlane == config.DataPlaneXDP:
		return "", "", fmt.Errorf("service %q: data_plane xdp: %w", s.Name, xerr)
	case s.Protocol == "udp":
		return "", "", fmt.Errorf("service %q: udp is served by XDP only: %w", s.Name, xerr)
	}
	return PlaneProxy, "proxy, because " + xerr.Error(), nil
}

// usableSet applies all_down to the health verdicts: which backends the data plane
// is told are usable. Called with Agent.mu held.
func (s *service) usableSet(xdp bool) map[*backend]bool {
	// Draining is not being down: a drained backend keeps its established flows
	// whatever all_down says, and a service whose every backend is drained takes no
	// new flows but keeps serving the ones it has.
	needMAC := xdp && s.cfg.Mode == config.ModeDSR
	u := make(map[*backend]bool, len(s.backends))
	some, undrained := false, false
	for _, b := range s.backends {
		u[b] = b.usable && (!needMAC || b.mac != nil)
		if u[b] && b.weight() > 0 {
			some = true
			undrained = undrained || !b.drained()
		}
	}
	s.allDown = !some
	s.note = ""
	if some && !undrained {
		s.note = "every usable backend is drained: new flows are refused, established ones continue"
	}
	if !some {
		switch s.cfg.AllDown {
		case config.AllDownKeepLast:
			kept := false
			for _, b := range s.backends {
				if b.kept && (!needMAC || b.mac != nil) {
					u[b], kept = true, true
				}
			}
			s.note = "every backend is down: keeping the last usable ones (all_down: keep_last)"
			if !kept {
				s.note = "every backend is down and none was ever usable: dropping (all_down: keep_last)"
			}
			return u
		case config.AllDownPass:
			if xdp {
				s.note = "every backend is down: packets pass to the host's stack (all_down: pass)"
			} else {
				s.note = "every backend is down: the proxy closes new connections (all_down: pass is XDP only)"
			}
		default:
			s.note = "every backend is down: new flows are dropped (all_down: drop)"
		}
		return u
	}
	for _, b := range s.backends {
		b.kept = u[b] && b.weight() > 0
	}
	return u
}

// leave records backends that were in before and are not in s.backends now as
// draining until now + drain_timeout (0, "no limit", keeps them for the program's
// established-TCP idle timeout, after which their flows are forgotten anyway), and
// keeps earlier leavers whose time is not up and that did not come back.
func (s *service) leave(before []*backend, now time.Time) {
	d := s.cfg.DrainTimeout.D()
	if d == 0 {
		d = 15 * time.Minute
	}
	var next []leavingBackend
	for _, l := range s.leaving {
		if now.Before(l.until) && s.backend(l.b.cfg.Addr) == nil {
			next = append(next, l)
		}
	}
	for _, b := range before {
		if s.backend(b.cfg.Addr) == nil {
			next = append(next, leavingBackend{b: b, until: now.Add(d)})
		}
	}
	s.leaving = next
}

// expireLeaving drops the leavers whose time is up and reports whether any went.
func (s *service) expireLeaving(now time.Time) bool {
	kept := s.leaving[:0]
	for _, l := range s.leaving {
		if now.Before(l.until) {
			kept = append(kept, l)
		}
	}
	gone := len(kept) != len(s.leaving)
	s.leaving = kept
	return gone
}

// xdpSpec is the loader's view of the service now.
func (s *service) xdpSpec() (loader.Service, bool) {
	u := s.usableSet(true)
	spec := loader.Service{Key: s.key, Forwarding: forwarding(s.cfg.Mode), SourceHash: s.cfg.Hash == config.HashSource,
		TableSize: s.cfg.TableSize}
	for _, b := range s.backends {
		lb := loader.Backend{Addr: b.cfg.Addr, Weight: b.weight(), Usable: u[b], Draining: b.drained()}
		if spec.Forwarding == loader.ForwardDSR {
			lb.MAC = b.mac
			if lb.MAC == nil {
				lb.MAC = zeroMAC // unusable until resolved
			}
		}
		spec.Backends = append(spec.Backends, lb)
	}
	for _, l := range s.leaving {
		lb := loader.Backend{Addr: l.b.cfg.Addr, Usable: l.b.usable, Draining: true}
		if spec.Forwarding == loader.ForwardDSR {
			lb.MAC = l.b.mac
			if lb.MAC == nil {
				lb.MAC = zeroMAC
			}
		}
		spec.Backends = append(spec.Backends, lb)
	}
	pass := s.allDown && s.cfg.AllDown == config.AllDownPass
	return spec, !pass
}

func weightSum(spec loader.Service) uint64 {
	sum := uint64(0)
	for _, b := range spec.Backends {
		sum += uint64(b.Weight)
	}
	return sum
}

// push brings the service's data plane in line with its backends' state.
func (s *service) push(x *xdpPlane) error {
	switch s.plane {
	case PlaneXDP:
		spec, install := s.xdpSpec()
		if weightSum(spec) == 0 {
			return fmt.Errorf("service %q: every backend has weight 0: give one a weight first", s.cfg.Name)
		}
		switch {
		case !install && s.installed:
			if err := x.prog.DeleteService(s.key); err != nil {
				return err
			}
			s.installed = false
		case !install:
		case s.installed:
			return x.prog.UpdateService(spec)
		default:
			// SetService: after a restart the pinned program may have it already.
			if err := x.prog.SetService(spec); err != nil {
				return err
			}
			s.installed = true
		}
		return nil
	case PlaneProxy:
		u := s.usableSet(false)
		bs := make([]proxy.Backend, 0, len(s.backends))
		for _, b := range s.backends {
			bs = append(bs, proxy.Backend{Addr: b.cfg.Addr.String(), Weight: max(b.weight(), 1), MaxConns: b.cfg.MaxConns,
				SlowStart: s.cfg.SlowStart.D(), Down: !u[b]})
		}
		if err := s.px.SetBackends(bs); err != nil {
			return err
		}
		var errs []error
		for _, b := range s.backends {
			addr := b.cfg.Addr.String()
			errs = append(errs, s.px.SetBackendUsable(addr, u[b]), s.px.SetDraining(addr, b.drained() || b.weight() == 0))
		}
		return errors.Join(errs...)
	}
	return nil
}

// proxyConfig translates a service's settings for the proxy.
func proxyConfig(s *config.Service, obs proxy.Observer, log *slog.Logger) proxy.Config {
	px := s.Proxy
	drain := s.DrainTimeout.D()
	if drain == 0 {
		drain = -1 // the config's 0 means no limit
	}
	return proxy.Config{
		Name:               s.Name,
		Listen:             px.ListenAddr.String(),
		Algorithm:          s.Algorithm,
		ConnectTimeout:     px.ConnectTimeout.D(),
		IdleTimeout:        px.IdleTimeout.D(),
		Retries:            *px.Retries,
		MaxConns:           px.MaxConns,
		MaxConnsPerBackend: px.MaxConnsPerBackend,
		ProxyProtocol:      px.ProxyProtocol,
		DrainTimeout:       drain,
		EjectAfter:         -1, // passive ejection is the health checker's, configured by passive
		Observer:           obs,
		Logger:             log,
	}
}

// observer feeds what the proxy sees of its connections to the health checker.
type observer struct {
	checker *health.Checker
	service string
}

func (o observer) Observe(addr string, out proxy.Outcome, _ time.Duration) {
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
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return
	}
	o.checker.Observe(healthID(o.service, ap), ho)
}
