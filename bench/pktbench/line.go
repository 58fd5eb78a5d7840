// Package pktbench measures packets per second through a balancer namespace:
// weir's own generator (bench/pktgen) sends from one namespace, the balancer
// under test runs in a second, and what it forwards is counted by XDP sinks.
// Every case runs for a fixed time, repeated and interleaved with the others,
// beside a floor (an XDP program that only swaps MACs and sends the frame
// back) and the kernel's own forwarding and nftables NAT.
//
//	gen ns                 lb ns                        sink ns
//	g0 10.78.1.1 ──veth── l0 10.78.1.2   l1 10.78.2.1 ──veth── s0 10.78.2.2
//	                                        fd78:2::1            fd78:2::2
//	generator sends here   balancer under test here     far sink (routed, NATed,
//	back sink (XDP_TX)                                  tunnelled)
//
// L2 direct server return (weir's dsr mode, the XDP_TX floor) sends each
// frame back out of the link it came in on: on a veth that is the
// generator's link, so the back sink on g0 counts those. weir's nat and
// tunnel modes, the redirect floor, and the kernel's forwarding and NAT send
// out of l1 towards backends behind s0 (10.78.3.0/24, fd78:3::/64, routed
// via s0, which only counts), counted by the far sink on s0. Both sinks are native XDP
// programs that count per CPU and drop, so counting costs almost nothing,
// and g0 needs one anyway: a veth delivers frames sent by XDP only to a peer
// that runs native XDP (or has GRO on).
package pktbench

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bench/pktgen"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/loader"
)

// Addresses and MACs of the line. They never leave its namespaces.
var (
	GenIP       = netip.MustParseAddr("10.78.1.1")
	LBInIP      = netip.MustParseAddr("10.78.1.2")
	LBOutIP     = netip.MustParseAddr("10.78.2.1")
	SinkIP      = netip.MustParseAddr("10.78.2.2")
	VIP4        = netip.MustParseAddr("10.78.100.1")
	VIP6        = netip.MustParseAddr("fd78:100::1")
	VIPNet4     = netip.MustParsePrefix("10.78.100.0/24")
	BackendNet4 = netip.MustParsePrefix("10.78.3.0/24")
	// IPv6 exists only on l1, for weir's nat and tunnel to IPv6 backends.
	LBOutIP6    = netip.MustParseAddr("fd78:2::1")
	SinkIP6     = netip.MustParseAddr("fd78:2::2")
	BackendNet6 = netip.MustParsePrefix("fd78:3::/64")
	GenMAC      = net.HardwareAddr{0x02, 0x78, 0, 0, 1, 1}
	LBInMAC     = net.HardwareAddr{0x02, 0x78, 0, 0, 1, 2}
	LBOutMAC    = net.HardwareAddr{0x02, 0x78, 0, 0, 2, 1}
	SinkMAC     = net.HardwareAddr{0x02, 0x78, 0, 0, 2, 2}
)

// Port is the services' port.
const Port = 80

// Links inside the namespaces; each namespace has its own, so short names do.
const (
	GenLink  = "g0"
	LBIn     = "l0"
	LBOut    = "l1"
	SinkLink = "s0"
)

// Backend returns backend i's address (10.78.3.(1+i)) and MAC; backends
// exist only as addresses and MACs the sinks see.
func Backend(i int) (netip.Addr, net.HardwareAddr) {
	return netip.AddrFrom4([4]byte{10, 78, 3, byte(1 + i)}), net.HardwareAddr{0x02, 0x78, 0, 0, 3, byte(1 + i)}
}

// Backend6 returns backend i's IPv6 address, fd78:3::(1+i).
func Backend6(i int) netip.Addr {
	return netip.AddrFrom16([16]byte{0xfd, 0x78, 0, 3, 15: byte(1 + i)})
}

// Line is the three namespaces with their links and sinks. Close removes it.
type Line struct {
	Name          string
	Gen, LB, Sink *netns.NS
	GenIndex      int // g0's ifindex inside Gen, where the generator sends
	Back, Far     *pktgen.Sink
	local         *pktgen.Sink    // the null case's sink on l0, while it runs
	weir          *loader.Program // weir's program, while a weir case runs

	namespaces []*netns.NS
}

// NamePrefix prefixes the line's namespaces; a crashed run's are removed by
// NewLine.
const NamePrefix = "wpb"

