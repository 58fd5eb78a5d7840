package httplb

// Clients and backends that break HTTP/2's rules on sizes, windows, stream IDs
// and lengths: each is held to them without harm to the rest of the
// connection, or loses its connection when the rule says so.

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/balance"
)

// A client's stream that weir must reset for the client's fault (here a
// WINDOW_UPDATE of 0) costs a backend a request as one the client resets
// does ("rapid reset", CVE-2023-44487), so it counts against the same limit.
func TestResetsWeirSendsCountAsRapidReset(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	bs[0].Delay.Store(int64(50 * time.Millisecond))
	s := serve(t, Config{Algorithm: "round_robin"}, bs)
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	const streams = 20000
	wrote := make(chan time.Duration, 1)
	// Written from a goroutine: weir answers while the client writes. Exits
	// when the writes end or fail.
	go func() {
		start := time.Now()
		for i := range streams {
			id := uint32(2*i + 1)
			if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true}) != nil ||
				fr.WriteWindowUpdate(id, 0) != nil {
				break
			}
		}
		wrote <- time.Since(start)
	}()
	rfr := http2.NewFramer(nil, conn)
	rsts := 0
	deadline := time.Now().Add(8 * time.Second)
	for rsts < streams && time.Now().Before(deadline) {
		f, err := rfr.ReadFrame()
		if err != nil {
			t.Fatalf("read after %d resets: %v", rsts, err)
		}
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			if f.ErrCode != http2.ErrCodeEnhanceYourCalm {
				t.Errorf("GOAWAY %v after %d resets; want ENHANCE_YOUR_CALM", f.ErrCode, rsts)
			}
			if rsts > 2*maxResetsPerSecond {
				t.Errorf("GOAWAY after %d resets; want it past %d a second", rsts, maxResetsPerSecond)
			}
			return
		case *http2.RSTStreamFrame:
			rsts++
		}
	}
	took := <-wrote
	time.Sleep(200 * time.Millisecond) // the backend's requests in flight reach its handler
	hits := bs[0].Hits.Load()
	t.Errorf("%d streams opened and reset within %v with no GOAWAY, the backend got %d requests; want GOAWAY ENHANCE_YOUR_CALM past %d a second, as for RST_STREAM",
		rsts, took, hits, maxResetsPerSecond)
}

// weir advertises no SETTINGS_MAX_FRAME_SIZE, so a frame longer than 16,384
// bytes, from a client or a backend, is a FRAME_SIZE_ERROR for the connection
// (RFC 9113 4.2), not read (and held) whole.
func TestFrameOverMaxFrameSizeEndsConnection(t *testing.T) {
	oversized := func(w io.Writer) {
		var h [9]byte
		h[1], h[2] = 0x40, 0x01 // 16,385 bytes
		h[3] = 0x20             // of a type no one knows
		w.Write(h[:])
		w.Write(make([]byte, 16385))
	}
	t.Run("client", func(t *testing.T) {
		bs := httpbackend.StartN(t, 1)
		s := serve(t, Config{}, bs)
		conn, fr := h2Conn(t, s.Addr().String())
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		oversized(conn)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				t.Fatalf("read: %v; want GOAWAY FRAME_SIZE_ERROR", err)
			}
			if g, ok := f.(*http2.GoAwayFrame); ok {
				if g.ErrCode != http2.ErrCodeFrameSize {
					t.Errorf("GOAWAY %v; want FRAME_SIZE_ERROR", g.ErrCode)
				}
				return
			}
		}
	})
	t.Run("backend", func(t *testing.T) {
		away := make(chan http2.ErrCode, 1)
		be := rawBackend(t, func(conn net.Conn) {
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			preface := make([]byte, len(http2.ClientPreface))
			if _, err := io.ReadFull(conn, preface); err != nil {
				return
			}
			fr := http2.NewFramer(conn, conn)
			fr.WriteSettings()
			oversized(conn)
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					return
				}
				if g, ok := f.(*http2.GoAwayFrame); ok {
					away <- g.ErrCode
					return
				}
			}
		})
		s := serveOn(t, Config{Upstream: UpstreamH2C}, []Backend{{Addr: be, Weight: 1, Usable: true}})
		conn, fr := h2Conn(t, s.Addr().String())
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(s.Addr().String()), EndHeaders: true, EndStream: true})
		select {
		case code := <-away:
			if code != http2.ErrCodeFrameSize {
				t.Errorf("weir's GOAWAY to the backend: %v; want FRAME_SIZE_ERROR", code)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no GOAWAY to a backend that sent a frame of 16,385 bytes")
		}
	})
}

// A backend's stream gets a window of recvStreamWin: a backend that sends
// past it has its stream reset, not its bytes queued without bound for a
// client that reads slowly.
func TestBackendPastItsStreamWindowIsReset(t *testing.T) {
	const total = 32 << 20
	rst := make(chan http2.ErrCode, 4)
	sent := make(chan int, 1)
	be := rawBackend(t, func(conn net.Conn) {
		conn.SetDeadline(time.Now().Add(15 * time.Second))
		preface := make([]byte, len(http2.ClientPreface))
		if _, err := io.ReadFull(conn, preface); err != nil {
			return
		}
		fr := http2.NewFramer(conn, conn)
		fr.WriteSettings()
		var wmu sync.Mutex
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.RSTStreamFrame:
				rst <- f.ErrCode
			case *http2.SettingsFrame:
				if !f.IsAck() {
					wmu.Lock()
					fr.WriteSettingsAck()
					wmu.Unlock()
				}
			case *http2.HeadersFrame:
				id := f.StreamID
				wmu.Lock()
				hb.Reset()
				enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
				fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hb.Bytes(), EndHeaders: true})
				wmu.Unlock()
				// Exits once the body is written or the connection fails.
				go func() {
					chunk := make([]byte, 16384)
					n := 0
					for n < total {
						wmu.Lock()
						err := fr.WriteData(id, false, chunk)
						wmu.Unlock()
						if err != nil {
							break
						}
						n += len(chunk)
					}
					sent <- n
				}()
			}
		}
	})
	s := getWithoutWindow(t, be)
	var n int
	select {
	case code := <-rst:
		if code != http2.ErrCodeFlowControl {
			t.Errorf("weir reset the backend's stream with %v; want FLOW_CONTROL_ERROR", code)
		}
		return
	case n = <-sent:
	case <-time.After(10 * time.Second):
		t.Fatal("the backend's body neither went out nor was reset in 10s")
	}
	select {
	case code := <-rst:
		if code != http2.ErrCodeFlowControl {
			t.Errorf("weir reset the backend's stream with %v; want FLOW_CONTROL_ERROR", code)
		}
		return
	case <-time.After(300 * time.Millisecond):
	}
	// What weir holds for the client, queued in its stream.
	queued := 0
	s.fmu.Lock()
	for ss := range s.fsessions {
		ss.mu.Lock()
		for _, st := range ss.streams {
			for _, b := range st.respQ {
				queued += len(b)
			}
		}
		ss.mu.Unlock()
	}
	s.fmu.Unlock()
	t.Errorf("the backend sent %d MiB on a stream whose window weir set at %d KiB, without a reset; weir holds %d MiB of it queued for a client that takes none",
		n>>20, recvStreamWin>>10, queued>>20)
}

