package httplb

import (
	"errors"
	"net"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// deadlineWriter is a ResponseWriter whose SetReadDeadline (which
// http.ResponseController finds) sets its connection's and counts the calls.
type deadlineWriter struct {
	http.ResponseWriter
	conn net.Conn
	mu   sync.Mutex
	set  []time.Time
}

func (w *deadlineWriter) SetReadDeadline(t time.Time) error {
	w.mu.Lock()
	w.set = append(w.set, t)
	w.mu.Unlock()
	return w.conn.SetReadDeadline(t)
}

func (w *deadlineWriter) calls() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.set)
}

// TestReplayBodyBreakRead: a try's breakRead breaks only a read of the body
// that is under way, and only while its try is (it runs on a goroutine of
// its own when the try's time is up, and may come after the try has
// returned: then it must touch nothing, neither the connection a retry or
// the next request reads nor a ResponseWriter whose handler has returned);
// mend lifts the deadline it set, and the broken read is not the client's
// failure.
func TestReplayBodyBreakRead(t *testing.T) {
	client, server := net.Pipe()
	defer client.Close()
	defer server.Close()
	w := &deadlineWriter{conn: server}
	rb := &replayBody{src: server, keep: true}
	tb := rb.next()
	rb.breakRead(w, tb.gen)
	if n := w.calls(); n != 0 {
		t.Fatalf("breakRead with no read under way set the read deadline %d times; want none (a try whose dial hangs reads nothing)", n)
	}
	// A read that try starts after its time ran out fails at once, not
	// waiting on the client (the transport between two reads).
	late := make(chan error, 1)
	// Exits at once, or, if it waits on the client, when the pipe closes at
	// the end.
	go func() {
		_, err := tb.Read(make([]byte, 16))
		late <- err
	}()
	select {
	case err := <-late:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a read after the try's time ran out: %v; want a deadline error", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("a read the try started after its time ran out waits on a paused client")
	}
	if err := rb.failed(); err != nil {
		t.Errorf("failed() = %v after a try ran out of time; want nil (not the client's failure)", err)
	}
	tb = rb.next() // a retry
	done := make(chan error, 1)
	// Exits when its read is broken off, or the pipe closes at the end.
	go func() {
		_, err := tb.Read(make([]byte, 16))
		done <- err
	}()
	if !waitfor.Cond(5*time.Second, func() bool {
		rb.mu.Lock()
		defer rb.mu.Unlock()
		return rb.reading
	}) {
		t.Fatal("the try's read never began")
	}
	rb.breakRead(w, tb.gen+1)
	rb.endTry()
	rb.breakRead(w, tb.gen)
	rb.breakRead(w, 0)
	if n := w.calls(); n != 0 {
		t.Fatalf("breakRead of another try, or after its try ended, set the read deadline %d times; want none", n)
	}
	tb2 := rb.next() // the read under way is now the retry's to wait for
	rb.breakRead(w, 0)
	select {
	case err := <-done:
		if !isTimeout(err) {
			t.Errorf("the broken read returned %v; want a timeout", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("breakRead during a try left its read blocked")
	}
	if err := rb.failed(); err != nil {
		t.Errorf("failed() = %v after a broken read; want nil (not the client's failure)", err)
	}
	rb.mend(w)
	w.mu.Lock()
	got := append([]time.Time(nil), w.set...)
	w.mu.Unlock()
	if len(got) != 2 || !got[0].Before(time.Now()) || !got[1].IsZero() {
		t.Fatalf("read deadlines set: %v; want one in the past (breakRead), then none (mend)", got)
	}
	// The retry reads on under no deadline. The write exits when the retry
	// has read it, or when the pipe closes at the end.
	tb2 = rb.next()
	go client.Write([]byte("hi"))
	buf := make([]byte, 16)
	if n, err := tb2.Read(buf); err != nil || string(buf[:n]) != "hi" {
		t.Errorf("the retry's read after mend: %q, %v; want \"hi\"", buf[:n], err)
	}
}
