package agent

import (
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/httpplane"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/agent/proxyplane"
	"github.com/weir-lb/weir/userspace/config"
)

// TestPlaneMoveUnderLoad: reloads that move a service between the proxy and
// the http plane on the same address, through the agent's reconcile (the
// new plane's add, then the old plane's removal), while clients keep opening
// connections, one HTTP/1.1 request each, lose none of them: the new plane's
// server takes the other's listening sockets over, all of the proxy's (one
// per event loop). A move refused by a later failing add leaves the old
// server serving on its sockets, with nothing lost either.
func TestPlaneMoveUnderLoad(t *testing.T) {
	// Three event loops: the http plane takes three proxy sockets over.
	was := runtime.GOMAXPROCS(3)
	t.Cleanup(func() { runtime.GOMAXPROCS(was) })
	a, vip, on, service := planeMoveSetup(t)
	other := map[plan.Plane]plan.Plane{plan.Proxy: plan.HTTP, plan.HTTP: plan.Proxy}
	prev := on(plan.Proxy)
	if err := a.reconcile(plan.Desired{}, prev); err != nil {
		t.Fatal(err)
	}
	load := churn.Start(t, vip.String(), 16, []byte("GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n"), []byte("HTTP/1.1 200"))
	load.Each(t, 10, func(i int) {
		next := on(other[prev.Services[0].Plane])
		if i%3 == 0 {
			// An address no interface holds: its add fails after the
			// move's, and the reload is refused.
			refused := next
			refused.Services = append(refused.Services, service("bad", plan.Proxy, netip.MustParseAddrPort("192.0.2.1:80")))
			before := a.server(prev.Services[0].Plane)
			if err := a.reconcile(prev, refused); err == nil {
				t.Fatalf("move %d: a reload with a service that cannot bind was applied", i)
			}
			if got := a.server(prev.Services[0].Plane); got != before || before == nil {
				t.Fatalf("move %d refused: the service's server on the %s plane is %v; want the one it had, %v", i, prev.Services[0].Plane, got, before)
			}
			if got := a.server(next.Services[0].Plane); got != nil {
				t.Fatalf("move %d refused: the %s plane serves the service", i, next.Services[0].Plane)
			}
		}
		if err := a.reconcile(prev, next); err != nil {
			t.Fatalf("move %d to the %s plane: %v", i, next.Services[0].Plane, err)
		}
		prev = next
	})
	load.NoneFailed(t, "10 moves between the proxy and the http plane, and 4 refused, under load")
}

// planeMoveSetup is planeMover, plus on(p): service "web" on plane p at vip.
func planeMoveSetup(t *testing.T) (a *Agent, vip netip.AddrPort, on func(plan.Plane) plan.Desired,
	service func(name string, on plan.Plane, at netip.AddrPort) plan.Service) {
	t.Helper()
	a, vip, service = planeMover(t, nil)
	on = func(p plan.Plane) plan.Desired { return plan.Desired{Services: []plan.Service{service("web", p, vip)}} }
	return a, vip, on, service
}

// server returns the server of service "web" on plane p, nil if none.
func (a *Agent) server(p plan.Plane) any {
	switch p {
	case plan.Proxy:
		if srv, ok := a.proxy.Get("web"); ok {
			return srv
		}
	case plan.HTTP:
		if srv, ok := a.http.Get("web"); ok {
			return srv
		}
	}
	return nil
}

