package httplb

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"golang.org/x/net/http2"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
)

func backendSet(bs []*httpbackend.Backend) []Backend {
	var out []Backend
	for _, b := range bs {
		out = append(out, Backend{Addr: b.Addr, Weight: 1, Usable: true})
	}
	return out
}

// serve starts a service over bs with cfg (Listen defaults to a free loopback
// port) and stops it, drained, at cleanup.
func serve(t testing.TB, cfg Config, bs []*httpbackend.Backend) *Service {
	t.Helper()
	return serveOn(t, cfg, backendSet(bs))
}

// serveOn is serve over backends given by address.
func serveOn(t testing.TB, cfg Config, bs []Backend) *Service {
	t.Helper()
	return serveStoppable(t, cfg, bs).Service
}

// served is a service whose Serve runs until stop (or cleanup) cancels it.
type served struct {
	*Service
	stop context.CancelFunc
	done chan struct{} // closed when Serve has returned, with its error in err
	err  error
}

// serveStoppable is serveOn for a test that stops the service itself (and sees
// how long Serve takes to return); an error from Serve fails the test at
// cleanup.
func serveStoppable(t testing.TB, cfg Config, bs []Backend) *served {
	t.Helper()
	return serveStoppableWith(t, cfg, bs, Listen)
}

// serveStoppableWith is serveStoppable with the service's listener bound by
// listen.
func serveStoppableWith(t testing.TB, cfg Config, bs []Backend, listen func(Config, []Backend) (*Service, error)) *served {
	t.Helper()
	if !cfg.Listen.IsValid() {
		cfg.Listen = netip.MustParseAddrPort("127.0.0.1:0")
	}
	if cfg.Name == "" {
		cfg.Name = "test"
	}
	if testing.Verbose() && cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	s, err := listen(cfg, bs)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	sv := &served{Service: s, stop: cancel, done: make(chan struct{})}
	// Exits when stop is called, by the test or at cleanup.
	go func() {
		sv.err = s.Serve(ctx)
		close(sv.done)
	}()
	t.Cleanup(func() {
		cancel()
		<-sv.done
		if sv.err != nil {
			t.Error(sv.err)
		}
	})
	return sv
}

func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}, Timeout: 10 * time.Second}
}

func h1Client() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 8}, Timeout: 10 * time.Second}
}

func get(t *testing.T, c *http.Client, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	return do(t, c, "GET", url, hdr...)
}

// do sends a request without a body and returns the answer with its whole body.
func do(t *testing.T, c *http.Client, method, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		if strings.EqualFold(hdr[i], "Host") {
			req.Host = hdr[i+1] // Go's client sends no Host from the header
			continue
		}
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("%s %s: body: %v", method, url, err)
	}
	return resp, string(body)
}

