package httplb

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// Framing at the edges of HTTP/1.1: answers that come before the request's
// body has, requests whose framing a proxy in front may read otherwise, and
// answers a request did not ask for.

// TestH1EarlyAnswerPausedUpload: a backend that answers before it has read the
// body (a 403 to an upload) gets its answer to a client that has paused its
// upload, within the header timeout, and the connection closes after it. The
// transport's body read, blocked on the client, held the lock the answer's
// writer waited on: the answer never went out.
func TestH1EarlyAnswerPausedUpload(t *testing.T) {
	be := rawBackend(t, func(c net.Conn) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 403 Forbidden\r\nContent-Length: 6\r\nConnection: close\r\n\r\ndenied")
	})
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http", ReadHeaderTimeout: 300 * time.Millisecond},
				[]Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			io.WriteString(conn, "PUT /up HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n0123456789")
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("no answer within 5 s while the upload is paused: %v", err)
			}
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != 403 || string(body) != "denied" || !resp.Close {
				t.Errorf("got %d %q close=%v; want the backend's 403 \"denied\" and the connection closed after it", resp.StatusCode, body, resp.Close)
			}
			// And closed it is, not held by the wait for the rest of the body.
			if n, err := br.Read(make([]byte, 1)); err == nil || isTimeout(err) {
				t.Errorf("after the answer: read %d bytes, %v; want the connection closed", n, err)
			}
		})
	}
}

// pathsBackend answers every request 200 "ok" on a kept-alive connection, after
// reading its body, and records each request's target in order.
func pathsBackend(t *testing.T) (addr netip.AddrPort, paths func() []string) {
	var mu sync.Mutex
	var seen []string
	ap := rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			mu.Lock()
			seen = append(seen, req.RequestURI)
			mu.Unlock()
			io.Copy(io.Discard, req.Body)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	return ap, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), seen...)
	}
}

// TestH1AmbiguousFramingCloses: a request with both Transfer-Encoding and
// Content-Length, or an HTTP/1.0 request with Transfer-Encoding, is answered
// and its connection closed (RFC 9112 6.1, 6.3): a proxy in front that framed
// it by the other field took what follows for another request's bytes, and
// serving them as a request of their own is request smuggling. Requests framed
// one way only keep their connection.
func TestH1AmbiguousFramingCloses(t *testing.T) {
	const smuggled = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
	for _, c := range []struct {
		name, req string
		close     bool
	}{
		{"chunked and Content-Length", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", true},
		{"Content-Length first in lower case", "POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", true},
		{"HTTP/1.0 with Transfer-Encoding", "POST / HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n5c\r\n", true},
		{"chunked alone", "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", false},
		{"Content-Length alone", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nabcd", false},
		{"HTTP/1.0 keep-alive", "POST / HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 4\r\n\r\nabcd", false},
		{"bare LF, both", "POST / HTTP/1.1\nHost: x\nContent-Length: 4\nTransfer-Encoding: chunked\n\n0\r\n\r\n", true},
		{"bare LF, chunked alone", "POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n\n0\r\n\r\n", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			be, paths := pathsBackend(t)
			s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, c.req+smuggled)
			resp, err := http.ReadResponse(br, &http.Request{Method: "POST"})
			if err != nil {
				t.Fatalf("reading the answer: %v", err)
			}
			io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != 200 || resp.Close != c.close {
				t.Errorf("got %d close=%v; want 200 close=%v", resp.StatusCode, resp.Close, c.close)
			}
			next, err := http.ReadResponse(br, nil)
			switch {
			case c.close && err == nil:
				t.Errorf("the bytes after the request were answered (%d) as a request of their own", next.StatusCode)
			case !c.close && err != nil:
				t.Errorf("the next request on the connection: %v", err)
			}
			if got := paths(); c.close && len(got) != 1 {
				t.Errorf("the backend was sent %q; want only the first request", got)
			}
		})
	}
}

// TestH1UnaskedSwitch: a 101 to a request that asked for no upgrade is a
// backend's malformed answer (502), not relayed: the client would read what
// follows as another protocol's bytes while weir still spoke HTTP to it.
func TestH1UnaskedSwitch(t *testing.T) {
	be := answeringBackend(t, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: foo\r\nConnection: Upgrade\r\n\r\n")
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			for _, req := range []string{
				"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
				"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
			} {
				conn, br := rawConn(t, s.Addr().String())
				io.WriteString(conn, req)
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("%q: reading the answer: %v", req, err)
				}
				if resp.StatusCode != http.StatusBadGateway {
					t.Errorf("%q: got %d; want 502", req, resp.StatusCode)
				}
			}
		})
	}
}

