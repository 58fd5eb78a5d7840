package httpplane_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestKeepaliveReload: an http service's tcp_keepalive and tcp_user_timeout,
// as the file writes them, are on its client and backend sockets; weir plan
// names them as what a change of them gives a new listener for; and a reload
// that changes them gives the connections after it the new settings.
func TestKeepaliveReload(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	port := freePort(t)
	// tcp_user_timeout is the keepalive idle of each side, which askIdles checks.
	svc := "  - {name: web, vip: 127.0.0.1:%[1]d, data_plane: http, health: {method: connect}, http: {tcp_keepalive: {client: {idle: %[2]ds, interval: 2s, count: 3}, backend: {idle: %[3]ds}}, tcp_user_timeout: {client: %[2]ds, backend: %[3]ds}}, backends: %[4]s}\n"
	r := startAgent(t, fmt.Sprintf(svc, port, 5, 6, backendList(bs)))
	vip := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
	// idles asks over new HTTP/1.1 connections until one is served with the
	// client keepalive idle want, and returns the keepalive idle of the
	// service's backend sockets. The server a reload replaced accepts on the
	// same listening socket until it has stopped, just after the reload:
	// a connection it took is answered with its setting and closed, so the
	// test asks again, until the deadline.
	idles := func(when string, want int) (backend []int) {
		var client int
		var err error
		if !waitfor.Cond(10*time.Second, func() bool {
			client, backend, err = askIdles(vip, bs[0].Addr)
			return err == nil && client == want
		}) {
			t.Fatalf("%s: got client keepalive idle %ds, %v; want %ds", when, client, err, want)
		}
		return backend
	}
	if backend := idles("before the reload", 5); !slices.Equal(backend, []int{6}) {
		t.Errorf("keepalive idle: got backend %vs; want [6]s", backend)
	}
	r.writeConfig(t, fmt.Sprintf(svc, port, 8, 9, backendList(bs)))
	if sp := httpPlan(t, r.a, nil); !strings.HasPrefix(sp.NewDataPlane, "a new listener on http") || !strings.Contains(sp.NewDataPlane, "tcp_keepalive") ||
		!strings.Contains(sp.NewDataPlane, "tcp_user_timeout") {
		t.Errorf("plan: new data plane %q; want a new listener, naming tcp_keepalive and tcp_user_timeout", sp.NewDataPlane)
	}
	if err := r.a.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The service the reload replaced may still hold its connection to the
	// backend, idle in its pool.
	if backend := idles("after the reload", 8); !slices.Contains(backend, 9) || slices.ContainsFunc(backend, func(s int) bool { return s != 6 && s != 9 }) {
		t.Errorf("after the reload, keepalive idle: got backend %vs; want 9s (and 6s from before)", backend)
	}
}

// askIdles sends a request over a new connection to vip and returns the
// keepalive idle of the service's client socket and of each of this process's
// sockets to backend, after checking their interval and count, and that their
// user timeout is their keepalive idle.
func askIdles(vip, backend netip.AddrPort) (int, []int, error) {
	c, err := net.Dial("tcp", vip.String())
	if err != nil {
		return 0, nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: web\r\n\r\n"); err != nil {
		return 0, nil, err
	}
	if _, err := c.Read(make([]byte, 512)); err != nil {
		return 0, nil, fmt.Errorf("read the answer: %w", err)
	}
	kc, err := sockfd.KeepaliveBetween(vip, c.LocalAddr().(*net.TCPAddr).AddrPort())
	if err != nil {
		return 0, nil, err
	}
	if kc.Interval != 2 || kc.Count != 3 {
		return 0, nil, fmt.Errorf("got client side %+v; want interval 2, count 3", kc)
	}
	if uc, err := sockfd.UserTimeoutBetween(vip, c.LocalAddr().(*net.TCPAddr).AddrPort()); err != nil || uc != time.Duration(kc.Idle)*time.Second {
		return 0, nil, fmt.Errorf("got client side user timeout %v, %v; want %ds", uc, err, kc.Idle)
	}
	fds, err := sockfd.FindAll(netip.AddrPort{}, backend)
	if err != nil {
		return 0, nil, err
	}
	var idles []int
	for _, fd := range fds {
		kb, err := sockfd.KeepaliveOf(fd)
		if err != nil {
			return 0, nil, err
		}
		if kb.Interval != 10 || kb.Count != 6 {
			return 0, nil, fmt.Errorf("got backend side %+v; want the defaults, interval 10, count 6", kb)
		}
		if ub, err := sockfd.UserTimeoutOf(fd); err != nil || ub != time.Duration(kb.Idle)*time.Second {
			return 0, nil, fmt.Errorf("got backend side user timeout %v, %v; want %ds", ub, err, kb.Idle)
		}
		idles = append(idles, kb.Idle)
	}
	return kc.Idle, idles, nil
}
