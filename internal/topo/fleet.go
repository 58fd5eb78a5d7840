package topo

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
)

// Fleet is several balancer nodes behind one router, as a fleet runs: the router
// reaches the VIPs through the nodes (ECMP, from what the nodes announce over
// BGP), the client sits behind the router, and the backends are reachable from
// every node two ways.
//
//	client c0 10.80.1.1 (+ 10.80.1.100..) ──── rc 10.80.1.254  router
//	fabric 10.80.0.0/24, a bridge in its own namespace:
//	  router f0 10.80.0.254, node-i n0 10.80.0.(1+i), dsr backend-j b0 10.80.0.(11+j)
//	router rt<j> 10.80.(10+j).254 ──── t0 10.80.(10+j).11  tunnel backend-j
//
// IPv6 the same in fd80:<subnet>::/64 (the fabric is fd80::/64). dsr backends share
// the fabric with the nodes and answer the client through the router; tunnel
// backends sit in subnets of their own behind the router, so a node's IPIP packets
// to them are routed. Every backend holds the VIPs on lo. The router forwards with
// the 5-tuple multipath hash (fib_multipath_hash_policy=1, both families). The
// nodes' bridge ports carry the XDP_PASS program, so the nodes' native XDP_TX is
// delivered; every fabric host has permanent neighbour entries for the others.
type Fleet struct {
	group
	Name string
	// Bridge is the fabric's namespace, BridgeLink its bridge.
	Bridge     *netns.NS
	BridgeLink string
	Client     Host // Link c0, towards the router
	// ClientAddrs are the client's source addresses (its own first).
	ClientAddrs []netip.Addr
	Router      Host // Link f0 on the fabric
	RouterNS    *netns.NS
	Nodes       []Host // Link n0
	DSR         []Host // Link b0, on the fabric
	Tunnel      []Host // Link t0, behind the router
	// NodePeers are the nodes' bridge-side veth names, by node.
	NodePeers []string
}

// FleetPrefix begins the names of fleet topologies by default (weir demo
// fleet's): the first of them in a process removes those of this prefix whose
// process has exited (CleanupStale).
const FleetPrefix = "wfl"

// FleetConfig describes a fleet topology.
type FleetConfig struct {
	Name           string // as Config.Name; empty: UniqueName(FleetPrefix)
	Nodes          int    // 1..9, default 3
	DSRBackends    int    // 0..40
	TunnelBackends int    // 0..40
	ClientAddrs    int    // extra client source addresses, 0..150
}

// Addresses of the fleet topology.
var (
	FleetVIP4       = netip.MustParseAddr("10.80.100.1")
	FleetVIP4Tunnel = netip.MustParseAddr("10.80.100.2")
	FleetVIP4NAT    = netip.MustParseAddr("10.80.100.3") // on no backend: nat translates it
	FleetVIP6       = netip.MustParseAddr("fd80:100::1")
	FleetNet        = netip.MustParsePrefix("10.80.0.0/16")
	FleetNet6       = netip.MustParsePrefix("fd80::/16")
)

func fleetHost(name, link string, ns *netns.NS, subnet, octet int) Host {
	return Host{
		Name: name, Link: link, NS: ns,
		IP4: netip.AddrFrom4([4]byte{10, 80, byte(subnet), byte(octet)}),
		IP6: netip.MustParseAddr(fmt.Sprintf("fd80:%d::%d", subnet, octet)),
		MAC: net.HardwareAddr{0x02, 0x80, byte(subnet), 0, 0, byte(octet)},
	}
}

