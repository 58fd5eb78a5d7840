package httplb

import (
	"bytes"
	"math"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/userspace/balance"
)

// cannedBackend answers every HTTP/1.1 request on its connections with the same
// bytes (what Go's net/http server sends for a one-byte body), and allocates
// nothing per request, so a benchmark's allocations are the plane's alone.
func cannedBackend(tb testing.TB) netip.AddrPort {
	answer := []byte("HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Type: text/plain; charset=utf-8\r\n" +
		"Date: Wed, 02 Dec 2026 04:00:00 GMT\r\n\r\na")
	return rawBackend(tb, func(c net.Conn) {
		buf := make([]byte, 8192)
		have := 0
		for {
			n, err := c.Read(buf[have:])
			if err != nil {
				return
			}
			have += n
			// A request without a body ends at its blank line; more than one
			// may have come.
			for {
				i := bytes.Index(buf[:have], []byte("\r\n\r\n"))
				if i < 0 {
					break
				}
				if _, err := c.Write(answer); err != nil {
					return
				}
				have = copy(buf, buf[i+4:have])
			}
		}
	})
}

// rawBackend listens on loopback and runs serve on each connection it accepts,
// on a goroutine of its own, closing the connection when serve returns; the
// listener closes at cleanup.
func rawBackend(tb testing.TB, serve func(net.Conn)) netip.AddrPort {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ln.Close() })
	// Exits when the listener closes at cleanup.
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			// Exits when serve does: the plane closed the connection, or the
			// backend is done with it.
			go func() {
				defer c.Close()
				serve(c)
			}()
		}
	}()
	return netip.MustParseAddrPort(ln.Addr().String())
}

// BenchmarkH1KeepAlive: one keep-alive HTTP/1.1 client sends requests one after
// another through the plane to one backend: GETs, and POSTs of a 512-byte JSON
// body sent with the head (an API call). ns/op is a request's round trip
// (client, plane and backend on one machine); allocs/op and B/op are the
// plane's alone, as neither end allocates per request: compare them across
// builds (benchstat) when a change claims to take work off the request path.
func BenchmarkH1KeepAlive(b *testing.B) {
	for _, c := range []struct {
		name  string
		cfg   Config
		post  bool
		extra string // fields the GET carries besides the usual
	}{
		{"loop", Config{XForwardedFor: true, XForwardedProto: true}, false, ""},
		{"net_http", Config{XForwardedFor: true, XForwardedProto: true, NetHTTP1: true}, false, ""},
		{"loop/POST", Config{XForwardedFor: true, XForwardedProto: true}, true, ""},
		// Hashed by a field named as operators write it: Host, and one in
		// lower case.
		{"loop/hash_host", Config{XForwardedFor: true, XForwardedProto: true, Algorithm: balance.Maglev, Hash: HashHeader, HashName: "Host"}, false, ""},
		{"loop/hash_header", Config{XForwardedFor: true, XForwardedProto: true, Algorithm: balance.Maglev, Hash: HashHeader, HashName: "x-request-id"},
			false, "X-Request-Id: 42\r\n"},
	} {
		b.Run(c.name, func(b *testing.B) {
			s := serveOn(b, c.cfg, []Backend{{Addr: cannedBackend(b), Weight: 1, Usable: true}})
			conn, err := net.Dial("tcp", s.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			req := []byte("GET /index.html HTTP/1.1\r\nHost: " + s.Addr().String() + "\r\nUser-Agent: bench\r\nAccept: */*\r\n" + c.extra + "\r\n")
			if c.post {
				body := benchJSON(512)
				req = []byte("POST /api/items HTTP/1.1\r\nHost: " + s.Addr().String() + "\r\nUser-Agent: bench\r\nAccept: */*\r\n" +
					"Content-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body)
			}
			roundTrip := keepAliveRoundTrip(b, conn, req)
			roundTrip()
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				roundTrip()
			}
		})
	}
}

// benchJSON is a JSON object of n bytes (n at least 16), as an API client
// would send: no blank line in it, which cannedBackend would take for a
// request's end.
func benchJSON(n int) string {
	pad := n - len(`{"id":1,"note":""}`)
	return `{"id":1,"note":"` + strings.Repeat("x", pad) + `"}`
}

// answerLength is the length of a whole answer whose start is in p (its header
// and its Content-Length), or 0 if its header has not all come.
func answerLength(p []byte) int {
	end := bytes.Index(p, []byte("\r\n\r\n"))
	if end < 0 {
		return 0
	}
	const field = "\r\nContent-Length: "
	i := bytes.Index(p[:end], []byte(field))
	if i < 0 {
		panic("answer without Content-Length:\n" + string(p))
	}
	j := bytes.IndexByte(p[i+len(field):], '\r')
	n, err := strconv.Atoi(string(p[i+len(field) : i+len(field)+j]))
	if err != nil {
		panic(err)
	}
	return end + 4 + n
}

// h1POSTAllocs bounds the allocations of a keep-alive POST through the loop
// with no timeout, its body streamed through http.Transport: 61 at ebfd406
// for a 2-byte body, before the guard against paused uploads (64 with it,
// before it took none where no time can be up); 63 for h1StreamedBody, read
// in more pieces; 62 since the status code's digits are appended in the write
// buffer. A try_timeout adds 7 (its context and timer), a timeout 7
// more and its hook 3.
const h1POSTAllocs = 62

// h1InHandPOSTAllocs bounds the same for a POST whose body came whole with its
// head, which weir's own exchange carries (a 2-byte body): 24 at c5b04b2, 22
// since the status code's and the Content-Length's digits are appended in the
// write buffers (they escaped from arrays of their own), 21 since the answer's
// body wrapper is the request's scratch's. A try_timeout
// adds 9, a timeout 7 more.
const h1InHandPOSTAllocs = 21

// h1StreamedBody is a body longer than the connection loop's reader, so it
// streams through http.Transport.
var h1StreamedBody = strings.Repeat("x", 5000)

// TestH1POSTAllocs: a keep-alive POST through the loop allocates no more
// than its bound, with no timeout configured and with try_timeout and
// timeout, its body streamed or in hand (weir's own exchange, far fewer).
// Streamed, the body's guard against a client that pauses its upload (a
// breakRead when a try's time is up) costs nothing where no time can be up,
// nothing beyond the timer a try_timeout already has, and one hook per
// request with a timeout. The measure counts the whole process's allocations
// (the client's and the canned backend's are none per request).
func TestH1POSTAllocs(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  Config
		max  float64
		body string
	}{
		{"no timeout", Config{}, h1POSTAllocs, h1StreamedBody},
		{"try_timeout", Config{TryTimeout: time.Minute}, h1POSTAllocs + 7, h1StreamedBody},
		{"timeout and try_timeout", Config{Timeout: time.Minute, TryTimeout: time.Minute}, h1POSTAllocs + 17, h1StreamedBody},
		{"body in hand", Config{}, h1InHandPOSTAllocs, "hi"},
		{"body in hand, try_timeout", Config{TryTimeout: time.Minute}, h1InHandPOSTAllocs + 9, "hi"},
		{"body in hand, timeout and try_timeout", Config{Timeout: time.Minute, TryTimeout: time.Minute}, h1InHandPOSTAllocs + 16, "hi"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := serveOn(t, c.cfg, []Backend{{Addr: cannedBackend(t), Weight: 1, Usable: true}})
			req := "POST /form HTTP/1.1\r\nHost: " + s.Addr().String() + "\r\nContent-Type: text/plain\r\nContent-Length: " +
				strconv.Itoa(len(c.body)) + "\r\n\r\n" + c.body
			got := h1AllocsPerRequest(t, s, req)
			max := c.max
			if raceDetector {
				// Its sync.Pools drop a share of what is put back: 6 more
				// in each case, measured.
				max += 8
			}
			t.Logf("%.1f allocations per POST", got)
			if got > max {
				t.Errorf("got %.1f allocations per keep-alive POST; want at most %.0f", got, max)
			}
		})
	}
}

