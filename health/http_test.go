package health

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

func TestHTTPCheck(t *testing.T) {
	slow := func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(2 * time.Second):
		case <-r.Context().Done():
		}
	}
	tests := []struct {
		name       string
		handler    http.HandlerFunc
		check      HTTPCheck
		wantState  State
		wantErr    error // errors.Is target; nil for a pass
		wantReason string
	}{
		{
			name: "200 is up",
			handler: func(w http.ResponseWriter, r *http.Request) {
				if r.Host != "web.test" || r.URL.Path != "/healthz" || r.Header.Get("Connection") != "" {
					w.WriteHeader(http.StatusBadRequest)
					fmt.Fprintf(w, "host %q path %q connection %q", r.Host, r.URL.Path, r.Header.Get("Connection"))
					return
				}
				fmt.Fprint(w, "ok")
			},
			check:     HTTPCheck{Path: "/healthz", Host: "web.test"},
			wantState: Up,
		},
		{
			name:       "503 is down",
			handler:    func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) },
			wantState:  Down,
			wantErr:    ErrStatus,
			wantReason: "http status 503",
		},
		{
			name:       "404 is down unless accepted",
			handler:    func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNotFound) },
			check:      HTTPCheck{Status: []StatusRange{{200, 299}}},
			wantState:  Down,
			wantErr:    ErrStatus,
			wantReason: "http status 404",
		},
		{
			name:      "accepted status set",
			handler:   func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNotFound) },
			check:     HTTPCheck{Status: []StatusRange{{200, 299}, {404, 404}}},
			wantState: Up,
		},
		{
			name:      "body substring found",
			handler:   func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, `{"status":"serving"}`) },
			check:     HTTPCheck{Body: `"serving"`},
			wantState: Up,
		},
		{
			name:       "wrong body is down",
			handler:    func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, `{"status":"draining"}`) },
			check:      HTTPCheck{Body: `"serving"`},
			wantState:  Down,
			wantErr:    ErrBody,
			wantReason: `http body: no "\"serving\"" in the first 21 bytes`,
		},
		{
			name: "reset is down, said to be the http exchange's",
			handler: func(w http.ResponseWriter, r *http.Request) {
				c, _, err := w.(http.Hijacker).Hijack()
				if err != nil {
					return
				}
				c.(*net.TCPConn).SetLinger(0) // close with an RST
				c.Close()
			},
			wantState:  Down,
			wantErr:    syscall.ECONNRESET,
			wantReason: "http: read: connection reset by peer",
		},
		{
			name:       "slow response past the timeout is down",
			handler:    slow,
			wantState:  Down,
			wantErr:    ErrTimeout,
			wantReason: "http: timeout after 200ms",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(tt.handler)
			defer srv.Close()
			u, _ := url.Parse(srv.URL)

			c := &Checker{}
			cfg := Config{Check: Check{Kind: HTTP, Interval: 50 * time.Millisecond, Timeout: 200 * time.Millisecond, HTTP: tt.check}}
			if err := c.SetService("web", cfg); err != nil {
				t.Fatal(err)
			}
			if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "web"}); err != nil {
				t.Fatal(err)
			}
			sub := c.Subscribe()
			defer sub.Close()
			run(t, c)
			ch := waitChange(t, sub, "b", 5*time.Second, func(ch Change) bool { return ch.To != Unknown })
			st, _ := c.Status("b")
			if ch.To != tt.wantState {
				t.Fatalf("state: got %v (reason %q, last %v); want %v", ch.To, ch.Reason, st.Last.Err, tt.wantState)
			}
			if tt.wantErr == nil {
				if st.Last.Err != nil {
					t.Errorf("last error: got %v; want nil", st.Last.Err)
				}
				return
			}
			if !errors.Is(st.Last.Err, tt.wantErr) {
				t.Errorf("last error: got %v; want one wrapping %v", st.Last.Err, tt.wantErr)
			}
			if ch.Reason != tt.wantReason {
				t.Errorf("reason: got %q; want %q", ch.Reason, tt.wantReason)
			}
		})
	}
}

