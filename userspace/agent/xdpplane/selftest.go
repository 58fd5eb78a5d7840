package xdpplane

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/config"
)

// The self-test runs the loaded program through BPF_PROG_TEST_RUN on golden
// packets for a service shaped like the one to serve (family, protocol, port,
// hashing, mode) at documentation addresses (RFC 5737, RFC 3849, RFC 7042) that no
// real client, VIP or backend has, so it is safe while real traffic flows.
//
// dsr needs nothing but the program. nat and tunnel ask bpf_fib_lookup for the next
// hop, whose answer depends on the host's routes, neighbours and forwarding
// settings: a test run in the host's namespace could end in "forwarded", "no
// neighbour" or "no route" and would check the rewrite only in some of them. So
// those packets run in a scratch network namespace the agent makes for the purpose
// (one veth pair, the documentation prefixes on-link, permanent neighbours,
// forwarding on): the lookup there always succeeds, and the whole output frame —
// MACs from the neighbour entry, translated or encapsulated packet, every checksum
// — is compared byte for byte with one built independently. (A test run resolves
// the ingress interface and the fib in the calling thread's namespace.)
var (
	testVIP4      = netip.MustParseAddr("192.0.2.1")
	testClient4   = netip.MustParseAddr("192.0.2.2")
	testBackend4  = netip.MustParseAddr("192.0.2.3")
	testVIP6      = netip.MustParseAddr("2001:db8::1")
	testClient6   = netip.MustParseAddr("2001:db8::2")
	testBackend6  = netip.MustParseAddr("2001:db8::3")
	testMACIn     = net.HardwareAddr{0x00, 0x00, 0x5e, 0x00, 0x53, 0x01}
	testMACOur    = net.HardwareAddr{0x00, 0x00, 0x5e, 0x00, 0x53, 0x02}
	testMACBE     = net.HardwareAddr{0x00, 0x00, 0x5e, 0x00, 0x53, 0x03}
	testNet4      = netip.MustParsePrefix("192.0.2.254/24")
	testNet6      = netip.MustParsePrefix("2001:db8::fe/64")
	testPeerLink  = "weirst1"
	testLink      = "weirst0"
	testBackendPt = uint16(8080) // nat changes the port
	testClientPt  atomic.Uint32  // a fresh client port per run, so runs never share a flow
)

// scratchNS is the self-test's network namespace, made on first use and kept until
// the plane closes.
type scratchNS struct {
	once    sync.Once
	handle  netns.NsHandle
	ifindex int
	err     error
}

// run calls fn on a thread inside the scratch namespace.
func (s *scratchNS) run(fn func(ifindex int) error) error {
	s.once.Do(s.create)
	if s.err != nil {
		return fmt.Errorf("self-test namespace: %w", s.err)
	}
	return onScratchThread(func() error {
		if err := netns.Set(s.handle); err != nil {
			return fmt.Errorf("self-test namespace: enter: %w", err)
		}
		return fn(s.ifindex)
	})
}

func (s *scratchNS) create() {
	s.err = onScratchThread(func() error {
		h, err := netns.New()
		if err != nil {
			return fmt.Errorf("unshare: %w", err)
		}
		s.handle = h
		if s.ifindex, err = setupScratch(); err != nil {
			h.Close()
		}
		return err
	})
}

