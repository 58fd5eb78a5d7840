package proxyplane

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
	"github.com/weir-lb/weir/userspace/proxy"
)

// rebuildSetup runs a proxy plane with an echo backend; service(name, px) is
// a service of it made of px (its listen address set to a loopback address
// of its own). It has service("web", px) added.
func rebuildSetup(t *testing.T, px config.Proxy) (p *Plane, vip netip.AddrPort, service func(string, config.Proxy) *plan.Service) {
	be := churn.Echo(t)
	p = New(&health.Checker{}, slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})))
	t.Cleanup(p.Close)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	vip = l.Addr().(*net.TCPAddr).AddrPort()
	l.Close()
	service = func(name string, px config.Proxy) *plan.Service {
		px.Listen, px.ConnectTimeout = vip, time.Second
		return &plan.Service{
			Config:   config.Service{Name: name, Algorithm: config.AlgorithmLeastConn, DrainTimeout: 5 * time.Second, Proxy: px},
			Backends: []plan.Backend{{ID: plan.ID(name, be), Config: config.Backend{Addr: be}, Usable: true, Weight: 1}},
		}
	}
	if err := p.Add(service("web", px)); err != nil {
		t.Fatalf("add: %v", err)
	}
	p.Commit()
	return p, vip, service
}

// TestRebuildUnderLoad: reloads that replace a service's server while
// clients keep opening connections lose none of them: no client sees its
// connection reset. The new server takes the old one's listening sockets
// over, after a change of a setting fixed at listen time (idle_timeout), the
// same with the number of event loops (GOMAXPROCS) changed up and down
// between reloads, and after a rename on the same address.
func TestRebuildUnderLoad(t *testing.T) {
	idle := func(i int) (string, config.Proxy) {
		return "web", config.Proxy{IdleTimeout: time.Duration(10+i) * time.Second}
	}
	for _, tc := range []struct {
		name string
		// at is the name and settings after i reloads ("web" at 0).
		at func(i int) (string, config.Proxy)
		// procs is GOMAXPROCS before each reload, in turn; nil: unchanged.
		procs []int
	}{
		{"idle_timeout", idle, nil},
		{"event_loops", idle, []int{4, 1, 3, 2}},
		{"rename", func(i int) (string, config.Proxy) {
			if i == 0 {
				return "web", config.Proxy{}
			}
			return fmt.Sprintf("web-%d", i), config.Proxy{}
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			was := runtime.GOMAXPROCS(0)
			t.Cleanup(func() { runtime.GOMAXPROCS(was) })
			_, px := tc.at(0)
			p, vip, service := rebuildSetup(t, px)
			load := churn.Start(t, vip.String(), 16, []byte("ping"), []byte("ping"))
			load.Each(t, 10, func(i int) {
				if len(tc.procs) > 0 {
					runtime.GOMAXPROCS(tc.procs[i%len(tc.procs)])
				}
				if err := reload(p, service(tc.at(i)), service(tc.at(i+1))); err != nil {
					t.Fatalf("reload %d: %v", i, err)
				}
				p.Commit()
			})
			load.NoneFailed(t, "10 reloads under load")
		})
	}
}

// reload applies the change from prev to next as the agent does: a new name
// is added, then the old one removed.
func reload(p *Plane, prev, next *plan.Service) error {
	if prev.Name() == next.Name() {
		return p.Update(prev, next)
	}
	if err := p.Add(next); err != nil {
		return err
	}
	return p.Remove(prev)
}

// TestRebuildAborted: a change that replaced a service's server (its client
// keepalive changed; or it was renamed, the change refused before the old
// name was removed, as when a later add fails; or its keepalive changed with
// more, or fewer, event loops than the old server has sockets) and is aborted
// gives the old server its listening sockets back: it goes on accepting on
// them, with its own keepalive setting, and the load on the service loses no
// connection meanwhile, on the sockets the new server bound beside those
// either.
func TestRebuildAborted(t *testing.T) {
	keepalive := func(idle time.Duration) config.Proxy {
		return config.Proxy{TCPKeepalive: config.TCPKeepalive{Client: config.Keepalive{Idle: idle}}}
	}
	for _, tc := range []struct {
		name  string
		to    string // the name after the change
		procs [2]int // GOMAXPROCS before and for the change; 0: unchanged
	}{{"rebuild", "web", [2]int{}}, {"rename", "www", [2]int{}},
		{"more_event_loops", "web", [2]int{1, 4}}, {"fewer_event_loops", "web", [2]int{4, 1}}} {
		t.Run(tc.name, func(t *testing.T) {
			name := tc.to
			if tc.procs[0] > 0 {
				t.Cleanup(func(was int) func() { return func() { runtime.GOMAXPROCS(was) } }(runtime.GOMAXPROCS(tc.procs[0])))
			}
			p, vip, service := rebuildSetup(t, keepalive(5*time.Second))
			old := mustGet(t, p, "web")
			load := churn.Start(t, vip.String(), 16, []byte("ping"), []byte("ping"))
			load.Each(t, 1, func(int) {
				if tc.procs[1] > 0 {
					// More: the new server binds sockets beside those it
					// takes over; fewer: it takes more over than it has
					// loops for.
					runtime.GOMAXPROCS(tc.procs[1])
				}
				next := service(name, keepalive(9*time.Second))
				if name == "web" {
					if err := p.Update(service("web", keepalive(5*time.Second)), next); err != nil {
						t.Fatalf("update: %v", err)
					}
				} else if err := p.Add(next); err != nil {
					t.Fatalf("add: %v", err)
				}
			})
			fresh := mustGet(t, p, name)
			if fresh == old {
				t.Fatal("the change did not start a new server")
			}
			if !load.Progress(100, 10*time.Second) || fresh.Snapshot().Accepted == 0 {
				t.Fatal("the new server accepted nothing before the abort")
			}
			load.Each(t, 1, func(int) { p.Abort() })
			if mustGet(t, p, "web") != old {
				t.Fatal("after the abort: the service's server is not the one it had")
			}
			if _, ok := p.Get("www"); ok {
				t.Fatal("after the abort: the new name is served")
			}
			if !waitfor.Cond(10*time.Second, func() bool { return len(p.Draining(name)) == 0 }) {
				t.Fatal("the server the abort gave up did not end")
			}
			accepted := old.Snapshot().Accepted
			if !load.Progress(200, 10*time.Second) {
				t.Fatal("the load made no progress after the abort")
			}
			// Only the old server listens now: of the 200 connections served, all
			// but those the load's 16 clients had open before are its.
			if got := old.Snapshot().Accepted; got < accepted+200-16 {
				t.Errorf("after the abort: the old server accepted %d connections of 200 served; want at least 184", got-accepted)
			}
			load.NoneFailed(t, "a replacement started and aborted under load")
			checkKeepalive(t, vip, 5)
		})
	}
}