// TestPlaneMoveKeepsNoDescriptor: moves of a service between the proxy and
// the http plane and back, one refused at each turn first, leave the process
// no descriptor and no goroutine more than it had once the servers they
// replaced have drained: each server, the http one accepting from the
// proxy's three sockets included, closes its own descriptors of the sockets
// it shared, and ends what it started.
func TestPlaneMoveKeepsNoDescriptor(t *testing.T) {
	was := runtime.GOMAXPROCS(3)
	t.Cleanup(func() { runtime.GOMAXPROCS(was) })
	a, vip, on, service := planeMoveSetup(t)
	prev := on(plan.Proxy)
	if err := a.reconcile(plan.Desired{}, prev); err != nil {
		t.Fatal(err)
	}
	request, answer := []byte("GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n"), []byte("HTTP/1.1 200")
	// Served: the proxy's event loops, made as it starts, are open.
	churn.Start(t, vip.String(), 1, request, answer).NoneFailed(t, "before the moves")
	count := func() (int, int) {
		n, err := sockfd.Open()
		if err != nil {
			t.Fatal(err)
		}
		return n, runtime.NumGoroutine()
	}
	fds, goroutines := count()
	for i, p := range []plan.Plane{plan.HTTP, plan.Proxy, plan.HTTP, plan.Proxy} {
		next := on(p)
		refused := next
		refused.Services = append(refused.Services, service("bad", plan.Proxy, netip.MustParseAddrPort("192.0.2.1:80")))
		if err := a.reconcile(prev, refused); err == nil {
			t.Fatalf("move %d: a reload with a service that cannot bind was applied", i)
		}
		if err := a.reconcile(prev, next); err != nil {
			t.Fatalf("move %d to the %s plane: %v", i, p, err)
		}
		prev = next
	}
	churn.Start(t, vip.String(), 1, request, answer).NoneFailed(t, "after the moves")
	drained := func() bool { return len(a.proxy.Draining("web")) == 0 && len(a.http.Draining("web")) == 0 }
	if !waitfor.Cond(10*time.Second, func() bool {
		n, g := count()
		return drained() && n <= fds && g <= goroutines
	}) {
		n, g := count()
		t.Errorf("after 4 moves and 4 refused: %d descriptors, %d goroutines open, drained %v; want at most %d, %d, true",
			n, g, drained(), fds, goroutines)
	}
}

// planeMover returns an agent with paired proxy and http planes, an address
// on loopback no socket holds, and service, which makes a service name on
// plane on listening at with one backend (the same for every service),
// amended by set if not nil.
func planeMover(t *testing.T, set func(*config.Service)) (*Agent, netip.AddrPort, func(name string, on plan.Plane, at netip.AddrPort) plan.Service) {
	t.Helper()
	bs := httpbackend.StartN(t, 1)
	log := slog.New(slog.DiscardHandler)
	a := &Agent{log: log, proxy: proxyplane.New(&health.Checker{}, log), http: httpplane.New(&health.Checker{}, log, nil)}
	pairPlanes(a.proxy, a.http)
	a.planes = map[plan.Plane]Plane{plan.Proxy: a.proxy, plan.HTTP: a.http}
	t.Cleanup(a.http.Close)
	t.Cleanup(a.proxy.Close)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	vip := l.Addr().(*net.TCPAddr).AddrPort()
	l.Close()
	service := func(name string, on plan.Plane, at netip.AddrPort) plan.Service {
		dp := config.DataPlaneProxy
		if on == plan.HTTP {
			dp = config.DataPlaneHTTP
		}
		s := plan.Service{
			Config: config.Service{Name: name, DataPlane: dp, Algorithm: config.AlgorithmLeastConn, DrainTimeout: 5 * time.Second,
				Proxy: config.Proxy{Listen: at, ConnectTimeout: time.Second},
				HTTP:  config.HTTP{Listen: at, ConnectTimeout: time.Second, IdleTimeout: time.Minute}},
			Placement: plan.Placement{Plane: on}, Installed: true,
			Backends: []plan.Backend{{ID: plan.ID(name, bs[0].Addr), Config: config.Backend{Addr: bs[0].Addr, Weight: 1},
				Healthy: true, Usable: true, Weight: 1}},
		}
		if set != nil {
			set(&s.Config)
		}
		return s
	}
	return a, vip, service
}

