package httplb

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// countingBackend is an HTTP/1.1 and HTTP/2 cleartext (prior knowledge)
// server on loopback that counts the connections it accepts and has open.
type countingBackend struct {
	addr           netip.AddrPort
	accepted, open atomic.Int64
	srv            *http.Server

	mu    sync.Mutex
	conns map[net.Conn]bool // open now: whether a request came on it
}

// openConns returns the connections open now, each with whether a request
// came on it.
func (b *countingBackend) openConns() map[net.Conn]bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return maps.Clone(b.conns)
}

func startCountingBackend(t *testing.T, h http.HandlerFunc, idle time.Duration) *countingBackend {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return serveCounting(t, ln, h, idle)
}

// serveCounting is startCountingBackend on a listener of the caller's.
func serveCounting(t *testing.T, ln net.Listener, h http.HandlerFunc, idle time.Duration) *countingBackend {
	t.Helper()
	b := &countingBackend{addr: netip.MustParseAddrPort(ln.Addr().String()), conns: map[net.Conn]bool{}}
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	b.srv = &http.Server{Handler: h, IdleTimeout: idle, Protocols: &p, ConnState: func(c net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			b.accepted.Add(1)
			b.open.Add(1)
			b.mu.Lock()
			b.conns[c] = false
			b.mu.Unlock()
		case http.StateActive:
			b.mu.Lock()
			b.conns[c] = true
			b.mu.Unlock()
		case http.StateClosed, http.StateHijacked:
			b.open.Add(-1)
			b.mu.Lock()
			delete(b.conns, c)
			b.mu.Unlock()
		}
	}}
	// Exits when the server is closed at cleanup.
	go b.srv.Serve(ln)
	t.Cleanup(func() { b.srv.Close() })
	return b
}

// TestH1UpstreamConnections: requests without a body go to HTTP/1.1 backends over
// pooled connections the handler drives itself. Each case sends its requests one
// after another through the plane and checks what reached the backend and how
// many connections it took.
func TestH1UpstreamConnections(t *testing.T) {
	big := strings.Repeat("x", 100<<10)
	cases := []struct {
		name    string
		handler http.HandlerFunc
		idle    time.Duration // the backend's keep-alive timeout
		pause   time.Duration // between requests
		method  string
		// what each request must get, and how many connections the backend
		// must have accepted for all of them
		status, requests int
		body             string
		conns            int64
	}{
		{name: "kept alive", method: "GET", requests: 20, status: 200, body: "ok", conns: 1,
			handler: func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }},
		{name: "chunked answers", method: "GET", requests: 5, status: 200, body: "chunk chunk", conns: 1,
			handler: func(w http.ResponseWriter, r *http.Request) {
				io.WriteString(w, "chunk ")
				w.(http.Flusher).Flush()
				io.WriteString(w, "chunk")
			}},
		{name: "HEAD", method: "HEAD", requests: 5, status: 200, body: "", conns: 1,
			handler: func(w http.ResponseWriter, r *http.Request) { w.Header().Set("Content-Length", "10") }},
		{name: "backend closes after each answer", method: "GET", requests: 5, status: 200, body: "ok", conns: 5,
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Connection", "close")
				io.WriteString(w, "ok")
			}},
		// The backend's keep-alive timeout closes each connection between two
		// requests: the next one sees that and dials, even for a POST, which could
		// not be sent twice.
		{name: "backend closed the idle connection, GET", method: "GET", requests: 3, status: 200, body: "ok", conns: 3,
			idle: 50 * time.Millisecond, pause: 300 * time.Millisecond,
			handler: func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }},
		{name: "backend closed the idle connection, POST", method: "POST", requests: 3, status: 200, body: "ok", conns: 3,
			idle: 50 * time.Millisecond, pause: 300 * time.Millisecond,
			handler: func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }},
		{name: "early hints before the answer", method: "GET", requests: 3, status: 200, body: "ok", conns: 1,
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Link", "</a.css>; rel=preload")
				w.WriteHeader(http.StatusEarlyHints)
				io.WriteString(w, "ok")
			}},
		// A head past the connection's 32 KiB reader is read with a larger
		// one of its own, and the connection is closed after it.
		{name: "answer header past the reader", method: "GET", requests: 3, status: 200, body: "ok", conns: 3,
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-Big", big[:40<<10])
				io.WriteString(w, "ok")
			}},
		{name: "answer header too long", method: "GET", requests: 2, status: http.StatusBadGateway, conns: 2,
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-Big", big)
				io.WriteString(w, "ok")
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := startCountingBackend(t, tc.handler, tc.idle)
			s := serveOn(t, Config{}, []Backend{{Addr: b.addr, Weight: 1, Usable: true}})
			c := h1Client()
			for i := range tc.requests {
				if i > 0 {
					time.Sleep(tc.pause)
				}
				resp, body := do(t, c, tc.method, "http://"+s.Addr().String()+"/")
				if resp.StatusCode != tc.status || (tc.status == 200 && body != tc.body) {
					t.Fatalf("request %d: %d %q, want %d %q", i, resp.StatusCode, body, tc.status, tc.body)
				}
			}
			if got := b.accepted.Load(); got != tc.conns {
				t.Errorf("backend accepted %d connections for %d requests, want %d", got, tc.requests, tc.conns)
			}
		})
	}
}

