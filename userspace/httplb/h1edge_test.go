package httplb

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

// Edge cases of the HTTP/1.1 connection loop (h1serve.go) and the upstream
// request writer (writeRequestHead): timeouts, shutdown, framing and upstream
// connections. Each runs against both engines where net/http's server is the
// reference: "loop" (weir's own) and "net_http" (Config.NetHTTP1).

var h1Engines = []string{"loop", "net_http"}

// heldBackend is an HTTP/1.1 backend whose /slow holds its answer until
// release is called, reporting on gone if its request's context ends first;
// anything else is answered "ok" at once. release is idempotent; call it (by
// t.Cleanup registered after the service's) so a drain does not wait on it.
func heldBackend(t *testing.T) (addr netip.AddrPort, gone <-chan struct{}, release func()) {
	t.Helper()
	g := make(chan struct{}, 8)
	held := make(chan struct{})
	var once sync.Once
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
			g <- struct{}{}
		case <-held:
			io.WriteString(w, "slow")
		}
	})
	addr = muxBackend(t, mux)
	rel := func() { once.Do(func() { close(held) }) }
	t.Cleanup(rel) // before the server's close: cleanups run last first
	return addr, g, rel
}

// TestH1ClientGoneAfterHeaderTimeout: a client that goes away while its
// bodiless request waits for a slow backend has the backend's request cancelled
// however long the request has run, past the header timeout too (a long poll):
// the watch's read outlives any deadline the header left on the connection.
func TestH1ClientGoneAfterHeaderTimeout(t *testing.T) {
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			be, gone, release := heldBackend(t)
			s := serveOn(t, Config{NetHTTP1: engine == "net_http", ReadHeaderTimeout: 100 * time.Millisecond},
				[]Backend{{Addr: be, Weight: 1, Usable: true}})
			t.Cleanup(release)
			conn, _ := rawConn(t, s.Addr().String())
			io.WriteString(conn, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
			waitfor.Value(t, 5*time.Second, "the request in flight", func() (any, bool) {
				n := s.Snapshot().InFlight
				return n, n == 1
			})
			// What is under test is time passing: the request outlives the
			// header timeout before its client leaves.
			time.Sleep(300 * time.Millisecond)
			conn.Close()
			select {
			case <-gone:
			case <-time.After(2 * time.Second):
				t.Errorf("the backend's request still runs 2 s after its client closed; want it cancelled")
			}
		})
	}
}

// TestH1DrainTimeout: drain_timeout bounds Serve's shutdown. A request still in
// flight at the deadline is broken off (its context cancelled, so the wait for
// the backend ends) and its connection closed, also when its connection's watch
// has ended: behind a pipelined request, or past the header timeout.
func TestH1DrainTimeout(t *testing.T) {
	for _, engine := range h1Engines {
		for _, c := range []struct {
			name      string
			pipelined bool
		}{{"pipelined request behind", true}, {"past the header timeout", false}} {
			t.Run(engine+"/"+c.name, func(t *testing.T) {
				be, _, release := heldBackend(t)
				s := serveStoppable(t, Config{NetHTTP1: engine == "net_http", DrainTimeout: 200 * time.Millisecond,
					ReadHeaderTimeout: 100 * time.Millisecond}, []Backend{{Addr: be, Weight: 1, Usable: true}})
				t.Cleanup(release) // before Serve's end is awaited: cleanups run last first
				conn, _ := rawConn(t, s.Addr().String())
				io.WriteString(conn, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
				waitfor.Value(t, 5*time.Second, "the request in flight", func() (any, bool) {
					n := s.Snapshot().InFlight
					return n, n == 1
				})
				if c.pipelined {
					io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
				} else {
					// What is under test is time passing: the request outlives
					// the header timeout.
					time.Sleep(300 * time.Millisecond)
				}
				start := time.Now()
				s.stop()
				select {
				case <-s.done:
					t.Logf("Serve returned %v after shutdown began", time.Since(start))
				case <-time.After(2 * time.Second):
					t.Errorf("Serve still running 2 s after shutdown began with DrainTimeout 200ms; want it to return at the drain deadline")
				}
			})
		}
	}
}

// TestH1FirstRequestHeaderTimeout: a client that connects and sends nothing
// gets read_header_timeout for its first request, as net/http's server gives it,
// not the idle timeout, over cleartext and after a TLS handshake.
func TestH1FirstRequestHeaderTimeout(t *testing.T) {
	eachH1Front(t, func(t *testing.T, cfg Config) {
		be, _, _ := heldBackend(t)
		cfg.ReadHeaderTimeout, cfg.IdleTimeout = 100*time.Millisecond, 20*time.Second
		withTLS := cfg.TLS != nil
		s := serveOn(t, cfg, []Backend{{Addr: be, Weight: 1, Usable: true}})
		var conn net.Conn
		raw, _ := rawConn(t, s.Addr().String())
		conn = raw
		if withTLS {
			tc := tls.Client(raw, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"http/1.1"}})
			if err := tc.Handshake(); err != nil {
				t.Fatal(err)
			}
			conn = tc
		}
		conn.SetReadDeadline(time.Now().Add(2 * time.Second))
		start := time.Now()
		n, err := conn.Read(make([]byte, 1))
		if n != 0 || isTimeout(err) {
			t.Errorf("connection with no request: read %d bytes (%v) after %v; want it closed within ReadHeaderTimeout",
				n, err, time.Since(start).Round(time.Millisecond))
		}
	})
}

