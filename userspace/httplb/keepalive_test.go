package httplb

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/net/websocket"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/netpair"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestKeepaliveSockets reads back with getsockopt, on the service's accepted
// client socket and on its socket to the backend, the TCP keepalive each
// engine's connections get: the configured one when set; when not, Go's
// defaults: 15s idle on the client's, and on the backend's 15s for the frame
// engine and 30s for the others' pools.
func TestKeepaliveSockets(t *testing.T) {
	client := net.KeepAliveConfig{Enable: true, Idle: 7 * time.Second, Interval: 3 * time.Second, Count: 4}
	backend := net.KeepAliveConfig{Enable: true, Idle: 11 * time.Second, Interval: 2 * time.Second, Count: 2}
	for _, tc := range []struct {
		name     string
		h2       bool // the client speaks HTTP/2 by prior knowledge, else HTTP/1.1
		netHTTP  bool // net/http's engines serve it
		set      bool
		upstream Upstream
	}{
		{"h1 loop", false, false, true, UpstreamAuto},
		{"h2 frames", true, false, true, UpstreamAuto},
		{"h1 net_http", false, true, true, UpstreamAuto},
		{"h2 net_http", true, true, true, UpstreamAuto},
		{"h1 to h2c", false, false, true, UpstreamH2C},
		{"h1 loop off", false, false, false, UpstreamAuto},
		{"h2 frames off", true, false, false, UpstreamAuto},
		{"h2 net_http off", true, true, false, UpstreamAuto},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			cfg := Config{Upstream: tc.upstream, NetHTTP1: tc.netHTTP, NetHTTP2: tc.netHTTP}
			if tc.set {
				cfg.ClientKeepalive, cfg.BackendKeepalive = client, backend
			}
			s := serve(t, cfg, bs)
			lb := s.Addr().(*net.TCPAddr).AddrPort()
			kc, err := sockfd.KeepaliveBetween(lb, getFrom(t, s, tc.h2))
			if err != nil {
				t.Fatal(err)
			}
			kb, err := sockfd.KeepaliveBetween(netip.AddrPort{}, bs[0].Addr)
			if err != nil {
				t.Fatal(err)
			}
			want := func(k net.KeepAliveConfig) sockfd.Keepalive {
				return sockfd.Keepalive{On: 1, Idle: int(k.Idle / time.Second), Interval: int(k.Interval / time.Second), Count: k.Count}
			}
			// Go's, with the idle its dialer or listener asks for.
			goDefault := func(idle int) sockfd.Keepalive { return sockfd.Keepalive{On: 1, Idle: idle, Interval: 15, Count: 9} }
			offIdle := 30
			if tc.h2 && !tc.netHTTP {
				offIdle = 15 // the frame engine's dialer
			}
			switch {
			case tc.set && (kc != want(client) || kb != want(backend)):
				t.Errorf("got client side %+v, backend side %+v; want %+v, %+v", kc, kb, want(client), want(backend))
			case !tc.set && (kc != goDefault(15) || kb != goDefault(offIdle)):
				t.Errorf("without keepalive set: got client side %+v, backend side %+v; want Go's defaults, %+v, %+v", kc, kb, goDefault(15), goDefault(offIdle))
			}
		})
	}
}

