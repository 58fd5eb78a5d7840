package httplb

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/weir-lb/weir/internal/netpair"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestClientTimeoutsCounted: a client whose host vanished (its link goes
// down) while the backend takes its time is sent the answer, which stays
// unacknowledged; the client user timeout fails its connection, which the
// service counts in ClientTimeouts once, on every engine that serves
// clients, after an h2c upgrade and in a tunnel, in cleartext and over TLS (whose layer sees the
// error as the accepted connection below it does). A client that closed its connection first, as
// clients do, counts nothing.
func TestClientTimeoutsCounted(t *testing.T) {
	for _, tc := range []struct {
		name    string
		netHTTP bool
		// alpn, when set, is the protocol the client asks for over TLS; empty:
		// cleartext.
		alpn string
		// ask sends, on a connection made with dial, a request to path: the
		// backend answers "/now" at once, and holds "/held" until it is
		// released. For "/now" it reads the answer and closes the
		// connection; for "/held" it returns once the request is on its way.
		ask func(t *testing.T, dial func() net.Conn, path string)
	}{
		{"h1 loop", false, "", askH1},
		{"h1 net_http", true, "", askH1},
		{"h2 frames", false, "", askH2},
		{"h2 net_http", true, "", askH2},
		{"h2c upgrade h1 loop", false, "", askH2cUpgrade},
		{"tunnel h1 loop", false, "", askTunnel},
		{"tunnel net_http", true, "", askTunnel},
		{"tls h1 loop", false, "http/1.1", askH1},
		{"tls h1 net_http", true, "http/1.1", askH1},
		{"tls h2 frames", false, "h2", askH2},
		{"tls h2 net_http", true, "h2", askH2},
		{"tls tunnel h1 loop", false, "http/1.1", askTunnel},
		{"tls tunnel net_http", true, "http/1.1", askTunnel},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pair := netpair.New(t)
			be, release, waiting := releasedBackend(t)
			listenInA := func(cfg Config, bs []Backend) (s *Service, err error) {
				err = pair.A.Do(func() error { s, err = Listen(cfg, bs); return err })
				return s, err
			}
			cfg := Config{Listen: netip.AddrPortFrom(pair.AddrA, 0), ClientUserTimeout: time.Second,
				NetHTTP1: tc.netHTTP, NetHTTP2: tc.netHTTP, DrainTimeout: 100 * time.Millisecond}
			if tc.alpn != "" {
				cert, err := tls.X509KeyPair(testCert, testKey)
				if err != nil {
					t.Fatal(err)
				}
				cfg.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
			}
			s := serveStoppableWith(t, cfg, []Backend{{Addr: be, Weight: 1, Usable: true}}, listenInA).Service
			dial := func() net.Conn {
				c, err := pair.B.DialWith(context.Background(), &net.Dialer{KeepAlive: -1}, "tcp", s.Addr().String())
				if err != nil {
					t.Fatalf("dial: %v", err)
				}
				t.Cleanup(func() { c.Close() })
				if tc.alpn == "" {
					return c
				}
				tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{tc.alpn}})
				c.SetDeadline(time.Now().Add(10 * time.Second))
				if err := tc.Handshake(); err != nil {
					t.Fatalf("TLS handshake: %v", err)
				}
				c.SetDeadline(time.Time{})
				return tc
			}
			// Connections open, in the engine's hands or a tunnel's.
			open := func(want int64) func() (any, bool) {
				return func() (any, bool) {
					sn := s.Snapshot()
					return fmt.Sprintf("%d connections, %d tunnels", sn.Connections, sn.Tunnels), sn.Connections+sn.Tunnels == want
				}
			}
			tc.ask(t, dial, "/now")
			waitfor.Value(t, 10*time.Second, "none open", open(0))
			if n := s.Snapshot().ClientTimeouts; n != 0 {
				t.Fatalf("a client that closed: got %d client timeouts; want 0", n)
			}
			tc.ask(t, dial, "/held")
			waitfor.Value(t, 10*time.Second, "1 open", open(1))
			waitfor.Value(t, 10*time.Second, "the request held", func() (any, bool) {
				n := waiting.Load()
				return fmt.Sprintf("%d held", n), n == 1
			})
			pair.CutB(t)
			release() // the answer goes to the vanished client
			waitfor.Value(t, 20*time.Second, "none open", open(0))
			if n := s.Snapshot().ClientTimeouts; n != 1 {
				t.Errorf("a client that vanished: got %d client timeouts; want 1", n)
			}
		})
	}
}

