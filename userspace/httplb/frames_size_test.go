package httplb

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/weir-lb/weir/internal/httpbackend"
)

// misshapenFrames are frames whose length their type or flags rule out, with
// what RFC 9113 asks of the peer that gets one: a connection error (GOAWAY and
// its code) or, for PRIORITY, a stream error (RST_STREAM FRAME_SIZE_ERROR) that
// leaves the connection serving. onStream: the frame goes on the request's
// stream, else on stream 0.
var misshapenFrames = []struct {
	name     string
	typ      http2.FrameType
	flags    http2.Flags
	onStream bool
	payload  []byte
	want     string
}{
	// RFC 9113 6.1: padding as long as the payload or longer.
	{"DATA padded past its end", http2.FrameData, http2.FlagDataPadded, true, []byte{5}, "GOAWAY PROTOCOL_ERROR"},
	{"DATA padding as long as its payload", http2.FrameData, http2.FlagDataPadded, true, []byte{4, 'a', 'b', 'c'}, "GOAWAY PROTOCOL_ERROR"},
	// RFC 9113 4.2: too short for its Pad Length field.
	{"DATA padded with no pad length", http2.FrameData, http2.FlagDataPadded, true, nil, "GOAWAY FRAME_SIZE_ERROR"},
	// A HEADERS frame weir cannot take apart, even on an open stream: its
	// block cannot be decoded, so HPACK's state is lost for every later
	// block on the connection. Padding as long as the payload or longer
	// (RFC 9113 6.2); too short for its pad length or priority (RFC 9113
	// 4.2).
	{"HEADERS padded past their end", http2.FrameHeaders, http2.FlagHeadersPadded | http2.FlagHeadersEndHeaders, true, []byte{5}, "GOAWAY PROTOCOL_ERROR"},
	{"HEADERS with priority padded past their end", http2.FrameHeaders, http2.FlagHeadersPadded | http2.FlagHeadersPriority | http2.FlagHeadersEndHeaders, true, []byte{1, 0, 0, 0, 0, 16}, "GOAWAY PROTOCOL_ERROR"},
	{"HEADERS padded with no pad length", http2.FrameHeaders, http2.FlagHeadersPadded | http2.FlagHeadersEndHeaders, true, nil, "GOAWAY FRAME_SIZE_ERROR"},
	{"HEADERS with priority cut short", http2.FrameHeaders, http2.FlagHeadersPriority | http2.FlagHeadersEndHeaders, true, []byte{0, 0, 0}, "GOAWAY FRAME_SIZE_ERROR"},
	{"HEADERS with priority cut short by its pad length", http2.FrameHeaders, http2.FlagHeadersPadded | http2.FlagHeadersPriority | http2.FlagHeadersEndHeaders, true, []byte{0, 0, 0, 0, 0}, "GOAWAY FRAME_SIZE_ERROR"},
	// RFC 9113 6.3.
	{"PRIORITY of 4 bytes", http2.FramePriority, 0, true, []byte{0, 0, 0, 0}, "RST_STREAM FRAME_SIZE_ERROR"},
	{"PRIORITY of 6 bytes", http2.FramePriority, 0, true, []byte{0, 0, 0, 0, 16, 0}, "RST_STREAM FRAME_SIZE_ERROR"},
	// RFC 9113 6.4, 6.5, 6.7, 6.8, 6.9.
	{"RST_STREAM of 3 bytes", http2.FrameRSTStream, 0, true, []byte{0, 0, 8}, "GOAWAY FRAME_SIZE_ERROR"},
	{"SETTINGS of 5 bytes", http2.FrameSettings, 0, false, []byte{0, 4, 0, 0, 1}, "GOAWAY FRAME_SIZE_ERROR"},
	{"SETTINGS ACK with a setting", http2.FrameSettings, http2.FlagSettingsAck, false, []byte{0, 4, 0, 0, 0, 1}, "GOAWAY FRAME_SIZE_ERROR"},
	{"PING of 7 bytes", http2.FramePing, 0, false, []byte{1, 2, 3, 4, 5, 6, 7}, "GOAWAY FRAME_SIZE_ERROR"},
	{"GOAWAY of 7 bytes", http2.FrameGoAway, 0, false, []byte{0, 0, 0, 0, 0, 0, 0}, "GOAWAY FRAME_SIZE_ERROR"},
	{"WINDOW_UPDATE of 3 bytes", http2.FrameWindowUpdate, 0, false, []byte{0, 0, 1}, "GOAWAY FRAME_SIZE_ERROR"},
	{"stream WINDOW_UPDATE of 5 bytes", http2.FrameWindowUpdate, 0, true, []byte{0, 0, 0, 1, 0}, "GOAWAY FRAME_SIZE_ERROR"},
	// A client may not push, and weir turns a backend's push off: either
	// way a connection error, whose code a promise too short to hold its
	// fields makes FRAME_SIZE_ERROR.
	{"PUSH_PROMISE padded with no pad length", http2.FramePushPromise, http2.FlagPushPromisePadded | http2.FlagPushPromiseEndHeaders, true, nil, "GOAWAY FRAME_SIZE_ERROR"},
	{"PUSH_PROMISE cut short of its promised stream", http2.FramePushPromise, http2.FlagPushPromiseEndHeaders, true, []byte{0, 0, 2}, "GOAWAY FRAME_SIZE_ERROR"},
	{"PUSH_PROMISE padded past its end", http2.FramePushPromise, http2.FlagPushPromisePadded | http2.FlagPushPromiseEndHeaders, true, []byte{9, 0, 0, 0, 2}, "GOAWAY PROTOCOL_ERROR"},
}

