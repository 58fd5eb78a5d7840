package httplb

import (
	"errors"
	"io"
	"net/http"
	"os"
	"sync"
	"time"
)

// replayLimit is how much of a retryable request's body is kept for a retry. A
// longer body streams on; a try that fails after sending more than this is not
// retried.
const replayLimit = 64 << 10

// fillWait bounds how long a retry waits for the rest of a body the failed try
// had not read yet (a gRPC call refused before its message was all sent).
const fillWait = 100 * time.Millisecond

var errStaleTry = errors.New("request body: read by a try that has been given up")

// replayBody streams a client's request body to the backend, keeping its first
// bytes so a retry can send them again. Each try reads through its own tryBody;
// a given-up try's late reads (a transport may still be writing when RoundTrip
// has returned) get an error, never the next try's bytes, and what they had
// already pulled from the client stays kept.
type replayBody struct {
	src  io.ReadCloser
	keep bool // keep bytes for a retry

	srcMu sync.Mutex // one reader of src at a time

	mu   sync.Mutex
	gen  int
	buf  []byte
	read bool // any byte read from src
	over bool // more read than buf keeps
	eof  bool
	// srcErr is how reading the client's body failed (it went away, or sent
	// a body its framing does not allow): the request's fault, never a
	// backend's.
	srcErr error
	// reading: a read of src is under way (pull), which breakRead may break.
	reading bool
	// trying: the generation of the try under way, whose breakRead may act;
	// 0 between tries (endTry).
	trying int
	// broken: a try's time ran out and breakRead broke off the read; its
	// error is not the client's.
	broken bool
	// expired: the generation of the try whose time ran out (breakRead),
	// whose reads fail from then on: one the transport starts after the
	// break, between two of its reads, would otherwise wait on a paused
	// client with no deadline.
	expired int
}

// next starts a try: a reader that replays what was kept, then reads on.
func (rb *replayBody) next() *tryBody {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	rb.gen++
	rb.trying = rb.gen
	return &tryBody{rb: rb, gen: rb.gen}
}

// endTry ends the try next started, before the try returns: its breakRead,
// which runs on a goroutine of its own when the try's time is up and may
// come late, does nothing from now on. (A late one would break the read of a
// retry, or of the wait for the rest of the body, or reach a ResponseWriter
// whose handler has returned.)
func (rb *replayBody) endTry() {
	rb.mu.Lock()
	rb.trying = 0
	rb.mu.Unlock()
}

// pull reads from the client, keeping what it reads while within the limit;
// srcMu must be held.
func (rb *replayBody) pull(p []byte) (n int, kept bool, err error) {
	rb.mu.Lock()
	rb.reading = true
	rb.mu.Unlock()
	n, err = rb.src.Read(p)
	rb.mu.Lock()
	defer rb.mu.Unlock()
	rb.reading = false
	if n > 0 {
		rb.read = true
		if rb.keep && !rb.over && len(rb.buf)+n <= replayLimit {
			rb.buf = append(rb.buf, p[:n]...)
			kept = true
		} else {
			rb.over = true
		}
	}
	switch {
	case err == io.EOF:
		rb.eof = true
	case err != nil && rb.srcErr == nil && !rb.broken:
		rb.srcErr = err
	}
	return n, kept, err
}

// breakRead breaks off try gen's read of the client's body (gen 0: the read
// of the try under way, whichever it is), through w's connection (or stream),
// if the transport is blocked in it: Go's transport returns from a try that
// failed or ran out of time only once its read of the body has, and a client
// that paused its upload would hold that read, and the request, for as long
// as it likes. Nothing else is touched: a body no read waits for (a try whose
// dial hung has read none) is retried whole, and a deadline set then would
// fail the retry's reads of a client that sent everything; nor is a try that
// has ended (endTry).
func (rb *replayBody) breakRead(w http.ResponseWriter, gen int) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if rb.trying == 0 || gen != 0 && rb.trying != gen || rb.eof {
		return
	}
	rb.expired = rb.trying
	if !rb.reading {
		return
	}
	rb.broken = true
	// Under mu: endTry, and so mend, come after the deadline is set.
	http.NewResponseController(w).SetReadDeadline(aLongTimeAgo)
}

// mend undoes breakRead before a retry: the read deadline it set is lifted (a
// body's reads have none), so the retry, and the wait for what the broken
// read left of the body, read under their own time.
func (rb *replayBody) mend(w http.ResponseWriter) {
	if rb == nil {
		return
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if !rb.broken {
		return
	}
	rb.broken = false
	http.NewResponseController(w).SetReadDeadline(time.Time{})
}

// failed returns the error a read of the client's body met, nil if none did
// (or there is no body).
func (rb *replayBody) failed() error {
	if rb == nil {
		return nil
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return rb.srcErr
}

// ended reports whether the client's body has been read to its end; a nil body
// has.
func (rb *replayBody) ended() bool {
	if rb == nil {
		return true
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return rb.eof
}

// replayable says whether a new try can send the whole body again: nothing of it
// was read (dial: and no try is reading now), or all of it is kept. A body the
// failed try had not read to its end is read on, within the limit, for a
// moment. A nil body always can.
func (rb *replayBody) replayable(dial bool) bool {
	if rb == nil {
		return true
	}
	rb.mu.Lock()
	read, eof, over := rb.read, rb.eof, rb.over
	rb.mu.Unlock()
	switch {
	case dial && !read:
		return true
	case eof || over || !rb.keep:
		return eof && !over
	}
	done := make(chan struct{})
	// Exits at the body's end, the limit, or a read error (at the latest when
	// the server closes the body as the request ends).
	go func() {
		defer close(done)
		var tmp [4096]byte
		rb.srcMu.Lock()
		defer rb.srcMu.Unlock()
		for {
			if _, kept, err := rb.pull(tmp[:]); err != nil || !kept {
				return
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(fillWait):
		return false
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return rb.eof && !rb.over
}

type tryBody struct {
	rb  *replayBody
	gen int
	off int
}

func (t *tryBody) Read(p []byte) (int, error) {
	rb := t.rb
	// Held from the check to the read's end, so bytes another try pulls in the
	// meantime are replayed first, in order.
	rb.srcMu.Lock()
	defer rb.srcMu.Unlock()
	rb.mu.Lock()
	switch {
	case t.gen != rb.gen:
		rb.mu.Unlock()
		return 0, errStaleTry
	case t.gen == rb.expired:
		// Not the client's failure: the try's time is up.
		rb.mu.Unlock()
		return 0, os.ErrDeadlineExceeded
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
	n, kept, err := rb.pull(p)
	if kept {
		t.off += n
	}
	return n, err
}

// Close leaves the client's body open: the server closes it when the request
// ends, and a transport closing it on a failed try must not end the retry's.
func (t *tryBody) Close() error { return nil }