// TestForward: HTTP/1.1 and HTTP/2 cleartext requests reach the backends, are
// spread per request (one HTTP/2 connection reaches every backend), and carry
// the forwarding headers; hop-by-hop headers stay behind.
func TestForward(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	s := serve(t, Config{Algorithm: "round_robin", XForwardedFor: true, XForwardedProto: true, Forwarded: true}, bs)
	url := "http://" + s.Addr().String() + "/"
	for _, c := range []struct {
		name   string
		client *http.Client
		proto  string
	}{
		{"http1", h1Client(), "HTTP/1.1"},
		{"h2c", h2cClient(), "HTTP/2.0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			seen := map[string]int{}
			for range 30 {
				resp, body := get(t, c.client, url, "X-Forwarded-For", "192.0.2.1", "X-Private", "secret")
				if resp.StatusCode != 200 || resp.Proto != c.proto {
					t.Fatalf("got %s %s; want 200 over %s", resp.Proto, resp.Status, c.proto)
				}
				if got := resp.Header.Get("X-Seen-Forwarded-For"); got != "192.0.2.1, 127.0.0.1" {
					t.Errorf("X-Forwarded-For at the backend: got %q; want %q", got, "192.0.2.1, 127.0.0.1")
				}
				if got := resp.Header.Get("X-Seen-Forwarded"); got != `for=127.0.0.1;proto=http;host="`+s.Addr().String()+`"` {
					t.Errorf("Forwarded at the backend: got %q", got)
				}
				// auto: the backend is spoken to as the client spoke.
				if got, want := resp.Header.Get("X-Seen-Forwarded-Proto")+" "+resp.Header.Get("X-Seen-Proto"), "http "+c.proto; got != want {
					t.Errorf("X-Forwarded-Proto and protocol at the backend: got %q; want %q", got, want)
				}
				seen[body]++
			}
			for _, b := range bs {
				if seen[b.Name] != 10 {
					t.Errorf("round robin over 30 requests: got %v; want 10 each", seen)
					break
				}
			}
			c.client.CloseIdleConnections()
		})
	}
	sn := s.Snapshot()
	if sn.Requests != 60 || len(sn.Backends) != 3 || sn.Backends[0].Classes[2] != 20 {
		t.Errorf("snapshot: got %+v; want 60 requests, 20 2xx on each of 3 backends", sn)
	}
}

// TestTLS: with a certificate, clients negotiate h2 or http/1.1 by ALPN.
func TestTLS(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	cert, err := tls.X509KeyPair(testCert, testKey)
	if err != nil {
		t.Fatal(err)
	}
	s := serve(t, Config{XForwardedProto: true, TLS: &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}}, bs)
	for _, c := range []struct {
		name  string
		h2    bool
		proto string
	}{{"h2", true, "HTTP/2.0"}, {"http1", false, "HTTP/1.1"}} {
		t.Run(c.name, func(t *testing.T) {
			tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, ForceAttemptHTTP2: c.h2}
			if !c.h2 {
				tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
			}
			resp, body := get(t, &http.Client{Transport: tr}, "https://"+s.Addr().String()+"/")
			if resp.Proto != c.proto || body != "a" || resp.Header.Get("X-Seen-Forwarded-Proto") != "https" {
				t.Errorf("got %s %q, backend saw %q; want %s from a, https", resp.Proto, body, resp.Header.Get("X-Seen-Forwarded-Proto"), c.proto)
			}
		})
	}
}

// TestGRPC: unary calls on one channel are spread over the backends, and a
// bidirectional stream passes messages both ways and ends with its status.
func TestGRPC(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	s := serve(t, Config{Algorithm: "round_robin"}, bs)
	c := httpbackend.Client(t, s.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	seen := map[string]int{}
	for range 30 {
		r, err := c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: &testpb.Payload{Body: []byte("x")}})
		if err != nil {
			t.Fatal(err)
		}
		seen[r.GetHostname()]++
	}
	if seen["a"] != 10 || seen["b"] != 10 || seen["c"] != 10 {
		t.Errorf("30 unary calls on one channel: got %v; want 10 each", seen)
	}
	st, err := c.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range 100 {
			if err := st.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: []byte{byte(i)}}}); err != nil {
				t.Error(err)
				return
			}
		}
		st.CloseSend()
	})
	var backend string
	for i := 0; ; i++ {
		r, err := st.Recv()
		if err == io.EOF {
			if i != 100 {
				t.Errorf("bidi stream: got %d answers; want 100", i)
			}
			break
		}
		if err != nil {
			t.Fatalf("bidi stream, answer %d: %v", i, err)
		}
		name, b, _ := strings.Cut(string(r.GetPayload().GetBody()), ":")
		if backend == "" {
			backend = name
		}
		if name != backend || len(b) != 1 || b[0] != byte(i) {
			t.Fatalf("bidi answer %d: got %q; want %s:%d (one stream, one backend)", i, r.GetPayload().GetBody(), backend, i)
		}
	}
	wg.Wait()
}

