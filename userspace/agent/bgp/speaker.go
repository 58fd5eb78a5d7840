package bgp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"time"

	gobgpapi "github.com/osrg/gobgp/v4/api"
	"github.com/osrg/gobgp/v4/pkg/apiutil"
	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
	"github.com/osrg/gobgp/v4/pkg/server"

	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/config"
)

// Speaker runs the node's BGP sessions and announces the routes it is given. Create
// it with New, Run it once; Announce and Status may be called from any goroutine.
type Speaker struct {
	cfg  config.BGP
	log  *slog.Logger
	kick chan struct{} // a new want is waiting; buffered 1

	mu        sync.Mutex
	want      []Route
	withheld  []Withheld
	drain     drainState
	announced map[netip.Prefix]Route // what the speaker's RIB holds now
	pending   map[netip.Prefix]pendingRoute
	peers     map[netip.Addr]*peerState
	runErr    error // why Run gave up, if it did

	// wrapRIB, when a test sets it, stands between apply and the GoBGP server: the
	// embedded server offers no way to make AddPath or DeletePath fail on demand.
	wrapRIB func(rib) rib
}

// rib is what apply asks of the GoBGP server (*server.BgpServer).
type rib interface {
	AddPath(apiutil.AddPathRequest) ([]apiutil.AddPathResponse, error)
	DeletePath(apiutil.DeletePathRequest) error
}

// pendingRoute is a prefix whose last AddPath or DeletePath failed: the RIB does not
// hold what the node wants, and the speaker tries again at next. Each prefix has
// its own backoff, so one that keeps failing does not hold back the retries of
// another.
type pendingRoute struct {
	announce bool  // true: to be announced (or its policy changed); false: withdrawn
	route    Route // what the failed announcement was to put in the RIB
	since    time.Time
	attempts int
	err      error
	bo       backoff
	next     time.Time // the next try
}

// due reports whether the change to bring p to want (nil: withdrawn) is to be
// tried at now: a route that failed waits for its next try, unless the node now
// wants something else of it.
func (pr *pendingRoute) due(want *Route, now time.Time) bool {
	if pr.announce != (want != nil) || want != nil && !pr.route.equal(want) {
		return true
	}
	return !now.Before(pr.next)
}

// want is what p waits for: api.RouteAnnounce or api.RouteWithdraw.
func (pr *pendingRoute) want() string {
	if pr.announce {
		return api.RouteAnnounce
	}
	return api.RouteWithdraw
}

// Retries of a failed route change wait retryMin, doubling up to retryMax, each
// spread by ±retryJitter so that nodes that failed together do not retry together.
const (
	retryMin    = 100 * time.Millisecond
	retryMax    = 5 * time.Second
	retryJitter = 0.2
)

// backoff is the wait before the next retry of a failed route change.
type backoff struct{ next time.Duration }

// delay returns the wait before the next attempt and doubles the one after.
func (b *backoff) delay() time.Duration {
	d := max(b.next, retryMin)
	b.next = min(2*d, retryMax)
	return time.Duration(float64(d) * (1 + retryJitter*(2*rand.Float64()-1)))
}

type drainState struct {
	on           bool
	since, until time.Time
}

type peerState struct {
	state   bgp.FSMState
	since   time.Time // established at
	lastErr string
}

// New returns a speaker for cfg (cfg.ASN must not be 0).
func New(cfg config.BGP, log *slog.Logger) *Speaker {
	s := &Speaker{cfg: cfg, log: log.With("part", "bgp"), kick: make(chan struct{}, 1),
		announced: map[netip.Prefix]Route{}, pending: map[netip.Prefix]pendingRoute{}, peers: map[netip.Addr]*peerState{}}
	for _, p := range cfg.Peers {
		s.peers[p.Address] = &peerState{state: bgp.BGP_FSM_IDLE}
	}
	return s
}