// writeRawFrame writes a frame as given, whatever its length.
func writeRawFrame(w io.Writer, typ http2.FrameType, flags http2.Flags, id uint32, payload []byte) error {
	n := len(payload)
	_, err := w.Write(append([]byte{byte(n >> 16), byte(n >> 8), byte(n), byte(typ), byte(flags),
		byte(id >> 24), byte(id >> 16), byte(id >> 8), byte(id)}, payload...))
	return err
}

// rawH2Backend is a backend that takes weir's HTTP/2 preface, sends its
// SETTINGS and leaves the connection to serve, for 15 s at the most.
func rawH2Backend(t *testing.T, serve func(conn net.Conn, fr *http2.Framer)) netip.AddrPort {
	t.Helper()
	return rawBackend(t, func(conn net.Conn) {
		conn.SetDeadline(time.Now().Add(15 * time.Second))
		if _, err := io.ReadFull(conn, make([]byte, len(http2.ClientPreface))); err != nil {
			return
		}
		fr := http2.NewFramer(conn, conn)
		fr.WriteSettings()
		serve(conn, fr)
	})
}

// statusBlock is a header block of a status alone.
func statusBlock(code string) []byte {
	var b bytes.Buffer
	hpack.NewEncoder(&b).WriteField(hpack.HeaderField{Name: ":status", Value: code})
	return b.Bytes()
}

// frameAnswer reads fr until weir's answer to a frame on stream id followed by
// a PING: "GOAWAY <code>", "RST_STREAM <code>" (a reset of stream id other
// than NO_ERROR, which ends a stream answered whole), "PING answered" (weir
// went on as if the frame were sound), or the read's error.
func frameAnswer(fr *http2.Framer, id uint32) string {
	return frameAnswerServing(fr, id, nil)
}

// frameAnswerServing is frameAnswer for a backend, which answers the requests
// (HEADERS) that come in the meantime with serve, if set.
func frameAnswerServing(fr *http2.Framer, id uint32, serve func(id uint32)) string {
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return "read: " + err.Error()
		}
		switch f := f.(type) {
		case *http2.HeadersFrame:
			if serve != nil {
				serve(f.StreamID)
			}
		case *http2.GoAwayFrame:
			return "GOAWAY " + f.ErrCode.String()
		case *http2.RSTStreamFrame:
			if f.StreamID == id && f.ErrCode != http2.ErrCodeNo {
				return "RST_STREAM " + f.ErrCode.String()
			}
		case *http2.PingFrame:
			if f.IsAck() {
				return "PING answered"
			}
		}
	}
}

// TestMisshapenFramesFromClient: a client's frame of a length its type or
// flags rule out is answered as RFC 9113 asks, never by a connection closed
// without a GOAWAY nor by a frame taken as sound.
func TestMisshapenFramesFromClient(t *testing.T) {
	// The backend reads the whole body before it answers: the request's
	// stream stays open until the client ends it.
	be, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
	})
	s := serveOn(t, Config{}, []Backend{be})
	addr := s.Addr().String()
	for _, c := range misshapenFrames {
		t.Run(c.name, func(t *testing.T) {
			conn, fr := h2Conn(t, addr)
			t.Cleanup(func() { conn.Close() })
			if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true}); err != nil {
				t.Fatal(err)
			}
			id := uint32(0)
			if c.onStream {
				id = 1
			}
			if err := writeRawFrame(conn, c.typ, c.flags, id, c.payload); err != nil {
				t.Fatal(err)
			}
			if err := fr.WritePing(false, [8]byte{'s', 'i', 'z', 'e'}); err != nil {
				t.Fatal(err)
			}
			if got := frameAnswer(fr, 1); got != c.want {
				t.Fatalf("after the frame: %s; want %s", got, c.want)
			}
			if c.want == "RST_STREAM FRAME_SIZE_ERROR" {
				// A stream error: the connection serves on.
				if got := frameAnswer(fr, 1); got != "PING answered" {
					t.Errorf("after the reset: %s; want PING answered", got)
				}
			}
		})
	}
}

