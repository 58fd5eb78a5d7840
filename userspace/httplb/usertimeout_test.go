package httplb

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/netpair"
	"github.com/weir-lb/weir/internal/ownnetns"
	"github.com/weir-lb/weir/internal/sockfd"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestUserTimeoutSockets reads back with getsockopt, on the service's accepted
// client socket and on its socket to the backend, the TCP_USER_TIMEOUT each
// engine's connections get: the client's set on the listening socket and
// inherited by the accepted one, the backend's on each dialed one; none when
// not configured.
func TestUserTimeoutSockets(t *testing.T) {
	for _, tc := range []struct {
		name            string
		h2              bool // the client speaks HTTP/2 by prior knowledge, else HTTP/1.1
		netHTTP         bool // net/http's engines serve it
		upstream        Upstream
		listen          string
		client, backend time.Duration
	}{
		{"h1 loop", false, false, UpstreamAuto, "127.0.0.1:0", 7 * time.Second, 11 * time.Second},
		{"h1 loop, IPv6", false, false, UpstreamAuto, "[::1]:0", 7 * time.Second, 11 * time.Second},
		{"h2 frames", true, false, UpstreamAuto, "127.0.0.1:0", 1500 * time.Millisecond, 2 * time.Second},
		{"h2 frames, IPv6", true, false, UpstreamAuto, "[::1]:0", 1500 * time.Millisecond, 2 * time.Second},
		{"h1 net_http", false, true, UpstreamAuto, "127.0.0.1:0", 3 * time.Second, 4 * time.Second},
		{"h2 net_http", true, true, UpstreamAuto, "[::1]:0", 3 * time.Second, 4 * time.Second},
		{"h1 to h2c", false, false, UpstreamH2C, "127.0.0.1:0", 5 * time.Second, 6 * time.Second},
		{"h1 loop off", false, false, UpstreamAuto, "127.0.0.1:0", 0, 0},
		{"h2 frames off", true, false, UpstreamAuto, "[::1]:0", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			s := serve(t, Config{Listen: netip.MustParseAddrPort(tc.listen), Upstream: tc.upstream, NetHTTP1: tc.netHTTP, NetHTTP2: tc.netHTTP,
				ClientUserTimeout: tc.client, BackendUserTimeout: tc.backend}, bs)
			uc, err := sockfd.UserTimeoutBetween(s.Addr().(*net.TCPAddr).AddrPort(), getFrom(t, s, tc.h2))
			if err != nil {
				t.Fatal(err)
			}
			ub, err := sockfd.UserTimeoutBetween(netip.AddrPort{}, bs[0].Addr)
			if err != nil {
				t.Fatal(err)
			}
			if uc != tc.client || ub != tc.backend {
				t.Errorf("got client side %v, backend side %v; want %v, %v", uc, ub, tc.client, tc.backend)
			}
		})
	}
}

// TestUserTimeoutTunnel: a WebSocket tunnel's connection to its backend, which
// the tunnel dials itself, has the backend side's user timeout too.
func TestUserTimeoutTunnel(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{BackendUserTimeout: 2345 * time.Millisecond}, bs)
	wsEchoThrough(t, s)
	// The tunnel's is the only connection to the backend: nothing else was asked.
	fds, err := sockfd.FindAll(netip.AddrPort{}, bs[0].Addr)
	if err != nil || len(fds) != 1 {
		t.Fatalf("sockets to the backend: got %d, %v; want the tunnel's", len(fds), err)
	}
	if d, err := sockfd.UserTimeoutOf(fds[0]); err != nil || d != 2345*time.Millisecond {
		t.Errorf("the tunnel's backend socket: got %v, %v; want 2.345s", d, err)
	}
}