// Announce makes routes what the node announces; withheld says why the other VIPs
// are not, for status. It never blocks: the speaker applies the latest set it was
// given.
func (s *Speaker) Announce(routes []Route, withheld []Withheld) {
	s.mu.Lock()
	s.want, s.withheld = routes, withheld
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// SetDrain records the node's drain for status (the routes come through Announce).
func (s *Speaker) SetDrain(on bool, since time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.drain = drainState{on: on, since: since, until: since.Add(s.cfg.DrainTimeout)}
}

// Run starts the BGP server, dials the peers (and listens if the config says so)
// and announces what Announce last gave it until ctx is done; then it ends every
// session with a Cease notification, which withdraws the routes at once. A route
// change GoBGP refuses is tried again, with a backoff of its own, until it is made
// or a newer Announce no longer needs it.
func (s *Speaker) Run(ctx context.Context) error {
	lvl := &slog.LevelVar{}
	lvl.Set(slog.LevelWarn) // GoBGP's own info lines repeat what this package logs
	glog := slog.New(&notifyHandler{Handler: s.log.Handler(), level: lvl, note: s.onNotification})
	srv := server.NewBgpServer(server.LoggerOption(glog, lvl))
	served := make(chan struct{})
	// Exits when StopBgp ends the server.
	go func() {
		defer close(served)
		srv.Serve()
	}()
	listen := int32(-1) // GoBGP's "no listener"
	if s.cfg.ListenPort != 0 {
		listen = int32(s.cfg.ListenPort)
	}
	stop := func() {
		// A fresh context: ctx is done when the agent stops, and the Cease must go out.
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.StopBgp(sctx, &gobgpapi.StopBgpRequest{}); err != nil {
			// Not serving (yet): nothing to wait for.
			s.log.Error("stop bgp", "err", err)
			return
		}
		<-served
	}
	if err := srv.StartBgp(ctx, &gobgpapi.StartBgpRequest{Global: &gobgpapi.Global{
		Asn: s.cfg.ASN, RouterId: s.cfg.RouterID.String(), ListenPort: listen}}); err != nil {
		stop()
		// The listener is what a host can refuse (a port another process holds):
		// name the setting, as admin.listen and metrics.listen do.
		if oe := (*net.OpError)(nil); errors.As(err, &oe) && oe.Op == "listen" {
			err = fmt.Errorf("bgp.listen_port %d: %w", s.cfg.ListenPort, err)
		}
		return s.failed(fmt.Errorf("bgp: start: %w", err))
	}
	watchCtx, cancelWatch := context.WithCancel(ctx)
	defer cancelWatch()
	if err := srv.WatchEvent(watchCtx, server.WatchEventMessageCallbacks{OnPeerUpdate: s.onPeer}, server.WatchPeer()); err != nil {
		stop()
		return s.failed(fmt.Errorf("bgp: watch peers: %w", err))
	}
	for _, p := range s.cfg.Peers {
		if err := srv.AddPeer(ctx, &gobgpapi.AddPeerRequest{Peer: s.peer(p)}); err != nil {
			stop()
			return s.failed(fmt.Errorf("bgp: peer %s: %w", p.Address, err))
		}
	}
	s.log.Info("bgp speaker running", "asn", s.cfg.ASN, "router_id", s.cfg.RouterID, "peers", len(s.cfg.Peers), "listen_port", s.cfg.ListenPort)
	var r rib = srv
	if s.wrapRIB != nil {
		r = s.wrapRIB(r)
	}
	retry := time.NewTimer(0)
	retry.Stop()
	defer retry.Stop()
	var fails failureLog
	for {
		select {
		case <-ctx.Done():
			s.mu.Lock()
			n := len(s.announced)
			clear(s.announced)
			clear(s.pending)
			s.mu.Unlock()
			stop()
			s.log.Info("bgp speaker stopped: sessions closed, routes withdrawn", "routes", n)
			return nil
		case <-s.kick:
		case <-retry.C:
		}
		refused := s.apply(r, time.Now())
		next, err := s.pendingState()
		now := time.Now()
		if err == nil {
			retry.Stop()
			fails.ok(s.log, now)
			continue
		}
		retry.Reset(next.Sub(now))
		if refused {
			fails.failed(s.log, now, err, max(0, next.Sub(now)))
		}
	}
}

// repeatLogEvery is how often a route change that keeps failing with the same
// error is logged again: retries come up to every retryMax, forever, and a line
// each would flood the log with one refusal.
const repeatLogEvery = time.Minute

// failureLog logs the failures of apply: the first and every change of the
// error at once, repeats of the same error at most every repeatLogEvery with
// how many were left out, and the recovery once at info. Its zero value is a
// speaker with no failure.
type failureLog struct {
	err        string    // the failing error; "" while apply succeeds
	since      time.Time // first failure of this run of them
	attempts   int       // failures since then
	loggedAt   time.Time // last line
	suppressed int       // failures since the last line that it did not log
}

func (f *failureLog) failed(log *slog.Logger, now time.Time, err error, retryIn time.Duration) {
	if f.err == "" {
		f.since, f.attempts = now, 0
	}
	f.attempts++
	msg := err.Error()
	same := msg == f.err
	f.err = msg
	if same && now.Sub(f.loggedAt) < repeatLogEvery {
		f.suppressed++
		return
	}
	args := []any{"err", err, "retry_in", retryIn.Round(time.Millisecond)}
	if f.attempts > 1 {
		args = append(args, "failing_for", now.Sub(f.since).Round(time.Second), "attempts", f.attempts, "repeats_suppressed", f.suppressed)
	}
	if same {
		log.Error("bgp: apply routes: still failing", args...)
	} else {
		log.Error("bgp: apply routes", args...)
	}
	f.loggedAt, f.suppressed = now, 0
}

func (f *failureLog) ok(log *slog.Logger, now time.Time) {
	if f.err == "" {
		return
	}
	log.Info("bgp: route changes applied again", "failing_for", now.Sub(f.since).Round(time.Second),
		"failed_attempts", f.attempts, "repeats_suppressed", f.suppressed)
	*f = failureLog{}
}

// failed records why Run gave up, for status, and returns it.
func (s *Speaker) failed(err error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runErr = err
	return err
}

// peer is the GoBGP form of one configured peer.
func (s *Speaker) peer(p config.Peer) *gobgpapi.Peer {
	gp := &gobgpapi.Peer{
		Conf:      &gobgpapi.PeerConf{NeighborAddress: p.Address.String(), PeerAsn: p.ASN, AuthPassword: p.Password},
		Timers:    &gobgpapi.Timers{Config: &gobgpapi.TimersConfig{HoldTime: uint64(p.HoldTime / time.Second), KeepaliveInterval: uint64(p.Keepalive / time.Second), ConnectRetry: 1}},
		Transport: &gobgpapi.Transport{RemotePort: uint32(p.Port), PassiveMode: false},
	}
	if p.Multihop > 0 {
		gp.EbgpMultihop = &gobgpapi.EbgpMultihop{Enabled: true, MultihopTtl: uint32(p.Multihop)}
	}
	// A family is offered where its routes have a next hop: the session's own
	// address, or a configured one.
	for _, v4 := range []bool{true, false} {
		_, nh := s.cfg.NextHopFor(netip.IPv4Unspecified())
		if !v4 {
			_, nh = s.cfg.NextHopFor(netip.IPv6Unspecified())
		}
		if p.Address.Is4() != v4 && !nh {
			continue
		}
		afi := gobgpapi.Family_AFI_IP
		if !v4 {
			afi = gobgpapi.Family_AFI_IP6
		}
		gp.AfiSafis = append(gp.AfiSafis, &gobgpapi.AfiSafi{Config: &gobgpapi.AfiSafiConfig{
			Family: &gobgpapi.Family{Afi: afi, Safi: gobgpapi.Family_SAFI_UNICAST}, Enabled: true}})
	}
	return gp
}

func (s *Speaker) onPeer(ev *apiutil.WatchEventMessage_PeerEvent, at time.Time) {
	if ev.Type != apiutil.PEER_EVENT_STATE {
		return
	}
	addr := ev.Peer.State.NeighborAddress
	if !addr.IsValid() {
		addr = ev.Peer.Conf.NeighborAddress
	}
	s.mu.Lock()
	p, ok := s.peers[addr.Unmap()]
	if !ok {
		s.mu.Unlock()
		return
	}
	was := p.state
	p.state = ev.Peer.State.SessionState
	switch {
	case p.state == bgp.BGP_FSM_ESTABLISHED && was != p.state:
		p.since = at
	case p.state != bgp.BGP_FSM_ESTABLISHED:
		p.since = time.Time{}
		// GoBGP says why for every transition; only a fall back to idle or from
		// established is an error worth showing.
		if m := ev.Peer.State.DisconnectMessage; m != "" && (p.state == bgp.BGP_FSM_IDLE || was == bgp.BGP_FSM_ESTABLISHED) {
			p.lastErr = m
		}
	}
	state, lastErr := p.state, p.lastErr
	s.mu.Unlock()
	if was != state {
		s.log.Info("bgp session", "peer", addr, "state", stateName(state), "was", stateName(was), "last_error", lastErr)
	}
}

// onNotification records a NOTIFICATION sent to or received from peer as its
// last error, for status: "sent notification: code 2(open) subcode 2(bad peer
// as)" for a peer whose asn is wrong.
func (s *Speaker) onNotification(peer netip.Addr, what string) {
	s.mu.Lock()
	p, ok := s.peers[peer]
	same := ok && p.lastErr == what
	if ok {
		p.lastErr = what
	}
	s.mu.Unlock()
	if ok && !same {
		s.log.Info("bgp notification", "peer", peer, "notification", what)
	}
}

// apply adds and withdraws the difference between the RIB and the latest want: at
// once for a change the node has not tried yet, at its next try for one that
// failed. It reports whether a change failed at this call.
func (s *Speaker) apply(srv rib, now time.Time) (refused bool) {
	s.mu.Lock()
	want := slices.Clone(s.want)
	have := maps.Clone(s.announced)
	pending := maps.Clone(s.pending) // only this goroutine changes it
	s.mu.Unlock()
	keep := map[netip.Prefix]bool{}
	for _, r := range want {
		keep[r.Prefix] = true
		if h, ok := have[r.Prefix]; ok && h.equal(&r) {
			s.settle(r.Prefix, &r) // the services keeping it up may differ
			continue
		}
		if pr, ok := pending[r.Prefix]; ok && !pr.due(&r, now) {
			continue
		}
		path, err := s.path(r)
		if err == nil {
			_, err = srv.AddPath(apiutil.AddPathRequest{Paths: []*apiutil.Path{path}})
		}
		if err != nil {
			refused = true
			s.refused(r.Prefix, &r, err, now)
			continue
		}
		s.settle(r.Prefix, &r)
		s.log.Info("bgp announce", "prefix", r.Prefix, "services", r.Services)
	}
	for _, p := range slices.SortedFunc(maps.Keys(have), netip.Prefix.Compare) {
		if keep[p] {
			continue
		}
		if pr, ok := pending[p]; ok && !pr.due(nil, now) {
			continue
		}
		r := have[p]
		path, err := s.path(r)
		if err == nil {
			err = srv.DeletePath(apiutil.DeletePathRequest{Paths: []*apiutil.Path{path}})
		}
		if err != nil {
			refused = true
			s.refused(p, nil, err, now)
			continue
		}
		s.settle(p, nil)
		s.log.Info("bgp withdraw", "prefix", p)
	}
	// An announcement that failed and is no longer wanted is no longer pending (a
	// withdrawal wanted again was settled above).
	for p := range pending {
		if _, held := have[p]; !held && !keep[p] {
			s.settle(p, nil)
		}
	}
	return refused
}

// settle records that the RIB now holds r for p (nil: nothing), which is no longer
// pending.
func (s *Speaker) settle(p netip.Prefix, r *Route) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.pending, p)
	if r == nil {
		delete(s.announced, p)
		return
	}
	s.announced[p] = *r
}

