package loader

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// TestTunnelEndToEnd runs tunnel mode through a router to backends in other subnets,
// each with weir's decap program: new connections are answered directly (the replies
// never reach the balancer), a bulk transfer arrives intact — which needs path-MTU
// discovery through the ICMP errors the balancer sends for packets too big to
// encapsulate — in both families and both attach modes.
func TestTunnelEndToEnd(t *testing.T) {
	for _, mode := range []Mode{ModeNative, ModeGeneric} {
		t.Run(string(mode), func(t *testing.T) {
			tp := topo.NewRoutedT(t, 3)
			p, decaps := tunnelRig(t, tp, mode, 3)
			for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
				for _, s := range []Service{tunnelService(vip, 80, tp.Backends), tunnelService(vip, echoPort, tp.Backends[:1])} {
					if err := p.AddService(s); err != nil {
						t.Fatal(err)
					}
				}
			}

			client := &http.Client{Transport: &http.Transport{
				DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
					return tp.Client.NS.DialWith(ctx, &net.Dialer{Timeout: 3 * time.Second}, network, addr)
				},
				DisableKeepAlives: true,
			}, Timeout: 10 * time.Second}
			for _, tc := range []struct {
				vip netip.Addr
				n   int
			}{{tp.VIP4, 1000}, {tp.VIP6, 600}} {
				answers := tunnelRequests(t, client, tc.vip, tc.n)
				for i := range tp.Backends {
					name := fmt.Sprintf("backend-%d", i)
					if share := float64(answers[name]) / float64(tc.n); share < 0.7/3 || share > 1.3/3 {
						t.Errorf("%s: %s answered %.1f%%; want within ±30%% of a third", tc.vip, name, 100*share)
					}
				}
			}
			for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
				tunnelBulk(t, tp.Client, netip.AddrPortFrom(vip, echoPort), 50<<20)
			}

			st, err := p.Stats()
			if err != nil {
				t.Fatal(err)
			}
			var decapsulated, malformed uint64
			for _, d := range decaps {
				ds, err := d.Stats()
				if err != nil {
					t.Fatal(err)
				}
				decapsulated += ds.Decapsulated.Packets
				malformed += ds.Malformed.Packets
			}
			sent := st.Reasons[ReasonRedirect].Packets + st.Reasons[ReasonPassNoNeighbour].Packets
			dropped, where := pathDrops(t, tp)
			t.Logf("balancer: redirect %d, pass_no_neighbour %d, tunnel_too_big %d, pass_not_service %d, pass_not_ip %d; backends decapsulated %d; the links on the way dropped %d (%s)",
				st.Reasons[ReasonRedirect].Packets, st.Reasons[ReasonPassNoNeighbour].Packets, st.Reasons[ReasonTunnelTooBig].Packets,
				st.Reasons[ReasonPassNotService].Packets, st.Reasons[ReasonPassNotIP].Packets, decapsulated, dropped, where)
			// Every packet the balancer encapsulated was decapsulated, but for those a
			// veth on the way dropped (its peer's XDP ring was full: the next program
			// ran behind the bulk transfer on this 2-CPU machine), and none was
			// malformed. Under two loaded CI runs a few more went missing while only
			// the router's links to the backends were counted (4 of 85,861 in one run,
			// 250 of 90,855 beside 112 counted in another, in runs that changed no
			// forwarding code; the TCP transfers above completed); the balancer's link
			// to the router is counted too since, and the log line says which pair
			// dropped what. Up to 0.5 % of the packets may go unaccounted, which
			// encapsulation that decapsulators refuse (all of a family's packets, or
			// all past some size) would far exceed.
			if malformed != 0 {
				t.Errorf("the backends' decapsulators found %d malformed tunnel packets; want none", malformed)
			}
			// The links' counters count every packet they drop, a neighbour
			// discovery or ICMP packet too, so they may exceed what went missing
			// (one drop beside 0 missing in a CI run).
			lost := int64(sent) - int64(decapsulated+dropped)
			if lost > 0 {
				t.Logf("%d packets encapsulated, not decapsulated and not counted dropped on the router's links", lost)
			}
			if decapsulated > sent || float64(lost) > 0.005*float64(sent) {
				t.Errorf("backends decapsulated %d packets and the links on the way dropped %d; the balancer encapsulated %d", decapsulated, dropped, sent)
			}
			if st.Reasons[ReasonTunnelTooBig].Packets == 0 {
				t.Error("no packet was answered as too big; the bulk transfer should have needed path-MTU discovery")
			}
			// Thousands of replies went to the client; at most a few neighbour
			// discovery packets may reach the balancer besides its clients' traffic.
			if n := st.Reasons[ReasonPassNotService].Packets; n > 50 {
				t.Errorf("the balancer passed %d packets not to a service; want the replies to bypass it", n)
			}
		})
	}
}

