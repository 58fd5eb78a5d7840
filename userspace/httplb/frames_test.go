package httplb

import (
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
)

// h2cBackend serves h on loopback over HTTP/2 cleartext (and HTTP/1.1), with
// at most maxStreams streams per connection (0: net/http's default); conns
// counts the connections it accepted.
func h2cBackend(t *testing.T, maxStreams int, h http.HandlerFunc) (Backend, *atomic.Int64) {
	t.Helper()
	return protoBackend(t, true, maxStreams, h)
}

// protoBackend is h2cBackend, with HTTP/1.1 served beside HTTP/2 cleartext
// only if http1 (without it, as a gRPC server: HTTP/2 by prior knowledge).
func protoBackend(t *testing.T, http1 bool, maxStreams int, h http.HandlerFunc) (Backend, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var p http.Protocols
	p.SetHTTP1(http1)
	p.SetUnencryptedHTTP2(true)
	conns := new(atomic.Int64)
	srv := &http.Server{Handler: h, Protocols: &p, HTTP2: &http.HTTP2Config{MaxConcurrentStreams: maxStreams},
		ConnState: func(_ net.Conn, st http.ConnState) {
			if st == http.StateNew {
				conns.Add(1)
			}
		}}
	done := make(chan struct{})
	// Exits when srv closes at cleanup.
	go func() { defer close(done); srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close(); <-done })
	return Backend{Addr: netip.MustParseAddrPort(ln.Addr().String()), Weight: 1, Usable: true}, conns
}

// TestFramesFlowControl: an answer much larger than the client's windows
// arrives whole, and never more of it than the client's windows allowed.
func TestFramesFlowControl(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{Algorithm: "round_robin"}, bs)
	addr := s.Addr().String()
	const size, win = 300_000, 8192
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: win})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: reqBlock("GET", addr, "/?size="+strconv.Itoa(size)), EndHeaders: true, EndStream: true})
	streamWin, connWin := int64(win), int64(65535)
	got := 0
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read after %d of %d bytes: %v", got, size, err)
		}
		d, ok := f.(*http2.DataFrame)
		if !ok || d.StreamID != 1 {
			if r, ok := f.(*http2.RSTStreamFrame); ok {
				t.Fatalf("stream reset (%v) after %d bytes", r.ErrCode, got)
			}
			continue
		}
		n := int64(d.Length)
		streamWin -= n
		connWin -= n
		if streamWin < 0 || connWin < 0 {
			t.Fatalf("after %d bytes: %d more than the stream window allowed, %d more than the connection's", got, -min(streamWin, 0), -min(connWin, 0))
		}
		got += len(d.Data())
		if d.StreamEnded() {
			break
		}
		// Consumed: give it all back, a frame at a time.
		fr.WriteWindowUpdate(1, uint32(n))
		fr.WriteWindowUpdate(0, uint32(n))
		streamWin += n
		connWin += n
	}
	if got != size {
		t.Errorf("got %d bytes; want %d", got, size)
	}
}

// TestFramesStalledClient: a client that stops reading its socket holds up
// only its own answers, not other clients' answers from the same backend
// connection, even with more of them waiting than that connection's window.
func TestFramesStalledClient(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{Algorithm: "round_robin"}, bs)
	addr := s.Addr().String()
	stalled, fr := h2Conn(t, addr)
	defer stalled.Close()
	fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1})
	fr.WriteWindowUpdate(0, 1<<31-1-65535)
	block := reqBlock("GET", addr, "/?size="+strconv.Itoa(64<<20))
	// Five large answers: together more than the backend connection's window.
	for i := range 5 {
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: block, EndHeaders: true, EndStream: true})
	}
	// The stalled client reads nothing from here on. Once its socket buffers
	// are full, the answers pile up in weir.
	time.Sleep(500 * time.Millisecond)
	client := h2cClient()
	client.Timeout = 5 * time.Second
	for i := range 20 {
		resp, body := get(t, client, "http://"+addr+"/?size=100")
		if resp.StatusCode != 200 || len(body) != 100 {
			t.Fatalf("request %d: %d, %d bytes", i, resp.StatusCode, len(body))
		}
	}
}

