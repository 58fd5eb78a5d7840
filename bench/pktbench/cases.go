package pktbench

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/weir-lb/weir/bench/pktgen"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/loader"
)

// Path says which sink counts a case's forwarded frames.
type Path int

const (
	// PathBack: frames sent back out of l0 (XDP_TX: dsr, the XDP_TX
	// floor), counted on g0.
	PathBack Path = iota
	// PathFar: frames sent out of l1 (weir nat and tunnel, the redirect
	// floor, kernel forwarding and NAT), counted on s0.
	PathFar
	// PathLocal: the balancer namespace's own sink on l0 counts what
	// arrives; the null case.
	PathLocal
)

// Balancer is what runs in the balancer namespace during a case.
type Balancer struct {
	Name  string // "weir dsr native"
	Group string // plot colour and table section: null, floor, weir, kernel
	Path  Path
	// Floor names the balancer whose rate this one is compared with.
	Floor string
	// Setup installs the balancer on the line and returns what removes it.
	Setup func(l *Line) (teardown func() error, err error)
}

// Case is one measurement: a balancer, a number of flows and a kind of frame.
type Case struct {
	Balancer
	Flows  int
	Packet pktgen.Packet
	// RateOfFloor, if > 0, sends at that fraction of the floor's median
	// forwarding rate measured earlier in the same round instead of flat
	// out (the no-loss-below-the-floor check).
	RateOfFloor float64
	// Rate, if > 0, sends at that many frames/s instead of flat out.
	Rate float64
	// Idle sends no load at all (a latency baseline).
	Idle bool
	// Generator is "" for weir's own generator or Trafgen.
	Generator string
	// Probe times TCP request/response probes through the balancer's probe
	// service during the window (weir nat and nftables DNAT have one).
	Probe bool
	// SrcPorts, if > 1, sends Packet from that many source ports
	// (pktgen.SrcPort upwards, a kind of frame each, at most
	// pktgen.MaxTemplates), each cycling through Flows source addresses:
	// Flows × SrcPorts distinct flows.
	SrcPorts int
	// Streams, if > 0, runs that many established TCP streams through weir
	// nat's stream service (the probe service's VIP and backend address)
	// from before the load starts until after it stops, and measures what
	// they deliver (flood.go); Interactive streams write a little every
	// 100 ms, the others flat out. Not with Probe: both use the probe
	// service.
	Streams     int
	Interactive bool
	// SplitCPU gives the generator its CPU to itself: l0 is polled by a
	// kernel thread on the next CPU, where the streams and the rest of the
	// line run, so a paced load arrives at its rate whatever the balancer
	// costs, and what it costs comes out of the other CPU (flood.go).
	SplitCPU bool
}

// mix is the kinds of frame the case sends: Packet, once per source port.
func (c Case) mix() []pktgen.Packet {
	if c.SrcPorts <= 1 {
		return []pktgen.Packet{c.Packet}
	}
	mix := make([]pktgen.Packet, c.SrcPorts)
	for i := range mix {
		mix[i] = c.Packet
		mix[i].SrcPort = uint16(pktgen.SrcPort + i)
	}
	return mix
}

// flows is the case's distinct flows: Flows from each source port.
func (c Case) flows() int { return c.Flows * max(c.SrcPorts, 1) }

// Name is the case's label in tables and plots.
func (c Case) Name() string {
	traffic := c.Packet.Traffic()
	if c.Packet.Dst.IsValid() {
		traffic += " to " + floodTarget(c.Packet.Dst)
	}
	s := fmt.Sprintf("%s, %s, %d flows", c.Balancer.Name, traffic, c.flows())
	switch {
	case c.Idle:
		s = c.Balancer.Name + ", no load"
	case c.RateOfFloor > 0:
		s += fmt.Sprintf(", at %.0f%% of floor", 100*c.RateOfFloor)
	case c.Rate > 0:
		s += fmt.Sprintf(", at %.2f Mpps", c.Rate/1e6)
	}
	if c.Generator != "" {
		s += ", by " + c.Generator
	}
	if c.Probe {
		s += ", probed"
	}
	if c.Streams > 0 {
		kind := "bulk"
		if c.Interactive {
			kind = "interactive"
		}
		s += fmt.Sprintf(", %d %s streams", c.Streams, kind)
	}
	if c.SplitCPU {
		s += ", split CPUs"
	}
	return s
}

// paced says the case does not send flat out, so its rate is no capacity.
func (c Case) paced() bool { return c.Idle || c.RateOfFloor > 0 || c.Rate > 0 }