// TestAffinity: maglev over a header, a cookie or the client address keeps
// each key on one backend, and spreads different keys; so does maglev_p2c,
// whose two candidates come from the same key (one request at a time here, so
// the first always wins), over HTTP/2 frames and HTTP/1.1 alike.
func TestAffinity(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	user := func(i int) []string { return []string{"X-User", fmt.Sprint("user", i)} }
	host := func(i int) []string { return []string{"Host", fmt.Sprintf("site%d.example", i)} }
	byHost := Config{Algorithm: "maglev", Hash: HashHeader, HashName: "Host"}
	byHostNetHTTP := byHost
	byHostNetHTTP.NetHTTP1, byHostNetHTTP.NetHTTP2 = true, true
	for _, c := range []struct {
		name string
		cfg  Config
		key  func(i int) []string // request headers for user i
		h1   bool                 // HTTP/1.1 requests, not h2c
	}{
		// Host is no header field to Go's server (r.Host), nor in HTTP/2
		// (:authority): each engine hashes by it all the same.
		{"host", byHost, host, false},
		{"host h1", byHost, host, true},
		{"host net_http", byHostNetHTTP, host, false},
		{"host net_http h1", byHostNetHTTP, host, true},
		{"header", Config{Algorithm: "maglev", Hash: HashHeader, HashName: "X-User"}, user, false},
		{"cookie", Config{Algorithm: "maglev", Hash: HashCookie, HashName: "session"}, func(i int) []string { return []string{"Cookie", fmt.Sprintf("a=1; session=s%d", i)} }, false},
		{"source", Config{Algorithm: "source_hash"}, func(int) []string { return nil }, false},
		{"p2c header", Config{Algorithm: "maglev_p2c", Hash: HashHeader, HashName: "X-User"}, user, false},
		{"p2c header h1", Config{Algorithm: "maglev_p2c", Hash: HashHeader, HashName: "X-User"}, user, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := serve(t, c.cfg, bs)
			client := h2cClient()
			if c.h1 {
				client = h1Client()
			}
			defer client.CloseIdleConnections()
			owners := map[string]bool{}
			for i := range 30 {
				var first string
				for range 5 {
					_, body := get(t, client, "http://"+s.Addr().String()+"/", c.key(i)...)
					if first == "" {
						first = body
					}
					if body != first {
						t.Fatalf("key %d: answered by %s, then %s; want one backend", i, first, body)
					}
				}
				owners[first] = true
			}
			if want := map[string]int{"source": 1}[c.name]; want == 1 && len(owners) != 1 || want == 0 && len(owners) < 3 {
				t.Errorf("30 keys went to %d backends; want %s", len(owners), map[bool]string{true: "1 (one client address)", false: "all 3"}[want == 1])
			}
		})
	}
}

// TestDrain: a backend taken out of use finishes the requests it has and gets
// no new ones.
func TestDrain(t *testing.T) {
	bs := httpbackend.StartN(t, 2)
	bs[0].Delay.Store(int64(300 * time.Millisecond))
	s := serve(t, Config{Algorithm: "round_robin"}, bs)
	client := h2cClient()
	defer client.CloseIdleConnections()
	url := "http://" + s.Addr().String() + "/"
	var wg sync.WaitGroup
	answers := make(chan string, 10)
	for range 10 {
		wg.Go(func() {
			resp, body := get(t, client, url)
			if resp.StatusCode != 200 {
				t.Errorf("in flight across the drain: got %s", resp.Status)
			}
			answers <- body
		})
	}
	// Round robin sends a 5 of the 10; all of them there (a answers slowly)
	// before the drain.
	waitfor.Value(t, 5*time.Second, "5 requests at a", func() (any, bool) {
		n := bs[0].Hits.Load()
		return n, n == 5
	})
	s.SetBackends([]Backend{{Addr: bs[0].Addr, Weight: 1, Usable: false}, {Addr: bs[1].Addr, Weight: 1, Usable: true}})
	hitsA := bs[0].Hits.Load()
	for range 20 {
		if _, body := get(t, client, url); body != "b" {
			t.Fatalf("after the drain: answered by %s; want b", body)
		}
	}
	wg.Wait()
	close(answers)
	var fromA int
	for a := range answers {
		if a == "a" {
			fromA++
		}
	}
	if fromA == 0 || bs[0].Hits.Load() != hitsA {
		t.Errorf("a answered %d of the 10 in flight and %d new; want some in flight, none new", fromA, bs[0].Hits.Load()-hitsA)
	}
}

