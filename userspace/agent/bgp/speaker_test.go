package bgp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	gobgpapi "github.com/osrg/gobgp/v4/api"
	"github.com/osrg/gobgp/v4/pkg/apiutil"
	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
	"github.com/osrg/gobgp/v4/pkg/server"

	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/config"
)

// router is a second GoBGP on loopback standing in for the router: the fleet tests
// (internal/fleet) run the speaker against a real BIRD in namespaces; this one runs
// anywhere, under -race too, and reads what the router learnt from its RIB. Its AS
// is asn; the speaker's is 65001 (eBGP unless asn is 65001 too).
func router(t *testing.T, asn uint32) (*server.BgpServer, uint16) {
	t.Helper()
	return routerAt(t, asn, "127.0.0.1")
}

// routerAt is router listening at addr, for a speaker at the same address.
func routerAt(t *testing.T, asn uint32, addr string) (*server.BgpServer, uint16) {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		t.Fatal(err)
	}
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	l.Close()
	r := server.NewBgpServer(server.LoggerOption(slog.New(slog.NewTextHandler(io.Discard, nil)), &slog.LevelVar{}))
	done := make(chan struct{})
	go func() { defer close(done); r.Serve() }() // exits at StopBgp
	if err := r.StartBgp(context.Background(), &gobgpapi.StartBgpRequest{Global: &gobgpapi.Global{
		Asn: asn, RouterId: "127.0.0.2", ListenPort: int32(port), ListenAddresses: []string{addr}}}); err != nil {
		t.Fatal(err)
	}
	if err := r.AddPeer(context.Background(), &gobgpapi.AddPeerRequest{Peer: &gobgpapi.Peer{
		Conf:      &gobgpapi.PeerConf{NeighborAddress: addr, PeerAsn: 65001},
		Transport: &gobgpapi.Transport{PassiveMode: true},
		AfiSafis: []*gobgpapi.AfiSafi{
			{Config: &gobgpapi.AfiSafiConfig{Family: &gobgpapi.Family{Afi: gobgpapi.Family_AFI_IP, Safi: gobgpapi.Family_SAFI_UNICAST}, Enabled: true}},
			{Config: &gobgpapi.AfiSafiConfig{Family: &gobgpapi.Family{Afi: gobgpapi.Family_AFI_IP6, Safi: gobgpapi.Family_SAFI_UNICAST}, Enabled: true}},
		},
	}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.StopBgp(context.Background(), &gobgpapi.StopBgpRequest{})
		<-done
	})
	return r, port
}

// run runs s until the test ends.
func run(t *testing.T, s *Speaker) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }() // exits when ctx is cancelled
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// learnt is the prefixes the router has, with their MED.
func learnt(r *server.BgpServer) map[netip.Prefix]uint32 {
	out := map[netip.Prefix]uint32{}
	for _, fam := range []bgp.Family{bgp.RF_IPv4_UC, bgp.RF_IPv6_UC} {
		r.ListPath(apiutil.ListPathRequest{TableType: gobgpapi.TableType_TABLE_TYPE_GLOBAL, Family: fam}, func(nlri bgp.NLRI, paths []*apiutil.Path) {
			p, err := netip.ParsePrefix(nlri.String())
			if err != nil || len(paths) == 0 {
				return
			}
			for _, a := range paths[0].Attrs {
				if m, ok := a.(*bgp.PathAttributeMultiExitDisc); ok {
					out[p] = m.Value
					return
				}
			}
			out[p] = 0
		})
	}
	return out
}