// The balancers. dsr is compared with the XDP_TX floor (both send the frame
// back out of l0), nat and tunnel with the redirect floor (both send it out
// of l1 through a devmap).
var (
	Null = Balancer{Name: "null (counting XDP_DROP on l0)", Group: "null", Path: PathLocal, Setup: setupNull}

	FloorNative          = Balancer{Name: "floor native", Group: "floor", Path: PathBack, Floor: "floor native", Setup: setupFloor(false)}
	FloorGeneric         = Balancer{Name: "floor generic", Group: "floor", Path: PathBack, Floor: "floor generic", Setup: setupFloor(true)}
	FloorRedirectNative  = Balancer{Name: "floor redirect native", Group: "floor", Path: PathFar, Floor: "floor redirect native", Setup: setupRedirectFloor(false)}
	FloorRedirectGeneric = Balancer{Name: "floor redirect generic", Group: "floor", Path: PathFar, Floor: "floor redirect generic", Setup: setupRedirectFloor(true)}

	WeirDSRNative  = Balancer{Name: "weir dsr native", Group: "weir", Path: PathBack, Floor: "floor native", Setup: setupWeir(loader.ModeNative, loader.ForwardDSR, 0)}
	WeirDSRGeneric = Balancer{Name: "weir dsr generic", Group: "weir", Path: PathBack, Floor: "floor generic", Setup: setupWeir(loader.ModeGeneric, loader.ForwardDSR, 0)}

	WeirNATNative  = Balancer{Name: "weir nat native", Group: "weir", Path: PathFar, Floor: "floor redirect native", Setup: setupWeir(loader.ModeNative, loader.ForwardNAT, 0)}
	WeirNATGeneric = Balancer{Name: "weir nat generic", Group: "weir", Path: PathFar, Floor: "floor redirect generic", Setup: setupWeir(loader.ModeGeneric, loader.ForwardNAT, 0)}
	// A nat flow lives on through SYNs (only FIN, RST or idleness end it),
	// so SYN traffic alone measures established nat flows. With a TCP idle
	// timeout of 1 ns, a flow last seen in an earlier tick of the kernel's
	// coarse clock has expired, and at 100,000 flows every frame opens a
	// new flow: a new backend pick, port claim, reverse and connection
	// entries — the new-flow cost.
	WeirNATNewNative = Balancer{Name: "weir nat native, flows expire at once", Group: "weir", Path: PathFar, Floor: "floor redirect native", Setup: setupWeir(loader.ModeNative, loader.ForwardNAT, time.Nanosecond)}

	WeirTunnelNative  = Balancer{Name: "weir tunnel native", Group: "weir", Path: PathFar, Floor: "floor redirect native", Setup: setupWeir(loader.ModeNative, loader.ForwardTunnel, 0)}
	WeirTunnelGeneric = Balancer{Name: "weir tunnel generic", Group: "weir", Path: PathFar, Floor: "floor redirect generic", Setup: setupWeir(loader.ModeGeneric, loader.ForwardTunnel, 0)}

	KernelRoute = Balancer{Name: "kernel routing", Group: "kernel", Path: PathFar, Floor: "floor native", Setup: setupRoute}
	NftDNAT     = Balancer{Name: "nftables dnat", Group: "kernel", Path: PathFar, Floor: "floor native", Setup: setupNft(false)}
	NftDNATMasq = Balancer{Name: "nftables dnat+masquerade", Group: "kernel", Path: PathFar, Floor: "floor native", Setup: setupNft(true)}
)