// h1GETAllocs bounds the allocations of a keep-alive GET through the loop
// (the request's and the answer's parse by the standard library): 20 at
// c5b04b2, of which the status code's digits and the answer's body wrapper
// were weir's own, and with a query in the target, the upstream request
// target joined into one string.
const h1GETAllocs = 18

// TestH1GETAllocs: a keep-alive GET through the loop, weir's own exchange
// carrying it, allocates no more than its bound, with a query in its target
// too; what the plane's own code allocates per request shows here first.
func TestH1GETAllocs(t *testing.T) {
	for _, target := range []string{"/index.html", "/search?q=weir&page=2"} {
		t.Run(target, func(t *testing.T) {
			s := serveOn(t, Config{XForwardedFor: true, XForwardedProto: true}, []Backend{{Addr: cannedBackend(t), Weight: 1, Usable: true}})
			got := h1AllocsPerRequest(t, s, "GET "+target+" HTTP/1.1\r\nHost: "+s.Addr().String()+"\r\nUser-Agent: test\r\nAccept: */*\r\n\r\n")
			max := float64(h1GETAllocs)
			if raceDetector {
				max += 8 // as for a POST: the race detector's pools drop a share
			}
			t.Logf("%.1f allocations per GET", got)
			if got > max {
				t.Errorf("got %.1f allocations per keep-alive GET; want at most %.0f", got, max)
			}
		})
	}
}

// keepAliveRoundTrip returns a function that sends req on conn and reads its
// answer whole. The answer's length is learned from the first one; every
// answer is the same but for its Date, whose length is fixed.
func keepAliveRoundTrip(tb testing.TB, conn net.Conn, req []byte) func() {
	buf := make([]byte, 4096)
	want := 0
	return func() {
		if _, err := conn.Write(req); err != nil {
			tb.Fatal(err)
		}
		have := 0
		for want == 0 || have < want {
			n, err := conn.Read(buf[have:])
			if err != nil {
				tb.Fatal(err)
			}
			have += n
			if want == 0 {
				want = answerLength(buf[:have])
			}
		}
	}
}

// h1AllocsPerRequest is the process's allocations per request of req sent
// again and again on one keep-alive connection to s (whose backend is
// cannedBackend, which allocates none per request, nor does the client).
//
// The bounds measured with it are exact: on a loaded machine, with
// GOMAXPROCS=1 and with GOGC=1 they came out the same on every run. Noise can
// only add to a measure: a request slower than h1WatchAfter pays about 3
// allocations for its connection's watch (a measure in which a third of the
// requests stall goes one over), and under the race detector a GC empties the
// pools (one more with GOGC=1). The least of three measures keeps such noise
// out; a cost the code adds shows in all three.
func h1AllocsPerRequest(t *testing.T, s *Service, req string) float64 {
	t.Helper()
	conn, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	roundTrip := keepAliveRoundTrip(t, conn, []byte(req))
	for range 10 {
		roundTrip() // pools and the backend's connection warmed
	}
	got := math.Inf(1)
	for range 3 {
		got = min(got, testing.AllocsPerRun(200, roundTrip))
	}
	return got
}
