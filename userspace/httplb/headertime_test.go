package httplb

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/weir-lb/weir/internal/httpbackend"
)

// TestPrefaceByteHeaderTime: a cleartext client that sends a first byte that
// could begin the HTTP/2 preface ("P") and then nothing is closed within
// read_header_timeout of its accept, through either HTTP/1.1 engine: the
// sniff for the preface and the request's read share the header time, as
// net/http's server shares it where it serves both protocols (no sniff; the
// last case). Before, the sniff waited out the header time for the rest of
// the preface, and the HTTP/1.1 engine then gave the request the header time
// again.
func TestPrefaceByteHeaderTime(t *testing.T) {
	const header = time.Second
	for _, c := range []struct {
		name string
		cfg  Config
	}{
		{"loop", Config{}},
		{"net_http", Config{NetHTTP1: true}},
		{"net_http both", Config{NetHTTP1: true, NetHTTP2: true}},
	} {
		t.Run(c.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			cfg := c.cfg
			cfg.ReadHeaderTimeout = header
			s := serve(t, cfg, bs)
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

// TestTLSHeaderTimeAfterHandshake: over TLS the handshake has
// read_header_timeout from the accept, and the first request, or the HTTP/2
// preface of a client that chose h2 by ALPN, has read_header_timeout again
// from the handshake's end, whichever engine serves it. A client that takes
// most of the header time for each is served. Before, the frame engine gave
// the preface only what the handshake had left of the header time.
func TestTLSHeaderTimeAfterHandshake(t *testing.T) {
	const header = 1500 * time.Millisecond
	pause := header * 3 / 5 // before the handshake, and after it: each less than the header time, both more
	cert, err := tls.X509KeyPair(testCert, testKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		cfg   Config
		proto string
	}{
		{"h2/frames", Config{}, "h2"},
		{"h2/net_http", Config{NetHTTP2: true}, "h2"},
		{"http1.1/loop", Config{}, "http/1.1"},
		{"http1.1/net_http", Config{NetHTTP1: true}, "http/1.1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			cfg := c.cfg
			cfg.ReadHeaderTimeout = header
			cfg.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
			s := serve(t, cfg, bs)
			// A client slow to start its handshake, and slow to send its
			// first request after it.
			dial := func(ctx context.Context, network, addr string, tc *tls.Config) (net.Conn, error) {
				raw, err := (&net.Dialer{}).DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				time.Sleep(pause)
				tc = tc.Clone()
				tc.InsecureSkipVerify, tc.NextProtos = true, []string{c.proto}
				conn := tls.Client(raw, tc)
				if err := conn.HandshakeContext(ctx); err != nil {
					raw.Close()
					return nil, err
				}
				if got := conn.ConnectionState().NegotiatedProtocol; got != c.proto {
					conn.Close()
					return nil, fmt.Errorf("ALPN chose %q", got)
				}
				time.Sleep(pause)
				return conn, nil
			}
			var rt http.RoundTripper
			if c.proto == "h2" {
				rt = &http2.Transport{DialTLSContext: dial}
			} else {
				rt = &http.Transport{DialTLSContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
					return dial(ctx, network, addr, &tls.Config{})
				}}
			}
			client := &http.Client{Transport: rt, Timeout: 10 * time.Second}
			t.Cleanup(client.CloseIdleConnections)
			resp, err := client.Get("https://" + s.Addr().String() + "/")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					err = errors.New(resp.Status)
				}
			}
			if err != nil {
				t.Errorf("a client that took %v before its handshake and %v after it: %v; want a 200", pause, pause, err)
			}
		})
	}
}
