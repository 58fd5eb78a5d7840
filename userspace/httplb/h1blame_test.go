package httplb

import (
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// Passive health as the HTTP/1.1 side reports it: what a try is blamed for,
// and how often.

// outcomeLog records every try's outcome, in order, and the run of failures
// in a row the health checker would count from them (a Success ends a run).
type outcomeLog struct {
	mu       sync.Mutex
	outcomes []Outcome
}

func (o *outcomeLog) Try(_ netip.AddrPort, out Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.outcomes = append(o.outcomes, out)
}

func (o *outcomeLog) Request(netip.AddrPort, int, time.Duration) {}

func (o *outcomeLog) get() []Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]Outcome(nil), o.outcomes...)
}

// TestH1ClientBodyFailureNotBlamed: a client whose request body breaks off (it
// closes or resets its connection mid-upload, or sends a chunk size that is
// not one) has its request ended, and the backend it was going to is blamed
// for nothing: the health checker counts the plane's Reset as the backend's,
// so a client could eject every backend by cutting its uploads short.
func TestH1ClientBodyFailureNotBlamed(t *testing.T) {
	be, _ := h1TestBackend(t)
	for _, engine := range h1Engines {
		for _, c := range []struct {
			name, send string
			reset      bool
		}{
			{"closed mid-body", "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789", false},
			{"reset mid-body", "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789", true},
			{"bad chunk size", "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n", false},
		} {
			t.Run(engine+"/"+c.name, func(t *testing.T) {
				obs := &outcomeLog{}
				s := serveOn(t, Config{NetHTTP1: engine == "net_http", Observer: obs}, []Backend{{Addr: be, Weight: 1, Usable: true}})
				conn, br := rawConn(t, s.Addr().String())
				io.WriteString(conn, c.send)
				if c.name != "bad chunk size" {
					// The body's first bytes on their way to the backend
					// before the client goes.
					waitfor.Value(t, 5*time.Second, "the request in flight", func() (any, bool) {
						n := s.Snapshot().InFlight
						return n, n == 1
					})
					if c.reset {
						conn.(*net.TCPConn).SetLinger(0)
					}
					conn.Close()
				}
				// Done with: answered (400) or, to a client that has gone,
				// ended without an answer.
				waitfor.Value(t, 5*time.Second, "the request done", func() (any, bool) {
					n := s.Snapshot().InFlight
					return n, n == 0
				})
				if got := obs.get(); len(got) != 0 {
					t.Errorf("outcomes told to the health checker: %v; want none: the client's body failed, not the backend", got)
				}
				if c.name == "bad chunk size" {
					// Still there: told its request was bad, not that a
					// backend failed.
					checkAnswer(t, br, wantAnswer{method: "POST", status: 400,
						body: "service \"test\": request body: invalid byte in chunk length\n", close: true})
				}
			})
		}
	}
}