// eachH1Front runs f as a subtest for each HTTP/1.1 engine, over cleartext and
// over TLS (cfg.TLS set, h2 and http/1.1 offered by ALPN).
func eachH1Front(t *testing.T, f func(t *testing.T, cfg Config)) {
	cert, err := tls.X509KeyPair(testCert, testKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, engine := range h1Engines {
		for _, withTLS := range []bool{false, true} {
			cfg := Config{NetHTTP1: engine == "net_http"}
			name := engine + "/cleartext"
			if withTLS {
				name = engine + "/TLS"
				cfg.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
			}
			t.Run(name, func(t *testing.T) { f(t, cfg) })
		}
	}
}

// TestH1Host: the loop's Host rules. http.ReadRequest, the parser the loop
// uses, fills the request's host from the target's authority and drops the
// Host field, so the loop judges the host, not the field: an HTTP/1.1 request
// with none is refused; one in absolute form takes its target's authority
// (RFC 9112 3.2.2: a proxy replaces Host with it), as net/http forwards it
// too; and an empty Host field is refused, where net/http's server, which sees
// the field, lets it through to a handler that has no host to go by.
func TestH1Host(t *testing.T) {
	be, _ := h1TestBackend(t)
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	for _, c := range []struct {
		name, req string
		status    int
	}{
		{"no Host", "GET / HTTP/1.1\r\n\r\n", 400},
		{"empty Host field", "GET / HTTP/1.1\r\nHost:\r\n\r\n", 400},
		{"absolute form without Host field", "GET http://x/ HTTP/1.1\r\n\r\n", 200},
		{"absolute form with another Host", "GET http://x/ HTTP/1.1\r\nHost: y\r\n\r\n", 200},
		{"HTTP/1.0 without Host", "GET / HTTP/1.0\r\n\r\n", 200},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, c.req)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("reading the answer: %v", err)
			}
			resp.Body.Close()
			if resp.StatusCode != c.status {
				t.Errorf("got %d; want %d", resp.StatusCode, c.status)
			}
		})
	}
}

// TestH1CRLFAfterPOST: a CRLF some clients send after a POST's body is skipped
// (RFC 9112 2.2), as net/http's server skips it, and the next request answered.
func TestH1CRLFAfterPOST(t *testing.T) {
	be, _ := h1TestBackend(t)
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\r\n")
			checkAnswer(t, br, wantAnswer{status: 200, body: "hello"})
			io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			checkAnswer(t, br, wantAnswer{status: 200, body: "ok", header: map[string]string{"X-Backend": "b"}})
		})
	}
}

// nextRequest is a raw backend's read of the next request on its connection,
// its body read and dropped; false when none came (the connection ended).
func nextRequest(br *bufio.Reader) (*http.Request, bool) {
	req, err := http.ReadRequest(br)
	if err != nil {
		return nil, false
	}
	io.Copy(io.Discard, req.Body)
	return req, true
}

// answeringBackend answers every request on a kept-alive connection with answer,
// as it is, after reading the request's body.
func answeringBackend(t *testing.T, answer string) netip.AddrPort {
	return rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			if _, ok := nextRequest(br); !ok {
				return
			}
			io.WriteString(c, answer)
		}
	})
}