// TestBackendOverrunWithEndStreamIsResetByWeir: a backend's DATA that runs
// past the stream's window weir gave is reset (FLOW_CONTROL_ERROR) even when it
// carries END_STREAM, and the stream counts as closed by weir's reset: frames
// the backend sends on it after are ignored (RFC 9113 5.1), not taken for
// frames after both sides had ended it, which would end the connection with
// GOAWAY STREAM_CLOSED and fail every other request on it.
func TestBackendOverrunWithEndStreamIsResetByWeir(t *testing.T) {
	got := make(chan string, 1)
	be := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
		var id uint32
		for id == 0 {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			if h, ok := f.(*http2.HeadersFrame); ok {
				id = h.StreamID
			}
		}
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: statusBlock("200"), EndHeaders: true})
		// The whole window weir gave the stream, then a byte past it with
		// END_STREAM. The client grants no window of its own, so weir
		// passes on under creditBatch and gives the stream no more.
		chunk := make([]byte, defaultMaxFrame)
		for range recvStreamWin / defaultMaxFrame {
			fr.WriteData(id, false, chunk)
		}
		fr.WriteData(id, true, []byte("x"))
		if a := frameAnswer(fr, id); a != "RST_STREAM "+http2.ErrCodeFlowControl.String() {
			got <- "to the overrun: " + a
			return
		}
		// Late DATA on the stream weir reset.
		fr.WriteData(id, true, []byte("late"))
		fr.WritePing(false, [8]byte{'l', 'a', 't', 'e'})
		got <- frameAnswer(fr, id)
		io.Copy(io.Discard, conn)
	})
	getWithoutWindow(t, be)
	select {
	case g := <-got:
		if g != "PING answered" {
			t.Errorf("after DATA on the stream weir reset: %s; want PING answered", g)
		}
	case <-time.After(15 * time.Second):
		t.Error("the backend saw no answer from weir in 15s")
	}
}

// getWithoutWindow serves a service over the backend be, and sends it a GET
// from an HTTP/2 client that reads what its 65,535-byte windows let through
// and never grants more, until cleanup closes its connection.
func getWithoutWindow(t *testing.T, be netip.AddrPort) *Service {
	t.Helper()
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(15 * time.Second))
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true}); err != nil {
		t.Fatal(err)
	}
	// Exits when the connection closes.
	go func() {
		for {
			if _, err := fr.ReadFrame(); err != nil {
				return
			}
		}
	}()
	return s
}

// weir's own answers (503 when no backend is usable, 502 and 504 after failed
// tries, 405, 431) send their body within the client's windows, as a
// backend's answer goes: DATA past them would fail the whole connection.
func TestOwnAnswerWaitsForTheWindow(t *testing.T) {
	s := serveOn(t, Config{}, []Backend{{Addr: netip.MustParseAddrPort("127.0.0.1:1"), Weight: 1, Usable: false}})
	addr := s.Addr().String()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(conn, http2.ClientPreface)
	fr := http2.NewFramer(conn, conn)
	fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
	var body []byte
	opened := false
	for {
		if !opened {
			conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		}
		f, err := fr.ReadFrame()
		if ne, ok := err.(net.Error); ok && ne.Timeout() && !opened {
			// Nothing more while the window is shut: open it.
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			fr.WriteWindowUpdate(1, 1000)
			opened = true
			continue
		}
		if err != nil {
			t.Fatalf("read: %v; want the 503's body once the window opened", err)
		}
		switch f := f.(type) {
		case *http2.HeadersFrame:
			if got := headerValue(decodeFields(t, f.HeaderBlockFragment()), ":status"); got != "503" {
				t.Errorf("status %s; want 503", got)
			}
		case *http2.DataFrame:
			if !opened && len(f.Data()) > 0 {
				t.Fatalf("%d bytes of DATA on a stream whose window the client set at 0: %q", len(f.Data()), f.Data())
			}
			body = append(body, f.Data()...)
			if f.StreamEnded() {
				if !bytes.Contains(body, []byte("no usable backend")) {
					t.Errorf("body %q; want weir's reason", body)
				}
				return
			}
		}
	}
}

func decodeFields(t *testing.T, block []byte) []hpack.HeaderField {
	t.Helper()
	fields, err := hpack.NewDecoder(4096, nil).DecodeFull(block)
	if err != nil {
		t.Fatal(err)
	}
	return fields
}

func headerValue(fields []hpack.HeaderField, name string) string {
	for _, f := range fields {
		if f.Name == name {
			return f.Value
		}
	}
	return ""
}

