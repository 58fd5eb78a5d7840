package httplb

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestBlockReader: header blocks are decoded whole across CONTINUATION frames,
// and each check the framer's own decoding makes fails the stream or the
// connection as it would.
func TestBlockReader(t *testing.T) {
	enc := func(fields ...string) []byte {
		var buf bytes.Buffer
		e := hpack.NewEncoder(&buf)
		for i := 0; i+1 < len(fields); i += 2 {
			e.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
		}
		return buf.Bytes()
	}
	get := []string{":method", "GET", ":scheme", "http", ":path", "/"}
	withGet := func(extra ...string) []byte { return enc(append(append([]string{}, get...), extra...)...) }
	const limit = 1024
	for _, c := range []struct {
		name      string
		block     []byte
		split     int // CONTINUATION after this many bytes; 0: one frame
		wantConn  http2.ErrCode
		wantReset bool
		truncated bool
		fields    int
	}{
		{name: "request", block: withGet("user-agent", "x"), fields: 4},
		{name: "across CONTINUATION", block: withGet("x-long", strings.Repeat("v", 100)), split: 10, fields: 4},
		{name: "response", block: enc(":status", "200", "content-type", "text/plain"), fields: 2},
		{name: "upper case name", block: withGet("X-Up", "1"), wantReset: true},
		{name: "pseudo after regular", block: enc(":method", "GET", "a", "b", ":path", "/"), wantReset: true},
		{name: "unknown pseudo", block: withGet(":bogus", "1"), wantReset: true},
		{name: "repeated pseudo", block: enc(":method", "GET", ":method", "POST"), wantReset: true},
		{name: "request and response pseudo", block: enc(":method", "GET", ":status", "200"), wantReset: true},
		{name: "control character in a value", block: withGet("a", "b\x00c"), wantReset: true},
		{name: "past the list size", block: withGet("x-big", strings.Repeat("v", limit-200), "x-more", strings.Repeat("w", 300)), truncated: true},
		{name: "far past the list size", block: withGet("x-huge", strings.Repeat("v", 3*limit)), wantConn: http2.ErrCodeProtocol},
		{name: "bad hpack", block: []byte{0xff, 0xff, 0xff, 0xff}, wantConn: http2.ErrCodeCompression},
	} {
		t.Run(c.name, func(t *testing.T) {
			var wire bytes.Buffer
			w := http2.NewFramer(&wire, nil)
			first, rest := c.block, []byte(nil)
			if c.split > 0 {
				first, rest = c.block[:c.split], c.block[c.split:]
			}
			w.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: first, EndStream: true, EndHeaders: rest == nil})
			if rest != nil {
				w.WriteContinuation(1, true, rest)
			}
			w.WritePing(false, [8]byte{})
			r := newBlockReader(http2.NewFramer(nil, &wire), limit)
			f, b, err := r.read()
			var se http2.StreamError
			var ce http2.ConnectionError
			switch {
			case c.wantConn != 0:
				if !errors.As(err, &ce) || http2.ErrCode(ce) != c.wantConn {
					t.Fatalf("got %v; want connection error %v", err, c.wantConn)
				}
				return
			case c.wantReset:
				if !errors.As(err, &se) || se.StreamID != 1 || se.Code != http2.ErrCodeProtocol {
					t.Fatalf("got %v; want a PROTOCOL_ERROR reset of stream 1", err)
				}
			case err != nil || f != nil || b == nil:
				t.Fatalf("got %v, %v, %v; want a block", f, b, err)
			default:
				if b.id != 1 || !b.end || b.truncated != c.truncated || !c.truncated && len(b.fields) != c.fields {
					t.Errorf("block: stream %d, end %v, truncated %v, %d fields; want 1, true, %v, %d", b.id, b.end, b.truncated, len(b.fields), c.truncated, c.fields)
				}
			}
			// The connection reads on after a block or a stream error.
			if f, _, err := r.read(); err != nil || f == nil || f.Header().Type != http2.FramePing {
				t.Errorf("next frame: %v, %v; want the PING", f, err)
			}
		})
	}
}
