package topo

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/weir-lb/weir/internal/netns"
)

// Routed puts the backends in other subnets than the balancer, behind a router, as
// tunnel mode expects. The client reaches the VIPs through the balancer; the
// backends answer it directly through the router.
//
//	client c0 10.79.1.1 ──── lc 10.79.1.2  balancer  lr 10.79.4.2 ──── rl 10.79.4.254  router
//	client c1 10.79.3.1 ──── rc 10.79.3.254 router
//	router rb<i> 10.79.(10+i).254 ──── b0 10.79.(10+i).11 backend-i (VIPs on lo)
//
// IPv6 the same in fd79:<subnet>::/64. The balancer routes 10.79.0.0/16 and fd79::/16
// via the router; the router routes the client's 10.79.1.0/24 via c1, so replies
// never pass the balancer. Links that receive frames from the balancer's native XDP
// (the client's c0 for ICMP errors, the router's rl) carry an XDP_PASS program.
// Every link has tx checksum offload off and MTU 1500.
type Routed struct {
	group
	Name         string
	Client       Host // Link c0, towards the balancer
	ClientReturn Host // the client's second link c1, towards the router
	Balancer     Host // Link lc, towards the client
	BalancerUp   Host // the balancer's link lr, towards the router
	Router       *netns.NS
	Backends     []Host // Link b0 in each backend's namespace
	VIP4, VIP6   netip.Addr
}

// Addresses of the routed topology.
var (
	RoutedVIP4 = netip.MustParseAddr("10.79.100.1")
	RoutedVIP6 = netip.MustParseAddr("fd79:100::1")
)

// NewRouted builds the routed topology with n backends (1..50).
func NewRouted(name string, n int) (_ *Routed, err error) {
	if name == "" {
		name = UniqueName("wrt")
	}
	if len(name) > MaxNameLen || !nameRE.MatchString(name) {
		return nil, fmt.Errorf("topology name %q: want 1-%d characters of [A-Za-z0-9_]", name, MaxNameLen)
	}
	if n < 1 || n > 50 {
		return nil, fmt.Errorf("topology %s: backends: want 1-50, got %d", name, n)
	}
	t := &Routed{group: group{name: name}, Name: name, VIP4: RoutedVIP4, VIP6: RoutedVIP6}
	defer func() {
		if err != nil {
			t.Close()
		}
	}()
	mk := t.newNS
	host := func(name, link string, ns *netns.NS, subnet, octet int) Host {
		return Host{
			Name: name, Link: link, NS: ns,
			IP4: netip.AddrFrom4([4]byte{10, 79, byte(subnet), byte(octet)}),
			IP6: netip.MustParseAddr(fmt.Sprintf("fd79:%d::%d", subnet, octet)),
			MAC: net.HardwareAddr{0x02, 0x79, byte(subnet), 0, 0, byte(octet)},
		}
	}
	clientNS, err := mk("cl")
	if err != nil {
		return nil, err
	}
	lbNS, err := mk("lb")
	if err != nil {
		return nil, err
	}
	if t.Router, err = mk("rt"); err != nil {
		return nil, err
	}
	if err := t.loadPass(); err != nil {
		return nil, err
	}
	t.Client = host("client", "c0", clientNS, 1, 1)
	t.Balancer = host("balancer", "lc", lbNS, 1, 2)
	t.ClientReturn = host("client", "c1", clientNS, 3, 1)
	routerClient := host("router", "rc", t.Router, 3, 254)
	t.BalancerUp = host("balancer", "lr", lbNS, 4, 2)
	routerBalancer := host("router", "rl", t.Router, 4, 254)
	links := []struct{ a, b *Host }{{&t.Balancer, &t.Client}, {&routerClient, &t.ClientReturn}, {&t.BalancerUp, &routerBalancer}}
	for i := range n {
		ns, err := mk(fmt.Sprintf("be%d", i))
		if err != nil {
			return nil, err
		}
		t.Backends = append(t.Backends, host(fmt.Sprintf("backend-%d", i), "b0", ns, 10+i, 11))
	}
	routerBackends := make([]Host, n)
	for i := range n {
		routerBackends[i] = host("router", fmt.Sprintf("rb%d", i), t.Router, 10+i, 254)
		links = append(links, struct{ a, b *Host }{&routerBackends[i], &t.Backends[i]})
	}
	for _, l := range links {
		if err := connect(l.a, l.b); err != nil {
			return nil, fmt.Errorf("topology %s: %w", t.Name, err)
		}
	}
	for _, h := range []*Host{&t.Client, &routerBalancer} {
		if err := attachPass(h, t.pass); err != nil {
			return nil, fmt.Errorf("topology %s: %w", t.Name, err)
		}
	}

	noFilter := []string{"net/ipv4/conf/all/rp_filter", "0", "net/ipv4/conf/default/rp_filter", "0"}
	for _, ns := range t.namespaces {
		if err := sysctls(ns, noFilter...); err != nil {
			return nil, err
		}
	}
	if err := sysctls(t.Router, "net/ipv4/ip_forward", "1", "net/ipv6/conf/all/forwarding", "1"); err != nil {
		return nil, err
	}
	if err := sysctls(lbNS, "net/ipv4/ip_forward", "1", "net/ipv6/conf/all/forwarding", "1",
		"net/ipv4/conf/all/accept_local", "1", "net/ipv4/conf/lc/accept_local", "1"); err != nil {
		return nil, err
	}
	// Routes: client -> VIPs via the balancer; balancer -> backends via the router;
	// router -> client's first subnet via its second link; backends -> default via
	// the router.
	for _, r := range []struct {
		h   Host
		dst netip.Prefix
		via netip.Addr
	}{
		{t.Client, netip.PrefixFrom(t.VIP4, 24), t.Balancer.IP4},
		{t.Client, netip.PrefixFrom(t.VIP6, 64), t.Balancer.IP6},
		{t.Balancer, netip.MustParsePrefix("10.79.0.0/16"), routerBalancer.IP4},
		{t.Balancer, netip.MustParsePrefix("fd79::/16"), routerBalancer.IP6},
		{routerClient, netip.PrefixFrom(t.Client.IP4, 24), t.ClientReturn.IP4},
		{routerClient, netip.PrefixFrom(t.Client.IP6, 64), t.ClientReturn.IP6},
	} {
		if err := route(r.h, r.dst.Addr(), r.dst.Bits(), r.via); err != nil {
			return nil, err
		}
	}
	for i, b := range t.Backends {
		if err := route(b, netip.IPv4Unspecified(), 0, routerBackends[i].IP4); err != nil {
			return nil, err
		}
		if err := route(b, netip.IPv6Unspecified(), 0, routerBackends[i].IP6); err != nil {
			return nil, err
		}
		if err := sysctls(b.NS, "net/ipv4/conf/all/arp_ignore", "1", "net/ipv4/conf/all/arp_announce", "2"); err != nil {
			return nil, err
		}
		for _, vip := range []netip.Addr{t.VIP4, t.VIP6} {
			if err := addLoopback(b.NS, vip); err != nil {
				return nil, err
			}
		}
	}
	return t, nil
}

// NewRoutedT is NewRouted for tests, closed at cleanup; see NewT for the rule on
// missing privileges.
func NewRoutedT(tb TB, n int) *Routed {
	tb.Helper()
	return newT(tb, func() (*Routed, error) { return NewRouted("", n) })
}