// Trailers a client sent while weir answered and reset its stream (an answer
// before the request's end) are ignored, as frames on a stream weir reset are
// (RFC 9113 5.1); the connection goes on.
func TestTrailersAfterEarlyAnswerIgnored(t *testing.T) {
	be, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/upload" {
			w.WriteHeader(http.StatusUnauthorized) // without reading the body
			return
		}
		io.WriteString(w, "ok")
	})
	s := serveOn(t, Config{}, []Backend{be})
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", addr}, {":path", "/upload"}, {"te", "trailers"}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	fr.WriteData(1, false, []byte("part of the upload"))
	// Wait for the answer to stream 1 and weir's RST_STREAM of it.
	for rst := false; !rst; {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		switch f := f.(type) {
		case *http2.HeadersFrame:
			t.Logf("stream %d answered (END_STREAM %v)", f.StreamID, f.StreamEnded())
		case *http2.RSTStreamFrame:
			t.Logf("weir reset stream %d: %v", f.StreamID, f.ErrCode)
			rst = true
		case *http2.GoAwayFrame:
			t.Fatalf("GOAWAY %v before the trailers", f.ErrCode)
		}
	}
	// The client's trailers (sent before it read the reset), then a new request.
	hb.Reset()
	enc.WriteField(hpack.HeaderField{Name: "x-checksum", Value: "abc"})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true, EndStream: true})
	hb.Reset()
	for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", addr}, {":path", "/"}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: hb.Bytes(), EndHeaders: true, EndStream: true})
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v; want the answer to stream 3", err)
		}
		switch f := f.(type) {
		case *http2.HeadersFrame:
			if f.StreamID == 3 {
				return
			}
		case *http2.GoAwayFrame:
			t.Fatalf("GOAWAY %v %q after trailers on a stream weir had reset; want them ignored and stream 3 answered", f.ErrCode, f.DebugData())
		}
	}
}

// A HEADERS frame whose block is malformed opens its stream all the same (RFC
// 9113 5.1.1): a lower stream ID after it is a connection error.
func TestMalformedHeadersUseTheirStreamID(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{}, bs)
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 7, BlockFragment: h2Get(addr, "X-Upper", "1"), EndHeaders: true, EndStream: true})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 7, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
	answered := 0
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		switch f := f.(type) {
		case *http2.RSTStreamFrame:
			t.Logf("RST_STREAM %d %v", f.StreamID, f.ErrCode)
		case *http2.GoAwayFrame:
			if f.ErrCode != http2.ErrCodeProtocol || f.LastStreamID != 7 {
				t.Errorf("GOAWAY %v, last stream %d; want PROTOCOL_ERROR, 7", f.ErrCode, f.LastStreamID)
			}
			return
		case *http2.HeadersFrame:
			t.Errorf("stream %d answered after stream 7 was opened (malformed); want GOAWAY PROTOCOL_ERROR", f.StreamID)
			if answered++; answered == 2 {
				return
			}
		}
	}
}

// A frame other than HEADERS or PRIORITY on a stream the client never opened
// is a connection error PROTOCOL_ERROR (RFC 9113 5.1), a WINDOW_UPDATE of 0
// too: that it would be a stream error on an open stream does not make it one
// here, where no RST_STREAM may go. The PING after it shows a weir that went
// on instead.
func TestClientFrameOnIdleStreamEndsConnection(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{}, bs)
	addr := s.Addr().String()
	for _, c := range []struct {
		name  string
		id    uint32
		write func(fr *http2.Framer, id uint32) error
	}{
		{"WINDOW_UPDATE of 0 above the streams opened", 3, func(fr *http2.Framer, id uint32) error { return fr.WriteWindowUpdate(id, 0) }},
		{"WINDOW_UPDATE of 0 on an even stream", 2, func(fr *http2.Framer, id uint32) error { return fr.WriteWindowUpdate(id, 0) }},
		{"WINDOW_UPDATE", 3, func(fr *http2.Framer, id uint32) error { return fr.WriteWindowUpdate(id, 1) }},
		{"RST_STREAM", 3, func(fr *http2.Framer, id uint32) error { return fr.WriteRSTStream(id, http2.ErrCodeCancel) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, fr := h2Conn(t, addr)
			t.Cleanup(func() { conn.Close() })
			if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true}); err != nil {
				t.Fatal(err)
			}
			if err := c.write(fr, c.id); err != nil {
				t.Fatal(err)
			}
			if err := fr.WritePing(false, [8]byte{'i', 'd', 'l', 'e'}); err != nil {
				t.Fatal(err)
			}
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					t.Fatalf("read: %v; want GOAWAY PROTOCOL_ERROR", err)
				}
				switch f := f.(type) {
				case *http2.RSTStreamFrame:
					if f.StreamID == c.id {
						t.Fatalf("RST_STREAM %v on idle stream %d; want GOAWAY PROTOCOL_ERROR", f.ErrCode, c.id)
					}
				case *http2.PingFrame:
					if f.IsAck() {
						t.Fatalf("PING answered after the frame on idle stream %d; want GOAWAY PROTOCOL_ERROR first", c.id)
					}
				case *http2.GoAwayFrame:
					if f.ErrCode != http2.ErrCodeProtocol || f.LastStreamID != 1 {
						t.Errorf("GOAWAY %v, last stream %d; want PROTOCOL_ERROR, 1", f.ErrCode, f.LastStreamID)
					}
					return
				}
			}
		})
	}
}

