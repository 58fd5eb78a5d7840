package proxy

import (
	"net"
	"net/netip"
	"os"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

// keepalive is what the kernel holds of a socket's TCP keepalive settings.
type keepalive struct{ on, idle, intvl, cnt int }

// keepaliveOf reads fd's keepalive settings back with getsockopt.
func keepaliveOf(t *testing.T, fd int) keepalive {
	t.Helper()
	get := func(level, opt int) int {
		v, err := unix.GetsockoptInt(fd, level, opt)
		if err != nil {
			t.Fatalf("getsockopt %d/%d on fd %d: %v", level, opt, fd, err)
		}
		return v
	}
	return keepalive{get(unix.SOL_SOCKET, unix.SO_KEEPALIVE), get(unix.IPPROTO_TCP, unix.TCP_KEEPIDLE),
		get(unix.IPPROTO_TCP, unix.TCP_KEEPINTVL), get(unix.IPPROTO_TCP, unix.TCP_KEEPCNT)}
}

// socketOf finds the descriptor of this process whose socket is connected from
// local to peer: the proxy's own end of a connection, which no API hands out.
func socketOf(t *testing.T, local, peer netip.AddrPort) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		la, err := getsocknameRaw(fd)
		if err != nil || la != local {
			continue
		}
		if sa, err := unix.Getpeername(fd); err == nil {
			if in4, ok := sa.(*unix.SockaddrInet4); ok && netip.AddrPortFrom(netip.AddrFrom4(in4.Addr), uint16(in4.Port)) == peer {
				return fd
			}
		}
	}
	t.Fatalf("no socket of this process connected from %s to %s", local, peer)
	return -1
}

// TestKeepaliveSockets checks with getsockopt, on both of the proxy's sockets of
// a proxied connection, that the configured keepalive is what the kernel holds:
// the client's set on the listener and inherited by the accepted socket, the
// backend's set on the dialed one; and that without it neither socket has
// keepalive on.
func TestKeepaliveSockets(t *testing.T) {
	// The host's defaults, which a socket with keepalive off still reports.
	off := func(t *testing.T) keepalive {
		ln, err := listen(loopback0, net.KeepAliveConfig{})
		if err != nil {
			t.Fatal(err)
		}
		defer ln.close()
		return keepaliveOf(t, ln.fd)
	}(t)
	if off.on != 0 {
		t.Fatalf("a listener without keepalive: SO_KEEPALIVE got %d; want 0", off.on)
	}
	for _, tc := range []struct {
		name                  string
		client, backend       net.KeepAliveConfig
		wantClient, wantBackd keepalive
	}{
		{"off", net.KeepAliveConfig{}, net.KeepAliveConfig{}, off, off},
		{"on",
			net.KeepAliveConfig{Enable: true, Idle: 7 * time.Second, Interval: 3 * time.Second, Count: 4},
			net.KeepAliveConfig{Enable: true, Idle: 11 * time.Second, Interval: 1500 * time.Millisecond, Count: 2},
			keepalive{1, 7, 3, 4}, keepalive{1, 11, 2, 2}},
		{"client only",
			net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3},
			net.KeepAliveConfig{},
			keepalive{1, 5, 2, 3}, off},
		{"backend only, kernel's idle",
			net.KeepAliveConfig{},
			net.KeepAliveConfig{Enable: true, Interval: 9 * time.Second, Count: 1},
			off, keepalive{1, off.idle, 9, 1}},
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
			if got := keepaliveOf(t, socketOf(t, s.Addr(), client)); got != tc.wantClient {
				t.Errorf("client side: got %+v; want %+v", got, tc.wantClient)
			}
			dialed := <-accepted
			if got := keepaliveOf(t, socketOf(t, dialed, be.addr())); got != tc.wantBackd {
				t.Errorf("backend side: got %+v; want %+v", got, tc.wantBackd)
			}
			c.Close()
			waitfor.Value(t, 5*time.Second, "0 active connections", active(s, 0))
		})
	}
}