// NewLine builds the line. On error it removes whatever it created.
func NewLine() (_ *Line, err error) {
	if err := topo.CleanupStale(NamePrefix); err != nil {
		return nil, fmt.Errorf("line: remove a crashed run's namespaces: %w", err)
	}
	l := &Line{Name: topo.UniqueName(NamePrefix)}
	defer func() {
		if err != nil {
			l.Close()
		}
	}()
	for _, p := range []**netns.NS{&l.Gen, &l.LB, &l.Sink} {
		role := map[**netns.NS]string{&l.Gen: "gen", &l.LB: "lb", &l.Sink: "sink"}[p]
		ns, err := netns.New(l.Name + "-" + role)
		if err != nil {
			return nil, fmt.Errorf("line: %w", err)
		}
		l.namespaces = append(l.namespaces, ns)
		*p = ns
		// IPv6 off before any link exists: no router solicitations, MLD
		// or neighbour discovery for the sinks to count. Reverse-path
		// filtering off: sources are 198.18.0.0/15.
		if err := sysctls(ns,
			"net/ipv6/conf/all/disable_ipv6", "1",
			"net/ipv6/conf/default/disable_ipv6", "1",
			"net/ipv4/conf/all/rp_filter", "0",
			"net/ipv4/conf/default/rp_filter", "0",
		); err != nil {
			return nil, err
		}
	}
	if err := sysctls(l.LB, "net/ipv4/ip_forward", "1", "net/ipv6/conf/all/forwarding", "1"); err != nil {
		return nil, err
	}
	if err := l.veth(l.Gen, GenLink, GenMAC, GenIP, LBIn, LBInMAC, LBInIP); err != nil {
		return nil, err
	}
	if err := l.veth(l.Sink, SinkLink, SinkMAC, SinkIP, LBOut, LBOutMAC, LBOutIP); err != nil {
		return nil, err
	}
	// IPv6 on l1 alone (bpf_fib_lookup needs an IPv6 route, which needs
	// IPv6 on its link): no link-local address, no duplicate address
	// detection, and, forwarding, no router solicitations. What remains
	// are a few MLD reports when the address is added, their repeats 1 ms
	// apart instead of 1 s, so they are over before any case starts.
	if err := sysctls(l.LB,
		"net/ipv6/conf/"+LBOut+"/mldv2_unsolicited_report_interval", "1",
		"net/ipv6/conf/"+LBOut+"/addr_gen_mode", "1",
		"net/ipv6/conf/"+LBOut+"/accept_dad", "0",
		"net/ipv6/conf/"+LBOut+"/disable_ipv6", "0",
	); err != nil {
		return nil, err
	}
	err = l.Gen.Do(func() error {
		g, err := netlink.LinkByName(GenLink)
		if err != nil {
			return err
		}
		l.GenIndex = g.Attrs().Index
		return neigh(g, LBInIP, LBInMAC)
	})
	if err != nil {
		return nil, fmt.Errorf("line: %w", err)
	}
	err = l.LB.Do(func() error {
		in, err := netlink.LinkByName(LBIn)
		if err != nil {
			return err
		}
		out, err := netlink.LinkByName(LBOut)
		if err != nil {
			return err
		}
		if err := neigh(in, GenIP, GenMAC); err != nil {
			return err
		}
		if err := neigh(out, SinkIP, SinkMAC); err != nil {
			return err
		}
		err = netlink.AddrAdd(out, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(LBOutIP6, 64)), Flags: unix.IFA_F_NODAD})
		if err != nil {
			return fmt.Errorf("address %s on %s: %w", LBOutIP6, LBOut, err)
		}
		if err := neigh(out, SinkIP6, SinkMAC); err != nil {
			return err
		}
		// Replies to the generator's sources, and the NAT and tunnel
		// targets.
		for _, r := range []struct {
			dst  netip.Prefix
			link netlink.Link
			gw   netip.Addr
		}{
			{netip.MustParsePrefix("198.18.0.0/15"), in, GenIP},
			{BackendNet4, out, SinkIP},
			{BackendNet6, out, SinkIP6},
		} {
			if err := netlink.RouteAdd(&netlink.Route{LinkIndex: r.link.Attrs().Index, Dst: ipNet(r.dst), Gw: r.gw.AsSlice()}); err != nil {
				return fmt.Errorf("route %s: %w", r.dst, err)
			}
		}
		// Frames a veth receives from an XDP sender enter the stack (and
		// generic XDP) only with GRO on or a native program attached.
		return topo.SetGRO(LBIn, true)
	})
	if err != nil {
		return nil, fmt.Errorf("line: %s: %w", l.LB, err)
	}
	if err := l.probePath(); err != nil {
		return nil, fmt.Errorf("line: %w", err)
	}
	if l.Back, err = l.sink(l.Gen, GenLink); err != nil {
		return nil, err
	}
	if l.Far, err = l.sink(l.Sink, SinkLink); err != nil {
		return nil, err
	}
	return l, nil
}