// TestH1H2CUpgradeNeedsHTTP11: the h2c upgrade is an HTTP/1.1 request's, whose
// Connection names Upgrade and HTTP2-Settings (RFC 9110 7.8, RFC 7540 3.2); a
// request with less is answered over HTTP/1.x as a plain one.
func TestH1H2CUpgradeNeedsHTTP11(t *testing.T) {
	be, _ := h1TestBackend(t)
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	for _, c := range []struct {
		name, req string
		status    int
	}{
		{"HTTP/1.0", "GET / HTTP/1.0\r\nUpgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: \r\n\r\n", 200},
		{"no Upgrade in Connection", "GET / HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: HTTP2-Settings\r\nHTTP2-Settings: \r\n\r\n", 200},
		{"the upgrade", "GET / HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: \r\n\r\n", 101},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, c.req)
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatal(err)
			}
			if f := strings.Fields(line); len(f) < 2 || f[1] != strconv.Itoa(c.status) {
				t.Errorf("got %q; want status %d", strings.TrimSpace(line), c.status)
			}
		})
	}
}

func TestHeadLen(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int
	}{
		{"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody", 27},
		{"GET / HTTP/1.1\nHost: x\n\nbody", 24},
		{"GET / HTTP/1.1\r\nHost: x\n\r\n", 26},
		{"GET / HTTP/1.1\r\nHost: x\r\n", 0},
		{"GET / HTTP/1.1\r\nHost: x\r\n\r", 0},
		{"", 0},
	} {
		if got := headLen([]byte(c.in)); got != c.want {
			t.Errorf("headLen(%q) = %d; want %d", c.in, got, c.want)
		}
	}
}

// TestH1TargetAsWritten: the request target goes to the backend as the client
// wrote it (as nginx and HAProxy send it): a signed URL's signature, a cache
// key or a backend's routing may cover its exact bytes. Rebuilt from the
// parsed URL, /a{b} went as /a%7Bb%7D and /x? as /x. Absolute form sends its
// path; a path starting "//" and the asterisk form go as they came too.
func TestH1TargetAsWritten(t *testing.T) {
	be, paths := pathsBackend(t)
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			for _, c := range []struct{ target, want string }{
				{"/a{b}", "/a{b}"},
				{"/a|b^c\"d", "/a|b^c\"d"},
				{"/x?", "/x?"},
				{"/p%2Fq?r=%20s&t", "/p%2Fq?r=%20s&t"},
				{"/caf%C3%A9/%7e", "/caf%C3%A9/%7e"},
				{"//double/slash?q", "//double/slash?q"},
				{"http://x/abs{1}?y", "/abs{1}?y"},
				{"http://x", "/"},
				{"http://x?q/a", "/?q/a"},
			} {
				before := len(paths())
				conn, br := rawConn(t, s.Addr().String())
				io.WriteString(conn, "GET "+c.target+" HTTP/1.1\r\nHost: x\r\n\r\n")
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("%s: %v", c.target, err)
				}
				resp.Body.Close()
				got := paths()
				if resp.StatusCode != 200 || len(got) != before+1 || got[before] != c.want {
					t.Errorf("%s: answered %d, the backend saw %q; want %q", c.target, resp.StatusCode, got[before:], c.want)
				}
			}
		})
	}
}

// TestH1SwitchWithClose: a backend's 101 whose Connection also says close
// switches all the same, as nginx switches: the fields its Connection names are
// dropped, but its Upgrade, which names the protocol switched to, is kept (the
// response parser drops that Connection field whole, and the switch was refused
// for want of an Upgrade).
func TestH1SwitchWithClose(t *testing.T) {
	be := answeringBackend(t, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade, close, X-Internal\r\n"+
		"Upgrade: websocket\r\nX-Internal: secret\r\nX-Kept: 1\r\n\r\n")
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	c, br := rawConn(t, s.Addr().String())
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols || resp.Header.Get("Upgrade") != "websocket" ||
		resp.Header.Get("X-Internal") != "" || resp.Header.Get("X-Kept") != "1" {
		t.Errorf("got %s, Upgrade %q, X-Internal %q, X-Kept %q; want 101, websocket, none, 1",
			resp.Status, resp.Header.Get("Upgrade"), resp.Header.Get("X-Internal"), resp.Header.Get("X-Kept"))
	}
}