// TestRetryGRPC: a gRPC call the config marks retryable, refused by one
// backend (503), is answered by another, its request body sent again; a call
// not marked gets the refusal.
func TestRetryGRPC(t *testing.T) {
	bs := httpbackend.StartN(t, 2)
	bs[0].Status.Store(http.StatusServiceUnavailable)
	for _, c := range []struct {
		name  string
		retry []string
		want  string // "b", or the error
	}{
		{"marked", []string{"/grpc.testing.TestService/UnaryCall"}, "b"},
		{"service marked", []string{"/grpc.testing.TestService/*"}, "b"},
		{"not marked", []string{"/grpc.testing.TestService/EmptyCall"}, "Unavailable"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := serve(t, Config{Algorithm: "round_robin", Retries: 1, RetryBudget: 1, RetryGRPC: c.retry}, bs)
			client := httpbackend.Client(t, s.Addr().String())
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var unavailable int
			for i := range 10 {
				r, err := client.UnaryCall(ctx, &testpb.SimpleRequest{Payload: &testpb.Payload{Body: make([]byte, 1000)}})
				switch {
				case err != nil && status.Code(err) == codes.Unavailable && c.want == "Unavailable":
					unavailable++
				case err != nil:
					t.Fatalf("call %d: %v", i, err)
				case r.GetHostname() != "b" || len(r.GetPayload().GetBody()) != 1000:
					t.Fatalf("call %d: answered by %s with %d bytes; want b with the 1000 sent", i, r.GetHostname(), len(r.GetPayload().GetBody()))
				}
			}
			if c.want == "Unavailable" && unavailable != 5 {
				t.Errorf("not retryable: %d of 10 calls Unavailable; want a's 5", unavailable)
			}
		})
	}
}

// TestGRPCTimeoutStatus: a gRPC call that runs out of weir's own time, one
// try's (try_timeout) or the whole request's (timeout), while the client's
// deadline is still far ahead, gets DEADLINE_EXCEEDED (4), as Envoy's router
// answers its own timeouts, not UNAVAILABLE (14), which tells a client to
// try again; on the frame engine and on net/http's. A call with no usable
// backend still gets UNAVAILABLE.
func TestGRPCTimeoutStatus(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"frames, try_timeout", Config{TryTimeout: 200 * time.Millisecond}},
		{"frames, timeout", Config{Timeout: 200 * time.Millisecond}},
		{"net_http, try_timeout", Config{NetHTTP2: true, TryTimeout: 200 * time.Millisecond}},
		{"net_http, timeout", Config{NetHTTP2: true, Timeout: 200 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			bs[0].Delay.Store(int64(3 * time.Second))
			cfg := tc.cfg
			cfg.Retries = 0
			s := serve(t, cfg, bs)
			client := httpbackend.Client(t, s.Addr().String())
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, err := client.UnaryCall(ctx, &testpb.SimpleRequest{})
			if got := status.Code(err); got != codes.DeadlineExceeded {
				t.Errorf("got %v (%v); want %v", got, err, codes.DeadlineExceeded)
			}
			s.SetBackends([]Backend{{Addr: bs[0].Addr, Weight: 1, Usable: false}})
			_, err = client.UnaryCall(ctx, &testpb.SimpleRequest{})
			if got := status.Code(err); got != codes.Unavailable {
				t.Errorf("no usable backend: got %v (%v); want %v", got, err, codes.Unavailable)
			}
		})
	}
}

