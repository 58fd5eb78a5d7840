package proxyplane

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
	"github.com/weir-lb/weir/userspace/proxy"
)

// noBPFEnv marks the child of TestSockMapOn that runs without the capabilities BPF
// needs.
const noBPFEnv = "WEIR_PROXYPLANE_NO_BPF"

// TestSockMapOn: a service with sockmap: on forwards in the kernel where the host
// lets the agent load BPF, and where it doesn't (a child process whose capability
// bounding set lacks CAP_BPF, CAP_SYS_ADMIN and CAP_PERFMON, as in a container that
// was not granted them) it serves the same through the copy path.
func TestSockMapOn(t *testing.T) {
	if os.Getenv(noBPFEnv) == "1" {
		serveOne(t, false)
		return
	}
	t.Run("with bpf", func(t *testing.T) { serveOne(t, true) })
	t.Run("without bpf", func(t *testing.T) {
		setpriv, err := exec.LookPath("setpriv")
		if err != nil {
			t.Fatalf("setpriv (util-linux, make deps): %v", err)
		}
		exe, err := os.Executable()
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(setpriv, "--bounding-set", "-bpf,-sys_admin,-perfmon", "--",
			exe, "-test.run=^TestSockMapOn$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), noBPFEnv+"=1")
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			t.Fatalf("child without bpf: %v\n%s", err, out.String())
		}
		t.Logf("child:\n%s", out.String())
	})
}

// serveOne runs one proxy service with sockmap: on and checks a round trip through
// it, and which path carried it.
func serveOne(t *testing.T, wantKernel bool) {
	be := churn.Echo(t)
	p := New(&health.Checker{}, slog.New(slog.NewTextHandler(testWriter{t}, nil)))
	defer p.Close()
	s := &plan.Service{
		Config: config.Service{Name: "web", Algorithm: config.AlgorithmLeastConn,
			Proxy: config.Proxy{Listen: netip.MustParseAddrPort("127.0.0.1:0"), ConnectTimeout: time.Second, SockMap: config.SockMapOn}},
		Backends: []plan.Backend{{ID: plan.ID("web", be), Config: config.Backend{Addr: be}, Usable: true, Weight: 1}},
	}
	if err := p.Add(s); err != nil {
		t.Fatalf("add: %v", err)
	}
	before := proxy.Splices()
	// With bpf, a connection whose pairing the kernel refuses is served by the
	// copy path, by design; one in CI's race run under load was. Up to three
	// connections, then, and at least one must have been forwarded in the kernel.
	tries := 1
	if wantKernel {
		tries = 3
	}
	var paired uint64
	for range tries {
		echoThrough(t, mustGet(t, p, "web"))
		if paired = proxy.Splices().Redirected - before.Redirected; paired > 0 {
			break
		}
	}
	after := proxy.Splices()
	if failed := after.RedirectErrs - before.RedirectErrs; failed > 0 {
		t.Logf("%d pairings refused (logged above); those connections took the copy path", failed)
	}
	if wantKernel && (paired != 1 || p.sockmapErr != nil) {
		t.Errorf("with bpf: got %d of %d connections paired, load error %v; want one, none",
			paired, tries, p.sockmapErr)
	}
	if !wantKernel && (paired != 0 || p.sockmapErr == nil) {
		t.Errorf("without bpf: got %d connections paired, load error %v; want 0 and the error", paired, p.sockmapErr)
	}
}

// echoThrough makes one round trip through px to an echo backend.
func echoThrough(t *testing.T, px *proxy.Service) {
	t.Helper()
	c, err := net.Dial("tcp", px.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	msg := []byte("through the proxy")
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	_, err = io.ReadFull(c, got)
	c.Close()
	if err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo: got %q, %v; want %q", got, err, msg)
	}
}

