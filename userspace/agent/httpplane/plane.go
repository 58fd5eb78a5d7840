// Package httpplane is the agent's http data plane: one userspace/httplb service
// (listener, HTTP/1.1, HTTP/2 and gRPC termination, per-request balancing) per
// service the config gives data_plane http, kept in step with the desired
// backends, and what its requests see of each backend fed to the health checker
// as passive signals.
//
// The agent's reconcile loop owns a Plane: Add, Update, SetBackend and Remove are
// called from that loop only. Snapshot may be called from any goroutine. A
// removed or replaced service shuts down gracefully in the background (GOAWAY,
// in-flight requests finish, up to its drain timeout); Close stops every service
// and waits for all of them.
package httpplane

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/agent/served"
	"github.com/weir-lb/weir/userspace/config"
	"github.com/weir-lb/weir/userspace/httplb"
)

// RequestObserver is told of every finished request (the agent's metrics).
type RequestObserver func(service, backend string, status int, d time.Duration)

// Plane is the http data plane.
type Plane struct {
	checker *health.Checker
	log     *slog.Logger
	observe RequestObserver
	// Set serves Add, Update, SetBackend, Remove and Close.
	served.Set[*httplb.Service]

	// certs are the certificates the services' newest servers hand out, by
	// service name (loop only). Each server reads the pointer it started
	// with, which never holds nil: one replaced keeps handing out its own
	// certificate as it drains, not that of the name's new server, which may
	// listen elsewhere (two services swapped their names).
	certs map[string]*atomic.Pointer[loadedCert]
	// certsBefore is what the change in progress replaced in certs, until
	// Commit or Abort.
	certsBefore map[string]heldCert
	tally       served.Tally[*httplb.Service, httplb.Snapshot] // counters across servers

	// Peer finds the running server of another plane (the proxy's) that
	// listens on an address: a service moved here on the same address takes
	// its listening sockets over. Set its Find before the first Add.
	Peer served.Peer[httplb.Sockets]
}

// New returns an http plane that reports what its requests see to checker, and
// every finished request to observe (nil: nobody).
func New(checker *health.Checker, log *slog.Logger, observe RequestObserver) *Plane {
	p := &Plane{checker: checker, log: log, observe: observe,
		certs: map[string]*atomic.Pointer[loadedCert]{}, certsBefore: map[string]heldCert{}}
	p.Set = served.Set[*httplb.Service]{Start: p.start, Push: func(lb *httplb.Service, s *plan.Service) error {
		return lb.Reconfigure(p.lbConfig(&s.Config), backends(s))
	}, Replace: p.replace, Listen: func(c *config.Service) netip.AddrPort { return c.HTTP.Listen },
		Rebuilt: rebuilt, Drained: p.tally.Drained, Log: log, What: "http plane"}
	p.tally = served.Tally[*httplb.Service, httplb.Snapshot]{Set: &p.Set, Snap: (*httplb.Service).Snapshot, Merge: merge, Idle: idle}
	return p
}

// ReadCertificates reads the certificate and key files of every TLS service of d
// the plane serves now, so a reload serves renewed files at the same paths (a
// new or rebuilt service reads its own when it starts). If a pair does not
// load, it changes nothing and says which; else the certificates read from
// the paths a service's server has are served at once, and Abort puts the
// ones before back. Files at other paths are the new server's, which the
// change starts: the running one hands out its own until it retires.
func (p *Plane) ReadCertificates(d plan.Desired) error {
	read, err := readCerts(d, func(name string) bool { return p.certs[name] != nil })
	if err != nil {
		return err
	}
	for name, cert := range read {
		if ptr := p.certs[name]; ptr.Load().sameFiles(cert) {
			p.holdCert(name)
			ptr.Store(cert)
		}
	}
	return nil
}

// CheckCertificates reads the certificate and key files of every TLS service of
// d, served now or not, as applying d would (ReadCertificates, and a new or
// rebuilt service as it starts), and changes nothing: a pair that does not load
// is what weir plan reports that a reload would be refused for.
func CheckCertificates(d plan.Desired) error {
	_, err := readCerts(d, func(string) bool { return true })
	return err
}

