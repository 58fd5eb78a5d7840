package httplb

import (
	"bufio"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestShutdownAnswersAccepted: a connection the service accepted before it
// began to shut down, whose request comes only after, is answered rather than
// closed unanswered, by either HTTP/1.1 engine: a client that connected while
// the service listened loses nothing, as when a replacement took the listening
// socket over and the old service stops.
func TestShutdownAnswersAccepted(t *testing.T) {
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			sv := serveStoppable(t, Config{NetHTTP1: engine == "net_http"}, backendSet(bs))
			addr := sv.Addr().String()
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			if !waitfor.Cond(10*time.Second, func() bool { return sv.Snapshot().Accepted == 1 }) {
				t.Fatal("the connection was not accepted")
			}
			sv.stop()
			// The shutdown has begun once the listener is closed.
			if !waitfor.Cond(10*time.Second, func() bool {
				d, err := net.Dial("tcp", addr)
				if err == nil {
					d.Close()
				}
				return err != nil
			}) {
				t.Fatal("the listener was not closed")
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatalf("read the answer: %v; want 200", err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("got %d; want 200", resp.StatusCode)
			}
			<-sv.done
		})
	}
}

// TestShutdownSilentClient: a connection accepted before the service began to
// shut down whose client sends nothing holds the shutdown up for no more than
// the header time it is given to start its request (from its accept), not for
// that time twice nor for the drain time.
func TestShutdownSilentClient(t *testing.T) {
	const header = 3 * time.Second
	bs := httpbackend.StartN(t, 1)
	sv := serveStoppable(t, Config{ReadHeaderTimeout: header, DrainTimeout: time.Minute}, backendSet(bs))
	c, err := net.Dial("tcp", sv.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if !waitfor.Cond(10*time.Second, func() bool { return sv.Snapshot().Accepted == 1 }) {
		t.Fatal("the connection was not accepted")
	}
	start := time.Now()
	sv.stop()
	select {
	case <-sv.done:
	case <-time.After(time.Minute):
		t.Fatal("Serve did not return")
	}
	// Twice the header time would be 6s; the margin is for a loaded machine.
	if took := time.Since(start); took > header+header/2 {
		t.Errorf("Serve returned %v after the stop; want within the header time, %v", took.Round(time.Millisecond), header)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Errorf("the silent connection: read %d bytes (%v); want it closed", n, err)
	}
}

// TestSlowFirstRequest: a client that sends its first request late within the
// header time (after its TLS handshake, itself late, over TLS) is served, as
// the service runs and when its shutdown began after the accept, by either
// HTTP/1.1 engine.
func TestSlowFirstRequest(t *testing.T) {
	for _, stopping := range []bool{false, true} {
		name := "running"
		if stopping {
			name = "stopping"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			slowFirstRequest(t, stopping)
		})
	}
}

func slowFirstRequest(t *testing.T, stopping bool) {
	eachH1Front(t, func(t *testing.T, cfg Config) {
		// The client's late TLS handshake has the last 4/10 of it: under the
		// race detector, on a loaded machine, a handshake took more than 0.6s.
		const header = 3 * time.Second
		cfg.ReadHeaderTimeout, cfg.DrainTimeout = header, time.Minute
		bs := httpbackend.StartN(t, 1)
		sv := serveStoppable(t, cfg, backendSet(bs))
		raw, err := net.Dial("tcp", sv.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { raw.Close() })
		dialed := time.Now()
		if !waitfor.Cond(10*time.Second, func() bool { return sv.Snapshot().Accepted == 1 }) {
			t.Fatal("the connection was not accepted")
		}
		if stopping {
			sv.stop()
		}
		// What is under test is time passing: the client is slow.
		time.Sleep(time.Until(dialed.Add(header * 6 / 10)))
		var c net.Conn = raw
		if cfg.TLS != nil {
			tc := tls.Client(raw, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"http/1.1"}})
			if err := tc.Handshake(); err != nil {
				t.Fatal(err)
			}
			c = tc
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("shutting down %v: read the answer: %v; want 200", stopping, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("shutting down %v: got %d; want 200", stopping, resp.StatusCode)
		}
	})
}