// TestH1NoContentLengthOn204: a 204 carries no Content-Length (RFC 9110 8.6),
// whatever the backend sent; a client that framed by it would wait for a body
// that never comes.
func TestH1NoContentLengthOn204(t *testing.T) {
	be := answeringBackend(t, "HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n")
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != 204 || resp.Header.Get("Content-Length") != "" {
				t.Errorf("got %d with Content-Length %q; want 204 without Content-Length", resp.StatusCode, resp.Header.Get("Content-Length"))
			}
		})
	}
}

// TestH1UpstreamClosedAfterAnswer: a backend may close a kept-alive connection
// right after an answer (RFC 9112 9.6), without Connection: close. A POST
// without a body sent just after does not fail for it: the pool sees the close
// before it reuses the connection (a POST is not sent twice).
func TestH1UpstreamClosedAfterAnswer(t *testing.T) {
	closed := make(chan struct{}, 1)
	be := rawBackend(t, func(c net.Conn) {
		if _, ok := nextRequest(bufio.NewReader(c)); !ok {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		// One answer per connection: the backend closes it, and the test's
		// next request waits for that (on loopback the FIN is in the plane's
		// socket once close returns), so the close always comes first.
		c.Close()
		closed <- struct{}{}
	})
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	conn, br := rawConn(t, s.Addr().String())
	failed := 0
	const n = 20
	for range n {
		io.WriteString(conn, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
		resp, err := http.ReadResponse(br, &http.Request{Method: "POST"})
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			failed++
		}
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatal("the backend did not close its connection")
		}
	}
	if failed > 0 {
		t.Errorf("%d of %d POSTs failed; want none", failed, n)
	}
}

// TestH1IDNAHostEndToEnd: an HTTP/2 client's request for a host name that is
// not ASCII, forwarded to an HTTP/1.1 backend, reaches it with the same Host
// with or without a body (weir's writer and http.Transport alike).
func TestH1IDNAHostEndToEnd(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, r.Host)
	})
	be := muxBackend(t, mux)
	s := serveOn(t, Config{Upstream: UpstreamHTTP1}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	conn, fr := h2Conn(t, s.Addr().String())
	defer conn.Close()
	const authority = "bücher.example"
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: reqBlock("GET", authority, "/"), EndStream: true, EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: reqBlock("POST", authority, "/"), EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteData(3, true, []byte("x")); err != nil {
		t.Fatal(err)
	}
	bodies := map[uint32]string{}
	ended := 0
	for ended < 2 {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("reading the answers: %v (so far %v)", err, bodies)
		}
		switch f := f.(type) {
		case *http2.DataFrame:
			bodies[f.StreamID] += string(f.Data())
			if f.StreamEnded() {
				ended++
			}
		case *http2.HeadersFrame:
			if f.StreamEnded() {
				ended++
			}
		case *http2.RSTStreamFrame:
			t.Fatalf("stream %d reset: %v", f.StreamID, f.ErrCode)
		case *http2.GoAwayFrame:
			t.Fatalf("GOAWAY: %v", f.ErrCode)
		}
	}
	if bodies[1] != bodies[3] {
		t.Errorf("Host at the backend: GET (writeRequestHead) %q; POST (Request.Write) %q; want the same", bodies[1], bodies[3])
	}
}

// TestH1UpgradeExpectContinue: an h2c upgrade request with a body and Expect:
// 100-continue gets its 100 Continue before the body is read, as from
// net/http's h2c handler.
func TestH1UpgradeExpectContinue(t *testing.T) {
	be, _ := h1TestBackend(t)
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http", ReadHeaderTimeout: 3 * time.Second}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, "POST /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: \r\n"+
				"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n")
			conn.SetReadDeadline(time.Now().Add(1500 * time.Millisecond))
			line, err := br.ReadString('\n')
			if line != "HTTP/1.1 100 Continue\r\n" {
				t.Errorf("got %q (%v); want 100 Continue before the body is sent", line, err)
			}
		})
	}
}

