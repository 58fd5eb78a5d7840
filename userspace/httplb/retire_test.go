package httplb

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/balance"
)

// upstreamPools are the ways a request reaches a backend, one per pool of
// upstream connections: the HTTP/1.1 exchange of requests without a body or
// with a short one sent whole (h1Pool), http.Transport for HTTP/1.1 requests
// with a body streamed, Go's HTTP/2 transport for HTTP/1.1 clients' requests
// to an h2c backend and for HTTP/2 clients served by net/http, and the frame
// engine's own pool.
var upstreamPools = []upstreamPool{
	{"HTTP/1.1 without a body", Config{}, h1Client, "GET", false},
	{"HTTP/1.1 with a short body", Config{}, h1Client, "POST", false},
	{"HTTP/1.1 with a streamed body", Config{}, h1Client, "POST", true},
	{"HTTP/1.1 client to h2c", Config{Upstream: UpstreamH2C}, h1Client, "POST", false},
	{"HTTP/2 client through net/http", Config{Upstream: UpstreamH2C, NetHTTP2: true}, h2cClient, "GET", false},
	{"HTTP/2 client through the frame engine", Config{Upstream: UpstreamH2C}, h2cClient, "POST", false},
}

type upstreamPool struct {
	name   string
	cfg    Config
	client func() *http.Client
	method string
	stream bool // the body goes chunked, of a length not known ahead
}

// start serves cfg (the pool's, amended) over a holding backend, and returns
// the service, the backend, a client and the service's URL.
func (p upstreamPool) start(t *testing.T, cfg Config) (*served, *holdingBackend, *http.Client, string) {
	t.Helper()
	be := startHoldingBackend(t)
	sv := serveStoppable(t, cfg, []Backend{{Addr: be.addr, Weight: 1, Usable: true}})
	t.Cleanup(be.letGo)
	c := p.client()
	t.Cleanup(c.CloseIdleConnections)
	return sv, be, c, "http://" + sv.Addr().String()
}

// sendOK sends the pool's request to url+"/" and fails the test unless it is
// answered 200 ok.
func (p upstreamPool) sendOK(t *testing.T, c *http.Client, url string) {
	t.Helper()
	if code, body, err := sendBody(c, p.method, url+"/", p.stream); err != nil || code != http.StatusOK || body != "ok" {
		t.Fatalf("%s /: %d %q %v; want 200 ok", p.method, code, body, err)
	}
}

// holdingBackend is a counting backend whose /slow requests wait, once they
// have come whole, until letGo (or weir breaks them off); anything else is
// answered "ok" at once.
type holdingBackend struct {
	*countingBackend
	entered chan struct{} // a /slow request has come
	release chan struct{} // closed by letGo: /slow requests answer
	once    sync.Once
}

const slowAnswer = "the slow answer, whole"

func startHoldingBackend(t *testing.T) *holdingBackend {
	t.Helper()
	b := &holdingBackend{entered: make(chan struct{}, 16), release: make(chan struct{})}
	b.countingBackend = startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.URL.Path != "/slow" {
			io.WriteString(w, "ok")
			return
		}
		b.entered <- struct{}{}
		select {
		case <-b.release:
			io.WriteString(w, slowAnswer)
		case <-r.Context().Done(): // weir broke it off
		case <-time.After(20 * time.Second):
		}
	}, 0)
	return b
}

// waitAllClosed fails the test unless every connection to b is closed within
// 5 s (weir's pools would keep an idle one for 90 s).
func (b *holdingBackend) waitAllClosed(t *testing.T) {
	t.Helper()
	waitfor.Value(t, 5*time.Second, "no connection open to the backend", func() (any, bool) {
		n := b.open.Load()
		return n, n == 0
	})
}

// letGo has the /slow requests answer; idempotent. Call it by a t.Cleanup
// registered after the service's too, so a drain does not wait on it.
func (b *holdingBackend) letGo() { b.once.Do(func() { close(b.release) }) }

// send sends a request to url with a short body if method takes one, and
// returns the answer's status and body ("" and the error if it failed).
func send(c *http.Client, method, url string) (int, string, error) {
	return sendBody(c, method, url, false)
}