// TestListenFromUserTimeout: a service that takes the listening socket over
// sets its client user timeout on it, turning it off where the old service
// had one, and Reclaim gives the old service's back once the new one is given
// up; accepted sockets inherit what the listening socket has.
func TestListenFromUserTimeout(t *testing.T) {
	for _, tc := range []struct {
		name     string
		old, new time.Duration
	}{{"set to off", 5 * time.Second, 0}, {"off to set", 0, 1500 * time.Millisecond}, {"set to another", time.Second, time.Minute}} {
		t.Run(tc.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			cfg := Config{Name: "old", Listen: netip.MustParseAddrPort("127.0.0.1:0"), ClientUserTimeout: tc.old}
			old := serve(t, cfg, bs)
			addr := old.Addr().(*net.TCPAddr).AddrPort()
			// accepted is the user timeout of a connection the service
			// given accepts.
			accepted := func(s *Service) time.Duration {
				t.Helper()
				c, err := net.Dial("tcp", addr.String())
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				local := c.LocalAddr().(*net.TCPAddr).AddrPort()
				var d time.Duration
				waitfor.Value(t, 5*time.Second, "the accepted socket", func() (any, bool) {
					d, err = sockfd.UserTimeoutBetween(addr, local)
					return err, err == nil
				})
				return d
			}
			if got := accepted(old); got != tc.old {
				t.Errorf("before: got %v; want %v", got, tc.old)
			}
			cfg.Name, cfg.ClientUserTimeout = "new", tc.new // the same Listen: a takeover
			s, err := ListenFrom(cfg, backendSet(bs), old)
			if err != nil {
				t.Fatal(err)
			}
			// The old service still accepts on the socket, now with the new setting.
			if got := accepted(old); got != tc.new {
				t.Errorf("taken over: got %v; want %v", got, tc.new)
			}
			s.Close()
			if err := old.Reclaim(); err != nil {
				t.Fatal(err)
			}
			if got := accepted(old); got != tc.old {
				t.Errorf("reclaimed: got %v; want %v", got, tc.old)
			}
		})
	}
}

// TestUserTimeoutVanishedClient: an answer the service sends to an HTTP/1.1
// client whose host vanished without a FIN or a reset (its link goes down
// while the backend takes its time) stays unacknowledged; with a client user
// timeout the connection ends about that long after, where keepalive would
// not probe (bytes are in flight). Without it, the connection stays.
func TestUserTimeoutVanishedClient(t *testing.T) {
	pair := netpair.New(t)
	release := make(chan struct{})
	be := slowBackend(t, release)
	listenInA := func(cfg Config, bs []Backend) (s *Service, err error) {
		err = pair.A.Do(func() error { s, err = Listen(cfg, bs); return err })
		return s, err
	}
	services := map[string]*Service{}
	for _, name := range []string{"user timeout", "none"} {
		ut := time.Second
		if name == "none" {
			ut = 0
		}
		s := serveStoppableWith(t, Config{Name: name, Listen: netip.AddrPortFrom(pair.AddrA, 0), ClientUserTimeout: ut, DrainTimeout: 100 * time.Millisecond},
			[]Backend{{Addr: be, Weight: 1, Usable: true}}, listenInA).Service
		services[name] = s
		c, err := pair.B.DialWith(context.Background(), &net.Dialer{KeepAlive: -1}, "tcp", s.Addr().String())
		if err != nil {
			t.Fatalf("%s: dial: %v", name, err)
		}
		t.Cleanup(func() { c.Close() })
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		waitfor.Value(t, 5*time.Second, "1 open connection", openConns(s, 1))
	}
	pair.CutB(t)
	start := time.Now()
	close(release) // the answers go to the vanished client
	netpair.Outlived(t, start, func() int64 { return services["user timeout"].Snapshot().Connections },
		func() int64 { return services["none"].Snapshot().Connections })
}

// slowBackend is an HTTP backend on loopback whose every answer waits for
// release to be closed.
func slowBackend(t *testing.T, release <-chan struct{}) netip.AddrPort {
	t.Helper()
	return startServer(t, &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		io.WriteString(w, "late")
	}), ReadHeaderTimeout: 10 * time.Second})
}