// TestH1UpstreamBrokenOff: a client that goes away in the middle of a long answer
// takes the upstream connection with it (its rest can't be read), and the next
// request gets a connection of its own and its whole answer.
func TestH1UpstreamBrokenOff(t *testing.T) {
	b := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/short" {
			io.WriteString(w, "ok")
			return
		}
		chunk := strings.Repeat("y", 64<<10)
		for range 1000 { // 64 MB, far more than socket buffers hold
			if _, err := io.WriteString(w, chunk); err != nil {
				return
			}
		}
	}, 0)
	s := serveOn(t, Config{}, []Backend{{Addr: b.addr, Weight: 1, Usable: true}})
	conn, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "GET /long HTTP/1.1\r\nHost: x\r\n\r\n")
	buf := make([]byte, 256<<10)
	if _, err := io.ReadFull(conn, buf); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	waitfor.Value(t, 5*time.Second, "0 open backend connections after the client broke off",
		func() (any, bool) { n := b.open.Load(); return n, n == 0 })
	_, body := get(t, h1Client(), "http://"+s.Addr().String()+"/short")
	if body != "ok" {
		t.Fatalf("next request: %q", body)
	}
	if got := b.accepted.Load(); got != 2 {
		t.Errorf("backend accepted %d connections, want 2", got)
	}
}

// TestH1PoolReap: connections idle for longer than the pool keeps them are
// closed without a request coming.
func TestH1PoolReap(t *testing.T) {
	b := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }, 0)
	dial := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", b.addr.String())
	}
	p := newH1Pool(dial, 8, 100*time.Millisecond, 64<<10)
	for range 3 {
		req, _ := http.NewRequest("GET", "http://"+b.addr.String()+"/", nil)
		resp, err := p.roundTrip(req.Context(), req, nil, new(h1Body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if got := b.accepted.Load(); got != 1 {
		t.Fatalf("backend accepted %d connections for 3 requests, want 1", got)
	}
	waitfor.Value(t, 5*time.Second, "0 open backend connections after the reap",
		func() (any, bool) { n := b.open.Load(); return n, n == 0 })
	p.mu.Lock()
	n := len(p.idle)
	p.mu.Unlock()
	if n != 0 {
		t.Errorf("pool holds %d idle connections after the reap, want 0", n)
	}
}

// TestH1UpstreamBackendRemoved: a backend taken out of the service has its idle
// connections closed, and one a request was on when it went is closed when the
// request ends, not kept; configured again, it pools them again.
func TestH1UpstreamBackendRemoved(t *testing.T) {
	release := make(chan struct{})
	slow := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-release
		}
		io.WriteString(w, "ok")
	}, 0)
	other := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }, 0)
	first := []Backend{{Addr: slow.addr, Weight: 1, Usable: true}}
	s := serveOn(t, Config{}, first)
	url := "http://" + s.Addr().String()
	get(t, h1Client(), url+"/")
	if n := slow.open.Load(); n != 1 {
		t.Fatalf("after one request the backend has %d connections open, want 1 (pooled)", n)
	}

	done := make(chan string, 1)
	// Exits when the held request is answered (release is closed below).
	go func() {
		resp, err := h1Client().Get(url + "/slow")
		if err != nil {
			done <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- string(b)
	}()
	waitfor.Value(t, 5*time.Second, "the slow request in flight", func() (any, bool) {
		n := s.stats.inflight.Load()
		return n, n == 1
	})
	if err := s.SetBackends([]Backend{{Addr: other.addr, Weight: 1, Usable: true}}); err != nil {
		t.Fatal(err)
	}
	close(release)
	if got := <-done; got != "ok" {
		t.Fatalf("the request in flight on the removed backend: %q", got)
	}
	waitfor.Value(t, 5*time.Second, "no connection left open to the removed backend", func() (any, bool) {
		n := slow.open.Load()
		return n, n == 0
	})

	if err := s.SetBackends(first); err != nil {
		t.Fatal(err)
	}
	get(t, h1Client(), url+"/")
	waitfor.Value(t, 5*time.Second, "configured again, its connection is pooled (1 open)", func() (any, bool) {
		n := slow.open.Load()
		return n, n == 1
	})
}