// TestKeepaliveVanishedClient: an HTTP/1.1 client whose host vanishes
// without a FIN or a reset between two requests (its link goes down) is found
// out by the configured keepalive and its connection ends; with Go's default
// (15s idle) it is still open past that time.
func TestKeepaliveVanishedClient(t *testing.T) {
	pair := netpair.New(t)
	bs := httpbackend.StartN(t, 1)
	listenInA := func(cfg Config, bs []Backend) (s *Service, err error) {
		err = pair.A.Do(func() error { s, err = Listen(cfg, bs); return err })
		return s, err
	}
	ka := net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 2}
	services := map[string]*Service{}
	for name, cka := range map[string]net.KeepAliveConfig{"keepalive": ka, "default": {}} {
		s := serveStoppableWith(t, Config{Name: name, Listen: netip.AddrPortFrom(pair.AddrA, 0), ClientKeepalive: cka, DrainTimeout: 100 * time.Millisecond},
			backendSet(bs), listenInA).Service
		services[name] = s
		// The client does not probe: it is the one that goes.
		c, err := pair.B.DialWith(context.Background(), &net.Dialer{KeepAlive: -1}, "tcp", s.Addr().String())
		if err != nil {
			t.Fatalf("%s: dial: %v", name, err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Read(make([]byte, 512)); err != nil {
			t.Fatalf("%s: read the answer: %v", name, err)
		}
		waitfor.Value(t, 5*time.Second, "1 open connection", openConns(s, 1))
	}

	// The client's host goes: nothing sent.
	pair.VanishB(t, func() int64 { return services["keepalive"].Snapshot().Connections },
		func() int64 { return services["default"].Snapshot().Connections })
}

// openConns is the number of client connections s holds, for waitfor.Value.
func openConns(s *Service, want int64) func() (any, bool) {
	return func() (any, bool) {
		n := s.Snapshot().Connections
		return fmt.Sprintf("%d open connections", n), n == want
	}
}

// TestKeepaliveTunnel: a WebSocket tunnel's connection to its backend, which
// the tunnel dials itself, has the backend side's keepalive too.
func TestKeepaliveTunnel(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{BackendKeepalive: net.KeepAliveConfig{Enable: true, Idle: 11 * time.Second, Interval: 2 * time.Second, Count: 2}}, bs)
	wsEchoThrough(t, s)
	// The tunnel's is the only connection to the backend: nothing else was asked.
	fds, err := sockfd.FindAll(netip.AddrPort{}, bs[0].Addr)
	if err != nil || len(fds) != 1 {
		t.Fatalf("sockets to the backend: got %d, %v; want the tunnel's", len(fds), err)
	}
	want := sockfd.Keepalive{On: 1, Idle: 11, Interval: 2, Count: 2}
	if k, err := sockfd.KeepaliveOf(fds[0]); err != nil || k != want {
		t.Errorf("the tunnel's backend socket: got %+v, %v; want %+v", k, err, want)
	}
}

// wsEchoThrough opens a WebSocket tunnel through s to its backend's echo, and
// checks that it echoes; the tunnel is closed at the test's cleanup.
func wsEchoThrough(t *testing.T, s *Service) *websocket.Conn {
	t.Helper()
	ws, err := websocket.DialConfig(wsConfig(t, "ws", s.Addr().String(), nil))
	if err != nil {
		t.Fatalf("WebSocket handshake through the plane: %v", err)
	}
	t.Cleanup(func() { ws.Close() })
	ws.SetDeadline(time.Now().Add(5 * time.Second))
	var got string
	if err := websocket.Message.Send(ws, "ping"); err != nil {
		t.Fatal(err)
	}
	if err := websocket.Message.Receive(ws, &got); err != nil || got != "ping" {
		t.Fatalf("through the tunnel: got %q, %v; want \"ping\"", got, err)
	}
	return ws
}

// getFrom asks s for / over a new connection, HTTP/2 by prior knowledge if h2
// (else HTTP/1.1), checks that it is answered 200, and returns the address
// the connection was made from, open until the test ends.
func getFrom(t *testing.T, s *Service, h2 bool) netip.AddrPort {
	t.Helper()
	local := make(chan netip.AddrPort, 1)
	var p http.Protocols
	p.SetHTTP1(!h2)
	p.SetUnencryptedHTTP2(h2)
	tr := &http.Transport{Protocols: &p, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{KeepAlive: -1}).DialContext(ctx, network, addr)
		if err == nil {
			local <- c.LocalAddr().(*net.TCPAddr).AddrPort()
		}
		return c, err
	}}
	t.Cleanup(tr.CloseIdleConnections)
	resp, _ := get(t, &http.Client{Transport: tr, Timeout: 10 * time.Second}, "http://"+s.Addr().String()+"/")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("got %s; want 200", resp.Status)
	}
	return <-local
}