// releasedBackend is a backend on loopback that answers a request for "/now" at
// once and one for "/held" once release is called (or the test ends),
// counting those it holds in waiting; an upgrade to "hold" it accepts, and
// sends releasedLen bytes into the tunnel, at once or on release as the path
// says.
func releasedBackend(t *testing.T) (addr netip.AddrPort, release func(), waiting *atomic.Int32) {
	held := make(chan struct{})
	release = closeOnce(held)
	t.Cleanup(release)
	waiting = new(atomic.Int32)
	wait := func(path string) {
		if path == "/held" {
			waiting.Add(1)
			<-held
		}
	}
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true) // the frame engine's upstream
	addr = startServer(t, &http.Server{Protocols: &protos, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "hold" {
			wait(r.URL.Path)
			io.WriteString(w, "ok")
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: hold\r\n\r\n")
		wait(r.URL.Path)
		c.Write(make([]byte, releasedLen))
		io.Copy(io.Discard, brw)
	})})
	return addr, release, waiting
}

// releasedLen is what releasedBackend sends into a tunnel.
const releasedLen = 64 << 10

// askH1 sends an HTTP/1.1 GET for path (see TestClientTimeoutsCounted).
func askH1(t *testing.T, dial func() net.Conn, path string) {
	c := dial()
	if _, err := io.WriteString(c, "GET "+path+" HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if path != "/now" {
		return
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	c.Close()
}

// askH2 sends a GET for path over HTTP/2 by prior knowledge (see
// TestClientTimeoutsCounted).
func askH2(t *testing.T, dial func() net.Conn, path string) {
	tr := &http2.Transport{AllowHTTP: true, DialTLSContext: func(context.Context, string, string, *tls.Config) (net.Conn, error) {
		return dial(), nil
	}}
	t.Cleanup(tr.CloseIdleConnections)
	req, err := http.NewRequest("GET", "http://x"+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	// Exits when the request is answered or fails (at the latest when the
	// test's cleanup closes the connection).
	go func() {
		resp, err := tr.RoundTrip(req)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		done <- err
	}()
	if path != "/now" {
		return
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no answer in 10s")
	}
	tr.CloseIdleConnections()
}

// askH2cUpgrade sends a GET for path with an upgrade to h2c, which the
// answer comes over, and for "/now" reads the answer's frames to its end and
// closes the connection (see TestClientTimeoutsCounted).
func askH2cUpgrade(t *testing.T, dial func() net.Conn, path string) {
	c := dial()
	br := switchProtocols(t, c, path, "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: \r\n")
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, http2.ClientPreface)
	fr := http2.NewFramer(c, br)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Time{})
	if path != "/now" {
		return
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		// The upgrade's request is stream 1; END_STREAM is the same bit on
		// HEADERS and DATA.
		if h := f.Header(); h.StreamID == 1 && h.Flags.Has(http2.FlagDataEndStream) {
			break
		}
	}
	c.Close()
}

// switchProtocols sends on c a GET for path with the upgrade fields given
// (each line ending in CRLF) and reads the 101 that must answer it; it returns
// the reader the rest is read with.
func switchProtocols(t *testing.T, c net.Conn, path, fields string) *bufio.Reader {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	io.WriteString(c, "GET "+path+" HTTP/1.1\r\nHost: x\r\n"+fields+"\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: got %v, %v; want 101", resp, err)
	}
	return br
}