// refused records that the change bringing p to want (nil: withdrawn) failed at
// now with err, and when it is tried again; the attempts and the backoff go on
// from an earlier failure of the same kind of change.
func (s *Speaker) refused(p netip.Prefix, want *Route, err error, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	pr, ok := s.pending[p]
	if !ok || pr.announce != (want != nil) {
		pr = pendingRoute{announce: want != nil, since: now}
	}
	if want != nil {
		pr.route = *want
	}
	pr.attempts++
	pr.err = err
	pr.next = now.Add(pr.bo.delay())
	s.pending[p] = pr
}

// pendingState is the failures of the pending routes, in prefix order so that the
// same refusals read the same at every retry (failureLog), and the earliest next
// try; nil and zero when nothing is pending.
func (s *Speaker) pendingState() (time.Time, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	var next time.Time
	for _, p := range slices.SortedFunc(maps.Keys(s.pending), netip.Prefix.Compare) {
		pr := s.pending[p]
		errs = append(errs, fmt.Errorf("%s %s: %w", pr.want(), p, pr.err))
		if next.IsZero() || pr.next.Before(next) {
			next = pr.next
		}
	}
	return next, errors.Join(errs...)
}

// path is the GoBGP path of r: origin IGP, the next hop of its family (unspecified:
// GoBGP puts the session's local address), and the service's policy.
func (s *Speaker) path(r Route) (*apiutil.Path, error) {
	nlri, err := bgp.NewIPAddrPrefix(r.Prefix)
	if err != nil {
		return nil, err
	}
	nh, ok := s.cfg.NextHopFor(r.Prefix.Addr())
	if !ok {
		nh = netip.IPv4Unspecified()
		if r.Prefix.Addr().Is6() {
			nh = netip.IPv6Unspecified()
		}
	}
	attrs := []bgp.PathAttributeInterface{bgp.NewPathAttributeOrigin(bgp.BGP_ORIGIN_ATTR_TYPE_IGP)}
	family := bgp.RF_IPv4_UC
	if r.Prefix.Addr().Is4() {
		a, err := bgp.NewPathAttributeNextHop(nh)
		if err != nil {
			return nil, err
		}
		attrs = append(attrs, a)
	} else {
		family = bgp.RF_IPv6_UC
		a, err := bgp.NewPathAttributeMpReachNLRI(family, []bgp.PathNLRI{{NLRI: nlri}}, nh)
		if err != nil {
			return nil, err
		}
		attrs = append(attrs, a)
	}
	if len(r.Communities) > 0 {
		attrs = append(attrs, bgp.NewPathAttributeCommunities(r.Communities))
	}
	if r.MED != 0 {
		attrs = append(attrs, bgp.NewPathAttributeMultiExitDisc(r.MED))
	}
	if r.LocalPref != 0 {
		attrs = append(attrs, bgp.NewPathAttributeLocalPref(r.LocalPref))
	}
	return &apiutil.Path{Family: family, Nlri: nlri, Attrs: attrs}, nil
}