// onScratchThread runs fn, which may switch its thread into another network
// namespace, on a locked thread of its own, and gives the thread back to the
// runtime only once it is back in the namespace it started in, so no other
// goroutine ever runs in the scratch namespace. A thread that cannot be
// switched back stays locked, and the runtime ends it when fn's goroutine
// exits. That must stay the exception: the runtime cannot end the process's
// main thread, which may be the one running fn, and parks it for good instead,
// leaving /proc/PID/ns/net (the main thread's) naming the scratch namespace
// for tools such as `ip netns identify` and `nsenter -t`.
func onScratchThread(fn func() error) error {
	errc := make(chan error, 1)
	// Exits when fn returns.
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("read the thread's network namespace: %w", err)
			return
		}
		defer orig.Close()
		err = fn()
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// setupScratch configures the namespace the calling thread is in.
func setupScratch() (int, error) {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return 0, err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return 0, err
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: testLink, HardwareAddr: testMACOur}, PeerName: testPeerLink}
	if err := netlink.LinkAdd(veth); err != nil {
		return 0, fmt.Errorf("add veth: %w", err)
	}
	l, err := netlink.LinkByName(testLink)
	if err != nil {
		return 0, err
	}
	peer, err := netlink.LinkByName(testPeerLink)
	if err != nil {
		return 0, err
	}
	for _, sysctl := range []string{"net/ipv4/conf/all/forwarding", "net/ipv6/conf/all/forwarding",
		"net/ipv6/conf/default/accept_dad", "net/ipv6/conf/" + testLink + "/accept_dad"} {
		v := "1"
		if sysctl[len(sysctl)-3:] == "dad" {
			v = "0"
		}
		if err := os.WriteFile("/proc/sys/"+sysctl, []byte(v), 0o644); err != nil {
			return 0, err
		}
	}
	for _, link := range []netlink.Link{l, peer} {
		if err := netlink.LinkSetUp(link); err != nil {
			return 0, fmt.Errorf("set %s up: %w", link.Attrs().Name, err)
		}
	}
	for _, p := range []netip.Prefix{testNet4, testNet6} {
		a := &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}, Flags: unix.IFA_F_NODAD}
		if err := netlink.AddrAdd(l, a); err != nil {
			return 0, fmt.Errorf("add address %s: %w", p, err)
		}
	}
	for _, ip := range []netip.Addr{testBackend4, testBackend6} {
		fam := unix.AF_INET
		if ip.Is6() {
			fam = unix.AF_INET6
		}
		n := &netlink.Neigh{LinkIndex: l.Attrs().Index, Family: fam, IP: ip.AsSlice(), HardwareAddr: testMACBE, State: netlink.NUD_PERMANENT}
		if err := netlink.NeighSet(n); err != nil {
			return 0, fmt.Errorf("add neighbour %s: %w", ip, err)
		}
	}
	return l.Attrs().Index, nil
}

func (s *scratchNS) close() {
	s.once.Do(func() { s.err = errors.New("closed") })
	if s.err == nil {
		s.handle.Close()
	}
}

// selfTest installs a test service shaped like s, checks the program's answer to
// its golden packets, and removes it again.
func (x *Plane) selfTest(s *config.Service) error {
	v6 := s.VIP.Addr().Is6()
	vip, client := testVIP4, testClient4
	if v6 {
		vip, client = testVIP6, testClient6
	}
	proto := loader.TCP
	if s.Protocol == config.UDP {
		proto = loader.UDP
	}
	port := s.VIP.Port()
	key := loader.ServiceKey{VIP: netip.AddrPortFrom(vip, port), Protocol: proto}
	svc := loader.Service{Key: key, SourceHash: s.Hash == config.HashSource, Forwarding: forwarding(s.Mode),
		P2C: s.Algorithm == config.AlgorithmMaglevP2C}
	var backendFamilies []bool // IPv6? of each backend family to test (tunnel may mix)
	switch s.Mode {
	case config.ModeDSR:
		svc.Backends = []loader.Backend{{Addr: netip.AddrPortFrom(testBackendAddr(v6), port), MAC: testMACBE, Weight: 1, Usable: true}}
	case config.ModeNAT:
		svc.Backends = []loader.Backend{{Addr: netip.AddrPortFrom(testBackendAddr(v6), testBackendPt), Weight: 1, Usable: true}}
	case config.ModeTunnel:
		seen := map[bool]bool{}
		for _, b := range s.Backends {
			seen[b.Addr.Addr().Is6()] = true
		}
		for _, fam := range []bool{false, true} {
			if seen[fam] {
				backendFamilies = append(backendFamilies, fam)
			}
		}
	}
	if s.Mode == config.ModeTunnel {
		// One test service per backend family, each with one backend.
		for _, fam := range backendFamilies {
			svc.Backends = []loader.Backend{{Addr: netip.AddrPortFrom(testBackendAddr(fam), port), Weight: 1, Usable: true}}
			if err := x.runSelfTest(svc, client); err != nil {
				return err
			}
		}
	} else if err := x.runSelfTest(svc, client); err != nil {
		return err
	}
	return nil
}

