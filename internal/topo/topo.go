// Package topo builds the network-namespace topology that weir's XDP tests,
// `weir demo` and the benchmarks run on: a client, a balancer and N backends,
// each in its own namespace, joined by veth pairs to a bridge that lives in a
// namespace of its own.
//
//	client ──veth──┐
//	balancer ─veth─┤ bridge (own namespace)
//	backend-i ─veth┘
//
// Addressing, all inside the namespaces this package creates (one L2
// segment):
//
//	segment       10.77.0.0/24          fd77::/64
//	client        10.77.0.1             fd77::1
//	balancer      10.77.0.2             fd77::2
//	backend-i     10.77.0.(11+i)        fd77::(11+i)  (same digits, read as hex)
//	VIP           10.77.100.1           fd77:100::1   (off the segment)
//
// The client routes 10.77.100.0/24 and fd77:100::/64 via the balancer, so its
// frames to a VIP carry the balancer's MAC. Backends hold the VIPs on lo
// (arp_ignore=1, arp_announce=2; the IPv6 VIP is a /128 on lo, which Linux
// does not answer neighbour solicitations for on other links) and answer the
// client directly, which is what L2 direct server return needs. Every host
// has permanent neighbour entries for every other host on the segment, so no
// test depends on ARP or ND timing; DAD is off, so addresses are usable at
// once. MACs are fixed: 02:77:00:00:00:<last IPv4 octet>.
//
// Two kernel facts (measured on 6.18) are handled here so no test has to:
//
//   - A veth delivers frames sent by a native-mode XDP_TX only if the
//     receiving peer has a native XDP program itself. New attaches a
//     two-instruction XDP_PASS program in native mode to the balancer's peer
//     in the bridge namespace (Config.PeerXDP extends that to every peer for
//     modes that redirect). A bridge device itself cannot run native XDP.
//   - After XDP_TX a CHECKSUM_PARTIAL packet is never completed, so a backend
//     would see bad TCP checksums. New turns tx checksum offload off (the
//     SIOCETHTOOL ioctl, `ethtool -K <link> tx off`) on every host's link:
//     the client's is the one DSR needs; the backends' and the balancer's
//     are off too so that modes where their packets pass an XDP program
//     (NAT replies, tunnels) get complete checksums as well.
//
// Nothing here needs bpffs: the XDP_PASS program is attached through netlink
// and held by the device. (`ip netns exec` remounts /sys, so a pin made
// under /sys/fs/bpf from inside it would not be where the agent looks.)
//
// Every namespace is named <Config.Name>-<role> and bind-mounted under
// /run/netns; the links live only inside them, so closing the namespaces
// removes everything, and CleanupStale removes what a crashed run left.
package topo

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"regexp"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
)

// Addresses of the topology. They never leave the namespaces.
var (
	Net4    = netip.MustParsePrefix("10.77.0.0/24")
	Net6    = netip.MustParsePrefix("fd77::/64")
	VIPNet4 = netip.MustParsePrefix("10.77.100.0/24")
	VIPNet6 = netip.MustParsePrefix("fd77:100::/64")
	VIP4    = netip.MustParseAddr("10.77.100.1")
	VIP6    = netip.MustParseAddr("fd77:100::1")
)

// Ports the backends serve on (see ServeBackends).
const (
	HTTPPort = 80
	UDPPort  = 53
)

const (
	defaultBackends = 3
	// MaxBackends keeps backend addresses inside 10.77.0.11-254.
	MaxBackends = 200
	// MaxNameLen leaves room for the longest link-name suffix ("-p199")
	// within the kernel's 15-character interface names.
	MaxNameLen = 10
)

// PeerXDP says which bridge-side veth peers get the native XDP_PASS program.
type PeerXDP int