// TestH1UpstreamManyClosed: a backend that closes several idle connections at
// once (shutting down) fails no GET: the pool checks each before reuse and
// dials when all are gone.
func TestH1UpstreamManyClosed(t *testing.T) {
	var heldClosed atomic.Int64
	var mu sync.Mutex
	var held []chan struct{}
	be := rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.URL.Path == "/hold" {
			ch := make(chan struct{})
			mu.Lock()
			held = append(held, ch)
			mu.Unlock()
			<-ch
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		// One answer per connection: the backend closes it, and counts the held
		// ones' closes, which the test's next request waits for (on loopback
		// the FIN is in the plane's socket once close returns).
		c.Close()
		if req.URL.Path == "/hold" {
			heldClosed.Add(1)
		}
	})
	nheld := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(held)
	}
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	failed := 0
	const rounds = 10
	for round := range rounds {
		mu.Lock()
		held = nil
		mu.Unlock()
		a, abr := rawConn(t, s.Addr().String())
		b, bbr := rawConn(t, s.Addr().String())
		io.WriteString(a, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
		io.WriteString(b, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
		waitfor.Value(t, 5*time.Second, "2 requests held at the backend", func() (any, bool) { n := nheld(); return n, n == 2 })
		mu.Lock()
		for _, ch := range held {
			close(ch)
		}
		mu.Unlock()
		for _, br := range []*bufio.Reader{abr, bbr} {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
		}
		waitfor.Value(t, 5*time.Second, "both held connections closed by the backend", func() (any, bool) {
			n := heldClosed.Load()
			return n, n == int64(2*(round+1))
		})
		io.WriteString(a, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(abr, nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != 200 {
			failed++
		}
		a.Close()
		b.Close()
	}
	if failed > 0 {
		t.Errorf("%d of %d GETs failed just after the backend closed its connections; want none", failed, rounds)
	}
}

// mixBackend answers /echo with the body read, after ms= milliseconds;
// /noread after ms= without reading the body; /stream in pieces.
func mixBackend(t *testing.T) netip.AddrPort {
	t.Helper()
	wait := func(r *http.Request) {
		if ms, _ := time.ParseDuration(r.URL.Query().Get("ms") + "ms"); ms > 0 {
			select {
			case <-time.After(ms):
			case <-r.Context().Done():
			}
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		wait(r)
		w.Write(b)
	})
	mux.HandleFunc("/noread", func(w http.ResponseWriter, r *http.Request) {
		wait(r)
		io.WriteString(w, "ok")
	})
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		for range 3 {
			io.WriteString(w, "x")
			w.(http.Flusher).Flush()
			wait(r)
		}
	})
	return muxBackend(t, mux)
}

// TestH1Stress: many connections at once, each a mix of what puts the loop's
// goroutine, the watch, the transport's body reader and 100-continue writes on
// the same connection: pipelined requests behind slow answers, bodies sent
// after 100 Continue, bodies the backend leaves unread, streamed answers, and
// clients that leave mid-request. Run with -race (make race does).
func TestH1Stress(t *testing.T) {
	be := mixBackend(t)
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	onConns(t, s.Addr().String(), 24, func(i int, conn net.Conn, br *bufio.Reader, errs chan<- string) {
		j := 0
		read := func(method, want string) bool {
			resp, err := http.ReadResponse(br, &http.Request{Method: method})
			if err != nil {
				errs <- "reading: " + err.Error()
				return false
			}
			b, err := io.ReadAll(resp.Body)
			if err != nil || string(b) != want {
				errs <- fmt.Sprintf("case %d: %s %d %q (%v); want %q", (i+j)%5, method, resp.StatusCode, b, err, want)
				return false
			}
			return true
		}
		for j = range 6 {
			switch (i + j) % 5 {
			case 0: // 100-continue, slow answer, a pipelined GET behind it
				io.WriteString(conn, "POST /echo?ms=40 HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
				line, _ := br.ReadString('\n')
				br.ReadString('\n')
				if line != "HTTP/1.1 100 Continue\r\n" {
					errs <- "want 100 Continue, got " + line
					return
				}
				io.WriteString(conn, "hello")
				// Past h1WatchAfter: the watch is reading when the
				// pipelined request comes.
				time.Sleep(25 * time.Millisecond)
				io.WriteString(conn, "GET /noread HTTP/1.1\r\nHost: x\r\n\r\n")
				if !read("POST", "hello") || !read("GET", "ok") {
					return
				}
			case 1: // a body the backend leaves unread, slow answer
				io.WriteString(conn, "POST /noread?ms=30 HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789")
				if !read("POST", "ok") {
					return
				}
			case 2: // chunked body, streamed answer, pipelined HEAD
				io.WriteString(conn, "POST /stream?ms=15 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nHEAD /noread HTTP/1.1\r\nHost: x\r\n\r\n")
				if !read("POST", "xxx") || !read("HEAD", "") {
					return
				}
			case 3: // 100-continue the backend never reads (the transport still sends the body)
				io.WriteString(conn, "POST /noread?ms=30 HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
				if line, _ := br.ReadString('\n'); line != "HTTP/1.1 100 Continue\r\n" {
					errs <- "want 100 Continue, got " + line
					return
				}
				br.ReadString('\n')
				io.WriteString(conn, "hello")
				if !read("POST", "ok") {
					return
				}
			case 4:
				if j == 5 { // leave mid-request
					io.WriteString(conn, "GET /noread?ms=200 HTTP/1.1\r\nHost: x\r\n\r\n")
					time.Sleep(30 * time.Millisecond) // past h1WatchAfter: the watch sees it go

					return
				}
				io.WriteString(conn, "GET /noread?ms=25 HTTP/1.1\r\nHost: x\r\n\r\nGET /noread HTTP/1.1\r\nHost: x\r\n\r\n")
				if !read("GET", "ok") || !read("GET", "ok") {
					return
				}
			}
		}
	})
	waitfor.Value(t, 5*time.Second, "no request in flight", func() (any, bool) {
		n := s.Snapshot().InFlight
		return n, n == 0
	})
}

// TestH1NoLeaks: connections that end in every way the loop has
// (client gone mid-answer, mid-body, after 100-continue it never got, after
// a pipelined request, after an h2c upgrade, on a bad request) leave no
// goroutine, file descriptor or counted connection behind.
func TestH1NoLeaks(t *testing.T) {
	be := mixBackend(t)
	s := serveOn(t, Config{ReadHeaderTimeout: 300 * time.Millisecond}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	addr := s.Addr().String()
	warm, wbr := rawConn(t, addr)
	// Both upstream pools warmed: a body that came with its head goes by
	// weir's own exchange, a chunked one by http.Transport.
	io.WriteString(warm, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
	checkAnswer(t, wbr, wantAnswer{status: 200, body: "x"})
	io.WriteString(warm, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\ny\r\n0\r\n\r\n")
	checkAnswer(t, wbr, wantAnswer{status: 200, body: "y"})
	io.WriteString(warm, "GET /noread HTTP/1.1\r\nHost: x\r\n\r\n")
	checkAnswer(t, wbr, wantAnswer{status: 200, body: "ok"})
	warm.Close()
	base := takeBaseline(t, s)
	for _, send := range []string{
		"GET /noread?ms=300 HTTP/1.1\r\nHost: x\r\n\r\n",                                        // gone mid-request
		"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789",               // gone mid-body
		"POST /noread HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n", // gone before its body
		"GET /noread?ms=100 HTTP/1.1\r\nHost: x\r\n\r\nGET /noread HTTP/1.1\r\nHost: x\r\n\r\n",
		"GET /stream?ms=50 HTTP/1.1\r\nHost: x\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: \r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\n", // header never ends
	} {
		conn, br := rawConn(t, addr)
		io.WriteString(conn, send)
		conn.SetReadDeadline(time.Now().Add(60 * time.Millisecond))
		br.ReadString('\n')
		conn.Close()
	}
	base.waitBack(t, s)
}

// TestH1UnreadBodyCloseAnnounced: a backend answers (with a length) before it
// has read the request's large body. The connection cannot carry another
// request (more than 256 KiB is left unread), and the answer's header says so
// (Connection: close, decided before the header is written, as net/http's
// server does), so a client does not send its next request on it.
func TestH1UnreadBodyCloseAnnounced(t *testing.T) {
	be := rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		io.Copy(io.Discard, br) // reads on, so the body keeps flowing
	})
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
			var wg sync.WaitGroup
			// Exits when the plane closes the connection (or at cleanup).
			wg.Go(func() {
				chunk := make([]byte, 64<<10)
				for {
					if _, err := conn.Write(chunk); err != nil {
						return
					}
				}
			})
			t.Cleanup(func() {
				conn.Close()
				wg.Wait()
			})
			resp, err := http.ReadResponse(br, &http.Request{Method: "POST"})
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			if string(body) != "ok" {
				t.Fatalf("got %d %q; want 200 ok", resp.StatusCode, body)
			}
			n, err := br.Read(make([]byte, 1))
			closed := n == 0 && err != nil && !isTimeout(err)
			t.Logf("answer's Connection: close %v; connection closed after it: %v (%v)", resp.Close, closed, err)
			if closed && !resp.Close {
				t.Errorf("the answer said keep-alive (no Connection: close) and the connection then closed (%v); want Connection: close on an answer after which the connection closes", err)
			}
		})
	}
}

// TestH1ConcurrentRequestsKeepTheirOwn: requests forwarded at once from many
// connections each reach the backend with their own path, query, header fields
// and forwarding fields, also when a request goes a second time (the first
// backend answers 503). The memory a request takes on its way upstream is
// reused across requests; a request that saw another's would fail here.
func TestH1ConcurrentRequestsKeepTheirOwn(t *testing.T) {
	echo := func(name string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if name == "flaky" && strings.HasPrefix(r.URL.Path, "/retry") {
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintf(w, "%s?%s tag=%s xff=%s n=%d even=%q", r.URL.Path, r.URL.RawQuery, r.Header.Get("X-Tag"),
				r.Header.Get("X-Forwarded-For"), len(r.Header["X-Tag"]), r.Header.Get("X-Even"))
		})
	}
	bes := []Backend{
		{Addr: muxBackend(t, echo("flaky")), Weight: 1, Usable: true},
		{Addr: muxBackend(t, echo("good")), Weight: 1, Usable: true},
	}
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{Algorithm: "round_robin", XForwardedFor: true, Retries: 1, RetryBudget: 1,
				NetHTTP1: engine == "net_http"}, bes)
			onConns(t, s.Addr().String(), 16, func(i int, conn net.Conn, br *bufio.Reader, errs chan<- string) {
				for j := range 50 {
					path := fmt.Sprintf("/c%d/r%d", i, j)
					if j%7 == 0 {
						path = fmt.Sprintf("/retry%d/r%d", i, j)
					}
					tag := fmt.Sprintf("t%d-%d", i, j)
					// Every other request has a field the next one lacks.
					even := ""
					if j%2 == 0 {
						even = "yes"
					}
					fmt.Fprintf(conn, "GET %s?q=%d HTTP/1.1\r\nHost: h%d\r\nX-Tag: %s\r\nX-Forwarded-For: 192.0.2.%d\r\n", path, j, i, tag, i)
					if even != "" {
						fmt.Fprintf(conn, "X-Even: %s\r\n", even)
					}
					io.WriteString(conn, "\r\n")
					resp, err := http.ReadResponse(br, &http.Request{Method: "GET"})
					if err != nil {
						errs <- fmt.Sprintf("%s: %v", path, err)
						return
					}
					b, _ := io.ReadAll(resp.Body)
					want := fmt.Sprintf("%s?q=%d tag=%s xff=192.0.2.%d, 127.0.0.1 n=1 even=%q", path, j, tag, i, even)
					if resp.StatusCode != http.StatusOK || string(b) != want {
						errs <- fmt.Sprintf("got %d %q; want 200 %q", resp.StatusCode, b, want)
						return
					}
				}
			})
		})
	}
}