// TestRebuildKeepsNoDescriptor: reloads that replace a service's server (a
// setting fixed at listen time changed; the service renamed; the number of
// event loops changed up and down), one of them aborted, leave the process
// no descriptor more than it had once the replaced servers have drained:
// each server closes its own descriptors of the listening sockets it shared,
// and the sockets bound beside those taken over.
func TestRebuildKeepsNoDescriptor(t *testing.T) {
	idle := func(i int) (string, config.Proxy) {
		return "web", config.Proxy{IdleTimeout: time.Duration(10+i) * time.Second}
	}
	for _, tc := range []struct {
		name  string
		at    func(i int) (string, config.Proxy) // as in TestRebuildUnderLoad
		procs []int                              // GOMAXPROCS before each reload, in turn; nil: unchanged
	}{
		{"idle_timeout", idle, nil},
		{"rename", func(i int) (string, config.Proxy) {
			if i == 0 {
				return "web", config.Proxy{}
			}
			return fmt.Sprintf("web-%d", i), config.Proxy{}
		}, nil},
		{"event_loops", idle, []int{3, 1, 4, 2, 1, 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			was := runtime.GOMAXPROCS(0)
			t.Cleanup(func() { runtime.GOMAXPROCS(was) })
			_, px := tc.at(0)
			p, vip, service := rebuildSetup(t, px)
			// Served: the server's event loops, made as it starts, are open.
			churn.Start(t, vip.String(), 1, []byte("ping"), []byte("ping")).NoneFailed(t, "before the reloads")
			before, loops := openFDs(t), sockets(t, mustGet(t, p, "web"), vip)
			for i := range 6 {
				if len(tc.procs) > 0 {
					runtime.GOMAXPROCS(tc.procs[i])
				}
				if err := reload(p, service(tc.at(i)), service(tc.at(i+1))); err != nil {
					t.Fatalf("reload %d: %v", i, err)
				}
				if i == 3 {
					p.Abort()
					if err := reload(p, service(tc.at(i)), service(tc.at(i+1))); err != nil {
						t.Fatalf("reload %d again: %v", i, err)
					}
				}
				p.Commit()
			}
			runtime.GOMAXPROCS(was)
			churn.Start(t, vip.String(), 1, []byte("ping"), []byte("ping")).NoneFailed(t, "after the reloads")
			last, _ := tc.at(6)
			more := sockets(t, mustGet(t, p, last), vip) - loops
			drained := func() bool {
				for i := range 7 {
					if name, _ := tc.at(i); len(p.Draining(name)) > 0 {
						return false
					}
				}
				return true
			}
			// Each loop the last server has more than the first has a
			// listening socket, an epoll and a wake descriptor.
			want := before + 3*more
			if !waitfor.Cond(10*time.Second, func() bool { return drained() && openFDs(t) <= want }) {
				t.Errorf("after 6 reloads and an abort: %d descriptors open, drained %v; want at most %d, true",
					openFDs(t), drained(), want)
			}
		})
	}
}

// sockets returns how many listening sockets px holds open on vip.
func sockets(t *testing.T, px *proxy.Service, vip netip.AddrPort) int {
	fds := px.ListenFDs(vip)
	for _, fd := range fds {
		if err := unix.Close(fd); err != nil {
			t.Fatal(err)
		}
	}
	return len(fds)
}

// openFDs returns how many descriptors the process has open, but for pipes
// (sockfd.Open).
func openFDs(t *testing.T) int {
	n, err := sockfd.Open()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// checkKeepalive fails the test unless a connection to vip now has keepalive on
// with idle seconds.
func checkKeepalive(t *testing.T, vip netip.AddrPort, idle int) {
	t.Helper()
	c, err := net.Dial("tcp", vip.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 1)); err != nil {
		t.Fatalf("read the echo: %v", err)
	}
	k, err := sockfd.KeepaliveBetween(vip, c.LocalAddr().(*net.TCPAddr).AddrPort())
	if err != nil {
		t.Fatal(err)
	}
	if k.On != 1 || k.Idle != idle {
		t.Errorf("the client socket's keepalive is %+v; want on, idle %ds", k, idle)
	}
}