// askTunnel switches protocols to "hold" with a request for path, and for
// "/now" reads what the backend sends into the tunnel and closes it (see
// TestClientTimeoutsCounted).
func askTunnel(t *testing.T, dial func() net.Conn, path string) {
	c := dial()
	br := switchProtocols(t, c, path, "Connection: Upgrade\r\nUpgrade: hold\r\n")
	if path != "/now" {
		return
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(br, make([]byte, releasedLen)); err != nil {
		t.Fatal(err)
	}
	c.Close()
}

// TestClientTimeoutsBeforeRequest: a client that connects and vanishes (its
// link goes down) before its first request is whole, while the service still
// looks at its first bytes for the engine to serve it, is given up on by
// keepalive and counted in ClientTimeouts once, as any other: having sent
// nothing, part of HTTP/2's preface, or over TLS.
func TestClientTimeoutsBeforeRequest(t *testing.T) {
	for _, tc := range []struct {
		name string
		tls  bool
		sent string
	}{
		{"nothing", false, ""},
		{"part of the preface", false, "PRI * HTTP/2.0\r\n"},
		{"tls", true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pair := netpair.New(t)
			listenInA := func(cfg Config, bs []Backend) (s *Service, err error) {
				err = pair.A.Do(func() error { s, err = Listen(cfg, bs); return err })
				return s, err
			}
			// The header time outlasts the keepalive's 2s by far: the
			// connection ends by the keepalive's failure, not by it.
			cfg := Config{Listen: netip.AddrPortFrom(pair.AddrA, 0), ReadHeaderTimeout: time.Minute,
				ClientKeepalive: net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 1},
				DrainTimeout:    100 * time.Millisecond}
			if tc.tls {
				cert, err := tls.X509KeyPair(testCert, testKey)
				if err != nil {
					t.Fatal(err)
				}
				cfg.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
			}
			s := serveStoppableWith(t, cfg, []Backend{{Addr: netip.MustParseAddrPort("127.0.0.1:1"), Weight: 1, Usable: true}}, listenInA).Service
			c, err := pair.B.DialWith(context.Background(), &net.Dialer{KeepAlive: -1}, "tcp", s.Addr().String())
			if err != nil {
				t.Fatalf("dial: %v", err)
			}
			t.Cleanup(func() { c.Close() })
			if tc.sent != "" {
				if _, err := io.WriteString(c, tc.sent); err != nil {
					t.Fatal(err)
				}
			}
			waitfor.Value(t, 10*time.Second, "the connection accepted", func() (any, bool) {
				n := s.Snapshot().Connections
				return fmt.Sprintf("%d connections", n), n == 1
			})
			pair.CutB(t)
			waitfor.Value(t, 20*time.Second, "none open", func() (any, bool) {
				n := s.Snapshot().Connections
				return fmt.Sprintf("%d connections", n), n == 0
			})
			if n := s.Snapshot().ClientTimeouts; n != 1 {
				t.Errorf("got %d client timeouts; want 1", n)
			}
		})
	}
}

// TestClientTimeoutsRejected: a request the HTTP/1.1 loop refuses (a field
// name that is not a token: 400; an Expect it does not know: 417) is answered
// and the connection half-closed, and what the client still sends is read and
// dropped for a moment before the close. A client that stopped taking
// packets (nothing from the service reaches it) leaves that answer
// unacknowledged: the client user timeout fails the connection during that
// read, which counts it in ClientTimeouts once, as any other read would.
func TestClientTimeoutsRejected(t *testing.T) {
	for _, tc := range []struct{ name, req string }{
		{"bad field name", "GET / HTTP/1.1\r\nHost: x\r\nX A: 1\r\n\r\n"},
		{"unknown expect", "GET / HTTP/1.1\r\nHost: x\r\nExpect: later\r\nContent-Length: 1\r\n\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pair := netpair.New(t)
			listenInA := func(cfg Config, bs []Backend) (s *Service, err error) {
				err = pair.A.Do(func() error { s, err = Listen(cfg, bs); return err })
				return s, err
			}
			// A user timeout well within the half second the refusal reads
			// for: the kernel retransmits by it (the RTO is clamped to it).
			cfg := Config{Listen: netip.AddrPortFrom(pair.AddrA, 0), ClientUserTimeout: 100 * time.Millisecond, DrainTimeout: 100 * time.Millisecond}
			s := serveStoppableWith(t, cfg, []Backend{{Addr: netip.MustParseAddrPort("127.0.0.1:1"), Weight: 1, Usable: true}}, listenInA).Service
			c, err := pair.B.DialWith(context.Background(), &net.Dialer{KeepAlive: -1}, "tcp", s.Addr().String())
			if err != nil {
				t.Fatalf("dial: %v", err)
			}
			t.Cleanup(func() { c.Close() })
			conns := func(want int64) func() (any, bool) {
				return func() (any, bool) {
					n := s.Snapshot().Connections
					return fmt.Sprintf("%d connections", n), n == want
				}
			}
			waitfor.Value(t, 10*time.Second, "the connection accepted", conns(1))
			// B's packets still reach the service; none of the service's
			// reach B.
			pair.B.Do(func() error { netpair.DropPort(t, s.Addr().(*net.TCPAddr).AddrPort().Port()); return nil })
			if _, err := io.WriteString(c, tc.req); err != nil {
				t.Fatal(err)
			}
			waitfor.Value(t, 20*time.Second, "the connection closed", conns(0))
			if n := s.Snapshot().ClientTimeouts; n != 1 {
				t.Errorf("got %d client timeouts; want 1", n)
			}
		})
	}
}