// A request whose DATA does not add up to its content-length is malformed and
// is not forwarded (RFC 9113 8.1.1): its stream is reset, the rest of the
// connection served.
func TestContentLengthMismatchNotForwarded(t *testing.T) {
	var mu sync.Mutex
	got := map[string]int{} // path: body bytes of the whole requests the backend got
	be, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		// weir streams a request: its headers may reach the backend before
		// the DATA that makes it malformed, and the backend then sees the
		// stream reset, never the request's end.
		n, err := io.Copy(io.Discard, r.Body)
		if err != nil {
			return
		}
		mu.Lock()
		got[r.URL.Path] = int(n)
		mu.Unlock()
	})
	s := serveOn(t, Config{}, []Backend{be})
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	cases := []struct {
		path, cl string
		body     int // -1: END_STREAM on the HEADERS
		ok       bool
	}{
		{"/longer", "5", 100, false},
		{"/shorter", "5", 3, false},
		{"/signed", "+5", 5, false},
		{"/none-sent", "5", -1, false},
		{"/twice", "5, 6", 5, false},
		{"/exact", "5", 5, true},
		{"/empty", "0", -1, true},
	}
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for i, c := range cases {
		hb.Reset()
		for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", addr}, {":path", c.path}, {"content-length", c.cl}} {
			enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		id := uint32(2*i + 1)
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hb.Bytes(), EndHeaders: true, EndStream: c.body < 0})
		if c.body >= 0 {
			fr.WriteData(id, true, bytes.Repeat([]byte("A"), c.body))
		}
	}
	outcome := map[uint32]string{}
	for len(outcome) < len(cases) {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v (outcomes so far %v)", err, outcome)
		}
		switch f := f.(type) {
		case *http2.RSTStreamFrame:
			if _, done := outcome[f.StreamID]; !done {
				outcome[f.StreamID] = f.ErrCode.String()
			}
		case *http2.HeadersFrame:
			outcome[f.StreamID] = "answered"
		case *http2.GoAwayFrame:
			t.Fatalf("GOAWAY %v; want only the malformed streams reset", f.ErrCode)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i, c := range cases {
		want := "PROTOCOL_ERROR"
		if c.ok {
			want = "answered"
		}
		if o := outcome[uint32(2*i+1)]; o != want {
			t.Errorf("%s (content-length %q, %d bytes): %s; want %s", c.path, c.cl, c.body, o, want)
		}
		if n, seen := got[c.path]; seen && !c.ok {
			t.Errorf("%s (content-length %q): the backend got the whole request, %d bytes of body; want it reset", c.path, c.cl, n)
		}
		if n := got[c.path]; c.ok && c.body > 0 && n != c.body {
			t.Errorf("%s (content-length %q): the backend got %d bytes of body; want %d", c.path, c.cl, n, c.body)
		}
	}
}

// Empty CONTINUATION frames cost nothing to send and a read each: a header
// block may span only so many frames (the CONTINUATION flood, CVE-2024-27316).
func TestContinuationFloodEndsConnection(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{}, bs)
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	const empties = 50000
	// Exits when the writes end or fail.
	go func() {
		if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndStream: true}) != nil {
			return
		}
		for range empties {
			if fr.WriteContinuation(1, false, nil) != nil {
				return
			}
		}
		fr.WriteContinuation(1, true, nil)
	}()
	rfr := http2.NewFramer(nil, conn)
	for {
		f, err := rfr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			if f.ErrCode != http2.ErrCodeProtocol {
				t.Errorf("GOAWAY %v; want PROTOCOL_ERROR", f.ErrCode)
			}
			return
		case *http2.HeadersFrame:
			t.Errorf("a header block of 1 HEADERS and %d empty CONTINUATION frames was read whole and answered (stream %d); want the connection closed", empties+1, f.StreamID)
			return
		}
	}
}

// A header block whose CONTINUATION frames stop coming (slowloris over
// HTTP/2) ends its connection after the header timeout, even while another
// stream is open (which stops the idle timeout).
func TestStalledHeaderBlockTimesOut(t *testing.T) {
	be, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-r.Context().Done() // a long answer keeps stream 1 open
	})
	s := serveOn(t, Config{ReadHeaderTimeout: 300 * time.Millisecond}, []Backend{be})
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
	block := h2Get(addr)
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: block[:2], EndStream: true}) // the rest never comes
	start := time.Now()
	conn.SetReadDeadline(start.Add(5 * time.Second))
	for {
		if _, err := fr.ReadFrame(); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatalf("the connection was still open after 5s with a header block stalled; want it closed after the header timeout (300ms)")
			}
			if d := time.Since(start); d < 250*time.Millisecond {
				t.Errorf("closed after %v; want the header timeout (300ms) first", d)
			}
			return
		}
	}
}

// fieldBlock encodes name, value pairs with enc into a header block of its own.
func fieldBlock(enc *hpack.Encoder, buf *bytes.Buffer, fields ...string) []byte {
	buf.Reset()
	for i := 0; i+1 < len(fields); i += 2 {
		enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	return bytes.Clone(buf.Bytes())
}

// weir's own answer to a HEAD request (no usable backend; a backend that
// refuses connections, answered from the backend connection's goroutine) is
// its headers alone, and the connection goes on.
func TestOwnAnswerToHEAD(t *testing.T) {
	for _, tc := range []struct {
		name   string
		usable bool
	}{
		{"no usable backend", false},
		{"backend refuses connections", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			panics := enginePanics.Load()
			s := serveOn(t, Config{}, []Backend{{Addr: netip.MustParseAddrPort("127.0.0.1:1"), Weight: 1, Usable: tc.usable}})
			addr := s.Addr().String()
			conn, fr := h2Conn(t, addr)
			defer conn.Close()
			var buf bytes.Buffer
			enc := hpack.NewEncoder(&buf)
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, EndHeaders: true, EndStream: true,
				BlockFragment: fieldBlock(enc, &buf, ":method", "HEAD", ":scheme", "http", ":authority", addr, ":path", "/")})
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, EndHeaders: true, EndStream: true,
				BlockFragment: fieldBlock(enc, &buf, ":method", "GET", ":scheme", "http", ":authority", addr, ":path", "/")})
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			head, get := false, false
			for !head || !get {
				f, err := fr.ReadFrame()
				if err != nil {
					t.Fatalf("read: %v (HEAD answered %v, GET answered %v)", err, head, get)
				}
				switch f := f.(type) {
				case *http2.HeadersFrame:
					head = head || f.StreamID == 1 && f.StreamEnded()
				case *http2.DataFrame:
					if f.StreamID == 1 {
						t.Errorf("DATA on the HEAD's stream: %q", f.Data())
					}
					get = get || f.StreamID == 3 && f.StreamEnded()
				}
			}
			if n := enginePanics.Load() - panics; n != 0 {
				t.Errorf("%d connections ended by a panic", n)
			}
		})
	}
}

