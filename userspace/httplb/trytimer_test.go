package httplb

import (
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestFramesStaleTryTimerSparesNextTry: a try's timer that fires as the try
// fails for another reason (the backend resets the stream) finds the next try
// under way; it must leave that try alone. The test holds the client
// session's lock while the backend's reset and then the first try's timer
// arrive, so both wait for it, in that order: the reset starts the second try,
// and the first try's timer runs after. Before, that timer took the second
// try for its own and failed it (504: no response headers within
// try_timeout), though the second backend answered well within its time.
func TestFramesStaleTryTimerSparesNextTry(t *testing.T) {
	const tryTimeout = time.Second
	var n atomic.Int32
	came, reset := make(chan struct{}, 1), make(chan struct{})
	letReset := closeOnce(reset)
	t.Cleanup(letReset)
	// Both backends alike: the first request either gets is reset when the
	// test says, the next is answered once the first try's timer has run,
	// well within its own try's time.
	h := func(conn net.Conn, fr *http2.Framer) {
		readBackendFrames(fr, func(f *http2.HeadersFrame) {
			if n.Add(1) == 1 {
				came <- struct{}{}
				<-reset
				fr.WriteRSTStream(f.StreamID, http2.ErrCodeInternal)
				return
			}
			waitfor.Cond(10*time.Second, func() bool { return !waitingForLock("(*fsess).timerFired") })
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: statusBlock("200"), EndHeaders: true, EndStream: true})
		}, func(string) bool { return true })
	}
	bs := []Backend{{Addr: rawH2Backend(t, h), Weight: 1, Usable: true}, {Addr: rawH2Backend(t, h), Weight: 1, Usable: true}}
	s := serveOn(t, Config{Upstream: UpstreamH2C, TryTimeout: tryTimeout, Retries: 1}, bs)
	c := h2cClient()
	t.Cleanup(c.CloseIdleConnections)
	got := sendAsync(c, "http://"+s.Addr().String()+"/", nil)
	awaitCame(t, came)
	var ss *fsess
	s.fmu.Lock()
	for k := range s.fsessions {
		ss = k
	}
	s.fmu.Unlock()
	if ss == nil {
		t.Fatal("no frame engine session for the client")
	}
	ss.mu.Lock()
	letReset()
	// The reset arrives first, then the try's time runs out: each waits for
	// the lock, the reset's ahead.
	blocked := func(fn string) func() bool {
		return func() bool { return waitingForLock(fn) }
	}
	okReset := waitfor.Cond(10*time.Second, blocked("(*upconn).withStream"))
	okTimer := okReset && waitfor.Cond(10*time.Second, blocked("(*fsess).timerFired"))
	ss.mu.Unlock()
	if !okReset || !okTimer {
		t.Fatalf("the backend's reset waiting for the session's lock: %v; the first try's timer: %v; want both", okReset, okTimer)
	}
	if g := <-got; g != "200  <nil>" {
		t.Errorf("GET whose first try was reset as its timer fired: %s; want 200  <nil>, from the second backend", g)
	}
}

// waitingForLock reports whether a goroutine whose stack names fn waits for
// a sync.Mutex.
func waitingForLock(fn string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "[sync.Mutex.Lock") && strings.Contains(g, fn) {
			return true
		}
	}
	return false
}
