package httplb

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestIdleBackendCloseSendsGoAway: weir's HTTP/2 connections to a backend end
// with GOAWAY NO_ERROR when weir closes them idle, as it does when the service
// stops or a reload removes the backend (RFC 9113 6.8), not with a bare FIN:
// those of HTTP/1.1 clients' requests (Go's HTTP/2 transport) and those of
// HTTP/2 clients' (the frame engine). A connection busy with a request when
// the reload removes the backend ends so once the request has.
func TestIdleBackendCloseSendsGoAway(t *testing.T) {
	for _, c := range []struct {
		name   string
		client *http.Client
		close  func(sv *served) error
		busy   bool // the close comes while the request waits for its answer
	}{
		{"HTTP/1.1 client/stop", h1Client(), stop, false},
		{"HTTP/1.1 client/reload without the backend", h1Client(), removeBackends, false},
		{"HTTP/1.1 client/reload without the backend, busy", h1Client(), removeBackends, true},
		{"HTTP/2 client/stop", h2cClient(), stop, false},
		{"HTTP/2 client/reload without the backend", h2cClient(), removeBackends, false},
		{"HTTP/2 client/reload without the backend, busy", h2cClient(), removeBackends, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			last := make(chan string, 1)
			came, answer := make(chan struct{}, 1), make(chan struct{})
			var answerOnce sync.Once
			letAnswer := func() { answerOnce.Do(func() { close(answer) }) }
			be := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
				readBackendFrames(fr, func(f *http2.HeadersFrame) {
					if c.busy {
						came <- struct{}{}
						<-answer
					}
					fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: statusBlock("200"), EndHeaders: true})
					fr.WriteData(f.StreamID, true, []byte("ok"))
				}, reportEnd(last))
			})
			sv := serveStoppable(t, Config{Upstream: UpstreamH2C}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			t.Cleanup(letAnswer) // before the service's drain
			url := "http://" + sv.Addr().String() + "/"
			if !c.busy {
				resp, body := get(t, c.client, url)
				if resp.StatusCode != http.StatusOK || body != "ok" {
					t.Fatalf("GET: %s %q; want 200 ok", resp.Status, body)
				}
				if err := c.close(sv); err != nil {
					t.Fatal(err)
				}
			} else {
				got := make(chan string, 1)
				// Exits when the request is answered or fails.
				go func() {
					code, body, err := send(c.client, "GET", url)
					got <- fmt.Sprint(code, " ", body, " ", err)
				}()
				select {
				case <-came:
				case <-time.After(15 * time.Second):
					t.Fatal("the request did not reach the backend in 15s")
				}
				if err := c.close(sv); err != nil {
					t.Fatal(err)
				}
				letAnswer()
				if g := <-got; g != "200 ok <nil>" {
					t.Fatalf("GET in flight across the close: %s; want 200 ok <nil>", g)
				}
			}
			select {
			case g := <-last:
				if g != "GOAWAY NO_ERROR" {
					t.Errorf("the backend's connection ended with %s; want GOAWAY NO_ERROR", g)
				}
			case <-time.After(15 * time.Second):
				t.Error("the backend's connection still open 15s after weir closed it")
			}
		})
	}
}

// TestTransportProtocolErrorCloseNotNoError: a connection Go's HTTP/2
// transport closes for a protocol error of the backend's, while weir is
// closing that backend's idle connections, does not say GOAWAY NO_ERROR: it
// is not an orderly end. The test holds the backend's retire flag as
// closeIdle holds it while it runs, and the backend, once its answer is in,
// sends DATA on stream 0, which the transport takes for a connection error.
func TestTransportProtocolErrorCloseNotNoError(t *testing.T) {
	end, bad := make(chan string, 1), make(chan struct{})
	be := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
		readBackendFrames(fr, func(f *http2.HeadersFrame) {
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: statusBlock("200"), EndHeaders: true})
			fr.WriteData(f.StreamID, true, []byte("ok"))
			select {
			case <-bad:
				writeRawFrame(conn, http2.FrameData, 0, 0, []byte("on stream 0"))
			case <-time.After(20 * time.Second):
			}
		}, reportEnd(end))
	})
	sv := serveStoppable(t, Config{Upstream: UpstreamH2C}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	c := h1Client()
	t.Cleanup(c.CloseIdleConnections)
	if code, body, err := send(c, "GET", "http://"+sv.Addr().String()+"/"); err != nil || code != http.StatusOK || body != "ok" {
		t.Fatalf("GET: %d %q %v; want 200 ok", code, body, err)
	}
	b := sv.backend(be.String())
	b.h2Retire.Store(true)
	t.Cleanup(func() { b.h2Retire.Store(false) })
	close(bad)
	select {
	case g := <-end:
		if g == "GOAWAY NO_ERROR" {
			t.Errorf("the connection the transport closed for DATA on stream 0 ended with %s; want no claim of no error", g)
		}
	case <-time.After(15 * time.Second):
		t.Error("the transport had not closed the connection 15s after DATA on stream 0")
	}
}

