package httplb

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// h1TestBackend is an HTTP/1.1 backend with one handler per behaviour the
// connection loop must pass on; gone receives how long /slow waited before its
// request's context ended.
func h1TestBackend(t *testing.T) (netip.AddrPort, chan time.Duration) {
	t.Helper()
	gone := make(chan time.Duration, 4)
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Backend", "b")
		io.WriteString(w, "ok")
	})
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	})
	mux.HandleFunc("/chunked", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "a")
		w.(http.Flusher).Flush()
		io.WriteString(w, "b")
	})
	mux.HandleFunc("/trailers", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Sum")
		io.WriteString(w, "body")
		w.(http.Flusher).Flush()
		w.Header().Set("X-Sum", "42")
	})
	mux.HandleFunc("/nocontent", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.HandleFunc("/noread", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		ms, err := strconv.Atoi(r.URL.Query().Get("ms"))
		if err != nil {
			ms = 5000
		}
		select {
		case <-r.Context().Done():
			gone <- time.Since(start)
		case <-time.After(time.Duration(ms) * time.Millisecond):
			io.WriteString(w, "slow")
		}
	})
	return muxBackend(t, mux), gone
}

// muxBackend serves h with net/http's server on loopback until cleanup.
func muxBackend(t *testing.T, h http.Handler) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	// Exits when the server is closed at cleanup.
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return netip.MustParseAddrPort(ln.Addr().String())
}

// wantAnswer is what one answer read off a raw client connection must be.
type wantAnswer struct {
	method  string // of the request it answers (HEAD has no body)
	proto   string // default HTTP/1.1
	status  int
	body    string
	chunked bool
	close   bool              // Connection: close
	header  map[string]string // fields that must be there
	trailer map[string]string
}

// TestH1Loop: the connection loop frames answers as HTTP/1.1 clients expect:
// keep-alive and pipelining, HTTP/1.0 with and without keep-alive, Connection:
// close, chunked answers and trailers, HEAD and 204, request bodies of known and
// unknown length, a body the backend leaves unread, and Expect.
//
// net/http's server, which serves HTTP/1.1 clients with http.h1_engine:
// net_http, must pass the same table: the loop is a drop-in for it.
func TestH1Loop(t *testing.T) {
	be, _ := h1TestBackend(t)
	for _, engine := range []string{"loop", "net_http"} {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			testH1Loop(t, s)
		})
	}
}

