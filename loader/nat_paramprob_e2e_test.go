package loader

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
)

// paramProbPort is the nat UDP service TestNATParameterProblem sends through.
const paramProbPort = 9400

// TestNATParameterProblem sends an ICMP parameter problem (IPv4 type 12, ICMPv6
// type 4) about a real nat flow through the attached program, each way: the
// backend, from a raw socket, reports a fault in the client's datagram as it
// received it (from the nat address), and the client reports one in the backend's
// answer as it received it (from the VIP). Each side's UDP socket, with RECVERR on,
// must find the error in its queue with the type, code and pointer that were sent,
// from the address it talks to: the client's kernel found its socket by the quote
// only if the program translated it to the client's own flow, and the backend's
// likewise for its side. An IPv4 quote with a Record Route a router filled in
// reaches the client with its options as they were, though its header's checksum
// no longer holds; one without options whose header's checksum fails is dropped
// and counted (drop_icmp_checksum), and reaches no socket.
func TestNATParameterProblem(t *testing.T) {
	for _, mode := range []Mode{ModeNative, ModeGeneric} {
		t.Run(string(mode), func(t *testing.T) {
			tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wpe"), Backends: 1})
			p := attachBalancer(t, tp, mode, Options{HashSeed: 7, NAT: NATOptions{Addr4: tp.Balancer.IP4, Addr6: tp.Balancer.IP6}})
			be := tp.Backends[0]
			for _, v6 := range []bool{false, true} {
				vip, beIP, natIP, clientIP := tp.VIP4, be.IP4, tp.Balancer.IP4, tp.Client.IP4
				family := "ipv4"
				if v6 {
					vip, beIP, natIP, clientIP = tp.VIP6, be.IP6, tp.Balancer.IP6, tp.Client.IP6
					family = "ipv6"
				}
				svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip, paramProbPort), UDP}, Forwarding: ForwardNAT,
					Backends: []Backend{{Addr: netip.AddrPortFrom(beIP, paramProbPort), Weight: 1, Usable: true}}}
				if err := p.AddService(svc); err != nil {
					t.Fatal(err)
				}
				t.Run(family, func(t *testing.T) {
					natParameterProblem(t, tp, p, vip, beIP, natIP, clientIP)
				})
			}
		})
	}
}

