package agent

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/config"
)

// xdpPlane is the loaded XDP program and where it is attached.
type xdpPlane struct {
	prog   *loader.Program // nil when XDP is unavailable
	reason string          // why it is unavailable, or how it is attached
	ifaces []InterfaceStatus
	links  map[int]string // ifindex -> name of attached interfaces
	addrs  []netip.Addr   // the balancer's own addresses

	hashSeed uint32
	scratch  scratchNS // where nat and tunnel self-tests run
}

// natAddr is the balancer's own address of a family: nat's source and tunnel's
// outer source (zero if there is none).
func (x *xdpPlane) natAddr(v6 bool) netip.Addr {
	for _, a := range x.addrs {
		if a.Is6() == v6 {
			return a
		}
	}
	return netip.Addr{}
}

// errInterfaceBusy: another program (another agent?) already holds the interface.
var errInterfaceBusy = errors.New("interface already has an XDP program")

// setupXDP loads the program and attaches it to every configured interface. It
// returns a plane without program, and the reason, when the host can't run XDP; it
// returns an error only for what must stop the agent (an interface that another
// XDP program holds).
func setupXDP(cfg *config.Config, disabled bool) (*xdpPlane, error) {
	x := &xdpPlane{links: make(map[int]string), addrs: cfg.Addrs, hashSeed: cfg.XDP.HashSeed}
	switch {
	case disabled:
		x.reason = "XDP disabled (--no-xdp)"
		return x, nil
	case len(cfg.Interfaces) == 0:
		x.reason = "no interfaces configured"
		return x, nil
	}
	if err := checkPrivileges(); err != nil {
		x.reason = err.Error()
		return x, nil
	}
	if err := ensureBPFFS(cfg.XDP.PinPath); err != nil {
		// Pinning is not used yet (see the README): without bpffs only a restart
		// would lose flows, so XDP still serves.
		x.reason = "bpffs: " + err.Error()
	}
	if len(x.addrs) == 0 {
		// Best effort: without an address of a family, nat and tunnel services of
		// that family fall back to the proxy and say why.
		x.addrs, _ = interfaceAddrs(cfg.Interfaces[0].Name)
	}
	prog, err := loader.Load(loader.Options{HashSeed: cfg.XDP.HashSeed, ConntrackSize: cfg.XDP.ConntrackSize,
		NAT: loader.NATOptions{Addr4: x.natAddr(false), Addr6: x.natAddr(true)}})
	if err != nil {
		x.reason = err.Error()
		return x, nil
	}
	for _, in := range cfg.Interfaces {
		st := InterfaceStatus{Name: in.Name, Requested: in.Attach}
		mode, err := prog.Attach(in.Name, loader.Mode(in.Attach))
		if err != nil {
			if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.EEXIST) {
				prog.Close()
				return nil, fmt.Errorf("attach xdp to %s: %w: is another weir agent running? (%w)", in.Name, errInterfaceBusy, err)
			}
			st.Error = err.Error()
		} else {
			st.Mode = string(mode)
			if iface, err := net.InterfaceByName(in.Name); err == nil {
				x.links[iface.Index] = in.Name
			}
		}
		x.ifaces = append(x.ifaces, st)
	}
	if len(x.links) == 0 {
		prog.Close()
		x.reason = "could not attach XDP to any interface"
		return x, nil
	}
	x.prog = prog
	return x, nil
}

func (x *xdpPlane) close() error {
	if x == nil || x.prog == nil {
		return nil
	}
	x.scratch.close()
	return x.prog.Close()
}

// canServe says whether the XDP plane can serve a service, and if not why.
func (x *xdpPlane) canServe(s *config.Service) error {
	switch {
	case x.prog == nil:
		return fmt.Errorf("XDP unavailable: %s", x.reason)
	case !config.XDPAlgorithm(s.Algorithm):
		return fmt.Errorf("algorithm %s needs the proxy (XDP serves maglev and source_hash)", s.Algorithm)
	}
	if err := x.modeReady(s); err != nil {
		return err
	}
	if err := x.selfTest(s); err != nil {
		return fmt.Errorf("self-test failed: %w", err)
	}
	return nil
}

// modeReady checks what a forwarding mode needs of the host: nat and tunnel send
// from the balancer's own address of the family they send in, and their next-hop
// lookups (bpf_fib_lookup) answer only where the kernel would forward: IPv4
// forwarding on the interface the packets arrive on, IPv6 forwarding for the host.
func (x *xdpPlane) modeReady(s *config.Service) error {
	var families []bool // IPv6?
	switch s.Mode {
	case config.ModeDSR:
		return nil
	case config.ModeNAT:
		families = []bool{s.VIPAddr.Addr().Is6()}
	case config.ModeTunnel:
		seen := map[bool]bool{}
		for _, b := range s.Backends {
			if !seen[b.Addr.Addr().Is6()] {
				seen[b.Addr.Addr().Is6()] = true
				families = append(families, b.Addr.Addr().Is6())
			}
		}
	}
	for _, v6 := range families {
		name, sysctl := "IPv4", "net/ipv4/conf/%s/forwarding"
		if v6 {
			name, sysctl = "IPv6", "net/ipv6/conf/all/forwarding"
		}
		if !x.natAddr(v6).IsValid() {
			return fmt.Errorf("%s mode needs the balancer's own %s address: list one in addresses (none found on the first interface either)", s.Mode, name)
		}
		for _, ifname := range x.links {
			path := sysctl
			if !v6 {
				path = fmt.Sprintf(sysctl, ifname)
			}
			b, err := os.ReadFile("/proc/sys/" + path)
			if err != nil {
				return fmt.Errorf("%s mode: read %s: %w", s.Mode, path, err)
			}
			if strings.TrimSpace(string(b)) != "1" {
				key := strings.ReplaceAll(path, "/", ".")
				return fmt.Errorf("%s mode needs %s forwarding (the program's next-hop lookup answers only where the kernel would forward): %s is 0; set it with sysctl -w %s=1", s.Mode, name, key, key)
			}
		}
	}
	return nil
}
