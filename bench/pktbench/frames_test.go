package pktbench

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bench/pktgen"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/xdptest"
)

// TestWeirFramesAtSink sends exactly n SYNs of n flows through weir's nat
// and tunnel modes and captures what arrives on s0 (a packet socket behind
// a sink that passes what it counts): the sink must see n frames, each the
// generator's frame as the mode should leave it, byte for byte — nat: from
// l1's address and a port in 10000..32767 to a backend's, checksums as if
// computed afresh; tunnel: an outer header from l1's address to a backend's
// around the generator's packet, unchanged. The n frames must also be n
// flows: nat gives each flow its own (backend, port), tunnel carries n
// distinct client 5-tuples, so the generator's flows are distinct.
func TestWeirFramesAtSink(t *testing.T) {
	l, err := NewLine()
	xdptest.Check(t, err)
	t.Cleanup(func() { l.Close() })
	// The far sink passes frames on, so the capture below sees them.
	l.Far.Close()
	l.Far, err = pktgen.NewSink(true)
	xdptest.Check(t, err)
	xdptest.Check(t, l.Far.Attach(l.Sink, SinkLink))
	capture := openCapture(t, l)

	const n = 1000
	for _, tc := range []struct {
		b    Balancer
		ipv6 bool
	}{
		{WeirNATNative, false},
		{WeirNATNative, true},
		{WeirNATGeneric, false},
		{WeirTunnelNative, false},
		{WeirTunnelNative, true},
		{WeirTunnelGeneric, true},
	} {
		p := pktgen.Packet{SYN: true, IPv6: tc.ipv6}
		t.Run(fmt.Sprintf("%s/%s", tc.b.Name, p.Traffic()), func(t *testing.T) {
			teardown, err := tc.b.Setup(l)
			xdptest.Check(t, err)
			defer func() {
				if err := teardown(); err != nil {
					t.Error(err)
				}
			}()
			cfg := pktgen.Config{
				SrcMAC: GenMAC, DstMAC: LBInMAC,
				Dst4: netipPort(VIP4), Dst6: netipPort(VIP6),
				Flows: n, Mix: []pktgen.Packet{p},
			}
			g, err := pktgen.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			capture.drain()
			before, err := l.Far.Count()
			if err != nil {
				t.Fatal(err)
			}
			if err := g.Send(l.Gen, l.GenIndex, n); err != nil {
				t.Fatal(err)
			}
			// read returns once all n have come; the ceiling is for a loaded machine.
			frames, others := capture.read(t, n, 5*time.Second)
			after, err := l.Far.Count()
			if err != nil {
				t.Fatal(err)
			}
			if got := after.Sub(before).Packets; got != uint64(n+others) {
				t.Errorf("far sink counted %d frames; want %d (and %d not to a backend)", got, n, others)
			}
			if len(frames) != n {
				t.Fatalf("captured %d frames to the backends; want %d", len(frames), n)
			}
			check := checkNAT
			if tc.b.Name == WeirTunnelNative.Name || tc.b.Name == WeirTunnelGeneric.Name {
				check = checkTunnel
			}
			flows := map[string]bool{}
			for i, fr := range frames {
				flow, err := check(cfg, p, fr)
				if err != nil {
					t.Fatalf("frame %d: %v\n%x", i, err, fr)
				}
				flows[flow] = true
			}
			if len(flows) != n {
				t.Errorf("%d frames carry %d distinct flows; want %d", n, len(flows), n)
			}
		})
	}
}

// checkNAT checks a frame weir's nat sent to a backend and returns its flow
// as the backend sees it (backend and nat port).
func checkNAT(cfg pktgen.Config, p pktgen.Packet, fr []byte) (string, error) {
	in := cfg.Frame(p, 0)
	src, dst, sport, dport, err := addrs(fr)
	if err != nil {
		return "", err
	}
	wantSrc, n := LBOutIP, NATBackends
	if p.IPv6 {
		wantSrc = LBOutIP6
	}
	if src != wantSrc {
		return "", fmt.Errorf("source %s; want the nat address %s", src, wantSrc)
	}
	if !isBackend(dst, p.IPv6, n) {
		return "", fmt.Errorf("destination %s; want one of the %d backends", dst, n)
	}
	if sport < 10000 || sport > 32767 || dport != Port {
		return "", fmt.Errorf("ports %d -> %d; want 10000..32767 -> %d", sport, dport, Port)
	}
	// The generator's frame rewritten, checksums computed from scratch.
	want := packet.Frame{
		SrcMAC: LBOutMAC, DstMAC: SinkMAC,
		Src: netip.AddrPortFrom(src, sport), Dst: netip.AddrPortFrom(dst, dport),
		TCPFlags: packet.SYN, Payload: make([]byte, len(in)-headerLen(p)),
	}.Build()
	if !bytes.Equal(fr, want) {
		return "", fmt.Errorf("got\n%x\nwant\n%x", fr, want)
	}
	return netip.AddrPortFrom(dst, sport).String(), nil
}

