package httplb

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/sockfd"
)

// TestKeepaliveSockets reads back with getsockopt, on the service's accepted
// client socket and on its socket to the backend, the TCP keepalive each
// engine's connections get: the configured one when set; Go's default (15s
// idle) on the client's when not.
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
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			cfg := Config{Upstream: tc.upstream, NetHTTP1: tc.netHTTP, NetHTTP2: tc.netHTTP}
			if tc.set {
				cfg.ClientKeepalive, cfg.BackendKeepalive = client, backend
			}
			s := serve(t, cfg, bs)
			local := make(chan netip.AddrPort, 1)
			var p http.Protocols
			p.SetHTTP1(!tc.h2)
			p.SetUnencryptedHTTP2(tc.h2)
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
			lb := s.Addr().(*net.TCPAddr).AddrPort()
			kc, err := sockfd.KeepaliveBetween(lb, <-local)
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
			switch {
			case tc.set && (kc != want(client) || kb != want(backend)):
				t.Errorf("got client side %+v, backend side %+v; want %+v, %+v", kc, kb, want(client), want(backend))
			case !tc.set && (kc.On != 1 || kc.Idle != 15 || kb.On != 1):
				t.Errorf("without keepalive set: got client side %+v, backend side %+v; want Go's defaults, on, 15s idle on the client's", kc, kb)
			}
		})
	}
}
