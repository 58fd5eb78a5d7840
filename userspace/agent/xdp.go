package agent

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/packet"
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
}

// errInterfaceBusy: another program (another agent?) already holds the interface.
var errInterfaceBusy = errors.New("interface already has an XDP program")

// setupXDP loads the program and attaches it to every configured interface. It
// returns a plane without program, and the reason, when the host can't run XDP; it
// returns an error only for what must stop the agent (an interface that another
// XDP program holds).
func setupXDP(cfg *config.Config, disabled bool) (*xdpPlane, error) {
	x := &xdpPlane{links: make(map[int]string), addrs: cfg.Addrs}
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
	prog, err := loader.Load(loader.Options{HashSeed: cfg.XDP.HashSeed, ConntrackSize: cfg.XDP.ConntrackSize})
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
	if len(x.addrs) == 0 {
		x.addrs, _ = interfaceAddrs(cfg.Interfaces[0].Name)
	}
	return x, nil
}

func (x *xdpPlane) close() error {
	if x == nil || x.prog == nil {
		return nil
	}
	return x.prog.Close()
}

// canServe says whether the XDP plane can serve a service, and if not why.
func (x *xdpPlane) canServe(s *config.Service) error {
	switch {
	case x.prog == nil:
		return fmt.Errorf("XDP unavailable: %s", x.reason)
	case !config.XDPAlgorithm(s.Algorithm):
		return fmt.Errorf("algorithm %s needs the proxy (XDP serves maglev and source_hash)", s.Algorithm)
	case s.Mode != config.ModeDSR:
		return fmt.Errorf("the agent drives only dsr mode in XDP so far (%s needs its own self-test and settings)", s.Mode)
	}
	if err := x.selfTest(s); err != nil {
		return fmt.Errorf("self-test failed: %w", err)
	}
	return nil
}

// Addresses the self-test uses: documentation ranges (RFC 5737, RFC 3849, RFC 7042)
// that no real client, VIP or backend has.
var (
	testVIP4     = netip.MustParseAddr("192.0.2.1")
	testClient4  = netip.MustParseAddr("192.0.2.2")
	testBackend4 = netip.MustParseAddr("192.0.2.3")
	testVIP6     = netip.MustParseAddr("2001:db8::1")
	testClient6  = netip.MustParseAddr("2001:db8::2")
	testBackend6 = netip.MustParseAddr("2001:db8::3")
	testMACIn    = net.HardwareAddr{0x00, 0x00, 0x5e, 0x00, 0x53, 0x01}
	testMACOur   = net.HardwareAddr{0x00, 0x00, 0x5e, 0x00, 0x53, 0x02}
	testMACBE    = net.HardwareAddr{0x00, 0x00, 0x5e, 0x00, 0x53, 0x03}
)

// selfTest runs the loaded program through BPF_PROG_TEST_RUN on golden packets for
// a service shaped like s (family, protocol, port, hashing) at a documentation
// VIP, so it is safe while real traffic flows: a first packet of a flow must leave
// by XDP_TX with only the MACs rewritten as dsr does, and a packet to another port
// must pass untouched.
func (x *xdpPlane) selfTest(s *config.Service) error {
	vip, client, be := testVIP4, testClient4, testBackend4
	if s.VIPAddr.Addr().Is6() {
		vip, client, be = testVIP6, testClient6, testBackend6
	}
	proto := loader.TCP
	if s.Protocol == "udp" {
		proto = loader.UDP
	}
	port := s.VIPAddr.Port()
	key := loader.ServiceKey{VIP: netip.AddrPortFrom(vip, port), Protocol: proto}
	svc := loader.Service{Key: key, SourceHash: s.Hash == config.HashSource, Backends: []loader.Backend{
		{Addr: netip.AddrPortFrom(be, port), MAC: testMACBE, Weight: 1, Usable: true},
	}}
	if err := x.prog.AddService(svc); err != nil {
		return fmt.Errorf("install test service %s: %w", key, err)
	}
	defer x.prog.DeleteService(key)

	frame := packet.Frame{SrcMAC: testMACIn, DstMAC: testMACOur,
		Src: netip.AddrPortFrom(client, 40000), Dst: key.VIP, Payload: []byte("weir self-test")}
	if proto == loader.UDP {
		frame.Proto = packet.ProtoUDP
	} else {
		frame.TCPFlags = packet.SYN
	}
	in := frame.Build()
	act, out, err := x.prog.Run(in)
	if err != nil {
		return err
	}
	want := append(append(append([]byte{}, testMACBE...), testMACOur...), in[12:]...)
	if act != loader.XDPTX || !bytes.Equal(out, want) {
		return fmt.Errorf("first packet to %s: got %v and a %d-byte frame; want XDP_TX and the frame with destination MAC %s, source MAC %s", key, act, len(out), testMACBE, testMACOur)
	}

	other := frame
	other.Dst = netip.AddrPortFrom(vip, port+1)
	if port == 65535 {
		other.Dst = netip.AddrPortFrom(vip, 1)
	}
	in = other.Build()
	if act, out, err = x.prog.Run(in); err != nil {
		return err
	}
	if act != loader.XDPPass || !bytes.Equal(out, in) {
		return fmt.Errorf("packet to %s (no service): got %v; want XDP_PASS and the frame untouched", other.Dst, act)
	}
	return nil
}