// onConns runs f on n client connections to addr at once, each with a 10 s
// deadline, and reports what they sent to errs once all are done.
func onConns(t *testing.T, addr string, n int, f func(i int, conn net.Conn, br *bufio.Reader, errs chan<- string)) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan string, n*4)
	for i := range n {
		// Exits when f is done with its connection.
		wg.Go(func() {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				errs <- err.Error()
				return
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			f(i, conn, bufio.NewReader(conn), errs)
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// TestH1UnsolicitedBytesNoAnswer: bytes a backend sends past its answer's end
// (here a second answer to one request) are no answer to the next request on
// that connection, which another client sent: the connection is closed instead
// of reused, whether the bytes came with the answer or while it sat in the
// pool. (Bytes that come after the look at reuse are not caught: see
// docs/http.md's limits.)
func TestH1UnsolicitedBytesNoAnswer(t *testing.T) {
	const evil = "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"
	for _, c := range []struct {
		name      string
		sameWrite bool
	}{
		{"with the answer", true},
		{"while idle", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			answered := make(chan struct{})
			delivered := make(chan struct{})
			be := rawBackend(t, func(conn net.Conn) {
				br := bufio.NewReader(conn)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					if req.URL.Path != "/twice" {
						io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ngood")
						continue
					}
					head := "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"
					if c.sameWrite {
						io.WriteString(conn, head+evil)
						close(delivered)
						continue
					}
					io.WriteString(conn, head)
					<-answered
					io.WriteString(conn, evil)
					// In weir's socket once the backend's has nothing left unacked.
					waitfor.Value(t, 5*time.Second, "the bytes acked", func() (any, bool) {
						n := outq(conn)
						return n, n == 0
					})
					close(delivered)
				}
			})
			s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			first, br1 := rawConn(t, s.Addr().String())
			io.WriteString(first, "GET /twice HTTP/1.1\r\nHost: x\r\n\r\n")
			resp, err := http.ReadResponse(br1, nil)
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("GET /twice: %v %v", resp, err)
			}
			if body, _ := io.ReadAll(resp.Body); string(body) != "first" {
				t.Fatalf("GET /twice: %q; want the first answer's \"first\"", body)
			}
			close(answered)
			<-delivered
			for _, method := range []string{http.MethodGet, http.MethodPost} {
				other, br2 := rawConn(t, s.Addr().String())
				io.WriteString(other, method+" / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
				resp, err = http.ReadResponse(br2, nil)
				if err != nil {
					t.Fatalf("%s: %v", method, err)
				}
				body, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != 200 || string(body) != "good" {
					t.Errorf("%s from another client: %s %q; want 200 \"good\", the backend's answer to it", method, resp.Status, body)
				}
			}
		})
	}
}

// outq is the bytes conn has sent that its peer has not acknowledged, 0 if it
// cannot be told (the connection is gone).
func outq(conn net.Conn) int {
	rc, err := conn.(*net.TCPConn).SyscallConn()
	if err != nil {
		return 0
	}
	var n int
	rc.Control(func(fd uintptr) { n, err = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ) })
	if err != nil {
		return 0
	}
	return n
}

