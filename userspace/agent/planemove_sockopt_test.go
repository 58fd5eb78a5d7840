package agent

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// TestPlaneMoveSocketOptions: a service moved between the proxy and the http
// plane on one address keeps its listening sockets, and the options on them
// follow the plane that serves: a move refused gives the old plane's server
// its own back (keepalive off and no user timeout for the proxy's, Go's
// keepalive and its user timeout for the http plane's), and connections the
// http plane accepts on sockets it took from the proxy have Go's keepalive
// and the http plane's user timeout.
func TestPlaneMoveSocketOptions(t *testing.T) {
	const httpUT = 3 * time.Second
	a, vip, service := planeMover(t, func(s *config.Service) { s.HTTP.TCPUserTimeout.Client = httpUT })
	on := func(p plan.Plane) plan.Desired { return plan.Desired{Services: []plan.Service{service("web", p, vip)}} }
	refused := func(p plan.Plane) plan.Desired {
		d := on(p)
		// An address no interface holds: its add fails, and the reload is refused.
		d.Services = append(d.Services, service("bad", plan.Proxy, netip.MustParseAddrPort("192.0.2.1:80")))
		return d
	}
	goKeepalive := sockfd.Keepalive{On: 1, Idle: 15, Interval: 15, Count: 9}
	// listening checks the options of every listening socket of the server
	// that serves the service on plane p.
	listening := func(when string, p plan.Plane, ka sockfd.Keepalive, ut time.Duration) {
		t.Helper()
		var fds []int
		switch p {
		case plan.Proxy:
			srv, _ := a.proxy.Get("web")
			fds = srv.ListenFDs(vip)
		case plan.HTTP:
			srv, _ := a.http.Get("web")
			fds = srv.ListenFDs(vip)
		}
		if len(fds) == 0 {
			t.Fatalf("%s: the %s plane's server has no listening socket", when, p)
		}
		for _, fd := range fds {
			k, kerr := sockfd.KeepaliveOf(fd)
			u, uerr := sockfd.UserTimeoutOf(fd)
			unix.Close(fd)
			if kerr != nil || uerr != nil {
				t.Fatalf("%s: %v, %v", when, kerr, uerr)
			}
			if ka.On == 0 {
				k = sockfd.Keepalive{On: k.On} // the times of a socket with keepalive off do not count
			}
			if k != ka || u != ut {
				t.Errorf("%s: a listening socket's keepalive, user timeout: got %+v, %v; want %+v, %v", when, k, u, ka, ut)
			}
		}
	}

	prev := on(plan.Proxy)
	if err := a.reconcile(plan.Desired{}, prev); err != nil {
		t.Fatal(err)
	}
	listening("proxy", plan.Proxy, sockfd.Keepalive{}, 0)
	if err := a.reconcile(prev, refused(plan.HTTP)); err == nil {
		t.Fatal("a reload with a service that cannot bind was applied")
	}
	listening("proxy, a move to the http plane refused", plan.Proxy, sockfd.Keepalive{}, 0)

	next := on(plan.HTTP)
	if err := a.reconcile(prev, next); err != nil {
		t.Fatal(err)
	}
	prev = next
	listening("http", plan.HTTP, goKeepalive, httpUT)
	c, err := net.Dial("tcp", vip.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	local := c.LocalAddr().(*net.TCPAddr).AddrPort()
	waitfor.Value(t, 5*time.Second, "the accepted connection's Go keepalive and the http plane's user timeout", func() (any, bool) {
		k, kerr := sockfd.KeepaliveBetween(vip, local)
		u, uerr := sockfd.UserTimeoutBetween(vip, local)
		return [4]any{k, kerr, u, uerr}, kerr == nil && uerr == nil && k == goKeepalive && u == httpUT
	})

	if err := a.reconcile(prev, refused(plan.Proxy)); err == nil {
		t.Fatal("a reload with a service that cannot bind was applied")
	}
	listening("http, a move to the proxy refused", plan.HTTP, goKeepalive, httpUT)
}
