package httplb

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/proxy"
)

// TestMergedListenerFails: when one of a merged listener's sockets fails for
// good, Accept returns the error, and a connection another socket accepts
// after it is closed rather than held by a goroutine nobody will take it
// from; Close then ends every goroutine.
func TestMergedListenerFails(t *testing.T) {
	var lns []net.Listener
	for range 2 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		lns = append(lns, ln)
	}
	// A listening socket shut down accepts no more: accept returns EINVAL.
	rc, err := lns[0].(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	rc.Control(func(fd uintptr) { err = unix.Shutdown(int(fd), unix.SHUT_RD) })
	if err != nil {
		t.Fatal(err)
	}
	m := newMergedListener(lns)
	if _, err := m.Accept(); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("accept: got %v; want EINVAL", err)
	}
	c, err := net.Dial("tcp", lns[1].Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("a connection accepted after the failure: read got %v; want EOF (closed)", err)
	}
	m.Close()
	select {
	case <-m.ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the merged listener's goroutines did not end after Close")
	}
}

// TestMergedShutdownAnswersAccepted: a service that took a proxy's several
// listening sockets over (one per event loop) answers, as it shuts down, the
// connections it accepted from each of them before, whose requests come only
// after, by either HTTP/1.1 engine; once its Serve has returned, every
// goroutine it started has ended and it holds no descriptor.
func TestMergedShutdownAnswersAccepted(t *testing.T) {
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			bs := httpbackend.StartN(t, 1)
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			at := l.Addr().(*net.TCPAddr).AddrPort()
			l.Close()
			px, err := proxy.Listen(context.Background(), proxy.Config{Name: "px", Listen: at, AcceptLoops: 3,
				Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { px.Close() })
			goroutines, fds := runtime.NumGoroutine(), openFDs(t)
			sv := serveStoppableWith(t, Config{Listen: at, NetHTTP1: engine == "net_http"}, backendSet(bs),
				func(cfg Config, bs []Backend) (*Service, error) { return ListenFrom(cfg, bs, px) })
			if got := len(sv.socks); got != 3 {
				t.Fatalf("the service took %d sockets over; want the proxy's 3", got)
			}
			// Many source ports: connections reach every socket.
			var cs []net.Conn
			for range 12 {
				c, err := net.Dial("tcp", at.String())
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				cs = append(cs, c)
			}
			if !waitfor.Cond(10*time.Second, func() bool { return sv.Snapshot().Accepted == uint64(len(cs)) }) {
				t.Fatalf("accepted %d connections; want %d", sv.Snapshot().Accepted, len(cs))
			}
			sv.stop()
			// The proxy's descriptors close too: once the service's are,
			// nothing listens.
			px.Close()
			if !waitfor.Cond(10*time.Second, func() bool {
				d, err := net.Dial("tcp", at.String())
				if err == nil {
					d.Close()
				}
				return err != nil
			}) {
				t.Fatal("the listening sockets were not closed")
			}
			for i, c := range cs {
				c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); err != nil {
					t.Fatal(err)
				}
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					t.Fatalf("connection %d: read the answer: %v; want 200", i, err)
				}
				resp.Body.Close()
				c.Close()
				if resp.StatusCode != http.StatusOK {
					t.Errorf("connection %d: got %d; want 200", i, resp.StatusCode)
				}
			}
			select {
			case <-sv.done:
			case <-time.After(30 * time.Second):
				t.Fatal("Serve did not return")
			}
			if !waitfor.Cond(10*time.Second, func() bool { return runtime.NumGoroutine() <= goroutines && openFDs(t) <= fds }) {
				t.Errorf("after Serve returned: %d goroutines, %d descriptors; want at most %d, %d",
					runtime.NumGoroutine(), openFDs(t), goroutines, fds)
			}
		})
	}
}