// DefaultCases is the benchmark `make bench-pkt` runs, in the order each
// round runs it (floors before the cases compared with them).
func DefaultCases() []Case {
	ack := pktgen.Packet{}
	syn := pktgen.Packet{SYN: true}
	cs := []Case{
		{Balancer: Null, Flows: 1000, Packet: ack},
		{Balancer: FloorNative, Flows: 1000, Packet: ack},
		{Balancer: FloorGeneric, Flows: 1000, Packet: ack},
		{Balancer: FloorRedirectNative, Flows: 1000, Packet: ack},
		{Balancer: FloorRedirectGeneric, Flows: 1000, Packet: ack},
	}
	for _, b := range []Balancer{WeirDSRNative, WeirDSRGeneric} {
		for _, p := range []pktgen.Packet{ack, syn} {
			for _, flows := range []int{1, 1000, 100_000} {
				cs = append(cs, Case{Balancer: b, Flows: flows, Packet: p})
			}
		}
	}
	cs = append(cs,
		Case{Balancer: WeirDSRNative, Flows: 1000, Packet: pktgen.Packet{IPv6: true}},
		Case{Balancer: WeirDSRNative, Flows: 1000, Packet: pktgen.Packet{UDP: true}},
		Case{Balancer: WeirDSRNative, Flows: 4096, Packet: ack},
		Case{Balancer: WeirDSRNative, Flows: 1000, Packet: ack, RateOfFloor: 0.5},
	)
	// nat and tunnel: native at 1 to 100,000 flows, generic at 1,000 and
	// 100,000, IPv6 at 1,000.
	for _, b := range []Balancer{WeirNATNative, WeirTunnelNative} {
		for _, flows := range []int{1, 1000, 4096, 100_000} {
			cs = append(cs, Case{Balancer: b, Flows: flows, Packet: ack})
		}
		cs = append(cs,
			Case{Balancer: b, Flows: 1000, Packet: syn},
			Case{Balancer: b, Flows: 100_000, Packet: syn},
			Case{Balancer: b, Flows: 1000, Packet: pktgen.Packet{IPv6: true}},
			Case{Balancer: b, Flows: 1000, Packet: pktgen.Packet{IPv6: true, SYN: true}},
		)
	}
	for _, b := range []Balancer{WeirNATGeneric, WeirTunnelGeneric} {
		cs = append(cs,
			Case{Balancer: b, Flows: 1000, Packet: ack},
			Case{Balancer: b, Flows: 100_000, Packet: ack},
			Case{Balancer: b, Flows: 1000, Packet: syn},
		)
	}
	cs = append(cs, floodCases()...)
	cs = append(cs,
		Case{Balancer: WeirNATNewNative, Flows: 100_000, Packet: syn},
		Case{Balancer: WeirNATNative, Flows: 1000, Packet: ack, RateOfFloor: 0.5},
		Case{Balancer: KernelRoute, Flows: 4096, Packet: ack},
		Case{Balancer: NftDNAT, Flows: 1, Packet: ack},
		Case{Balancer: NftDNAT, Flows: 4096, Packet: ack},
		Case{Balancer: NftDNATMasq, Flows: 4096, Packet: ack},
	)
	if TrafgenAvailable() {
		cs = append(cs, TrafgenCases()...)
	}
	return append(cs, LatencyCases()...)
}

// TrafgenCases repeat a few cases with trafgen as the generator: null, the
// XDP_TX floor, weir dsr established at 1,000 flows, and nftables DNAT at
// 4,096 flows, so their ratios can be set beside weir's generator's.
func TrafgenCases() []Case {
	cs := []Case{
		{Balancer: Null, Flows: 1000},
		{Balancer: FloorNative, Flows: 1000},
		{Balancer: WeirDSRNative, Flows: 1000},
		{Balancer: NftDNAT, Flows: 4096},
	}
	for i := range cs {
		cs[i].Generator = Trafgen
	}
	return cs
}

// LatencyLoads are the load rates, in frames/s, of the latency cases beside
// none: one that nftables DNAT forwards without loss here and one beyond
// what it forwards (about a quarter of the redirect floor).
var LatencyLoads = []float64{0.5e6, 2e6}

// LatencyCases probe weir nat and nftables DNAT (the two balancers here
// whose backends answer) with no load and at each of LatencyLoads, 4,096
// established flows of load.
func LatencyCases() []Case {
	var cs []Case
	for _, b := range []Balancer{WeirNATNative, NftDNAT} {
		cs = append(cs, Case{Balancer: b, Flows: 4096, Idle: true, Probe: true})
		for _, r := range LatencyLoads {
			cs = append(cs, Case{Balancer: b, Flows: 4096, Rate: r, Probe: true})
		}
	}
	return cs
}

// NewCases are the cases of the second generator, latency and CPU cost
// with the null case and floors they are read against.
func NewCases() []Case {
	ack := pktgen.Packet{}
	cs := []Case{
		{Balancer: Null, Flows: 1000, Packet: ack},
		{Balancer: FloorNative, Flows: 1000, Packet: ack},
		{Balancer: FloorRedirectNative, Flows: 1000, Packet: ack},
		{Balancer: WeirDSRNative, Flows: 1000, Packet: ack},
		{Balancer: WeirNATNative, Flows: 4096, Packet: ack},
		{Balancer: NftDNAT, Flows: 4096, Packet: ack},
	}
	if TrafgenAvailable() {
		cs = append(cs, TrafgenCases()...)
	}
	return append(cs, LatencyCases()...)
}

