package proxy

import (
	"context"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/sockfd"
)

// TestListenFromLoops: a service that replaces one on the same address takes
// over as many of its listening sockets as it has loops for and binds the
// rest; once the old service has stopped, every socket it serves on still
// accepts.
func TestListenFromLoops(t *testing.T) {
	for _, tc := range []struct{ old, new, taken int }{{2, 2, 2}, {2, 3, 2}, {3, 1, 1}} {
		t.Run(fmt.Sprintf("%d loops to %d", tc.old, tc.new), func(t *testing.T) {
			be := startBackend(t, "a", loopback0, echo)
			cfg := Config{Name: t.Name(), Listen: loopback0, Backends: []Backend{{Addr: be.addr()}}, Logger: discardLogger(),
				AcceptLoops: tc.old, ShutdownTimeout: DefaultDrainTimeout}
			ctx, cancel := context.WithCancel(context.Background())
			old, err := Listen(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			// Exits when cancel is called below (or at cleanup), once drained.
			go func() { done <- old.Serve(ctx) }()
			stop := func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("old serve: %v", err)
				}
			}
			t.Cleanup(func() {
				if ctx.Err() == nil {
					stop()
				}
			})
			cfg.AcceptLoops = tc.new
			s := startProxyWith(t, cfg, func(ctx context.Context, cfg Config) (*Service, error) { return ListenFrom(ctx, cfg, old) })
			if s.Addr() != old.Addr() {
				t.Fatalf("got address %v; want the old service's, %v", s.Addr(), old.Addr())
			}
			var was []uint64
			for _, ln := range old.lns {
				was = append(was, inode(t, ln.fd))
			}
			taken := 0
			for _, ln := range s.lns {
				if slices.Contains(was, inode(t, ln.fd)) {
					taken++
				}
			}
			if len(s.lns) != tc.new || taken != tc.taken {
				t.Errorf("got %d sockets, %d of them the old service's; want %d, %d", len(s.lns), taken, tc.new, tc.taken)
			}
			stop()
			// Connections from many source ports reach every socket of the
			// SO_REUSEPORT group.
			for i := range 40 {
				if err := roundTrip(dial(t, s), "ping\n"); err != nil {
					t.Fatalf("connection %d after the old service stopped: %v", i, err)
				}
			}
		})
	}
}

// inode returns the inode of the socket fd is a descriptor of.
func inode(t *testing.T, fd int) uint64 {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestListenFromKeepalive: a service that takes listening sockets over sets
// its client keepalive on them, turning it off or giving a field it leaves
// out the kernel's default where the old service had set one, and Reclaim
// gives the old service's setting back once the new one is given up.
func TestListenFromKeepalive(t *testing.T) {
	host, err := keepaliveDefaults()
	if err != nil {
		t.Fatal(err)
	}
	off := net.KeepAliveConfig{}
	set := net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3}
	defaults := net.KeepAliveConfig{Enable: true}
	wantOf := func(ka net.KeepAliveConfig) sockfd.Keepalive {
		if !ka.Enable {
			return sockfd.Keepalive{On: 0}
		}
		if ka.Idle == 0 {
			ka = host
		}
		return sockfd.Keepalive{On: 1, Idle: int(ka.Idle / time.Second), Interval: int(ka.Interval / time.Second), Count: ka.Count}
	}
	for _, tc := range []struct {
		name     string
		old, new net.KeepAliveConfig
	}{{"set to off", set, off}, {"off to the defaults", off, defaults}, {"set to the defaults", set, defaults}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Name: t.Name(), Listen: loopback0, Backends: []Backend{{Addr: loopback0}}, Logger: discardLogger(),
				AcceptLoops: 1, ClientKeepalive: tc.old}
			old, err := Listen(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { old.Close() })
			check := func(when string, want net.KeepAliveConfig) {
				t.Helper()
				k, err := sockfd.KeepaliveOf(old.lns[0].fd)
				if err != nil {
					t.Fatal(err)
				}
				w := wantOf(want)
				if k.On != w.On || w.On == 1 && (k.Idle != w.Idle || k.Interval != w.Interval || k.Count != w.Count) {
					t.Errorf("%s: the listening socket's keepalive got %+v; want %+v", when, k, w)
				}
			}
			check("before", tc.old)
			cfg.ClientKeepalive = tc.new
			s, err := ListenFrom(context.Background(), cfg, old)
			if err != nil {
				t.Fatal(err)
			}
			if inode(t, s.lns[0].fd) != inode(t, old.lns[0].fd) {
				t.Fatal("the new service did not take the socket over")
			}
			check("taken over", tc.new)
			s.Close()
			if err := old.Reclaim(); err != nil {
				t.Fatal(err)
			}
			check("reclaimed", tc.old)
		})
	}
}