// TestBackendStatusUnder100: Go's response reader takes any three digits as a
// status, "099" too, but no client may be sent one under 100: the plane answers
// 502 instead, whether weir's own exchange (GET) or http.Transport (POST with a
// body) read it, through both HTTP/1.1 engines. The frame engine checks
// :status itself.
func TestBackendStatusUnder100(t *testing.T) {
	be := answeringBackend(t, "HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok")
	for _, engine := range h1Engines {
		s := serveOn(t, Config{NetHTTP1: engine == "net_http", Retries: 0}, []Backend{{Addr: be, Weight: 1, Usable: true}})
		for _, method := range []string{http.MethodGet, http.MethodPost} {
			req, _ := http.NewRequest(method, "http://"+s.Addr().String()+"/", strings.NewReader("body"))
			if method == http.MethodGet {
				req.Body, req.ContentLength = nil, 0
			}
			resp, err := h1Client().Do(req)
			if err != nil {
				t.Errorf("%s, %s: %v; want a 502", engine, method, err)
				continue
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadGateway {
				t.Errorf("%s, %s: %s for a backend's status 099; want 502", engine, method, resp.Status)
			}
		}
	}
}

// TestH1HeaderTimeoutAfterPOST: the start of a next request that comes right
// behind a POST's body, and no more of it, does not hold the connection open:
// the loop gives it read_header_timeout, as any request's head, and net/http's
// server the idle timeout (a CR alone is the CRLF some clients send after a
// POST's body, RFC 9112 2.2, and no request's start: the idle timeout on
// both). The loop looked for that CRLF with a read of 4 bytes under no
// deadline at all (the body's reads have none), and waited for ever.
func TestH1HeaderTimeoutAfterPOST(t *testing.T) {
	be, _ := h1TestBackend(t)
	for _, engine := range h1Engines {
		for _, c := range []struct{ name, after string }{
			{"one byte", "G"},
			{"three bytes", "GET"},
			{"a CR", "\r"},
			{"a CRLF and one byte", "\r\nG"},
		} {
			t.Run(engine+"/"+c.name, func(t *testing.T) {
				s := serveOn(t, Config{NetHTTP1: engine == "net_http", ReadHeaderTimeout: 200 * time.Millisecond, IdleTimeout: time.Second},
					[]Backend{{Addr: be, Weight: 1, Usable: true}})
				conn, br := rawConn(t, s.Addr().String())
				io.WriteString(conn, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"+c.after)
				checkAnswer(t, br, wantAnswer{status: 200, body: "hello"})
				conn.SetReadDeadline(time.Now().Add(3 * time.Second))
				start := time.Now()
				n, err := io.Copy(io.Discard, br)
				if isTimeout(err) {
					t.Errorf("connection still open 3 s after the answer, with %q of a request's head sent; want it closed within the idle timeout (1 s) at the most", c.after)
				} else {
					t.Logf("closed %v after the answer (%d bytes more, %v)", time.Since(start).Round(time.Millisecond), n, err)
				}
			})
		}
	}
}

// TestH1TimeoutClientNotReading: http.timeout bounds the whole request also
// when it is the client that holds it up: an answer that cannot be written
// because the client does not read is broken off at the timeout, the backend's
// request ended and its in-flight count given back, through both engines. The
// write waited for the client for ever, and the timeout broke off only waits
// for the backend. The bound is the request's: a kept-alive connection's
// next request, later than the first one's deadline, is answered.
func TestH1TimeoutClientNotReading(t *testing.T) {
	ended := make(chan struct{}, 4)
	mux := http.NewServeMux()
	mux.HandleFunc("/small", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		defer func() { ended <- struct{}{} }()
		chunk := make([]byte, 32<<10)
		for range 2048 { // 64 MiB, more than any socket buffers
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	})
	be := muxBackend(t, mux)
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http", Timeout: 300 * time.Millisecond},
				[]Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			conn.(*net.TCPConn).SetReadBuffer(4 << 10)
			io.WriteString(conn, "GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
			checkAnswer(t, br, wantAnswer{status: 200, body: "ok"})
			// What is under test is time passing: the first request's
			// deadline is behind when the next one is answered, by weir
			// itself (no backend's answer sets a deadline of its own).
			time.Sleep(400 * time.Millisecond)
			io.WriteString(conn, "CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n")
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("the request after the first one's deadline: %v; want its answer", err)
			}
			io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != http.StatusMethodNotAllowed {
				t.Fatalf("the request after the first one's deadline: %d; want 405", resp.StatusCode)
			}
			io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			waitfor.Value(t, 5*time.Second, "the request in flight", func() (any, bool) {
				n := s.Snapshot().InFlight
				return n, n == 1
			})
			// The client reads nothing.
			waitfor.Value(t, 5*time.Second, "no request in flight within 5 s (timeout 300ms), the client reading nothing", func() (any, bool) {
				n := s.Snapshot().InFlight
				return n, n == 0
			})
			select {
			case <-ended:
			case <-time.After(5 * time.Second):
				t.Errorf("the backend's request still runs 5 s after the timeout; want it ended")
			}
		})
	}
}