// TestRetryBudget: the budget lets a share of the requests retry, and no more.
func TestRetryBudget(t *testing.T) {
	b := newRetryBudget(0.2)
	b.balance.Store(0)
	for range 100 {
		b.deposit()
	}
	got := 0
	for b.withdraw() {
		got++
	}
	// 20 from the deposits, plus the floor's refill in the microseconds this took.
	if got < 20 || got > 21 {
		t.Errorf("100 requests at 0.2: %d retries allowed; want 20", got)
	}
	for range 1_000_000 {
		b.deposit()
	}
	if v := b.balance.Load(); v > budgetCap+1000 {
		t.Errorf("balance %d after a long run; want capped at %d", v, budgetCap)
	}
}

// TestH2CUpgrade: an HTTP/1.1 client that asks to upgrade to h2c (curl
// --http2 on an http:// URL does) gets HTTP/2, its first request answered on
// stream 1; when the service shuts down the upgraded connection gets GOAWAY
// like any other HTTP/2 connection.
func TestH2CUpgrade(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s, err := Listen(Config{Name: "up", Listen: netip.MustParseAddrPort("127.0.0.1:0")}, backendSet(bs))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	// Exits when cancel is called below.
	go func() { done <- s.Serve(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	t.Run("curl", func(t *testing.T) {
		curl, err := exec.LookPath("curl")
		if err != nil {
			t.Fatalf("curl not found (make deps installs it): %v", err)
		}
		out, err := exec.Command(curl, "-sS", "--http2", "-o", "/dev/null", "-w", "%{http_version} %{http_code}", "http://"+s.Addr().String()+"/").CombinedOutput()
		if err != nil || string(out) != "2 200" {
			t.Errorf("curl --http2: got %q (%v); want HTTP/2 200 after the upgrade", out, err)
		}
	})
	conn, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: \r\n\r\n")
	br := bufio.NewReader(conn)
	line, _ := br.ReadString('\n')
	if !strings.HasPrefix(line, "HTTP/1.1 101") {
		t.Fatalf("upgrade answer %q; want 101 Switching Protocols", line)
	}
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if l == "\r\n" {
			break
		}
	}
	io.WriteString(conn, http2.ClientPreface)
	fr := http2.NewFramer(conn, br)
	fr.WriteSettings()
	var answered, goaway bool
	for !goaway {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v (answered %t); want stream 1's answer, then GOAWAY", err, answered)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
			}
		case *http2.DataFrame:
			if f.StreamID == 1 && string(f.Data()) == "a" {
				answered = true
				cancel() // shut down: the upgraded connection must get GOAWAY
			}
		case *http2.GoAwayFrame:
			goaway = true
		}
	}
	if !answered {
		t.Errorf("GOAWAY before stream 1's answer")
	}
}

// TestAccessLog: with AccessLog each request is one slog line naming the
// backend, the status and the durations.
func TestAccessLog(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	var buf syncBuffer
	s, err := Listen(Config{Name: "log", Listen: netip.MustParseAddrPort("127.0.0.1:0"), AccessLog: true,
		Logger: slog.New(slog.NewTextHandler(&buf, nil))}, backendSet(bs))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	// Exits when cancel is called below.
	go func() { done <- s.Serve(ctx) }()
	c := h1Client()
	get(t, c, "http://"+s.Addr().String()+"/path?q=1")
	c.CloseIdleConnections()
	cancel()
	<-done
	line := buf.String()
	for _, want := range []string{"msg=request", "method=GET", "path=/path", "proto=HTTP/1.1", "backend=" + bs[0].Addr.String(), "status=200", "headers=", "duration="} {
		if !strings.Contains(line, want) {
			t.Errorf("access log %q lacks %q", line, want)
		}
	}
}