// TestFramesHeaders: header blocks past one frame (CONTINUATION) both ways,
// request trailers and answer trailers pass through.
func TestFramesHeaders(t *testing.T) {
	be, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Trailer", "X-Answer-Trailer")
		w.Header().Set("X-Seen-Big", strconv.Itoa(len(r.Header.Get("X-Big"))))
		w.Header().Set("X-Seen-Trailer", r.Trailer.Get("X-Req-Trailer"))
		w.Header().Set("X-Big-Answer", strings.Repeat("b", 40<<10))
		io.WriteString(w, "body")
		w.Header().Set("X-Answer-Trailer", "done")
	})
	s := serveOn(t, Config{Algorithm: "round_robin"}, []Backend{be})
	req, _ := http.NewRequest("POST", "http://"+s.Addr().String()+"/", io.MultiReader(strings.NewReader("payload")))
	req.Header.Set("X-Big", strings.Repeat("a", 30<<10))
	req.Trailer = http.Header{"X-Req-Trailer": nil}
	req.ContentLength = -1
	pr, pw := io.Pipe()
	req.Body = pr
	go func() {
		io.WriteString(pw, "payload")
		req.Trailer.Set("X-Req-Trailer", "sent")
		pw.Close()
	}()
	resp, err := h2cClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(body) != "body" {
		t.Fatalf("body %q, %v", body, err)
	}
	for _, c := range []struct{ what, got, want string }{
		{"the backend's X-Big length", resp.Header.Get("X-Seen-Big"), strconv.Itoa(30 << 10)},
		{"the request trailer at the backend", resp.Header.Get("X-Seen-Trailer"), "sent"},
		{"X-Big-Answer length", strconv.Itoa(len(resp.Header.Get("X-Big-Answer"))), strconv.Itoa(40 << 10)},
		{"the answer's trailer", resp.Trailer.Get("X-Answer-Trailer"), "done"},
	} {
		if c.got != c.want {
			t.Errorf("%s: %q; want %q", c.what, c.got, c.want)
		}
	}
}