// checkTunnel checks a frame weir's tunnel sent to a backend and returns the
// client's flow it carries (its source address: the generator's flows
// differ by source address).
func checkTunnel(cfg pktgen.Config, p pktgen.Packet, fr []byte) (string, error) {
	if len(fr) < 14 || !bytes.Equal(fr[:6], SinkMAC) || !bytes.Equal(fr[6:12], LBOutMAC) {
		return "", fmt.Errorf("MACs %x; want %s -> %s", fr[:min(len(fr), 12)], LBOutMAC, SinkMAC)
	}
	var outer, inner []byte
	var src, dst netip.Addr
	switch binary.BigEndian.Uint16(fr[12:]) {
	case unix.ETH_P_IP:
		if len(fr) < 34 {
			return "", errors.New("short IPv4 header")
		}
		outer, inner = fr[14:34], fr[34:]
		src, dst = netip.AddrFrom4([4]byte(outer[12:16])), netip.AddrFrom4([4]byte(outer[16:20]))
		if outer[0] != 0x45 || int(binary.BigEndian.Uint16(outer[2:])) != len(fr)-14 ||
			binary.BigEndian.Uint16(outer[6:]) != 0x4000 || outer[8] != 64 || outer[9] != 4 {
			return "", fmt.Errorf("outer IPv4 header %x; want version 4, IHL 5, length %d, DF, TTL 64, protocol 4 (IPIP)", outer, len(fr)-14)
		}
		if packet.Checksum(outer) != 0 {
			return "", fmt.Errorf("outer IPv4 header %x: bad checksum", outer)
		}
	case unix.ETH_P_IPV6:
		if len(fr) < 54 {
			return "", errors.New("short IPv6 header")
		}
		outer, inner = fr[14:54], fr[54:]
		src, dst = netip.AddrFrom16([16]byte(outer[8:24])), netip.AddrFrom16([16]byte(outer[24:40]))
		if outer[0]>>4 != 6 || int(binary.BigEndian.Uint16(outer[4:])) != len(inner) || outer[6] != 41 || outer[7] != 64 {
			return "", fmt.Errorf("outer IPv6 header %x; want version 6, payload %d, next header 41 (IPv6), hop limit 64", outer, len(inner))
		}
	default:
		return "", fmt.Errorf("ethertype %#04x; want IPv4 or IPv6", binary.BigEndian.Uint16(fr[12:]))
	}
	wantSrc := LBOutIP
	if p.IPv6 {
		wantSrc = LBOutIP6
	}
	if src != wantSrc || !isBackend(dst, p.IPv6, Backends) {
		return "", fmt.Errorf("outer %s -> %s; want %s -> one of the %d backends", src, dst, wantSrc, Backends)
	}
	// The client's packet, unchanged: the generator's frame of the flow
	// its source address says.
	csrc, _, _, _, err := addrs(append(bytes.Clone(fr[:14]), inner...))
	if err != nil {
		return "", fmt.Errorf("inner: %w", err)
	}
	base := pktgen.Src4
	if p.IPv6 {
		base = pktgen.Src6
	}
	f := int(binary.BigEndian.Uint32(csrc.AsSlice()[csrc.BitLen()/8-4:]) - binary.BigEndian.Uint32(base.AsSlice()[base.BitLen()/8-4:]))
	if f < 0 || f >= cfg.Flows {
		return "", fmt.Errorf("inner source %s: not one of the generator's %d flows", csrc, cfg.Flows)
	}
	if want := cfg.Frame(p, f)[14:]; !bytes.Equal(inner, want) {
		return "", fmt.Errorf("inner packet\n%x\nwant flow %d's\n%x", inner, f, want)
	}
	return csrc.String(), nil
}