// readCerts reads the pairs of d's TLS services that want names, and says
// which do not load.
func readCerts(d plan.Desired, want func(name string) bool) (map[string]*loadedCert, error) {
	read := map[string]*loadedCert{}
	var errs []error
	for i := range d.Services {
		s := &d.Services[i]
		if s.Plane != plan.HTTP || s.Config.HTTP.TLSCert == "" || !want(s.Name()) {
			continue
		}
		cert, err := readCert(s)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		read[s.Name()] = cert
	}
	return read, errors.Join(errs...)
}

// CertError is a service's certificate and key files that do not load.
type CertError struct {
	Service   string
	Cert, Key string
	Err       error
}

func (e *CertError) Error() string {
	return fmt.Sprintf("service %q: http.tls: cert %s and key %s do not load: %v", e.Service, e.Cert, e.Key, e.Err)
}

func (e *CertError) Unwrap() error { return e.Err }

// loadedCert is a certificate and the files it was read from.
type loadedCert struct {
	tls.Certificate
	certFile, keyFile string
}

// sameFiles reports whether c and o were read from the same files.
func (c *loadedCert) sameFiles(o *loadedCert) bool {
	return c.certFile == o.certFile && c.keyFile == o.keyFile
}

// heldCert is a service's certificate pointer (nil: none) and the
// certificate it held as a change found them.
type heldCert struct {
	ptr  *atomic.Pointer[loadedCert]
	cert *loadedCert
}

// readCert reads s's certificate and key files.
func readCert(s *plan.Service) (*loadedCert, error) {
	h := s.Config.HTTP
	cert, err := tls.LoadX509KeyPair(h.TLSCert, h.TLSKey)
	if err != nil {
		return nil, &CertError{Service: s.Name(), Cert: h.TLSCert, Key: h.TLSKey, Err: err}
	}
	return &loadedCert{Certificate: cert, certFile: h.TLSCert, keyFile: h.TLSKey}, nil
}

// startCert is the certificate a server of s starts with: its files read
// anew, or, where they do not load, the one last read from the same files,
// which the service's servers hand out now. A server started anew (after its
// server stopped on its own) keeps serving while the files are gone or being
// rewritten; a reload that reads them (ReadCertificates) is still refused
// while they do not load, and a new service, or new paths, have no
// certificate to go on with.
func (p *Plane) startCert(s *plan.Service) (*loadedCert, error) {
	c, err := readCert(s)
	if err == nil {
		return c, nil
	}
	var last *loadedCert
	if ptr := p.certs[s.Name()]; ptr != nil {
		last = ptr.Load()
	}
	h := s.Config.HTTP
	if last == nil || last.certFile != h.TLSCert || last.keyFile != h.TLSKey {
		return nil, err
	}
	p.log.Warn("http plane: certificate files do not load; serving the certificate last read from them",
		"service", s.Name(), "cert", h.TLSCert, "key", h.TLSKey, "err", err)
	return last, nil
}

// holdCert remembers the named service's certificate before the change in
// progress first touches it.
func (p *Plane) holdCert(name string) {
	if _, ok := p.certsBefore[name]; ok {
		return
	}
	h := heldCert{ptr: p.certs[name]}
	if h.ptr != nil {
		h.cert = h.ptr.Load()
	}
	p.certsBefore[name] = h
}

// Commit ends the change in progress (see served.Set.Commit): the certificates
// it read stay.
func (p *Plane) Commit() {
	p.Set.Commit()
	p.Peer.Commit()
	clear(p.certsBefore)
	for name := range p.certs {
		if _, ok := p.Get(name); !ok {
			delete(p.certs, name)
		}
	}
	p.tally.Prune()
}

// Revive starts anew the servers that stopped on their own (see
// served.Set.Revive). It is no change: the certificates they read as they
// start are the ones served, which no later Abort puts back.
func (p *Plane) Revive(find func(name string) *plan.Service) time.Duration {
	next := p.Set.Revive(find)
	clear(p.certsBefore)
	return next
}

// Abort undoes the change in progress (see served.Set.Abort), the certificates
// it read too; a server of another plane whose sockets it took over gets its
// settings on them back.
func (p *Plane) Abort() {
	for name, h := range p.certsBefore {
		// A server the change started keeps its own pointer, and hands
		// out what it holds to the connections it accepted as it drains
		// them.
		if h.ptr == nil {
			delete(p.certs, name)
			continue
		}
		h.ptr.Store(h.cert)
		p.certs[name] = h.ptr
	}
	clear(p.certsBefore)
	p.Set.Abort()
	p.Peer.Abort(p.log)
}