func stop(sv *served) error {
	sv.stop()
	<-sv.done
	return nil
}

func removeBackends(sv *served) error { return sv.SetBackends(nil) }

// TestGoAwayConnCloseDoesNotWait: closing a connection of Go's HTTP/2
// transport while its backend reads nothing and weir's queue to it is full
// returns at once, as a close without GOAWAY does. The transport closes it
// under its pool's lock, and closeIdle under the service's: a Close that
// waited for the backend would hold up every request and reload behind them.
// It must not wait to queue its GOAWAY, nor for a Write of the transport's
// that waits for room (a PING's answer, say).
func TestGoAwayConnCloseDoesNotWait(t *testing.T) {
	for _, pending := range []bool{false, true} {
		t.Run(fmt.Sprintf("write pending %v", pending), func(t *testing.T) {
			cc, peer := tcpPair(t)
			// Small socket buffers: the first frame fills them, and the
			// backend reads nothing.
			cc.Conn.(*net.TCPConn).SetWriteBuffer(4 << 10)
			peer.(*net.TCPConn).SetReadBuffer(4 << 10)
			var retire atomic.Bool
			c := newGoAwayConn(cc, &retire, new(h2Conns))
			if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Write(dataFrame(1 << 20)); err != nil {
				t.Fatal(err)
			}
			// The flusher has taken that frame into the kernel, where it
			// stays: the queue is empty behind it. Then a frame fills the
			// queue to its limit, and ends at a frame boundary.
			if !waitfor.Cond(30*time.Second, func() bool {
				cc.mu.Lock()
				defer cc.mu.Unlock()
				return cc.writing && len(cc.buf) == 0
			}) {
				t.Fatal("the first frame still queued after 30s")
			}
			if _, err := c.Write(dataFrame(coalesceLimit - 9)); err != nil {
				t.Fatal(err)
			}
			if pending {
				// Exits when Close fails it, or at cleanup, when the
				// socket closes.
				go c.Write([]byte{0, 0, 8, byte(http2.FramePing), 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
				waitParked(t, "(*coalescingConn).Write")
			}
			retire.Store(true)
			closed := make(chan struct{})
			// Exits when Close returns; the cleanup's socket closes end the
			// flusher's write, and with it a Close that waits.
			go func() {
				c.Close()
				close(closed)
			}()
			select {
			case <-closed:
			case <-time.After(20 * time.Second):
				t.Fatal("Close still waiting for the backend after 20s")
			}
		})
	}
}

// dataFrame is a DATA frame on stream 1 with n bytes of payload.
func dataFrame(n int) []byte {
	f := make([]byte, 9+n)
	f[0], f[1], f[2] = byte(n>>16), byte(n>>8), byte(n)
	f[3] = byte(http2.FrameData)
	f[8] = 1
	return f
}

// waitParked waits until a goroutine waits on a sync.Cond inside fn (a
// function name as stack dumps show it).
func waitParked(t *testing.T, fn string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	if !waitfor.Cond(30*time.Second, func() bool {
		n := runtime.Stack(buf, true)
		for g := range strings.SplitSeq(string(buf[:n]), "\n\n") {
			if strings.Contains(g, "sync.(*Cond).Wait") && strings.Contains(g, fn) {
				return true
			}
		}
		return false
	}) {
		t.Fatalf("no goroutine waiting in %s after 30s", fn)
	}
}

// TestOneGoAwayToBackend: a backend connection weir has ended with a GOAWAY
// for the backend's protocol error gets no second GOAWAY, even when a
// client's cancel ends its last stream before the connection is closed.
// The backend first sends GOAWAY itself (the connection takes no new
// streams), then a frame that breaks the protocol; the test holds the pool's
// lock so that the connection, its GOAWAY PROTOCOL_ERROR sent, waits to be
// dropped while the client cancels.
func TestOneGoAwayToBackend(t *testing.T) {
	frames := make(chan string, 16)
	breakIt := make(chan struct{})
	be := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
		defer close(frames)
		readBackendFrames(fr, func(f *http2.HeadersFrame) {
			// The PING's answer tells the test weir has read the GOAWAY.
			fr.WriteGoAway(f.StreamID, http2.ErrCodeNo, nil)
			fr.WritePing(false, [8]byte{1})
			go func() { // exits when the test lets it or gives up
				select {
				case <-breakIt:
					// A reset of a stream weir never opened.
					fr.WriteRSTStream(f.StreamID+100, http2.ErrCodeCancel)
				case <-time.After(20 * time.Second):
				}
			}()
		}, func(what string) bool { frames <- what; return true })
	})
	sv := serveStoppable(t, Config{Upstream: UpstreamH2C}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { // exits when the request ends: cancel, or the client's timeout
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+sv.Addr().String()+"/", nil)
		resp, err := h2cClient().Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	t.Cleanup(func() { cancel(); <-errc })
	next := func(want string) {
		t.Helper()
		select {
		case got := <-frames:
			if got != want {
				t.Fatalf("the backend read %s; want %s", got, want)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("the backend read nothing in 15s; want %s", want)
		}
	}
	next("PING answered")
	pool := sv.backend(be.String()).fpool.Load()
	pool.mu.Lock()
	locked := true
	unlock := func() {
		if locked {
			locked = false
			pool.mu.Unlock()
		}
	}
	t.Cleanup(unlock)
	close(breakIt)
	next("GOAWAY PROTOCOL_ERROR")
	cancel()
	next("RST_STREAM CANCEL")
	unlock()
	for f := range frames {
		if strings.HasPrefix(f, "GOAWAY") {
			t.Errorf("after its GOAWAY PROTOCOL_ERROR weir sent %s; want no other GOAWAY", f)
		}
	}
}

// reportEnd is a report for readBackendFrames that passes on how the
// connection ended, GOAWAY or the read's error, and stops reading there.
func reportEnd(end chan<- string) func(string) bool {
	return func(what string) bool {
		if strings.HasPrefix(what, "GOAWAY ") || strings.HasPrefix(what, "read: ") {
			end <- what
			return false
		}
		return true
	}
}

// readBackendFrames is a raw backend's reader: it acknowledges weir's
// SETTINGS, passes each HEADERS to headers, and reports to report, until it
// returns false or the read fails, "GOAWAY <code>", "RST_STREAM <code>",
// "PING answered" and, last, "read: <error>".
func readBackendFrames(fr *http2.Framer, headers func(*http2.HeadersFrame), report func(string) bool) {
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			report("read: " + err.Error())
			return
		}
		what := ""
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
			}
		case *http2.HeadersFrame:
			headers(f)
		case *http2.PingFrame:
			if f.IsAck() {
				what = "PING answered"
			}
		case *http2.GoAwayFrame:
			what = "GOAWAY " + f.ErrCode.String()
		case *http2.RSTStreamFrame:
			what = "RST_STREAM " + f.ErrCode.String()
		}
		if what != "" && !report(what) {
			return
		}
	}
}

