// Package httpbackend is a real HTTP/1.1, HTTP/2 cleartext and gRPC backend for
// the http data plane's tests and benchmark, with a WebSocket echo at /ws: it
// answers with its own name, so a test can tell which backend served a
// request, can be made slower or to answer an error status, and can be killed
// (every connection closed at once) and started again on the same address.
// Tests and bench only.
package httpbackend

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/websocket"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testpb "google.golang.org/grpc/interop/grpc_testing"
)

// wsEcho echoes every WebSocket message back (x/net/websocket: RFC 6455).
var wsEcho = websocket.Handler(func(ws *websocket.Conn) { io.Copy(ws, ws) })

// Backend is one running backend.
type Backend struct {
	Name string
	Addr netip.AddrPort

	// Hits counts requests and gRPC messages answered.
	Hits atomic.Int64
	// Delay is added before every answer (ns).
	Delay atomic.Int64
	// Status, when not 0, is answered to every request (gRPC calls get it as
	// their HTTP status, with no gRPC status).
	Status atomic.Int32

	mu   sync.Mutex
	srv  *http.Server
	gsrv *grpc.Server
	done chan struct{}
}

// StartN starts n backends named a, b, c, ... on loopback, closed at the test's
// cleanup.
func StartN(tb testing.TB, n int) []*Backend {
	tb.Helper()
	var bs []*Backend
	for i := range n {
		b, err := Start(string(rune('a'+i)), "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(b.Close)
		bs = append(bs, b)
	}
	return bs
}

// Client is a gRPC TestService client on one channel to addr (plaintext, h2c),
// closed at the test's cleanup.
func Client(tb testing.TB, addr string) testpb.TestServiceClient {
	tb.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cc.Close() })
	return testpb.NewTestServiceClient(cc)
}

// Start serves on addr ("127.0.0.1:0" picks a port).
func Start(name, addr string) (*Backend, error) {
	b := &Backend{Name: name}
	if err := b.listen(addr); err != nil {
		return nil, err
	}
	return b, nil
}

func (b *Backend) listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("backend %s: %w", b.Name, err)
	}
	b.Addr = netip.MustParseAddrPort(ln.Addr().String())
	gs := grpc.NewServer()
	testpb.RegisterTestServiceServer(gs, &grpcService{b: b})
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: b.handler(gs), Protocols: &p, ReadHeaderTimeout: 10 * time.Second,
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 1000}}
	done := make(chan struct{})
	b.mu.Lock()
	b.srv, b.gsrv, b.done = srv, gs, done
	b.mu.Unlock()
	// Exits when Kill or Close closes srv.
	go func() {
		defer close(done)
		srv.Serve(ln)
	}()
	return nil
}

func (b *Backend) wait() {
	if d := b.Delay.Load(); d > 0 {
		time.Sleep(time.Duration(d))
	}
}

func (b *Backend) handler(gs *grpc.Server) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor == 2 && r.Header.Get("Content-Type") == "application/grpc" {
			if st := b.Status.Load(); st != 0 {
				w.WriteHeader(int(st))
				return
			}
			gs.ServeHTTP(w, r)
			return
		}
		b.Hits.Add(1)
		if r.URL.Path == "/ws" && r.Header.Get("Upgrade") != "" {
			wsEcho.ServeHTTP(w, r)
			return
		}
		got, _ := io.Copy(io.Discard, r.Body)
		b.wait()
		w.Header().Set("X-Backend", b.Name)
		w.Header().Set("X-Seen-Body-Bytes", strconv.FormatInt(got, 10))
		// Only what came: nghttp2 refuses empty or space-led header values.
		for k, v := range map[string]string{"X-Seen-Forwarded-For": r.Header.Get("X-Forwarded-For"),
			"X-Seen-Forwarded": r.Header.Get("Forwarded"), "X-Seen-Forwarded-Proto": r.Header.Get("X-Forwarded-Proto")} {
			if v != "" {
				w.Header().Set(k, v)
			}
		}
		w.Header().Set("X-Seen-Proto", r.Proto)
		if st := b.Status.Load(); st != 0 {
			w.WriteHeader(int(st))
		}
		if n, err := strconv.Atoi(r.URL.Query().Get("size")); err == nil && n > 0 {
			buf := make([]byte, min(n, 32<<10))
			for n > 0 {
				k, _ := w.Write(buf[:min(n, len(buf))])
				n -= k
				if k == 0 {
					return
				}
			}
			return
		}
		io.WriteString(w, b.Name)
	})
}

// Kill closes the listener and every connection at once, as a crashed backend
// would.
func (b *Backend) Kill() {
	b.mu.Lock()
	srv, done := b.srv, b.done
	b.mu.Unlock()
	srv.Close()
	<-done
}

// Restart serves again on the same address after Kill.
func (b *Backend) Restart() error { return b.listen(b.Addr.String()) }

// Close stops the backend (also after Kill).
func (b *Backend) Close() {
	b.Kill()
	b.mu.Lock()
	gs := b.gsrv
	b.mu.Unlock()
	gs.Stop()
}

// ServeGRPC serves only gRPC, with grpc-go's own HTTP/2 server (faster than
// through net/http), on a listener of its own; for the benchmark. It returns
// when ctx is done.
func (b *Backend) ServeGRPC(ctx context.Context, ln net.Listener) error {
	gs := grpc.NewServer()
	testpb.RegisterTestServiceServer(gs, &grpcService{b: b})
	// Exits when ctx is done.
	go func() {
		<-ctx.Done()
		gs.Stop()
	}()
	err := gs.Serve(ln)
	if errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return err
}

// grpcService answers grpc.testing.TestService: UnaryCall with the backend's
// name as hostname; FullDuplexCall echoes each message's payload with the name
// in front.
type grpcService struct {
	testpb.UnimplementedTestServiceServer
	b *Backend
}

func (g *grpcService) UnaryCall(_ context.Context, req *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	g.b.Hits.Add(1)
	g.b.wait()
	return &testpb.SimpleResponse{Hostname: g.b.Name, Payload: req.GetPayload()}, nil
}

func (g *grpcService) FullDuplexCall(st grpc.BidiStreamingServer[testpb.StreamingOutputCallRequest, testpb.StreamingOutputCallResponse]) error {
	for {
		req, err := st.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		g.b.Hits.Add(1)
		body := append([]byte(g.b.Name+":"), req.GetPayload().GetBody()...)
		if err := st.Send(&testpb.StreamingOutputCallResponse{Payload: &testpb.Payload{Body: body}}); err != nil {
			return err
		}
	}
}
