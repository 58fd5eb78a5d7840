package tcpopt

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/sockfd"
)

// socket returns a new TCP socket, closed at the test's end, and what the
// kernel gives a new socket for keepalive.
func socket(t *testing.T) (int, sockfd.Keepalive) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	k, err := sockfd.KeepaliveOf(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fd, k
}

// TestSetKeepalive: each field is rounded up to whole seconds, and one left
// zero or negative keeps what the socket had.
func TestSetKeepalive(t *testing.T) {
	for _, c := range []struct {
		name string
		ka   net.KeepAliveConfig
		want func(kernel sockfd.Keepalive) sockfd.Keepalive
	}{
		{"every field", net.KeepAliveConfig{Idle: 7 * time.Second, Interval: 3 * time.Second, Count: 4},
			func(sockfd.Keepalive) sockfd.Keepalive {
				return sockfd.Keepalive{On: 1, Idle: 7, Interval: 3, Count: 4}
			}},
		{"rounded up", net.KeepAliveConfig{Idle: 1500 * time.Millisecond, Interval: time.Millisecond, Count: 1},
			func(sockfd.Keepalive) sockfd.Keepalive {
				return sockfd.Keepalive{On: 1, Idle: 2, Interval: 1, Count: 1}
			}},
		{"none set: the kernel's", net.KeepAliveConfig{},
			func(k sockfd.Keepalive) sockfd.Keepalive { k.On = 1; return k }},
		{"negative: the kernel's", net.KeepAliveConfig{Idle: -1, Interval: 9 * time.Second, Count: -1},
			func(k sockfd.Keepalive) sockfd.Keepalive { k.On, k.Interval = 1, 9; return k }},
	} {
		t.Run(c.name, func(t *testing.T) {
			fd, kernel := socket(t)
			if err := SetKeepalive(fd, c.ka); err != nil {
				t.Fatal(err)
			}
			got, err := sockfd.KeepaliveOf(fd)
			if err != nil {
				t.Fatal(err)
			}
			if want := c.want(kernel); got != want {
				t.Errorf("SetKeepalive(%+v): got %+v; want %+v", c.ka, got, want)
			}
		})
	}
}

// TestSetUserTimeout: rounded up to whole milliseconds; 0 turns it off.
func TestSetUserTimeout(t *testing.T) {
	fd, _ := socket(t)
	for _, c := range []struct{ set, want time.Duration }{
		{30 * time.Second, 30 * time.Second},
		{1500 * time.Microsecond, 2 * time.Millisecond},
		{time.Nanosecond, time.Millisecond},
		{0, 0},
	} {
		if err := SetUserTimeout(fd, c.set); err != nil {
			t.Fatal(err)
		}
		if got, err := sockfd.UserTimeoutOf(fd); err != nil || got != c.want {
			t.Errorf("SetUserTimeout(%v): got %v, %v; want %v", c.set, got, err, c.want)
		}
	}
}

func TestFill(t *testing.T) {
	def := net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 15 * time.Second, Count: 9}
	for _, c := range []struct{ ka, want net.KeepAliveConfig }{
		{net.KeepAliveConfig{Enable: true}, net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 15 * time.Second, Count: 9}},
		{net.KeepAliveConfig{Enable: true, Idle: time.Second, Count: -1}, net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: 15 * time.Second, Count: 9}},
		{net.KeepAliveConfig{Idle: 2 * time.Second, Interval: 3 * time.Second, Count: 4}, net.KeepAliveConfig{Idle: 2 * time.Second, Interval: 3 * time.Second, Count: 4}},
	} {
		if got := Fill(c.ka, def); got != c.want {
			t.Errorf("Fill(%+v): got %+v; want %+v", c.ka, got, c.want)
		}
	}
}