// BenchmarkGoAwayConnWrite: a small frame written through goAwayConn, as Go's
// HTTP/2 transport writes its frames; "bare" writes to the coalescingConn
// beneath alone, the baseline for what following the frames costs. On
// "loopback" a peer reads everything; on "closed" the connection is closed
// and each Write fails at once, which leaves the wrappers' own cost (locks,
// following the frames) without the noise of the queue's goroutine and the
// socket.
func BenchmarkGoAwayConnWrite(b *testing.B) {
	for _, closed := range []bool{false, true} {
		for _, wrapped := range []bool{false, true} {
			name := map[bool]string{false: "loopback", true: "closed"}[closed] + "/" + map[bool]string{false: "bare", true: "goAwayConn"}[wrapped]
			b.Run(name, func(b *testing.B) {
				cc, peer := tcpPair(b)
				// Exits when the pair closes (at cleanup).
				go io.Copy(io.Discard, peer)
				var w io.WriteCloser = cc
				if wrapped {
					g := newGoAwayConn(cc, new(atomic.Bool), new(h2Conns))
					if _, err := g.Write([]byte(http2.ClientPreface)); err != nil {
						b.Fatal(err)
					}
					w = g
				}
				if closed {
					w.Close()
				}
				f := dataFrame(64)
				b.ReportAllocs()
				for b.Loop() {
					if _, err := w.Write(f); err != nil && !closed {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