func TestSpeaker(t *testing.T) {
	r, port := router(t, 65000)
	cfg := config.BGP{ASN: 65001, RouterID: netip.MustParseAddr("127.0.0.1"), DrainTimeout: time.Second,
		NextHop: []netip.Addr{netip.MustParseAddr("fd00::1")},
		Peers:   []config.Peer{{Address: netip.MustParseAddr("127.0.0.1"), ASN: 65000, Port: port, HoldTime: 3 * time.Second, Keepalive: time.Second}}}
	s := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }() // exits when ctx is cancelled
	defer func() {
		cancel()
		<-done
	}()
	v4, v6 := netip.MustParsePrefix("10.80.100.1/32"), netip.MustParsePrefix("fd80:100::1/128")
	s.Announce([]Route{{Prefix: v4, Services: []string{"web"}, MED: 7}, {Prefix: v6, Services: []string{"web6"}}}, nil)
	want := func(what string, w map[netip.Prefix]uint32) {
		t.Helper()
		var got map[netip.Prefix]uint32
		if !waitfor.Cond(10*time.Second, func() bool {
			got = learnt(r)
			return len(got) == len(w) && func() bool {
				for p, m := range w {
					if g, ok := got[p]; !ok || g != m {
						return false
					}
				}
				return true
			}()
		}) {
			t.Fatalf("%s: the router has %v; want %v", what, got, w)
		}
	}
	want("announced", map[netip.Prefix]uint32{v4: 7, v6: 0})
	st := s.Status()
	if len(st.Peers) != 1 || st.Peers[0].State != "established" || len(st.Announced) != 2 {
		t.Errorf("status: %+v; want the peer established and two routes", st)
	}
	// A changed policy is sent again; a route no longer wanted is withdrawn.
	s.Announce([]Route{{Prefix: v4, Services: []string{"web"}, MED: 9}}, []Withheld{{v6, "web6: no backend usable and up"}})
	want("policy changed, v6 withdrawn", map[netip.Prefix]uint32{v4: 9})
	st = s.Status()
	if len(st.Announced) != 1 || len(st.Withheld) != 1 || !slices.Contains(st.Announced[0].Services, "web") {
		t.Errorf("status: %+v; want one route announced and one withheld", st)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	done <- nil
	want("stopped", map[netip.Prefix]uint32{})
}

// TestSpeakerListenTaken: a listen port another process holds stops the speaker
// with an error that names the setting, which status shows.
func TestSpeakerListenTaken(t *testing.T) {
	l, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cfg := config.BGP{ASN: 65001, RouterID: netip.MustParseAddr("127.0.0.1"), ListenPort: uint16(l.Addr().(*net.TCPAddr).Port),
		Peers: []config.Peer{{Address: netip.MustParseAddr("127.0.0.1"), ASN: 65000, Port: 179, HoldTime: 3 * time.Second, Keepalive: time.Second}}}
	s := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	port := fmt.Sprintf("bgp.listen_port %d: ", cfg.ListenPort)
	if err := s.Run(ctx); err == nil || !strings.Contains(err.Error(), port) || !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("Run: got %v; want the listen port's error, naming bgp.listen_port", err)
	}
	if st := s.Status(); !strings.Contains(st.Error, port) {
		t.Errorf("status: %+v; want the error, naming bgp.listen_port", st)
	}
}

// TestSpeakerIPv6Session: over a session to an IPv6 peer, an IPv6 VIP goes with
// the session's own address as next hop, and an IPv4 VIP with the configured
// IPv4 next_hop.
func TestSpeakerIPv6Session(t *testing.T) {
	r, port := routerAt(t, 65000, "::1")
	cfg := config.BGP{ASN: 65001, RouterID: netip.MustParseAddr("127.0.0.1"),
		NextHop: []netip.Addr{netip.MustParseAddr("192.0.2.1")},
		Peers:   []config.Peer{{Address: netip.MustParseAddr("::1"), ASN: 65000, Port: port, HoldTime: 3 * time.Second, Keepalive: time.Second}}}
	s := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	run(t, s)
	v4, v6 := netip.MustParsePrefix("10.80.100.1/32"), netip.MustParsePrefix("fd80:100::1/128")
	s.Announce([]Route{{Prefix: v4, Services: []string{"web"}}, {Prefix: v6, Services: []string{"web6"}}}, nil)
	want := map[netip.Prefix]string{v4: "192.0.2.1", v6: "::1"}
	got := map[netip.Prefix]string{}
	if !waitfor.Cond(10*time.Second, func() bool {
		for _, fam := range []bgp.Family{bgp.RF_IPv4_UC, bgp.RF_IPv6_UC} {
			r.ListPath(apiutil.ListPathRequest{TableType: gobgpapi.TableType_TABLE_TYPE_GLOBAL, Family: fam}, func(nlri bgp.NLRI, paths []*apiutil.Path) {
				if p, err := netip.ParsePrefix(nlri.String()); err == nil && len(paths) > 0 {
					got[p] = nextHop(paths[0])
				}
			})
		}
		return maps.Equal(got, want)
	}) {
		t.Errorf("the router learnt %v; want %v", got, want)
	}
}