// tunnelRig readies tp for tunnel mode in attach mode mode: each backend serves
// (serveBackend, named backend-i) and strips the tunnel with weir's decap program,
// and the balancer runs tunnelBalancer's program. It returns the program and the
// decapsulators, in the backends' order; t's cleanup closes them.
func tunnelRig(t *testing.T, tp *topo.Routed, mode Mode, seed uint32) (*Program, []*Decap) {
	t.Helper()
	var decaps []*Decap
	for i, b := range tp.Backends {
		serveBackend(t, b, fmt.Sprintf("backend-%d", i))
		d, err := LoadDecap([]netip.Addr{b.IP4, b.IP6})
		xdptest.Check(t, err)
		t.Cleanup(func() { d.Close() })
		err = b.NS.Do(func() error { _, err := d.Attach(b.Link, mode); return err })
		xdptest.Check(t, err)
		decaps = append(decaps, d)
	}
	return tunnelBalancer(t, tp, mode, seed), decaps
}

// tunnelBalancer loads the program with hash seed seed and tp's balancer-side
// addresses as its own, and attaches it in mode to both of the balancer's links;
// tb's cleanup closes it.
func tunnelBalancer(tb testing.TB, tp *topo.Routed, mode Mode, seed uint32) *Program {
	tb.Helper()
	p, err := Load(Options{HashSeed: seed, NAT: NATOptions{Addr4: tp.BalancerUp.IP4, Addr6: tp.BalancerUp.IP6}})
	xdptest.Check(tb, err)
	tb.Cleanup(func() { p.Close() })
	err = tp.Balancer.NS.Do(func() error {
		for _, link := range []string{tp.Balancer.Link, tp.BalancerUp.Link} {
			if _, err := p.Attach(link, mode); err != nil {
				return err
			}
		}
		return nil
	})
	xdptest.Check(tb, err)
	return p
}

// tunnelService is a tunnel-mode TCP service on vip:port whose backends are hosts,
// by their address in vip's family, each of weight 1.
func tunnelService(vip netip.Addr, port uint16, hosts []topo.Host) Service {
	s := Service{Key: ServiceKey{netip.AddrPortFrom(vip, port), TCP}, Forwarding: ForwardTunnel}
	for _, h := range hosts {
		ip := h.IP4
		if vip.Is6() {
			ip = h.IP6
		}
		s.Backends = append(s.Backends, Backend{Addr: netip.AddrPortFrom(ip, port), Weight: 1, Usable: true})
	}
	return s
}

// serveBackend serves HTTP (its name) on :80 and an echo on echoPort in b's namespace.
func serveBackend(t *testing.T, b topo.Host, name string) {
	t.Helper()
	ln, err := b.NS.Listen("tcp", ":80")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, name) })}
	// Exits when the server is closed at cleanup.
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	serveEcho(t, b.NS, echoPort)
}

func tunnelRequests(t *testing.T, client *http.Client, vip netip.Addr, n int) map[string]int {
	t.Helper()
	answers := make(map[string]int)
	var mu sync.Mutex
	var wg sync.WaitGroup
	var failures []error
	work := make(chan struct{})
	for range 8 {
		wg.Add(1)
		// Exits when work is closed.
		go func() {
			defer wg.Done()
			for range work {
				resp, err := client.Get("http://" + netip.AddrPortFrom(vip, 80).String() + "/")
				var body []byte
				if err == nil {
					body, err = io.ReadAll(resp.Body)
					resp.Body.Close()
				}
				mu.Lock()
				if err != nil {
					failures = append(failures, err)
				} else {
					answers[string(body)]++
				}
				mu.Unlock()
			}
		}()
	}
	for range n {
		work <- struct{}{}
	}
	close(work)
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("%s: %d of %d requests failed; first: %v", vip, len(failures), n, failures[0])
	}
	return answers
}