// A request weir refuses (REFUSED_STREAM, here after its GOAWAY) whose body
// and trailers were already on their way: they are ignored, and the streams
// the GOAWAY let finish are answered.
func TestTrailersOnRefusedStreamIgnored(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	bs[0].Delay.Store(int64(300 * time.Millisecond))
	sv := serveStoppable(t, Config{}, backendSet(bs))
	addr := sv.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, EndHeaders: true, EndStream: true,
		BlockFragment: fieldBlock(enc, &buf, ":method", "GET", ":scheme", "http", ":authority", addr, ":path", "/")})
	// Stream 1 is open (its answer 300 ms away) when the shutdown's GOAWAY goes.
	if !waitfor.Cond(5*time.Second, func() bool { return sv.stats.inflight.Load() > 0 }) {
		t.Fatal("stream 1 not open after 5s")
	}
	sv.stop()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	answered, refused := false, false
	for !answered || !refused {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v; want stream 1 answered (%v), stream 3 refused (%v)", err, answered, refused)
		}
		switch f := f.(type) {
		case *http2.RSTStreamFrame:
			refused = refused || f.StreamID == 3 && f.ErrCode == http2.ErrCodeRefusedStream
		case *http2.GoAwayFrame:
			if f.ErrCode != http2.ErrCodeNo {
				t.Fatalf("GOAWAY %v %q; want the shutdown's only", f.ErrCode, f.DebugData())
			}
			// A client that had not read it yet sends a whole upload.
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, EndHeaders: true,
				BlockFragment: fieldBlock(enc, &buf, ":method", "POST", ":scheme", "http", ":authority", addr, ":path", "/")})
			fr.WriteData(3, false, []byte("hello"))
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, EndHeaders: true, EndStream: true, BlockFragment: fieldBlock(enc, &buf, "x-trailer", "1")})
		case *http2.DataFrame:
			answered = answered || f.StreamID == 1 && f.StreamEnded()
		}
	}
}

// TestFramesBrokenAnswerOneOutcome: an HTTP/2 backend that breaks off every
// answer after its headers is told to passive health as one Reset per try,
// not as a Success (at the headers) and a Reset, whose Success would end the
// run of failures an ejection counts; a whole answer is one Success.
func TestFramesBrokenAnswerOneOutcome(t *testing.T) {
	be, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/whole" {
			io.WriteString(w, "whole")
			return
		}
		w.Header().Set("Content-Length", "100")
		io.WriteString(w, "part")
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler) // the stream reset mid-answer
	})
	obs := &outcomeLog{}
	s := serveOn(t, Config{Observer: obs}, []Backend{be})
	c := h2cClient()
	for range 3 {
		resp, err := c.Get("http://" + s.Addr().String() + "/broken")
		if err == nil {
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		if err == nil {
			t.Fatal("a broken-off answer read whole")
		}
	}
	resp, body := get(t, c, "http://"+s.Addr().String()+"/whole")
	if resp.StatusCode != 200 || body != "whole" {
		t.Fatalf("got %d %q; want 200 whole", resp.StatusCode, body)
	}
	want := []Outcome{Reset, Reset, Reset, Success}
	waitfor.Value(t, 5*time.Second, fmt.Sprint("outcomes ", want), func() (any, bool) {
		got := obs.get()
		return got, slices.Equal(got, want)
	})
}

// scriptedBackend speaks HTTP/2 on conn and hands each request's decoded
// headers to answer, which writes what it likes with w (under the connection's
// write lock); frames it gets later go to on, if not nil, in the same way.
func scriptedBackend(conn net.Conn, answer func(w *scriptedConn, f *http2.MetaHeadersFrame), on func(w *scriptedConn, f http2.Frame)) {
	conn.SetDeadline(time.Now().Add(15 * time.Second))
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(conn, preface); err != nil {
		return
	}
	fr := http2.NewFramer(conn, conn)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	w := &scriptedConn{fr: fr}
	w.enc = hpack.NewEncoder(&w.hb)
	fr.WriteSettings()
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		w.mu.Lock()
		if mh, ok := f.(*http2.MetaHeadersFrame); ok {
			answer(w, mh)
		} else if on != nil {
			on(w, f)
		}
		w.mu.Unlock()
	}
}

// scriptedConn is a scriptedBackend's side of its connection.
type scriptedConn struct {
	mu  sync.Mutex
	fr  *http2.Framer
	hb  bytes.Buffer
	enc *hpack.Encoder
}

// headers writes a HEADERS frame of the fields (name, value, ...).
func (w *scriptedConn) headers(id uint32, end bool, fields ...string) {
	w.hb.Reset()
	for i := 0; i+1 < len(fields); i += 2 {
		w.enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	w.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: w.hb.Bytes(), EndHeaders: true, EndStream: end})
}