// TestH1LongAnswerHeadMemory: an answer's head past the reader its connection
// (or an upgrade) reads with is read into a larger reader that grows with the
// head, up to the budget for heads, not into one the budget's size at once:
// with max_header_bytes at its 16 MiB top, a request whose answer has a 40 KiB
// head costs a few hundred KiB, not 16 MiB.
func TestH1LongAnswerHeadMemory(t *testing.T) {
	pad := strings.Repeat("p", 40<<10)
	be := answeringBackend(t, "HTTP/1.1 200 OK\r\nX-Pad: "+pad+"\r\nContent-Length: 2\r\n\r\nok")
	for _, p := range answerPaths {
		if p.name == "transport" {
			continue
		}
		t.Run(p.name, func(t *testing.T) {
			s := serveOn(t, Config{MaxHeaderBytes: 16 << 20}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			const requests = 8
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for range requests {
				c, br := rawConn(t, s.Addr().String())
				io.WriteString(c, p.req)
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatal(err)
				}
				body, err := io.ReadAll(resp.Body)
				if err != nil || resp.StatusCode != 200 || string(body) != "ok" || resp.Header.Get("X-Pad") != pad {
					t.Fatalf("got %s %q (%v), X-Pad of %d bytes; want 200 \"ok\" and the pad", resp.Status, body, err, len(resp.Header.Get("X-Pad")))
				}
				c.Close()
			}
			runtime.ReadMemStats(&after)
			if per := (after.TotalAlloc - before.TotalAlloc) / requests; per > 2<<20 {
				t.Errorf("got %d bytes allocated per request; want at most 2 MiB for a 40 KiB head", per)
			}
		})
	}
}

// TestH1ConnectionListedWithClose: the fields a backend's Connection names
// are not forwarded (RFC 9110 7.6.1), also when it says close: the response
// parser drops such a Connection field whole, names and all, and the names
// are taken from the answer's head as it came, whatever its size (a head past
// the 32 KiB the upstream connection's reader holds was not looked at), on
// weir's own exchange and in the answer to an upgrade that declines it (which
// did not look). (Requests with a body, which http.Transport carries, keep its
// parser's loss.)
func TestH1ConnectionListedWithClose(t *testing.T) {
	for _, conn := range []string{"close, X-Internal", "X-Internal, close", "X-Internal"} {
		for _, pad := range []int{0, 40 << 10} {
			for _, p := range answerPaths {
				if p.name == "transport" {
					continue
				}
				t.Run(fmt.Sprintf("%s/%d bytes more/%s", conn, pad, p.name), func(t *testing.T) {
					be := answeringBackend(t, "HTTP/1.1 200 OK\r\nX-Pad: "+strings.Repeat("p", pad)+"\r\nConnection: "+conn+
						"\r\nX-Internal: secret\r\nX-Kept: 1\r\nContent-Length: 2\r\n\r\nok")
					s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
					c, br := rawConn(t, s.Addr().String())
					io.WriteString(c, p.req)
					resp, err := http.ReadResponse(br, nil)
					if err != nil {
						t.Fatal(err)
					}
					if v := resp.Header.Get("X-Internal"); v != "" || resp.Header.Get("X-Kept") != "1" || len(resp.Header.Get("X-Pad")) != pad {
						t.Errorf("%s: X-Internal %q, X-Kept %q, X-Pad of %d bytes; want the first dropped, the others kept",
							resp.Status, v, resp.Header.Get("X-Kept"), len(resp.Header.Get("X-Pad")))
					}
				})
			}
		}
	}
}