// sendBody is send, with the body chunked (its length not known ahead) if
// stream.
func sendBody(c *http.Client, method, url string, stream bool) (int, string, error) {
	var body io.Reader
	if method == "POST" || method == "PUT" {
		body = strings.NewReader("a request body")
		if stream {
			body = struct{ io.Reader }{body}
		}
	}
	req, err := http.NewRequest(method, url, body)
	if err != nil {
		return 0, "", err
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// sendHeld starts the pool's /slow request and returns once the backend has it; the
// answer comes on the channel when the backend is let go.
func (p upstreamPool) sendHeld(t *testing.T, c *http.Client, url string, be *holdingBackend) <-chan string {
	t.Helper()
	answer := make(chan string, 1)
	// Exits when the request is answered or fails: the backend answers at
	// the latest 20s after it came.
	go func() {
		code, body, err := sendBody(c, p.method, url+"/slow", p.stream)
		if err != nil {
			answer <- err.Error()
			return
		}
		answer <- http.StatusText(code) + " " + body
	}()
	select {
	case <-be.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the slow request did not reach the backend in 10s")
	}
	return answer
}

// TestRemovedBackendConnectionsClose: a backend a reload removes while a
// request is in flight on it, directly or after a drain, or whose service is
// removed, has every upstream connection to it closed once that request ends
// (and the request gets its whole answer), whatever the pool the request went
// through; a removed backend's connections do not wait for the pools' idle
// timeout (90 s) to close.
func TestRemovedBackendConnectionsClose(t *testing.T) {
	removals := []struct {
		name   string
		remove func(t *testing.T, sv *served, gone, other Backend)
	}{
		{"reload without it", func(t *testing.T, sv *served, gone, other Backend) {
			if err := sv.SetBackends([]Backend{other}); err != nil {
				t.Fatal(err)
			}
		}},
		{"drained then removed", func(t *testing.T, sv *served, gone, other Backend) {
			gone.Usable, gone.Draining = false, true
			if err := sv.SetBackends([]Backend{gone, other}); err != nil {
				t.Fatal(err)
			}
			if err := sv.SetBackends([]Backend{other}); err != nil {
				t.Fatal(err)
			}
		}},
		{"service removed", func(t *testing.T, sv *served, gone, other Backend) { sv.stop() }},
	}
	for _, p := range upstreamPools {
		for _, rm := range removals {
			t.Run(p.name+"/"+rm.name, func(t *testing.T) {
				sv, be, c, url := p.start(t, p.cfg)
				other := startHoldingBackend(t)
				// An idle pooled connection besides the one the held request
				// takes, where the pool has one per request.
				p.sendOK(t, c, url)
				answer := p.sendHeld(t, c, url, be)
				rm.remove(t, sv, Backend{Addr: be.addr, Weight: 1, Usable: true}, Backend{Addr: other.addr, Weight: 1, Usable: true})
				be.letGo()
				if got, want := <-answer, "OK "+slowAnswer; got != want {
					t.Fatalf("the request in flight on the removed backend got %q; want %q", got, want)
				}
				be.waitAllClosed(t)
			})
		}
	}
}

// TestReaddedBackendKeepsConnections: a backend removed while a request is
// in flight on it and configured again before the request ends keeps the
// connections it has once the request ends, through the requests after.
func TestReaddedBackendKeepsConnections(t *testing.T) {
	for _, p := range upstreamPools {
		t.Run(p.name, func(t *testing.T) {
			sv, be, c, url := p.start(t, p.cfg)
			other := startHoldingBackend(t)
			back := []Backend{{Addr: be.addr, Weight: 1, Usable: true}}
			answer := p.sendHeld(t, c, url, be)
			if err := sv.SetBackends([]Backend{{Addr: other.addr, Weight: 1, Usable: true}}); err != nil {
				t.Fatal(err)
			}
			if err := sv.SetBackends(back); err != nil {
				t.Fatal(err)
			}
			// A connection of the backend configured again: the request
			// in flight must not take it down when it ends.
			p.sendOK(t, c, url)
			be.letGo()
			if got, want := <-answer, "OK "+slowAnswer; got != want {
				t.Fatalf("the request in flight across the removal got %q; want %q", got, want)
			}
			// Its end is all done (the plane's bookkeeping too) before the
			// next requests.
			waitfor.Value(t, 5*time.Second, "no request in flight", func() (any, bool) {
				n := sv.stats.inflight.Load()
				return n, n == 0
			})
			kept := be.openConns()
			if len(kept) == 0 {
				t.Fatal("no connection open to the backend configured again once the request in flight ended; want its pooled ones kept")
			}
			for range 3 {
				p.sendOK(t, c, url)
			}
			// Those that carried a request are kept. (Go's HTTP/2
			// transport, after the close of its idle connections at the
			// removal, may dial one for a request to come that it closes
			// unused, its own pool having one that can take the request.)
			now := be.openConns()
			for conn, used := range kept {
				if used && !now[conn] {
					t.Errorf("connection from %s closed; want it kept", conn.RemoteAddr())
				}
			}
		})
	}
}

// TestStoppedServiceConnectionsClose: a service stopped while a request
// waits on a backend past the drain timeout breaks the request off, and once
// Serve has returned no connection to the backend is left open, whatever the
// pool the request went through. Serve leaves nothing to do it later: when it
// returns, no connection of Go's HTTP/2 transport is open and no timer is
// armed to look for one (before, a timer looked again for up to 2.55 s).
func TestStoppedServiceConnectionsClose(t *testing.T) {
	for _, p := range upstreamPools {
		t.Run(p.name, func(t *testing.T) {
			cfg := p.cfg
			cfg.DrainTimeout = 200 * time.Millisecond
			sv, be, c, url := p.start(t, cfg)
			p.sendOK(t, c, url)
			answer := p.sendHeld(t, c, url, be)
			sv.stop()
			<-sv.done
			if left := leftBehind(sv.Service); left != "" {
				t.Errorf("once Serve returned: %s; want nothing left to close", left)
			}
			if got := <-answer; strings.HasSuffix(got, slowAnswer) {
				t.Fatalf("the request held past the drain timeout got %q; want it broken off", got)
			}
			be.waitAllClosed(t)
		})
	}
}

// TestRefusedOnRemovedBackendGoesElsewhere: a request whose stream a backend
// leaves unprocessed (its GOAWAY) after a reload has removed it goes to
// another backend, as the same try (no retry is allowed here), and the
// removed backend gets no new connection: through the frame engine, and
// through Go's HTTP/2 transport, which sends such a request again itself.
// Before, it went again to the removed backend, on a connection dialled for
// it. A reload that also changes the algorithm leaves the request the old
// balancer, which knows only the removed backend: the other is still found,
// in the balancer in force.
func TestRefusedOnRemovedBackendGoesElsewhere(t *testing.T) {
	reloads := []struct {
		name   string
		reload func(sv *served, bs []Backend) error
	}{
		{"removed", func(sv *served, bs []Backend) error { return sv.SetBackends(bs) }},
		{"removed with the algorithm changed", func(sv *served, bs []Backend) error {
			cfg := sv.cfg
			cfg.Algorithm = balance.RoundRobin
			return sv.Reconfigure(cfg, bs)
		}},
	}
	for _, p := range refusedPools {
		for _, rl := range reloads {
			t.Run(p.name+"/"+rl.name, func(t *testing.T) {
				other := startHoldingBackend(t)
				got := refusedOnRemoved(t, p, nil, func(sv *served) error {
					return rl.reload(sv, []Backend{{Addr: other.addr, Weight: 1, Usable: true}})
				})
				if got != "200 ok <nil>" {
					t.Fatalf("GET the removed backend refused: %s; want 200 ok <nil> from the other", got)
				}
			})
		}
	}
}

// TestRefusedOnRemovedBackendKeepsHashInForce: when the reload that removed
// the backend also turned on hashing by a header, the request the removed
// backend refused goes to the backend its header's hash chooses, as the
// requests after the reload with that header do. Before, it was picked with
// the key of the configuration it started in, which hashed nothing (key 0):
// it went to the backend of key 0, as did every other request caught so.
func TestRefusedOnRemovedBackendKeepsHashInForce(t *testing.T) {
	for _, p := range refusedPools {
		t.Run(p.name, func(t *testing.T) {
			var bs []Backend
			for _, name := range []string{"a", "b"} {
				be := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, name) }, 0)
				bs = append(bs, Backend{Addr: be.addr, Weight: 1, Usable: true})
			}
			p.cfg.Algorithm = balance.RoundRobin
			hashed := p.cfg
			hashed.Algorithm, hashed.Hash, hashed.HashName = balance.Maglev, HashHeader, "X-User"
			user, want := userOffKeyZero(t, hashed, bs)
			hdr := http.Header{"X-User": {user}}
			var url string
			got := refusedOnRemoved(t, p, hdr, func(sv *served) error {
				url = "http://" + sv.Addr().String() + "/"
				hashed.Name, hashed.Listen = sv.cfg.Name, sv.cfg.Listen
				return sv.Reconfigure(hashed, bs)
			})
			if got != "200 "+want+" <nil>" {
				t.Errorf("GET for %s the removed backend refused: %s; want 200 %s <nil>, from the backend of its hash", user, got, want)
			}
			c := p.client()
			t.Cleanup(c.CloseIdleConnections)
			if g := sendWith(c, url, hdr); g != "200 "+want+" <nil>" {
				t.Errorf("GET for %s after the reload: %s; want 200 %s <nil>", user, g, want)
			}
		})
	}
}