// Status is the speaker's sessions and routes now.
func (s *Speaker) Status() *api.BGPStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &api.BGPStatus{ASN: s.cfg.ASN, RouterID: s.cfg.RouterID.String(), Drained: s.drain.on,
		Peers: []api.PeerStatus{}, Announced: []api.RouteStatus{}}
	if s.drain.on {
		st.DrainedSince, st.DrainUntil = s.drain.since, s.drain.until
	}
	if s.runErr != nil {
		st.Error = s.runErr.Error()
	}
	now := time.Now()
	for _, p := range s.cfg.Peers {
		ps := s.peers[p.Address]
		out := api.PeerStatus{Address: p.Address.String(), ASN: p.ASN, State: stateName(ps.state), LastError: ps.lastErr,
			HoldTime: uint64(p.HoldTime / time.Second)}
		if !ps.since.IsZero() {
			out.Since, out.Uptime = ps.since, now.Sub(ps.since).Round(time.Second).String()
		}
		st.Peers = append(st.Peers, out)
	}
	// What the RIB holds, wanted routes first in their order, then those a failed
	// withdrawal left there.
	order := make([]netip.Prefix, 0, len(s.announced))
	wanted := make(map[netip.Prefix]bool, len(s.want))
	for _, r := range s.want {
		wanted[r.Prefix] = true
		if _, ok := s.announced[r.Prefix]; ok {
			order = append(order, r.Prefix)
		}
	}
	var stale []netip.Prefix
	for p := range s.announced {
		if !wanted[p] {
			stale = append(stale, p)
		}
	}
	slices.SortFunc(stale, netip.Prefix.Compare)
	for _, p := range append(order, stale...) {
		r := s.announced[p]
		rs := api.RouteStatus{Prefix: p.String(), Services: r.Services, MED: r.MED, LocalPref: r.LocalPref}
		for _, c := range r.Communities {
			rs.Communities = append(rs.Communities, strconv.Itoa(int(c>>16))+":"+strconv.Itoa(int(c&0xffff)))
		}
		st.Announced = append(st.Announced, rs)
	}
	for _, w := range s.withheld {
		st.Withheld = append(st.Withheld, api.WithheldRoute{Prefix: w.Prefix.String(), Why: w.Why})
	}
	for _, p := range slices.SortedFunc(maps.Keys(s.pending), netip.Prefix.Compare) {
		pr := s.pending[p]
		st.Pending = append(st.Pending, api.PendingRoute{Prefix: p.String(), Want: pr.want(), Since: pr.since,
			Attempts: pr.attempts, LastError: pr.err.Error(), NextTry: pr.next})
	}
	return st
}

func stateName(s bgp.FSMState) string {
	switch s {
	case bgp.BGP_FSM_IDLE:
		return "idle"
	case bgp.BGP_FSM_CONNECT:
		return "connect"
	case bgp.BGP_FSM_ACTIVE:
		return "active"
	case bgp.BGP_FSM_OPENSENT:
		return "opensent"
	case bgp.BGP_FSM_OPENCONFIRM:
		return "openconfirm"
	case bgp.BGP_FSM_ESTABLISHED:
		return "established"
	}
	return fmt.Sprintf("state %d", int(s))
}