// TestH1IdleAfterPOSTWithCRLF: a client that ends its POST's body with the
// extra CRLF RFC 9112 2.2 lets a server skip, with the body or after the
// answer, then idles less than idle_timeout but longer than
// read_header_timeout, keeps its connection (net/http's server waits for the
// next request under the idle timeout). The loop took the CRLF for the start
// of a request's head and closed the connection at read_header_timeout.
func TestH1IdleAfterPOSTWithCRLF(t *testing.T) {
	be, _ := h1TestBackend(t)
	for _, engine := range h1Engines {
		for _, c := range []struct{ name, body, after string }{
			{"with the body", "hi\r\n", ""},
			{"after the answer", "hi", "\r\n"},
		} {
			t.Run(engine+"/"+c.name, func(t *testing.T) {
				s := serveOn(t, Config{NetHTTP1: engine == "net_http", ReadHeaderTimeout: 300 * time.Millisecond, IdleTimeout: 5 * time.Second},
					[]Backend{{Addr: be, Weight: 1, Usable: true}})
				conn, br := rawConn(t, s.Addr().String())
				io.WriteString(conn, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"+c.body)
				checkAnswer(t, br, wantAnswer{method: "POST", status: 200, body: "hi"})
				io.WriteString(conn, c.after)
				time.Sleep(time.Second) // idle: past read_header_timeout, within idle_timeout
				io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("the next request after 1 s idle (idle_timeout 5s): %v; want its answer", err)
				}
				io.Copy(io.Discard, resp.Body)
			})
		}
	}
}
