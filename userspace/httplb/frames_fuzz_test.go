package httplb

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/weir-lb/weir/internal/httpbackend"
)

// FuzzClientFrames sends arbitrary bytes after the HTTP/2 preface to the
// frame engine, over a real socket, with a real backend behind it: whatever
// comes, the engine must not panic (enginePanics stays 0). The seeds are
// well-formed exchanges; the fuzzer's mutations make them malformed in every
// way the framer lets through.
//
//	go test -run '^$' -fuzz FuzzClientFrames -fuzztime 2m ./userspace/httplb/
func FuzzClientFrames(f *testing.F) {
	seed := func(build func(fr *http2.Framer, block func(method, path string, extra ...string) []byte)) []byte {
		var wire, hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		block := func(method, path string, extra ...string) []byte {
			hb.Reset()
			fields := append([]string{":method", method, ":scheme", "http", ":authority", "x", ":path", path}, extra...)
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
	f.Fuzz(func(t *testing.T, data []byte) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.Write([]byte(http2.ClientPreface))
		http2.NewFramer(conn, nil).WriteSettings()
		conn.Write(data)
		// What weir answers, until it closes or it has had its time.
		conn.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
		io.Copy(io.Discard, conn)
		if n := enginePanics.Load(); n != 0 {
			t.Fatalf("the frame engine panicked (%d connections)", n)
		}
	})
}

func trailerBlock() []byte {
	var b bytes.Buffer
	hpack.NewEncoder(&b).WriteField(hpack.HeaderField{Name: "x-trailer", Value: "1"})
	return b.Bytes()
}
