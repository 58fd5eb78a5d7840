package proxy

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
)

// keepaliveBetween is the keepalive setting of the socket of this process
// connected from local to peer.
func keepaliveBetween(t *testing.T, local, peer netip.AddrPort) sockfd.Keepalive {
	t.Helper()
	k, err := sockfd.KeepaliveBetween(local, peer)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestKeepaliveSockets checks with getsockopt, on both of the proxy's sockets of
// a proxied connection, that the configured keepalive is what the kernel holds:
// the client's set on the listener and inherited by the accepted socket, the
// backend's set on the dialed one; and that without it neither socket has
// keepalive on.
func TestKeepaliveSockets(t *testing.T) {
	// The host's defaults, which a socket with keepalive off still reports.
	off := func(t *testing.T) sockfd.Keepalive {
		ln, err := listen(loopback0, net.KeepAliveConfig{})
		if err != nil {
			t.Fatal(err)
		}
		defer ln.close()
		k, err := sockfd.KeepaliveOf(ln.fd)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}(t)
	if off.On != 0 {
		t.Fatalf("a listener without keepalive: SO_KEEPALIVE got %d; want 0", off.On)
	}
	for _, tc := range []struct {
		name                  string
		client, backend       net.KeepAliveConfig
		wantClient, wantBackd sockfd.Keepalive
	}{
		{"off", net.KeepAliveConfig{}, net.KeepAliveConfig{}, off, off},
		{"on",
			net.KeepAliveConfig{Enable: true, Idle: 7 * time.Second, Interval: 3 * time.Second, Count: 4},
			net.KeepAliveConfig{Enable: true, Idle: 11 * time.Second, Interval: 1500 * time.Millisecond, Count: 2},
			sockfd.Keepalive{On: 1, Idle: 7, Interval: 3, Count: 4}, sockfd.Keepalive{On: 1, Idle: 11, Interval: 2, Count: 2}},
		{"client only",
			net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3},
			net.KeepAliveConfig{},
			sockfd.Keepalive{On: 1, Idle: 5, Interval: 2, Count: 3}, off},
		{"backend only, kernel's idle",
			net.KeepAliveConfig{},
			net.KeepAliveConfig{Enable: true, Interval: 9 * time.Second, Count: 1},
			off, sockfd.Keepalive{On: 1, Idle: off.Idle, Interval: 9, Count: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			accepted := make(chan netip.AddrPort, 1)
			be := startBackend(t, "b", netip.AddrPort{}, func(name string, c *net.TCPConn) {
				accepted <- c.RemoteAddr().(*net.TCPAddr).AddrPort()
				echo(name, c)
			})
			s := startProxy(t, Config{Backends: []Backend{{Addr: be.addr()}},
				ClientKeepalive: tc.client, BackendKeepalive: tc.backend})
			c := dial(t, s)
			if err := roundTrip(c, "ping"); err != nil {
				t.Fatal(err)
			}
			client := c.LocalAddr().(*net.TCPAddr).AddrPort()
			if got := keepaliveBetween(t, s.Addr(), client); got != tc.wantClient {
				t.Errorf("client side: got %+v; want %+v", got, tc.wantClient)
			}
			dialed := <-accepted
			if got := keepaliveBetween(t, dialed, be.addr()); got != tc.wantBackd {
				t.Errorf("backend side: got %+v; want %+v", got, tc.wantBackd)
			}
			c.Close()
			waitfor.Value(t, 5*time.Second, "0 active connections", active(s, 0))
		})
	}
}

// TestKeepaliveVanishedClient: a client whose host vanishes without a FIN or a
// reset (here its link goes down) is found out by keepalive and its connection
// ends, freeing its slot; without keepalive, the connection stays.
//
// The client lives in a namespace of its own joined by a veth to the proxy's
// listeners' namespace; the proxy's loops, which dial, and the backend stay in
// the test's namespace.
func TestKeepaliveVanishedClient(t *testing.T) {
	name := topo.UniqueName("wka")
	lbNS, clNS := newNS(t, name+"-lb"), newNS(t, name+"-cl")
	lbAddr, clAddr := netip.MustParsePrefix("10.99.0.1/30"), netip.MustParsePrefix("10.99.0.2/30")
	if err := lbNS.Do(func() error {
		nsFd, err := unix.Open(clNS.Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(nsFd)
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "lb"}, PeerName: "cl", PeerNamespace: netlink.NsFd(nsFd)}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("add veth: %w", err)
		}
		return addrUp("lb", lbAddr)
	}); err != nil {
		t.Fatal(err)
	}
	if err := clNS.Do(func() error { return addrUp("cl", clAddr) }); err != nil {
		t.Fatal(err)
	}

	be := startBackend(t, "b", netip.AddrPort{}, echo)
	listenInLB := func(ctx context.Context, cfg Config) (s *Service, err error) {
		err = lbNS.Do(func() error { s, err = Listen(ctx, cfg); return err })
		return s, err
	}
	ka := net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 2}
	services := map[string]*Service{}
	for name, cka := range map[string]net.KeepAliveConfig{"keepalive": ka, "none": {}} {
		services[name] = startProxyWith(t, Config{Name: name, Listen: netip.AddrPortFrom(lbAddr.Addr(), 0),
			Backends: []Backend{{Addr: be.addr()}}, ClientKeepalive: cka, ShutdownTimeout: 100 * time.Millisecond}, listenInLB)
		// The client does not probe: it is the one that goes.
		c, err := clNS.DialWith(context.Background(), &net.Dialer{KeepAlive: -1}, "tcp", services[name].Addr().String())
		if err != nil {
			t.Fatalf("%s: dial: %v", name, err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if err := roundTrip(c, "ping"); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		waitfor.Value(t, 5*time.Second, "1 active connections", active(services[name], 1))
	}

	// The client's host goes: its link down, nothing sent.
	if err := clNS.Do(func() error {
		link, err := netlink.LinkByName("cl")
		if err == nil {
			err = netlink.LinkSetDown(link)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// Idle 1s, then 2 probes 1s apart unanswered: the kernel fails the
	// socket about 3s later; the deadline leaves a loaded machine room.
	start := time.Now()
	waitfor.Value(t, 20*time.Second, "0 active connections", active(services["keepalive"], 0))
	t.Logf("keepalive ended the connection %v after the client went", time.Since(start).Round(time.Millisecond))
	// Without keepalive nothing ends it: past the time keepalive took, and
	// a second more, it is still there.
	if waitfor.Cond(time.Second, func() bool { return services["none"].Snapshot().Active != 1 }) {
		t.Errorf("without keepalive, %v after the client went: got %d active connections; want 1",
			time.Since(start).Round(time.Millisecond), services["none"].Snapshot().Active)
	}
}

// newNS creates a network namespace that the test removes when it ends.
func newNS(t *testing.T, name string) *netns.NS {
	t.Helper()
	ns, err := netns.New(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	return ns
}

// addrUp gives the link called name the address a and sets it up, in the
// calling thread's namespace.
func addrUp(name string, a netip.Prefix) error {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("find %s: %w", name, err)
	}
	ipn := &net.IPNet{IP: a.Addr().AsSlice(), Mask: net.CIDRMask(a.Bits(), a.Addr().BitLen())}
	if err := netlink.AddrAdd(link, &netlink.Addr{IPNet: ipn}); err != nil {
		return fmt.Errorf("address %s: %w", name, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}
