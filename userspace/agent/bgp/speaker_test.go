package bgp

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	gobgpapi "github.com/osrg/gobgp/v4/api"
	"github.com/osrg/gobgp/v4/pkg/apiutil"
	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
	"github.com/osrg/gobgp/v4/pkg/server"

	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/config"
)

// router is a second GoBGP on loopback standing in for the router: the fleet tests
// (internal/fleet) run the speaker against a real BIRD in namespaces; this one runs
// anywhere, under -race too, and reads what the router learnt from its RIB. Its AS
// is asn; the speaker's is 65001 (eBGP unless asn is 65001 too).
func router(t *testing.T, asn uint32) (*server.BgpServer, uint16) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	l.Close()
	r := server.NewBgpServer(server.LoggerOption(slog.New(slog.NewTextHandler(io.Discard, nil)), &slog.LevelVar{}))
	done := make(chan struct{})
	go func() { defer close(done); r.Serve() }() // exits at StopBgp
	if err := r.StartBgp(context.Background(), &gobgpapi.StartBgpRequest{Global: &gobgpapi.Global{
		Asn: asn, RouterId: "127.0.0.2", ListenPort: int32(port), ListenAddresses: []string{"127.0.0.1"}}}); err != nil {
		t.Fatal(err)
	}
	if err := r.AddPeer(context.Background(), &gobgpapi.AddPeerRequest{Peer: &gobgpapi.Peer{
		Conf:      &gobgpapi.PeerConf{NeighborAddress: "127.0.0.1", PeerAsn: 65001},
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
// with an error that status shows.
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
	if err := s.Run(ctx); err == nil {
		t.Fatal("Run: got nil; want the listen port's error")
	}
	if st := s.Status(); st.Error == "" {
		t.Errorf("status: %+v; want the error", st)
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
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- s.Run(ctx) }() // exits when ctx is cancelled
			t.Cleanup(func() {
				cancel()
				<-done
			})
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