// A backend's DATA after a stream's end, on a stream it reset itself, is a
// stream error STREAM_CLOSED (RFC 9113 5.1, 6.1): that stream reset, the
// connection and its other streams going on. After weir's own reset, the
// backend may have sent it before it saw the reset: it is dropped. So it is
// after an answer the backend ended while weir's request was still open, and
// that reached the client whole: weir has reset the stream (the request goes
// no further), and sends no second reset (TestOneResetPerStream has the
// answer still waiting, and the STREAM_CLOSED). Before, weir dropped every
// frame on a stream it had finished with.
func TestBackendLateDataOnClosedStream(t *testing.T) {
	for _, c := range []struct {
		name string
		path string
		want string // weir's answer to the late DATA
	}{
		{"after the backend's RST_STREAM", "/peer-reset", "RST_STREAM STREAM_CLOSED"},
		{"after the backend's END_STREAM with the request open, once weir has reset it", "/early-end", "nothing"},
		{"after weir's RST_STREAM", "/weir-reset", "nothing"},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Each late DATA is followed by a PING: weir reads frames in
			// order, so its answer to the DATA, if any, comes before the ACK.
			verdict := make(chan string, 4)
			var conns atomic.Int64
			var late uint32 // the stream of the late DATA, once sent; under the conn's lock
			lateData := func(w *scriptedConn, id uint32) {
				late = id
				w.fr.WriteData(id, true, []byte("late"))
				w.fr.WritePing(false, [8]byte{'l', 'a', 't', 'e'})
			}
			be := rawBackend(t, func(conn net.Conn) {
				conns.Add(1)
				answer := "nothing"
				scriptedBackend(conn, func(w *scriptedConn, f *http2.MetaHeadersFrame) {
					id := f.StreamID
					switch f.PseudoValue("path") {
					case "/peer-reset":
						w.headers(id, false, ":status", "200")
						w.fr.WriteRSTStream(id, http2.ErrCodeCancel)
						lateData(w, id)
					case "/early-end":
						w.headers(id, true, ":status", "200")
						lateData(w, id)
					case "/weir-reset":
						w.headers(id, false, ":status", "200")
					default:
						w.headers(id, false, ":status", "200")
						w.fr.WriteData(id, true, []byte("ok"))
					}
				}, func(w *scriptedConn, f http2.Frame) {
					switch f := f.(type) {
					case *http2.RSTStreamFrame:
						if f.StreamID == late && f.ErrCode == http2.ErrCodeStreamClosed {
							answer = "RST_STREAM STREAM_CLOSED"
						} else if late == 0 && f.ErrCode == http2.ErrCodeCancel {
							lateData(w, f.StreamID) // weir's reset of /weir-reset
						}
					case *http2.PingFrame:
						if f.IsAck() && f.Data == [8]byte{'l', 'a', 't', 'e'} {
							verdict <- answer
						}
					case *http2.GoAwayFrame:
						verdict <- fmt.Sprintf("GOAWAY %v", f.ErrCode)
					}
				})
			})
			s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			addr := s.Addr().String()
			conn, fr := h2Conn(t, addr)
			t.Cleanup(func() { conn.Close() })
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			var buf bytes.Buffer
			enc := hpack.NewEncoder(&buf)
			if c.path == "/early-end" {
				// A POST whose body has not ended when the answer has.
				fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, EndHeaders: true,
					BlockFragment: fieldBlock(enc, &buf, ":method", "POST", ":scheme", "http", ":authority", addr, ":path", c.path)})
				fr.WriteData(1, false, []byte("part"))
			} else {
				fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, EndHeaders: true, EndStream: true,
					BlockFragment: fieldBlock(enc, &buf, ":method", "GET", ":scheme", "http", ":authority", addr, ":path", c.path)})
			}
			// The client's side: weir's answer on stream 1 (reset by the
			// client at its headers for /weir-reset), then a GET / on the same
			// connection, which must be answered.
			sentNext := false
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					t.Fatalf("client read: %v; want the second request's answer", err)
				}
				if g, ok := f.(*http2.GoAwayFrame); ok {
					t.Fatalf("client got GOAWAY %v; want its connection to go on", g.ErrCode)
				}
				if f.Header().StreamID == 1 && !sentNext {
					if c.path == "/weir-reset" {
						fr.WriteRSTStream(1, http2.ErrCodeCancel)
					}
					fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, EndHeaders: true, EndStream: true,
						BlockFragment: fieldBlock(enc, &buf, ":method", "GET", ":scheme", "http", ":authority", addr, ":path", "/")})
					sentNext = true
				}
				if d, ok := f.(*http2.DataFrame); ok && d.StreamID == 3 && d.StreamEnded() {
					break
				}
			}
			select {
			case got := <-verdict:
				if got != c.want {
					t.Errorf("weir's answer to the late DATA: %s; want %s", got, c.want)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("weir did not answer the PING behind the late DATA")
			}
			if n := conns.Load(); n != 1 {
				t.Errorf("the backend got %d connections; want 1, the second request on the first", n)
			}
		})
	}
}

// A backend's DATA on a stream whose END_STREAM went both ways cannot have
// been on its way before anything weir did: it ends the connection with
// GOAWAY STREAM_CLOSED (RFC 7540 5.1). The requests in flight on it fail as
// on a backend that died: a GET is tried again on another backend, a POST
// answered 502; the answer already delivered is whole.
func TestBackendLateDataAfterBothEndsClosesConnection(t *testing.T) {
	goaway := make(chan http2.ErrCode, 4)
	backend := func(name string) netip.AddrPort {
		return rawBackend(t, func(conn net.Conn) {
			var first uint32 // the answered stream, on this connection
			held := 0
			scriptedBackend(conn, func(w *scriptedConn, f *http2.MetaHeadersFrame) {
				id := f.StreamID
				switch path := f.PseudoValue("path"); {
				case path == "/first":
					w.headers(id, true, ":status", "200", "x-backend", name)
					first = id
				case strings.HasPrefix(path, "/held") && first != 0:
					// Held until the other is in: then DATA on the
					// stream that ended both ways.
					if held++; held == 2 {
						w.fr.WriteData(first, true, []byte("late"))
					}
				default:
					w.headers(id, false, ":status", "200", "x-backend", name)
					w.fr.WriteData(id, true, []byte("ok"))
				}
			}, func(w *scriptedConn, f http2.Frame) {
				if g, ok := f.(*http2.GoAwayFrame); ok {
					goaway <- g.ErrCode
				}
			})
		})
	}
	a, b := backend("a"), backend("b")
	s := serveOn(t, Config{Algorithm: balance.Maglev, Hash: HashHeader, HashName: "x-key", Retries: 1},
		[]Backend{{Addr: a, Weight: 1, Usable: true}, {Addr: b, Weight: 1, Usable: true}})
	client := h2cClient()
	client.Timeout = 8 * time.Second
	t.Cleanup(client.CloseIdleConnections)
	url := "http://" + s.Addr().String()
	send := func(method, path string) (*http.Response, string, error) {
		var body io.Reader
		if method == http.MethodPost {
			body = strings.NewReader("post body")
		}
		req, _ := http.NewRequest(method, url+path, body)
		req.Header.Set("x-key", "k")
		resp, err := client.Do(req)
		if err != nil {
			return nil, "", err
		}
		defer resp.Body.Close()
		got, err := io.ReadAll(resp.Body)
		return resp, string(got), err
	}
	resp, _, err := send(http.MethodGet, "/first")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /first: %v, %v; want 200", resp, err)
	}
	first := resp.Header.Get("x-backend")
	type result struct {
		status  int
		backend string
		err     error
	}
	get, post := make(chan result, 1), make(chan result, 1)
	for _, r := range []struct {
		method string
		out    chan result
	}{{http.MethodGet, get}, {http.MethodPost, post}} {
		// Exits within the client's timeout.
		go func() {
			resp, _, err := send(r.method, "/held")
			if err != nil {
				r.out <- result{err: err}
				return
			}
			r.out <- result{status: resp.StatusCode, backend: resp.Header.Get("x-backend")}
		}()
	}
	select {
	case code := <-goaway:
		if code != http2.ErrCodeStreamClosed {
			t.Errorf("GOAWAY %v; want STREAM_CLOSED", code)
		}
	case <-time.After(8 * time.Second):
		t.Error("no GOAWAY for DATA on a stream that ended both ways")
	}
	if r := <-get; r.err != nil || r.status != http.StatusOK || r.backend == first {
		t.Errorf("the GET in flight: %d from %q (%v); want 200 from the other backend than %q", r.status, r.backend, r.err, first)
	}
	if r := <-post; r.err != nil || r.status != http.StatusBadGateway {
		t.Errorf("the POST in flight: %d (%v); want 502", r.status, r.err)
	}
}

