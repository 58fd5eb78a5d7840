package topo

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
)

// TwoArmed is a balancer with two interfaces on two subnets: clients on one, the
// backend on the other, joined by plain veth pairs (no bridge). A nat packet then
// leaves by the other interface than it came in on: XDP_REDIRECT.
//
//	client 10.78.1.1 fd78:1::1 ──veth── [lbc 10.78.1.2 fd78:1::2  balancer  lbb 10.78.2.2 fd78:2::2] ──veth── backend 10.78.2.11 fd78:2::11
//
// The client routes the VIPs (10.78.100.1, fd78:100::1) via the balancer. The
// client's and backend's links carry a native XDP_PASS program, so frames the
// balancer sends them by native XDP_TX or XDP_REDIRECT are delivered, and have tx
// checksum offload off. The balancer forwards (ip_forward, IPv6 forwarding) and
// accepts packets with its own source address (accept_local), which the kernel
// sees when the program passes it a translated packet whose next hop it has yet to
// resolve.
type TwoArmed struct {
	group
	Name                    string
	Client, Backend         Host // Link is the host's own link; PeerLink its balancer-side end
	Balancer                *netns.NS
	ClientSide, BackendSide Host // the balancer's two links (NS is Balancer)
	VIP4, VIP6              netip.Addr
}

// TwoArmedConfig describes a two-armed topology.
type TwoArmedConfig struct {
	Name string // as Config.Name; empty means UniqueName("wta")
	// StaticNeighbours gives the balancer permanent neighbour entries for the client
	// and the backend; without them its first packets find no neighbour.
	StaticNeighbours bool
}

// Addresses of the two-armed topology.
var (
	TwoArmedVIP4 = netip.MustParseAddr("10.78.100.1")
	TwoArmedVIP6 = netip.MustParseAddr("fd78:100::1")
)

