package proxy

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/netpair"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestKeepaliveSockets checks with getsockopt, on both of the proxy's sockets of
// a proxied connection, that the configured keepalive is what the kernel holds:
// the client's set on the listener and inherited by the accepted socket, the
// backend's set on the dialed one; and that without it neither socket has
// keepalive on.
func TestKeepaliveSockets(t *testing.T) {
	// The host's defaults, which a socket with keepalive off still reports.
	off := func(t *testing.T) sockfd.Keepalive {
		ln, err := listen(loopback0, tcpOpts{})
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
			client, backend := proxiedSockets(t, tc.ip, Config{ClientKeepalive: tc.client, BackendKeepalive: tc.backend})
			if got, err := sockfd.KeepaliveOf(client); err != nil || got != tc.wantClient {
				t.Errorf("client side: got %+v, %v; want %+v", got, err, tc.wantClient)
			}
			if got, err := sockfd.KeepaliveOf(backend); err != nil || got != tc.wantBackd {
				t.Errorf("backend side: got %+v, %v; want %+v", got, err, tc.wantBackd)
			}
		})
	}
}

// proxiedSockets proxies a connection through a service with cfg (its Listen
// and Backends set here: ip, "" 127.0.0.1, is the listener's and the
// backend's address), and returns the descriptors of the proxy's client and
// backend sockets of it, for getsockopt, until the test ends; then the
// connection is closed and its end waited for.
func proxiedSockets(t *testing.T, ip string, cfg Config) (client, backend int) {
	t.Helper()
	at := loopback0
	if ip != "" {
		at = netip.AddrPortFrom(netip.MustParseAddr(ip), 0)
	}
	accepted := make(chan netip.AddrPort, 1)
	be := startBackend(t, "b", at, func(name string, c *net.TCPConn) {
		accepted <- c.RemoteAddr().(*net.TCPAddr).AddrPort()
		echo(name, c)
	})
	cfg.Listen, cfg.Backends = at, []Backend{{Addr: be.addr()}}
	s := startProxy(t, cfg)
	c := dial(t, s)
	if err := roundTrip(c, "ping"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		waitfor.Value(t, 5*time.Second, "0 active connections", active(s, 0))
	})
	client, err := sockfd.Find(s.Addr(), c.LocalAddr().(*net.TCPAddr).AddrPort())
	if err != nil {
		t.Fatal(err)
	}
	if backend, err = sockfd.Find(<-accepted, be.addr()); err != nil {
		t.Fatal(err)
	}
	return client, backend
}

// TestKeepaliveVanishedClient: a client whose host vanishes without a FIN or a
// reset (here its link goes down) is found out by keepalive and its connection
// ends, freeing its slot; without keepalive, the connection stays.
func TestKeepaliveVanishedClient(t *testing.T) {
	for _, how := range []string{"open", "half-closed"} {
		t.Run(how, func(t *testing.T) {
			vanishedClient(t, func(cfg *Config) {
				cfg.ClientKeepalive = net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 2}
			}, false, how)
		})
	}
}