// TestFramesBackendStreamLimit: a backend that allows 2 streams per connection
// gets more connections, and every request succeeds.
func TestFramesBackendStreamLimit(t *testing.T) {
	be, conns := h2cBackend(t, 2, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(50 * time.Millisecond)
		io.WriteString(w, "ok")
	})
	s := serveOn(t, Config{Algorithm: "round_robin"}, []Backend{be})
	client := h2cClient()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Go(func() {
			resp, err := client.Get("http://" + s.Addr().String() + "/")
			if err != nil {
				errs <- err
				return
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || string(b) != "ok" {
				errs <- fmt.Errorf("%d %q %v", resp.StatusCode, b, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := conns.Load(); n < 2 {
		t.Errorf("the backend got %d connections; want more than 1 for 16 concurrent streams at 2 each", n)
	}
}

// TestFramesBackendResetMidAnswer: a backend that breaks off its answer after
// the headers went out: the client sees its stream reset, not a clean end.
func TestFramesBackendResetMidAnswer(t *testing.T) {
	be, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "partial")
		w.(http.Flusher).Flush()
		time.Sleep(20 * time.Millisecond)
		panic(http.ErrAbortHandler)
	})
	s := serveOn(t, Config{Algorithm: "round_robin", Retries: 2}, []Backend{be})
	resp, err := h2cClient().Get("http://" + s.Addr().String() + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil {
		t.Errorf("read %q and a clean end; want the stream reset", b)
	}
}

// TestFramesInFlightSettles: streams the client resets, or that weir resets
// for the client's protocol error, while the backend is still working give
// their backend back: nothing stays counted in flight.
func TestFramesInFlightSettles(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	bs[0].Delay.Store(int64(2 * time.Second))
	s := serve(t, Config{Algorithm: "least_conn"}, bs)
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
	waitfor.Value(t, 2*time.Second, "both requests at the backend", func() (any, bool) {
		n := s.Snapshot().Backends[0].InFlight
		return n, n == 2
	})
	fr.WriteRSTStream(1, http2.ErrCodeCancel)
	// Stream 3's window overflows: weir resets it with FLOW_CONTROL_ERROR.
	fr.WriteWindowUpdate(3, 1<<31-1)
	fr.WriteWindowUpdate(3, 1<<31-1)
	waitfor.Value(t, time.Second, "in flight, service and backend", func() (any, bool) {
		sn := s.Snapshot()
		return [2]int64{sn.InFlight, int64(sn.Backends[0].InFlight)}, sn.InFlight == 0 && sn.Backends[0].InFlight == 0
	})
}

// TestFramesServesTLS: a TLS client that chose h2 by ALPN is served by the
// frame engine, and the backend hears it came over https.
func TestFramesServesTLS(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	cert, err := tls.X509KeyPair(testCert, testKey)
	if err != nil {
		t.Fatal(err)
	}
	s := serve(t, Config{XForwardedProto: true, Forwarded: true, TLS: &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}}, bs)
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	resp, body := get(t, &http.Client{Transport: tr}, "https://"+s.Addr().String()+"/")
	if resp.Proto != "HTTP/2.0" || body != "a" || resp.Header.Get("X-Seen-Forwarded-Proto") != "https" ||
		!strings.Contains(resp.Header.Get("X-Seen-Forwarded"), "proto=https") {
		t.Errorf("got %s %q, backend saw %q and %q; want HTTP/2.0 from a, https", resp.Proto, body,
			resp.Header.Get("X-Seen-Forwarded-Proto"), resp.Header.Get("X-Seen-Forwarded"))
	}
	s.fmu.Lock()
	n := len(s.fsessions)
	s.fmu.Unlock()
	if n != 1 {
		t.Errorf("%d frame engine sessions; want the client's 1", n)
	}
}

// TestFramesRapidReset: a client that opens streams and resets them at once,
// faster than maxResetsPerSecond, gets GOAWAY ENHANCE_YOUR_CALM, and the
// backend does not get a request for every stream it opened.
func TestFramesRapidReset(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	bs[0].Delay.Store(int64(50 * time.Millisecond))
	s := serve(t, Config{Algorithm: "round_robin"}, bs)
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	const streams = 5000
	// Written from a goroutine: weir answers while the client writes.
	go func() {
		for i := range streams {
			id := uint32(2*i + 1)
			if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true}) != nil ||
				fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
				return
			}
		}
	}()
	rfr := http2.NewFramer(nil, conn)
	for {
		f, err := rfr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v; want GOAWAY ENHANCE_YOUR_CALM", err)
		}
		if g, ok := f.(*http2.GoAwayFrame); ok {
			if g.ErrCode != http2.ErrCodeEnhanceYourCalm {
				t.Fatalf("GOAWAY %v; want ENHANCE_YOUR_CALM", g.ErrCode)
			}
			break
		}
	}
	time.Sleep(100 * time.Millisecond) // the backend's requests in flight reach its handler
	if n := bs[0].Hits.Load(); n > 2*maxResetsPerSecond {
		t.Errorf("the backend got %d requests for %d streams reset at once; want at most %d", n, streams, 2*maxResetsPerSecond)
	}
}