// TestH1TimeoutPausedUpload: http.timeout and try_timeout bound a request
// whose client has paused its upload while its backend is silent or has
// failed: the client gets its 504 (or the 502 of the reset, when the transport
// saw it as it wrote; or, through net/http's server, which takes the
// broken-off body read for the client's going, its connection closed) within
// the timeout and the header timeout, and the request ends. Go's transport
// returns from a failed or timed-out request only once its body read has, and
// that read waited for the client for ever; and net/http's server framed a
// 502 only once it had read the rest of the body, which never came.
func TestH1TimeoutPausedUpload(t *testing.T) {
	silent := rawBackend(t, func(c net.Conn) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		io.Copy(io.Discard, c) // until the plane closes the connection
	})
	failing := rawBackend(t, func(c net.Conn) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		c.(*net.TCPConn).SetLinger(0) // a reset, not an answer
	})
	for _, engine := range h1Engines {
		for _, c := range []struct {
			name   string
			be     netip.AddrPort
			cfg    Config
			method string
		}{
			{"timeout/silent", silent, Config{Timeout: 300 * time.Millisecond}, "POST"},
			{"timeout/reset", failing, Config{Timeout: 300 * time.Millisecond}, "POST"},
			{"try_timeout/silent", silent, Config{TryTimeout: 300 * time.Millisecond}, "PUT"},
		} {
			t.Run(engine+"/"+c.name, func(t *testing.T) {
				cfg := c.cfg
				cfg.NetHTTP1, cfg.ReadHeaderTimeout = engine == "net_http", 300*time.Millisecond
				s := serveOn(t, cfg, []Backend{{Addr: c.be, Weight: 1, Usable: true}})
				conn, br := rawConn(t, s.Addr().String())
				conn.SetDeadline(time.Now().Add(5 * time.Second))
				io.WriteString(conn, c.method+" /up HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n0123456789")
				resp, err := http.ReadResponse(br, nil)
				switch {
				case isTimeout(err):
					t.Fatalf("neither an answer nor the connection closed within 5 s while the upload is paused")
				case err != nil && engine == "loop":
					t.Fatalf("reading the answer: %v; want a 504", err)
				case err == nil:
					io.Copy(io.Discard, resp.Body)
					reset := c.be == failing && resp.StatusCode == http.StatusBadGateway
					if resp.StatusCode != http.StatusGatewayTimeout && !reset || !resp.Close {
						t.Errorf("got %d close=%v; want 504 (502 for a reset) and the connection closed after it", resp.StatusCode, resp.Close)
					}
				}
				waitfor.Value(t, 5*time.Second, "no request in flight", func() (any, bool) {
					n := s.Snapshot().InFlight
					return n, n == 0
				})
			})
		}
	}
}

// TestH1PausedUploadAnswered: an answer weir makes itself (503: no usable
// backend) to a client that has paused its upload goes out within the header
// timeout, and the connection closes after it. net/http's server framed it
// only once it had read the rest of the body, which never came.
func TestH1PausedUploadAnswered(t *testing.T) {
	be, _ := h1TestBackend(t)
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http", ReadHeaderTimeout: 300 * time.Millisecond},
				[]Backend{{Addr: be, Weight: 1, Usable: false}})
			conn, br := rawConn(t, s.Addr().String())
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			io.WriteString(conn, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n0123456789")
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("no answer within 5 s while the upload is paused: %v", err)
			}
			io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != http.StatusServiceUnavailable || !resp.Close {
				t.Errorf("got %d close=%v; want 503 and the connection closed after it", resp.StatusCode, resp.Close)
			}
		})
	}
}

// TestH1TrailersOfAnEmptyBody: a backend's trailers reach the client when its
// chunked answer has no body bytes (a trailers-only answer, as gRPC-Web and
// digest fields have them): the answer goes chunked, not with a Content-Length
// of 0, which has no room for trailers.
func TestH1TrailersOfAnEmptyBody(t *testing.T) {
	be := answeringBackend(t, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n0\r\nX-Sum: 42\r\n\r\n")
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			checkAnswer(t, br, wantAnswer{status: 200, chunked: true, trailer: map[string]string{"X-Sum": "42"}})
		})
	}
}

// answerPaths are the ways weir reads a backend's HTTP/1.1 answer: its own
// exchange (a request without a body), http.Transport (a request with one) and
// an upgrade's (an answer that declines it, or a switch).
var answerPaths = []struct{ name, req string }{
	{"own exchange", "GET / HTTP/1.1\r\nHost: x\r\n\r\n"},
	{"transport", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"},
	{"upgrade", "GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"},
}

// closingBackend answers a connection's first request with what answer
// writes, then reads on, and sends to the channel it returns when the
// connection has ended (the plane closed it) or answer failed. Each test that
// waits on the channel takes a backend of its own, so that no signal from
// another's connection can stand for its own.
func closingBackend(t *testing.T, answer func(c net.Conn) error) (netip.AddrPort, <-chan struct{}) {
	closed := make(chan struct{}, 16)
	be := rawBackend(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(20 * time.Second))
		br := bufio.NewReader(c)
		if _, ok := nextRequest(br); !ok {
			return
		}
		if answer(c) == nil {
			io.Copy(io.Discard, br)
		}
		closed <- struct{}{}
	})
	return be, closed
}

