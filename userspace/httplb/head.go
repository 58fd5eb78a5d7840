package httplb

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
)

// A message head as it came, read whole into a bufio.Reader before the standard
// library parses it there: the parser drops fields whose presence matters to a
// proxy (Transfer-Encoding beside Content-Length, a Connection field that says
// close and names others), and the raw head still has them.

// bufferedHead returns the message head br holds, through its empty line, or
// nil if it holds less than a whole head. (The connection loop then knows no
// byte more is awaited for a request's head, and its idle deadline can stay.)
func bufferedHead(br *bufio.Reader) []byte {
	b, _ := br.Peek(br.Buffered())
	if n := headLen(b); n > 0 {
		return b[:n]
	}
	return nil
}

// headLen is the length of the message head at b's start, through the empty
// line that ends it (CRLF, or a bare LF, which http.ReadRequest takes too), or
// 0 if b does not hold all of it.
func headLen(b []byte) int {
	for i := 0; ; {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			return 0
		}
		i += j + 1
		switch {
		case i < len(b) && b[i] == '\n':
			return i + 1
		case i+1 < len(b) && b[i] == '\r' && b[i+1] == '\n':
			return i + 2
		}
	}
}

// readHead reads until br holds a whole message head and returns it; nil and
// no error if the head does not fit br (http.ReadRequest or ReadResponse then
// reads it on). Parsed from br, a head it holds needs no read more, so the
// returned bytes stay put through the parse. A read's error is returned as it
// came: br hands it over once, and a read again would find another (a reset
// reads as an end).
func readHead(br *bufio.Reader) ([]byte, error) {
	for {
		if head := bufferedHead(br); head != nil {
			return head, nil
		}
		n := br.Buffered()
		if n >= br.Size() {
			return nil, nil
		}
		if _, err := br.Peek(n + 1); err != nil {
			return nil, err
		}
	}
}

// ambiguousFraming reports whether a request's framing may have been read
// otherwise by a proxy in front: Transfer-Encoding beside Content-Length, or
// Transfer-Encoding in HTTP/1.0, which http.ReadRequest drops (RFC 9112 6.1 and
// 6.3). Such a request is answered, and its connection then closed, as RFC 9112
// 6.1 has it: bytes that proxy took for the next request are not served as one.
// head is the request's head as it came, nil if it was not read whole at once:
// then both framings count as ambiguous.
func ambiguousFraming(req *http.Request, head []byte) bool {
	switch {
	case !req.ProtoAtLeast(1, 1):
		return head == nil || hasField(head, "transfer-encoding")
	case len(req.TransferEncoding) > 0:
		return head == nil || hasField(head, "content-length")
	}
	return false
}

// hasField reports whether a message head has a field of the given lower-case
// name (its first line, the request or status line, aside).
func hasField(head []byte, name string) bool {
	found := false
	eachField(head, name, func([]byte) bool { found = true; return false })
	return found
}

// eachField calls f with the value of each field of head named name (lower
// case), in order, until f returns false.
func eachField(head []byte, name string, f func(value []byte) bool) {
	for {
		i := bytes.IndexByte(head, '\n')
		if i < 0 {
			return
		}
		head = head[i+1:]
		if len(head) > len(name) && head[len(name)] == ':' && asciiEqualFold(head[:len(name)], name) {
			v := head[len(name)+1:]
			if e := bytes.IndexByte(v, '\n'); e >= 0 {
				v = v[:e]
			}
			if !f(bytes.TrimSpace(v)) {
				return
			}
		}
	}
}

// dropConnectionListed removes from h the fields a head's Connection names
// (RFC 9110 7.6.1), for an answer whose Connection field the response parser
// has dropped: it does when the field says close, names and all.
func dropConnectionListed(h http.Header, head []byte) {
	var listed []string
	eachField(head, "connection", func(v []byte) bool {
		listed = append(listed, string(v))
		return true
	})
	removeConnectionHeaders(h, http.Header{"Connection": listed})
}

func asciiEqualFold(b []byte, lower string) bool {
	for i := range len(lower) {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != lower[i] {
			return false
		}
	}
	return true
}

// answer is a backend's answer as readAnswer read it.
type answer struct {
	resp *http.Response
	// rd holds what follows the answer's head (its body, or past a 101 the
	// new protocol's bytes): the reader given, or, for a head that did not
	// fit it, a larger one that took its bytes over; the reader given is
	// then not to be read again, and the connection not to be reused.
	rd *bufio.Reader
	// came: bytes of an answer came, whole or not.
	came bool
}