// reqBlock is an HPACK block for a request (method, path) on addr.
func reqBlock(method, addr, path string) []byte {
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	for _, f := range [][2]string{{":method", method}, {":scheme", "http"}, {":authority", addr}, {":path", path}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	return buf.Bytes()
}

// TestFramesResetQueuedAnswers: streams the client resets while their answers
// wait in weir for the client's window give the backend connection's window
// back, so the connection's later streams still get their bytes.
func TestFramesResetQueuedAnswers(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	s := serve(t, Config{Algorithm: "round_robin"}, bs)
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	// Exits when conn closes: reads what weir sends, gives no window back.
	go func() {
		rfr := http2.NewFramer(nil, conn)
		for {
			if _, err := rfr.ReadFrame(); err != nil {
				return
			}
		}
	}()
	for i := range 6 {
		id := uint32(2*i + 1)
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: reqBlock("GET", addr, "/?size="+strconv.Itoa(8<<20)), EndHeaders: true, EndStream: true})
		time.Sleep(200 * time.Millisecond)
		fr.WriteRSTStream(id, http2.ErrCodeCancel)
	}
	client := h2cClient()
	client.Timeout = 3 * time.Second
	resp, body := get(t, client, "http://"+addr+"/?size=100000")
	if resp.StatusCode != 200 || len(body) != 100000 {
		t.Fatalf("a request after 6 streams reset mid-answer: %d, %d bytes", resp.StatusCode, len(body))
	}
}

// TestFramesReplayCreditedOnce: a request body sent again to another backend
// (the first answered 503) is credited to the client once, not per try.
func TestFramesReplayCreditedOnce(t *testing.T) {
	be1, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(503)
	})
	be2, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) })
	s := serveOn(t, Config{Algorithm: "round_robin", Retries: 1, RetryBudget: 1}, []Backend{be1, be2})
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	const streams, bodyLen, chunk = 4, 60000, 15000
	for i := range streams {
		id := uint32(2*i + 1)
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: reqBlock("PUT", addr, "/"), EndHeaders: true})
		for off := 0; off < bodyLen; off += chunk {
			fr.WriteData(id, off+chunk >= bodyLen, make([]byte, chunk))
		}
	}
	rfr := http2.NewFramer(nil, conn)
	var credit int64
	first := true
	for ended := 0; ended < streams; {
		f, err := rfr.ReadFrame()
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		switch f := f.(type) {
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 && !first {
				credit += int64(f.Increment)
			}
			first = first && f.StreamID != 0 // the first is weir's initial window
		case *http2.HeadersFrame:
			if f.StreamEnded() {
				ended++
			}
		case *http2.DataFrame:
			if f.StreamEnded() {
				ended++
			}
		case *http2.RSTStreamFrame:
			ended++
		}
	}
	if sent := int64(streams * bodyLen); credit > sent {
		t.Errorf("weir gave back %d bytes of connection window for %d sent", credit, sent)
	}
}

// refusingBackend is an HTTP/2 backend that refuses each stream (RST_STREAM
// REFUSED_STREAM) once 32 KiB of its body came.
func refusingBackend(t *testing.T) Backend {
	addr := rawBackend(t, func(c net.Conn) {
		if _, err := io.ReadFull(c, make([]byte, len(http2.ClientPreface))); err != nil {
			return
		}
		fr := http2.NewFramer(c, c)
		fr.WriteSettings()
		got := map[uint32]int{}
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if !f.IsAck() {
					fr.WriteSettingsAck()
				}
			case *http2.DataFrame:
				if n := len(f.Data()); n > 0 {
					fr.WriteWindowUpdate(0, uint32(n))
				}
				if got[f.StreamID] >= 0 {
					if got[f.StreamID] += len(f.Data()); got[f.StreamID] >= 32<<10 {
						got[f.StreamID] = -1
						fr.WriteRSTStream(f.StreamID, http2.ErrCodeRefusedStream)
					}
				}
			}
		}
	})
	return Backend{Addr: addr, Weight: 1, Usable: true}
}