func testH1Loop(t *testing.T, s *Service) {
	get := func(path string) string { return "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n" }
	ok := wantAnswer{status: 200, body: "ok", header: map[string]string{"X-Backend": "b"}}
	type step struct {
		send    string
		answers []wantAnswer
	}
	for _, c := range []struct {
		name   string
		steps  []step
		closed bool // the plane closes the connection after the last answer
	}{
		{name: "keep-alive", steps: []step{{get("/"), []wantAnswer{ok}}, {get("/"), []wantAnswer{ok}}}},
		{name: "pipelined", steps: []step{{get("/") + get("/chunked") + get("/"),
			[]wantAnswer{ok, {status: 200, body: "ab", chunked: true}, ok}}}},
		{name: "HTTP/1.0", closed: true, steps: []step{{"GET / HTTP/1.0\r\n\r\n",
			[]wantAnswer{{proto: "HTTP/1.0", status: 200, body: "ok", close: true}}}}},
		{name: "HTTP/1.0 keep-alive", steps: []step{
			{"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", []wantAnswer{{proto: "HTTP/1.0", status: 200, body: "ok", header: map[string]string{"Connection": "keep-alive"}}}},
			{"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", []wantAnswer{{proto: "HTTP/1.0", status: 200, body: "ok"}}},
		}},
		{name: "HTTP/1.0, length unknown", closed: true, steps: []step{{"GET /chunked HTTP/1.0\r\n\r\n",
			[]wantAnswer{{proto: "HTTP/1.0", status: 200, body: "ab", close: true}}}}},
		{name: "Connection: close", closed: true, steps: []step{{"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
			[]wantAnswer{{status: 200, body: "ok", close: true}}}}},
		{name: "trailers", steps: []step{{get("/trailers"),
			[]wantAnswer{{status: 200, body: "body", chunked: true, trailer: map[string]string{"X-Sum": "42"}}}}}},
		{name: "HEAD", steps: []step{{"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n",
			[]wantAnswer{{method: "HEAD", status: 200, header: map[string]string{"Content-Length": "2"}}}}, {get("/"), []wantAnswer{ok}}}},
		{name: "204", steps: []step{{get("/nocontent"), []wantAnswer{{status: 204}}}, {get("/"), []wantAnswer{ok}}}},
		{name: "body of known length", steps: []step{{"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
			[]wantAnswer{{status: 200, body: "hello"}}}, {get("/"), []wantAnswer{ok}}}},
		{name: "chunked body", steps: []step{{"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
			[]wantAnswer{{status: 200, body: "abcde"}}}, {get("/"), []wantAnswer{ok}}}},
		{name: "body the backend leaves unread", steps: []step{{"POST /noread HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789",
			[]wantAnswer{{status: 200, body: "ok"}}}, {get("/"), []wantAnswer{ok}}}},
		{name: "Expect other than 100-continue", closed: true, steps: []step{{"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: tea\r\nContent-Length: 1\r\n\r\nx",
			[]wantAnswer{{status: http.StatusExpectationFailed, close: true}}}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, br := rawConn(t, s.Addr().String())
			for _, st := range c.steps {
				if _, err := io.WriteString(conn, st.send); err != nil {
					t.Fatal(err)
				}
				for _, want := range st.answers {
					checkAnswer(t, br, want)
				}
			}
			if c.closed {
				if n, err := br.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
					t.Errorf("after the last answer: read %d bytes (%v); want the connection closed", n, err)
				}
			}
		})
	}
	t.Run("100-continue", func(t *testing.T) {
		// The client sends its body only once told to: the plane says so when
		// the request's body is first read on its way to the backend.
		conn, br := rawConn(t, s.Addr().String())
		io.WriteString(conn, "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
		line, err := br.ReadString('\n')
		if line != "HTTP/1.1 100 Continue\r\n" {
			t.Fatalf("got %q (%v); want 100 Continue before the body is sent", line, err)
		}
		if blank, _ := br.ReadString('\n'); blank != "\r\n" {
			t.Fatalf("100 Continue followed by %q; want its blank line", blank)
		}
		io.WriteString(conn, "hello")
		checkAnswer(t, br, wantAnswer{status: 200, body: "hello"})
	})
}

// rawConn dials the plane; the connection closes at cleanup.
func rawConn(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	return conn, bufio.NewReader(conn)
}

func checkAnswer(t *testing.T, br *bufio.Reader, want wantAnswer) {
	t.Helper()
	method := want.method
	if method == "" {
		method = "GET"
	}
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the answer's body: %v", err)
	}
	proto := want.proto
	if proto == "" {
		proto = "HTTP/1.1"
	}
	chunked := len(resp.TransferEncoding) > 0 && resp.TransferEncoding[0] == "chunked"
	if resp.Proto != proto || resp.StatusCode != want.status || string(body) != want.body || chunked != want.chunked || resp.Close != want.close {
		t.Errorf("got %s %d %q chunked=%v close=%v; want %s %d %q chunked=%v close=%v",
			resp.Proto, resp.StatusCode, body, chunked, resp.Close, proto, want.status, want.body, want.chunked, want.close)
	}
	if resp.Header.Get("Date") == "" && resp.StatusCode < 400 {
		t.Errorf("answer without Date")
	}
	for k, v := range want.header {
		if got := resp.Header.Get(k); got != v {
			t.Errorf("header %s: got %q; want %q", k, got, v)
		}
	}
	for k, v := range want.trailer {
		if got := resp.Trailer.Get(k); got != v {
			t.Errorf("trailer %s: got %q; want %q", k, got, v)
		}
	}
}