// Snapshot returns the named service's counters. The client connections and
// requests that servers it had before (replaced by a reload, or started anew
// after one stopped on its own) still serve as they drain are counted in its
// open ones, per backend too; what those servers counted is counted on, so no
// counter goes back when a server is replaced.
func (p *Plane) Snapshot(name string) (httplb.Snapshot, bool) { return p.tally.Snapshot(name) }

// idle clears a drained server's open connections, requests and tunnels.
func idle(s *httplb.Snapshot) {
	s.Connections, s.InFlight, s.Tunnels = 0, 0, 0
	for i := range s.Backends {
		s.Backends[i].InFlight, s.Backends[i].Tunnels = 0, 0
	}
}

// merge adds src's counters to dst's, and its open connections, requests and
// tunnels; a backend dst lacks is added only with add (a server that still
// drains has requests on it).
func merge(dst *httplb.Snapshot, src httplb.Snapshot, add bool) {
	dst.Connections += src.Connections
	dst.InFlight += src.InFlight
	dst.Tunnels += src.Tunnels
	dst.Accepted += src.Accepted
	dst.Requests += src.Requests
	dst.NoBackend += src.NoBackend
	dst.AcceptErrors += src.AcceptErrors
	dst.ClientTimeouts += src.ClientTimeouts
	for _, ob := range src.Backends {
		b := served.Entry(&dst.Backends, func(b *httplb.BackendSnapshot) bool { return b.Addr == ob.Addr }, add,
			func() httplb.BackendSnapshot { return httplb.BackendSnapshot{Addr: ob.Addr} })
		if b == nil {
			continue
		}
		b.InFlight += ob.InFlight
		b.Tunnels += ob.Tunnels
		b.Requests += ob.Requests
		b.Retries += ob.Retries
		for c := range b.Classes {
			b.Classes[c] += ob.Classes[c]
		}
	}
}

// start binds a service's listener with its backends; the set starts serving.
func (p *Plane) start(s *plan.Service) (*httplb.Service, error) { return p.replace(nil, s) }

// replace is start for a service whose server old (nil: none) it replaces:
// where old, or else the other plane's server that Peer finds, listens on the
// same address, the new server takes its listening sockets over
// (httplb.ListenFrom).
func (p *Plane) replace(old *httplb.Service, s *plan.Service) (*httplb.Service, error) {
	cfg := p.lbConfig(&s.Config)
	if s.Config.HTTP.TLSCert != "" {
		c, err := p.startCert(s)
		if err != nil {
			return nil, err
		}
		// A pointer of its own: the server it replaces hands out its own
		// certificate until it retires.
		p.holdCert(s.Name())
		cert := new(atomic.Pointer[loadedCert])
		cert.Store(c)
		p.certs[s.Name()] = cert
		cfg.TLS = &tls.Config{NextProtos: []string{"h2", "http/1.1"}, MinVersion: tls.VersionTLS12,
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return &cert.Load().Certificate, nil }}
	} else if p.certs[s.Name()] != nil {
		// Served without TLS: the name keeps no certificate (Abort puts
		// it back), which TLS given again would start with.
		p.holdCert(s.Name())
		delete(p.certs, s.Name())
	}
	var from httplb.Sockets = old
	if old == nil {
		from, _ = p.Peer.Take(cfg.Listen)
	}
	lb, err := httplb.ListenFrom(cfg, backends(s), from)
	if errors.Is(err, syscall.EADDRNOTAVAIL) {
		return nil, fmt.Errorf("%w: the http plane binds %s, which no interface of this host holds", err, cfg.Listen.Addr())
	}
	return lb, err // names the service
}