// NewFleet builds the fleet topology.
func NewFleet(cfg FleetConfig) (_ *Fleet, err error) {
	if cfg.Name == "" {
		cfg.Name = UniqueName(FleetPrefix)
	}
	if cfg.Nodes == 0 {
		cfg.Nodes = 3
	}
	switch {
	case len(cfg.Name) > MaxNameLen || !nameRE.MatchString(cfg.Name):
		return nil, fmt.Errorf("topology name %q: want 1-%d characters of [A-Za-z0-9_]", cfg.Name, MaxNameLen)
	case cfg.Nodes < 1 || cfg.Nodes > 9:
		return nil, fmt.Errorf("fleet %s: nodes: want 1-9, got %d", cfg.Name, cfg.Nodes)
	case cfg.DSRBackends < 0 || cfg.DSRBackends > 40 || cfg.TunnelBackends < 0 || cfg.TunnelBackends > 40:
		return nil, fmt.Errorf("fleet %s: backends: want 0-40 of each kind", cfg.Name)
	case cfg.ClientAddrs < 0 || cfg.ClientAddrs > 150:
		return nil, fmt.Errorf("fleet %s: client addresses: want 0-150, got %d", cfg.Name, cfg.ClientAddrs)
	}
	t := &Fleet{group: group{name: cfg.Name}, Name: cfg.Name, BridgeLink: "br0"}
	defer func() {
		if err != nil {
			t.Close()
		}
	}()
	if t.Bridge, err = t.newNS("br"); err != nil {
		return nil, err
	}
	if t.RouterNS, err = t.newNS("rt"); err != nil {
		return nil, err
	}
	clientNS, err := t.newNS("cl")
	if err != nil {
		return nil, err
	}
	if err := t.loadPass(); err != nil {
		return nil, err
	}
	if err := sysctls(t.Bridge, "net/ipv6/conf/all/disable_ipv6", "1", "net/ipv6/conf/default/disable_ipv6", "1"); err != nil {
		return nil, err
	}
	if err := t.Bridge.Do(func() error {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: t.BridgeLink}}
		if err := netlink.LinkAdd(br); err != nil {
			return fmt.Errorf("add bridge: %w", err)
		}
		return netlink.LinkSetUp(br)
	}); err != nil {
		return nil, fmt.Errorf("fleet %s: %w", t.Name, err)
	}

	t.Client = fleetHost("client", "c0", clientNS, 1, 1)
	routerClient := fleetHost("router", "rc", t.RouterNS, 1, 254)
	t.Router = fleetHost("router", "f0", t.RouterNS, 0, 254)
	if err := connect(&routerClient, &t.Client); err != nil {
		return nil, fmt.Errorf("fleet %s: %w", t.Name, err)
	}
	var fabric []*Host
	fabric = append(fabric, &t.Router)
	for i := range cfg.Nodes {
		ns, err := t.newNS(fmt.Sprintf("n%d", i))
		if err != nil {
			return nil, err
		}
		t.Nodes = append(t.Nodes, fleetHost(fmt.Sprintf("node-%d", i), "n0", ns, 0, 1+i))
	}
	for j := range cfg.DSRBackends {
		ns, err := t.newNS(fmt.Sprintf("d%d", j))
		if err != nil {
			return nil, err
		}
		t.DSR = append(t.DSR, fleetHost(fmt.Sprintf("dsr-%d", j), "b0", ns, 0, 11+j))
	}
	for i := range t.Nodes {
		fabric = append(fabric, &t.Nodes[i])
	}
	for i := range t.DSR {
		fabric = append(fabric, &t.DSR[i])
	}
	for i, h := range fabric {
		peer := fmt.Sprintf("p%d", i)
		if err := t.port(h, peer); err != nil {
			return nil, fmt.Errorf("fleet %s: %s: %w", t.Name, h.Name, err)
		}
		if h.Name[:4] == "node" {
			t.NodePeers = append(t.NodePeers, peer)
			if err := t.Bridge.Do(func() error {
				l, err := netlink.LinkByName(peer)
				if err != nil {
					return err
				}
				return netlink.LinkSetXdpFdWithFlags(l, t.pass.FD(), nl.XDP_FLAGS_DRV_MODE)
			}); err != nil {
				return nil, fmt.Errorf("fleet %s: xdp_pass on %s: %w", t.Name, peer, err)
			}
		}
	}
	for _, h := range fabric {
		for _, o := range fabric {
			if o != h {
				if err := neighbours(h.NS, h.Link, *o); err != nil {
					return nil, err
				}
			}
		}
	}
	var routerTunnel []Host
	for j := range cfg.TunnelBackends {
		ns, err := t.newNS(fmt.Sprintf("t%d", j))
		if err != nil {
			return nil, err
		}
		t.Tunnel = append(t.Tunnel, fleetHost(fmt.Sprintf("tunnel-%d", j), "t0", ns, 10+j, 11))
		routerTunnel = append(routerTunnel, fleetHost("router", fmt.Sprintf("rt%d", j), t.RouterNS, 10+j, 254))
	}
	for j := range t.Tunnel {
		if err := connect(&routerTunnel[j], &t.Tunnel[j]); err != nil {
			return nil, fmt.Errorf("fleet %s: %w", t.Name, err)
		}
	}

	noFilter := []string{"net/ipv4/conf/all/rp_filter", "0", "net/ipv4/conf/default/rp_filter", "0"}
	for _, ns := range t.namespaces[1:] {
		if err := sysctls(ns, noFilter...); err != nil {
			return nil, err
		}
	}
	if err := sysctls(t.RouterNS, "net/ipv4/ip_forward", "1", "net/ipv6/conf/all/forwarding", "1",
		"net/ipv4/fib_multipath_hash_policy", "1", "net/ipv6/fib_multipath_hash_policy", "1"); err != nil {
		return nil, err
	}
	if err := sysctls(clientNS, "net/ipv4/tcp_tw_reuse", "1"); err != nil {
		return nil, err
	}
	// The client: more source addresses, and everything via the router.
	t.ClientAddrs = []netip.Addr{t.Client.IP4}
	if err := clientNS.Do(func() error {
		l, err := netlink.LinkByName(t.Client.Link)
		if err != nil {
			return err
		}
		for k := range cfg.ClientAddrs {
			a := netip.AddrFrom4([4]byte{10, 80, 1, byte(100 + k)})
			addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(24, 32)}, Flags: unix.IFA_F_NODAD}
			if err := netlink.AddrAdd(l, addr); err != nil {
				return fmt.Errorf("client address %s: %w", a, err)
			}
			t.ClientAddrs = append(t.ClientAddrs, a)
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("fleet %s: %w", t.Name, err)
	}
	type r struct {
		h   Host
		dst netip.Prefix
		via netip.Addr
	}
	routes := []r{
		{t.Client, netip.PrefixFrom(netip.IPv4Unspecified(), 0), routerClient.IP4},
		{t.Client, netip.PrefixFrom(netip.IPv6Unspecified(), 0), routerClient.IP6},
	}
	for _, n := range t.Nodes {
		// Forwarding on, so the program's next-hop lookups answer; tunnel packets
		// to the backends' subnets go through the router.
		if err := sysctls(n.NS, "net/ipv4/ip_forward", "1", "net/ipv6/conf/all/forwarding", "1"); err != nil {
			return nil, err
		}
		routes = append(routes, r{n, FleetNet, t.Router.IP4}, r{n, FleetNet6, t.Router.IP6})
	}
	for _, b := range t.DSR {
		routes = append(routes, r{b, netip.PrefixFrom(netip.IPv4Unspecified(), 0), t.Router.IP4},
			r{b, netip.PrefixFrom(netip.IPv6Unspecified(), 0), t.Router.IP6})
	}
	for j, b := range t.Tunnel {
		routes = append(routes, r{b, netip.PrefixFrom(netip.IPv4Unspecified(), 0), routerTunnel[j].IP4},
			r{b, netip.PrefixFrom(netip.IPv6Unspecified(), 0), routerTunnel[j].IP6})
	}
	for _, x := range routes {
		if err := route(x.h, x.dst.Addr(), x.dst.Bits(), x.via); err != nil {
			return nil, err
		}
	}
	for _, b := range append(append([]Host{}, t.DSR...), t.Tunnel...) {
		if err := sysctls(b.NS, "net/ipv4/conf/all/arp_ignore", "1", "net/ipv4/conf/all/arp_announce", "2"); err != nil {
			return nil, err
		}
		for _, vip := range []netip.Addr{FleetVIP4, FleetVIP4Tunnel, FleetVIP6} {
			if err := addLoopback(b.NS, vip); err != nil {
				return nil, err
			}
		}
	}
	return t, nil
}

