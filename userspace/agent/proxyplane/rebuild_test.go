package proxyplane

import (
	"log/slog"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// rebuildSetup runs a proxy plane whose service "web", on a loopback address
// of its own, is what service makes of its proxy settings (their listen
// address set), with an echo backend; it has service(px) added.
func rebuildSetup(t *testing.T, px config.Proxy) (p *Plane, vip netip.AddrPort, service func(config.Proxy) *plan.Service) {
	be := churn.Echo(t)
	p = New(&health.Checker{}, slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})))
	t.Cleanup(p.Close)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	vip = l.Addr().(*net.TCPAddr).AddrPort()
	l.Close()
	service = func(px config.Proxy) *plan.Service {
		px.Listen, px.ConnectTimeout = vip, time.Second
		return &plan.Service{
			Config:   config.Service{Name: "web", Algorithm: config.AlgorithmLeastConn, DrainTimeout: 5 * time.Second, Proxy: px},
			Backends: []plan.Backend{{ID: plan.ID("web", be), Config: config.Backend{Addr: be}, Usable: true, Weight: 1}},
		}
	}
	if err := p.Add(service(px)); err != nil {
		t.Fatalf("add: %v", err)
	}
	p.Commit()
	return p, vip, service
}

// TestRebuildUnderLoad: reloads that replace a service's server (idle_timeout
// is fixed at listen time) while clients keep opening connections lose none
// of them: no client sees its connection reset.
func TestRebuildUnderLoad(t *testing.T) {
	p, vip, service := rebuildSetup(t, config.Proxy{IdleTimeout: 10 * time.Second})
	prev := service(config.Proxy{IdleTimeout: 10 * time.Second})
	load := churn.Start(t, vip.String(), 16, []byte("ping"), []byte("ping"))
	load.Each(t, 10, func(i int) {
		next := service(config.Proxy{IdleTimeout: time.Duration(11+i) * time.Second})
		if err := p.Update(prev, next); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		p.Commit()
		prev = next
	})
	load.NoneFailed(t, "10 reloads under load")
}

// TestRebuildAborted: a change that replaced a service's server (its client
// keepalive changed) and is aborted gives the old server its listening
// sockets back: it goes on accepting on them, with its own keepalive setting,
// and the load on the service loses no connection meanwhile.
func TestRebuildAborted(t *testing.T) {
	keepalive := func(idle time.Duration) config.Proxy {
		return config.Proxy{TCPKeepalive: config.TCPKeepalive{Client: config.Keepalive{Idle: idle}}}
	}
	p, vip, service := rebuildSetup(t, keepalive(5*time.Second))
	old := mustGet(t, p, "web")
	load := churn.Start(t, vip.String(), 8, []byte("ping"), []byte("ping"))
	load.Each(t, 1, func(int) {
		if err := p.Update(service(keepalive(5*time.Second)), service(keepalive(9*time.Second))); err != nil {
			t.Fatalf("update: %v", err)
		}
	})
	if mustGet(t, p, "web") == old {
		t.Fatal("the update did not replace the server")
	}
	load.Each(t, 1, func(int) { p.Abort() })
	if mustGet(t, p, "web") != old {
		t.Fatal("after the abort: the service's server is not the one it had")
	}
	if !waitfor.Cond(10*time.Second, func() bool { return len(p.Draining("web")) == 0 }) {
		t.Fatal("the server the abort gave up did not end")
	}
	accepted := old.Snapshot().Accepted
	if !load.Progress(200, 10*time.Second) {
		t.Fatal("the load made no progress after the abort")
	}
	// Only the old server listens now: of the 200 connections served, all
	// but those the load's 8 clients had open before are its.
	if got := old.Snapshot().Accepted; got < accepted+200-8 {
		t.Errorf("after the abort: the old server accepted %d connections of 200 served; want at least 192", got-accepted)
	}
	load.NoneFailed(t, "a replacement started and aborted under load")
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
	if k.On != 1 || k.Idle != 5 {
		t.Errorf("after the abort: the client socket's keepalive is %+v; want on, idle 5s", k)
	}
}

// TestRebuildKeepsNoDescriptor: reloads that replace a service's server, and
// one that is aborted, leave the process no descriptor more than it had once
// the replaced servers have drained: each server closes its own descriptors
// of the listening sockets it shared.
func TestRebuildKeepsNoDescriptor(t *testing.T) {
	p, vip, service := rebuildSetup(t, config.Proxy{IdleTimeout: 10 * time.Second})
	idle := func(i int) *plan.Service {
		return service(config.Proxy{IdleTimeout: time.Duration(10+i) * time.Second})
	}
	// Served: the server's event loops, made as it starts, are open.
	churn.Start(t, vip.String(), 1, []byte("ping"), []byte("ping")).NoneFailed(t, "before the reloads")
	before := openFDs(t)
	for i := range 6 {
		if err := p.Update(idle(i), idle(i+1)); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		if i == 3 {
			p.Abort()
			if err := p.Update(idle(i), idle(i+1)); err != nil {
				t.Fatalf("reload %d again: %v", i, err)
			}
		}
		p.Commit()
	}
	churn.Start(t, vip.String(), 1, []byte("ping"), []byte("ping")).NoneFailed(t, "after the reloads")
	if !waitfor.Cond(10*time.Second, func() bool { return len(p.Draining("web")) == 0 && openFDs(t) <= before }) {
		t.Errorf("after 6 reloads and an abort: %d descriptors open, %d draining servers; want at most %d, 0",
			openFDs(t), len(p.Draining("web")), before)
	}
}

// openFDs returns how many descriptors the process has open.
func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}