// A backend that ends its answer while weir's request is still being sent
// leaves the stream half-closed on weir's side (RFC 9113 5.1): weir sends no
// more of the request, so it must reset the stream, or the backend keeps it
// open for good, counting against its stream limit (RFC 9113 5.1.2). weir did
// so only once the answer had reached the client whole; an answer it rejects
// (an interim status that ends the stream) or a client that resets its stream
// before the answer has reached it left the backend's stream open.
func TestBackendEndedStreamIsResetWhenRequestIsCut(t *testing.T) {
	for _, c := range []struct {
		name   string
		status string // the backend's answer, which ends its stream
		// cut, with the client's framer, ends the client's side once weir
		// has answered or held the answer.
		cut func(fr *http2.Framer)
	}{
		{"interim status ending the stream", "100", func(*http2.Framer) {}},
		{"client reset before the answer reached it", "200", func(fr *http2.Framer) { fr.WriteRSTStream(1, http2.ErrCodeCancel) }},
		{"answer ended by trailers, delivered", "trailers", func(fr *http2.Framer) { fr.WriteWindowUpdate(1, 1<<20) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			var reset atomic.Int64 // the stream weir reset on the backend, once it has
			be := rawBackend(t, func(conn net.Conn) {
				scriptedBackend(conn, func(w *scriptedConn, f *http2.MetaHeadersFrame) {
					switch c.status {
					case "200":
						w.headers(f.StreamID, false, ":status", c.status)
						w.fr.WriteData(f.StreamID, true, []byte("the whole answer"))
						return
					case "trailers":
						w.headers(f.StreamID, false, ":status", "200")
						w.fr.WriteData(f.StreamID, false, []byte("the whole answer"))
						w.headers(f.StreamID, true, "grpc-status", "0")
						return
					}
					w.headers(f.StreamID, true, ":status", c.status)
				}, func(w *scriptedConn, f http2.Frame) {
					if r, ok := f.(*http2.RSTStreamFrame); ok {
						reset.Store(int64(r.StreamID))
					}
				})
			})
			fr, _ := postWindowShut(t, be)
			readHeadersOf(t, fr, 1)
			c.cut(fr)
			waitfor.Value(t, 5*time.Second, "weir's reset of the backend's stream", func() (any, bool) {
				id := reset.Load()
				return fmt.Sprintf("RST_STREAM on stream %d", id), id == 1
			})
		})
	}
}

// A backend may end its answer before the request's end and then reset the
// stream with NO_ERROR to stop the upload (RFC 9113 8.1; Go's server does).
// The stream is then closed on both sides, and weir must send nothing more on
// it (RFC 9113 5.1). weir sent its own reset once the answer had reached the
// client: after the backend's, for a client that took its time.
func TestBackendResetAfterEarlyAnswerIsNotResetAgain(t *testing.T) {
	n := resetsOfEarlyAnswer(t, func(w *scriptedConn) { w.fr.WriteRSTStream(1, http2.ErrCodeNo) }, readEarlyAnswer)
	if n != 0 {
		t.Errorf("weir sent %d RST_STREAM on the stream the backend had reset; want 0", n)
	}
}

// resetsOfEarlyAnswer has a backend answer, through weir, stream 1 of a
// client (postWindowShut) whole while the request's body is still open, then
// write what after writes on it. Once weir has read that, end ends the
// client's side of the stream; the client then sends a second request, which
// goes on the same backend connection, behind what weir sent on stream 1. It
// returns the RST_STREAMs weir sent the backend on stream 1 by then.
func resetsOfEarlyAnswer(t *testing.T, after func(w *scriptedConn), end func(t *testing.T, fr *http2.Framer)) int64 {
	t.Helper()
	behind := [8]byte{'a', 'f', 't', 'e', 'r'}
	var rsts atomic.Int64
	pinged := make(chan struct{})
	second := make(chan int64, 1)
	be := rawBackend(t, func(conn net.Conn) {
		scriptedBackend(conn, func(w *scriptedConn, f *http2.MetaHeadersFrame) {
			if f.StreamID != 1 {
				select {
				case second <- rsts.Load():
				default:
				}
				w.headers(f.StreamID, true, ":status", "204")
				return
			}
			w.headers(1, false, ":status", "200")
			w.fr.WriteData(1, true, []byte("the whole answer"))
			after(w)
			w.fr.WritePing(false, behind) // acknowledged once weir has read what after wrote
		}, func(w *scriptedConn, f http2.Frame) {
			switch f := f.(type) {
			case *http2.RSTStreamFrame:
				if f.StreamID == 1 {
					rsts.Add(1)
				}
			case *http2.PingFrame:
				if f.IsAck() && f.Data == behind {
					close(pinged)
				}
			}
		})
	})
	fr, get := postWindowShut(t, be)
	select {
	case <-pinged:
	case <-time.After(10 * time.Second):
		t.Fatal("weir did not acknowledge the backend's PING")
	}
	end(t, fr)
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, EndHeaders: true, EndStream: true, BlockFragment: get})
	select {
	case n := <-second:
		return n
	case <-time.After(10 * time.Second):
		t.Fatalf("the second request did not reach the backend (weir sent %d RST_STREAM on stream 1)", rsts.Load())
	}
	return 0
}

// readEarlyAnswer has the client of resetsOfEarlyAnswer take stream 1's
// answer whole.
func readEarlyAnswer(t *testing.T, fr *http2.Framer) {
	fr.WriteWindowUpdate(1, 1<<20)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("client read: %v; want the answer's end", err)
		}
		if d, ok := f.(*http2.DataFrame); ok && d.StreamID == 1 && d.StreamEnded() {
			return
		}
	}
}

