package loader

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"testing"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// TestNATTwoArmed puts clients and the backend on different interfaces of the
// balancer, so nat packets leave by XDP_REDIRECT, in both directions and both
// families. Without static neighbour entries the loader adds managed ones and the
// kernel resolves them; packets that arrive before that are passed to the kernel
// (pass_no_neighbour), and either way every request succeeds.
func TestNATTwoArmed(t *testing.T) {
	for _, tc := range []struct {
		mode       Mode
		staticNeig bool
	}{
		{ModeNative, true},
		{ModeGeneric, true},
		{ModeNative, false},
	} {
		t.Run(fmt.Sprintf("%s/static-neighbours=%t", tc.mode, tc.staticNeig), func(t *testing.T) {
			tp := topo.NewTwoArmedT(t, topo.TwoArmedConfig{StaticNeighbours: tc.staticNeig})
			ln, err := tp.Backend.NS.Listen("tcp", ":80")
			if err != nil {
				t.Fatal(err)
			}
			srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.WriteString(w, "backend-0 saw "+r.RemoteAddr)
			})}
			// Exits when the server is closed at cleanup.
			go srv.Serve(ln)
			t.Cleanup(func() { srv.Close() })

			p, err := Load(Options{NAT: NATOptions{Addr4: tp.BackendSide.IP4, Addr6: tp.BackendSide.IP6}})
			xdptest.Check(t, err)
			t.Cleanup(func() { p.Close() })
			err = tp.Balancer.Do(func() error {
				for _, link := range []string{tp.ClientSide.Link, tp.BackendSide.Link} {
					if got, err := p.Attach(link, tc.mode); err != nil {
						return err
					} else if got != tc.mode {
						return fmt.Errorf("attached to %s in %s mode; want %s", link, got, tc.mode)
					}
				}
				return nil
			})
			xdptest.Check(t, err)
			for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
				be := tp.Backend.IP4
				if vip.Is6() {
					be = tp.Backend.IP6
				}
				err := p.AddService(Service{Key: ServiceKey{netip.AddrPortFrom(vip, 80), TCP}, Forwarding: ForwardNAT,
					Backends: []Backend{{Addr: netip.AddrPortFrom(be, 80), Weight: 1, Usable: true}}})
				if err != nil {
					t.Fatal(err)
				}
			}

			client := tp.HTTPClient()
			for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
				natAddr := tp.BackendSide.IP4
				if vip.Is6() {
					natAddr = tp.BackendSide.IP6
				}
				for i := range 50 {
					resp, err := client.Get("http://" + netip.AddrPortFrom(vip, 80).String() + "/")
					if err != nil {
						t.Fatalf("request %d to %s: %v", i, vip, err)
					}
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					// The backend sees the balancer's nat address, never the client.
					host, _, _ := net.SplitHostPort(string(body[len("backend-0 saw "):]))
					if got, _ := netip.ParseAddr(host); got != natAddr {
						t.Fatalf("backend saw the connection from %s; want the nat address %s", host, natAddr)
					}
				}
			}
			st, err := p.Stats()
			if err != nil {
				t.Fatal(err)
			}
			if st.Reasons[ReasonRedirect].Packets == 0 || st.Reasons[ReasonNATReply].Packets == 0 {
				t.Errorf("redirected %d, replies %d; want both > 0", st.Reasons[ReasonRedirect].Packets, st.Reasons[ReasonNATReply].Packets)
			}
			if err := p.NextHopError(); err != nil {
				t.Errorf("next hops: %v", err)
			}
			t.Logf("redirect %d, nat_reply %d, pass_no_neighbour %d", st.Reasons[ReasonRedirect].Packets,
				st.Reasons[ReasonNATReply].Packets, st.Reasons[ReasonPassNoNeighbour].Packets)
		})
	}
}