// refusedPools are the ways to a backend where a request it refused after
// its removal goes to another.
var refusedPools = []upstreamPool{
	{"HTTP/2 client through the frame engine", Config{Upstream: UpstreamH2C}, h2cClient, "GET", false},
	{"HTTP/2 client through net/http", Config{Upstream: UpstreamH2C, NetHTTP2: true}, h2cClient, "GET", false},
	{"HTTP/1.1 client to h2c", Config{Upstream: UpstreamH2C}, h1Client, "GET", false},
}

// userOffKeyZero returns a value of the header cfg hashes whose backend
// among bs (named by what it answers, "a" and the next letters in order) is
// not the backend of key 0.
func userOffKeyZero(t *testing.T, cfg Config, bs []Backend) (user, name string) {
	t.Helper()
	pick, names := namedPicks(t, cfg, bs)
	zero := pick(0)
	for i := range 100 {
		user = fmt.Sprint("user", i)
		if id := pick(fnv1a(user)); id != zero {
			return user, names[id]
		}
	}
	t.Fatalf("no user of 100 is off the backend of key 0")
	return "", ""
}

// refusedOnRemoved sends a GET with hdr to a service of p's configuration
// whose one backend holds it until reload has run, then refuses it
// (GOAWAY). It returns the answer, "code body error", and fails the test if
// the removed backend took a second connection.
func refusedOnRemoved(t *testing.T, p upstreamPool, hdr http.Header, reload func(*served) error) string {
	t.Helper()
	came, refuse := make(chan struct{}, 1), make(chan struct{})
	var conns atomic.Int32
	gone := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
		conns.Add(1)
		readBackendFrames(fr, func(f *http2.HeadersFrame) {
			select {
			case came <- struct{}{}:
			default:
			}
			<-refuse
			fr.WriteGoAway(0, http2.ErrCodeNo, nil)
		}, func(string) bool { return true })
	})
	sv := serveStoppable(t, p.cfg, []Backend{{Addr: gone, Weight: 1, Usable: true}})
	letRefuse := closeOnce(refuse)
	t.Cleanup(letRefuse) // before the service's drain
	c := p.client()
	t.Cleanup(c.CloseIdleConnections)
	got := sendAsync(c, "http://"+sv.Addr().String()+"/", hdr)
	awaitCame(t, came)
	if err := reload(sv); err != nil {
		t.Fatal(err)
	}
	letRefuse()
	g := <-got
	if n := conns.Load(); n != 1 {
		t.Errorf("the removed backend accepted %d connections; want 1, none after its removal", n)
	}
	return g
}