// nextHop is p's next hop, from NEXT_HOP or MP_REACH_NLRI.
func nextHop(p *apiutil.Path) string {
	for _, a := range p.Attrs {
		switch a := a.(type) {
		case *bgp.PathAttributeNextHop:
			return a.Value.String()
		case *bgp.PathAttributeMpReachNLRI:
			return a.Nexthop.String()
		}
	}
	return ""
}

// TestSpeakerWrongPeerASN: a peer whose AS is not the configured asn never
// comes up, and status and the log say why: the OPEN the speaker refused. The
// log has none of GoBGP's own info lines.
func TestSpeakerWrongPeerASN(t *testing.T) {
	_, port := router(t, 65000)
	cfg := config.BGP{ASN: 65001, RouterID: netip.MustParseAddr("127.0.0.1"),
		Peers: []config.Peer{{Address: netip.MustParseAddr("127.0.0.1"), ASN: 65009, Port: port, HoldTime: 3 * time.Second, Keepalive: time.Second}}}
	log := &lineLog{}
	s := New(cfg, slog.New(log))
	run(t, s)
	var got api.PeerStatus
	if !waitfor.Cond(15*time.Second, func() bool {
		got = s.Status().Peers[0]
		return strings.Contains(got.LastError, "bad peer as")
	}) {
		t.Errorf("peer status: got %+v; want the refused OPEN (bad peer as) as its last error", got)
	}
	if got.State == "established" {
		t.Errorf("peer state: got established; want a session to a peer of the wrong AS refused")
	}
	if n := log.of("bgp notification"); len(n) == 0 || attr(n[0], "notification") != "sent notification: code 2(open) subcode 2(bad peer as)" {
		t.Errorf("log: got %v; want the refused OPEN first", n)
	}
	for _, gobgp := range []string{"Add a peer configuration", "sent notification", "starting outgoing connection manager"} {
		if n := log.of(gobgp); len(n) > 0 {
			t.Errorf("log: got GoBGP's info line %q; want none", gobgp)
		}
	}
}

// TestSpeakerLocalPref: LOCAL_PREF reaches iBGP peers only: the service's
// local_pref, or 100 when it has none; an eBGP peer gets no LOCAL_PREF at all.
func TestSpeakerLocalPref(t *testing.T) {
	for _, c := range []struct {
		name      string
		routerASN uint32
		localPref uint32
		want      uint32 // 0: no LOCAL_PREF attribute
	}{
		{"ibgp, unset", 65001, 0, 100},
		{"ibgp, set", 65001, 200, 200},
		{"ebgp, set", 65000, 200, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, port := router(t, c.routerASN)
			cfg := config.BGP{ASN: 65001, RouterID: netip.MustParseAddr("127.0.0.1"),
				Peers: []config.Peer{{Address: netip.MustParseAddr("127.0.0.1"), ASN: c.routerASN, Port: port, HoldTime: 3 * time.Second, Keepalive: time.Second}}}
			s := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
			run(t, s)
			s.Announce([]Route{{Prefix: netip.MustParsePrefix("10.80.100.1/32"), Services: []string{"web"}, LocalPref: c.localPref}}, nil)
			got, found := uint32(0), false
			if !waitfor.Cond(10*time.Second, func() bool {
				r.ListPath(apiutil.ListPathRequest{TableType: gobgpapi.TableType_TABLE_TYPE_GLOBAL, Family: bgp.RF_IPv4_UC}, func(_ bgp.NLRI, paths []*apiutil.Path) {
					if len(paths) == 0 {
						return
					}
					found = true
					for _, a := range paths[0].Attrs {
						if lp, ok := a.(*bgp.PathAttributeLocalPref); ok {
							got = lp.Value
						}
					}
				})
				return found
			}) {
				t.Fatal("the router learnt no route within 10s")
			}
			if got != c.want {
				t.Errorf("LOCAL_PREF: got %d; want %d (0: none)", got, c.want)
			}
		})
	}
}

// flakyRIB fails every AddPath and DeletePath while failing is set, and those of
// a prefix given refusals, and passes them to the real GoBGP server otherwise. The
// failure is injected because the embedded server refuses a well-formed path only
// once it is stopped, which ends Run too: a refusal that passes cannot be made on
// demand.
type flakyRIB struct {
	rib
	failing atomic.Bool
	calls   atomic.Int32 // refused calls

	mu        sync.Mutex
	refusals  map[netip.Prefix]int // how many more changes of the prefix to refuse
	refusedOf map[netip.Prefix]int // refused changes of the prefix
}

