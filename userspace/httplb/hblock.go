package httplb

import (
	"errors"
	"strings"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// hblock is one decoded header block (a HEADERS frame and its CONTINUATIONs).
// Its fields are valid until the connection's next block is read.
type hblock struct {
	id        uint32
	end       bool // END_STREAM
	fields    []hpack.HeaderField
	truncated bool // past the header list size: the fields are incomplete
}

// pseudo returns a pseudo-header's value (name without the colon).
func (b *hblock) pseudo(name string) string {
	for _, hf := range b.fields {
		if !strings.HasPrefix(hf.Name, ":") {
			break
		}
		if hf.Name[1:] == name {
			return hf.Value
		}
	}
	return ""
}

// regular returns the fields after the pseudo-headers.
func (b *hblock) regular() []hpack.HeaderField {
	for i, hf := range b.fields {
		if !strings.HasPrefix(hf.Name, ":") {
			return b.fields[i:]
		}
	}
	return nil
}

// blockReader reads a connection's frames, decoding header blocks into one
// slice it reuses: the framer's own decoding (ReadMetaHeaders) builds a new
// field slice for every block, growing it field by field, which was a tenth of
// the frame engine's CPU. The checks are the framer's: field names and values
// valid on the wire, pseudo-headers first, known and not repeated, the header
// list size (past it the block is truncated; a block far past it fails the
// connection).
type blockReader struct {
	fr      *http2.Framer
	dec     *hpack.Decoder
	max     uint32
	remain  uint32
	regular bool
	invalid error
	b       hblock
	// partial, if set, is told when a block starts that needs CONTINUATION
	// frames (true) and when it is whole (false): the reader bounds the
	// wait for the rest, which otherwise holds the connection's decoder.
	partial func(on bool)
}

func newBlockReader(fr *http2.Framer, maxList uint32) *blockReader {
	r := &blockReader{fr: fr, max: maxList}
	r.dec = hpack.NewDecoder(4096, r.emit)
	r.dec.SetMaxStringLength(int(maxList))
	return r
}

var errPseudoAfterRegular = errors.New("pseudo-header after a regular header")
var errSelfDependency = errors.New("the stream depends on itself")

// errPriorityLength is the cause of the stream error for a PRIORITY frame
// not 5 bytes long: PRIORITY may come on a stream not open, where the error
// has no stream to reset.
var errPriorityLength = errors.New("PRIORITY frame not 5 bytes long")

func (r *blockReader) emit(hf hpack.HeaderField) {
	if !httpguts.ValidHeaderFieldValue(hf.Value) {
		r.invalid = errors.New("invalid header field value for " + hf.Name)
	} else if strings.HasPrefix(hf.Name, ":") {
		if r.regular {
			r.invalid = errPseudoAfterRegular
		}
	} else {
		r.regular = true
		if !validWireName(hf.Name) {
			r.invalid = errors.New("invalid header field name")
		}
	}
	if r.invalid != nil {
		r.dec.SetEmitEnabled(false)
		return
	}
	if size := hf.Size(); size > r.remain {
		r.dec.SetEmitEnabled(false)
		r.b.truncated = true
		r.remain = 0
		return
	} else {
		r.remain -= size
	}
	r.b.fields = append(r.b.fields, hf)
}

// validWireName: a token, in lower case (RFC 9113 8.2.1).
func validWireName(v string) bool {
	if v == "" {
		return false
	}
	for _, c := range v {
		if !httpguts.IsTokenRune(c) || 'A' <= c && c <= 'Z' {
			return false
		}
	}
	return true
}

// read returns the next frame, or, for a HEADERS frame, the whole decoded
// block (frame nil). Errors are the framer's: a StreamError leaves the
// connection usable. A malformed block comes with its StreamError, so the
// reader can hold its stream ID to the rules of a HEADERS frame.
func (r *blockReader) read() (http2.Frame, *hblock, error) {
	fh, err := r.fr.ReadFrameHeader()
	if err != nil {
		return nil, nil, err
	}
	if fh.Length < fixedLength(fh) {
		// Too short for its pad length, priority or promised stream: a frame
		// size error (RFC 9113 4.2), and a connection error in a frame
		// carrying a header block or counted against the connection's
		// window. The framer's own answer, io.ErrUnexpectedEOF, reads as a
		// connection cut short, which would end it with no GOAWAY.
		return nil, nil, http2.ConnectionError(http2.ErrCodeFrameSize)
	}
	f, err := r.fr.ReadFrameForHeader(fh)
	if err == http2.ConnectionError(http2.ErrCodeFrameSize) && fh.Type == http2.FramePriority && fh.StreamID != 0 {
		// A PRIORITY frame not 5 bytes long is a stream error (RFC 9113
		// 6.3); the framer makes it the connection's.
		return nil, nil, http2.StreamError{StreamID: fh.StreamID, Code: http2.ErrCodeFrameSize, Cause: errPriorityLength}
	}
	if _, ok := err.(http2.StreamError); ok && fh.Type == http2.FrameHeaders {
		// The framer's stream error for a HEADERS frame whose padding is as
		// long as the frame is a connection error (RFC 9113 6.2): its block,
		// never decoded, leaves HPACK's state unknown for every later one.
		return nil, nil, http2.ConnectionError(http2.ErrCodeProtocol)
	}
	if err != nil {
		return nil, nil, err
	}
	hf, ok := f.(*http2.HeadersFrame)
	if !ok {
		return f, nil, nil
	}
	r.b = hblock{id: hf.StreamID, end: hf.StreamEnded(), fields: r.b.fields[:0]}
	// A stream cannot depend on itself (RFC 9113 5.3.1): a stream error,
	// known before the block is read, reported once it is decoded.
	selfDep := hf.HasPriority() && hf.Priority.StreamDep == hf.StreamID
	r.remain, r.regular, r.invalid = r.max, false, nil
	r.dec.SetEmitEnabled(true)
	frag, ended := hf.HeaderBlockFragment(), hf.HeadersEnded()
	if !ended && r.partial != nil {
		r.partial(true)
		defer r.partial(false)
	}
	// Frames bound a block as bytes do: empty CONTINUATIONs cost nothing to
	// send and a read each (the CONTINUATION flood, CVE-2024-27316).
	frames := 16 + r.max/512
	for {
		// A block far past the limit is not decoded at all.
		if int64(len(frag)) > 2*int64(r.remain) || r.invalid != nil || frames == 0 {
			return nil, nil, http2.ConnectionError(http2.ErrCodeProtocol)
		}
		frames--
		if _, err := r.dec.Write(frag); err != nil {
			return nil, nil, http2.ConnectionError(http2.ErrCodeCompression)
		}
		if ended {
			break
		}
		f, err := r.fr.ReadFrame()
		if err != nil {
			return nil, nil, err
		}
		c := f.(*http2.ContinuationFrame) // the framer allows nothing else here
		frag, ended = c.HeaderBlockFragment(), c.HeadersEnded()
	}
	if err := r.dec.Close(); err != nil {
		return nil, nil, http2.ConnectionError(http2.ErrCodeCompression)
	}
	if r.invalid != nil {
		return nil, &r.b, http2.StreamError{StreamID: r.b.id, Code: http2.ErrCodeProtocol, Cause: r.invalid}
	}
	if selfDep {
		return nil, &r.b, http2.StreamError{StreamID: r.b.id, Code: http2.ErrCodeProtocol, Cause: errSelfDependency}
	}
	if err := checkPseudos(r.b.fields); err != nil {
		return nil, &r.b, http2.StreamError{StreamID: r.b.id, Code: http2.ErrCodeProtocol, Cause: err}
	}
	return nil, &r.b, nil
}

// fixedLength is the length of the fields a frame of fh's type and flags
// cannot be without: the pad length (DATA, HEADERS, PUSH_PROMISE), a
// HEADERS frame's priority, a PUSH_PROMISE's promised stream (RFC 9113 6.1,
// 6.2, 6.6). Other types' lengths are the framer's to check.
func fixedLength(fh http2.FrameHeader) uint32 {
	var n uint32
	switch fh.Type {
	case http2.FrameData:
		if fh.Flags.Has(http2.FlagDataPadded) {
			n++
		}
	case http2.FrameHeaders:
		if fh.Flags.Has(http2.FlagHeadersPadded) {
			n++
		}
		if fh.Flags.Has(http2.FlagHeadersPriority) {
			n += 5
		}
	case http2.FramePushPromise:
		n = 4
		if fh.Flags.Has(http2.FlagPushPromisePadded) {
			n++
		}
	}
	return n
}

// checkPseudos: only known pseudo-headers, each once, of a request or of a
// response, not both.
func checkPseudos(fields []hpack.HeaderField) error {
	var request, response bool
	for i, hf := range fields {
		if !strings.HasPrefix(hf.Name, ":") {
			break
		}
		switch hf.Name {
		case ":method", ":path", ":scheme", ":authority", ":protocol":
			request = true
		case ":status":
			response = true
		default:
			return errors.New("unknown pseudo-header " + hf.Name)
		}
		for _, prev := range fields[:i] {
			if prev.Name == hf.Name {
				return errors.New("repeated pseudo-header " + hf.Name)
			}
		}
	}
	if request && response {
		return errors.New("request and response pseudo-headers mixed")
	}
	return nil
}