func tunnelBulk(t *testing.T, client topo.Host, dst netip.AddrPort, size int64) {
	t.Helper()
	conn, err := client.NS.DialWith(context.Background(), &net.Dialer{Timeout: 3 * time.Second}, "tcp", dst.String())
	if err != nil {
		t.Fatal(err)
	}
	c := conn.(*net.TCPConn)
	defer c.Close()
	c.SetDeadline(time.Now().Add(60 * time.Second))
	sent := sha256.New()
	errc := make(chan error, 1)
	// Exits when the whole payload is written.
	go func() {
		_, err := io.Copy(c, io.TeeReader(io.LimitReader(newPattern(), size), sent))
		if err == nil {
			err = c.CloseWrite()
		}
		errc <- err
	}()
	got := sha256.New()
	n, err := io.Copy(got, c)
	if err != nil {
		t.Fatalf("%s: read back after %d bytes: %v", dst, n, err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if n != size || string(got.Sum(nil)) != string(sent.Sum(nil)) {
		t.Fatalf("%s: echoed %d bytes, sha256 %x; want %d bytes, %x", dst, n, got.Sum(nil), size, sent.Sum(nil))
	}
}

// pathDrops is what the veth pairs on the tunnel's way dropped of the frames
// going from the balancer to the router (lr to rl) and from the router to each
// backend (rb<i> to b0), with how many each pair dropped. A veth drops a frame
// its peer's XDP ring has no room for, and such a drop can show on both ends
// (the sender's tx_dropped, the receiver's rx_dropped), so each pair counts
// the larger of its two.
func pathDrops(t *testing.T, tp *topo.Routed) (uint64, string) {
	t.Helper()
	dropped := func(h topo.Host, tx bool) uint64 {
		var n uint64
		err := h.NS.Do(func() error {
			l, err := netlink.LinkByName(h.Link)
			if err != nil {
				return err
			}
			if s := l.Attrs().Statistics; s != nil {
				n = s.RxDropped
				if tx {
					n = s.TxDropped
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	router := func(link string) topo.Host { return topo.Host{NS: tp.Router, Link: link} }
	type pair struct {
		name     string
		from, to topo.Host
	}
	pairs := []pair{{"lr>rl", tp.BalancerUp, router("rl")}}
	for i, b := range tp.Backends {
		pairs = append(pairs, pair{fmt.Sprintf("rb%d>b0", i), router(fmt.Sprintf("rb%d", i)), b})
	}
	var total uint64
	var each []string
	for _, p := range pairs {
		n := max(dropped(p.from, true), dropped(p.to, false))
		total += n
		each = append(each, fmt.Sprintf("%s %d", p.name, n))
	}
	return total, strings.Join(each, ", ")
}

// TestTunnelReplyPathMTU narrows the link from the router to the client, on the
// backends' way back only, so the router answers their large replies (from the VIP)
// with ICMP "fragmentation needed" / "packet too big", which it routes to the VIP,
// and so to the balancer. The balancer sends each error on to the flow's backend in
// the tunnel; without that the backend never lowers its path MTU and the echoed
// bulk transfer stalls.
func TestTunnelReplyPathMTU(t *testing.T) {
	tp := topo.NewRoutedT(t, 2)
	p, _ := tunnelRig(t, tp, ModeNative, 5)
	for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
		if err := p.AddService(tunnelService(vip, echoPort, tp.Backends)); err != nil {
			t.Fatal(err)
		}
	}
	// The router routes the VIPs to the balancer, as a network that announces them
	// does, and its link towards the client's return side carries 1,280 bytes.
	err := tp.Router.Do(func() error {
		for _, r := range []struct{ vip, via netip.Addr }{{tp.VIP4, tp.BalancerUp.IP4}, {tp.VIP6, tp.BalancerUp.IP6}} {
			dst := &net.IPNet{IP: r.vip.AsSlice(), Mask: net.CIDRMask(r.vip.BitLen(), r.vip.BitLen())}
			if err := netlink.RouteAdd(&netlink.Route{Dst: dst, Gw: r.via.AsSlice()}); err != nil {
				return fmt.Errorf("route %s via %s: %w", r.vip, r.via, err)
			}
		}
		l, err := netlink.LinkByName("rc")
		if err != nil {
			return err
		}
		return netlink.LinkSetMTU(l, 1280)
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
		before, err := p.Stats()
		if err != nil {
			t.Fatal(err)
		}
		tunnelBulk(t, tp.Client, netip.AddrPortFrom(vip, echoPort), 8<<20)
		after, err := p.Stats()
		if err != nil {
			t.Fatal(err)
		}
		n := after.Reasons[ReasonICMPToBackend].Packets - before.Reasons[ReasonICMPToBackend].Packets
		t.Logf("%s: %d ICMP errors sent on to the backend", vip, n)
		if n == 0 {
			t.Errorf("%s: no ICMP error went on to the backend; the transfer should have needed one", vip)
		}
	}
}