// sendAsync is sendWith from a goroutine of its own; the answer comes on the
// channel.
func sendAsync(c *http.Client, url string, hdr http.Header) <-chan string {
	got := make(chan string, 1)
	// Exits when the request is answered or fails (the client's timeout).
	go func() { got <- sendWith(c, url, hdr) }()
	return got
}

// awaitCame fails the test unless came has a value within 10 s: a backend
// has the request.
func awaitCame(t *testing.T, came <-chan struct{}) {
	t.Helper()
	select {
	case <-came:
	case <-time.After(10 * time.Second):
		t.Fatal("the request did not reach the backend in 10s")
	}
}

// sendWith sends a GET with hdr to url and returns the answer as "code body
// error".
func sendWith(c *http.Client, url string, hdr http.Header) string {
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		return fmt.Sprint(0, " ", err)
	}
	if hdr != nil {
		req.Header = hdr
	}
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Sprint(0, " ", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return fmt.Sprint(resp.StatusCode, " ", string(b), " ", err)
}

// endingH2Backend is a raw HTTP/2 backend that passes each HEADERS to
// headers with its connection's number (the first is 1); the channel gets
// how the first connection numbered from or later ended: the first of
// readBackendFrames' reports there other than "PING answered".
func endingH2Backend(t *testing.T, from int32, headers func(n int32, fr *http2.Framer, f *http2.HeadersFrame)) (netip.AddrPort, <-chan string) {
	t.Helper()
	var conns atomic.Int32
	end := make(chan string, 1)
	be := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
		n := conns.Add(1)
		readBackendFrames(fr, func(f *http2.HeadersFrame) { headers(n, fr, f) }, func(what string) bool {
			if n < from || what == "PING answered" {
				return true
			}
			select {
			case end <- what:
			default:
			}
			return false
		})
	})
	return be, end
}