// addrs reads an Ethernet frame's IP addresses and TCP/UDP ports.
func addrs(fr []byte) (src, dst netip.Addr, sport, dport uint16, err error) {
	if len(fr) < 14 {
		return src, dst, 0, 0, errors.New("short frame")
	}
	l4 := 0
	switch binary.BigEndian.Uint16(fr[12:]) {
	case unix.ETH_P_IP:
		if len(fr) >= 34 {
			src, dst = netip.AddrFrom4([4]byte(fr[26:30])), netip.AddrFrom4([4]byte(fr[30:34]))
			l4 = 14 + 4*int(fr[14]&0xf)
		}
	case unix.ETH_P_IPV6:
		if len(fr) >= 54 {
			src, dst = netip.AddrFrom16([16]byte(fr[22:38])), netip.AddrFrom16([16]byte(fr[38:54]))
			l4 = 54
		}
	}
	if l4 == 0 || len(fr) < l4+4 {
		return src, dst, 0, 0, fmt.Errorf("not an IP frame with ports: %x", fr)
	}
	return src, dst, binary.BigEndian.Uint16(fr[l4:]), binary.BigEndian.Uint16(fr[l4+2:]), nil
}

func isBackend(a netip.Addr, ipv6 bool, n int) bool {
	for i := range n {
		ip, _ := Backend(i)
		if ipv6 {
			ip = Backend6(i)
		}
		if a == ip {
			return true
		}
	}
	return false
}

// headerLen is the length of p's Ethernet, IP and TCP/UDP headers.
func headerLen(p pktgen.Packet) int {
	n := 14 + 20 + 20
	if p.IPv6 {
		n += 20
	}
	if p.UDP {
		n -= 12
	}
	return n
}

// capture is a packet socket on s0.
type capture struct{ fd int }

func openCapture(t *testing.T, l *Line) *capture {
	c := &capture{fd: -1}
	err := l.Sink.Do(func() error {
		proto := int(htons(unix.ETH_P_ALL))
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, proto)
		if err != nil {
			return err
		}
		c.fd = fd
		// Room for a whole exact-count run: each frame holds a page.
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 16<<20); err != nil {
			return err
		}
		iface, err := net.InterfaceByName(SinkLink)
		if err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: iface.Index})
	})
	if c.fd >= 0 {
		t.Cleanup(func() { unix.Close(c.fd) })
	}
	if err != nil {
		t.Fatalf("packet socket on %s: %v", SinkLink, err)
	}
	return c
}

// drain discards what the socket holds.
func (c *capture) drain() {
	buf := make([]byte, 4096)
	for {
		if _, _, err := unix.Recvfrom(c.fd, buf, 0); err != nil {
			return
		}
	}
}

// read returns the IP frames to the backend networks that arrive within
// timeout, up to n and then whatever else comes within 50 ms (too many is
// an error the caller sees). Anything else the link carries (MLD reports
// from l1) is logged, left out and counted in others.
func (c *capture) read(t *testing.T, n int, timeout time.Duration) (frames [][]byte, others int) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	buf := make([]byte, 4096)
	for ctx.Err() == nil {
		m, _, err := unix.Recvfrom(c.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) {
			if len(frames) >= n {
				time.Sleep(50 * time.Millisecond)
				if _, _, err := unix.Recvfrom(c.fd, buf, unix.MSG_PEEK); err != nil {
					return frames, others
				}
				continue
			}
			time.Sleep(time.Millisecond)
			continue
		}
		if err != nil {
			t.Fatalf("capture: %v", err)
		}
		fr := bytes.Clone(buf[:m])
		if dst := ipDst(fr); BackendNet4.Contains(dst) || BackendNet6.Contains(dst) {
			frames = append(frames, fr)
			continue
		}
		others++
		t.Logf("capture: left out a frame not to a backend: %x", fr[:min(len(fr), 64)])
	}
	return frames, others
}

// ipDst is an Ethernet frame's (outer) IP destination; invalid if none.
func ipDst(fr []byte) netip.Addr {
	switch {
	case len(fr) >= 34 && binary.BigEndian.Uint16(fr[12:]) == unix.ETH_P_IP:
		return netip.AddrFrom4([4]byte(fr[30:34]))
	case len(fr) >= 54 && binary.BigEndian.Uint16(fr[12:]) == unix.ETH_P_IPV6:
		return netip.AddrFrom16([16]byte(fr[38:54]))
	}
	return netip.Addr{}
}

func htons(v uint16) uint16 { return v>>8 | v<<8 }