// syncBuffer is a strings.Builder safe for the server's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestGRPCLargeStream: a bidirectional stream moving 32 MiB each way in 256 KiB
// messages passes through whole and in order: flow control holds each side to
// the other's pace, and nothing waits for the stream to end.
func TestGRPCLargeStream(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{}, bs)
	c := httpbackend.Client(t, s.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := c.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const n, size = 128, 256 << 10
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range n {
			body := make([]byte, size)
			body[0], body[size-1] = byte(i), byte(i)
			if err := st.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: body}}); err != nil {
				t.Errorf("send %d: %v", i, err)
				return
			}
		}
		st.CloseSend()
	})
	for i := 0; ; i++ {
		m, err := st.Recv()
		if err == io.EOF {
			if i != n {
				t.Errorf("got %d messages; want %d", i, n)
			}
			break
		}
		if err != nil {
			t.Fatalf("recv %d: %v", i, err)
		}
		b := m.GetPayload().GetBody()
		if len(b) != size+2 || b[2] != byte(i) || b[len(b)-1] != byte(i) {
			t.Fatalf("message %d: %d bytes, marks %d/%d; want %d bytes marked %d", i, len(b), b[2], b[len(b)-1], size+2, i)
		}
	}
	wg.Wait()
}

// TestLargeBodies: a 64 MiB answer and a 16 MiB upload stream through over
// HTTP/1.1 and HTTP/2, whole.
func TestLargeBodies(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{}, bs)
	url := "http://" + s.Addr().String() + "/"
	for _, c := range []struct {
		name   string
		client *http.Client
	}{{"http1", h1Client()}, {"h2c", h2cClient()}} {
		t.Run(c.name, func(t *testing.T) {
			defer c.client.CloseIdleConnections()
			resp, err := c.client.Get(url + "?size=" + fmt.Sprint(64<<20))
			if err != nil {
				t.Fatal(err)
			}
			n, err := io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if err != nil || n != 64<<20 {
				t.Errorf("download: %d bytes (%v); want %d", n, err, 64<<20)
			}
			up := io.LimitReader(zeros{}, 16<<20)
			resp, err = c.client.Post(url, "application/octet-stream", up)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if got := resp.Header.Get("X-Seen-Body-Bytes"); resp.StatusCode != 200 || got != fmt.Sprint(16<<20) {
				t.Errorf("upload: got %s, the backend read %s bytes; want 200 and %d", resp.Status, got, 16<<20)
			}
		})
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// TestHashByHostAbsoluteForm: an HTTP/1.1 request whose target is in absolute
// form (GET http://a.example/) names its host there, which stands in for its
// Host field (the backend is sent it as Host): hash_by header:Host hashes by
// it, so the request goes where one with that Host goes, on either engine.
func TestHashByHostAbsoluteForm(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	for _, netHTTP := range []bool{false, true} {
		t.Run(fmt.Sprint("net_http=", netHTTP), func(t *testing.T) {
			s := serve(t, Config{Algorithm: "maglev", Hash: HashHeader, HashName: "Host", NetHTTP1: netHTTP}, bs)
			c, err := net.Dial("tcp", s.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			br := bufio.NewReader(c)
			ask := func(head string) string {
				t.Helper()
				c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := io.WriteString(c, head+"\r\n"); err != nil {
					t.Fatal(err)
				}
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				return string(body)
			}
			owners := map[string]bool{}
			for i := range 12 {
				site := fmt.Sprintf("site%d.example", i)
				want := ask("GET / HTTP/1.1\r\nHost: " + site + "\r\n")
				if got := ask("GET http://" + site + "/ HTTP/1.1\r\nHost: decoy.example\r\n"); got != want {
					t.Errorf("%s in absolute form: answered by %q; want %q, as for Host: %s", site, got, want, site)
				}
				owners[want] = true
			}
			if len(owners) < 2 {
				t.Errorf("12 hosts all went to %v; want them spread", owners)
			}
		})
	}
}
