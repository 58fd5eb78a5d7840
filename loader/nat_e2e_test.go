package loader

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/internal/xdptest"
)

// natTopology builds the demo topology with the program attached to the balancer
// in nat mode for HTTP (all backends) and an echo service (backend-0 only), both
// families. Backends keep their VIPs on lo but nat never sends them a VIP address.
type natTopology struct {
	*topo.Topology
	prog *Program
	web  map[bool]Service // by IPv6
	echo map[bool]Service
}

// natConntrackSize is the nat tests' table size (0: the default).
var natConntrackSize uint32

const (
	echoPort   = 9000
	closedPort = 5555 // a nat udp service whose backends listen on nothing
)

func newNATTopology(t testing.TB, mode Mode) *natTopology {
	t.Helper()
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wnt"), Backends: 3})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := tp.ServeBackends(ctx); err != nil {
		t.Fatal(err)
	}
	// An echo server on backend-0 for the bulk transfer.
	serveEcho(t, tp.Backends[0].NS, echoPort)
	p := attachBalancer(t, tp, mode, Options{HashSeed: 7, ConntrackSize: natConntrackSize, NAT: NATOptions{Addr4: tp.Balancer.IP4, Addr6: tp.Balancer.IP6}})

	nt := &natTopology{Topology: tp, prog: p, web: map[bool]Service{}, echo: map[bool]Service{}}
	for _, v6 := range []bool{false, true} {
		vip := tp.VIP4
		if v6 {
			vip = tp.VIP6
		}
		web := Service{Key: ServiceKey{netip.AddrPortFrom(vip, topo.HTTPPort), TCP}, Forwarding: ForwardNAT}
		dns := Service{Key: ServiceKey{netip.AddrPortFrom(vip, topo.UDPPort), UDP}, Forwarding: ForwardNAT}
		echo := Service{Key: ServiceKey{netip.AddrPortFrom(vip, echoPort), TCP}, Forwarding: ForwardNAT}
		closed := Service{Key: ServiceKey{netip.AddrPortFrom(vip, closedPort), UDP}, Forwarding: ForwardNAT}
		for i, h := range tp.Backends {
			ip := h.IP4
			if v6 {
				ip = h.IP6
			}
			web.Backends = append(web.Backends, Backend{Addr: netip.AddrPortFrom(ip, topo.HTTPPort), Weight: 1, Usable: true})
			dns.Backends = append(dns.Backends, Backend{Addr: netip.AddrPortFrom(ip, topo.UDPPort), Weight: 1, Usable: true})
			closed.Backends = append(closed.Backends, Backend{Addr: netip.AddrPortFrom(ip, closedPort), Weight: 1, Usable: true})
			if i == 0 {
				echo.Backends = append(echo.Backends, Backend{Addr: netip.AddrPortFrom(ip, echoPort), Weight: 1, Usable: true})
			}
		}
		for _, s := range []Service{web, dns, echo, closed} {
			if err := p.AddService(s); err != nil {
				t.Fatal(err)
			}
		}
		nt.web[v6], nt.echo[v6] = web, echo
	}
	return nt
}

