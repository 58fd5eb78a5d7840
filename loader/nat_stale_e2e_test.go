package loader

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
)

// staleRing is the nat port range of TestNATPortMeetsBackendState: small, so
// the test can put a stale connection on the backend under every port of it.
const (
	staleRingMin  = 20000
	staleRingSize = 16
)

// TestNATPortMeetsBackendState holds nat to its rule for a port handed on from a
// flow that never finished its handshake (a flood's, or a client that went away):
// the backend may still hold that flow's half-open connection on the port, and a
// new client on it must still get through, after one SYN retransmission at most.
//
// In "stale connections on every port", spoofed SYNs leave a half-open
// connection on the backend under each port of the ring; the new clients' SYNs
// meet them, the backend answers with the stale connections' numbers, the program
// passes those answers to the host, whose stack resets the stale connections,
// and each client's SYN sent again gets through on its port.
//
// In "backend silent on the first port", the backend drops every SYN on the
// ring's first port (nftables), as a backend does whose stale connection
// rate-limits its answers; the client's SYN sent again must start over on
// another port instead of waiting on that one until the half-open flow expires.
//
// In "tcp fast open", the client's second connection carries its first bytes in
// its SYN and the backend's SYN-ACK acknowledges them too: that answer is the
// flow's own, and the connection must need no retransmission.
func TestNATPortMeetsBackendState(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		family := "ipv4"
		if v6 {
			family = "ipv6"
		}
		t.Run(family, func(t *testing.T) {
			t.Run("stale connections on every port", func(t *testing.T) { staleOnEveryPort(t, v6) })
			t.Run("backend silent on the first port", func(t *testing.T) { silentFirstPort(t, v6) })
			t.Run("tcp fast open", func(t *testing.T) { fastOpen(t, v6) })
		})
	}
}

// staleTopology is one backend serving echo behind a nat service on the small
// port ring.
type staleTopology struct {
	*topo.Topology
	prog    *Program
	vip     netip.AddrPort
	natAddr netip.Addr
	backend topo.Host
}

// newStaleTopology builds it; with fastOpen the echo server and the client's
// namespace have TCP Fast Open on.
func newStaleTopology(t *testing.T, v6, fastOpen bool) *staleTopology {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wst"), Backends: 1})
	be := tp.Backends[0]
	if fastOpen {
		serveFastOpenEcho(t, tp, be, echoPort)
	} else {
		serveEcho(t, be.NS, echoPort)
	}
	p := attachBalancer(t, tp, ModeNative, Options{HashSeed: 7, NAT: NATOptions{
		Addr4: tp.Balancer.IP4, Addr6: tp.Balancer.IP6,
		PortMin: staleRingMin, PortMax: staleRingMin + staleRingSize - 1,
	}})
	st := &staleTopology{Topology: tp, prog: p, vip: netip.AddrPortFrom(tp.VIP4, echoPort), natAddr: tp.Balancer.IP4, backend: be}
	ip := be.IP4
	if v6 {
		st.vip, st.natAddr, ip = netip.AddrPortFrom(tp.VIP6, echoPort), tp.Balancer.IP6, be.IP6
	}
	svc := Service{Key: ServiceKey{st.vip, TCP}, Forwarding: ForwardNAT,
		Backends: []Backend{{Addr: netip.AddrPortFrom(ip, echoPort), Weight: 1, Usable: true}}}
	if err := p.AddService(svc); err != nil {
		t.Fatal(err)
	}
	return st
}

func staleOnEveryPort(t *testing.T, v6 bool) {
	st := newStaleTopology(t, v6, false)
	st.spoofSYNs(t, staleRingSize)
	// Every spoofed SYN took a port of the ring and left a half-open connection on
	// the backend, which keeps answering it for a minute.
	waitSynRecv(t, st.backend, staleRingSize)
	before := st.counters(t)

	conns := st.connectAll(t, staleRingSize)
	after := st.counters(t)
	stale := after[ReasonPassNATStale] - before[ReasonPassNATStale]
	t.Logf("%d new connections, SYN retransmissions %v; pass_nat_stale %d, nat_new_port %d",
		len(conns), conns, stale, after[ReasonNATNewPort]-before[ReasonNATNewPort])
	if stale == 0 {
		t.Error("pass_nat_stale 0: no answer of a stale connection went to the host; want some")
	}
	// The host's resets ended every stale connection.
	waitSynRecv(t, st.backend, 0)
}