// TestCountersCarriedOver: a service whose listener is replaced (here by a
// change of a setting fixed at listen time) keeps counting from what the old
// listener counted, through its drain and after: Prometheus counters must
// not go back. Before, they went back to zero with every new listener.
func TestCountersCarriedOver(t *testing.T) {
	be := churn.Echo(t)
	p := New(&health.Checker{}, slog.New(slog.DiscardHandler))
	t.Cleanup(p.Close)
	svc := func(connect time.Duration) *plan.Service { return webService(be, connect, time.Second) }
	if err := p.Add(svc(time.Second)); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	echoThrough(t, mustGet(t, p, "web"))
	counted := func() (accepted, connects uint64) {
		snap, _ := p.Snapshot("web")
		for _, b := range snap.Backends {
			connects += b.Connects
		}
		return snap.Accepted, connects
	}
	waitfor.Value(t, 10*time.Second, "1 accepted, 1 connect", func() (any, bool) {
		a, c := counted()
		return fmt.Sprint(a, c), a == 1 && c == 1
	})
	old := mustGet(t, p, "web")
	if err := p.Update(svc(time.Second), svc(2*time.Second)); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	if mustGet(t, p, "web") == old {
		t.Fatal("the change kept the listener; want a new one")
	}
	waitfor.Value(t, 10*time.Second, "the old listener drained, its counts kept", func() (any, bool) {
		a, c := counted()
		if a < 1 || c < 1 {
			t.Fatalf("counters went back: %d accepted, %d connects; want at least 1, 1", a, c)
		}
		return len(p.Draining("web")), len(p.Draining("web")) == 0
	})
	echoThrough(t, mustGet(t, p, "web"))
	waitfor.Value(t, 10*time.Second, "2 accepted, 2 connects", func() (any, bool) {
		a, c := counted()
		return fmt.Sprint(a, c), a == 2 && c == 2
	})
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Logf("%s", b)
	return len(b), nil
}

func mustGet(t *testing.T, p *Plane, name string) *proxy.Service {
	t.Helper()
	px, ok := p.Get(name)
	if !ok {
		t.Fatalf("service %q is not served", name)
	}
	return px
}

// TestHashKey: a maglev service's hash key holds on the proxy as in XDP: with
// hash: 5tuple one client's connections (one address, many ports) spread over the
// backends; with hash: source, which a reload sets in place, they all go to one.
func TestHashKey(t *testing.T) {
	var backends []plan.Backend
	for _, name := range []string{"a", "b", "c"} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, name) }))
		t.Cleanup(srv.Close)
		be := srv.Listener.Addr().(*net.TCPAddr).AddrPort()
		backends = append(backends, plan.Backend{ID: plan.ID("web", be), Config: config.Backend{Addr: be}, Usable: true, Weight: 1})
	}
	p := New(&health.Checker{}, slog.New(slog.NewTextHandler(testWriter{t}, nil)))
	t.Cleanup(p.Close)
	service := func(h config.HashKey) *plan.Service {
		return &plan.Service{
			Config: config.Service{Name: "web", Algorithm: config.AlgorithmMaglev, Hash: h,
				Proxy: config.Proxy{Listen: netip.MustParseAddrPort("127.0.0.1:0"), ConnectTimeout: time.Second}},
			Backends: backends,
		}
	}
	// answered returns the backends that 30 connections from 127.0.0.1 reached.
	answered := func() map[string]int {
		got := map[string]int{}
		client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
		for range 30 {
			resp, err := client.Get("http://" + mustGet(t, p, "web").Addr().String() + "/")
			if err != nil {
				t.Fatal(err)
			}
			name, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatalf("read the backend's name: %v", err)
			}
			got[string(name)]++
		}
		return got
	}
	prev := service(config.HashFiveTuple)
	if err := p.Add(prev); err != nil {
		t.Fatalf("add: %v", err)
	}
	if got := answered(); len(got) < 2 {
		t.Errorf("hash: 5tuple: 30 connections from one address reached %v; want at least 2 backends", got)
	}
	next := service(config.HashSource)
	if err := p.Update(prev, next); err != nil {
		t.Fatalf("update: %v", err)
	}
	if got := answered(); len(got) != 1 {
		t.Errorf("hash: source: 30 connections from one address reached %v; want 1 backend", got)
	}
}

