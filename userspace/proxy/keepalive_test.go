package proxy

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/netpair"
	"github.com/weir-lb/weir/internal/sockfd"
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
		ip                    string // the listener's and the backend's; "" 127.0.0.1
	}{
		{"off", net.KeepAliveConfig{}, net.KeepAliveConfig{}, off, off, ""},
		{"on",
			net.KeepAliveConfig{Enable: true, Idle: 7 * time.Second, Interval: 3 * time.Second, Count: 4},
			net.KeepAliveConfig{Enable: true, Idle: 11 * time.Second, Interval: 1500 * time.Millisecond, Count: 2},
			sockfd.Keepalive{On: 1, Idle: 7, Interval: 3, Count: 4}, sockfd.Keepalive{On: 1, Idle: 11, Interval: 2, Count: 2}, ""},
		{"on, IPv6",
			net.KeepAliveConfig{Enable: true, Idle: 7 * time.Second, Interval: 3 * time.Second, Count: 4},
			net.KeepAliveConfig{Enable: true, Idle: 11 * time.Second, Interval: 2 * time.Second, Count: 2},
			sockfd.Keepalive{On: 1, Idle: 7, Interval: 3, Count: 4}, sockfd.Keepalive{On: 1, Idle: 11, Interval: 2, Count: 2}, "::1"},
		{"client only",
			net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3},
			net.KeepAliveConfig{},
			sockfd.Keepalive{On: 1, Idle: 5, Interval: 2, Count: 3}, off, ""},
		{"backend only, kernel's idle",
			net.KeepAliveConfig{},
			net.KeepAliveConfig{Enable: true, Interval: 9 * time.Second, Count: 1},
			off, sockfd.Keepalive{On: 1, Idle: off.Idle, Interval: 9, Count: 1}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			at := loopback0
			if tc.ip != "" {
				at = netip.AddrPortFrom(netip.MustParseAddr(tc.ip), 0)
			}
			accepted := make(chan netip.AddrPort, 1)
			be := startBackend(t, "b", at, func(name string, c *net.TCPConn) {
				accepted <- c.RemoteAddr().(*net.TCPAddr).AddrPort()
				echo(name, c)
			})
			s := startProxy(t, Config{Listen: at, Backends: []Backend{{Addr: be.addr()}},
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
// listeners' namespace (netpair); the proxy's loops, which dial, and the
// backend stay in the test's namespace.
func TestKeepaliveVanishedClient(t *testing.T) {
	pair := netpair.New(t)
	be := startBackend(t, "b", netip.AddrPort{}, echo)
	listenInA := func(ctx context.Context, cfg Config) (s *Service, err error) {
		err = pair.A.Do(func() error { s, err = Listen(ctx, cfg); return err })
		return s, err
	}
	ka := net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 2}
	services := map[string]*Service{}
	for name, cka := range map[string]net.KeepAliveConfig{"keepalive": ka, "none": {}} {
		services[name] = startProxyWith(t, Config{Name: name, Listen: netip.AddrPortFrom(pair.AddrA, 0),
			Backends: []Backend{{Addr: be.addr()}}, ClientKeepalive: cka, ShutdownTimeout: 100 * time.Millisecond}, listenInA)
		// The client does not probe: it is the one that goes.
		c, err := pair.B.DialWith(context.Background(), &net.Dialer{KeepAlive: -1}, "tcp", services[name].Addr().String())
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

	// The client's host goes: nothing sent.
	pair.VanishB(t, func() int64 { return services["keepalive"].Snapshot().Active },
		func() int64 { return services["none"].Snapshot().Active })
}
