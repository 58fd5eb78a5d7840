package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"syscall"
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

// TestKeepaliveVanishedBackend: a backend whose host vanishes without a FIN
// or a reset (here nftables drops every packet to and from its port) is found
// out by the backend side's keepalive: the client gets a reset, the slot is
// freed, and the backend is blamed for a reset (Resets, the Observer), as
// passive health counts it. A service without keepalive still holds its
// connection a second after that.
//
// In a network namespace of its own, for its nftables rules.
func TestKeepaliveVanishedBackend(t *testing.T) {
	if !inOwnNetns(t, nil) {
		return
	}
	be := startBackend(t, "b", netip.AddrPort{}, echo)
	ka := net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 2}
	rec := &recorder{}
	services := map[string]*Service{}
	clients := map[string]*net.TCPConn{}
	for name, bka := range map[string]net.KeepAliveConfig{"keepalive": ka, "none": {}} {
		services[name] = startProxy(t, Config{Name: name, Backends: []Backend{{Addr: be.addr()}},
			BackendKeepalive: bka, ShutdownTimeout: 100 * time.Millisecond, Observer: rec})
		c := dial(t, services[name])
		c.SetDeadline(time.Now().Add(60 * time.Second))
		if err := roundTrip(c, "ping"); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		clients[name] = c
	}

	// The backend's host goes: nothing it sends arrives, nothing reaches it.
	rules := fmt.Sprintf("table inet vanish { chain in { type filter hook input priority 0; tcp sport %[1]d drop; tcp dport %[1]d drop; }; }", be.addr().Port())
	if out, err := exec.Command("nft", rules).CombinedOutput(); err != nil {
		t.Fatalf("nft %s: %v: %s", rules, err, out)
	}
	start := time.Now()
	waitfor.Value(t, 20*time.Second, "0 active connections", active(services["keepalive"], 0))
	t.Logf("the probing service ended the connection %v after the backend went", time.Since(start).Round(time.Millisecond))
	if _, err := clients["keepalive"].Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the client of the probing service: read got %v; want a reset", err)
	}
	if got := services["keepalive"].Snapshot().Backends[0].Resets; got != 1 {
		t.Errorf("backend resets: got %d; want 1", got)
	}
	if got, want := rec.list(), []string{be.addr().String() + " reset"}; !slices.Equal(got, want) {
		t.Errorf("observed: got %q; want %q", got, want)
	}
	if waitfor.Cond(time.Second, func() bool { return services["none"].Snapshot().Active != 1 }) {
		t.Errorf("the service that does not probe, %v after the backend went: got %d connections; want 1",
			time.Since(start).Round(time.Millisecond), services["none"].Snapshot().Active)
	}
}