func testBackendAddr(v6 bool) netip.Addr {
	if v6 {
		return testBackend6
	}
	return testBackend4
}

func (x *Plane) runSelfTest(svc loader.Service, client netip.Addr) error {
	key := svc.Key
	prog, err := x.selfTestProgram()
	if err != nil {
		return err
	}
	if err := prog.AddService(svc); err != nil {
		return fmt.Errorf("install test service %s: %w", key, err)
	}
	defer prog.DeleteService(key)

	frame := packet.Frame{SrcMAC: testMACIn, DstMAC: testMACOur,
		Src: netip.AddrPortFrom(client, uint16(40000+testClientPt.Add(1)%20000)), Dst: key.VIP, Payload: []byte("weir self-test")}
	if key.Protocol == loader.UDP {
		frame.Proto = packet.ProtoUDP
	} else {
		frame.TCPFlags, frame.Seq = packet.SYN, 1000
	}
	in := frame.Build()
	be := svc.Backends[0].Addr
	switch svc.Forwarding {
	case loader.ForwardDSR:
		err = x.checkRun(in, 0, loader.XDPTX, func(out []byte) error {
			want := append(append(append([]byte{}, testMACBE...), testMACOur...), in[12:]...)
			if !bytes.Equal(out, want) {
				return fmt.Errorf("want the frame with destination MAC %s, source MAC %s and nothing else changed", testMACBE, testMACOur)
			}
			return nil
		})
	case loader.ForwardNAT:
		err = x.scratch.run(func(ifindex int) error { return x.natSelfTest(frame, be, ifindex) })
	case loader.ForwardTunnel:
		err = x.scratch.run(func(ifindex int) error { return x.tunnelSelfTest(frame, be, ifindex) })
	}
	if err != nil {
		return fmt.Errorf("first packet to %s (%s mode): %w", key, svc.Forwarding, err)
	}

	other := frame
	other.Dst = netip.AddrPortFrom(key.VIP.Addr(), key.VIP.Port()+1)
	if key.VIP.Port() == 65535 {
		other.Dst = netip.AddrPortFrom(key.VIP.Addr(), 1)
	}
	in = other.Build()
	err = x.checkRun(in, 0, loader.XDPPass, func(out []byte) error {
		if !bytes.Equal(out, in) {
			return errors.New("want the frame untouched")
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("packet to %s (no service): %w", other.Dst, err)
	}
	return nil
}

// checkRun runs one frame and checks the verdict, then the output with check.
func (x *Plane) checkRun(in []byte, ifindex int, want loader.Action, check func(out []byte) error) error {
	prog, err := x.selfTestProgram()
	if err != nil {
		return err
	}
	act, out, err := prog.RunOn(in, ifindex)
	if err != nil {
		return err
	}
	if act != want {
		return fmt.Errorf("got %v; want %v", act, want)
	}
	if err := check(out); err != nil {
		return fmt.Errorf("%v, output %x: %w", act, out, err)
	}
	return nil
}

// natSelfTest: the client's packet leaves translated (source: the balancer's address
// and a port of the nat range; destination: the backend) to the backend's MAC, and
// the backend's reply comes back translated to the client by the way it came.
func (x *Plane) natSelfTest(in packet.Frame, be netip.AddrPort, ifindex int) error {
	own := x.natAddr(be.Addr().Is6())
	l4 := 14 + 20
	if be.Addr().Is6() {
		l4 = 14 + 40
	}
	var natPort uint16
	err := x.checkRun(in.Build(), ifindex, loader.XDPTX, func(out []byte) error {
		if len(out) < l4+2 {
			return errors.New("frame too short")
		}
		natPort = binary.BigEndian.Uint16(out[l4:])
		if lo, hi := x.selfProg.NATPortRange(); natPort < lo || natPort > hi {
			return fmt.Errorf("nat source port %d; want %d..%d", natPort, lo, hi)
		}
		want := in
		want.SrcMAC, want.DstMAC = testMACOur, testMACBE
		want.Src, want.Dst = netip.AddrPortFrom(own, natPort), be
		if !bytes.Equal(out, want.Build()) {
			return fmt.Errorf("want %x (to %s from %s, MACs %s from %s)", want.Build(), be, want.Src, testMACBE, testMACOur)
		}
		return nil
	})
	if err != nil {
		return err
	}
	reply := packet.Frame{SrcMAC: testMACBE, DstMAC: testMACOur, Proto: in.Proto,
		Src: be, Dst: netip.AddrPortFrom(own, natPort), Payload: []byte("weir self-test reply")}
	if in.Proto != packet.ProtoUDP {
		// The SYN-ACK must answer the client's SYN: anything else is another
		// connection's, which nat passes to the host.
		reply.TCPFlags, reply.Ack = packet.SYN|packet.ACK, in.Seq+1
	}
	want := reply
	want.SrcMAC, want.DstMAC = in.DstMAC, in.SrcMAC
	want.Src, want.Dst = in.Dst, in.Src
	err = x.checkRun(reply.Build(), ifindex, loader.XDPTX, func(out []byte) error {
		if !bytes.Equal(out, want.Build()) {
			return fmt.Errorf("want %x (to the client %s from the VIP %s)", want.Build(), in.Src, in.Dst)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("reply: %w", err)
	}
	return nil
}

// tunnelSelfTest: the client's packet leaves whole inside an outer IPv4 or IPv6
// header from the balancer's address to the backend's, to the backend's MAC.
func (x *Plane) tunnelSelfTest(in packet.Frame, be netip.AddrPort, ifindex int) error {
	inner := in.Build()[14:]
	key := loader.ServiceKey{VIP: in.Dst, Protocol: loader.Protocol(6)}
	if in.Proto == packet.ProtoUDP {
		key.Protocol = loader.UDP
	}
	hash := loader.OuterHash(loader.Flow{Src: in.Src, Dst: in.Dst, Protocol: key.Protocol})
	innerProto := byte(4) // IPPROTO_IPIP
	if in.Dst.Addr().Is6() {
		innerProto = 41 // IPPROTO_IPV6
	}
	own := x.natAddr(be.Addr().Is6())
	want := append(append([]byte{}, testMACBE...), testMACOur...)
	if be.Addr().Is4() {
		h := make([]byte, 20)
		h[0] = 0x45
		binary.BigEndian.PutUint16(h[2:], uint16(20+len(inner)))
		binary.LittleEndian.PutUint16(h[4:], uint16(hash)) // the program stores the hash's low half as is
		binary.BigEndian.PutUint16(h[6:], 0x4000)          // DF
		h[8], h[9] = 64, innerProto
		s, d := own.As4(), be.Addr().As4()
		copy(h[12:], s[:])
		copy(h[16:], d[:])
		binary.BigEndian.PutUint16(h[10:], packet.Checksum(h))
		want = append(binary.BigEndian.AppendUint16(want, 0x0800), h...)
	} else {
		h := make([]byte, 40)
		binary.BigEndian.PutUint32(h[0:], 0x60000000|hash&0xfffff)
		binary.BigEndian.PutUint16(h[4:], uint16(len(inner)))
		h[6], h[7] = innerProto, 64
		s, d := own.As16(), be.Addr().As16()
		copy(h[8:], s[:])
		copy(h[24:], d[:])
		want = append(binary.BigEndian.AppendUint16(want, 0x86dd), h...)
	}
	want = append(want, inner...)
	return x.checkRun(in.Build(), ifindex, loader.XDPTX, func(out []byte) error {
		if !bytes.Equal(out, want) {
			return fmt.Errorf("want %x (the packet inside a header from %s to %s)", want, own, be.Addr())
		}
		return nil
	})
}