// vanishedClient checks that a service with what set sets finds out a
// client whose host vanished without a FIN or a reset (its link goes down)
// and ends its connection, freeing its slot and counting it in
// ClientTimeouts, blaming no backend, where a service without it
// still holds its connection a second after that (netpair.Outlived). With
// inFlight, the backend sends the client bytes once it has gone, which the
// proxy sends on and which then wait to be acknowledged. how is the
// connection's state as the client goes: "open"; "half-closed", the client
// has sent its FIN (the backend reads its EOF and stays), so the proxy no
// longer reads from it; "answered" (with inFlight), the backend closes with
// a FIN then a reset once it has sent its bytes, and the proxy lingers for
// the client to take them. The client's failure is a client timeout in each.
//
// The client lives in a namespace of its own joined by a veth to the proxy's
// listeners' namespace (netpair); the proxy's loops, which dial, and the
// backend stay in the test's namespace.
func vanishedClient(t *testing.T, set func(*Config), inFlight bool, how string) {
	t.Helper()
	pair := netpair.New(t)
	backs := make(chan *net.TCPConn, 2)
	eofs := make(chan struct{}, 2)
	release := make(chan struct{})
	be := startBackend(t, "b", netip.AddrPort{}, func(name string, c *net.TCPConn) {
		backs <- c
		io.Copy(c, c)
		eofs <- struct{}{}
		if how == "half-closed" {
			<-release // the connection stays open after the client's FIN
		}
		c.CloseWrite()
	})
	t.Cleanup(func() { close(release) })
	listenInA := func(ctx context.Context, cfg Config) (s *Service, err error) {
		err = pair.A.Do(func() error { s, err = Listen(ctx, cfg); return err })
		return s, err
	}
	services := map[string]*Service{}
	var backConns []*net.TCPConn
	for _, name := range []string{"set", "none"} {
		cfg := Config{Name: name, Listen: netip.AddrPortFrom(pair.AddrA, 0),
			Backends: []Backend{{Addr: be.addr()}}, ShutdownTimeout: 100 * time.Millisecond}
		if name == "set" {
			set(&cfg)
		}
		services[name] = startProxyWith(t, cfg, listenInA)
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
		backConns = append(backConns, <-backs)
		if how == "half-closed" {
			if err := c.(*net.TCPConn).CloseWrite(); err != nil {
				t.Fatal(err)
			}
			select {
			case <-eofs:
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: the backend did not read the client's FIN", name)
			}
		}
		waitfor.Value(t, 5*time.Second, "1 active connections", active(services[name], 1))
	}

	// The client's host goes.
	pair.CutB(t)
	start := time.Now()
	for _, bc := range backConns {
		if !inFlight {
			break
		}
		if _, err := bc.Write([]byte("for the client\n")); err != nil {
			t.Fatal(err)
		}
		if how == "answered" {
			// The backend's FIN, then a reset: its answer is whole.
			if err := bc.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			bc.SetLinger(0)
			bc.Close()
		}
	}
	netpair.Outlived(t, start, func() int64 { return services["set"].Snapshot().Active },
		func() int64 { return services["none"].Snapshot().Active })
	// The client is counted as one the kernel gave up on; no backend is blamed.
	snap := services["set"].Snapshot()
	if snap.ClientTimeouts != 1 || snap.Backends[0].Resets != 0 {
		t.Errorf("client timeouts, backend resets: got %d, %d; want 1, 0", snap.ClientTimeouts, snap.Backends[0].Resets)
	}
	if got := services["none"].Snapshot().ClientTimeouts; got != 0 {
		t.Errorf("the other service's client timeouts: got %d; want 0", got)
	}
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
	vanishedBackend(t, func(cfg *Config) {
		cfg.BackendKeepalive = net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 2}
	}, false)
}

// vanishedBackend checks that a service with what set sets finds
// out a backend whose host vanished without a FIN or a reset (nftables drops
// every packet to and from its port; the caller runs in a network namespace
// of its own): the client gets a reset, the slot is freed, and the backend is
// blamed for a reset (Resets, the Observer), as passive health counts it. A
// service without the setting still holds its connection a second after
// that. With inFlight, the clients send bytes once the backend has gone,
// which the proxy sends on and which then wait to be acknowledged.
func vanishedBackend(t *testing.T, set func(*Config), inFlight bool) {
	t.Helper()
	be := startBackend(t, "b", netip.AddrPort{}, echo)
	rec := &recorder{}
	services := map[string]*Service{}
	clients := map[string]*net.TCPConn{}
	for _, name := range []string{"set", "none"} {
		cfg := Config{Name: name, Backends: []Backend{{Addr: be.addr()}}, ShutdownTimeout: 100 * time.Millisecond, Observer: rec}
		if name == "set" {
			set(&cfg)
		}
		services[name] = startProxy(t, cfg)
		c := dial(t, services[name])
		c.SetDeadline(time.Now().Add(60 * time.Second))
		if err := roundTrip(c, "ping"); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		clients[name] = c
	}

	// The backend's host goes: nothing it sends arrives, nothing reaches it.
	netpair.DropPort(t, be.addr().Port())
	start := time.Now()
	for _, c := range clients {
		if !inFlight {
			break
		}
		if _, err := c.Write([]byte("for the backend\n")); err != nil {
			t.Fatal(err)
		}
	}
	netpair.Outlived(t, start, func() int64 { return services["set"].Snapshot().Active },
		func() int64 { return services["none"].Snapshot().Active })
	if _, err := clients["set"].Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the client of the service that found it out: read got %v; want a reset", err)
	}
	if got := services["set"].Snapshot().Backends[0].Resets; got != 1 {
		t.Errorf("backend resets: got %d; want 1", got)
	}
	if got, want := rec.list(), []string{be.addr().String() + " reset"}; !slices.Equal(got, want) {
		t.Errorf("observed: got %q; want %q", got, want)
	}
}