// TestMisshapenFramesFromBackend: a backend's frame of a length its type or
// flags rule out is answered as RFC 9113 asks. A connection error ends the
// backend's connection with a GOAWAY, and its requests fail as on a backend
// that died: these, idempotent and unanswered, are tried again on the other
// backend; a stream error fails only its own request, tried again likewise.
func TestMisshapenFramesFromBackend(t *testing.T) {
	for _, c := range misshapenFrames {
		t.Run(c.name, func(t *testing.T) {
			got := make(chan string, 1)
			bad := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
				// Two requests on this connection, or one if the second
				// is slow to come.
				var ids []uint32
				wait := time.Now().Add(10 * time.Second)
				for len(ids) < 2 {
					if len(ids) == 1 {
						wait = time.Now().Add(3 * time.Second)
					}
					conn.SetReadDeadline(wait)
					f, err := fr.ReadFrame()
					if ne, ok := err.(net.Error); ok && ne.Timeout() && len(ids) > 0 {
						break
					}
					if err != nil {
						return
					}
					if h, ok := f.(*http2.HeadersFrame); ok {
						ids = append(ids, h.StreamID)
					}
				}
				conn.SetReadDeadline(time.Now().Add(15 * time.Second))
				id := uint32(0)
				if c.onStream {
					id = ids[0]
				}
				writeRawFrame(conn, c.typ, c.flags, id, c.payload)
				fr.WritePing(false, [8]byte{'s', 'i', 'z', 'e'})
				// The other requests are answered, should the connection
				// still be up, and so are those that come later.
				ok := func(id uint32) {
					fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: statusBlock("200"), EndHeaders: true})
					fr.WriteData(id, true, []byte("ok"))
				}
				got <- frameAnswerServing(fr, ids[0], ok)
				for _, id := range ids[1:] {
					ok(id)
				}
				for !strings.HasPrefix(frameAnswerServing(fr, 0, ok), "read: ") {
				}
			})
			good := httpbackend.StartN(t, 1)[0]
			s := serveOn(t, Config{Algorithm: "round_robin", Retries: 1},
				[]Backend{{Addr: bad, Weight: 1, Usable: true}, {Addr: good.Addr, Weight: 1, Usable: true}})
			client := h2cClient()
			url := "http://" + s.Addr().String() + "/"
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			t.Cleanup(cancel)
			var wg sync.WaitGroup
			for i := range 4 {
				wg.Add(1)
				// Exits when the request is answered or ctx ends.
				go func() {
					defer wg.Done()
					req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
					resp, err := client.Do(req)
					if err != nil {
						t.Errorf("request %d: %v; want 200", i, err)
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						t.Errorf("request %d: %s; want 200", i, resp.Status)
					}
				}()
			}
			select {
			case g := <-got:
				if g != c.want {
					t.Errorf("after the frame: %s; want %s", g, c.want)
				}
			case <-ctx.Done():
				t.Errorf("the backend saw no answer to its frame; want %s", c.want)
			}
			wg.Wait()
		})
	}
}

// TestMisshapenPriorityNotOpen: a PRIORITY frame not 5 bytes long on a stream
// that has closed is still a stream error, answered with a reset; on a stream
// never opened, where no RST_STREAM may go, it is dropped as a sound one is.
func TestMisshapenPriorityNotOpen(t *testing.T) {
	s := serve(t, Config{}, httpbackend.StartN(t, 1))
	addr := s.Addr().String()
	conn, fr := h2Conn(t, addr)
	t.Cleanup(func() { conn.Close() })
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(addr), EndHeaders: true, EndStream: true}); err != nil {
		t.Fatal(err)
	}
	for ended := false; !ended; {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read the answer: %v", err)
		}
		switch f := f.(type) {
		case *http2.DataFrame:
			ended = f.StreamID == 1 && f.StreamEnded()
		case *http2.HeadersFrame:
			ended = f.StreamID == 1 && f.StreamEnded()
		}
	}
	short := []byte{0, 0, 0, 0}
	writeRawFrame(conn, http2.FramePriority, 0, 1, short)
	fr.WritePing(false, [8]byte{'c', 'l', 'o', 's', 'e', 'd'})
	if got := frameAnswer(fr, 1); got != "RST_STREAM FRAME_SIZE_ERROR" {
		t.Errorf("on a closed stream: %s; want RST_STREAM FRAME_SIZE_ERROR", got)
	}
	if got := frameAnswer(fr, 1); got != "PING answered" {
		t.Fatalf("after the reset: %s; want PING answered", got)
	}
	writeRawFrame(conn, http2.FramePriority, 0, 5, short)
	fr.WritePing(false, [8]byte{'i', 'd', 'l', 'e'})
	if got := frameAnswer(fr, 5); got != "PING answered" {
		t.Errorf("on a stream never opened: %s; want PING answered", got)
	}
}