// postWindowShut serves be and sends it, through weir, the start of a POST on
// stream 1 whose body has not ended, from a client whose streams' windows are
// 0 (weir holds an answer's body for it). It returns the client's framer
// (its connection closed at cleanup) and a header block for a GET / on
// weir, for the client's next stream.
func postWindowShut(t *testing.T, be netip.AddrPort) (fr *http2.Framer, get []byte) {
	t.Helper()
	fr, request := h2ClientThrough(t, be)
	fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, EndHeaders: true, BlockFragment: request("POST")})
	fr.WriteData(1, false, []byte("part"))
	return fr, request("GET")
}

// h2ClientThrough serves be and connects an HTTP/2 client to weir (its
// connection closed at cleanup); request makes the header block of a
// request to / with a method, in the client's HPACK context.
func h2ClientThrough(t *testing.T, be netip.AddrPort) (fr *http2.Framer, request func(method string) []byte) {
	t.Helper()
	s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	return fr, func(method string) []byte {
		return fieldBlock(enc, &buf, ":method", method, ":scheme", "http", ":authority", addr, ":path", "/")
	}
}

// TestOneResetPerStream: weir sends at most one RST_STREAM on a stream, to a
// backend and to a client; frames the peer sends on it after that are
// dropped (RFC 9113 5.1). A backend's DATA after its answer's END_STREAM,
// while weir's request was still being sent, got STREAM_CLOSED, and the
// stream a CANCEL later all the same once the answer had reached the client
// or the client reset it; a client's DATA after its END_STREAM got
// STREAM_CLOSED as many times as it came.
func TestOneResetPerStream(t *testing.T) {
	for _, c := range []struct {
		name string
		end  func(t *testing.T, fr *http2.Framer) // see resetsOfEarlyAnswer
	}{
		{"backend's late DATA, then the answer delivered", readEarlyAnswer},
		{"backend's late DATA, then the client's reset", func(t *testing.T, fr *http2.Framer) {
			fr.WriteRSTStream(1, http2.ErrCodeCancel)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			lateData := func(w *scriptedConn) { w.fr.WriteData(1, false, []byte("late")) } // after its own END_STREAM
			if n := resetsOfEarlyAnswer(t, lateData, c.end); n != 1 {
				t.Errorf("weir sent %d RST_STREAM on the backend's stream; want 1", n)
			}
		})
	}
	t.Run("client's DATA after its END_STREAM, twice", func(t *testing.T) {
		be := rawBackend(t, func(conn net.Conn) {
			scriptedBackend(conn, func(w *scriptedConn, f *http2.MetaHeadersFrame) {}, nil) // never answers
		})
		fr, request := h2ClientThrough(t, be)
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, EndHeaders: true, BlockFragment: request("POST")})
		fr.WriteData(1, true, []byte("body"))
		fr.WriteData(1, false, []byte("after the end"))
		fr.WriteData(1, false, []byte("and again"))
		fr.WritePing(false, [8]byte{'l', 'a', 't', 'e'})
		n := 0
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				t.Fatalf("client read: %v; want the PING's answer", err)
			}
			if r, ok := f.(*http2.RSTStreamFrame); ok && r.StreamID == 1 {
				n++
			}
			if p, ok := f.(*http2.PingFrame); ok && p.IsAck() && p.Data == [8]byte{'l', 'a', 't', 'e'} {
				break
			}
		}
		if n != 1 {
			t.Errorf("weir sent %d RST_STREAM on the client's stream; want 1", n)
		}
	})
}

// TestEarlyAnswerCountsAgainstBackendStreamLimit: a stream the backend has
// ended while weir's request was still open counts against the backend's
// limit on concurrent streams until weir resets it (RFC 9113 5.1.2: a
// half-closed stream counts), so weir opens no stream past that limit on
// its connection meanwhile, and the next request goes on another. Before,
// weir took the stream for gone at the backend's END_STREAM: with the
// answer held for a client that reads nothing yet, the next request went
// on the same connection, over the limit, and the backend refused it.
func TestEarlyAnswerCountsAgainstBackendStreamLimit(t *testing.T) {
	over := make(chan uint32, 1)
	behind := [8]byte{'a', 'f', 't', 'e', 'r'}
	ended := make(chan struct{})
	answered := closeOnce(ended)
	be := rawBackend(t, func(conn net.Conn) {
		unreset := map[uint32]bool{} // streams this backend ended whose request weir has not ended or reset
		scriptedBackend(conn, func(w *scriptedConn, f *http2.MetaHeadersFrame) {
			if len(unreset) > 0 {
				// Over the limit of one stream: refused, as a backend may.
				select {
				case over <- f.StreamID:
				default:
				}
				w.fr.WriteRSTStream(f.StreamID, http2.ErrCodeRefusedStream)
				return
			}
			if f.StreamEnded() {
				w.headers(f.StreamID, true, ":status", "204")
				return
			}
			w.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 1})
			w.headers(f.StreamID, false, ":status", "200")
			w.fr.WriteData(f.StreamID, true, []byte("the whole answer"))
			unreset[f.StreamID] = true
			w.fr.WritePing(false, behind) // acknowledged once weir has read the answer's end
		}, func(w *scriptedConn, f http2.Frame) {
			switch f := f.(type) {
			case *http2.RSTStreamFrame:
				delete(unreset, f.StreamID)
			case *http2.PingFrame:
				if f.IsAck() && f.Data == behind {
					answered()
				}
			}
		})
	})
	fr, get := postWindowShut(t, be)
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("weir did not acknowledge the backend's PING after stream 1's answer")
	}
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, EndHeaders: true, EndStream: true, BlockFragment: get})
	readHeadersOf(t, fr, 3)
	select {
	case id := <-over:
		t.Errorf("weir opened stream %d past the backend's limit of 1, stream 1 open there", id)
	default:
	}
}

// readHeadersOf reads what weir sends the client until the headers of
// stream id's answer.
func readHeadersOf(t *testing.T, fr *http2.Framer, id uint32) {
	t.Helper()
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("client read: %v; want stream %d's answer headers", err, id)
		}
		if h, ok := f.(*http2.HeadersFrame); ok && h.StreamID == id {
			return
		}
	}
}
