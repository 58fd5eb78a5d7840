package proxy

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestClientResetAfterHalfClose: a client that half-closes (its request sent),
// then resets before the backend answers, has gone: the proxy ends the
// connection and the backend gets a reset, as it would from the client itself.
// The proxy took no notice of the reset once the client's direction had ended,
// and held the connection, its lease and its backend slot until the backend
// wrote, which a backend waiting for an event (a long poll) may never do.
func TestClientResetAfterHalfClose(t *testing.T) {
	gotEOF := make(chan struct{})
	after := make(chan int16, 1)
	be := startBackend(t, "a", netip.AddrPort{}, func(_ string, c *net.TCPConn) {
		io.Copy(io.Discard, c) // the request, to the client's FIN
		close(gotEOF)
		// Answers nothing; waits, as a server in poll(2) does, to learn that
		// the client has gone.
		after <- pollErr(c, 10*time.Second)
	})
	s := startProxy(t, Config{Backends: []Backend{{Addr: be.addr()}}, Logger: discardLogger()})
	c := dial(t, s)
	if _, err := c.Write([]byte("request")); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-gotEOF:
	case <-time.After(5 * time.Second):
		t.Fatal("the backend did not get the client's FIN")
	}
	c.SetLinger(0)
	c.Close() // a reset
	waitfor.Value(t, 5*time.Second, "0 active connections", active(s, 0))
	if got := <-after; got&unix.POLLERR == 0 {
		t.Errorf("the backend's socket after the client's reset: poll events %#x; want POLLERR (a reset)", got)
	}
	if b := s.Snapshot().Backends[0]; b.Active != 0 || b.Resets != 0 {
		t.Errorf("backend: %d active, %d resets; want 0 and 0 (the client reset, not the backend)", b.Active, b.Resets)
	}
}

// pollErr waits up to timeout for c's socket to report an error or a hang-up,
// and returns the events poll(2) saw (0 if none came).
func pollErr(c *net.TCPConn, timeout time.Duration) int16 {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	var got int16
	rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd)}} // no events asked: POLLERR and POLLHUP only
		for deadline := time.Now().Add(timeout); time.Now().Before(deadline); {
			n, err := unix.Poll(fds, int(time.Until(deadline)/time.Millisecond)+1)
			if err == unix.EINTR {
				continue
			}
			if n > 0 {
				got = fds[0].Revents
			}
			return
		}
	})
	return got
}

// TestClientResetWhileDialing: a client that resets while the proxy is still
// dialing its backend has gone: the dial is given up at once, and with it the
// service's MaxConns slot, the backend's connection slot and its
// least-connections count; the dial is not the backend's failure. The proxy
// dialed on to the connect timeout (and then the other backends, and reset the
// one that answered), holding the slot meanwhile: with MaxConns 1 the next
// client waited for it.
func TestClientResetWhileDialing(t *testing.T) {
	slow := blackhole(t) // a connect to it hangs
	rec := &recorder{}
	s := startProxy(t, Config{Backends: []Backend{{Addr: slow}}, MaxConns: 1, ConnectTimeout: time.Minute,
		Observer: rec, Logger: discardLogger()})
	c := dial(t, s)
	waitfor.Value(t, 5*time.Second, "the dial in progress", func() (any, bool) {
		n := s.Snapshot().Backends[0].Active
		return fmt.Sprintf("%d connections on the backend", n), n == 1
	})
	c.SetLinger(0)
	c.Close() // a reset
	waitfor.Value(t, 5*time.Second, "0 active connections", active(s, 0))
	b := s.Snapshot().Backends[0]
	if b.Active != 0 || b.ConnectFailures != 0 {
		t.Errorf("backend: %d active, %d connect failures; want 0 and 0", b.Active, b.ConnectFailures)
	}
	if got := rec.list(); len(got) != 0 {
		t.Errorf("outcomes reported for the backend: %q; want none (the client gave up)", got)
	}
}