// port connects h to the fabric bridge through a veth pair whose bridge end is
// peer, and gives h's end its addresses.
func (t *Fleet) port(h *Host, peer string) error {
	if err := sysctls(h.NS, "net/ipv6/conf/all/accept_dad", "0", "net/ipv6/conf/default/accept_dad", "0",
		"net/ipv6/conf/all/router_solicitations", "0", "net/ipv6/conf/default/router_solicitations", "0"); err != nil {
		return err
	}
	bridgeSide := Host{Name: "bridge", Link: peer, NS: t.Bridge} // no addresses: a bridge port
	if err := connect(&bridgeSide, h); err != nil {
		return err
	}
	return t.Bridge.Do(func() error {
		br, err := netlink.LinkByName(t.BridgeLink)
		if err != nil {
			return err
		}
		l, err := netlink.LinkByName(peer)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetMaster(l, br); err != nil {
			return err
		}
		return netlink.LinkSetUp(l)
	})
}

// DeleteNodeLink removes node i's fabric link (both ends of its veth pair), as if
// the node had died: nothing it had open is closed towards its peers.
func (t *Fleet) DeleteNodeLink(i int) error {
	return t.Nodes[i].NS.Do(func() error {
		l, err := netlink.LinkByName(t.Nodes[i].Link)
		if err != nil {
			return err
		}
		return netlink.LinkDel(l)
	})
}

// NewFleetT is NewFleet for tests, closed at cleanup; see NewT for the rule on
// missing privileges.
func NewFleetT(tb TB, cfg FleetConfig) *Fleet {
	tb.Helper()
	return newT(tb, func() (*Fleet, error) { return NewFleet(cfg) })
}