// TestKeepaliveListener: the client keepalive is set on the listening socket,
// once, which accepted sockets inherit, so that Go need set none on each
// (ListenConfig.KeepAlive -1): Go's defaults when it is not configured, the
// configured one when it is; a service that takes the socket over sets its
// own, and Reclaim the old one's back.
func TestKeepaliveListener(t *testing.T) {
	set := net.KeepAliveConfig{Enable: true, Idle: 7 * time.Second, Interval: 3 * time.Second, Count: 4}
	goDefault := sockfd.Keepalive{On: 1, Idle: 15, Interval: 15, Count: 9}
	want := sockfd.Keepalive{On: 1, Idle: 7, Interval: 3, Count: 4}
	bs := httpbackend.StartN(t, 1)
	old := serve(t, Config{}, bs)
	listening := func(when string, s *Service, want sockfd.Keepalive) {
		t.Helper()
		rc, err := s.socks[0].SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var k sockfd.Keepalive
		rc.Control(func(fd uintptr) { k, err = sockfd.KeepaliveOf(int(fd)) })
		if err != nil || k != want {
			t.Errorf("%s: the listening socket's keepalive got %+v, %v; want %+v", when, k, err, want)
		}
	}
	listening("off", old, goDefault)
	s, err := ListenFrom(Config{Name: "test", Listen: netip.MustParseAddrPort("127.0.0.1:0"), ClientKeepalive: set}, backendSet(bs), old)
	if err != nil {
		t.Fatal(err)
	}
	listening("taken over", old, want)
	s.Close()
	if err := old.Reclaim(); err != nil {
		t.Fatal(err)
	}
	listening("reclaimed", old, goDefault)
}

// TestKeepaliveTakenOver reads back with getsockopt the keepalive of client
// sockets accepted from a listening socket a service took over, by either
// service (both accept from it until the old one stops), of each engine:
// the new service's setting, which the old one's connections inherit from
// the socket and the new one's get from Go's defaults and weir's changes.
func TestKeepaliveTakenOver(t *testing.T) {
	for _, tc := range []struct {
		name    string
		h2      bool
		netHTTP bool
		ka      net.KeepAliveConfig
		want    sockfd.Keepalive
	}{
		{"h1 loop", false, false, net.KeepAliveConfig{Enable: true, Idle: 7 * time.Second, Interval: 3 * time.Second, Count: 4}, sockfd.Keepalive{On: 1, Idle: 7, Interval: 3, Count: 4}},
		{"h2 frames", true, false, net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 2 * time.Second, Count: 9}, sockfd.Keepalive{On: 1, Idle: 15, Interval: 2, Count: 9}},
		{"h1 net_http", false, true, net.KeepAliveConfig{Enable: true, Idle: 8 * time.Second, Interval: 15 * time.Second, Count: 3}, sockfd.Keepalive{On: 1, Idle: 8, Interval: 15, Count: 3}},
		{"h2 net_http, Go's", true, true, net.KeepAliveConfig{}, sockfd.Keepalive{On: 1, Idle: 15, Interval: 15, Count: 9}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			cfg := Config{NetHTTP1: tc.netHTTP, NetHTTP2: tc.netHTTP, ClientKeepalive: net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 5 * time.Second, Count: 5}}
			old := serve(t, cfg, bs)
			cfg.ClientKeepalive = tc.ka
			s := serveStoppableWith(t, cfg, backendSet(bs), func(cfg Config, bs []Backend) (*Service, error) {
				cfg.Listen = netip.MustParseAddrPort("127.0.0.1:0") // as old's
				return ListenFrom(cfg, bs, old)
			}).Service
			if s.Addr().String() != old.Addr().String() {
				t.Fatalf("the new service listens on %v; want the old one's %v, taken over", s.Addr(), old.Addr())
			}
			for i := range 4 {
				k, err := sockfd.KeepaliveBetween(s.Addr().(*net.TCPAddr).AddrPort(), getFrom(t, s, tc.h2))
				if err != nil || k != tc.want {
					t.Errorf("connection %d: got %+v, %v; want %+v", i, k, err, tc.want)
				}
			}
		})
	}
}