// refusedAnswer checks that a request sent on its own connection to s gets a
// 502, that the backend's connection is closed, and that the backend alone
// was blamed, with one Reset.
func refusedAnswer(t *testing.T, s *Service, obs *outcomeLog, req string, closed <-chan struct{}) {
	t.Helper()
	conn, br := rawConn(t, s.Addr().String())
	io.WriteString(conn, req)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("reading the answer: %v; want a 502", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("got %s; want 502", resp.Status)
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Errorf("the backend's connection still open 10 s after the answer; want it closed")
	}
	waitfor.Value(t, 5*time.Second, "no request in flight", func() (any, bool) {
		n := s.Snapshot().InFlight
		return n, n == 0
	})
	if got := obs.get(); len(got) != 1 || got[0] != Reset {
		t.Errorf("outcomes told to the health checker: %v; want one Reset", got)
	}
}

// TestH1InterimFlood: a backend that sends interim (1xx) answers without end
// has them read within the budget of the answer's head (max_header_bytes, at
// least 64 KiB, for all of them and the answer), as http.Transport reads them,
// and no further: the client gets a 502, the backend is blamed, and its
// connection is closed. weir's own exchange and an upgrade's read and dropped
// them for as long as they came.
func TestH1InterimFlood(t *testing.T) {
	hints := []byte(strings.Repeat("HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n", 64))
	for _, engine := range h1Engines {
		for _, p := range answerPaths {
			t.Run(engine+"/"+p.name, func(t *testing.T) {
				// A backend of the subtest's own: an earlier subtest's
				// connection, closed late, cannot stand for this one's.
				be, closed := closingBackend(t, func(c net.Conn) error {
					for {
						if _, err := c.Write(hints); err != nil {
							return err
						}
					}
				})
				obs := &outcomeLog{}
				s := serveOn(t, Config{NetHTTP1: engine == "net_http", Observer: obs}, []Backend{{Addr: be, Weight: 1, Usable: true}})
				refusedAnswer(t, s, obs, p.req, closed)
			})
		}
	}
}

// TestH1AmbiguousAnswer: an answer framed by both Transfer-Encoding and
// Content-Length, which a server must not send (RFC 9112 6.1), is refused as
// nginx refuses it: a 502, the backend blamed, its connection closed. Go's
// reader frames it by the transfer coding (by the length in HTTP/1.0) and
// weir kept the connection: if the backend framed it otherwise, what it sent
// past the answer was read as the next answer, another client's. An answer
// framed by one of them goes through. (http.Transport, which carries requests
// with a body, drops Content-Length before weir sees it.)
func TestH1AmbiguousAnswer(t *testing.T) {
	for _, c := range []struct {
		name, answer string
		refused      bool
	}{
		{"chunked and Content-Length", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 7\r\n\r\n2\r\nok\r\n0\r\n\r\n", true},
		{"Content-Length first, lower case", "HTTP/1.1 200 OK\r\ncontent-length: 7\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", true},
		{"HTTP/1.0 keep-alive with both", "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\nok", true},
		{"chunked alone", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", false},
		{"Content-Length alone", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", false},
	} {
		for _, engine := range h1Engines {
			for _, p := range answerPaths {
				if p.name == "transport" {
					continue
				}
				t.Run(c.name+"/"+engine+"/"+p.name, func(t *testing.T) {
					// A backend of the subtest's own, as in TestH1InterimFlood.
					be, closed := closingBackend(t, func(conn net.Conn) error {
						_, err := io.WriteString(conn, c.answer)
						return err
					})
					obs := &outcomeLog{}
					s := serveOn(t, Config{NetHTTP1: engine == "net_http", Observer: obs}, []Backend{{Addr: be, Weight: 1, Usable: true}})
					if c.refused {
						refusedAnswer(t, s, obs, p.req, closed)
						return
					}
					conn, br := rawConn(t, s.Addr().String())
					io.WriteString(conn, p.req)
					checkAnswer(t, br, wantAnswer{status: 200, body: "ok", chunked: c.name == "chunked alone"})
				})
			}
		}
	}
}
