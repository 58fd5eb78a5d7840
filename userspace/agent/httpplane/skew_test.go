package httpplane_test

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	testpb "google.golang.org/grpc/interop/grpc_testing"

	"github.com/weir-lb/weir/internal/httpbackend"
)

// TestMultiplexSkew: one HTTP/2 connection with 100 concurrent streams, through
// a tcp-mode (proxy) service and an http-mode one to the same 3 backends. The
// proxy balances the connection, so every request lands on one backend; the
// http plane balances requests, so each backend gets a third (±10 %). The same
// for a gRPC channel's unary calls; a bidirectional stream passes through both.
// The http service balances round robin: the test is about what gets balanced,
// requests or connections, and least_conn (the default) gives each backend a
// share that follows its speed, which on a loaded machine drifts past ±10 %.
func TestMultiplexSkew(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	tcpPort, httpPort := freePort(t), freePort(t)
	r := startAgent(t, fmt.Sprintf(`  - {name: tcp, vip: 127.0.0.1:%d, data_plane: proxy, health: {method: connect}, backends: %s}
  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: round_robin, health: {method: connect}, backends: %s}
`, tcpPort, backendList(bs), httpPort, backendList(bs)))
	_ = r
	for _, c := range []struct {
		name   string
		port   int
		oneGet bool // every request on one backend
	}{{"tcp", tcpPort, true}, {"http", httpPort, false}} {
		t.Run("h2load/"+c.name, func(t *testing.T) {
			before := hits(bs)
			res := h2load(t, "-n", "20000", "-c", "1", "-m", "100", fmt.Sprintf("http://127.0.0.1:%d/", c.port))
			if res.succeeded != 20000 || res.ok2xx != 20000 {
				t.Fatalf("h2load: got %d succeeded, %d 2xx; want 20000\n%s", res.succeeded, res.ok2xx, res.out)
			}
			sh, total := shares(bs, before)
			t.Logf("%s mode: backend shares %.3f (of %d requests)", c.name, sh, total)
			checkShares(t, sh, c.oneGet)
		})
		t.Run("grpc/"+c.name, func(t *testing.T) {
			before := hits(bs)
			client := httpbackend.Client(t, fmt.Sprintf("127.0.0.1:%d", c.port))
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			const calls, workers = 10000, 50
			var wg sync.WaitGroup
			errs := make(chan error, workers)
			for range workers {
				wg.Go(func() {
					for range calls / workers {
						if _, err := client.UnaryCall(ctx, &testpb.SimpleRequest{}); err != nil {
							errs <- err
							return
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatalf("unary call: %v", err)
			}
			sh, total := shares(bs, before)
			t.Logf("%s mode: %d gRPC unary calls on one channel, backend shares %.3f", c.name, total, sh)
			if total != calls {
				t.Errorf("backends answered %d calls; want %d", total, calls)
			}
			checkShares(t, sh, c.oneGet)
			bidi(t, ctx, client, 1000)
		})
	}
}

func checkShares(t *testing.T, sh []float64, oneGetsAll bool) {
	t.Helper()
	for i, s := range sh {
		switch {
		case oneGetsAll && s != 0 && s < 0.99:
			t.Errorf("backend %d: share %.3f; want ~0 or ~1 (one connection, one backend)", i, s)
		case !oneGetsAll && (s < 1.0/3*0.9 || s > 1.0/3*1.1):
			t.Errorf("backend %d: share %.3f; want a third ±10 %%", i, s)
		}
	}
}

// bidi sends n messages on one bidirectional stream while reading the echoes.
func bidi(t *testing.T, ctx context.Context, c testpb.TestServiceClient, n int) {
	t.Helper()
	st, err := c.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range n {
			if err := st.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: []byte(fmt.Sprint(i))}}); err != nil {
				t.Errorf("bidi send %d: %v", i, err)
				return
			}
		}
		st.CloseSend()
	})
	defer wg.Wait()
	for i := 0; ; i++ {
		m, err := st.Recv()
		if err == io.EOF {
			if i != n {
				t.Errorf("bidi: got %d echoes; want %d", i, n)
			}
			return
		}
		if err != nil {
			t.Fatalf("bidi recv %d: %v", i, err)
		}
		if _, body, _ := strings.Cut(string(m.GetPayload().GetBody()), ":"); body != fmt.Sprint(i) {
			t.Fatalf("bidi echo %d: got %q", i, m.GetPayload().GetBody())
		}
	}
}