func silentFirstPort(t *testing.T, v6 bool) {
	st := newStaleTopology(t, v6, false)
	ip := "ip"
	if v6 {
		ip = "ip6"
	}
	nft(t, st.backend, fmt.Sprintf(`table inet wstale {
	chain input {
		type filter hook input priority 0; policy accept;
		%s saddr %s tcp sport %d tcp flags & (syn | ack) == syn drop
	}
}`, ip, st.natAddr, staleRingMin))
	before := st.counters(t)
	conns := st.connectAll(t, 1)
	after := st.counters(t)
	moved := after[ReasonNATNewPort] - before[ReasonNATNewPort]
	t.Logf("SYN retransmissions %v; nat_new_port %d", conns, moved)
	if moved != 1 {
		t.Errorf("nat_new_port %d; want 1 (the SYN sent again, moved off the silent port)", moved)
	}
}

func fastOpen(t *testing.T, v6 bool) {
	st := newStaleTopology(t, v6, true)
	// The first connection fetches the backend's cookie; the second sends its
	// message in its SYN.
	for i, what := range []string{"cookie", "data in the SYN"} {
		before := fastOpenPassive(t, st.backend)
		retrans, err := st.echoOnce(fmt.Sprintf("fast open connection %d", i), fastOpenConnect)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		passive := fastOpenPassive(t, st.backend) - before
		t.Logf("%s: %d retransmissions, TCPFastOpenPassive +%d", what, retrans, passive)
		if retrans != 0 {
			t.Errorf("%s: %d retransmissions; want 0", what, retrans)
		}
		if i == 1 && passive != 1 {
			t.Errorf("%s: the backend's TCPFastOpenPassive rose by %d; want 1 (the SYN's data accepted)", what, passive)
		}
	}
}

// fastOpenConnect is a dialer Control that turns TCP_FASTOPEN_CONNECT on: connect
// returns at once and the first write goes out in the SYN (with a cookie cached).
func fastOpenConnect(_, _ string, c syscall.RawConn) error {
	var err error
	if cerr := c.Control(func(fd uintptr) {
		err = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_FASTOPEN_CONNECT, 1)
	}); cerr != nil {
		return cerr
	}
	return err
}