// closeOnce returns a function that closes ch the first time it is called.
func closeOnce(ch chan struct{}) func() {
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

// sendHeldRaw sends a GET to sv from an HTTP/2 client and returns once came
// says the backend has it; the answer comes on the channel as "code body
// error".
func sendHeldRaw(t *testing.T, sv *served, came <-chan struct{}) <-chan string {
	t.Helper()
	got := sendH2(t, sv)
	select {
	case <-came:
	case <-time.After(10 * time.Second):
		t.Fatal("the request did not reach the backend in 10s")
	}
	return got
}

// sendH2 sends a GET to sv from an HTTP/2 client; the answer comes on the
// channel as "code body error".
func sendH2(t *testing.T, sv *served) <-chan string {
	t.Helper()
	c := h2cClient()
	t.Cleanup(c.CloseIdleConnections)
	got := make(chan string, 1)
	// Exits when the request is answered or fails (the client's timeout).
	go func() {
		code, body, err := send(c, "GET", "http://"+sv.Addr().String()+"/")
		got <- fmt.Sprint(code, " ", body, " ", err)
	}()
	return got
}

// wantGoAwayEnd fails the test unless end says within d that the connection
// (conn, for the messages) ended with weir's GOAWAY NO_ERROR.
func wantGoAwayEnd(t *testing.T, end <-chan string, d time.Duration, conn string) {
	t.Helper()
	select {
	case g := <-end:
		if g != "GOAWAY NO_ERROR" {
			t.Errorf("%s ended with %s; want GOAWAY NO_ERROR", conn, g)
		}
	case <-time.After(d):
		t.Errorf("%s still open %v after its last stream ended", conn, d)
	}
}

// TestRemovedBackendStaysRetiredOnRefusedChange: a set of backends refused
// (one listed twice) changes nothing: a backend removed while a request is
// in flight on it, listed again in the refused set, still has its
// connections closed once the request ends, and a backend only the refused
// set named is not reported.
func TestRemovedBackendStaysRetiredOnRefusedChange(t *testing.T) {
	for _, p := range upstreamPools {
		t.Run(p.name, func(t *testing.T) {
			sv, be, c, url := p.start(t, p.cfg)
			other, unknown := startHoldingBackend(t), startHoldingBackend(t)
			gone := Backend{Addr: be.addr, Weight: 1, Usable: true}
			answer := p.sendHeld(t, c, url, be)
			if err := sv.SetBackends([]Backend{{Addr: other.addr, Weight: 1, Usable: true}}); err != nil {
				t.Fatal(err)
			}
			if err := sv.SetBackends([]Backend{{Addr: unknown.addr, Weight: 1, Usable: true}, gone, gone}); err == nil {
				t.Fatal("SetBackends with a backend listed twice: no error; want one")
			}
			if got, want := fmt.Sprint(backendAddrs(sv.Snapshot())), fmt.Sprint([]netip.AddrPort{other.addr}); got != want {
				t.Errorf("backends after the refused change: %s; want %s", got, want)
			}
			be.letGo()
			if got, want := <-answer, "OK "+slowAnswer; got != want {
				t.Fatalf("the request in flight on the removed backend got %q; want %q", got, want)
			}
			be.waitAllClosed(t)
		})
	}
}

// backendAddrs is the addresses of a snapshot's backends.
func backendAddrs(sn Snapshot) []netip.AddrPort {
	var as []netip.AddrPort
	for _, b := range sn.Backends {
		as = append(as, b.Addr)
	}
	return as
}

// TestReaddedBackendKeepsHeldConnection: the frame engine's connection a
// request holds across its backend's removal and return stays open once the
// request ends, and takes the requests after: none is dialled for them. The
// same when the reload that removes the backend changes the algorithm too
// (the request's lease is then the replaced balancer's).
func TestReaddedBackendKeepsHeldConnection(t *testing.T) {
	for _, c := range []struct{ name, algorithm string }{{"same algorithm", ""}, {"algorithm changed", balance.RoundRobin}} {
		t.Run(c.name, func(t *testing.T) {
			p := upstreamPool{"HTTP/2 client through the frame engine", Config{Upstream: UpstreamH2C}, h2cClient, "POST", false}
			sv, be, cl, url := p.start(t, p.cfg)
			other := startHoldingBackend(t)
			answer := p.sendHeld(t, cl, url, be)
			cfg := sv.live.Load().cfg
			if c.algorithm != "" {
				cfg.Algorithm = c.algorithm
			}
			for _, b := range []*holdingBackend{other, be} {
				if err := sv.Reconfigure(cfg, []Backend{{Addr: b.addr, Weight: 1, Usable: true}}); err != nil {
					t.Fatal(err)
				}
			}
			be.letGo()
			if got, want := <-answer, "OK "+slowAnswer; got != want {
				t.Fatalf("the request in flight across the removal got %q; want %q", got, want)
			}
			for range 3 {
				p.sendOK(t, cl, url)
			}
			if n, open := be.accepted.Load(), be.open.Load(); n != 1 || open != 1 {
				t.Errorf("the backend accepted %d connections, %d open; want 1, kept open", n, open)
			}
		})
	}
}

// TestBackendResetLastStreamConnCloses: a frame engine's connection whose
// last stream the backend resets is looked at as one whose last stream ended
// any other way: a removed backend's is closed (GOAWAY NO_ERROR) at once, and
// one that takes requests gets its idle timer, which closes it once the pool's
// idle timeout has passed. Before, the backend's RST_STREAM left it open with
// no timer: kept until the backend closed it.
func TestBackendResetLastStreamConnCloses(t *testing.T) {
	// Restored after the services have stopped (cleanups run last-first).
	t.Cleanup(func(d time.Duration) func() { return func() { upIdleTimeout = d } }(upIdleTimeout))
	for _, c := range []struct {
		name    string
		idleFor time.Duration
		remove  bool // the backend is removed while the stream is held
	}{
		{"removed backend", time.Hour, true},
		{"idle timeout", 300 * time.Millisecond, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			upIdleTimeout = c.idleFor
			came, reset := make(chan struct{}, 1), make(chan struct{})
			be, end := endingH2Backend(t, 1, func(_ int32, fr *http2.Framer, f *http2.HeadersFrame) {
				came <- struct{}{}
				<-reset
				fr.WriteRSTStream(f.StreamID, http2.ErrCodeInternal)
			})
			sv := serveStoppable(t, Config{Upstream: UpstreamH2C}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			letReset := closeOnce(reset)
			t.Cleanup(letReset) // before the service's drain
			got := sendHeldRaw(t, sv, came)
			if c.remove {
				if err := removeBackends(sv); err != nil {
					t.Fatal(err)
				}
			}
			letReset()
			if g := <-got; !strings.HasPrefix(g, "502 ") {
				t.Fatalf("GET the backend reset: %s; want 502", g)
			}
			wantGoAwayEnd(t, end, 10*time.Second, "the connection")
		})
	}
}

// TestRetiredDuringDialConnTakesItsStreams: a frame engine's connection
// whose backend is removed once it is connected but before the requests that
// waited on it are sent sends them, and closes once they end, rather than
// closing at the removal and having them refused and sent again on another.
// The backend's full accept queue holds the connect up (its SYN is sent again
// after 1 s), and the test holds the waiting request's client session, which
// the dial takes to send it, until the removal is done.
func TestRetiredDuringDialConnTakesItsStreams(t *testing.T) {
	addr, fd, fillers := hungListener(t)
	other := startHoldingBackend(t)
	sv := serveStoppable(t, Config{Upstream: UpstreamH2C, ConnectTimeout: 30 * time.Second}, []Backend{{Addr: addr, Weight: 1, Usable: true}})
	got := sendH2(t, sv)
	// The connection being dialled, and the session of the request waiting on it.
	var uc *upconn
	var ss *fsess
	waitfor.Value(t, 10*time.Second, "a request waiting on a connection being dialled", func() (any, bool) {
		be := sv.backend(addr.String())
		p := be.fpool.Load()
		if p == nil {
			return "no pool", false
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		if len(p.conns) != 1 {
			return fmt.Sprint(len(p.conns), " connections"), false
		}
		uc = p.conns[0]
		uc.mu.Lock()
		defer uc.mu.Unlock()
		if len(uc.waiting) != 1 || uc.ready {
			return fmt.Sprint(len(uc.waiting), " waiting, ready ", uc.ready), false
		}
		ss = uc.waiting[0].sess
		return "", true
	})
	ss.mu.Lock()
	var unlocked sync.Once
	unlock := func() { unlocked.Do(ss.mu.Unlock) }
	t.Cleanup(unlock)
	// The backend: its accept queue emptied, it serves h2c.
	// Its own copy of fd, which hungListener's cleanup closes.
	dfd, err := syscall.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(dfd), "hung listener")
	ln, err := net.FileListener(f) // a copy of f's, closed by the server at cleanup
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	be := serveCounting(t, ln, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }, 0)
	waitfor.Value(t, 20*time.Second, "the connection connected", func() (any, bool) {
		uc.mu.Lock()
		defer uc.mu.Unlock()
		return uc.ready, uc.ready
	})
	if err := sv.SetBackends([]Backend{{Addr: other.addr, Weight: 1, Usable: true}}); err != nil {
		t.Fatal(err)
	}
	unlock()
	if g := <-got; g != "200 ok <nil>" {
		t.Fatalf("GET: %s; want 200 ok <nil>", g)
	}
	if n := be.accepted.Load() - int64(fillers); n != 1 {
		t.Errorf("the backend accepted %d connections from weir; want 1, the one the request waited on", n)
	}
}

