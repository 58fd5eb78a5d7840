package httplb

import (
	"bufio"
	"bytes"
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

// Requests with a short body that came whole with their head go through weir's
// own upstream exchange (h1Pool), as requests without a body do; any other
// body streams through http.Transport.

// echoFromBackend answers each request with its body, and in X-Conn the address
// weir's connection to it came from: which pool carried the request.
func echoFromBackend(t *testing.T) *countingBackend {
	return startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		w.Header().Set("X-Conn", r.RemoteAddr)
		w.Header().Set("X-Len", strconv.Itoa(len(b)))
		w.Write(b)
	}, 0)
}

// postRaw writes a POST of body to /echo in one write, reads its answer and
// returns it with its body.
func postRaw(t *testing.T, conn net.Conn, br *bufio.Reader, body []byte, extra string) (*http.Response, []byte) {
	t.Helper()
	req := fmt.Sprintf("POST /echo HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n", extra, len(body))
	if _, err := conn.Write(append([]byte(req), body...)); err != nil {
		t.Fatal(err)
	}
	return readRaw(t, br, "POST")
}

func readRaw(t *testing.T, br *bufio.Reader, method string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the answer's body: %v", err)
	}
	return resp, got
}

// pattern is n bytes that differ from position to position, so a byte lost,
// doubled or moved shows.
func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + i*7%26)
	}
	return b
}

// TestH1SmallBodyOwnExchange: GETs and POSTs and PUTs with a short body, one
// after another on a keep-alive client connection, all go over the one
// upstream connection of weir's own exchange, each body whole. Before, every
// request with a body went through http.Transport, which dialled a connection
// of its own.
func TestH1SmallBodyOwnExchange(t *testing.T) {
	be := echoFromBackend(t)
	s := serveOn(t, Config{}, []Backend{{Addr: be.addr, Weight: 1, Usable: true}})
	conn, br := rawConn(t, s.Addr().String())
	for i, method := range []string{"GET", "POST", "GET", "PUT", "POST", "DELETE"} {
		body := []byte(fmt.Sprintf(`{"n":%d}`, i))
		if method == "GET" {
			body = nil
		}
		fmt.Fprintf(conn, "%s /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", method, len(body), body)
		resp, got := readRaw(t, br, method)
		if resp.StatusCode != 200 || !bytes.Equal(got, body) {
			t.Fatalf("%s %d: got %d %q; want 200 %q", method, i, resp.StatusCode, got, body)
		}
	}
	if n := be.accepted.Load(); n != 1 {
		t.Errorf("the backend accepted %d connections for the 6 requests; want 1, weir's own exchange's", n)
	}
}

// TestH1BodySizes: bodies of every size around the bound (what the loop's 4 KiB
// reader holds past the request's head) reach the backend byte for byte, each
// sent in one write on a connection of its own; those within the bound go by
// weir's own exchange (the upstream connection a GET took), the others by
// http.Transport (another). A body of 0 bytes with a Content-Length goes with
// "Content-Length: 0".
func TestH1BodySizes(t *testing.T) {
	be := echoFromBackend(t)
	s := serveOn(t, Config{}, []Backend{{Addr: be.addr, Weight: 1, Usable: true}})
	addr := s.Addr().String()
	conn, br := rawConn(t, addr)
	io.WriteString(conn, "GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
	resp, _ := readRaw(t, br, "GET")
	own := resp.Header.Get("X-Conn")
	headLen := func(n int) int {
		return len(fmt.Sprintf("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", n))
	}
	bound := 4096 - headLen(4000) // every size near it has 4 digits
	for _, n := range []int{0, 1, 2, 512, 1500, bound - 1, bound, bound + 1, 4096, 5000, 64<<10 + 1} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			conn, br := rawConn(t, addr)
			body := pattern(n)
			resp, got := postRaw(t, conn, br, body, "")
			if resp.StatusCode != 200 || !bytes.Equal(got, body) || resp.Header.Get("X-Len") != strconv.Itoa(n) {
				t.Fatalf("got %d, %d bytes (the backend read %s); want 200 and the %d bytes sent", resp.StatusCode, len(got), resp.Header.Get("X-Len"), n)
			}
			wantOwn := n <= bound
			if gotOwn := resp.Header.Get("X-Conn") == own; gotOwn != wantOwn {
				t.Errorf("carried by weir's own exchange: %v; want %v (bound %d)", gotOwn, wantOwn, bound)
			}
		})
	}
}