// TestPlaneSwapUnderLoad: a reload in which a proxy service and an http
// service swap their addresses, each staying on its plane, refused once
// first, loses no connection to either address while clients keep opening
// them: each new server takes over the sockets of the other plane's server
// that leaves its address. Once the replaced servers have drained, each
// address has the sockets it had, with one descriptor each (the new
// server's), the proxy's address two more the proxy bound beside the http
// server's one for its three event loops; the process holds no descriptor
// more than those two, connected sockets aside (the http plane's pooled
// connections to the backend).
func TestPlaneSwapUnderLoad(t *testing.T) {
	was := runtime.GOMAXPROCS(3)
	t.Cleanup(func() { runtime.GOMAXPROCS(was) })
	a, x, _, service := planeMoveSetup(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	y := l.Addr().(*net.TCPAddr).AddrPort()
	l.Close()
	prev := plan.Desired{Services: []plan.Service{service("web", plan.Proxy, x), service("api", plan.HTTP, y)}}
	next := plan.Desired{Services: []plan.Service{service("web", plan.Proxy, y), service("api", plan.HTTP, x)}}
	if err := a.reconcile(plan.Desired{}, prev); err != nil {
		t.Fatal(err)
	}
	request, answer := []byte("GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n"), []byte("HTTP/1.1 200")
	// Served: the proxy's event loops, made as it starts, are open.
	for _, ap := range []netip.AddrPort{x, y} {
		churn.Start(t, ap.String(), 1, request, answer).NoneFailed(t, "before the swap, to "+ap.String())
	}
	standing := func() int {
		n, err := sockfd.Standing()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	listening := func(ap netip.AddrPort) map[string]int {
		m, err := sockfd.Listening(ap)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	fds, atX, atY := standing(), listening(x), listening(y)
	if len(atX) != 3 || len(atY) != 1 {
		t.Fatalf("before the swap: %v listening at the proxy's address, %v at the http plane's; want 3 sockets, 1", atX, atY)
	}
	loadX := churn.Start(t, x.String(), 8, request, answer)
	loadY := churn.Start(t, y.String(), 8, request, answer)
	loadX.Each(t, 1, func(int) {
		refused := next
		refused.Services = append(refused.Services, service("bad", plan.Proxy, netip.MustParseAddrPort("192.0.2.1:80")))
		webWas := a.server(plan.Proxy)
		apiWas, _ := a.http.Get("api")
		if err := a.reconcile(prev, refused); err == nil {
			t.Fatal("a reload with a service that cannot bind was applied")
		}
		if api, _ := a.http.Get("api"); a.server(plan.Proxy) != webWas || api != apiWas {
			t.Fatal("after the refused swap: a service's server is not the one it had")
		}
	})
	if !loadY.Progress(50, 10*time.Second) {
		t.Fatal("the load on the http service's address made no progress after the refused swap")
	}
	loadX.Each(t, 1, func(int) {
		if err := a.reconcile(prev, next); err != nil {
			t.Fatalf("swap: %v", err)
		}
	})
	loadX.NoneFailed(t, "a swap of a proxy and an http service's addresses, and one refused, to "+x.String())
	loadY.NoneFailed(t, "a swap of a proxy and an http service's addresses, and one refused, to "+y.String())
	drained := func() bool {
		return len(a.proxy.Draining("web")) == 0 && len(a.http.Draining("api")) == 0
	}
	// The http server's socket at y, and two the proxy bound, once each.
	atY3 := func(m map[string]int) bool {
		for ino := range atY {
			if m[ino] != 1 {
				return false
			}
		}
		for _, n := range m {
			if n != 1 {
				return false
			}
		}
		return len(m) == 3
	}
	if !waitfor.Cond(10*time.Second, func() bool {
		return drained() && standing() <= fds+2 && maps.Equal(listening(x), atX) && atY3(listening(y))
	}) {
		t.Errorf("after the swap: drained %v, %d descriptors open but for connections (want at most %d); listening at %s: %v (want %v), at %s: %v (want %v and 2 more, one descriptor each)",
			drained(), standing(), fds+2, x, listening(x), atX, y, listening(y), atY)
	}
}