// leftBehind says what a service's backends have left to close later: HTTP/2
// transport connections open, close-again timers armed ("" if nothing).
func leftBehind(s *Service) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var left []string
	for _, be := range s.backends {
		if n := be.h2Conns.count(); n > 0 {
			left = append(left, fmt.Sprintf("%s: %d HTTP/2 connections open", be.id, n))
		}
		if be.closeAgain != nil {
			left = append(left, be.id+": a close-again timer armed")
		}
	}
	return strings.Join(left, "; ")
}

// TestRetryAfterRefusalPicksInForce: a request the removed backend refused
// goes to a backend of the balancer in force, and so do its retries after
// that. The reload that removed the backend also changed the algorithm, so
// the request's own balancer knows only the removed backend; the one in
// force knows two, the first of which to get a request answers 503. Before,
// the retry after that 503 was picked by the request's own balancer, which
// had no other backend to offer: the client got the 503.
func TestRetryAfterRefusalPicksInForce(t *testing.T) {
	for _, p := range refusedPools {
		t.Run(p.name, func(t *testing.T) {
			var n atomic.Int32
			var bs []Backend
			for range 2 {
				be := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) {
					if n.Add(1) == 1 {
						w.WriteHeader(http.StatusServiceUnavailable)
						return
					}
					io.WriteString(w, "ok")
				}, 0)
				bs = append(bs, Backend{Addr: be.addr, Weight: 1, Usable: true})
			}
			p.cfg.Retries = 1
			got := refusedOnRemoved(t, p, nil, func(sv *served) error {
				cfg := sv.cfg
				cfg.Algorithm = balance.RoundRobin
				return sv.Reconfigure(cfg, bs)
			})
			if got != "200 ok <nil>" {
				t.Errorf("GET the removed backend refused, then the next answered 503: %s; want 200 ok <nil> from the third", got)
			}
		})
	}
}

// TestRetryAfterReloadPicksInForce: a request's retry after a reload that
// changed the algorithm is picked by the balancer in force. The reload
// removed the backend the request did not take and added another; the
// request's own balancer still offered the removed one, whose entry was
// gone: the retry failed without leaving weir, and with no retry left the
// client got 502 (no usable backend).
func TestRetryAfterReloadPicksInForce(t *testing.T) {
	for _, p := range upstreamPools {
		t.Run(p.name, func(t *testing.T) {
			g := newGate(t)
			// The first request any of them gets waits for the gate, then
			// is answered 503; the others "ok".
			start := func() Backend {
				var be *countingBackend
				be = startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) {
					io.Copy(io.Discard, r.Body)
					if g.n.Add(1) == 1 {
						g.came <- be.addr
						<-g.held
						w.WriteHeader(http.StatusServiceUnavailable)
						return
					}
					io.WriteString(w, "ok")
				}, 0)
				return Backend{Addr: be.addr, Weight: 1, Usable: true}
			}
			bs := []Backend{start(), start()}
			cfg := p.cfg
			cfg.Retries = 1
			method := p.method
			if method == "POST" {
				method = "PUT" // retryable
			}
			sv := serveStoppable(t, cfg, bs)
			c := p.client()
			t.Cleanup(c.CloseIdleConnections)
			got := make(chan string, 1)
			// Exits when the request is answered or fails (the client's timeout).
			go func() {
				code, body, err := sendBody(c, method, "http://"+sv.Addr().String()+"/", p.stream)
				got <- fmt.Sprint(code, " ", body, " ", err)
			}()
			held := g.wait(t)
			cfg = sv.cfg
			cfg.Algorithm = balance.RoundRobin
			if err := sv.Reconfigure(cfg, []Backend{{Addr: held, Weight: 1, Usable: true}, start()}); err != nil {
				t.Fatal(err)
			}
			g.open()
			if a := <-got; a != "200 ok <nil>" {
				t.Errorf("%s whose backend answered 503 after a reload that removed the other: %s; want 200 ok <nil> from the one added", method, a)
			}
		})
	}
}

