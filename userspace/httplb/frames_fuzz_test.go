package httplb

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
)

// FuzzClientFrames sends arbitrary bytes after the HTTP/2 preface to the
// frame engine, over a real socket, with a real backend behind it. Whatever
// comes, the engine must not panic (enginePanics stays 0), and once the client
// has closed its connection nothing of it may be left: no session, no request
// in flight, no backend lease held (a lease left behind would count against
// its backend under least_request for good). A well-formed request on a new
// connection must then still be answered. The seeds are well-formed
// exchanges; the fuzzer's mutations make them malformed in every way the
// framer lets through.
//
//	go test -run '^$' -fuzz FuzzClientFrames -fuzztime 2m ./userspace/httplb/
func FuzzClientFrames(f *testing.F) {
	seed := func(build func(fr *http2.Framer, block func(method, path string, extra ...string) []byte)) []byte {
		return frameSeed(func(fr *http2.Framer, fields func(...string) []byte) {
			build(fr, func(method, path string, extra ...string) []byte {
				return fields(append([]string{":method", method, ":scheme", "http", ":authority", "x", ":path", path}, extra...)...)
			})
		})
	}
	f.Add(seed(func(fr *http2.Framer, b func(string, string, ...string) []byte) {
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b("GET", "/?size=1000"), EndHeaders: true, EndStream: true})
	}))
	f.Add(seed(func(fr *http2.Framer, b func(string, string, ...string) []byte) {
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b("POST", "/", "content-type", "application/grpc", "te", "trailers"), EndHeaders: true})
		fr.WriteData(1, false, []byte("body"))
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: trailerBlock(), EndHeaders: true, EndStream: true})
	}))
	f.Add(seed(func(fr *http2.Framer, b func(string, string, ...string) []byte) {
		blk := b("PUT", "/", "x-long", string(bytes.Repeat([]byte("v"), 100)))
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: blk[:10], EndHeaders: false})
		fr.WriteContinuation(3, true, blk[10:])
		fr.WriteData(3, false, make([]byte, 300))
		fr.WriteRSTStream(3, http2.ErrCodeCancel)
		fr.WriteData(3, true, []byte("late"))
	}))
	f.Add(seed(func(fr *http2.Framer, b func(string, string, ...string) []byte) {
		fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 10}, http2.Setting{ID: http2.SettingMaxFrameSize, Val: 16384})
		fr.WritePing(false, [8]byte{1})
		fr.WritePriority(1, http2.PriorityParam{StreamDep: 0, Weight: 10})
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b("GET", "/?size=100000"), EndHeaders: true, EndStream: true})
		fr.WriteWindowUpdate(1, 100)
		fr.WriteWindowUpdate(0, 100)
		fr.WriteGoAway(1, http2.ErrCodeNo, nil)
	}))
	bs := httpbackend.StartN(f, 1)
	cfg := Config{Name: "fuzz", Listen: netip.MustParseAddrPort("127.0.0.1:0"), Algorithm: "round_robin", Retries: 1, RetryBudget: 1}
	s, err := Listen(cfg, backendSet(bs))
	if err != nil {
		f.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	// Exits when cancel is called at cleanup.
	go func() { done <- s.Serve(ctx) }()
	f.Cleanup(func() { cancel(); <-done })
	addr := s.Addr().String()
	client := h2cClient()
	client.Timeout = 5 * time.Second
	url := "http://" + addr + "/"
	f.Fuzz(func(t *testing.T, data []byte) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.Write([]byte(http2.ClientPreface))
		fr := http2.NewFramer(conn, conn)
		fr.WriteSettings()
		conn.Write(data)
		fr.WritePing(false, fuzzFence)
		readAnswers(conn, fr, s, 20*time.Millisecond)
		conn.Close()
		if n := enginePanics.Load(); n != 0 {
			t.Fatalf("the frame engine panicked (%d connections)", n)
		}
		waitfor.Value(t, 5*time.Second, "no session, request or lease left of the closed connection", func() (any, bool) {
			sn := s.Snapshot()
			leases := int64(0)
			for _, b := range sn.Backends {
				leases += int64(b.InFlight)
			}
			return [3]int64{sn.Connections, sn.InFlight, leases}, sn.Connections == 0 && sn.InFlight == 0 && leases == 0
		})
		resp, err := client.Get(url)
		if err != nil {
			t.Fatalf("a well-formed request after the input: %v", err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("a well-formed request after the input: %s", resp.Status)
		}
		client.CloseIdleConnections()
	})
}