// TestKeepaliveReload: a service's tcp_keepalive and tcp_user_timeout reach
// the proxy's sockets, and a reload that changes them gives the service
// listeners with the new settings: the next connection's sockets have them.
func TestKeepaliveReload(t *testing.T) {
	dialed := make(chan netip.AddrPort, 2)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }))
	srv.Config.ConnState = func(c net.Conn, s http.ConnState) {
		if s == http.StateNew {
			dialed <- c.RemoteAddr().(*net.TCPAddr).AddrPort()
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	be := srv.Listener.Addr().(*net.TCPAddr).AddrPort()
	p := New(&health.Checker{}, slog.New(slog.NewTextHandler(testWriter{t}, nil)))
	t.Cleanup(p.Close)
	service := func(idle time.Duration) *plan.Service {
		side := config.Keepalive{Idle: idle, Interval: 2 * time.Second, Count: 3}
		return &plan.Service{
			Config: config.Service{Name: "web", Algorithm: config.AlgorithmLeastConn, DrainTimeout: 5 * time.Second,
				Proxy: config.Proxy{Listen: netip.MustParseAddrPort("127.0.0.1:0"), ConnectTimeout: time.Second,
					TCPKeepalive:   config.TCPKeepalive{Client: side, Backend: side},
					TCPUserTimeout: config.TCPUserTimeout{Client: idle, Backend: idle}}},
			Backends: []plan.Backend{{ID: plan.ID("web", be), Config: config.Backend{Addr: be}, Usable: true, Weight: 1}},
		}
	}
	// connect opens a connection through the proxy, checks that it is served,
	// and returns the proxy's keepalive idle on its client and its backend
	// socket, in seconds, and their user timeouts, which must be the same.
	connect := func() (int, int) {
		px := mustGet(t, p, "web")
		c, err := net.Dial("tcp", px.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Read(make([]byte, 512)); err != nil {
			t.Fatalf("read the answer: %v", err)
		}
		kc, err := sockfd.KeepaliveBetween(px.Addr(), c.LocalAddr().(*net.TCPAddr).AddrPort())
		if err != nil {
			t.Fatal(err)
		}
		d := <-dialed
		kb, err := sockfd.KeepaliveBetween(d, be)
		if err != nil {
			t.Fatal(err)
		}
		uc, err := sockfd.UserTimeoutBetween(px.Addr(), c.LocalAddr().(*net.TCPAddr).AddrPort())
		if err != nil {
			t.Fatal(err)
		}
		ub, err := sockfd.UserTimeoutBetween(d, be)
		if err != nil {
			t.Fatal(err)
		}
		if uc != time.Duration(kc.Idle)*time.Second || ub != time.Duration(kb.Idle)*time.Second {
			t.Errorf("user timeouts got client %v, backend %v; want the keepalive idle, %ds, %ds", uc, ub, kc.Idle, kb.Idle)
		}
		return kc.Idle * kc.On, kb.Idle * kb.On
	}
	prev := service(5 * time.Second)
	if err := p.Add(prev); err != nil {
		t.Fatalf("add: %v", err)
	}
	client, backend := connect()
	if client != 5 || backend != 5 {
		t.Fatalf("before the reload: keepalive idle got client %ds, backend %ds; want 5s, 5s", client, backend)
	}
	next := service(9 * time.Second)
	if err := p.Update(prev, next); err != nil {
		t.Fatalf("update: %v", err)
	}
	p.Commit()
	// The server the reload replaced accepts on the same listening sockets
	// until it has stopped, just after the commit, and serves a connection
	// it took with its own backend setting: connect until the new server has
	// served one.
	px := mustGet(t, p, "web")
	if !waitfor.Cond(10*time.Second, func() bool {
		accepted := px.Snapshot().Accepted
		client, backend = connect()
		return px.Snapshot().Accepted > accepted
	}) {
		t.Fatal("after the reload: the new server accepted no connection")
	}
	if client != 9 || backend != 9 {
		t.Errorf("after the reload: keepalive idle got client %ds, backend %ds; want 9s, 9s", client, backend)
	}
}

// TestCountersKeptThroughAbortedRemove: a replaced listener that finishes
// draining while a change that removes its service is in progress still has
// its counts kept when that change is aborted (the service stays, so its
// counters must not go back). Before, they were dropped as the service's
// (the removed one's series go).
func TestCountersKeptThroughAbortedRemove(t *testing.T) {
	be := churn.Echo(t)
	p := New(&health.Checker{}, slog.New(slog.DiscardHandler))
	t.Cleanup(p.Close)
	svc := func(connect time.Duration) *plan.Service { return webService(be, connect, time.Minute) }
	if err := p.Add(svc(time.Second)); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	// A connection left open keeps the first listener draining.
	c := echoed(t, p)
	accepted := func() uint64 {
		snap, _ := p.Snapshot("web")
		return snap.Accepted
	}
	if err := p.Update(svc(time.Second), svc(2*time.Second)); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	if n := len(p.Draining("web")); n != 1 {
		t.Fatalf("%d listeners draining after the change; want the first one", n)
	}
	if n := accepted(); n != 1 {
		t.Fatalf("accepted after the change: %d; want 1", n)
	}

	if err := p.Remove(svc(2 * time.Second)); err != nil {
		t.Fatal(err)
	}
	c.Close()
	waitfor.Value(t, 10*time.Second, "the first listener drained", func() (any, bool) {
		n := len(p.Draining("web"))
		return n, n == 0
	})
	p.Abort()
	if n := accepted(); n != 1 {
		t.Errorf("accepted after the removal was aborted: %d; want 1 still", n)
	}
}

// webService is a proxy service "web" on 127.0.0.1 with the one backend be;
// a change of connect calls for a new listener.
func webService(be netip.AddrPort, connect, drain time.Duration) *plan.Service {
	return &plan.Service{
		Config: config.Service{Name: "web", Algorithm: config.AlgorithmLeastConn, DrainTimeout: drain,
			Proxy: config.Proxy{Listen: netip.MustParseAddrPort("127.0.0.1:0"), ConnectTimeout: connect}},
		Backends: []plan.Backend{{ID: plan.ID("web", be), Config: config.Backend{Addr: be}, Usable: true, Weight: 1}},
	}
}

// TestCountersGoWithRemovedService: a removed service's listener that
// finishes draining after the removal is committed leaves no counts behind: the
// service, added again later, counts from zero. Its series went with it.
func TestCountersGoWithRemovedService(t *testing.T) {
	be := churn.Echo(t)
	p := New(&health.Checker{}, slog.New(slog.DiscardHandler))
	t.Cleanup(p.Close)
	svc := webService(be, time.Second, time.Minute)
	if err := p.Add(svc); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	// A connection left open keeps the listener draining past the removal.
	c := echoed(t, p)
	if err := p.Remove(svc); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	c.Close()
	waitfor.Value(t, 10*time.Second, "the removed listener drained", func() (any, bool) {
		n := len(p.Draining("web"))
		return n, n == 0
	})
	if err := p.Add(svc); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	if snap, _ := p.Snapshot("web"); snap.Accepted != 0 {
		t.Errorf("accepted by the service added again: %d; want 0", snap.Accepted)
	}
}

// echoed dials service "web" of p and has a byte echoed: the connection is
// accepted and counted. It is closed at cleanup.
func echoed(t *testing.T, p *Plane) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", mustGet(t, p, "web").Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	return c
}