// countingServer is an HTTP server answering "ok" that counts the
// connections it accepts; it closes at the end of the test.
func countingServer(t *testing.T) (*httptest.Server, *atomic.Int32) {
	conns := new(atomic.Int32)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "ok") }))
	srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, conns
}

// TestHTTPKeepAlive: checks reuse one connection per backend, and a
// connection the server closed is replaced within the same check, so no
// check fails for it.
func TestHTTPKeepAlive(t *testing.T) {
	srv, conns := countingServer(t)
	u, _ := url.Parse(srv.URL)

	var checks, failed atomic.Int32
	c := &Checker{OnCheck: func(r Result) {
		checks.Add(1)
		if r.Err != nil {
			failed.Add(1)
			t.Errorf("check: got %v; want a pass", r.Err)
		}
	}}
	cfg := Config{Check: Check{Kind: HTTP, Interval: 20 * time.Millisecond, Timeout: time.Second, Initial: Up}}
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	run(t, c)
	waitfor.Value(t, 5*time.Second, "10 checks", func() (any, bool) { return checks.Load(), checks.Load() >= 10 })
	if n := conns.Load(); n != 1 {
		t.Errorf("connections for %d checks: got %d; want 1", checks.Load(), n)
	}
	srv.CloseClientConnections()
	before := checks.Load()
	waitfor.Value(t, 5*time.Second, "10 more checks", func() (any, bool) { return checks.Load(), checks.Load() >= before+10 })
	if n := conns.Load(); n != 2 {
		t.Errorf("connections after the server closed the first: got %d; want 2", n)
	}
}

// TestHTTPMaxKept: past Checker.MaxKept kept-alive connections, HTTP checks
// close theirs after the response and connect anew, and still pass; the
// backends holding the bound's slots keep one connection each, and keep their
// slots while their checks are in flight.
func TestHTTPMaxKept(t *testing.T) {
	const nBackends, maxKept = 5, 2
	srv, conns := countingServer(t)
	u, _ := url.Parse(srv.URL)

	var (
		mu     sync.Mutex
		checks = map[string]int{}
	)
	c := &Checker{MaxKept: maxKept, OnCheck: func(r Result) {
		mu.Lock()
		checks[r.ID]++
		mu.Unlock()
		if r.Err != nil {
			t.Errorf("check: got %v; want a pass", r.Err)
		}
	}}
	if err := c.SetService("web", Config{Check: Check{Kind: HTTP, Interval: 20 * time.Millisecond, Timeout: time.Second, Initial: Up}}); err != nil {
		t.Fatal(err)
	}
	for i := range nBackends {
		if err := c.Set(Backend{ID: fmt.Sprint("b", i), Addr: u.Host, Service: "web"}); err != nil {
			t.Fatal(err)
		}
	}
	run(t, c)
	waitfor.Value(t, 10*time.Second, "10 checks per backend", func() (any, bool) {
		mu.Lock()
		defer mu.Unlock()
		least := -1
		for i := range nBackends {
			if n := checks[fmt.Sprint("b", i)]; least < 0 || n < least {
				least = n
			}
		}
		return least, least >= 10
	})
	n := int(conns.Load())
	c.mu.RLock()
	mu.Lock()
	kept, slots, want := c.kept, 0, 0
	for id, b := range c.backends {
		if b.slot {
			slots++
			want++ // one connection, reused
		} else {
			want += checks[id] // one connection per check
		}
	}
	mu.Unlock()
	c.mu.RUnlock()
	// The connections and the checks are read a moment apart: the checks in
	// flight, at most one per backend, make up the difference either way.
	if kept != maxKept || slots != maxKept || n > want+nBackends || n < want-nBackends {
		t.Errorf("%d connections, %d slots held (count %d); want %d±%d connections and %d slots", n, slots, kept, want, nBackends, maxKept)
	}
}