// TestFramesRefusedAfterBody: a POST whose body was partly sent before the
// backend refused the stream is not sent elsewhere with its start missing:
// whatever answers 200 got the whole body.
func TestFramesRefusedAfterBody(t *testing.T) {
	var got atomic.Int64
	good, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		got.Store(n)
		w.Header().Set("X-Got", strconv.FormatInt(n, 10))
	})
	s := serveOn(t, Config{Algorithm: "round_robin", Retries: 1, RetryBudget: 1}, []Backend{refusingBackend(t), good})
	client := h2cClient()
	const size = 304 << 10
	for i := range 4 {
		pr, pw := io.Pipe()
		// Exits once the body is written or the request has failed.
		go func() {
			buf := make([]byte, 16<<10)
			for n := 0; n < size; n += len(buf) {
				if _, err := pw.Write(buf); err != nil {
					return
				}
				time.Sleep(time.Millisecond)
			}
			pw.Close()
		}()
		req, _ := http.NewRequest("POST", "http://"+s.Addr().String()+"/", pr)
		req.ContentLength = -1
		resp, err := client.Do(req)
		pr.CloseWithError(io.ErrClosedPipe)
		if err != nil {
			continue // refused, and not retried: right
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if g := resp.Header.Get("X-Got"); resp.StatusCode == 200 && g != strconv.Itoa(size) {
			t.Errorf("request %d: answered 200, but the backend got %s of %d body bytes", i, g, size)
		}
	}
}

// TestFramesBackendConnIdle: a backend connection that carried no stream for
// upIdleTimeout is closed, and the next request opens another.
func TestFramesBackendConnIdle(t *testing.T) {
	// Restored after the service has stopped (cleanups run last-first).
	t.Cleanup(func(d time.Duration) func() { return func() { upIdleTimeout = d } }(upIdleTimeout))
	// Wide margins both ways: on a loaded machine a request 100 ms after
	// another can start several hundred ms later.
	upIdleTimeout = 1500 * time.Millisecond
	be, conns := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	s := serveOn(t, Config{Algorithm: "round_robin"}, []Backend{be})
	client := h2cClient()
	url := "http://" + s.Addr().String() + "/"
	get(t, client, url)
	// Kept while requests keep coming within the timeout.
	for range 4 {
		time.Sleep(100 * time.Millisecond)
		get(t, client, url)
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d backend connections for requests 100 ms apart; want 1", n)
	}
	time.Sleep(3 * upIdleTimeout)
	get(t, client, url)
	if n := conns.Load(); n != 2 {
		t.Errorf("%d backend connections after an idle spell past the timeout; want a second one", n)
	}
}

