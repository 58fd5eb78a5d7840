package httplb

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
)

// leakBaseline is the process's goroutines and descriptors with no client
// connected to a service.
type leakBaseline struct{ goroutines, fds int }

// takeBaseline waits until no client is connected to s, then counts.
func takeBaseline(t *testing.T, s *Service) leakBaseline {
	t.Helper()
	waitNoClients(t, s)
	return leakBaseline{runtime.NumGoroutine(), openFDs(t)}
}

// waitBack waits until no client is connected to s and the goroutines and
// descriptors are back where the baseline counted them.
func (b leakBaseline) waitBack(t *testing.T, s *Service) {
	t.Helper()
	waitNoClients(t, s)
	waitfor.Value(t, 5*time.Second, "goroutines and fds back where they were", func() (any, bool) {
		g, f := runtime.NumGoroutine(), openFDs(t)
		return [2]int{g, f}, g <= b.goroutines && f <= b.fds
	})
}

func waitNoClients(t *testing.T, s *Service) {
	t.Helper()
	waitfor.Value(t, 5*time.Second, "no client connection", func() (any, bool) {
		n := s.Snapshot().Connections
		return n, n == 0
	})
}

func openFDs(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(es)
}

// TestBadInput: oversized headers, malformed requests, HTTP/2 protocol errors
// and slow headers get the right status, stream reset or connection close,
// never reach a backend, and leave no goroutine or file descriptor behind.
func TestBadInput(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{MaxHeaderBytes: 4096, ReadHeaderTimeout: 300 * time.Millisecond}, bs)
	addr := s.Addr().String()
	// Good requests first, so the pools (every one of the H2Conns upstream h2
	// connections) and the backend's goroutines exist before the count.
	for _, c := range []*http.Client{h1Client(), h2cClient()} {
		for range s.cfg.H2Conns {
			get(t, c, "http://"+addr+"/")
		}
		c.CloseIdleConnections()
	}
	base := takeBaseline(t, s)
	hitsBefore := bs[0].Hits.Load()

	big := strings.Repeat("x", 8192)
	for _, c := range []struct {
		name string
		send string // raw HTTP/1.1 bytes
		want string // the status line's start; "" for a closed connection
	}{
		{"oversized header", "GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + big + "\r\n\r\n", "HTTP/1.1 431"},
		{"header without colon", "GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", "HTTP/1.1 400"},
		{"bad request line", "BLAH\r\n\r\n", "HTTP/1.1 400"},
		{"bad version", "GET / HTTP/9.9\r\nHost: x\r\n\r\n", "HTTP/1.1 505"},
		{"two content lengths", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "HTTP/1.1 400"},
		{"no host", "GET / HTTP/1.1\r\n\r\n", "HTTP/1.1 400"},
		{"control character", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", "HTTP/1.1 400"},
		// Go's request reader lets a space in a field name through.
		{"space in a field name", "GET / HTTP/1.1\r\nHost: x\r\nX A: 1\r\n\r\n", "HTTP/1.1 400"},
		{"space in a field name, with a body", "POST / HTTP/1.1\r\nHost: x\r\nX A: 1\r\nContent-Length: 1\r\n\r\nx", "HTTP/1.1 400"},
		{"CONNECT", "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", "HTTP/1.1 405"},
		// Slow headers: a byte every 100 ms never finishes within
		// read_header_timeout (300 ms), and the connection is closed.
		{"slowloris", "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			if c.name == "slowloris" {
				start := time.Now()
				for _, b := range []byte("GET / HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaa") {
					if _, err := conn.Write([]byte{b}); err != nil {
						break // closed by the server: what we want
					}
					time.Sleep(100 * time.Millisecond)
					if time.Since(start) > 3*time.Second {
						t.Fatalf("still open after %v of slow headers; want closed after read_header_timeout", time.Since(start))
					}
				}
				n, err := conn.Read(make([]byte, 512))
				if err == nil && n > 0 {
					// A 408 is as good as a close; either way no request went on.
					return
				}
				if !errors.Is(err, io.EOF) && !isReset(err) {
					t.Errorf("slow headers: read got %v; want the connection closed", err)
				}
				return
			}
			if _, err := io.WriteString(conn, c.send); err != nil {
				t.Fatal(err)
			}
			line, err := bufio.NewReader(conn).ReadString('\n')
			if !strings.HasPrefix(line, c.want) {
				t.Errorf("got %q (%v); want a status line starting %q", line, err, c.want)
			}
		})
	}
	t.Run("h2 oversized header", func(t *testing.T) {
		conn, fr := h2Conn(t, addr)
		defer conn.Close()
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr, "x-big", big), EndHeaders: true, EndStream: true})
		dec := hpack.NewDecoder(4096, nil)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				t.Fatalf("read: %v; want a 431 answer", err)
			}
			if h, ok := f.(*http2.HeadersFrame); ok && h.StreamID == 1 {
				fields, err := dec.DecodeFull(h.HeaderBlockFragment())
				if err != nil || len(fields) == 0 || fields[0].Value != "431" {
					t.Errorf("got %v (%v); want :status 431", fields, err)
				}
				return
			}
			if r, ok := f.(*http2.RSTStreamFrame); ok && r.StreamID == 1 {
				return // refusing the stream is right too
			}
			if g, ok := f.(*http2.GoAwayFrame); ok {
				t.Logf("GOAWAY %v", g.ErrCode)
				return // and so is refusing the connection
			}
		}
	})
	for _, c := range []struct {
		name  string
		write func(fr *http2.Framer) error
		want  http2.ErrCode
	}{
		{"h2 data on stream 0", func(fr *http2.Framer) error { return fr.WriteData(0, false, []byte("x")) }, http2.ErrCodeProtocol},
		{"h2 bad hpack", func(fr *http2.Framer) error {
			return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0xff, 0xff, 0xff, 0xff}, EndHeaders: true, EndStream: true})
		}, http2.ErrCodeCompression},
		{"h2 even stream id", func(fr *http2.Framer) error {
			return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 2, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
		}, http2.ErrCodeProtocol},
		{"h2 window overflow", func(fr *http2.Framer) error {
			if err := fr.WriteWindowUpdate(0, 1<<31-1); err != nil {
				return err
			}
			return fr.WriteWindowUpdate(0, 1<<31-1)
		}, http2.ErrCodeFlowControl},
		// An open stream's window at the limit, then a larger initial window:
		// a connection error (RFC 9113 6.9.2). The backend is slow, so the
		// stream is still open.
		{"h2 stream window overflow by SETTINGS", func(fr *http2.Framer) error {
			if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true}); err != nil {
				return err
			}
			if err := fr.WriteWindowUpdate(1, 1<<31-1-65535); err != nil {
				return err
			}
			return fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 65536})
		}, http2.ErrCodeFlowControl},
	} {
		t.Run(c.name, func(t *testing.T) {
			bs[0].Delay.Store(int64(200 * time.Millisecond))
			defer bs[0].Delay.Store(0)
			conn, fr := h2Conn(t, addr)
			defer conn.Close()
			if err := c.write(fr); err != nil {
				t.Fatal(err)
			}
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					t.Fatalf("read: %v; want GOAWAY %v", err, c.want)
				}
				if ga, ok := f.(*http2.GoAwayFrame); ok {
					if ga.ErrCode != c.want {
						t.Errorf("GOAWAY %v; want %v", ga.ErrCode, c.want)
					}
					return
				}
			}
		})
	}
	t.Run("h2 stream reset by the client", func(t *testing.T) {
		// A stream the client resets while the backend is slow: the plane
		// cancels the backend's request and the connection lives on.
		bs[0].Delay.Store(int64(200 * time.Millisecond))
		defer bs[0].Delay.Store(0)
		conn, fr := h2Conn(t, addr)
		defer conn.Close()
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
		fr.WriteRSTStream(1, http2.ErrCodeCancel)
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				t.Fatalf("read: %v; want stream 3's answer", err)
			}
			if h, ok := f.(*http2.HeadersFrame); ok && h.StreamID == 3 {
				return
			}
			if h, ok := f.(*http2.HeadersFrame); ok && h.StreamID == 1 {
				t.Errorf("got an answer on the reset stream 1")
			}
		}
	})
	if n := bs[0].Hits.Load() - hitsBefore; n > 3 {
		t.Errorf("the backend got %d requests from bad input; want at most the 3 well-formed h2 streams", n)
	}
	base.waitBack(t, s)
}

func isReset(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "reset by peer") || strings.Contains(err.Error(), "broken pipe"))
}

// h2Conn opens a raw HTTP/2 cleartext connection (preface and SETTINGS sent)
// with a framer that writes whatever it is told to.
func h2Conn(t *testing.T, addr string) (net.Conn, *http2.Framer) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(conn, http2.ClientPreface)
	fr := http2.NewFramer(conn, conn)
	fr.AllowIllegalWrites = true
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return conn, fr
}

// h2Get is an HPACK block for GET / on addr, with extra fields (name, value, ...).
func h2Get(addr string, extra ...string) []byte {
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	fields := [][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", addr}, {":path", "/"}}
	for i := 0; i+1 < len(extra); i += 2 {
		fields = append(fields, [2]string{extra[i], extra[i+1]})
	}
	for _, f := range fields {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	return buf.Bytes()
}
