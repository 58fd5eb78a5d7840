package proxyplane

import (
	"maps"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// TestOntoChainKeepsSockets: a reload that moves web onto api's address, api
// onto db's and removes db, refused once and then applied, under load on the
// two addresses that stay: the refused one leaves each old server with its
// sockets, the applied one leaves every listening socket of api's and db's
// address with one descriptor, the new server's (the same sockets, taken
// over), nothing listening on web's old address, and the process no
// descriptor more than web's old server's sockets, epoll sets and wake
// descriptors fewer once the old servers have drained.
func TestOntoChainKeepsSockets(t *testing.T) {
	p, x, service := rebuildSetup(t, config.Proxy{})
	y, z := freeAddr(t), freeAddr(t)
	at := func(name string, ap netip.AddrPort) *plan.Service {
		s := service(name, config.Proxy{})
		s.Config.Proxy.Listen = ap
		return s
	}
	prev := map[string]*plan.Service{"web": at("web", x), "api": at("api", y), "db": at("db", z)}
	next := map[string]*plan.Service{"web": at("web", y), "api": at("api", z)}
	for _, name := range []string{"api", "db"} {
		if err := p.Add(prev[name]); err != nil {
			t.Fatal(err)
		}
	}
	p.Commit()
	// Served: each server's event loops, made as it starts, are open.
	for _, ap := range []netip.AddrPort{x, y, z} {
		churn.Start(t, ap.String(), 1, []byte("ping"), []byte("ping")).NoneFailed(t, "before the reload, to "+ap.String())
	}
	before, loops := openFDs(t), sockets(t, mustGet(t, p, "web"), x)
	// One descriptor of each socket, its server's: the same after the reload.
	atY, atZ := listeningAt(t, y), listeningAt(t, z)
	for _, m := range []map[string]int{atY, atZ} {
		for ino, n := range m {
			if n != 1 || len(m) != loops {
				t.Fatalf("before the reload: %d sockets listening, %d descriptors of %s; want %d, 1", len(m), n, ino, loops)
			}
		}
	}
	was := map[string]any{}
	for name := range prev {
		was[name] = mustGet(t, p, name)
	}
	loadY := churn.Start(t, y.String(), 8, []byte("ping"), []byte("ping"))
	loadZ := churn.Start(t, z.String(), 8, []byte("ping"), []byte("ping"))
	loadY.Each(t, 1, func(int) { apply(t, p, prev, next); p.Abort() })
	for name := range prev {
		if mustGet(t, p, name) != was[name] {
			t.Fatalf("after the abort: %s's server is not the one it had", name)
		}
	}
	churn.Start(t, x.String(), 1, []byte("ping"), []byte("ping")).NoneFailed(t, "after the abort, to web's address")
	if !loadZ.Progress(50, 10*time.Second) {
		t.Fatal("the load on db's address made no progress after the abort")
	}
	loadY.Each(t, 1, func(int) { apply(t, p, prev, next); p.Commit() })
	loadY.NoneFailed(t, "a refused and an applied reload, to "+y.String())
	loadZ.NoneFailed(t, "a refused and an applied reload, to "+z.String())
	drained := func() bool {
		return len(p.Draining("web")) == 0 && len(p.Draining("api")) == 0 && len(p.Draining("db")) == 0
	}
	want := before - 3*loops
	if !waitfor.Cond(10*time.Second, func() bool {
		return drained() && openFDs(t) <= want && maps.Equal(listeningAt(t, y), atY) && maps.Equal(listeningAt(t, z), atZ) && len(listeningAt(t, x)) == 0
	}) {
		t.Errorf("after the reload: drained %v, %d descriptors open (want at most %d); listening on web's old address: %v (want none), on api's: %v (want %v, one descriptor each), on db's: %v (want %v)",
			drained(), openFDs(t), want, listeningAt(t, x), listeningAt(t, y), atY, listeningAt(t, z), atZ)
	}
}

// freeAddr returns a loopback address with a port nothing listens on now.
func freeAddr(t *testing.T) netip.AddrPort {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// listeningAt is sockfd.Listening.
func listeningAt(t *testing.T, ap netip.AddrPort) map[string]int {
	t.Helper()
	m, err := sockfd.Listening(ap)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