// TestFramesBackendBadSettings: a backend that sends a setting out of range
// (a frame size of 0 or past 2^24-1, a window past 2^31-1), pushes the
// connection's window past 2^31-1 or sends PUSH_PROMISE (push is off) has its
// connection ended with GOAWAY and the error's code, and the requests on it
// fail with 502 at once. Before, weir took
// such settings as they came and went on; a frame size of 0 reaching
// writeHeaders, which splits a header block into frames of at most the peer's
// frame size, would write empty frames without end.
func TestFramesBackendBadSettings(t *testing.T) {
	for _, c := range []struct {
		name  string
		first func(fr *http2.Framer)
		code  http2.ErrCode
	}{
		{"frame size 0", func(fr *http2.Framer) { fr.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: 0}) }, http2.ErrCodeProtocol},
		{"frame size 2^24", func(fr *http2.Framer) { fr.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1 << 24}) }, http2.ErrCodeProtocol},
		{"window 2^31", func(fr *http2.Framer) {
			fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 31})
		}, http2.ErrCodeFlowControl},
		// Twice: past the limit however much of the window a body has used.
		{"connection window past 2^31-1", func(fr *http2.Framer) {
			fr.WriteSettings()
			fr.WriteWindowUpdate(0, 1<<31-1)
			fr.WriteWindowUpdate(0, 1<<31-1)
		}, http2.ErrCodeFlowControl},
		// RFC 9113 5.1: frames on a stream never opened.
		{"DATA on a stream never opened", func(fr *http2.Framer) {
			fr.WriteSettings()
			fr.WriteData(99, false, []byte("x"))
		}, http2.ErrCodeProtocol},
		{"DATA on an even stream", func(fr *http2.Framer) {
			fr.WriteSettings()
			fr.WriteData(2, false, []byte("x"))
		}, http2.ErrCodeProtocol},
		{"HEADERS on a stream never opened", func(fr *http2.Framer) {
			fr.WriteSettings()
			var hb bytes.Buffer
			hpack.NewEncoder(&hb).WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 99, BlockFragment: hb.Bytes(), EndHeaders: true})
		}, http2.ErrCodeProtocol},
		{"RST_STREAM on a stream never opened", func(fr *http2.Framer) {
			fr.WriteSettings()
			fr.WriteRSTStream(99, http2.ErrCodeCancel)
		}, http2.ErrCodeProtocol},
		{"WINDOW_UPDATE on a stream never opened", func(fr *http2.Framer) {
			fr.WriteSettings()
			fr.WriteWindowUpdate(99, 10)
		}, http2.ErrCodeProtocol},
		// A WINDOW_UPDATE of 0 is a stream error where the stream is open,
		// but on one never opened the stream's state rules first.
		{"WINDOW_UPDATE of 0 on a stream never opened", func(fr *http2.Framer) {
			fr.AllowIllegalWrites = true
			fr.WriteSettings()
			fr.WriteWindowUpdate(99, 0)
		}, http2.ErrCodeProtocol},
		{"WINDOW_UPDATE of 0 on an even stream", func(fr *http2.Framer) {
			fr.AllowIllegalWrites = true
			fr.WriteSettings()
			fr.WriteWindowUpdate(2, 0)
		}, http2.ErrCodeProtocol},
		{"PUSH_PROMISE with push off", func(fr *http2.Framer) {
			fr.WriteSettings()
			var hb bytes.Buffer
			hpack.NewEncoder(&hb).WriteField(hpack.HeaderField{Name: ":method", Value: "GET"})
			fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, BlockFragment: hb.Bytes(), EndHeaders: true})
		}, http2.ErrCodeProtocol},
	} {
		t.Run(c.name, func(t *testing.T) {
			goaway := make(chan http2.ErrCode, 16)
			be := rawBackend(t, func(conn net.Conn) { badSettingsBackend(conn, c.first, goaway) })
			s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			client := h2cClient()
			client.Timeout = 5 * time.Second
			url := "http://" + s.Addr().String() + "/"
			for i := range 3 {
				var resp *http.Response
				var err error
				if i == 2 {
					resp, err = client.Post(url, "text/plain", bytes.NewReader(make([]byte, 100000)))
				} else {
					resp, err = client.Get(url)
				}
				if err != nil {
					t.Fatalf("request %d: %v; want 502", i, err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusBadGateway {
					t.Errorf("request %d: %s; want 502", i, resp.Status)
				}
			}
			select {
			case code := <-goaway:
				if code != c.code {
					t.Errorf("GOAWAY %v; want %v", code, c.code)
				}
			case <-time.After(5 * time.Second):
				t.Errorf("no GOAWAY; want %v", c.code)
			}
		})
	}
}

// badSettingsBackend speaks HTTP/2 on conn: first sends what first writes, then
// answers every request 200 "ok", and reports a GOAWAY's code.
func badSettingsBackend(conn net.Conn, first func(*http2.Framer), goaway chan<- http2.ErrCode) {
	h2StatusBackend(conn, first, "200", false, goaway)
}

// h2StatusBackend speaks HTTP/2 on conn: first sends what first writes, then
// answers every request's HEADERS with HEADERS of status, ending the stream
// there if endStream, else with a DATA "ok" after a 200 (and nothing after
// another status); it reports a GOAWAY's code on goaway, if not nil.
func h2StatusBackend(conn net.Conn, first func(*http2.Framer), status string, endStream bool, goaway chan<- http2.ErrCode) {
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(conn, preface); err != nil {
		return
	}
	fr := http2.NewFramer(conn, conn)
	first(fr)
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			if goaway != nil {
				goaway <- f.ErrCode
			}
			return
		case *http2.HeadersFrame:
			hb.Reset()
			enc.WriteField(hpack.HeaderField{Name: ":status", Value: status})
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: hb.Bytes(), EndHeaders: true, EndStream: endStream})
			if !endStream && status == "200" {
				fr.WriteData(f.StreamID, true, []byte("ok"))
			}
		}
	}
}

