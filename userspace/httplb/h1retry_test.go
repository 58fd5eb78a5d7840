package httplb

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// hungBackend is an address whose accept queue is full: a connect to it hangs
// (the SYNs are dropped), as to a host that is down behind a firewall.
func hungBackend(t *testing.T) netip.AddrPort {
	t.Helper()
	addr, _, _ := hungListener(t)
	return addr
}

// hungListener is hungBackend's listening socket, and how many connections
// fill its accept queue (the first its fd accepts; closed at cleanup).
func hungListener(t *testing.T) (addr netip.AddrPort, fd, fillers int) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, _ := syscall.Getsockname(fd)
	addr = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(sa.(*syscall.SockaddrInet4).Port))
	for ; ; fillers++ { // fill the accept queue until a connect hangs
		c, err := net.DialTimeout("tcp", addr.String(), 200*time.Millisecond)
		if err != nil {
			break
		}
		t.Cleanup(func() { c.Close() })
		if fillers > 16 {
			t.Fatal("cannot fill the accept queue: a connect to it does not hang")
		}
	}
	return addr, fd, fillers
}

// TestH1RetryAfterTryTimeoutInDial: a PUT whose client sent its whole
// body at once; the first backend's connect hangs past try_timeout, so the
// request is retried on the second, healthy backend. It must succeed there.
func TestH1RetryAfterTryTimeoutInDial(t *testing.T) {
	hung := hungBackend(t)
	good, _ := h1TestBackend(t)
	body := strings.Repeat("x", 20000) // more than the reader's buffer holds
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			obs := &outcomeLog{}
			// try_timeout bounds the healthy backend's try too: 300 ms was
			// passed there on a loaded machine (a 504). Each request waits
			// it out once on the hung backend, so fewer requests.
			s := serveOn(t, Config{NetHTTP1: engine == "net_http", TryTimeout: time.Second, Retries: 1, Observer: obs},
				[]Backend{{Addr: hung, Weight: 1000, Usable: true}, {Addr: good, Weight: 1, Usable: true}})
			failed, tries := 0, 6
			for i := 0; i < tries; i++ {
				conn, br := rawConn(t, s.Addr().String())
				fmt.Fprintf(conn, "PUT /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Logf("request %d: %v", i, err)
					failed++
					continue
				}
				io.Copy(io.Discard, resp.Body)
				if resp.StatusCode != 200 {
					t.Logf("request %d: status %d", i, resp.StatusCode)
					failed++
				}
				conn.Close()
			}
			if failed > 0 {
				t.Errorf("%d of %d PUTs failed; want all answered by the healthy backend after the hung one's try_timeout (outcomes %v)", failed, tries, obs.get())
			}
		})
	}
}

// TestRetryCountedWhenClientLeaves: a retry sent to a backend is counted in
// its retries though the client goes away before the answer, through every
// upstream pool. Before, the HTTP/1.1 and net/http paths counted a retry only
// once the try had returned whole, and a client that left mid-try ended the
// request before it: the retry went uncounted.
func TestRetryCountedWhenClientLeaves(t *testing.T) {
	for _, p := range upstreamPools {
		t.Run(p.name, func(t *testing.T) {
			var n atomic.Int32
			came := make(chan struct{}, 1)
			// The first request either backend gets is answered 503, so
			// it is retried on the other, which holds it until weir
			// breaks it off.
			h := func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				if n.Add(1) == 1 {
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				came <- struct{}{}
				select {
				case <-r.Context().Done():
				case <-time.After(20 * time.Second):
				}
			}
			a, b := startCountingBackend(t, h, 0), startCountingBackend(t, h, 0)
			cfg := p.cfg
			cfg.Retries = 1
			sv := serveStoppable(t, cfg, []Backend{{Addr: a.addr, Weight: 1, Usable: true}, {Addr: b.addr, Weight: 1, Usable: true}})
			c := p.client()
			t.Cleanup(c.CloseIdleConnections)
			method := "GET"
			var body io.Reader
			if p.method != "GET" {
				method, body = "PUT", strings.NewReader("a request body") // retried, as a POST is not
				if p.stream {
					body = struct{ io.Reader }{body}
				}
			}
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel)
			req, err := http.NewRequestWithContext(ctx, method, "http://"+sv.Addr().String()+"/", body)
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			// Exits when the request is cancelled below (or the backend lets
			// it go after 20s).
			go func() {
				resp, err := c.Do(req)
				if err == nil {
					resp.Body.Close()
				}
				done <- err
			}()
			awaitCame(t, came)
			cancel()
			if err := <-done; err == nil {
				t.Fatal("the request cancelled mid-retry was answered")
			}
			awaitOneRetry(t, sv)
		})
	}
}

// TestTunnelRetryCountedWhenClientLeaves: an upgrade's retry sent to a
// backend is counted in its retries though the client goes away before the
// backend answers, through both HTTP/1.1 engines. Before, it was counted
// only once the try had returned, which a client that left ended first.
func TestTunnelRetryCountedWhenClientLeaves(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  Config
	}{{"loop", Config{}}, {"net/http", Config{NetHTTP1: true}}} {
		t.Run(c.name, func(t *testing.T) {
			var n atomic.Int32
			came := make(chan struct{}, 1)
			// The first upgrade either backend gets is broken off before an
			// answer, so it is retried on the other, which holds it until
			// weir lets go of it.
			h := func(conn net.Conn) {
				conn.SetDeadline(time.Now().Add(20 * time.Second))
				br := bufio.NewReader(conn)
				if _, err := http.ReadRequest(br); err != nil || n.Add(1) == 1 {
					return
				}
				came <- struct{}{}
				io.Copy(io.Discard, br)
			}
			a, b := rawBackend(t, h), rawBackend(t, h)
			cfg := c.cfg
			cfg.Retries = 1
			sv := serveStoppable(t, cfg, []Backend{{Addr: a, Weight: 1, Usable: true}, {Addr: b, Weight: 1, Usable: true}})
			conn, _ := rawConn(t, sv.Addr().String())
			io.WriteString(conn, "GET /t HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: test\r\n\r\n")
			awaitCame(t, came)
			conn.Close()
			awaitOneRetry(t, sv)
		})
	}
}

// awaitOneRetry fails the test unless sv's backends count one retry in all
// within 5 s.
func awaitOneRetry(t *testing.T, sv *served) {
	t.Helper()
	waitfor.Value(t, 5*time.Second, "one retry counted", func() (any, bool) {
		var retries uint64
		for _, bs := range sv.Snapshot().Backends {
			retries += bs.Retries
		}
		return retries, retries == 1
	})
}