const (
	// PeerXDPBalancer puts it on the balancer's peer only: enough for
	// XDP_TX from the balancer (DSR, NAT). The default.
	PeerXDPBalancer PeerXDP = iota
	// PeerXDPAll puts it on every peer, for modes whose frames leave by
	// XDP_REDIRECT or XDP_TX from other hosts' links.
	PeerXDPAll
	// PeerXDPNone attaches nothing, for tests of the failure itself.
	PeerXDPNone
)

// Config describes a topology.
type Config struct {
	// Name prefixes every namespace (<Name>-client, <Name>-lb, <Name>-be0,
	// <Name>-br) and link. At most MaxNameLen characters of [A-Za-z0-9_].
	// New uses it as given; tests get unique names from UniqueName. Empty
	// means UniqueName("w").
	Name string
	// Backends is the number of backends, default 3, at most MaxBackends.
	Backends int
	// PeerXDP chooses the bridge-side peers that get the XDP_PASS program.
	PeerXDP PeerXDP
}

// Host is one namespace attached to the segment.
type Host struct {
	Name     string // "client", "balancer", "backend-0", ...
	NS       *netns.NS
	Link     string // interface inside NS facing the bridge
	Index    int    // Link's ifindex inside NS
	IP4      netip.Addr
	IP6      netip.Addr
	MAC      net.HardwareAddr
	PeerLink string // the veth peer's name inside the bridge namespace

	role string // namespace name suffix: "client", "lb", "be0", ...
}