// startServer serves srv on loopback until the test ends.
func startServer(t *testing.T, srv *http.Server) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	// Exits when the cleanup closes srv.
	go func() {
		defer close(done)
		srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// TestUserTimeoutVanishedBackend: a request the service sends to a backend
// whose host vanished (nftables drops every packet to and from its port) on
// a pooled connection stays unacknowledged; with a backend user timeout the
// connection fails about that long after and the client is answered 504 in
// seconds (the try timed out; there is no other backend), where without it
// the request still waits a second after that.
//
// In a network namespace of its own, for its nftables rules.
func TestUserTimeoutVanishedBackend(t *testing.T) {
	if !ownnetns.In(t, nil) {
		return
	}
	bs := httpbackend.StartN(t, 1)
	rec := &outcomeLog{}
	type answer struct {
		status int
		err    error
	}
	answers := map[string]chan answer{}
	clients := map[string]*http.Client{}
	services := map[string]*Service{}
	for _, name := range []string{"user timeout", "none"} {
		ut := time.Second
		if name == "none" {
			ut = 0
		}
		services[name] = serve(t, Config{Name: name, BackendUserTimeout: ut, Observer: rec, DrainTimeout: 100 * time.Millisecond}, bs)
		clients[name] = h1Client()
		clients[name].Timeout = 30 * time.Second
		t.Cleanup(clients[name].CloseIdleConnections)
		// A first request opens the pooled connection to the backend.
		if resp, _ := get(t, clients[name], "http://"+services[name].Addr().String()+"/"); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: got %s; want 200", name, resp.Status)
		}
	}
	netpair.DropPort(t, bs[0].Addr.Port())
	start := time.Now()
	for name, c := range clients {
		// The goroutine sends on its own channel: the map is this
		// goroutine's, which writes it as the loop goes on.
		ch := make(chan answer, 1)
		answers[name] = ch
		url := "http://" + services[name].Addr().String() + "/"
		// Exits when the request is answered or the client's timeout ends it.
		go func() {
			resp, err := c.Get(url)
			if err != nil {
				ch <- answer{err: err}
				return
			}
			resp.Body.Close()
			ch <- answer{status: resp.StatusCode}
		}()
	}
	select {
	case a := <-answers["user timeout"]:
		t.Logf("the service with a user timeout answered %v after the backend went", time.Since(start).Round(time.Millisecond))
		if a.status != http.StatusGatewayTimeout {
			t.Errorf("the service with a user timeout: got %d, %v; want 504", a.status, a.err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the service with a user timeout: no answer 20s after the backend went")
	}
	select {
	case a := <-answers["none"]:
		t.Errorf("the service without one, %v after the backend went: got %d, %v; want no answer yet",
			time.Since(start).Round(time.Millisecond), a.status, a.err)
	case <-time.After(time.Second):
	}
	t.Logf("observed: %q", rec.get())
}

// TestUserTimeoutPooledIsFailedTry: a request sent on a pooled HTTP/1.1
// connection to a backend that went silent (nftables drops every packet to
// and from its port) fails by the backend user timeout, with ETIMEDOUT. That
// is no stale connection the backend closed: the try is counted against the
// backend (a timeout, for passive health) and the request is retried on the
// other backend, not sent again on a new connection to the silent one (whose
// dial would count a connect failure instead, and the broken try nothing).
//
// In a network namespace of its own, for its nftables rules.
func TestUserTimeoutPooledIsFailedTry(t *testing.T) {
	if !ownnetns.In(t, nil) {
		return
	}
	bs := httpbackend.StartN(t, 2)
	rec := &outcomeLog{}
	s := serve(t, Config{Algorithm: "round_robin", Retries: 1, RetryBudget: 1, BackendUserTimeout: time.Second, Observer: rec}, bs)
	c := h1Client()
	c.Timeout = 30 * time.Second
	t.Cleanup(c.CloseIdleConnections)
	url := "http://" + s.Addr().String() + "/"
	// A connection to each backend in its pool.
	for range 2 {
		if resp, _ := get(t, c, url); resp.StatusCode != http.StatusOK {
			t.Fatalf("got %s; want 200", resp.Status)
		}
	}
	silent := bs[0].Addr
	netpair.DropPort(t, silent.Port())
	before := len(rec.of(silent))
	// Round robin sends one of two requests to the silent backend.
	for i := 0; i < 2 && len(rec.of(silent)) == before; i++ {
		resp, body := get(t, c, url)
		if resp.StatusCode != http.StatusOK || !strings.Contains(body, bs[1].Name) {
			t.Errorf("request %d: got %s %q; want 200 from %s", i, resp.Status, body, bs[1].Name)
		}
	}
	if got := rec.of(silent)[before:]; len(got) != 1 || got[0] != Timeout {
		t.Errorf("the silent backend's tries: got %v; want [%v]: one failed try, on its pooled connection", got, Timeout)
	}
}

// TestUserTimeoutFramesVanishedBackend: the frame engine's connection to a
// backend that went silent (nftables drops every packet to and from its
// port) fails by the backend user timeout, with ETIMEDOUT, as a pooled
// HTTP/1.1 connection does (TestUserTimeoutPooledIsFailedTry), and counts the
// same: the try is a timeout for passive health, and with no other backend
// the client is answered 504, not 502 as for a backend that reset it.
//
// In a network namespace of its own, for its nftables rules.
func TestUserTimeoutFramesVanishedBackend(t *testing.T) {
	if !ownnetns.In(t, nil) {
		return
	}
	silentFramesTry(t, nil)
}

// silentFramesTry sends a request, with body if not nil, on the frame
// engine's connection to a backend that has gone silent, and checks that the
// try is one timeout and the client is answered 504.
func silentFramesTry(t *testing.T, body io.Reader) {
	t.Helper()
	bs := httpbackend.StartN(t, 1)
	rec := &outcomeLog{}
	s := serve(t, Config{BackendUserTimeout: time.Second, Observer: rec}, bs)
	c := h2cClient()
	c.Timeout = 30 * time.Second
	t.Cleanup(c.CloseIdleConnections)
	url := "http://" + s.Addr().String() + "/"
	// The frame engine's connection to the backend, kept for the next.
	if resp, _ := get(t, c, url); resp.StatusCode != http.StatusOK {
		t.Fatalf("got %s; want 200", resp.Status)
	}
	silent := bs[0].Addr
	netpair.DropPort(t, silent.Port())
	before := len(rec.of(silent))
	method := http.MethodGet
	if body != nil {
		method = http.MethodPost
	}
	req, _ := http.NewRequest(method, url, body)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusGatewayTimeout {
		t.Errorf("got %s; want 504", resp.Status)
	}
	if got := rec.of(silent)[before:]; len(got) != 1 || got[0] != Timeout {
		t.Errorf("the silent backend's tries: got %v; want [%v]", got, Timeout)
	}
}

// TestUserTimeoutFramesVanishedUpload is TestUserTimeoutFramesVanishedBackend
// with a request body streaming to the backend: the queue to the silent
// backend's socket fills (its send buffer kept small, so it does at once), and
// the connection's writer waits on the socket beside its reader. The kernel
// tells the user timeout (ETIMEDOUT) to whichever of the two asks first, the
// other finds the socket closed; either way the try is a timeout and the
// client is answered 504.
//
// In a network namespace of its own, for its nftables rules and send buffers.
func TestUserTimeoutFramesVanishedUpload(t *testing.T) {
	if !ownnetns.In(t, map[string]string{"net.ipv4.tcp_wmem": "4096 16384 65536"}) {
		return
	}
	// Several rounds, each with a backend and a connection to it of its own:
	// which side of the connection hears of the timeout first is the
	// scheduler's choice.
	for i := range 3 {
		t.Run(fmt.Sprint("round_", i), func(t *testing.T) { silentFramesTry(t, zeros{}) })
	}
}

// TestFramesVanishedAfterHead: a backend that sent an answer's headers and
// then went silent, its connection failing by keepalive (ETIMEDOUT), broke
// its answer off: a reset for passive health, as a body cut off on an
// HTTP/1.1 connection is, not a timeout, although the frame engine still held
// the headers back (a body of known length waits for its first bytes, so the
// request can go elsewhere) and retries it on the other backend.
//
// In a network namespace of its own, for its nftables rules.
func TestFramesVanishedAfterHead(t *testing.T) {
	if !ownnetns.In(t, nil) {
		return
	}
	headSent := make(chan struct{}, 1)
	silent, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "10")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case headSent <- struct{}{}:
		default:
		}
		<-r.Context().Done()
	})
	other, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "other") })
	rec := &outcomeLog{}
	s := serveOn(t, Config{Algorithm: "round_robin", Retries: 1, RetryBudget: 1, Observer: rec, BackendUserTimeout: time.Second,
		BackendKeepalive: net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 1}},
		[]Backend{silent, other})
	c := h2cClient()
	c.Timeout = 30 * time.Second
	t.Cleanup(c.CloseIdleConnections)
	url := "http://" + s.Addr().String() + "/"
	type answer struct {
		status int
		body   string
		err    error
	}
	// Round robin sends one of two requests to the silent backend.
	for i := range 2 {
		answers := make(chan answer, 1)
		// Exits when the request is answered, or by the client's timeout.
		go func() {
			resp, err := c.Get(url)
			if err != nil {
				answers <- answer{err: err}
				return
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			answers <- answer{resp.StatusCode, string(body), err}
		}()
		select {
		case a := <-answers:
			if a.err != nil || a.status != http.StatusOK || a.body != "other" {
				t.Fatalf("request %d: got %d %q, %v; want 200 from the other backend", i, a.status, a.body, a.err)
			}
			continue
		case <-headSent:
		case <-time.After(20 * time.Second):
			t.Fatalf("request %d: no answer, nor headers from the silent backend, in 20s", i)
		}
		netpair.DropPort(t, silent.Addr.Port())
		a := <-answers
		if a.err != nil || a.status != http.StatusOK || a.body != "other" {
			t.Errorf("got %d %q, %v; want 200 from the other backend, the request tried again there", a.status, a.body, a.err)
		}
		if got := rec.of(silent.Addr); len(got) != 1 || got[0] != Reset {
			t.Errorf("the silent backend's tries: got %v; want [%v]: its answer broken off", got, Reset)
		}
		return
	}
	t.Fatal("neither of two requests went to the silent backend")
}

