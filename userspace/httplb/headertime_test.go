package httplb

import (
	"io"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
)

// TestPrefaceByteHeaderTime: a cleartext client that sends a first byte that
// could begin the HTTP/2 preface ("P") and then nothing is closed within
// read_header_timeout of its accept, through either HTTP/1.1 engine: the
// sniff for the preface and the request's read share the header time. Before,
// the sniff waited out the header time for the rest of the preface, and the
// HTTP/1.1 engine then gave the request the header time again (net/http's
// server twice more: its own wait for the preface, then the request).
func TestPrefaceByteHeaderTime(t *testing.T) {
	const header = time.Second
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			s := serve(t, Config{NetHTTP1: engine == "net_http", ReadHeaderTimeout: header}, bs)
			conn, _ := rawConn(t, s.Addr().String())
			start := time.Now()
			if _, err := conn.Write([]byte("P")); err != nil {
				t.Fatal(err)
			}
			// Bounded: a connection still open at 4× the header time fails.
			conn.SetReadDeadline(start.Add(4 * header))
			n, err := io.Copy(io.Discard, conn)
			took := time.Since(start)
			if isTimeout(err) || took > header*8/5 {
				t.Errorf("after \"P\" and nothing: closed after %v (%d bytes, %v); want within the header time (%v), not twice it",
					took.Round(time.Millisecond), n, err, header)
			}
		})
	}
}