// fuzzFence is the payload of the PING FuzzClientFrames sends behind its
// input: the engine answers a PING in order, so its ACK says every frame
// before it has been taken.
var fuzzFence = [8]byte{0xfe, 'w', 'e', 'i', 'r', 'f', 'z', 0xff}

// readAnswers reads what the engine sends on conn until it closes, or it has
// taken the whole input (the fence's ACK) and has no request left in flight
// (every answer sent), or limit is up: most inputs are done in well under the
// limit, which is what bounds an execution otherwise. An input that leaves
// the fence unparsed (a frame it began and did not finish) waits out the limit.
func readAnswers(conn net.Conn, fr *http2.Framer, s *Service, limit time.Duration) {
	end := time.Now().Add(limit)
	fr.SetMaxReadFrameSize(1 << 24) // the input's SETTINGS may let the engine send large frames
	fenced := false
	for time.Now().Before(end) {
		if fenced && s.Snapshot().InFlight == 0 {
			return
		}
		step := end
		if fenced {
			step = time.Now().Add(time.Millisecond) // look at the requests in flight again soon
		}
		conn.SetReadDeadline(step)
		f, err := fr.ReadFrame()
		switch {
		case err == nil:
			if p, ok := f.(*http2.PingFrame); ok && p.IsAck() && p.Data == fuzzFence {
				fenced = true
			}
		case os.IsTimeout(err) && fenced:
		default: // closed, or frames the framer refuses: read the rest as bytes
			conn.SetReadDeadline(end)
			io.Copy(io.Discard, conn)
			return
		}
	}
}

func trailerBlock() []byte {
	var b bytes.Buffer
	hpack.NewEncoder(&b).WriteField(hpack.HeaderField{Name: "x-trailer", Value: "1"})
	return b.Bytes()
}