// TestUserTimeoutTransportPaths is TestUserTimeoutPooledIsFailedTry for the
// requests that go to their backend through http.Transport: a body that
// streams (no length, so not whole with the head), an HTTP/1.1 client's
// request to an h2c upstream, an HTTP/2 client's to an HTTP/1.1 upstream,
// and net/http's engines. The request goes on a pooled connection to a
// backend that went silent (nftables drops every packet to and from its
// port) and fails by the backend user timeout, with ETIMEDOUT: the try is a
// timeout for passive health, and the request is retried on the other
// backend where a retry is allowed, else answered 504.
//
// In a network namespace of its own, for its nftables rules.
func TestUserTimeoutTransportPaths(t *testing.T) {
	if !ownnetns.In(t, nil) {
		return
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		h2   bool // the client speaks HTTP/2 by prior knowledge, else HTTP/1.1
		body bool // a PUT whose body streams (no length given), else a GET
	}{
		{"h1 streamed body", Config{}, false, true},
		{"h1 to h2c", Config{Upstream: UpstreamH2C}, false, false},
		{"h2 to http1", Config{Upstream: UpstreamHTTP1}, true, true},
		{"h1 net_http", Config{NetHTTP1: true}, false, true},
		{"h2 net_http", Config{NetHTTP2: true}, true, false},
	} {
		for _, retries := range []int{0, 1} {
			t.Run(fmt.Sprintf("%s, retries %d", tc.name, retries), func(t *testing.T) {
				bs := httpbackend.StartN(t, 2)
				rec := &outcomeLog{}
				cfg := tc.cfg
				cfg.Algorithm, cfg.Retries, cfg.RetryBudget, cfg.BackendUserTimeout, cfg.Observer = "round_robin", retries, 1, time.Second, rec
				s := serve(t, cfg, bs)
				c := slowPathClient(t, tc.h2)
				url := "http://" + s.Addr().String() + "/"
				ask := func() (int, string) {
					method := http.MethodGet
					var body io.Reader
					if tc.body {
						method, body = http.MethodPut, io.NopCloser(strings.NewReader("streamed"))
					}
					req, _ := http.NewRequest(method, url, body)
					resp, err := c.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					b, err := io.ReadAll(resp.Body)
					resp.Body.Close()
					if err != nil {
						t.Fatal(err)
					}
					return resp.StatusCode, string(b)
				}
				// A connection to each backend in its pool.
				for range 2 {
					if status, body := ask(); status != http.StatusOK {
						t.Fatalf("got %d %q; want 200", status, body)
					}
				}
				silent := bs[0].Addr
				netpair.DropPort(t, silent.Port())
				before := len(rec.of(silent))
				// Round robin sends one of two requests to the silent backend.
				for i := 0; i < 2 && len(rec.of(silent)) == before; i++ {
					status, body := ask()
					switch {
					case len(rec.of(silent)) == before || retries > 0:
						if status != http.StatusOK || body != bs[1].Name {
							t.Errorf("request %d: got %d %q; want 200 from %s", i, status, body, bs[1].Name)
						}
					case status != http.StatusGatewayTimeout:
						t.Errorf("request %d: got %d %q; want 504", i, status, body)
					}
				}
				if got := rec.of(silent)[before:]; len(got) != 1 || got[0] != Timeout {
					t.Errorf("the silent backend's tries: got %v; want [%v]", got, Timeout)
				}
			})
		}
	}
}