// errAmbiguousAnswer is an answer framed both by Transfer-Encoding and by
// Content-Length, which a server must not send (RFC 9112 6.1): Go's reader
// frames it by the transfer coding and drops Content-Length, but the backend,
// or a proxy between, may have framed it by the length, and what it sent past
// that is then read as the next answer, to another request. It is refused as
// nginx refuses it (a 502, the connection closed).
var errAmbiguousAnswer = errors.New("malformed answer: framed by both Transfer-Encoding and Content-Length")

// ambiguousAnswer reports whether an answer's head, as it came, has both
// Transfer-Encoding and Content-Length. The reader keeps Transfer-Encoding
// only when it frames by it (HTTP/1.1), and drops it in HTTP/1.0, so the
// head is looked at only then.
func ambiguousAnswer(resp *http.Response, head []byte) bool {
	switch {
	case !resp.ProtoAtLeast(1, 1):
		return hasField(head, "transfer-encoding") && hasField(head, "content-length")
	case len(resp.TransferEncoding) > 0:
		return hasField(head, "content-length")
	}
	return false
}

// readAnswer reads the answer to req from br, which reads from lim. Interim
// answers (1xx: 100 Continue, 103 Early Hints) before it are read and dropped,
// as http.Transport drops them, and their heads and the answer's own share one
// budget of max bytes, as in http.Transport (MaxResponseHeaderBytes): a backend
// that sends 1xx heads without end fails once it has sent max bytes, rather
// than being read for ever. A 101 ends the wait. The answer's head is checked,
// as it came, for what Go's reader drops: framing by both Transfer-Encoding
// and Content-Length is an error, and the fields a Connection that says close
// names are dropped from the answer's header with it.
func readAnswer(br *bufio.Reader, lim *limitReader, req *http.Request, max int64) (answer, error) {
	lim.n = max
	a := answer{rd: br}
	for interim := 0; ; interim++ {
		head, err := wholeHead(&a, lim, int(max))
		var resp *http.Response
		if err == nil {
			resp, err = http.ReadResponse(a.rd, req)
		}
		a.came = a.came || lim.n < max
		switch {
		case err != nil && interim > 0 && errors.Is(err, errHeaderTooLong):
			return a, fmt.Errorf("after %d interim answers: %w", interim, err)
		case err != nil:
			return a, err
		case resp.StatusCode < 100:
			return a, errStatusUnder100(resp.StatusCode)
		case is1xx(resp.StatusCode) && resp.StatusCode != http.StatusSwitchingProtocols:
			resp.Body.Close()
			continue
		case ambiguousAnswer(resp, head):
			return a, errAmbiguousAnswer
		}
		if resp.Close && resp.ProtoAtLeast(1, 1) {
			// The parser dropped a Connection field that says close, and with
			// it the names of the fields it lists, which are hop-by-hop too.
			// A 101's Upgrade stays: it names the protocol switched to, which
			// the tunnel checks and passes on itself.
			up := resp.Header["Upgrade"]
			dropConnectionListed(resp.Header, head)
			if resp.StatusCode == http.StatusSwitchingProtocols && up != nil {
				resp.Header["Upgrade"] = up
			}
		}
		lim.n = math.MaxInt64 // the body reads with no cap
		a.resp = resp
		return a, nil
	}
}

// wholeHead reads until a.rd holds a whole message head and returns it. A head
// that does not fit a.rd is read into a reader twice its size (max at most),
// which takes over the bytes a.rd holds and becomes a.rd, and so on until it
// fits: the head's fields are then all there to look at, whatever its size (up
// to max, past which lim fails the read). The reader grows with the head, not
// to max at once: max may be 16 MiB, and a head just past a.rd then cost as
// much.
func wholeHead(a *answer, lim *limitReader, max int) ([]byte, error) {
	for {
		head, err := readHead(a.rd)
		switch {
		case head != nil || err != nil:
			return head, err
		case a.rd.Size() >= max:
			return nil, errHeaderTooLong
		}
		held, _ := a.rd.Peek(a.rd.Buffered())
		a.rd = bufio.NewReaderSize(io.MultiReader(bytes.NewReader(held), lim), min(2*a.rd.Size(), max))
	}
}