// TestH1ClientGone: a client that closes its connection while its request waits
// for a slow backend has the backend's request cancelled, as net/http's server
// would, and the plane blames the backend for nothing. Without an overall
// timeout the connection's own context breaks the exchange off; with one, the
// timeout's context does, through context.AfterFunc. A client that only ends
// its sending side is gone as well (net/http's server has it so), and gets no
// answer, never one the plane makes up (the empty 200 a handler that writes
// nothing would leave).
func TestH1ClientGone(t *testing.T) {
	for _, tc := range []struct {
		name      string
		timeout   time.Duration
		halfClose bool
	}{
		{"connection context", 0, false},
		{"with timeout", 30 * time.Second, false},
		{"half-closed", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be, gone := h1TestBackend(t)
			obs := &recordingObserver{}
			s := serveOn(t, Config{Observer: obs, Timeout: tc.timeout}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, _ := rawConn(t, s.Addr().String())
			io.WriteString(conn, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
			waitfor.Value(t, 5*time.Second, "the request in flight", func() (any, bool) {
				n := s.Snapshot().InFlight
				return n, n == 1
			})
			closed := time.Now()
			if tc.halfClose {
				conn.(*net.TCPConn).CloseWrite()
			} else {
				conn.Close()
			}
			select {
			case d := <-gone:
				t.Logf("the backend's request ended %v after it began, %v after the client closed", d, time.Since(closed))
			case <-time.After(3 * time.Second):
				t.Fatalf("the backend's request still runs 3 s after its client closed; want it cancelled")
			}
			waitfor.Value(t, 5*time.Second, "no request in flight", func() (any, bool) {
				n := s.Snapshot().InFlight
				return n, n == 0
			})
			if f := obs.failures(); f != 0 {
				t.Errorf("%d failed tries counted against the backend; want none: the client left", f)
			}
			if tc.halfClose {
				if got, err := io.ReadAll(conn); len(got) > 0 || err != nil {
					t.Errorf("the half-closed client got %q (%v); want the connection closed without an answer", got, err)
				}
			}
		})
	}
}

// TestH1Shutdown: at shutdown an idle HTTP/1.1 connection is closed at once, and
// one whose request is in flight gets its answer, with Connection: close, before
// it is closed.
func TestH1Shutdown(t *testing.T) {
	be, _ := h1TestBackend(t)
	s := serveStoppable(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	idle, idleR := rawConn(t, s.Addr().String())
	io.WriteString(idle, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	checkAnswer(t, idleR, wantAnswer{status: 200, body: "ok", header: map[string]string{"X-Backend": "b"}})
	busy, busyR := rawConn(t, s.Addr().String())
	io.WriteString(busy, "GET /chunked HTTP/1.1\r\nHost: x\r\n\r\nGET /slow?ms=500 HTTP/1.1\r\nHost: x\r\n\r\n")
	checkAnswer(t, busyR, wantAnswer{status: 200, body: "ab", chunked: true})
	waitfor.Value(t, 5*time.Second, "the slow request in flight", func() (any, bool) {
		n := s.Snapshot().InFlight
		return n, n == 1
	})
	start := time.Now()
	s.stop()
	if n, err := idleR.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Errorf("idle connection at shutdown: read %d bytes (%v); want it closed", n, err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("idle connection closed %v after shutdown began; want at once", d)
	}
	checkAnswer(t, busyR, wantAnswer{status: 200, body: "slow", close: true})
	<-s.done
	if _, err := net.Dial("tcp", s.Addr().String()); err == nil {
		t.Errorf("a new connection was accepted after shutdown")
	}
}

// recordingObserver counts the tries that failed.
type recordingObserver struct {
	mu     sync.Mutex
	failed int
}

func (o *recordingObserver) Try(_ netip.AddrPort, out Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if out != Success {
		o.failed++
	}
}

func (o *recordingObserver) Request(netip.AddrPort, int, time.Duration) {}

func (o *recordingObserver) failures() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.failed
}

// TestSessionCtx holds the connection context's hook to what context.AfterFunc
// promises: run once on cancellation, never after a release that reported it had
// not run, and nothing left held after a release, so the next exchange can hold
// its own.
func TestSessionCtx(t *testing.T) {
	for _, tc := range []struct {
		name            string
		steps           string // h: hold, r: release, c: cancel
		runs            int    // times the hook ran
		lastRelease     bool   // what the last release reported
		heldAfter, fall bool   // a hook still held at the end; a hold refused
	}{
		{"hold, release, hold, release", "hrhr", 0, true, false, false},
		{"hold, cancel, release", "hcr", 1, false, false, false},
		{"cancel, hold runs at once", "chr", 1, false, false, false},
		{"hold twice: the second is refused", "hh", 0, false, true, true},
		{"cancel twice runs once", "hccr", 1, false, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := newSessionCtx()
			runs, lastRelease, fall := 0, false, false
			for _, step := range tc.steps {
				switch step {
				case 'h':
					if !x.hold(func() { runs++ }) {
						fall = true
					}
				case 'r':
					lastRelease = x.release()
				case 'c':
					x.cancelWith(errClientGone)
				}
			}
			x.mu.Lock()
			held := x.hook != nil
			x.mu.Unlock()
			if runs != tc.runs || lastRelease != tc.lastRelease || held != tc.heldAfter || fall != tc.fall {
				t.Errorf("ran %d, last release %t, held after %t, a hold refused %t; want %d, %t, %t, %t",
					runs, lastRelease, held, fall, tc.runs, tc.lastRelease, tc.heldAfter, tc.fall)
			}
		})
	}
}

// TestH1SessionHookPerRequest: on a keep-alive connection each request's
// exchange holds the connection context's hook while it waits for the backend
// and leaves none behind once answered, request after request.
func TestH1SessionHookPerRequest(t *testing.T) {
	be, _ := h1TestBackend(t)
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	conn, br := rawConn(t, s.Addr().String())
	held := func() (n int) {
		s.h1mu.Lock()
		defer s.h1mu.Unlock()
		for c := range s.h1conns {
			c.ctx.mu.Lock()
			if c.ctx.hook != nil {
				n++
			}
			c.ctx.mu.Unlock()
		}
		return n
	}
	for i := range 3 {
		io.WriteString(conn, "GET /slow?ms=300 HTTP/1.1\r\nHost: x\r\n\r\n")
		waitfor.Value(t, 5*time.Second, fmt.Sprintf("request %d: a hook held while it waits", i), func() (any, bool) {
			n := held()
			return n, n == 1
		})
		checkAnswer(t, br, wantAnswer{status: 200, body: "slow"})
		if n := held(); n != 0 {
			t.Fatalf("request %d answered: %d hooks held; want none", i, n)
		}
	}
}

// TestH1WatchTimerPerBurst: requests that follow one another on a connection
// share its watch's timer, set by the first, rather than each setting it
// anew; and a slow request that comes under a timer an earlier one set is
// still watched from its own start: its client's going away cancels the
// backend's request.
func TestH1WatchTimerPerBurst(t *testing.T) {
	be, gone := h1TestBackend(t)
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	conn, br := rawConn(t, s.Addr().String())
	io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	checkAnswer(t, br, wantAnswer{status: 200, body: "ok"})
	arms := func() (n int) {
		s.h1mu.Lock()
		defer s.h1mu.Unlock()
		for c := range s.h1conns {
			c.wmu.Lock()
			n += c.watchArms
			c.wmu.Unlock()
		}
		return n
	}
	const burst = 100
	before := arms()
	start := time.Now()
	for range burst {
		io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		checkAnswer(t, br, wantAnswer{status: 200, body: "ok"})
	}
	took := time.Since(start)
	// The timer fires at most once per h1WatchAfter, and a fire that finds
	// the connection between two requests leaves the next to set it again.
	want := 1 + int(took/h1WatchAfter)
	if got := arms() - before; got > want {
		t.Errorf("%d requests in %v set the watch's timer %d times; want at most %d", burst, took, got, want)
	}

	// Pipelined: the slow request is armed while the quick one's timer runs.
	io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
	checkAnswer(t, br, wantAnswer{status: 200, body: "ok"})
	waitfor.Value(t, 5*time.Second, "the slow request in flight", func() (any, bool) {
		n := s.Snapshot().InFlight
		return n, n == 1
	})
	conn.Close()
	select {
	case d := <-gone:
		t.Logf("the backend's request ended %v after it began", d)
	case <-time.After(3 * time.Second):
		t.Fatal("the backend's request still runs 3 s after its client closed; want it cancelled")
	}
}

// TestH1WatchTimerAlone: a request that comes alone, more than h1WatchAfter
// after the one before it, leaves no watch timer pending once answered, so
// the timer does not fire for an idle connection: the next request is not
// expected soon.
func TestH1WatchTimerAlone(t *testing.T) {
	be, _ := h1TestBackend(t)
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	conn, br := rawConn(t, s.Addr().String())
	session := func() *h1Session {
		s.h1mu.Lock()
		defer s.h1mu.Unlock()
		for c := range s.h1conns {
			return c
		}
		return nil
	}
	for i := range 3 {
		if i > 0 {
			c := session()
			waitfor.Value(t, 5*time.Second, "h1WatchAfter past the last request's start", func() (any, bool) {
				c.wmu.Lock()
				since := time.Duration(nanotime() - c.watchFrom)
				c.wmu.Unlock()
				return since, since > h1WatchAfter
			})
		}
		io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		checkAnswer(t, br, wantAnswer{status: 200, body: "ok"})
		c := session()
		c.wmu.Lock()
		set := c.watchSet
		c.wmu.Unlock()
		if set {
			t.Errorf("request %d, alone, answered: the watch's timer is still pending; want it stopped", i)
		}
	}
}