func natParameterProblem(t *testing.T, tp *topo.Topology, p *Program, vip, beIP, natIP, clientIP netip.Addr) {
	be := tp.Backends[0]
	network := "udp4"
	if vip.Is6() {
		network = "udp6"
	}
	srvPC, err := be.NS.ListenPacket(network, netip.AddrPortFrom(beIP, paramProbPort).String())
	if err != nil {
		t.Fatal(err)
	}
	srv := srvPC.(*net.UDPConn)
	t.Cleanup(func() { srv.Close() })
	client, err := tp.DialUDP(context.Background(), netip.AddrPortFrom(vip, paramProbPort), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	for _, c := range []*net.UDPConn{srv, client} {
		if err := recvErr(c, vip.Is6()); err != nil {
			t.Fatal(err)
		}
	}
	clientAddr := netip.AddrPortFrom(clientIP, client.LocalAddr().(*net.UDPAddr).AddrPort().Port())

	// One exchange through the VIP: the backend learns the flow's nat port.
	deadline := time.Now().Add(10 * time.Second)
	client.SetDeadline(deadline)
	srv.SetDeadline(deadline)
	if _, err := client.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, from, err := srv.ReadFromUDPAddrPort(buf)
	if err != nil {
		t.Fatalf("backend: read the client's datagram: %v", err)
	}
	from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
	if from.Addr() != natIP || string(buf[:n]) != "ping" {
		t.Fatalf("backend got %q from %s; want \"ping\" from %s", buf[:n], from, natIP)
	}
	if _, err := srv.WriteToUDPAddrPort([]byte("pong"), from); err != nil {
		t.Fatal(err)
	}
	if n, err := client.Read(buf); err != nil || string(buf[:n]) != "pong" {
		t.Fatalf("client: read %q, %v; want \"pong\"", buf[:n], err)
	}

	typ, code, pointer := uint8(12), uint8(0), uint32(9) // IPv4: the protocol field
	if vip.Is6() {
		typ, code, pointer = 4, 0, 6 // ICMPv6: the next header field
	}
	before, err := p.Stats()
	if err != nil {
		t.Fatal(err)
	}

	// The backend's side: the quote is the datagram as the backend got it.
	got := packet.Frame{Src: from, Dst: netip.AddrPortFrom(beIP, paramProbPort), Proto: packet.ProtoUDP, Payload: []byte("ping")}
	if err := sendParamProb(be.NS, beIP, natIP, typ, code, pointer, got.IPPacket()); err != nil {
		t.Fatal(err)
	}
	wantICMPError(t, client, "client", vip, typ, code, pointer)

	// The client's side: the quote is the answer as the client got it.
	got = packet.Frame{Src: netip.AddrPortFrom(vip, paramProbPort), Dst: clientAddr, Proto: packet.ProtoUDP, Payload: []byte("pong")}
	if err := sendParamProb(tp.Client.NS, clientIP, vip, typ, code, pointer, got.IPPacket()); err != nil {
		t.Fatal(err)
	}
	wantICMPError(t, srv, "backend", natIP, typ, code, pointer)

	after, err := p.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if n := after.Reasons[ReasonICMPTranslated].Packets - before.Reasons[ReasonICMPTranslated].Packets; n != 2 {
		t.Errorf("icmp_translated rose by %d; want 2", n)
	}
	if vip.Is6() {
		return
	}

	// A quote whose header carries Record Route keeps its options as they are: the
	// client's stack finds its socket by the quote's addresses and ports, never by
	// an option's. The router filled the option in (the nat address, the pointer
	// moved past it) and quoted the header with the checksum it came with, as Linux
	// does for an error it sends before forwarding; the error still reaches the
	// client.
	withRR := packet.Frame{Src: from, Dst: netip.AddrPortFrom(beIP, paramProbPort), Proto: packet.ProtoUDP, Payload: []byte("ping"),
		IPv4Options: []byte{7, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0, 1}}.IPPacket()
	withRR[22] = 8
	copy(withRR[23:27], natIP.AsSlice())
	if err := sendParamProb(be.NS, beIP, natIP, typ, code, 20, withRR); err != nil {
		t.Fatal(err)
	}
	wantICMPError(t, client, "client, quote with record route", vip, typ, code, 20)
	if after, err = p.Stats(); err != nil {
		t.Fatal(err)
	}

	// A quoted IPv4 header whose own checksum fails, in an error whose ICMP checksum
	// holds, is dropped (RFC 5508 REQ-3 a), not sent to the client.
	quote := packet.Frame{Src: from, Dst: netip.AddrPortFrom(beIP, paramProbPort), Proto: packet.ProtoUDP, Payload: []byte("ping")}.IPPacket()
	quote[10] ^= 0x40
	if err := sendParamProb(be.NS, beIP, natIP, typ, code, pointer, quote); err != nil {
		t.Fatal(err)
	}
	dropped := func() (any, bool) {
		st, err := p.Stats()
		if err != nil {
			return err, false
		}
		n := st.Reasons[ReasonDropICMPChecksum].Packets - after.Reasons[ReasonDropICMPChecksum].Packets
		return n, n == 1
	}
	waitfor.Value(t, 10*time.Second, "1 more drop_icmp_checksum", dropped)
	rc, err := client.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	rc.Control(func(fd uintptr) {
		if ee, _, _ := readErrQueue(int(fd)); ee != nil {
			t.Errorf("client: got an ICMP error (type %d) about a quote whose header checksum fails; want none", ee.Type)
		}
	})
}

// recvErr turns on RECVERR, so c's ICMP errors queue with their type, code and
// pointer.
func recvErr(c *net.UDPConn, v6 bool) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = rc.Control(func(fd uintptr) {
		if v6 {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_RECVERR, 1)
		} else {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_RECVERR, 1)
		}
	})
	return errors.Join(err, serr)
}

