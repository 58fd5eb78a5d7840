package httplb

import (
	"errors"
	"io"
	"sync"
)

// replayLimit is how much of a retryable request's body is kept for a retry. A
// longer body streams on; a try that fails after sending more than this is not
// retried.
const replayLimit = 64 << 10

var errStaleTry = errors.New("request body: read by a try that has been given up")

// replayBody streams a client's request body to the backend, keeping its first
// bytes so a retry can send them again. Each try reads through its own tryBody;
// a given-up try's late reads (a transport may still be writing when RoundTrip
// has returned) get an error, never the next try's bytes.
type replayBody struct {
	src  io.ReadCloser
	keep bool // keep bytes for a retry

	mu   sync.Mutex
	gen  int
	buf  []byte
	read bool // any byte read from src
	over bool // more read than buf keeps
	eof  bool
}

// next starts a try: a reader that replays what was kept, then reads on.
func (rb *replayBody) next() io.ReadCloser {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	rb.gen++
	return &tryBody{rb: rb, gen: rb.gen}
}

// replayable says whether a new try can send the whole body again: nothing of it
// was read (dial: and no try is reading now), or all of it was, and kept.
// A nil body always can.
func (rb *replayBody) replayable(dial bool) bool {
	if rb == nil {
		return true
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return dial && !rb.read || rb.eof && !rb.over
}

type tryBody struct {
	rb  *replayBody
	gen int
	off int
}

func (t *tryBody) Read(p []byte) (int, error) {
	rb := t.rb
	rb.mu.Lock()
	switch {
	case t.gen != rb.gen:
		rb.mu.Unlock()
		return 0, errStaleTry
	case t.off < len(rb.buf):
		n := copy(p, rb.buf[t.off:])
		t.off += n
		rb.mu.Unlock()
		return n, nil
	case rb.eof:
		rb.mu.Unlock()
		return 0, io.EOF
	}
	rb.mu.Unlock()
	// One try reads src at a time: the next starts only after this one's
	// RoundTrip has returned, and replays only a body read to its end.
	n, err := rb.src.Read(p)
	rb.mu.Lock()
	if n > 0 {
		rb.read = true
		if rb.keep && !rb.over && len(rb.buf)+n <= replayLimit {
			rb.buf = append(rb.buf, p[:n]...)
			t.off += n
		} else {
			rb.over = true
		}
	}
	if err == io.EOF {
		rb.eof = true
	}
	rb.mu.Unlock()
	return n, err
}

// Close leaves the client's body open: the server closes it when the request
// ends, and a transport closing it on a failed try must not end the retry's.
func (t *tryBody) Close() error { return nil }