// TestMovedTryNotCounted: a retry moved off a backend removed while the
// backend held it (it refused the stream after the removal) is not a
// failed try, and is not counted as a retry of that backend: the answer
// says how many tries failed, and the removed backend, configured again,
// shows no retry. Before, the moved try was counted in both.
func TestMovedTryNotCounted(t *testing.T) {
	for _, p := range refusedPools {
		t.Run(p.name, func(t *testing.T) {
			g := newGate(t)
			// The first request either gets is answered 503; the next
			// waits for the gate, then is refused (GOAWAY).
			raw := func() Backend {
				var addr netip.AddrPort
				addr = rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
					readBackendFrames(fr, func(f *http2.HeadersFrame) {
						if g.n.Add(1) == 1 {
							fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: statusBlock("503"), EndHeaders: true, EndStream: true})
							return
						}
						g.came <- addr
						<-g.held
						fr.WriteGoAway(0, http2.ErrCodeNo, nil)
					}, func(string) bool { return true })
				})
				return Backend{Addr: addr, Weight: 1, Usable: true}
			}
			a, b := raw(), raw()
			third := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) }, 0)
			c3 := Backend{Addr: third.addr, Weight: 1, Usable: true}
			cfg := p.cfg
			cfg.Retries = 2
			sv := serveStoppable(t, cfg, []Backend{a, b})
			c := p.client()
			t.Cleanup(c.CloseIdleConnections)
			got := sendAsync(c, "http://"+sv.Addr().String()+"/", nil)
			held := g.wait(t)
			first := a
			if held == a.Addr {
				first = b
			}
			if err := sv.SetBackends([]Backend{first, c3}); err != nil {
				t.Fatal(err)
			}
			g.open()
			want := `503 service "test": 2 tries failed`
			if a := <-got; !strings.HasPrefix(a, want) {
				t.Errorf("GET answered 503, retried, moved off a removed backend, answered 503: %s; want %s...", a, want)
			}
			if err := sv.SetBackends([]Backend{first, c3, {Addr: held, Weight: 1, Usable: true}}); err != nil {
				t.Fatal(err)
			}
			for _, bs := range sv.Snapshot().Backends {
				want := uint64(0)
				if bs.Addr == c3.Addr {
					want = 1
				}
				if bs.Retries != want {
					t.Errorf("backend %s counts %d retries; want %d", bs.Addr, bs.Retries, want)
				}
			}
		})
	}
}

// gate holds one request at a backend: the backend counts its requests in
// n, sends its address to came for the one it holds, and holds it until
// open (or cleanup).
type gate struct {
	n    atomic.Int32
	came chan netip.AddrPort
	held chan struct{}
	open func()
}

func newGate(t *testing.T) *gate {
	g := &gate{came: make(chan netip.AddrPort, 1), held: make(chan struct{})}
	g.open = closeOnce(g.held)
	t.Cleanup(g.open)
	return g
}

// wait returns the address of the backend holding the request once it does.
func (g *gate) wait(t *testing.T) netip.AddrPort {
	t.Helper()
	select {
	case a := <-g.came:
		return a
	case <-time.After(10 * time.Second):
		t.Fatal("no backend held the request in 10s")
		return netip.AddrPort{}
	}
}

// TestStoppedServiceRefusesBackends: once Serve has returned, a new backend
// set (SetBackends or Reconfigure) is refused with ErrStopped, and every
// backend stays retired: no connection of a request broken off at the
// drain's end is kept again, and none is dialled. Before, the set was taken
// and its backends were made usable again.
func TestStoppedServiceRefusesBackends(t *testing.T) {
	a := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }, 0)
	b := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }, 0)
	bs := []Backend{{Addr: a.addr, Weight: 1, Usable: true}}
	sv := serveStoppable(t, Config{}, bs)
	sv.stop()
	<-sv.done
	if err := sv.SetBackends(bs); !errors.Is(err, ErrStopped) {
		t.Errorf("SetBackends after the stop: %v; want %v", err, ErrStopped)
	}
	cfg := sv.cfg
	cfg.Algorithm = balance.RoundRobin
	if err := sv.Reconfigure(cfg, append(bs, Backend{Addr: b.addr, Weight: 1, Usable: true})); !errors.Is(err, ErrStopped) {
		t.Errorf("Reconfigure after the stop: %v; want %v", err, ErrStopped)
	}
	sv.mu.Lock()
	defer sv.mu.Unlock()
	for id, be := range sv.backends {
		if !be.retired.Load() {
			t.Errorf("backend %s is not retired after the stop and a new set", id)
		}
	}
	if len(sv.backends) != 1 {
		t.Errorf("%d backends after the stop and a new set; want the 1 before", len(sv.backends))
	}
}