// FuzzBackendFrames has a backend answer the frame engine's upstream HTTP/2
// connection with arbitrary bytes after its SETTINGS, then end its side of the
// connection: whatever it sends, the engine must not panic or spin, the
// client's request must end (answered or failed) within the client's timeout,
// and nothing may stay in flight. The first byte of the input picks the
// request (odd: a POST with a body, which the upstream windows and frame size
// pace); the seeds are answers to stream 1, the first on a new connection.
//
//	go test -run '^$' -fuzz FuzzBackendFrames -fuzztime 2m ./userspace/httplb/
func FuzzBackendFrames(f *testing.F) {
	seed := func(post bool, build func(fr *http2.Framer, block func(fields ...string) []byte)) []byte {
		first := byte(0)
		if post {
			first = 1
		}
		return append([]byte{first}, frameSeed(build)...)
	}
	ok := func(fr *http2.Framer, b func(...string) []byte) {
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b(":status", "200", "x-a", "1"), EndHeaders: true})
		fr.WriteData(1, true, []byte("ok"))
	}
	f.Add(seed(false, ok))
	f.Add(seed(true, func(fr *http2.Framer, b func(...string) []byte) {
		fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 10}, http2.Setting{ID: http2.SettingMaxFrameSize, Val: 16384})
		fr.WriteWindowUpdate(1, 100)
		fr.WriteWindowUpdate(0, 100)
		ok(fr, b)
	}))
	f.Add(seed(false, func(fr *http2.Framer, b func(...string) []byte) {
		blk := b(":status", "200", "x-long", string(bytes.Repeat([]byte("v"), 100)))
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: blk[:10]})
		fr.WriteContinuation(1, true, blk[10:])
		fr.WriteData(1, false, []byte("part"))
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: trailerBlock(), EndHeaders: true, EndStream: true})
	}))
	f.Add(seed(false, func(fr *http2.Framer, b func(...string) []byte) {
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b(":status", "103", "link", "</a>"), EndHeaders: true})
		fr.WritePing(false, [8]byte{1})
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b(":status", "204"), EndHeaders: true, EndStream: true})
	}))
	f.Add(seed(true, func(fr *http2.Framer, b func(...string) []byte) {
		fr.WriteRSTStream(1, http2.ErrCodeRefusedStream)
		fr.WriteGoAway(0, http2.ErrCodeNo, nil)
	}))
	f.Add(seed(true, func(fr *http2.Framer, b func(...string) []byte) {
		fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 1}, http2.Setting{ID: http2.SettingHeaderTableSize, Val: 0})
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b(":status", "200"), EndHeaders: true, Priority: http2.PriorityParam{Weight: 1}})
		fr.WriteData(1, false, make([]byte, 1000))
		fr.WriteRSTStream(1, http2.ErrCodeCancel)
	}))

	// Frames on a stream after its end: after END_STREAM both ways, after the
	// backend's reset.
	f.Add(seed(false, func(fr *http2.Framer, b func(...string) []byte) {
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b(":status", "204"), EndHeaders: true, EndStream: true})
		fr.WriteData(1, true, []byte("late"))
	}))
	f.Add(seed(true, func(fr *http2.Framer, b func(...string) []byte) {
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b(":status", "200"), EndHeaders: true})
		fr.WriteRSTStream(1, http2.ErrCodeCancel)
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b(":status", "200"), EndHeaders: true, EndStream: true})
		fr.WriteData(1, true, []byte("late"))
	}))

	var answer atomic.Pointer[[]byte]
	var open atomic.Int64 // the backend's connections weir has not closed yet
	addr := rawBackend(f, func(c net.Conn) {
		open.Add(1)
		defer open.Add(-1)
		preface := make([]byte, len(http2.ClientPreface))
		if _, err := io.ReadFull(c, preface); err != nil {
			return
		}
		http2.NewFramer(c, nil).WriteSettings()
		c.Write(*answer.Load())
		c.(*net.TCPConn).CloseWrite()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		io.Copy(io.Discard, c) // until weir closes its side
	})
	be := Backend{Addr: addr, Weight: 1, Usable: true}
	s := serveOn(f, Config{}, []Backend{be})
	client := h2cClient()
	client.Timeout = 5 * time.Second
	url := "http://" + s.Addr().String() + "/"
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		frames := in[1:]
		answer.Store(&frames)
		var resp *http.Response
		var err error
		if in[0]&1 == 1 {
			resp, err = client.Post(url, "text/plain", bytes.NewReader(make([]byte, 40000)))
		} else {
			resp, err = client.Get(url)
		}
		if err == nil {
			var n int64
			n, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			t.Logf("%s, %d bytes, %v", resp.Status, n, err)
		} else {
			t.Logf("%v", err)
		}
		if errors.Is(err, context.DeadlineExceeded) || os.IsTimeout(err) {
			t.Fatalf("no answer within the client's timeout (%v): the backend sent %q", err, frames)
		}
		waitfor.Value(t, 5*time.Second, "nothing in flight, the backend's connection closed", func() (any, bool) {
			sn := s.Snapshot()
			return [2]int64{sn.InFlight, open.Load()}, sn.InFlight == 0 && open.Load() == 0
		})
		if n := enginePanics.Load(); n != 0 {
			t.Fatalf("the frame engine panicked (%d connections)", n)
		}
	})
}

// frameSeed is the frames build writes, with block giving the HPACK block of
// name, value, ... from one encoder (its dynamic table shared, as on a
// connection).
func frameSeed(build func(fr *http2.Framer, block func(fields ...string) []byte)) []byte {
	var wire, hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	block := func(fields ...string) []byte {
		hb.Reset()
		for i := 0; i+1 < len(fields); i += 2 {
			enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
		}
		return bytes.Clone(hb.Bytes())
	}
	fr := http2.NewFramer(&wire, nil)
	fr.AllowIllegalWrites = true
	build(fr, block)
	return wire.Bytes()
}