// Topology is a built topology. Close removes it.
type Topology struct {
	Name             string
	Client, Balancer Host
	Backends         []Host
	Bridge           *netns.NS // namespace holding the bridge
	BridgeLink       string    // the bridge device inside Bridge
	VIP4, VIP6       netip.Addr

	namespaces      []*netns.NS
	pass            *ebpf.Program   // the peer XDP_PASS program, nil if unused
	servedHTTP      []atomic.Uint64 // per backend
	servedUDP       []atomic.Uint64 // per backend
	httpOnce        sync.Once
	httpClient      *http.Client
	mu              sync.Mutex // guards closed, serving
	closed, serving bool
	stop            chan struct{} // closed by Close to stop the servers
	servers         sync.WaitGroup
	closeOnce       sync.Once
	closeErr        error
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_]+$`)

// New builds the topology. On any error it removes whatever it created.
func New(cfg Config) (_ *Topology, err error) {
	if cfg.Name == "" {
		cfg.Name = UniqueName("w")
	}
	if len(cfg.Name) > MaxNameLen || !nameRE.MatchString(cfg.Name) {
		return nil, fmt.Errorf("topology name %q: want 1-%d characters of [A-Za-z0-9_]", cfg.Name, MaxNameLen)
	}
	if cfg.Backends == 0 {
		cfg.Backends = defaultBackends
	}
	if cfg.Backends < 0 || cfg.Backends > MaxBackends {
		return nil, fmt.Errorf("topology %s: backends: want 1-%d, got %d", cfg.Name, MaxBackends, cfg.Backends)
	}
	if cfg.PeerXDP < PeerXDPBalancer || cfg.PeerXDP > PeerXDPNone {
		return nil, fmt.Errorf("topology %s: unknown PeerXDP %d", cfg.Name, cfg.PeerXDP)
	}

	t := &Topology{
		Name:       cfg.Name,
		BridgeLink: cfg.Name + "-br",
		VIP4:       VIP4,
		VIP6:       VIP6,
		servedHTTP: make([]atomic.Uint64, cfg.Backends),
		servedUDP:  make([]atomic.Uint64, cfg.Backends),
		stop:       make(chan struct{}),
	}
	defer func() {
		if err != nil {
			t.Close()
		}
	}()

	if t.Bridge, err = t.newNS("br"); err != nil {
		return nil, err
	}
	t.Client = t.host("client", "client", "-c", "-pc", 1)
	t.Balancer = t.host("balancer", "lb", "-lb", "-plb", 2)
	for i := range cfg.Backends {
		t.Backends = append(t.Backends, t.host(fmt.Sprintf("backend-%d", i), fmt.Sprintf("be%d", i), fmt.Sprintf("-b%d", i), fmt.Sprintf("-p%d", i), 11+i))
	}

	if err := t.setupBridge(); err != nil {
		return nil, err
	}
	for _, h := range t.hosts() {
		if h.NS, err = t.newNS(h.role); err != nil {
			return nil, err
		}
		if err := t.setupHost(h); err != nil {
			return nil, err
		}
	}
	if err := t.setupNeighbours(); err != nil {
		return nil, err
	}
	if err := t.setupClient(); err != nil {
		return nil, err
	}
	for i := range t.Backends {
		if err := t.setupBackend(&t.Backends[i]); err != nil {
			return nil, err
		}
	}
	switch cfg.PeerXDP {
	case PeerXDPBalancer:
		err = t.AttachPeerPass(t.Balancer)
	case PeerXDPAll:
		for _, h := range t.hosts() {
			if err = t.AttachPeerPass(*h); err != nil {
				break
			}
		}
	}
	if err != nil {
		return nil, err
	}
	return t, nil
}

// NewT is New for tests: the topology is closed at t's cleanup. If the
// machine cannot build it for lack of privileges or kernel support, the test
// is skipped, or fails when WEIR_REQUIRE_XDP=1 (see xdpenv); any other
// error fails the test. An empty cfg.Name gets a unique one.
func NewT(tb TB, cfg Config) *Topology {
	tb.Helper()
	return newT(tb, func() (*Topology, error) { return New(cfg) })
}

// host returns the description of a host before anything is created.
// role names its namespace, linkSuffix and peerSuffix its two veth ends.
func (t *Topology) host(name, role, linkSuffix, peerSuffix string, octet int) Host {
	a4 := Net4.Addr().As4()
	a4[3] = byte(octet)
	// The IPv6 host part has the IPv4 octet's decimal digits, read as hex,
	// so 10.77.0.11 pairs with fd77::11.
	ip6 := netip.MustParseAddr(fmt.Sprintf("fd77::%d", octet))
	return Host{
		Name:     name,
		Link:     t.Name + linkSuffix,
		IP4:      netip.AddrFrom4(a4),
		IP6:      ip6,
		MAC:      net.HardwareAddr{0x02, 0x77, 0, 0, 0, byte(octet)},
		PeerLink: t.Name + peerSuffix,
		role:     role,
	}
}

// Hosts returns every host: the client, the balancer, then the backends.
func (t *Topology) Hosts() []Host {
	return append([]Host{t.Client, t.Balancer}, t.Backends...)
}

// hosts returns pointers to every host, client and balancer first.
func (t *Topology) hosts() []*Host {
	hs := []*Host{&t.Client, &t.Balancer}
	for i := range t.Backends {
		hs = append(hs, &t.Backends[i])
	}
	return hs
}

// newNS creates <Name>-<role> and records it for Close.
func (t *Topology) newNS(role string) (*netns.NS, error) {
	ns, err := netns.New(t.Name + "-" + role)
	if err != nil {
		return nil, fmt.Errorf("topology %s: %w", t.Name, err)
	}
	t.namespaces = append(t.namespaces, ns)
	return ns, nil
}

// sysctls writes /proc/sys/<key> = value for each pair, inside ns (the net
// sysctls a task sees are its network namespace's).
func sysctls(ns *netns.NS, kv ...string) error {
	return ns.Do(func() error {
		for i := 0; i+1 < len(kv); i += 2 {
			p := "/proc/sys/" + kv[i]
			if err := os.WriteFile(p, []byte(kv[i+1]), 0o644); err != nil {
				return fmt.Errorf("netns %s: sysctl %s=%s: %w", ns.Name(), kv[i], kv[i+1], err)
			}
		}
		return nil
	})
}

// setupBridge creates the bridge in its namespace. The bridge namespace has
// IPv6 off so it sends nothing (router solicitations, MLD) into the segment.
func (t *Topology) setupBridge() error {
	err := sysctls(t.Bridge,
		"net/ipv6/conf/all/disable_ipv6", "1",
		"net/ipv6/conf/default/disable_ipv6", "1",
	)
	if err != nil {
		return err
	}
	return t.Bridge.Do(func() error {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: t.BridgeLink}}
		if err := netlink.LinkAdd(br); err != nil {
			return fmt.Errorf("add bridge %s: %w", t.BridgeLink, err)
		}
		if err := netlink.LinkSetUp(br); err != nil {
			return fmt.Errorf("set %s up: %w", t.BridgeLink, err)
		}
		return nil
	})
}

// setupHost sets the host namespace's defaults, creates its veth pair from
// the bridge namespace straight into both namespaces (so the links never
// exist in the caller's namespace) and configures the host's end.
func (t *Topology) setupHost(h *Host) error {
	err := sysctls(h.NS,
		// DAD off before the link exists, so its addresses (link-local
		// included) are usable at once.
		"net/ipv6/conf/all/accept_dad", "0",
		"net/ipv6/conf/default/accept_dad", "0",
		"net/ipv6/conf/all/router_solicitations", "0",
		"net/ipv6/conf/default/router_solicitations", "0",
		// Replies from VIPs and asymmetric DSR paths must not be dropped
		// by reverse-path filtering; the effective value is the max of
		// "all" and the link's, so both are set.
		"net/ipv4/conf/all/rp_filter", "0",
		"net/ipv4/conf/default/rp_filter", "0",
	)
	if err != nil {
		return err
	}

	err = t.Bridge.Do(func() error {
		nsFd, err := unix.Open(h.NS.Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open %s: %w", h.NS.Path(), err)
		}
		defer unix.Close(nsFd)
		veth := &netlink.Veth{
			LinkAttrs:        netlink.LinkAttrs{Name: h.PeerLink},
			PeerName:         h.Link,
			PeerHardwareAddr: h.MAC,
			PeerNamespace:    netlink.NsFd(nsFd),
		}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("add veth %s/%s: %w", h.PeerLink, h.Link, err)
		}
		br, err := netlink.LinkByName(t.BridgeLink)
		if err != nil {
			return fmt.Errorf("find bridge: %w", err)
		}
		peer, err := netlink.LinkByName(h.PeerLink)
		if err != nil {
			return fmt.Errorf("find %s: %w", h.PeerLink, err)
		}
		if err := netlink.LinkSetMaster(peer, br); err != nil {
			return fmt.Errorf("attach %s to %s: %w", h.PeerLink, t.BridgeLink, err)
		}
		if err := netlink.LinkSetUp(peer); err != nil {
			return fmt.Errorf("set %s up: %w", h.PeerLink, err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("topology %s: %s: %w", t.Name, h.Name, err)
	}

	err = h.NS.Do(func() error {
		link, err := netlink.LinkByName(h.Link)
		if err != nil {
			return fmt.Errorf("find %s: %w", h.Link, err)
		}
		h.Index = link.Attrs().Index
		if err := netlink.LinkSetUp(link); err != nil {
			return fmt.Errorf("set %s up: %w", h.Link, err)
		}
		for _, a := range []netip.Prefix{
			netip.PrefixFrom(h.IP4, Net4.Bits()),
			netip.PrefixFrom(h.IP6, Net6.Bits()),
		} {
			addr := &netlink.Addr{IPNet: ipNet(a), Flags: unix.IFA_F_NODAD}
			if err := netlink.AddrAdd(link, addr); err != nil {
				return fmt.Errorf("add %s to %s: %w", a, h.Link, err)
			}
		}
		// See the package comment: XDP_TX does not finish partial
		// checksums, so this host computes them in software.
		if err := SetTxChecksum(h.Link, false); err != nil {
			return fmt.Errorf("turn tx checksum offload off: %w", err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("topology %s: %s: %w", t.Name, h.Name, err)
	}
	return nil
}

// setupNeighbours gives every host a permanent neighbour entry, IPv4 and
// IPv6, for every other host, so the client reaches the balancer's MAC and
// backends the client's without ARP or ND.
func (t *Topology) setupNeighbours() error {
	hosts := t.hosts()
	for _, h := range hosts {
		err := h.NS.Do(func() error {
			for _, o := range hosts {
				if o == h {
					continue
				}
				for _, ip := range []netip.Addr{o.IP4, o.IP6} {
					n := &netlink.Neigh{
						LinkIndex:    h.Index,
						Family:       family(ip),
						State:        netlink.NUD_PERMANENT,
						IP:           net.IP(ip.AsSlice()),
						HardwareAddr: o.MAC,
					}
					if err := netlink.NeighSet(n); err != nil {
						return fmt.Errorf("neighbour %s on %s: %w", ip, h.Link, err)
					}
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("topology %s: %s: %w", t.Name, h.Name, err)
		}
	}
	return nil
}

// setupClient routes the VIP prefixes via the balancer and lets the client
// reuse TIME_WAIT tuples, since tests open many connections, some from
// fixed local ports.
func (t *Topology) setupClient() error {
	c := &t.Client
	if err := sysctls(c.NS, "net/ipv4/tcp_tw_reuse", "1"); err != nil {
		return err
	}
	// Since 6.13 the reuse waits tcp_tw_reuse_delay (default 1s) after the
	// last timestamp; older kernels have no such sysctl and wait 1s.
	err := sysctls(c.NS, "net/ipv4/tcp_tw_reuse_delay", "1")
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	err = c.NS.Do(func() error {
		for _, r := range []struct {
			dst netip.Prefix
			gw  netip.Addr
		}{{VIPNet4, t.Balancer.IP4}, {VIPNet6, t.Balancer.IP6}} {
			route := &netlink.Route{LinkIndex: c.Index, Dst: ipNet(r.dst), Gw: net.IP(r.gw.AsSlice())}
			if err := netlink.RouteAdd(route); err != nil {
				return fmt.Errorf("route %s via %s: %w", r.dst, r.gw, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("topology %s: client: %w", t.Name, err)
	}
	return nil
}

// setupBackend makes a backend accept packets for the VIPs without ever
// claiming them on the segment.
func (t *Topology) setupBackend(h *Host) error {
	err := sysctls(h.NS,
		// Answer ARP only for addresses on the receiving link, and never
		// use the VIP as the source of ARP requests.
		"net/ipv4/conf/all/arp_ignore", "1",
		"net/ipv4/conf/all/arp_announce", "2",
		"net/ipv4/conf/"+h.Link+"/arp_ignore", "1",
		"net/ipv4/conf/"+h.Link+"/arp_announce", "2",
		"net/ipv4/conf/"+h.Link+"/rp_filter", "0",
	)
	if err != nil {
		return err
	}
	for _, vip := range []netip.Addr{t.VIP4, t.VIP6} {
		if err := addLoopback(h.NS, vip); err != nil {
			return fmt.Errorf("topology %s: %s: %w", t.Name, h.Name, err)
		}
	}
	return nil
}

// AddBackendVIP puts one more VIP (inside VIPNet4 or VIPNet6, which the
// client routes via the balancer) on every backend's loopback, for tests
// with several services.
func (t *Topology) AddBackendVIP(vip netip.Addr) error {
	if !VIPNet4.Contains(vip) && !VIPNet6.Contains(vip) {
		return fmt.Errorf("topology %s: VIP %s: must be inside %s or %s", t.Name, vip, VIPNet4, VIPNet6)
	}
	for _, h := range t.Backends {
		if err := addLoopback(h.NS, vip); err != nil {
			return fmt.Errorf("topology %s: %s: %w", t.Name, h.Name, err)
		}
	}
	return nil
}

// addLoopback adds vip as a host route (/32 or /128) on lo. An IPv6 address
// on lo is not answered for in neighbour solicitations on other links, so
// the backend never competes with the balancer for it.
func addLoopback(ns *netns.NS, vip netip.Addr) error {
	return ns.Do(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return fmt.Errorf("find lo: %w", err)
		}
		addr := &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(vip, vip.BitLen())), Flags: unix.IFA_F_NODAD}
		if err := netlink.AddrAdd(lo, addr); err != nil {
			return fmt.Errorf("add %s to lo: %w", vip, err)
		}
		return nil
	})
}

// passProgram is XDP_PASS: r0 = 2; exit.
func passProgram() (*ebpf.Program, error) {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "weir_peer_pass",
		Type: ebpf.XDP,
		Instructions: asm.Instructions{
			asm.Mov.Imm(asm.R0, 2), // XDP_PASS
			asm.Return(),
		},
		License: "GPL",
	})
	if err != nil {
		return nil, fmt.Errorf("load xdp_pass program: %w", err)
	}
	return prog, nil
}

// AttachPeerPass attaches the XDP_PASS program in native mode to h's veth
// peer in the bridge namespace, so that frames h's link sends with a
// native-mode XDP_TX or XDP_REDIRECT are delivered (see the package comment).
// New does this for the balancer, or every host with PeerXDPAll.
func (t *Topology) AttachPeerPass(h Host) error {
	if t.pass == nil {
		prog, err := passProgram()
		if err != nil {
			return fmt.Errorf("topology %s: %w", t.Name, err)
		}
		t.pass = prog
	}
	err := t.Bridge.Do(func() error {
		peer, err := netlink.LinkByName(h.PeerLink)
		if err != nil {
			return fmt.Errorf("find %s: %w", h.PeerLink, err)
		}
		if err := netlink.LinkSetXdpFdWithFlags(peer, t.pass.FD(), nl.XDP_FLAGS_DRV_MODE); err != nil {
			return fmt.Errorf("attach native xdp_pass to %s: %w", h.PeerLink, err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("topology %s: %w", t.Name, err)
	}
	return nil
}

// PeerXDPMode reports how an XDP program is attached to h's veth peer in the
// bridge namespace: "native", "generic", "offload" or "" for none.
func (t *Topology) PeerXDPMode(h Host) (string, error) {
	var mode string
	err := t.Bridge.Do(func() error {
		peer, err := netlink.LinkByName(h.PeerLink)
		if err != nil {
			return fmt.Errorf("find %s: %w", h.PeerLink, err)
		}
		if x := peer.Attrs().Xdp; x != nil && x.Attached {
			mode = map[uint32]string{
				nl.XDP_ATTACHED_DRV: "native",
				nl.XDP_ATTACHED_SKB: "generic",
				nl.XDP_ATTACHED_HW:  "offload",
			}[x.AttachMode]
		}
		return nil
	})
	return mode, err
}

// TxChecksum reports whether tx checksum offload is on for h's link.
func TxChecksum(h Host) (bool, error) {
	var on bool
	err := h.NS.Do(func() (err error) {
		on, err = txChecksum(h.Link)
		return err
	})
	return on, err
}

// Close stops the backends' servers and removes every namespace, with the
// links, addresses and routes in them. It is idempotent.
func (t *Topology) Close() error {
	t.closeOnce.Do(func() {
		t.mu.Lock()
		t.closed = true
		close(t.stop)
		t.mu.Unlock()
		t.servers.Wait()

		var errs []error
		for i := len(t.namespaces) - 1; i >= 0; i-- {
			if err := t.namespaces[i].Close(); err != nil {
				errs = append(errs, err)
			}
		}
		if t.pass != nil {
			t.pass.Close()
		}
		t.closeErr = errors.Join(errs...)
		if t.closeErr != nil {
			t.closeErr = fmt.Errorf("close topology %s: %w", t.Name, t.closeErr)
		}
	})
	return t.closeErr
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

func family(ip netip.Addr) int {
	if ip.Is4() {
		return netlink.FAMILY_V4
	}
	return netlink.FAMILY_V6
}
