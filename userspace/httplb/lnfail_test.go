package httplb

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestListenerFailedClosesConnections: when the listener fails (Serve
// returns on its own), the client connections the service accepted are
// closed, as at a stop, not left open with nothing to close them. Before,
// Serve returned at once and an idle keep-alive connection stayed open
// until its client left, served by a service that had stopped.
func TestListenerFailedClosesConnections(t *testing.T) {
	good, _ := h1TestBackend(t)
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			sv := serveStoppable(t, Config{NetHTTP1: engine == "net_http", IdleTimeout: time.Hour},
				[]Backend{{Addr: good, Weight: 1, Usable: true}})
			conn, br := rawConn(t, sv.Addr().String())
			fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			checkAnswer(t, br, wantAnswer{status: http.StatusOK, body: "ok"})
			sv.ln.Close() // as a listener that fails: Accept returns an error
			waitServeFailed(t, sv)
			select {
			case <-sv.Failed():
			default:
				t.Error("Failed: not closed after the listener failed")
			}
			conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := br.ReadByte(); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Errorf("the idle client connection after the listener failed: read %v; want it closed", err)
			}
		})
	}
}

// TestListenerFailedFinishesInFlight: a request in flight when the listener
// fails is answered before Serve returns, and once it has, the service's
// counters (connections, requests and each backend's in flight) are back at
// zero: every connection it accepted was closed, and counted closed, once.
func TestListenerFailedFinishesInFlight(t *testing.T) {
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			addr, _, release := heldBackend(t)
			sv := serveStoppable(t, Config{NetHTTP1: engine == "net_http", IdleTimeout: time.Hour},
				[]Backend{{Addr: addr, Weight: 1, Usable: true}})
			t.Cleanup(release) // runs before the service's cleanup
			conn, br := rawConn(t, sv.Addr().String())
			fmt.Fprintf(conn, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
			waitfor.Value(t, 10*time.Second, "the request in flight", func() (any, bool) {
				n := sv.Snapshot().InFlight
				return n, n == 1
			})
			sv.ln.Close() // as a listener that fails
			waitfor.Value(t, 10*time.Second, "Failed once the listener failed", func() (any, bool) {
				select {
				case <-sv.Failed():
					return true, true
				default:
					return false, false
				}
			})
			select {
			case <-sv.done:
				t.Fatalf("Serve returned with a request in flight after its listener failed: %v", sv.err)
			default:
			}
			release()
			checkAnswer(t, br, wantAnswer{status: http.StatusOK, body: "slow", close: true})
			waitServeFailed(t, sv)
			sn := sv.Snapshot()
			if sn.Connections != 0 || sn.InFlight != 0 || sn.Requests != 1 {
				t.Errorf("after Serve returned: connections %d, in flight %d, requests %d; want 0, 0, 1",
					sn.Connections, sn.InFlight, sn.Requests)
			}
			for _, b := range sn.Backends {
				if b.InFlight != 0 {
					t.Errorf("backend %v after Serve returned: %d in flight; want 0", b.Addr, b.InFlight)
				}
			}
		})
	}
}

// TestSplitListenerClosesSocketFirst: when the listener fails, the socket is
// closed before the splitter's Accept reports it (then Serve returns and
// Failed is true): a replacement bound on the same address (SO_REUSEPORT)
// never shares it with a socket that accepts no more. Before, Accept could
// return while the failed socket was still open. A real Close cannot be held
// open, hence a listener whose Close waits for the test.
func TestSplitListenerClosesSocketFirst(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	hl := &heldClose{Listener: ln, entered: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(hl.let)
	s := &Service{cfg: Config{Name: "test"}, log: slog.New(slog.DiscardHandler)}
	l := newSplitListener(hl, s)
	// Exits when its Accept fails (the listener closes below).
	go l.run()
	ln.Close() // the socket's Accept fails
	select {
	case <-hl.entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the splitter did not close its listener after Accept failed")
	}
	select {
	case <-l.done:
		t.Error("the splitter's Accept reports the failure while its socket is still being closed; want it closed first")
	default:
	}
	hl.let()
	if _, err := l.Accept(); err == nil {
		t.Error("Accept after the listener failed: got a connection; want its error")
	}
}

// heldClose is a listener whose Close waits until let is called.
type heldClose struct {
	net.Listener
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (l *heldClose) Close() error {
	close(l.entered)
	<-l.release
	return l.Listener.Close()
}

func (l *heldClose) let() { l.once.Do(func() { close(l.release) }) }

// waitServeFailed waits for sv's Serve to return after its listener failed,
// with the listener's error.
func waitServeFailed(t *testing.T, sv *served) {
	t.Helper()
	select {
	case <-sv.done:
	case <-time.After(20 * time.Second):
		t.Fatal("Serve did not return after its listener failed (and its connections ended)")
	}
	if sv.err == nil {
		t.Error("Serve returned nil after its listener failed; want its error")
	}
	sv.err = nil // expected: the cleanup would report it
}