var errInjected = errors.New("injected: the RIB refuses the change")

// refuse makes the next n changes of p fail.
func (f *flakyRIB) refuse(p netip.Prefix, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refusals == nil {
		f.refusals, f.refusedOf = map[netip.Prefix]int{}, map[netip.Prefix]int{}
	}
	f.refusals[p] = n
}

// refused is the number of changes of p refused so far.
func (f *flakyRIB) refused(p netip.Prefix) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.refusedOf[p]
}

// fail reports whether to refuse a change of the paths, and counts it.
func (f *flakyRIB) fail(paths []*apiutil.Path) bool {
	if f.failing.Load() {
		f.calls.Add(1)
		return true
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, path := range paths {
		p, err := netip.ParsePrefix(path.Nlri.String())
		if err == nil && f.refusals[p] > 0 {
			f.refusals[p]--
			f.refusedOf[p]++
			f.calls.Add(1)
			return true
		}
	}
	return false
}

func (f *flakyRIB) AddPath(r apiutil.AddPathRequest) ([]apiutil.AddPathResponse, error) {
	if f.fail(r.Paths) {
		return nil, errInjected
	}
	return f.rib.AddPath(r)
}

func (f *flakyRIB) DeletePath(r apiutil.DeletePathRequest) error {
	if f.fail(r.Paths) {
		return errInjected
	}
	return f.rib.DeletePath(r)
}

// flakySpeaker is a running speaker logging to h, peering with a router, its RIB
// one whose changes the test can make fail.
func flakySpeaker(t *testing.T, h slog.Handler) (*Speaker, *server.BgpServer, *flakyRIB) {
	r, port := router(t, 65000)
	cfg := config.BGP{ASN: 65001, RouterID: netip.MustParseAddr("127.0.0.1"),
		Peers: []config.Peer{{Address: netip.MustParseAddr("127.0.0.1"), ASN: 65000, Port: port, HoldTime: 3 * time.Second, Keepalive: time.Second}}}
	s := New(cfg, slog.New(h))
	flaky := &flakyRIB{}
	s.wrapRIB = func(r rib) rib { flaky.rib = r; return flaky }
	run(t, s)
	return s, r, flaky
}

// TestSpeakerRetry: an announcement or a withdrawal GoBGP refuses is retried with
// no further event until it is made, and status shows the route as pending with
// the error meanwhile.
func TestSpeakerRetry(t *testing.T) {
	s, r, flaky := flakySpeaker(t, slog.NewTextHandler(io.Discard, nil))
	flaky.failing.Store(true)
	v4 := netip.MustParsePrefix("10.80.100.1/32")
	routerHas := func(what string, want bool) {
		t.Helper()
		if !waitfor.Cond(10*time.Second, func() bool { _, ok := learnt(r)[v4]; return ok == want }) {
			t.Fatalf("%s: the router has %v; want %s: %v", what, learnt(r), v4, want)
		}
	}
	pending := func(what, want string) {
		t.Helper()
		// Three refusals, with no Announce after the first: the speaker retries on
		// its own.
		var st *api.BGPStatus
		if !waitfor.Cond(10*time.Second, func() bool {
			st = s.Status()
			return flaky.calls.Load() >= 3 && len(st.Pending) == 1 && st.Pending[0].Attempts >= 3
		}) {
			t.Fatalf("%s: %d refused calls, status %+v; want 3 and more, and %s pending", what, flaky.calls.Load(), st, v4)
		}
		p := st.Pending[0]
		if p.Prefix != v4.String() || p.Want != want || !strings.Contains(p.LastError, errInjected.Error()) || p.Since.IsZero() {
			t.Errorf("%s: pending %+v; want %s to %s, with the error and since when", what, p, v4, want)
		}
	}

	s.Announce([]Route{{Prefix: v4, Services: []string{"web"}}}, nil)
	pending("announce refused", api.RouteAnnounce)
	if st := s.Status(); len(st.Announced) != 0 {
		t.Errorf("announce refused: status announced %+v; want none", st.Announced)
	}
	flaky.failing.Store(false)
	routerHas("announce accepted again", true)
	if !waitfor.Cond(5*time.Second, func() bool { st := s.Status(); return len(st.Pending) == 0 && len(st.Announced) == 1 }) {
		t.Errorf("announced: status %+v; want %s announced and nothing pending", s.Status(), v4)
	}

	flaky.calls.Store(0)
	flaky.failing.Store(true)
	s.Announce(nil, []Withheld{{v4, "web: no backend usable and up"}})
	pending("withdraw refused", api.RouteWithdraw)
	// Still in the RIB: status says so, and the router still has it.
	if st := s.Status(); len(st.Announced) != 1 || st.Announced[0].Prefix != v4.String() {
		t.Errorf("withdraw refused: status announced %+v; want %s still there", st.Announced, v4)
	}
	routerHas("withdraw refused", true)
	flaky.failing.Store(false)
	routerHas("withdraw accepted again", false)
	if !waitfor.Cond(5*time.Second, func() bool { st := s.Status(); return len(st.Pending) == 0 && len(st.Announced) == 0 }) {
		t.Errorf("withdrawn: status %+v; want nothing announced or pending", s.Status())
	}
}

// TestSpeakerRetryEachRoute: each refused route has its own backoff: a route
// GoBGP keeps refusing, its retries seconds apart by now, does not hold back the
// retry of another that fails once, and status shows each route's own next try.
func TestSpeakerRetryEachRoute(t *testing.T) {
	s, r, flaky := flakySpeaker(t, slog.NewTextHandler(io.Discard, nil))
	refused, ok := netip.MustParsePrefix("10.80.100.1/32"), netip.MustParsePrefix("10.80.100.2/32")
	flaky.refuse(refused, math.MaxInt)
	flaky.refuse(ok, 2)
	routes := []Route{{Prefix: refused, Services: []string{"web"}}}
	s.Announce(routes, nil)
	// Six refusals, 100 ms to 1.6 s apart: the next is 3.2 s ± 20 % away.
	if !waitfor.Cond(30*time.Second, func() bool { return flaky.refused(refused) >= 6 }) {
		t.Fatalf("%s refused %d times; want 6", refused, flaky.refused(refused))
	}
	before := flaky.refused(refused)
	s.Announce(append(routes, Route{Prefix: ok, Services: []string{"api"}}), nil)

	// Every status read while both are pending shows each route's own next try.
	pendingOf := func(st *api.BGPStatus, p netip.Prefix) *api.PendingRoute {
		for i := range st.Pending {
			if st.Pending[i].Prefix == p.String() {
				return &st.Pending[i]
			}
		}
		return nil
	}
	both := 0
	var st *api.BGPStatus
	if !waitfor.Cond(20*time.Second, func() bool {
		st = s.Status()
		a, b := pendingOf(st, refused), pendingOf(st, ok)
		if a == nil {
			t.Fatalf("status %+v; want %s pending throughout", st, refused)
		}
		if a.NextTry.IsZero() || b != nil && b.NextTry.IsZero() {
			t.Fatalf("status %+v; want a next try for every pending route", st)
		}
		if b != nil {
			both++
			if !b.NextTry.Before(a.NextTry) || b.Attempts > 2 || a.Attempts < 6 {
				t.Fatalf("pending %+v and %+v; want %s, failed once or twice, tried again before %s, failed 6 times", *a, *b, ok, refused)
			}
		}
		return slices.ContainsFunc(st.Announced, func(r api.RouteStatus) bool { return r.Prefix == ok.String() })
	}) {
		t.Fatalf("status %+v; want %s announced after two refusals", st, ok)
	}
	if after := flaky.refused(refused); after != before {
		t.Errorf("%s was announced after %d more refusals of %s; want none: its retries wait for no other route", ok, after-before, refused)
	}
	if both == 0 {
		t.Errorf("%s never seen pending; want it pending after its refusals", ok)
	}
	if !waitfor.Cond(10*time.Second, func() bool { _, has := learnt(r)[ok]; return has }) {
		t.Errorf("the router has %v; want %s", learnt(r), ok)
	}
}

// TestBackoff: retries wait 100ms doubling to 5s, each within ±20 %; a new
// backoff (a route that fails again after a success) starts over.
func TestBackoff(t *testing.T) {
	for round := range 2 {
		var b backoff
		for i, want := range []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond,
			1600 * time.Millisecond, 3200 * time.Millisecond, 5 * time.Second, 5 * time.Second} {
			if got := b.delay(); got < want*8/10 || got > want*12/10 {
				t.Errorf("round %d, retry %d: waits %s; want %s ± 20 %%", round, i, got, want)
			}
		}
	}
}