// TestWriteRequestHead: the synchronous path's request writer sends what
// http.Request.Write sends for a request without a body or with one of known
// length, as a server reads it: the same method, target, Host, header fields,
// Content-Length and body.
func TestWriteRequestHead(t *testing.T) {
	for _, c := range []struct {
		name, method, target, host string
		header                     http.Header
		body                       string
	}{
		{"GET with a query", "GET", "/a/b?x=1&y=%20", "example.com", http.Header{"Accept": {"*/*"}, "X-Forwarded-For": {"10.0.0.1"}}, ""},
		{"escaped path", "GET", "/a%2Fb/c%20d", "example.com:8080", http.Header{}, ""},
		{"DELETE", "DELETE", "/item/1", "h", http.Header{"X-Two": {"1", "2"}}, ""},
		{"POST without a body gets a length", "POST", "/", "h", http.Header{}, ""},
		{"HEAD", "HEAD", "/", "h", http.Header{}, ""},
		{"OPTIONS *", "OPTIONS", "*", "h", http.Header{}, ""},
		{"empty User-Agent is none", "GET", "/", "h", http.Header{"User-Agent": {""}}, ""},
		{"User-Agent kept", "GET", "/", "h", http.Header{"User-Agent": {"curl/8"}}, ""},
		{"IPv6 zone dropped", "GET", "/", "[fe80::1%25eth0]:80", http.Header{}, ""},
		{"host name not ASCII goes as IDNA", "GET", "/", "bücher.example", http.Header{}, ""},
		{"invalid Host sent empty", "GET", "/", "bad host", http.Header{}, ""},
		{"hop fields the writer owns", "GET", "/", "h", http.Header{"Content-Length": {"5"}, "Transfer-Encoding": {"chunked"}, "Trailer": {"X"}, "Host": {"other"}}, ""},
		{"invalid field name skipped", "GET", "/", "h", http.Header{"Bad Name": {"v"}, "Good": {"v"}}, ""},
		{"POST with a body", "POST", "/api", "h", http.Header{"Content-Type": {"application/json"}}, `{"a":1}`},
		{"DELETE with a body", "DELETE", "/x", "h", http.Header{}, "b"},
		{"GET with a body and a stale length", "GET", "/", "h", http.Header{"Content-Length": {"99"}}, "four"},
	} {
		t.Run(c.name, func(t *testing.T) {
			u, err := url.ParseRequestURI(c.target)
			if c.target == "*" {
				u, err = &url.URL{Path: "*"}, nil
			}
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := c.header["User-Agent"]; !ok {
				c.header["User-Agent"] = []string{""} // as outHeader leaves it: Go's own is not sent
			}
			req := &http.Request{Method: c.method, URL: u, Host: c.host, Header: c.header, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1}
			if c.body != "" {
				req.Body, req.ContentLength = io.NopCloser(strings.NewReader(c.body)), int64(len(c.body))
			}
			var std, ours bytes.Buffer
			if err := req.Write(&std); err != nil {
				t.Fatal(err)
			}
			bw := bufio.NewWriter(&ours)
			if err := writeRequestHead(bw, req, len(c.body)); err != nil {
				t.Fatal(err)
			}
			bw.WriteString(c.body)
			bw.Flush()
			stdText, oursText := std.String(), ours.String()
			a, errA := http.ReadRequest(bufio.NewReader(&std))
			b, errB := http.ReadRequest(bufio.NewReader(&ours))
			if errA != nil || errB != nil {
				t.Fatalf("reading them back: Request.Write's %v, ours %v\n%s", errA, errB, oursText)
			}
			bodyA, errA := io.ReadAll(a.Body)
			bodyB, errB := io.ReadAll(b.Body)
			if a.Method != b.Method || a.RequestURI != b.RequestURI || a.Host != b.Host || a.ContentLength != b.ContentLength ||
				!reflect.DeepEqual(a.Header, b.Header) || string(bodyA) != string(bodyB) || errA != nil || errB != nil {
				t.Errorf("ours:\n%s\nRequest.Write's:\n%s", oursText, stdText)
			}
		})
	}
}