// sendParamProb sends, from a raw socket in ns, a parameter problem from src to
// dst with the pointer (in IPv4 the top byte of the second word, in ICMPv6 the whole
// word) and quote.
func sendParamProb(ns *netns.NS, src, dst netip.Addr, typ, code uint8, pointer uint32, quote []byte) error {
	network, proto, hdr := "ip4:icmp", uint8(packet.ProtoICMP), 20
	rest := pointer << 24
	if dst.Is6() {
		network, proto, hdr, rest = "ip6:ipv6-icmp", packet.ProtoICMPv6, 40, pointer
	}
	msg := packet.Frame{Src: netip.AddrPortFrom(src, 0), Dst: netip.AddrPortFrom(dst, 0), Proto: proto,
		ICMP: &packet.ICMP{Type: typ, Code: code, Rest: rest, Quote: quote}}.IPPacket()[hdr:]
	pc, err := ns.ListenPacket(network, src.String())
	if err != nil {
		return err
	}
	defer pc.Close()
	_, err = pc.WriteTo(msg, &net.IPAddr{IP: dst.AsSlice()})
	return err
}

// wantICMPError waits for c's error queue to hold an ICMP error and checks it
// against what was sent: EPROTO, type, code, pointer, and from offender.
func wantICMPError(t *testing.T, c *net.UDPConn, who string, offender netip.Addr, typ, code uint8, pointer uint32) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var ee *unix.SockExtendedErr
	var from netip.Addr
	var last error
	waitfor.Cond(10*time.Second, func() bool {
		rc.Control(func(fd uintptr) {
			ee, from, last = readErrQueue(int(fd))
		})
		return ee != nil
	})
	if ee == nil {
		t.Fatalf("%s: no ICMP error in the socket's queue: %v", who, last)
	}
	got := fmt.Sprintf("errno %d type %d code %d pointer %d from %s", ee.Errno, ee.Type, ee.Code, ee.Info, from)
	want := fmt.Sprintf("errno %d type %d code %d pointer %d from %s", unix.EPROTO, typ, code, pointer, offender)
	if got != want {
		t.Errorf("%s: got %s; want %s", who, got, want)
	}
}

// readErrQueue takes one error from fd's queue without waiting.
func readErrQueue(fd int) (*unix.SockExtendedErr, netip.Addr, error) {
	oob := make([]byte, 512)
	_, oobn, _, _, err := unix.Recvmsg(fd, make([]byte, 512), oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
	if err != nil {
		return nil, netip.Addr{}, err
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return nil, netip.Addr{}, err
	}
	for _, m := range msgs {
		v4 := m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_RECVERR
		v6 := m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_RECVERR
		const eeLen = 16 // struct sock_extended_err
		if !v4 && !v6 || len(m.Data) < eeLen+8 {
			continue
		}
		ee := &unix.SockExtendedErr{
			Errno:  binary.NativeEndian.Uint32(m.Data[0:]),
			Origin: m.Data[4], Type: m.Data[5], Code: m.Data[6],
			Info: binary.NativeEndian.Uint32(m.Data[8:]),
			Data: binary.NativeEndian.Uint32(m.Data[12:]),
		}
		// The offender, a sockaddr_in or sockaddr_in6, follows.
		sa := m.Data[eeLen:]
		var from netip.Addr
		if v4 {
			from = netip.AddrFrom4([4]byte(sa[4:8]))
		} else if len(sa) >= 24 {
			from = netip.AddrFrom16([16]byte(sa[8:24]))
		}
		return ee, from, nil
	}
	return nil, netip.Addr{}, errors.New("no RECVERR message")
}
