package httplb

import (
	"bufio"
	"io"
	"net"
	"net/http"
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
	addrs    []netip.AddrPort // of each outcome's backend
}

func (o *outcomeLog) Try(addr netip.AddrPort, out Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.outcomes = append(o.outcomes, out)
	o.addrs = append(o.addrs, addr)
}

// of returns the outcomes of addr's tries.
func (o *outcomeLog) of(addr netip.AddrPort) []Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	var outs []Outcome
	for i, a := range o.addrs {
		if a == addr {
			outs = append(outs, o.outcomes[i])
		}
	}
	return outs
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

// TestH1BrokenAnswerOneOutcome: a backend that sends an answer's headers and
// then breaks off its body is told to the health checker as one Reset per try,
// so that such failures in a row add up to an ejection. Each was told as a
// Success when the headers came and a Reset when the body broke: the Success
// ended the run of failures every time, and a backend that broke off every
// answer was never ejected. Through both engines, over weir's own exchange
// (no retries), with the first body bytes read before answering (retries on:
// the try is retried elsewhere), and a declined upgrade's answer.
func TestH1BrokenAnswerOneOutcome(t *testing.T) {
	be := rawBackend(t, func(c net.Conn) {
		req, ok := nextRequest(bufio.NewReader(c))
		if !ok {
			return
		}
		body := "0123456789"
		if req.URL.Path == "/none" {
			body = ""
		}
		status := "200 OK"
		if req.Header.Get("Upgrade") != "" {
			status = "403 Forbidden"
		}
		// 100 bytes promised, fewer sent, and the connection closed.
		io.WriteString(c, "HTTP/1.1 "+status+"\r\nContent-Length: 100\r\n\r\n"+body)
	})
	const n = 3
	for _, engine := range h1Engines {
		for _, c := range []struct {
			name    string
			retries int
			req     string
		}{
			{"answer broken off", 0, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"},
			{"body with a length, retries on", 2, "GET /none HTTP/1.1\r\nHost: x\r\n\r\n"},
			{"declined upgrade", 0, "GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"},
		} {
			t.Run(engine+"/"+c.name, func(t *testing.T) {
				obs := &outcomeLog{}
				s := serveOn(t, Config{NetHTTP1: engine == "net_http", Observer: obs, Retries: c.retries},
					[]Backend{{Addr: be, Weight: 1, Usable: true}})
				for range n {
					conn, br := rawConn(t, s.Addr().String())
					io.WriteString(conn, c.req)
					// A cut answer (the connection closed short of it), or
					// a 502 when the try could be retried.
					if resp, err := http.ReadResponse(br, nil); err == nil {
						io.Copy(io.Discard, resp.Body)
					}
					conn.Close()
				}
				waitfor.Value(t, 5*time.Second, "no request in flight", func() (any, bool) {
					n := s.Snapshot().InFlight
					return n, n == 0
				})
				got := obs.get()
				run := 0
				for _, o := range got {
					if o == Success {
						run = 0
					} else {
						run++
					}
				}
				if len(got) != n || run != n {
					t.Errorf("outcomes told to the health checker for %d broken answers: %v (%d failures in a row); want %d Resets", n, got, run, n)
				}
			})
		}
	}
}