// NewTwoArmed builds the topology; on error it removes what it created.
func NewTwoArmed(cfg TwoArmedConfig) (_ *TwoArmed, err error) {
	if cfg.Name == "" {
		cfg.Name = UniqueName("wta")
	}
	if len(cfg.Name) > MaxNameLen || !nameRE.MatchString(cfg.Name) {
		return nil, fmt.Errorf("topology name %q: want 1-%d characters of [A-Za-z0-9_]", cfg.Name, MaxNameLen)
	}
	t := &TwoArmed{group: group{name: cfg.Name}, Name: cfg.Name, VIP4: TwoArmedVIP4, VIP6: TwoArmedVIP6}
	defer func() {
		if err != nil {
			t.Close()
		}
	}()
	mk := t.newNS
	host := func(name, link, peer string, subnet, octet int) Host {
		return Host{
			Name:     name,
			Link:     link,
			PeerLink: peer,
			IP4:      netip.AddrFrom4([4]byte{10, 78, byte(subnet), byte(octet)}),
			IP6:      netip.MustParseAddr(fmt.Sprintf("fd78:%d::%d", subnet, octet)),
			MAC:      net.HardwareAddr{0x02, 0x78, byte(subnet), 0, 0, byte(octet)},
		}
	}
	t.Client = host("client", "cl", "lbc", 1, 1)
	t.Backend = host("backend-0", "bl", "lbb", 2, 11)
	t.ClientSide = host("balancer", "lbc", "cl", 1, 2)
	t.BackendSide = host("balancer", "lbb", "bl", 2, 2)
	if t.Balancer, err = mk("lb"); err != nil {
		return nil, err
	}
	if t.Client.NS, err = mk("cl"); err != nil {
		return nil, err
	}
	if t.Backend.NS, err = mk("be"); err != nil {
		return nil, err
	}
	t.ClientSide.NS, t.BackendSide.NS = t.Balancer, t.Balancer
	if err := t.loadPass(); err != nil {
		return nil, err
	}

	for _, pair := range []struct{ lb, far *Host }{{&t.ClientSide, &t.Client}, {&t.BackendSide, &t.Backend}} {
		if err := t.wire(pair.lb, pair.far); err != nil {
			return nil, fmt.Errorf("topology %s: %w", t.Name, err)
		}
	}
	err = sysctls(t.Balancer, "net/ipv4/ip_forward", "1", "net/ipv6/conf/all/forwarding", "1",
		"net/ipv4/conf/all/accept_local", "1", "net/ipv4/conf/lbc/accept_local", "1", "net/ipv4/conf/lbb/accept_local", "1",
		"net/ipv4/conf/all/rp_filter", "0", "net/ipv4/conf/lbc/rp_filter", "0", "net/ipv4/conf/lbb/rp_filter", "0")
	if err != nil {
		return nil, err
	}
	// Hosts reach each other's subnets only through the balancer.
	if err := route(t.Client, t.VIP4, 24, t.ClientSide.IP4); err != nil {
		return nil, err
	}
	if err := route(t.Client, t.VIP6, 64, t.ClientSide.IP6); err != nil {
		return nil, err
	}
	if err := neighbours(t.Client.NS, t.Client.Link, t.ClientSide); err != nil {
		return nil, err
	}
	if err := neighbours(t.Backend.NS, t.Backend.Link, t.BackendSide); err != nil {
		return nil, err
	}
	if cfg.StaticNeighbours {
		if err := neighbours(t.Balancer, t.ClientSide.Link, t.Client); err != nil {
			return nil, err
		}
		if err := neighbours(t.Balancer, t.BackendSide.Link, t.Backend); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// wire creates the veth pair between the balancer's link lb and the far host's,
// addresses both ends and puts XDP_PASS on the far end.
func (t *TwoArmed) wire(lb, far *Host) error {
	if err := connect(lb, far); err != nil {
		return err
	}
	return attachPass(far, t.pass)
}

// connect creates a veth pair between a.Link in a.NS and b.Link in b.NS with their
// MACs, gives both ends their addresses (/24 and /64, no DAD), brings them up and
// turns tx checksum offload off, and records each end's ifindex.
func connect(a, b *Host) error {
	bNS, err := os.Open(b.NS.Path())
	if err != nil {
		return err
	}
	defer bNS.Close()
	err = a.NS.Do(func() error {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: a.Link, HardwareAddr: a.MAC},
			PeerName: b.Link, PeerHardwareAddr: b.MAC, PeerNamespace: netlink.NsFd(int(bNS.Fd()))}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("create veth %s/%s: %w", a.Link, b.Link, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, h := range []*Host{a, b} {
		err := h.NS.Do(func() error {
			l, err := netlink.LinkByName(h.Link)
			if err != nil {
				return err
			}
			h.Index = l.Attrs().Index
			for _, a := range []netip.Addr{h.IP4, h.IP6} {
				if !a.IsValid() {
					continue // a bridge port has none
				}
				bits := 24
				if a.Is6() {
					bits = 64
				}
				addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, a.BitLen())}, Flags: unix.IFA_F_NODAD}
				if err := netlink.AddrAdd(l, addr); err != nil {
					return fmt.Errorf("address %s on %s: %w", a, h.Link, err)
				}
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
			if err := SetTxChecksum(h.Link, false); err != nil {
				return fmt.Errorf("tx checksum off on %s: %w", h.Link, err)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// attachPass puts the native XDP_PASS program on h's link, so frames sent to it by
// native XDP_TX or XDP_REDIRECT are delivered.
func attachPass(h *Host, pass *ebpf.Program) error {
	return h.NS.Do(func() error {
		l, err := netlink.LinkByName(h.Link)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetXdpFdWithFlags(l, pass.FD(), nl.XDP_FLAGS_DRV_MODE); err != nil {
			return fmt.Errorf("attach native xdp_pass to %s: %w", h.Link, err)
		}
		return nil
	})
}

func route(h Host, dst netip.Addr, bits int, via netip.Addr) error {
	return h.NS.Do(func() error {
		prefix := netip.PrefixFrom(dst, bits).Masked()
		r := &netlink.Route{Dst: &net.IPNet{IP: prefix.Addr().AsSlice(), Mask: net.CIDRMask(bits, dst.BitLen())}, Gw: via.AsSlice()}
		if err := netlink.RouteAdd(r); err != nil {
			return fmt.Errorf("route %s/%d via %s in %s: %w", dst, bits, via, h.NS.Name(), err)
		}
		return nil
	})
}

// neighbours adds permanent entries in ns, on link, for both addresses of to.
func neighbours(ns *netns.NS, link string, to Host) error {
	return ns.Do(func() error {
		l, err := netlink.LinkByName(link)
		if err != nil {
			return err
		}
		for _, a := range []netip.Addr{to.IP4, to.IP6} {
			fam := netlink.FAMILY_V4
			if a.Is6() {
				fam = netlink.FAMILY_V6
			}
			n := &netlink.Neigh{LinkIndex: l.Attrs().Index, Family: fam, State: netlink.NUD_PERMANENT, IP: a.AsSlice(), HardwareAddr: to.MAC}
			if err := netlink.NeighSet(n); err != nil {
				return fmt.Errorf("neighbour %s on %s in %s: %w", a, link, ns.Name(), err)
			}
		}
		return nil
	})
}

// NewTwoArmedT is NewTwoArmed for tests, closed at cleanup; see NewT for the rule on
// missing privileges.
func NewTwoArmedT(tb TB, cfg TwoArmedConfig) *TwoArmed {
	tb.Helper()
	return newT(tb, func() (*TwoArmed, error) { return NewTwoArmed(cfg) })
}

// HTTPClient is Topology.HTTPClient for the two-armed client.
func (t *TwoArmed) HTTPClient() *http.Client {
	d := &net.Dialer{Timeout: 3 * time.Second}
	return &http.Client{
		Transport: &http.Transport{
			Proxy: nil,
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return t.Client.NS.DialWith(ctx, d, network, addr)
			},
			DisableKeepAlives:     true,
			ResponseHeaderTimeout: 5 * time.Second,
		},
		Timeout: 10 * time.Second,
	}
}