// TestHTTPHeaderBounded: a backend that answers a check with a header that
// never ends (here a field value streamed until the check hangs up) fails the
// check as soon as the header passes DefaultMaxHeader, with that reason, and
// costs the checker a bounded buffer: the bytes it allocates meanwhile, which
// do not depend on the machine's speed, stay under 16 MiB. Before the bound,
// Go's header reader kept every byte until the check's timeout.
func TestHTTPHeaderBounded(t *testing.T) {
	// Each connection's handler returns when the checker closes it, or
	// after 256 MiB.
	addr := serveTCP(t, func(c net.Conn) {
		c.Read(make([]byte, 4096)) // the request
		io.WriteString(c, "HTTP/1.1 200 OK\r\nX-Endless: ")
		chunk := bytes.Repeat([]byte("a"), 64<<10)
		for range 4096 {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
	})
	c := &Checker{}
	cfg := Config{Check: Check{Kind: HTTP, Interval: time.Second, Timeout: 5 * time.Second}}
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if err := c.Set(Backend{ID: "b", Addr: addr, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	sub := c.Subscribe()
	defer sub.Close()
	run(t, c)
	ch := waitChange(t, sub, "b", 10*time.Second, func(ch Change) bool { return ch.To != Unknown })
	runtime.ReadMemStats(&after)
	want := fmt.Sprintf("http: response header over %d KiB", DefaultMaxHeader>>10)
	if ch.To != Down || ch.Reason != want {
		t.Errorf("got %v (%q); want down (%q)", ch.To, ch.Reason, want)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 16<<20 {
		t.Errorf("the check allocated %d MiB; want under 16", alloc>>20)
	}
}

// TestHTTPBodyBounded: a backend that answers a check with a body that never
// ends, of a declared length or chunked, has its check judged on the first
// DefaultMaxBody bytes and its connection closed there. Before, closing the
// response read the rest of the body, here until the check's timeout: the
// check took the whole timeout and read everything the backend sent.
func TestHTTPBodyBounded(t *testing.T) {
	for _, tt := range []struct{ name, head string }{
		{"content-length", "HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n"},
		{"chunked", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var sent atomic.Int64
			addr := serveTCP(t, func(c net.Conn) {
				c.Read(make([]byte, 4096)) // the request
				io.WriteString(c, tt.head)
				chunk := bytes.Repeat([]byte("a"), 64<<10)
				if tt.name == "chunked" {
					chunk = append([]byte(fmt.Sprintf("%x\r\n", len(chunk))), append(chunk, "\r\n"...)...)
				}
				for {
					n, err := c.Write(chunk)
					sent.Add(int64(n))
					if err != nil {
						return
					}
				}
			})
			const timeout = 10 * time.Second
			c := &Checker{}
			cfg := Config{Check: Check{Kind: HTTP, Interval: 200 * time.Millisecond, Timeout: timeout}}
			if err := c.SetService("web", cfg); err != nil {
				t.Fatal(err)
			}
			if err := c.Set(Backend{ID: "b", Addr: addr, Service: "web"}); err != nil {
				t.Fatal(err)
			}
			sub := c.Subscribe()
			t.Cleanup(sub.Close)
			run(t, c)
			ch := waitChange(t, sub, "b", 2*timeout, func(ch Change) bool { return ch.To != Unknown })
			st, _ := c.Status("b")
			if ch.To != Up {
				t.Errorf("state: got %v (%q); want up: the status is 200", ch.To, ch.Reason)
			}
			if st.Last.Duration > timeout/2 {
				t.Errorf("check took %v; want far below its timeout %v", st.Last.Duration, timeout)
			}
			if n := sent.Load(); n > 64<<20 {
				t.Errorf("backend sent %d MiB before the check ended; want what the sockets hold", n>>20)
			}
		})
	}
}