// TestUserTimeoutTransportUpload is TestUserTimeoutTransportPaths with a
// body that never ends streaming to the silent backend on a pooled
// connection: the socket's send buffer (kept small) fills at once, and the
// transport's writer waits on the socket beside its reader. The kernel tells
// the user timeout (ETIMEDOUT) to whichever of the two asks first, the other
// finds the socket closed; either way the try is a timeout and the client is
// answered 504 (the body, past what a retry keeps, goes nowhere else).
//
// In a network namespace of its own, for its nftables rules and send buffers.
func TestUserTimeoutTransportUpload(t *testing.T) {
	if !ownnetns.In(t, map[string]string{"net.ipv4.tcp_wmem": "4096 16384 65536"}) {
		return
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		h2   bool // the client speaks HTTP/2 by prior knowledge, else HTTP/1.1
	}{
		{"h1", Config{}, false},
		{"h1 to h2c", Config{Upstream: UpstreamH2C}, false},
		{"h2 to http1", Config{Upstream: UpstreamHTTP1}, true},
		{"h1 net_http", Config{NetHTTP1: true}, false},
		{"h2 net_http", Config{NetHTTP2: true}, true},
	} {
		// Several rounds, each with a backend and a connection to it of its
		// own: which side of the connection hears of the timeout first is
		// the scheduler's choice.
		for i := range 3 {
			t.Run(fmt.Sprintf("%s, round %d", tc.name, i), func(t *testing.T) {
				bs := httpbackend.StartN(t, 1)
				rec := &outcomeLog{}
				cfg := tc.cfg
				cfg.BackendUserTimeout, cfg.Observer = time.Second, rec
				s := serve(t, cfg, bs)
				c := slowPathClient(t, tc.h2)
				url := "http://" + s.Addr().String() + "/"
				put := func(body io.Reader) int {
					req, _ := http.NewRequest(http.MethodPut, url, body)
					resp, err := c.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					return resp.StatusCode
				}
				// The pooled connection, on the path the upload takes.
				if status := put(io.NopCloser(strings.NewReader("first"))); status != http.StatusOK {
					t.Fatalf("got %d; want 200", status)
				}
				silent := bs[0].Addr
				netpair.DropPort(t, silent.Port())
				before := len(rec.of(silent))
				status := 0
				if tc.h2 {
					status = put(io.NopCloser(zeros{}))
				} else {
					status = uploadH1(t, s.Addr().String())
				}
				if status != http.StatusGatewayTimeout {
					t.Errorf("got %d; want 504", status)
				}
				if got := rec.of(silent)[before:]; len(got) != 1 || got[0] != Timeout {
					t.Errorf("the silent backend's tries: got %v; want [%v]", got, Timeout)
				}
			})
		}
	}
}

// uploadH1 sends a PUT to addr over HTTP/1.1 whose chunked body goes on
// until the connection fails, and returns the answer's status. The body is
// written beside the read of the answer, which may come before the body's
// end (Go's client would report its write failing instead, once weir closes
// the connection after the answer).
func uploadH1(t *testing.T, addr string) int {
	t.Helper()
	c, br := rawConn(t, addr)
	c.SetDeadline(time.Now().Add(30 * time.Second))
	chunk := append([]byte("4000\r\n"), make([]byte, 0x4000)...)
	chunk = append(chunk, "\r\n"...)
	// Exits when a write fails: weir closed the connection, or the test's
	// cleanup did.
	go func() {
		if _, err := io.WriteString(c, "PUT / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"); err != nil {
			return
		}
		for {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
	}()
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("read the answer: %v", err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// slowPathClient is a client that speaks HTTP/2 by prior knowledge if h2,
// else HTTP/1.1, and waits long enough for a user timeout to end a request.
func slowPathClient(t *testing.T, h2 bool) *http.Client {
	c := h1Client()
	if h2 {
		c = h2cClient()
	}
	c.Timeout = 30 * time.Second
	t.Cleanup(c.CloseIdleConnections)
	return c
}