// SmokeCases is a few seconds' check that the pipeline works: the null
// case, the floor and weir, one run each.
func SmokeCases() []Case {
	return []Case{
		{Balancer: Null, Flows: 100, Packet: pktgen.Packet{}},
		{Balancer: FloorNative, Flows: 100, Packet: pktgen.Packet{}},
		{Balancer: WeirDSRNative, Flows: 100, Packet: pktgen.Packet{}},
		{Balancer: WeirDSRGeneric, Flows: 100, Packet: pktgen.Packet{SYN: true}},
		{Balancer: FloorRedirectNative, Flows: 100, Packet: pktgen.Packet{}},
		{Balancer: WeirNATNative, Flows: 100, Packet: pktgen.Packet{IPv6: true}},
		{Balancer: WeirTunnelGeneric, Flows: 100, Packet: pktgen.Packet{}},
	}
}

// Backends is how many backends every dsr and tunnel service has, and
// nftables balances over.
const Backends = 4

// NATBackends is how many backends a nat service has: a nat flow holds a
// source port per (backend, protocol), from 22,768 (10000..32767), so
// 100,000 flows need more than 4 backends; 8 hold 12,500 each.
const NATBackends = 8

func setupNull(l *Line) (func() error, error) {
	s, err := pktgen.NewSink(false)
	if err != nil {
		return nil, err
	}
	if err := s.Attach(l.LB, LBIn); err != nil {
		s.Close()
		return nil, err
	}
	l.local = s
	return func() error {
		l.local = nil
		return s.Close()
	}, nil
}

func setupRedirectFloor(generic bool) func(l *Line) (func() error, error) {
	return func(l *Line) (func() error, error) {
		f, err := pktgen.NewRedirectFloor(LBOut, LBOutMAC, SinkMAC)
		if err != nil {
			return nil, err
		}
		if err := f.Attach(l.LB, LBIn, generic); err != nil {
			f.Close()
			return nil, err
		}
		return f.Close, nil
	}
}

func setupFloor(generic bool) func(l *Line) (func() error, error) {
	return func(l *Line) (func() error, error) {
		f, err := pktgen.NewFloor()
		if err != nil {
			return nil, err
		}
		if err := f.Attach(l.LB, LBIn, generic); err != nil {
			f.Close()
			return nil, err
		}
		return f.Close, nil
	}
}

// setupWeir loads weir's program with a TCP service on each VIP and a UDP
// one on VIP4, forwarding by fwd to Backends backends each (NATBackends for
// nat), and attaches it to l0 and, for nat and tunnel, to l1, so that its
// devmap can send out of l1. nat and tunnel send from l1's addresses to
// backends routed via s0. tcpIdle, if not 0, is nat's idle timeout for
// established TCP flows.
func setupWeir(mode loader.Mode, fwd loader.Forwarding, tcpIdle time.Duration) func(l *Line) (func() error, error) {
	return setupWeirOpts(mode, fwd, loader.Options{NAT: loader.NATOptions{TCPIdle: tcpIdle}})
}

