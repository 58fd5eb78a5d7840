package proxy

import (
	"context"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestListenFromLoops: a service that replaces one on the same address takes
// over every one of its listening sockets and binds the rest of its loops'
// (with fewer loops, it serves all the sockets it took all the same), which
// listen only once Join is called; once the old service has stopped, every
// socket it serves on still accepts.
func TestListenFromLoops(t *testing.T) {
	for _, tc := range []struct{ old, new, sockets, taken int }{{2, 2, 2, 2}, {2, 3, 3, 2}, {3, 1, 3, 3}} {
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
			if len(s.lns) != tc.sockets || taken != tc.taken {
				t.Errorf("got %d sockets, %d of them the old service's; want %d, %d", len(s.lns), taken, tc.sockets, tc.taken)
			}
			if got := listening(t, s); got != tc.taken {
				t.Errorf("before Join: got %d sockets listening; want the %d taken over", got, tc.taken)
			}
			if err := s.Join(); err != nil {
				t.Fatal(err)
			}
			if got := listening(t, s); got != tc.sockets {
				t.Errorf("after Join: got %d sockets listening; want %d", got, tc.sockets)
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

// TestListenFromLoopsUnderLoad: services that replace one another on the
// same address with more loops, and with fewer, each stopping the one it
// replaced and then joining the sockets it bound, while clients keep opening
// connections: none of them is reset, the ones queued on a socket the new
// service has no loop of its own for included.
func TestListenFromLoopsUnderLoad(t *testing.T) {
	be := startBackend(t, "a", loopback0, echo)
	cfg := Config{Name: t.Name(), Listen: loopback0, Backends: []Backend{{Addr: be.addr()}}, Logger: discardLogger(),
		ShutdownTimeout: DefaultDrainTimeout}
	type running struct {
		s    *Service
		stop func()
	}
	serve := func(loops int, old *Service) running {
		t.Helper()
		cfg.AcceptLoops = loops
		s, stop := serveStoppable(t, cfg, func(ctx context.Context, cfg Config) (*Service, error) { return ListenFrom(ctx, cfg, old) })
		return running{s, stop}
	}
	// The services listen on one address as configured, not port 0.
	first := serve(1, nil)
	cfg.Listen = first.s.Addr()
	first.stop()
	cur := serve(4, nil)
	load := churn.Start(t, cur.s.Addr().String(), 16, []byte("ping"), []byte("ping"))
	loops := []int{1, 3, 2, 4, 1, 2, 1, 3}
	load.Each(t, len(loops), func(i int) {
		next := serve(loops[i], cur.s)
		cur.stop()
		if err := next.s.Join(); err != nil {
			t.Fatal(err)
		}
		cur = next
	})
	load.NoneFailed(t, fmt.Sprintf("services replaced with %v loops under load", loops))
}

// listening returns how many of s's sockets listen (SO_ACCEPTCONN).
func listening(t *testing.T, s *Service) int {
	n := 0
	for _, ln := range s.lns {
		on, err := unix.GetsockoptInt(ln.fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
		if err != nil {
			t.Fatal(err)
		}
		n += on
	}
	return n
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
			takeOverAndReclaim(t, func(cfg *Config, old bool) {
				cfg.ClientKeepalive = tc.new
				if old {
					cfg.ClientKeepalive = tc.old
				}
			}, func(fd int, old bool) error {
				k, err := sockfd.KeepaliveOf(fd)
				if err != nil {
					return err
				}
				w := wantOf(tc.new)
				if old {
					w = wantOf(tc.old)
				}
				if k.On != w.On || w.On == 1 && (k.Idle != w.Idle || k.Interval != w.Interval || k.Count != w.Count) {
					return fmt.Errorf("the listening socket's keepalive got %+v; want %+v", k, w)
				}
				return nil
			})
		})
	}
}

// takeOverAndReclaim starts a service with one listening socket, configured by
// set(cfg, true), and checks the socket with check(fd, true); then a service
// configured by set(cfg, false) takes it over (ListenFrom) and the socket is
// checked with check(fd, false); then that one is given up, the old one
// reclaims the socket (Reclaim), and it is checked as at first.
func takeOverAndReclaim(t *testing.T, set func(cfg *Config, old bool), check func(fd int, old bool) error) {
	t.Helper()
	cfg := Config{Name: t.Name(), Listen: loopback0, Backends: []Backend{{Addr: loopback0}}, Logger: discardLogger(), AcceptLoops: 1}
	set(&cfg, true)
	old, err := Listen(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { old.Close() })
	checkAt := func(when string, isOld bool) {
		t.Helper()
		if err := check(old.lns[0].fd, isOld); err != nil {
			t.Errorf("%s: %v", when, err)
		}
	}
	checkAt("before", true)
	set(&cfg, false)
	s, err := ListenFrom(context.Background(), cfg, old)
	if err != nil {
		t.Fatal(err)
	}
	if inode(t, s.lns[0].fd) != inode(t, old.lns[0].fd) {
		t.Fatal("the new service did not take the socket over")
	}
	checkAt("taken over", false)
	s.Close()
	if err := old.Reclaim(); err != nil {
		t.Fatal(err)
	}
	checkAt("reclaimed", true)
}

// TestListenFromUnjoined: a service that replaces one whose sockets bound
// beside those it took over have not joined yet takes only the listening
// ones over and binds the rest itself, so that once it has joined them every
// socket it serves on listens, and the first two services can stop.
func TestListenFromUnjoined(t *testing.T) {
	be := startBackend(t, "a", loopback0, echo)
	cfg := Config{Name: t.Name(), Listen: loopback0, Backends: []Backend{{Addr: be.addr()}}, Logger: discardLogger(),
		AcceptLoops: 1}
	// The services listen on one address as configured, not port 0.
	port, err := Listen(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Listen = port.Addr()
	port.Close()
	first, err := Listen(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { first.Close() })
	cfg.AcceptLoops = 3
	mid, err := ListenFrom(context.Background(), cfg, first)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mid.Close() })
	if got := listening(t, mid); got != 1 {
		t.Fatalf("the unjoined service has %d sockets listening; want the 1 it took over", got)
	}
	s := startProxyWith(t, cfg, func(ctx context.Context, cfg Config) (*Service, error) { return ListenFrom(ctx, cfg, mid) })
	mid.Close()
	first.Close()
	if err := s.Join(); err != nil {
		t.Fatal(err)
	}
	if got := listening(t, s); got != len(s.lns) || got != 3 {
		t.Errorf("got %d of %d sockets listening; want 3 of 3", got, len(s.lns))
	}
	churn.Start(t, s.Addr().String(), 4, []byte("ping"), []byte("ping")).NoneFailed(t, "once the first services stopped")
	if n := s.Snapshot().AcceptErrors; n != 0 {
		t.Errorf("got %d accept errors; want 0", n)
	}
}

// TestListenFromUnjoinedRetires: a serving service whose sockets bound beside
// those it took over have not joined yet, replaced before it joined them,
// closes them as it stops, with those it shared: once it and the first
// service have stopped, the process holds the last service's sockets, epoll
// sets and wake descriptors and nothing more, each of its sockets listening
// with one descriptor.
func TestListenFromUnjoinedRetires(t *testing.T) {
	be := startBackend(t, "a", loopback0, echo)
	cfg := Config{Name: t.Name(), Listen: loopback0, Backends: []Backend{{Addr: be.addr()}}, Logger: discardLogger(),
		AcceptLoops: 1, ShutdownTimeout: DefaultDrainTimeout}
	port, err := Listen(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Listen = port.Addr()
	port.Close()
	open := func() int {
		n, err := sockfd.Open()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := open()
	serve := func(listen func(context.Context, Config) (*Service, error)) (*Service, func()) {
		return serveStoppable(t, cfg, listen)
	}
	first, stopFirst := serve(Listen)
	cfg.AcceptLoops = 3
	mid, stopMid := serve(func(ctx context.Context, cfg Config) (*Service, error) { return ListenFrom(ctx, cfg, first) })
	s, _ := serve(func(ctx context.Context, cfg Config) (*Service, error) { return ListenFrom(ctx, cfg, mid) })
	stopMid()
	stopFirst()
	if err := s.Join(); err != nil {
		t.Fatal(err)
	}
	churn.Start(t, s.Addr().String(), 4, []byte("ping"), []byte("ping")).NoneFailed(t, "once the first services stopped")
	// Served: s's event loops are open. Three each of sockets, epolls, eventfds.
	want := before + 3*3
	if !waitfor.Cond(10*time.Second, func() bool { return open() <= want }) {
		t.Errorf("got %d descriptors open; want at most %d, those of the last service", open(), want)
	}
	at, err := sockfd.Listening(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	for ino, n := range at {
		if n != 1 || len(at) != 3 {
			t.Errorf("%d sockets listening at %s, %d descriptors of %s; want 3, 1", len(at), s.Addr(), n, ino)
		}
	}
}