// serveFastOpenEcho turns TCP Fast Open on in the client's and h's namespaces
// and serves echo on port in h with a Fast Open listener.
func serveFastOpenEcho(t *testing.T, tp *topo.Topology, h topo.Host, port int) {
	t.Helper()
	for _, host := range []topo.Host{tp.Client, h} {
		err := host.NS.Do(func() error {
			return os.WriteFile("/proc/sys/net/ipv4/tcp_fastopen", []byte("3"), 0o644) // client and server
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var err error
		if cerr := c.Control(func(fd uintptr) {
			err = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_FASTOPEN, 16)
		}); cerr != nil {
			return cerr
		}
		return err
	}}
	var ln net.Listener
	err := h.NS.Do(func() (err error) {
		ln, err = lc.Listen(context.Background(), "tcp", fmt.Sprintf(":%d", port))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	echoOn(t, ln)
}

// fastOpenPassive is h's count of Fast Open SYNs whose data it accepted
// (TcpExt TCPFastOpenPassive).
func fastOpenPassive(t *testing.T, h topo.Host) uint64 {
	t.Helper()
	var n uint64
	err := h.NS.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/netstat")
		if err != nil {
			return err
		}
		lines := strings.Split(string(b), "\n")
		for i := 0; i+1 < len(lines); i += 2 {
			names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
			for j, name := range names {
				if name == "TCPFastOpenPassive" && j < len(values) {
					_, err := fmt.Sscan(values[j], &n)
					return err
				}
			}
		}
		return errors.New("no TCPFastOpenPassive in /proc/net/netstat")
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// connectAll opens n connections to the service at once, each echoing a message;
// every one must succeed after one SYN retransmission at most. It returns each
// connection's count of retransmissions.
func (st *staleTopology) connectAll(t *testing.T, n int) []uint32 {
	t.Helper()
	retrans := make([]uint32, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		// Exits when its connection is done, within its deadline.
		go func() {
			defer wg.Done()
			retrans[i], errs[i] = st.echoOnce(fmt.Sprintf("connection %d", i), nil)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("connection %d: %v", i, err)
		} else if retrans[i] > 1 {
			t.Errorf("connection %d: %d SYN retransmissions; want 1 at most", i, retrans[i])
		}
	}
	return retrans
}

// echoOnce connects (giving up after 3 s: two SYN retransmissions' worth, as
// topo's dialer does), echoes msg and closes, and returns the retransmissions the
// connection needed. control, if not nil, is the dialer's Control.
func (st *staleTopology) echoOnce(msg string, control func(network, address string, c syscall.RawConn) error) (uint32, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d := &net.Dialer{Timeout: 3 * time.Second, Control: control}
	conn, err := st.Client.NS.DialWith(ctx, d, "tcp", st.vip.String())
	if err != nil {
		return 0, err
	}
	c := conn.(*net.TCPConn)
	defer c.Close()
	deadline, _ := ctx.Deadline()
	c.SetDeadline(deadline)
	if _, err := c.Write([]byte(msg)); err != nil {
		return 0, err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != msg {
		return 0, fmt.Errorf("echo: got %q, %v; want %q", got, err, msg)
	}
	// Read after the echo: with Fast Open the handshake completes with the first
	// write, and its retransmissions are known only then.
	return handshakeRetransmits(c)
}

// spoofSYNs sends n SYNs to the service from the client's link, each from its
// own source in the benchmarking ranges (198.18.0.0/15, 2001:2::/48), with a
// random initial sequence number. The backend's answers, translated back, reach
// the client namespace, which owns none of those addresses and forwards nothing:
// the backend's half-open connections are never answered.
func (st *staleTopology) spoofSYNs(t *testing.T, n int) {
	t.Helper()
	err := st.Client.NS.Do(func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		to := &unix.SockaddrLinklayer{Ifindex: st.Client.Index, Halen: 6}
		copy(to.Addr[:], st.Balancer.MAC)
		for i := range n {
			src := netip.AddrFrom4([4]byte{198, 18, 0, byte(1 + i)})
			if st.vip.Addr().Is6() {
				src = netip.AddrFrom16([16]byte{0x20, 0x01, 0, 0x02, 15: byte(1 + i)})
			}
			f := packet.Frame{SrcMAC: st.Client.MAC, DstMAC: st.Balancer.MAC,
				Src: netip.AddrPortFrom(src, 40000), Dst: st.vip, TCPFlags: packet.SYN, Seq: rand.Uint32() | 1}
			if err := unix.Sendto(fd, f.Build(), 0, to); err != nil {
				return fmt.Errorf("send spoofed syn %d: %w", i, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func (st *staleTopology) counters(t *testing.T) map[Reason]uint64 {
	t.Helper()
	s, err := st.prog.Stats()
	if err != nil {
		t.Fatal(err)
	}
	out := map[Reason]uint64{}
	for r, c := range s.Reasons {
		out[r] = c.Packets
	}
	return out
}

// waitSynRecv polls, up to 5 s, until h holds want connections in SYN_RECV.
func waitSynRecv(t *testing.T, h topo.Host, want int) {
	t.Helper()
	got := -1
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		got = 0
		err := h.NS.Do(func() error {
			for _, name := range []string{"tcp", "tcp6"} {
				n, err := countSynRecv("/proc/thread-self/net/" + name)
				if err != nil {
					return err
				}
				got += n
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if got == want {
			return
		}
	}
	t.Fatalf("%s holds %d connections in SYN_RECV; want %d", h.Name, got, want)
}

// countSynRecv counts the SYN_RECV (state 03) lines of a /proc/net/tcp table.
func countSynRecv(path string) (int, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 3 && fields[3] == "03" {
			n++
		}
	}
	return n, sc.Err()
}

// nft loads an nftables ruleset into h's namespace (the nft command, which
// make deps installs).
func nft(t *testing.T, h topo.Host, ruleset string) {
	t.Helper()
	cmd := exec.Command("ip", "netns", "exec", h.NS.Name(), "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(ruleset)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft in %s: %v: %s (nft comes with nftables: make deps)", h.Name, err, out)
	}
}