// TestRefusedOnRemovedBackendHashesClientXFF: a request the removed backend
// refused, where the configuration it began in added X-Forwarded-For and
// the reload turned on hashing by that header, goes to the backend of the
// client's X-Forwarded-For, as a request after the reload with that header
// does. Before, the frame engine hashed the value weir had made of it (the
// client's, then weir's client address).
func TestRefusedOnRemovedBackendHashesClientXFF(t *testing.T) {
	for _, p := range refusedPools {
		t.Run(p.name, func(t *testing.T) {
			var bs []Backend
			for _, name := range []string{"a", "b", "c"} {
				be := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, name) }, 0)
				bs = append(bs, Backend{Addr: be.addr, Weight: 1, Usable: true})
			}
			p.cfg.Algorithm, p.cfg.XForwardedFor = balance.RoundRobin, true
			hashed := p.cfg
			hashed.Algorithm, hashed.Hash, hashed.HashName = balance.Maglev, HashHeader, "X-Forwarded-For"
			user, want := userOffRewritten(t, hashed, bs)
			hdr := http.Header{"X-Forwarded-For": {user}}
			got := refusedOnRemoved(t, p, hdr, func(sv *served) error {
				hashed.Name, hashed.Listen = sv.cfg.Name, sv.cfg.Listen
				return sv.Reconfigure(hashed, bs)
			})
			if got != "200 "+want+" <nil>" {
				t.Errorf("GET with X-Forwarded-For %s the removed backend refused: %s; want 200 %s <nil>, from the backend of its hash", user, got, want)
			}
		})
	}
}

// userOffRewritten returns a value of X-Forwarded-For whose backend among bs
// (named by what it answers, "a" and the next letters in order) under cfg
// is not the backend of the value weir forwards (the client's address
// appended), and the name of its backend.
func userOffRewritten(t *testing.T, cfg Config, bs []Backend) (user, name string) {
	t.Helper()
	pick, names := namedPicks(t, cfg, bs)
	for i := range 100 {
		user = fmt.Sprint("10.1.0.", i)
		if id := pick(fnv1a(user)); id != pick(fnv1a(forwardedFor([]string{user}, "127.0.0.1"))) {
			return user, names[id]
		}
	}
	t.Fatalf("no value of 100 has another backend than its forwarded value")
	return "", ""
}

// namedPicks returns what a balancer of cfg's algorithm over bs picks for a
// key, and the names of bs by address ("a" and the next letters in order).
func namedPicks(t *testing.T, cfg Config, bs []Backend) (pick func(key uint64) string, names map[string]string) {
	t.Helper()
	bal, err := balance.New(cfg.Algorithm, nil, cfg.Seed)
	if err != nil {
		t.Fatal(err)
	}
	in := make([]balance.Backend, len(bs))
	names = map[string]string{}
	for i, b := range bs {
		in[i] = balance.Backend{ID: b.Addr.String(), Weight: b.Weight, Usable: true}
		names[b.Addr.String()] = string(rune('a' + i))
	}
	bal.SetBackends(in)
	return func(key uint64) string {
		l, err := bal.Pick(key, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(balance.Result{})
		return l.Backend()
	}, names
}

// TestMovedOffReaddedBackendTriedAgain: a backend a try was moved off
// (removed, it refused the stream) and that is configured again before the
// request's retry may take that retry: it was never tried. Here the other
// backend, which took the moved try, answers 503 once the first is back;
// the retry goes to the first. Before, the first stayed excluded for the
// request, which got the 503.
func TestMovedOffReaddedBackendTriedAgain(t *testing.T) {
	for _, p := range refusedPools {
		t.Run(p.name, func(t *testing.T) {
			g := newGate(t)
			var first atomic.Int32
			came, refuse := make(chan struct{}, 1), make(chan struct{})
			letRefuse := closeOnce(refuse)
			t.Cleanup(letRefuse)
			// The first request is held until letRefuse, then refused
			// (GOAWAY); the next is answered 200.
			a := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
				readBackendFrames(fr, func(f *http2.HeadersFrame) {
					if first.Add(1) == 1 {
						came <- struct{}{}
						<-refuse
						fr.WriteGoAway(0, http2.ErrCodeNo, nil)
						return
					}
					fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: statusBlock("200"), EndHeaders: true, EndStream: true})
				}, func(string) bool { return true })
			})
			b := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) {
				g.came <- netip.AddrPort{}
				<-g.held
				w.WriteHeader(http.StatusServiceUnavailable)
			}, 0)
			ba, bb := Backend{Addr: a, Weight: 1, Usable: true}, Backend{Addr: b.addr, Weight: 1, Usable: true}
			cfg := p.cfg
			cfg.Retries = 1
			sv := serveStoppable(t, cfg, []Backend{ba})
			c := p.client()
			t.Cleanup(c.CloseIdleConnections)
			got := sendAsync(c, "http://"+sv.Addr().String()+"/", nil)
			awaitCame(t, came)
			if err := sv.SetBackends([]Backend{bb}); err != nil {
				t.Fatal(err)
			}
			letRefuse()
			g.wait(t)
			if err := sv.SetBackends([]Backend{ba, bb}); err != nil {
				t.Fatal(err)
			}
			g.open()
			if a := <-got; a != "200  <nil>" {
				t.Errorf("GET moved off a backend configured again before its retry: %s; want 200  <nil>, from that backend", a)
			}
		})
	}
}