// probePath lets latency probes cross the line: the generator namespace
// routes the VIPs via l0; the sink namespace holds ProbeBackend on its
// loopback, knows l1's MAC, and routes replies to the generator via l1 (for
// nftables DNAT, which keeps the client's address). Both ends send with tx
// checksum offload off: a veth hands a partial checksum on with the skb, and
// a frame that weir's XDP program rewrites and redirects loses the skb.
func (l *Line) probePath() error {
	err := l.Gen.Do(func() error {
		g, err := netlink.LinkByName(GenLink)
		if err != nil {
			return err
		}
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: g.Attrs().Index, Dst: ipNet(VIPNet4), Gw: LBInIP.AsSlice()}); err != nil {
			return err
		}
		return topo.SetTxChecksum(GenLink, false)
	})
	if err != nil {
		return fmt.Errorf("%s: route %s: %w", l.Gen, VIPNet4, err)
	}
	err = l.Sink.Do(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return err
		}
		if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(ProbeBackend, 32))}); err != nil {
			return fmt.Errorf("address %s on lo: %w", ProbeBackend, err)
		}
		s0, err := netlink.LinkByName(SinkLink)
		if err != nil {
			return err
		}
		if err := neigh(s0, LBOutIP, LBOutMAC); err != nil {
			return err
		}
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: s0.Attrs().Index, Dst: ipNet(netip.PrefixFrom(GenIP, 24).Masked()), Gw: LBOutIP.AsSlice()}); err != nil {
			return err
		}
		return topo.SetTxChecksum(SinkLink, false)
	})
	if err != nil {
		return fmt.Errorf("%s: probe path: %w", l.Sink, err)
	}
	return nil
}

// sink counts and drops the load arriving on link, passing probes on.
func (l *Line) sink(ns *netns.NS, link string) (*pktgen.Sink, error) {
	s, err := pktgen.NewProbeSink(ProbePort)
	if err != nil {
		return nil, fmt.Errorf("line: %w", err)
	}
	if err := s.Attach(ns, link); err != nil {
		s.Close()
		return nil, fmt.Errorf("line: %w", err)
	}
	return s, nil
}

// veth creates the pair lbLink (in LB) / link (in ns) from inside LB, so the
// links never exist in the caller's namespace, and addresses both ends.
func (l *Line) veth(ns *netns.NS, link string, mac net.HardwareAddr, ip netip.Addr, lbLink string, lbMAC net.HardwareAddr, lbIP netip.Addr) error {
	err := l.LB.Do(func() error {
		fd, err := unix.Open(ns.Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		v := &netlink.Veth{
			LinkAttrs:        netlink.LinkAttrs{Name: lbLink, HardwareAddr: lbMAC},
			PeerName:         link,
			PeerHardwareAddr: mac,
			PeerNamespace:    netlink.NsFd(fd),
		}
		if err := netlink.LinkAdd(v); err != nil {
			return fmt.Errorf("add veth %s/%s: %w", lbLink, link, err)
		}
		return up(lbLink, lbIP)
	})
	if err == nil {
		err = ns.Do(func() error { return up(link, ip) })
	}
	if err != nil {
		return fmt.Errorf("line: %w", err)
	}
	return nil
}

func up(link string, ip netip.Addr) error {
	lk, err := netlink.LinkByName(link)
	if err != nil {
		return err
	}
	if err := netlink.AddrAdd(lk, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(ip, 24))}); err != nil {
		return fmt.Errorf("address %s on %s: %w", ip, link, err)
	}
	return netlink.LinkSetUp(lk)
}

func neigh(l netlink.Link, ip netip.Addr, mac net.HardwareAddr) error {
	family := unix.AF_INET
	if ip.Is6() {
		family = unix.AF_INET6
	}
	err := netlink.NeighSet(&netlink.Neigh{
		LinkIndex: l.Attrs().Index, Family: family, State: netlink.NUD_PERMANENT,
		IP: ip.AsSlice(), HardwareAddr: mac,
	})
	if err != nil {
		return fmt.Errorf("neighbour %s on %s: %w", ip, l.Attrs().Name, err)
	}
	return nil
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// sysctls writes /proc/sys/<key> = value for each pair inside ns.
func sysctls(ns *netns.NS, kv ...string) error {
	return ns.Do(func() error {
		for i := 0; i+1 < len(kv); i += 2 {
			if err := os.WriteFile("/proc/sys/"+kv[i], []byte(kv[i+1]), 0o644); err != nil {
				return fmt.Errorf("netns %s: sysctl %s=%s: %w", ns, kv[i], kv[i+1], err)
			}
		}
		return nil
	})
}

// Close removes the sinks and the namespaces (and with them every link). It
// is idempotent.
func (l *Line) Close() error {
	var errs []error
	for _, s := range []*pktgen.Sink{l.Back, l.Far} {
		if s != nil {
			errs = append(errs, s.Close())
		}
	}
	for _, ns := range l.namespaces {
		errs = append(errs, ns.Close())
	}
	l.namespaces = nil
	l.Back, l.Far = nil, nil
	return errors.Join(errs...)
}

func netipPort(a netip.Addr) netip.AddrPort { return netip.AddrPortFrom(a, Port) }

func numCPU() int { return runtime.NumCPU() }