// TestH1BodySplit: a short body that comes in pieces, after its head, reaches
// the backend whole. The backend is sent the head before the body has all
// come (http.Transport streams it), and the rest follows once it has; a body
// split inside its head the same.
func TestH1BodySplit(t *testing.T) {
	entered := make(chan struct{}, 1)
	be := startCountingBackend(t, func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	}, 0)
	s := serveOn(t, Config{}, []Backend{{Addr: be.addr, Weight: 1, Usable: true}})
	body := pattern(700)
	req := append([]byte(fmt.Sprintf("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", len(body))), body...)
	headEnd := bytes.Index(req, []byte("\r\n\r\n")) + 4
	for _, c := range []struct {
		name    string
		at      int
		waitFor bool // the backend has the request before the rest is sent
	}{
		{"after the head", headEnd, true},
		{"inside the body", headEnd + 300, true},
		{"at its last byte", len(req) - 1, true},
		{"inside the head", headEnd - 10, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, br := rawConn(t, s.Addr().String())
			if _, err := conn.Write(req[:c.at]); err != nil {
				t.Fatal(err)
			}
			if c.waitFor {
				select {
				case <-entered:
				case <-time.After(10 * time.Second):
					t.Fatal("the backend got no request within 10 s of its head")
				}
			}
			if _, err := conn.Write(req[c.at:]); err != nil {
				t.Fatal(err)
			}
			resp, got := readRaw(t, br, "POST")
			if resp.StatusCode != 200 || !bytes.Equal(got, body) {
				t.Fatalf("got %d, %q; want 200 and the body sent", resp.StatusCode, got)
			}
			if !c.waitFor {
				<-entered // sent before the answer: the next case's to take is its own
			}
		})
	}
}

// reuseClosingBackend answers the first request on each connection and closes
// the connection when the second comes, without a word: what a backend whose
// idle timeout ends a connection just as a request goes out on it looks like.
// It counts the requests that came on each connection.
type reuseClosingBackend struct {
	addr netip.AddrPort
	mu   sync.Mutex
	got  []string // method and target of each request, in order
}

func startReuseClosingBackend(t *testing.T) *reuseClosingBackend {
	b := &reuseClosingBackend{}
	b.addr = rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for i := 0; ; i++ {
			req, ok := nextRequest(br)
			if !ok {
				return
			}
			b.mu.Lock()
			b.got = append(b.got, req.Method+" "+req.RequestURI)
			b.mu.Unlock()
			if i == 1 {
				return // closes: the deferred Close of rawBackend
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	return b
}

func (b *reuseClosingBackend) requests() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.got...)
}

// TestH1SmallBodyReusedClosed: a request with a short body whose reused
// upstream connection the backend closes as the request goes out is sent
// again on a new connection only if it may be sent twice (http.Transport's
// rule: its method is safe, or it has an Idempotency-Key; its body is in
// hand): a POST gets a 502 and reached the backend once; one with an
// Idempotency-Key is sent again and answered.
func TestH1SmallBodyReusedClosed(t *testing.T) {
	for _, c := range []struct {
		name   string
		extra  string
		status int
		sent   int // times the POST reached the backend
	}{
		{"POST", "", http.StatusBadGateway, 1},
		{"POST with an Idempotency-Key", "Idempotency-Key: k1\r\n", http.StatusOK, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			be := startReuseClosingBackend(t)
			s := serveOn(t, Config{}, []Backend{{Addr: be.addr, Weight: 1, Usable: true}})
			conn, br := rawConn(t, s.Addr().String())
			io.WriteString(conn, "GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
			if resp, _ := readRaw(t, br, "GET"); resp.StatusCode != 200 {
				t.Fatalf("GET /first: %d; want 200", resp.StatusCode)
			}
			resp, _ := postRaw(t, conn, br, []byte(`{"a":1}`), c.extra)
			if resp.StatusCode != c.status {
				t.Errorf("POST on the connection the backend closes: %d; want %d", resp.StatusCode, c.status)
			}
			posts := 0
			for _, r := range be.requests() {
				if r == "POST /echo" {
					posts++
				}
			}
			if posts != c.sent {
				t.Errorf("the POST reached the backend %d times (%q); want %d", posts, be.requests(), c.sent)
			}
		})
	}
}

// TestH1SmallBodyEarlyAnswer: a backend that answers (413) before it reads the
// body of a request weir's own exchange carries gets its answer to the client,
// and the client's connection goes on; the upstream connection, which the
// answer closes, is not reused.
func TestH1SmallBodyEarlyAnswer(t *testing.T) {
	var mu sync.Mutex
	conns := 0
	be := rawBackend(t, func(c net.Conn) {
		mu.Lock()
		conns++
		mu.Unlock()
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.Method == "POST" {
			io.WriteString(c, "HTTP/1.1 413 Content Too Large\r\nContent-Length: 8\r\nConnection: close\r\n\r\ntoo long")
			// Reads on until weir closes, so the unread body resets nothing.
			c.(*net.TCPConn).CloseWrite()
			io.Copy(io.Discard, br)
			return
		}
		io.Copy(io.Discard, req.Body)
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	})
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	conn, br := rawConn(t, s.Addr().String())
	resp, got := postRaw(t, conn, br, pattern(1000), "")
	if resp.StatusCode != http.StatusRequestEntityTooLarge || string(got) != "too long" || resp.Close {
		t.Fatalf("got %d %q close=%v; want the backend's 413 \"too long\", the client's connection kept", resp.StatusCode, got, resp.Close)
	}
	io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if resp, got := readRaw(t, br, "GET"); resp.StatusCode != 200 || string(got) != "ok" {
		t.Fatalf("the next request: %d %q; want 200 ok", resp.StatusCode, got)
	}
	waitfor.Value(t, 5*time.Second, "2 upstream connections, the 413's not reused", func() (any, bool) {
		mu.Lock()
		defer mu.Unlock()
		return conns, conns == 2
	})
}