// backends is the desired backend set as the balancer takes it: a drained or
// weight-0 backend is unusable, so it gets no new requests. Weights are table
// weights: a maglev or source_hash table cannot ramp per pick, so the planner
// steps a ramping backend's (plan.SteppedSlowStart), as for the proxy.
func backends(s *plan.Service) []httplb.Backend {
	bs := make([]httplb.Backend, 0, len(s.Backends))
	for _, b := range s.Backends {
		bs = append(bs, httplb.Backend{Addr: b.Config.Addr, Weight: max(b.Weight, 1), SlowStart: s.Config.SlowStart,
			Usable: b.Usable && !b.Drained && b.Weight > 0, Draining: b.Drained || b.Weight == 0, Ramp: b.Ramp})
	}
	return bs
}

// rebuilt says whether a change needs a new listener: the address or TLS
// changed, or a setting the server or its pools fix while they run. Anything
// else (algorithm, retries, timeouts, headers, backends) is applied in place,
// so a reload does not send the clients GOAWAY.
func rebuilt(a, b *config.Service) bool {
	return a.VIP != b.VIP || a.Protocol != b.Protocol || a.DataPlane != b.DataPlane ||
		a.HTTP.TLSCert != b.HTTP.TLSCert || a.HTTP.TLSKey != b.HTTP.TLSKey ||
		httplb.Fixed(lbConfig(a, nil, nil), lbConfig(b, nil, nil))
}

func (p *Plane) lbConfig(s *config.Service) httplb.Config {
	return lbConfig(s, observer{p, s.Name}, p.log.With("service", s.Name))
}

// lbConfig translates a service's settings for httplb (TLS aside: its
// certificate is read when the service starts and at every reload).
func lbConfig(s *config.Service, obs httplb.Observer, log *slog.Logger) httplb.Config {
	h := s.HTTP
	c := httplb.Config{
		Name:               s.Name,
		Listen:             h.Listen,
		Algorithm:          string(s.Algorithm),
		LastByte:           h.LeastTime == config.LeastTimeLastByte,
		HashName:           h.HashBy.Name,
		ConnectTimeout:     h.ConnectTimeout,
		TryTimeout:         h.TryTimeout,
		Timeout:            h.Timeout,
		IdleTimeout:        h.IdleTimeout,
		ReadHeaderTimeout:  h.ReadHeaderTimeout,
		MaxHeaderBytes:     h.MaxHeaderBytes,
		Retries:            h.Retries,
		RetryBudget:        h.RetryBudget,
		RetryGRPC:          h.RetryGRPC,
		XForwardedFor:      h.XForwardedFor,
		Forwarded:          h.Forwarded,
		XForwardedProto:    h.XForwardedProto,
		AccessLog:          h.AccessLog,
		DrainTimeout:       s.DrainTimeout,
		ClientKeepalive:    h.TCPKeepalive.Client.KeepAliveConfig(),
		BackendKeepalive:   h.TCPKeepalive.Backend.KeepAliveConfig(),
		ClientUserTimeout:  h.TCPUserTimeout.Client,
		BackendUserTimeout: h.TCPUserTimeout.Backend,
		Observer:           obs,
		Logger:             log,
	}
	switch h.HashBy.Kind {
	case config.HashByHeader:
		c.Hash = httplb.HashHeader
	case config.HashByCookie:
		c.Hash = httplb.HashCookie
	}
	c.NetHTTP2 = h.H2Engine == config.H2EngineNetHTTP
	c.NetHTTP1 = h.H1Engine == config.H1EngineNetHTTP
	switch h.Upstream {
	case config.UpstreamHTTP1:
		c.Upstream = httplb.UpstreamHTTP1
	case config.UpstreamH2C:
		c.Upstream = httplb.UpstreamH2C
	}
	return c
}

// observer feeds what the service's requests see to the health checker and the
// agent's metrics.
type observer struct {
	p       *Plane
	service string
}

func (o observer) Try(addr netip.AddrPort, out httplb.Outcome) {
	var ho health.Outcome
	switch out {
	case httplb.Success:
		ho = health.Success
	case httplb.ConnectFailure:
		ho = health.ConnectFailure
	case httplb.Timeout:
		ho = health.Timeout
	case httplb.Reset:
		ho = health.Reset
	case httplb.ServerError:
		ho = health.ServerError
	default:
		return
	}
	o.p.checker.Observe(plan.ID(o.service, addr), ho)
}

func (o observer) Request(addr netip.AddrPort, status int, d time.Duration) {
	if o.p.observe != nil {
		o.p.observe(o.service, addr.String(), status, d)
	}
}