// TestFramesGoAwayLingers: at shutdown an HTTP/2 client gets GOAWAY, its
// stream in flight its answer, a stream it opened late (before it had read the
// GOAWAY) REFUSED_STREAM, then weir's FIN; and frames the client still sends
// after that are read and dropped, not answered with a reset, which would fail
// a client's write and with it (Go's client) every request it had in flight on
// the connection. The session ends when the client closes.
func TestFramesGoAwayLingers(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	bs[0].Delay.Store(int64(100 * time.Millisecond))
	sv := serveStoppable(t, Config{}, backendSet(bs))
	addr := sv.Addr().String()
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
	waitfor.Value(t, 5*time.Second, "the request in flight", func() (any, bool) {
		n := sv.Snapshot().InFlight
		return n, n == 1
	})
	sv.stop()
	lateSent, refused, answered := false, false, false
	for {
		f, err := fr.ReadFrame()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("read: %v; want the answer, then EOF", err)
		}
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			if f.LastStreamID != 1 || f.ErrCode != http2.ErrCodeNo {
				t.Errorf("GOAWAY last stream %d %v; want 1 NO_ERROR", f.LastStreamID, f.ErrCode)
			}
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true})
			lateSent = true
		case *http2.RSTStreamFrame:
			refused = f.StreamID == 3 && f.ErrCode == http2.ErrCodeRefusedStream
		case *http2.DataFrame:
			answered = answered || f.StreamID == 1 && f.StreamEnded()
		case *http2.HeadersFrame:
			answered = answered || f.StreamID == 1 && f.StreamEnded()
		}
	}
	if !lateSent || !refused || !answered {
		t.Fatalf("GOAWAY seen %v, stream 3 refused %v, stream 1 answered %v; want all", lateSent, refused, answered)
	}
	// Past weir's FIN: a client that has not seen it yet still writes. With
	// the socket closed under them the first write would draw a reset and a
	// later one fail.
	for i := range 20 {
		if err := fr.WritePing(false, [8]byte{byte(i)}); err != nil {
			t.Fatalf("write %d after weir's FIN: %v; want the frames read and dropped", i, err)
		}
		time.Sleep(5 * time.Millisecond) // each write its own segment, and time for a reset to come back
	}
	conn.Close()
	select {
	case <-sv.done:
	case <-time.After(5 * time.Second):
		t.Fatal("Serve still running 5 s after the client closed")
	}
}

// TestFramesBackendMalformedStatus: an HTTP/2 backend's answer that is
// malformed by its status (RFC 9113 8.1, 8.6) gets the client a 502 at once:
// an interim status on a HEADERS frame that ends the stream (which had left
// the client waiting for a final answer until its timeout) and 101, which
// HTTP/2 does not have.
func TestFramesBackendMalformedStatus(t *testing.T) {
	for _, c := range []struct {
		name   string
		status string
		end    bool
	}{
		{"103 ending the stream", "103", true},
		{"101", "101", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			be := rawBackend(t, func(conn net.Conn) {
				h2StatusBackend(conn, func(fr *http2.Framer) { fr.WriteSettings() }, c.status, c.end, nil)
			})
			s := serveOn(t, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			h2cGetBadGateway(t, s)
		})
	}
}

// h2cGetBadGateway sends a GET over HTTP/2 cleartext to s and checks that the
// answer is a 502.
func h2cGetBadGateway(t *testing.T, s *Service) {
	t.Helper()
	client := h2cClient()
	client.Timeout = 5 * time.Second
	resp, err := client.Get("http://" + s.Addr().String() + "/")
	if err != nil {
		t.Fatalf("GET: %v; want a 502", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("got %s; want 502", resp.Status)
	}
}
