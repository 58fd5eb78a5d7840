package httplb

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"testing"
	"time"
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
			select {
			case <-sv.done:
			case <-time.After(20 * time.Second):
				t.Fatal("Serve did not return after its listener failed")
			}
			if sv.err == nil {
				t.Error("Serve returned nil after its listener failed; want its error")
			}
			sv.err = nil // expected: the cleanup would report it
			if !sv.Failed() {
				t.Error("Failed: false after the listener failed")
			}
			conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := br.ReadByte(); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Errorf("the idle client connection after the listener failed: read %v; want it closed", err)
			}
		})
	}
}