// attachBalancer turns forwarding on in tp's balancer namespace (fib lookups
// forward only where it is on), loads the program with opts and attaches it to
// the balancer's link in mode. The program is closed at cleanup.
func attachBalancer(t testing.TB, tp *topo.Topology, mode Mode, opts Options) *Program {
	t.Helper()
	err := tp.Balancer.NS.Do(func() error {
		for _, k := range []string{"net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"} {
			if err := os.WriteFile("/proc/sys/"+k, []byte("1"), 0o644); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	p, err := Load(opts)
	xdptest.Check(t, err)
	t.Cleanup(func() { p.Close() })
	var got Mode
	err = tp.Balancer.NS.Do(func() error {
		var err error
		got, err = p.Attach(tp.Balancer.Link, mode)
		return err
	})
	xdptest.Check(t, err)
	if got != mode {
		t.Fatalf("attached in %s mode; want %s", got, mode)
	}
	return p
}

func TestNATEndToEnd(t *testing.T) {
	for _, mode := range []Mode{ModeNative, ModeGeneric} {
		t.Run(string(mode), func(t *testing.T) {
			nt := newNATTopology(t, mode)
			for _, v6 := range []bool{false, true} {
				family := "ipv4"
				vip := nt.VIP4
				if v6 {
					family, vip = "ipv6", nt.VIP6
				}
				t.Run(family, func(t *testing.T) {
					t.Run("1000 new connections", func(t *testing.T) { natManyConnections(t, nt, vip, 1000) })
					t.Run("udp", func(t *testing.T) {
						for i := range 30 {
							if _, err := nt.AskUDP(context.Background(), netip.AddrPortFrom(vip, topo.UDPPort), uint16(31000+i)); err != nil {
								t.Fatal(err)
							}
						}
					})
					t.Run("bulk transfer", func(t *testing.T) { natBulk(t, nt, vip, 100<<20) })
					t.Run("backend's icmp error reaches the client", func(t *testing.T) { natPortUnreachable(t, nt, vip, nil) })
					if !v6 {
						// Record Route, two slots: the client's kernel fills the first as
						// it sends, the backend's the second on receipt, and it quotes
						// the header so changed with the checksum it came with, which
						// then fails.
						rr := []byte{7, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0}
						t.Run("backend's icmp error about a datagram with record route reaches the client", func(t *testing.T) {
							natPortUnreachable(t, nt, vip, rr)
						})
					}
					t.Run("same source port from two clients", func(t *testing.T) { natSamePort(t, nt, vip) })
					t.Run("source port reused after a reset", func(t *testing.T) { natPortReuse(t, nt, vip) })
				})
			}
			st, err := nt.prog.Stats()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("counters: %v", st.Reasons)
		})
	}
}

func natManyConnections(t *testing.T, nt *natTopology, vip netip.Addr, n int) {
	// The answers could come some other way than through the translation (a route
	// the topology did not mean): the counter says they did not. Read here, not
	// once at the end of the test, so it holds whichever subtests -run selects.
	translatedBefore := natRepliesTranslated(t, nt)
	answers := make(map[string]int)
	var mu sync.Mutex
	var wg sync.WaitGroup
	var failures []error
	work := make(chan struct{})
	for range 8 {
		wg.Add(1)
		// Exits when work is closed.
		go func() {
			defer wg.Done()
			for range work {
				name, err := nt.Get(context.Background(), vip)
				mu.Lock()
				if err != nil {
					failures = append(failures, err)
				}
				answers[name]++
				mu.Unlock()
			}
		}()
	}
	for range n {
		work <- struct{}{}
	}
	close(work)
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("%d of %d requests failed; first: %v", len(failures), n, failures[0])
	}
	for _, h := range nt.Backends {
		share := float64(answers[h.Name]) / float64(n)
		if share < 0.7/3 || share > 1.3/3 {
			t.Errorf("%s answered %.1f%%; want within ±30%% of a third", h.Name, 100*share)
		}
	}
	// Every connection ends with FINs both ways, so none stays active; the count is
	// what a load-aware choice would read. A flow is counted closed at its second FIN,
	// which may still be on its way when the client's last request is done: poll.
	var opened, active uint64
	waitfor.Cond(5*time.Second, func() bool {
		st, err := nt.prog.Stats()
		if err != nil {
			t.Fatal(err)
		}
		opened, active = 0, 0
		for _, fc := range st.Flows[nt.web[vip.Is6()].Key] {
			opened += fc.Opened
			active += fc.Active()
		}
		return active == 0
	})
	if opened < uint64(n) {
		t.Errorf("backends' flow counters opened %d; want at least %d", opened, n)
	}
	if got := natRepliesTranslated(t, nt) - translatedBefore; got < uint64(n) {
		t.Errorf("%d reply packets translated for %d connections; want at least one each", got, n)
	}
	if active != 0 {
		t.Errorf("%d flows still counted active 5 s after every connection closed; want 0", active)
	}
}

// natRepliesTranslated reads the program's count of backends' packets translated
// back to the client.
func natRepliesTranslated(t *testing.T, nt *natTopology) uint64 {
	t.Helper()
	st, err := nt.prog.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return st.Reasons[ReasonNATReply].Packets
}

// natBulk sends size random bytes through the echo service and checks that what
// comes back hashes the same.
func natBulk(t *testing.T, nt *natTopology, vip netip.Addr, size int64) {
	c, err := nt.DialTCP(context.Background(), netip.AddrPortFrom(vip, echoPort), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(60 * time.Second))
	sent := sha256.New()
	errc := make(chan error, 1)
	// Exits when the whole payload is written.
	go func() {
		src := io.TeeReader(io.LimitReader(newPattern(), size), sent)
		_, err := io.Copy(c, src)
		if err == nil {
			err = c.CloseWrite()
		}
		errc <- err
	}()
	got := sha256.New()
	n, err := io.Copy(got, c)
	if err != nil {
		t.Fatalf("read back after %d bytes: %v", n, err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if n != size || string(got.Sum(nil)) != string(sent.Sum(nil)) {
		t.Fatalf("echoed %d bytes with sha256 %x; want %d bytes with %x", n, got.Sum(nil), size, sent.Sum(nil))
	}
}

// newPattern is a cheap endless stream of varying bytes.
func newPattern() io.Reader { return &pattern{} }

type pattern struct{ x uint64 }

func (p *pattern) Read(b []byte) (int, error) {
	for i := range b {
		p.x = p.x*6364136223846793005 + 1442695040888963407
		b[i] = byte(p.x >> 56)
	}
	return len(b), nil
}

// natSamePort connects from two client addresses with the same source port to
// the single-backend echo service: both must be served, so the balancer must give
// them different source ports towards the backend.
// natPortReuse: a client resets a connection and opens the next one from the same
// source port while the balancer still holds the first one's closing entry. The new
// connection is a new flow: it works, and the backends' counters open it.
func natPortReuse(t *testing.T, nt *natTopology, vip netip.Addr) {
	const port = 45999
	svc := nt.echo[vip.Is6()]
	opened := func() (n uint64) {
		t.Helper()
		st, err := nt.prog.Stats()
		if err != nil {
			t.Fatal(err)
		}
		for _, fc := range st.Flows[svc.Key] {
			n += fc.Opened
		}
		return n
	}
	echo := func(c *net.TCPConn, msg string) {
		t.Helper()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != msg {
			t.Fatalf("echo: got %q, %v; want %q", got, err, msg)
		}
	}
	before := opened()
	first, err := nt.DialTCP(context.Background(), svc.Key.VIP, port)
	if err != nil {
		t.Fatal(err)
	}
	echo(first, "first")
	first.SetLinger(0) // close with a reset: no TIME_WAIT holds the port
	first.Close()
	second, err := nt.DialTCP(context.Background(), svc.Key.VIP, port)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	echo(second, "second")
	if got := opened() - before; got != 2 {
		t.Errorf("backends' counters opened %d flows for two connections from one source port; want 2", got)
	}
}

func natSamePort(t *testing.T, nt *natTopology, vip netip.Addr) {
	second := netip.MustParseAddr("10.77.0.3")
	bits := 24
	if vip.Is6() {
		second, bits = netip.MustParseAddr("fd77::3"), 64
	}
	// A second client address on the client's link, and the balancer's neighbour
	// entry for it, as topo gives every host.
	err := nt.Client.NS.Do(func() error {
		l, err := netlink.LinkByName(nt.Client.Link)
		if err != nil {
			return err
		}
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: second.AsSlice(), Mask: net.CIDRMask(bits, second.BitLen())}, Flags: unix.IFA_F_NODAD}
		if err := netlink.AddrReplace(l, addr); err != nil {
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	err = nt.Balancer.NS.Do(func() error {
		l, err := netlink.LinkByName(nt.Balancer.Link)
		if err != nil {
			return err
		}
		return netlink.NeighSet(&netlink.Neigh{LinkIndex: l.Attrs().Index, IP: second.AsSlice(),
			HardwareAddr: nt.Client.MAC, State: netlink.NUD_PERMANENT, Family: family2netlink(second)})
	})
	if err != nil {
		t.Fatal(err)
	}

	const port = 45678
	var conns []net.Conn
	for _, src := range []netip.Addr{nt.Client.IP4, second} {
		if vip.Is6() && src == nt.Client.IP4 {
			src = nt.Client.IP6
		}
		d := &net.Dialer{Timeout: 3 * time.Second, LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, port))}
		c, err := nt.Client.NS.DialWith(context.Background(), d, "tcp", netip.AddrPortFrom(vip, echoPort).String())
		if err != nil {
			t.Fatalf("dial from %s:%d: %v", src, port, err)
		}
		defer c.Close()
		conns = append(conns, c)
	}
	for i, c := range conns {
		msg := fmt.Sprintf("hello from client %d", i)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
			t.Fatalf("client %d got %q, %v; want %q", i, buf, err, msg)
		}
	}
}

func family2netlink(a netip.Addr) int {
	if a.Is4() {
		return netlink.FAMILY_V4
	}
	return netlink.FAMILY_V6
}

// natPortUnreachable sends UDP to a service whose backends listen on nothing: the
// backend's kernel answers "port unreachable" to the nat address, the program
// translates it, and the client's connected socket sees the refusal. A datagram
// carries ipOptions (IPv4) when they are given.
func natPortUnreachable(t *testing.T, nt *natTopology, vip netip.Addr, ipOptions []byte) {
	before, err := nt.prog.Stats()
	if err != nil {
		t.Fatal(err)
	}
	c, err := nt.DialUDP(context.Background(), netip.AddrPortFrom(vip, closedPort), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if ipOptions != nil {
		rc, err := c.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptString(int(fd), unix.IPPROTO_IP, unix.IP_OPTIONS, string(ipOptions))
		}); err != nil || serr != nil {
			t.Fatalf("set IP_OPTIONS: %v", errors.Join(err, serr))
		}
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("anyone?")); err != nil {
		t.Fatal(err)
	}
	_, err = c.Read(make([]byte, 16))
	if !errors.Is(err, unix.ECONNREFUSED) {
		t.Fatalf("read: %v; want connection refused from the translated ICMP error", err)
	}
	st, err := nt.prog.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Reasons[ReasonICMPTranslated].Packets == before.Reasons[ReasonICMPTranslated].Packets {
		t.Error("icmp_translated counter unchanged; want the error counted")
	}
}

// serveEcho echoes every TCP connection to port in ns until the test ends.
func serveEcho(t testing.TB, ns *netns.NS, port int) {
	t.Helper()
	ln, err := ns.Listen("tcp", fmt.Sprintf(":%d", port))
	if err != nil {
		t.Fatal(err)
	}
	echoOn(t, ln)
}

// echoOn echoes every connection ln accepts until the test's cleanup closes ln.
func echoOn(t testing.TB, ln net.Listener) {
	t.Cleanup(func() { ln.Close() })
	// Exits when the listener is closed at cleanup.
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			// Exits when the client closes its side.
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
}