// setupWeirOpts is setupWeir with the rest of the loader's options taken
// from opts (its hash seed and nat addresses are setupWeir's). While the
// balancer is installed, l.weir is its program.
func setupWeirOpts(mode loader.Mode, fwd loader.Forwarding, opts loader.Options) func(l *Line) (func() error, error) {
	opts.HashSeed = 1
	opts.NAT.Addr4, opts.NAT.Addr6 = LBOutIP, LBOutIP6
	return func(l *Line) (func() error, error) {
		p, err := loader.Load(opts)
		if err != nil {
			return nil, err
		}
		links := []string{LBIn}
		if fwd != loader.ForwardDSR {
			links = append(links, LBOut)
		}
		err = l.LB.Do(func() error {
			for _, link := range links {
				if _, err := p.Attach(link, mode); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			p.Close()
			return nil, err
		}
		n := Backends
		if fwd == loader.ForwardNAT {
			n = NATBackends
		}
		for _, k := range []loader.ServiceKey{
			{VIP: netip.AddrPortFrom(VIP4, Port), Protocol: loader.TCP},
			{VIP: netip.AddrPortFrom(VIP6, Port), Protocol: loader.TCP},
			{VIP: netip.AddrPortFrom(VIP4, Port), Protocol: loader.UDP},
		} {
			s := loader.Service{Key: k, Forwarding: fwd}
			for i := range n {
				ip, mac := Backend(i)
				if k.VIP.Addr().Is6() {
					ip = Backend6(i)
				}
				s.Backends = append(s.Backends, loader.Backend{Addr: netip.AddrPortFrom(ip, Port), MAC: mac, Weight: 1, Usable: true})
			}
			if err := p.AddService(s); err != nil {
				p.Close()
				return nil, err
			}
		}
		if fwd == loader.ForwardNAT {
			// The probe service: one backend, the sink namespace's echo
			// server.
			s := loader.Service{
				Key:        loader.ServiceKey{VIP: netip.AddrPortFrom(VIP4, ProbePort), Protocol: loader.TCP},
				Forwarding: fwd,
				Backends:   []loader.Backend{{Addr: netip.AddrPortFrom(ProbeBackend, ProbePort), MAC: SinkMAC, Weight: 1, Usable: true}},
			}
			if err := p.AddService(s); err != nil {
				p.Close()
				return nil, err
			}
		}
		if err := p.NextHopError(); err != nil {
			p.Close()
			return nil, err
		}
		l.weir = p
		return func() error {
			l.weir = nil
			return p.Close()
		}, nil
	}
}

// setupRoute routes the VIPs to the far side: plain kernel forwarding, the
// kernel's least work for a frame that leaves by another link.
func setupRoute(l *Line) (func() error, error) {
	r := &netlink.Route{Dst: ipNet(VIPNet4), Gw: SinkIP.AsSlice()}
	err := l.LB.Do(func() error {
		out, err := netlink.LinkByName(LBOut)
		if err != nil {
			return err
		}
		r.LinkIndex = out.Attrs().Index
		return netlink.RouteAdd(r)
	})
	if err != nil {
		return nil, fmt.Errorf("route %s: %w", VIPNet4, err)
	}
	return func() error { return l.LB.Do(func() error { return netlink.RouteDel(r) }) }, nil
}

// nftTable is the kernel's answer to weir's job: DNAT of the TCP VIP to the
// backends by a hash of the source, as a balancer would, optionally with
// masquerade (SNAT to l1's address) for a full-NAT comparison. The probe
// service (VIP4:ProbePort) goes to the echo server; the load never reaches
// that rule (a new connection's first packet alone runs the nat chain, and
// the load's all match the first rule).
const nftTable = "weirbench"

func nftRules(masquerade bool) string {
	var m []string
	for i := range Backends {
		ip, _ := Backend(i)
		m = append(m, fmt.Sprintf("%d : %s", i, ip))
	}
	s := fmt.Sprintf(`table ip %s {
	chain pre {
		type nat hook prerouting priority dstnat; policy accept;
		ip daddr %s tcp dport %d dnat to jhash ip saddr . tcp sport mod %d map { %s }
		ip daddr %s tcp dport %d dnat to %s
	}
`, nftTable, VIP4, Port, Backends, strings.Join(m, ", "), VIP4, ProbePort, ProbeBackend)
	if masquerade {
		s += fmt.Sprintf(`	chain post {
		type nat hook postrouting priority srcnat; policy accept;
		oifname %q masquerade
	}
`, LBOut)
	}
	return s + "}\n"
}

func setupNft(masquerade bool) func(l *Line) (func() error, error) {
	return func(l *Line) (func() error, error) {
		if err := nft(l.LB, nftRules(masquerade)); err != nil {
			return nil, err
		}
		// Repeated segments of a flow the conntrack never saw open are
		// in window only for the liberal TCP tracker (the generator does
		// not advance sequence numbers).
		if err := sysctls(l.LB, "net/netfilter/nf_conntrack_tcp_be_liberal", "1"); err != nil {
			nft(l.LB, "delete table ip "+nftTable+"\n")
			return nil, err
		}
		return func() error {
			err := nft(l.LB, "delete table ip "+nftTable+"\n")
			// A tracked flow keeps its NAT binding after the rules go:
			// flush, so the next case starts clean.
			return errors.Join(err, l.LB.Do(func() error { return netlink.ConntrackTableFlush(netlink.ConntrackTable) }))
		}, nil
	}
}

// nft runs `nft -f -` with script inside ns.
func nft(ns *netns.NS, script string) error {
	cmd := exec.Command("ip", "netns", "exec", ns.Name(), "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			return fmt.Errorf("nft in %s: %w (install iproute2 and nftables)", ns, err)
		}
		return fmt.Errorf("nft in %s: %w: %s", ns, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// nftAvailable says whether the nft binary is on PATH.
func nftAvailable() bool {
	_, err := exec.LookPath("nft")
	return err == nil
}
