package proxy

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
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

// TestClientTalksAfterBackendClosed: a backend that answers and closes has
// ended its stream cleanly; a client that goes on sending after the EOF meets
// the reset the backend's host answers such bytes with, but that is the
// client's doing, not a reset of the backend's: nothing counts against it. It
// was counted as the backend breaking the connection (a reset in its counters
// and to the Observer, which passive health counts as a failure).
func TestClientTalksAfterBackendClosed(t *testing.T) {
	be := startBackend(t, "a", netip.AddrPort{}, func(_ string, c *net.TCPConn) {
		readLine(c)
		c.Write([]byte("bye\n"))
		// Closes with the client's later bytes unread: its host answers
		// them with a reset.
	})
	rec := &recorder{}
	s := startProxy(t, Config{Backends: []Backend{{Addr: be.addr()}}, Observer: rec, Logger: discardLogger()})
	c := dial(t, s)
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write([]byte("hi\n"))
	if line, err := readLine(c); err != nil || line != "bye" {
		t.Fatalf("answer: %q, %v; want \"bye\"", line, err)
	}
	if n, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("after the answer: read %d, %v; want EOF", n, err)
	}
	// Talks on until the proxy gives up on the connection.
	waitfor.Value(t, 5*time.Second, "the client's writes failing", func() (any, bool) {
		_, err := c.Write([]byte("more\n"))
		return err, err != nil
	})
	checkNotBlamed(t, s, rec, 5*time.Second)
}

// TestBackendResetAfterItsFIN: a backend that sends its whole answer, half-closes
// and then resets (an abortive close, which some servers make to leave no
// TIME_WAIT behind) has ended the connection: once its answer is the client's,
// the proxy closes, and the client, which has everything, meets the reset only
// if it sends more. The proxy took no notice of the reset after the backend's
// FIN and held the connection until the client wrote or closed; with the kernel
// forwarding, a client that wrote had its bytes vanish and the connection never
// ended.
func TestBackendResetAfterItsFIN(t *testing.T) {
	answer := bytes.Repeat([]byte("a"), 256<<10)
	read := make(chan struct{})
	be := startBackend(t, "a", netip.AddrPort{}, func(_ string, c *net.TCPConn) {
		readLine(c)
		c.Write(answer)
		c.CloseWrite()
		<-read
		c.SetLinger(0)
		c.Close()
	})
	rec := &recorder{}
	s := startProxy(t, Config{Backends: []Backend{{Addr: be.addr()}}, Observer: rec, Logger: discardLogger()})
	c := dial(t, s)
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write([]byte("hi\n"))
	got, err := io.ReadAll(c)
	close(read)
	if err != nil || !bytes.Equal(got, answer) {
		t.Fatalf("answer: got %d bytes, %v; want %d bytes, then EOF", len(got), err, len(answer))
	}
	checkNotBlamed(t, s, rec, 5*time.Second)
}

// TestSlowClientGetsWholeAnswer: a backend that sends its whole answer and its
// FIN, and resets once the proxy has taken it all, has delivered a whole
// stream; a client slow to read it gets all of it, then the EOF. The proxy,
// which held part of the answer for the client when the reset came, took the
// reset for a broken stream, threw away what it held and reset the client:
// megabytes lost that the backend had sent, and the proxy acknowledged, whole.
//
// In a network namespace of its own, for its buffer sizes (inSlowReaderNetns).
func TestSlowClientGetsWholeAnswer(t *testing.T) {
	if !inSlowReaderNetns(t) {
		return
	}
	answer := bytes.Repeat([]byte("a"), 1<<20)
	client := make(chan *net.TCPConn, 1)
	be := startFinThenReset(t, nil, answer, func(t *testing.T, c *net.TCPConn) {
		// Once the proxy has filled the client's buffer (it holds the rest).
		cc, ok := <-client
		if ok && !waitfor.Cond(5*time.Second, func() bool { return recvQueue(cc) > 0 }) {
			t.Errorf("the client's buffer: no bytes after 5 s")
		}
		abortiveClose(t, c)
	})
	t.Cleanup(func() { close(client) }) // before the backend's stop, if the test ends early
	s, rec, c := askSlowly(t, be)
	client <- c
	<-be.reset
	readWhole(t, c, answer)
	checkNotBlamed(t, s, rec, 5*time.Second)
}

// TestBackendResetAfterBothFINs: a backend that sends its whole answer and its
// FIN, and resets after the client has half-closed too (a server that closes
// with the client's upload unread: the proxy has passed the client's FIN on,
// but it waits behind the upload for the backend's closed window), has
// delivered a whole stream; a client slow to read it gets all of it, then the
// EOF, and the backend is not blamed. Its reset found the proxy's socket in
// LAST_ACK, not CLOSE_WAIT, where the kernel reports ECONNRESET, not EPIPE,
// and the proxy, holding part of the answer for the client, took it for a
// broken stream: it reset the client (4 to 14 KiB read of 1 MiB) and counted a
// reset against the backend. The kernel keeps what the backend's socket
// received, and a read returns it, and then the EOF, before the error.
//
// In a network namespace of its own, for its buffer sizes (inSlowReaderNetns).
func TestBackendResetAfterBothFINs(t *testing.T) {
	if !inSlowReaderNetns(t) {
		return
	}
	// The backend reads nothing after its request, and its receive buffer
	// is small: the client's upload closes its window.
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var err error
		rc.Control(func(fd uintptr) { err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4096) })
		return err
	}}
	ln, err := lc.Listen(context.Background(), "tcp", loopback0.String())
	if err != nil {
		t.Fatal(err)
	}
	backend := ln.Addr().(*net.TCPAddr).AddrPort()
	answer := bytes.Repeat([]byte("a"), 1<<20)
	be := startFinThenReset(t, ln, answer, func(t *testing.T, c *net.TCPConn) {
		// Once the proxy has passed the client's FIN on.
		if !waitfor.Cond(10*time.Second, func() bool { st, _ := socketTo(backend); return st == tcpLastAck }) {
			st, q := socketTo(backend)
			t.Errorf("the proxy's socket to the backend: state %d, %d bytes queued; want LAST_ACK (%d)", st, q, tcpLastAck)
		}
		c.Close() // with the upload unread: a reset
	})
	s, rec, c := askSlowly(t, be)
	// The upload, until 1 KiB of it stays in the proxy's send queue: the
	// backend's window is closed.
	chunk := bytes.Repeat([]byte("u"), 512)
	closed := false
	for range 256 {
		if _, err := c.Write(chunk); err != nil {
			t.Fatal(err)
		}
		if closed = waitfor.Cond(100*time.Millisecond, func() bool { _, q := socketTo(backend); return q >= 1024 }); closed {
			break
		}
	}
	if !closed {
		t.Fatal("the backend's window did not close")
	}
	c.CloseWrite()
	<-be.reset
	readWhole(t, c, answer)
	checkNotBlamed(t, s, rec, 5*time.Second)
}

// tcpLastAck is TCP_LAST_ACK, a socket's state in /proc/net/tcp.
const tcpLastAck = 9

// socketTo finds the one IPv4 socket of this network namespace connected to
// remote in /proc/net/tcp, and returns its state and the bytes in its send
// queue not yet acknowledged; 0 and 0 if there is none.
func socketTo(remote netip.AddrPort) (state, sendQueue int) {
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return 0, 0
	}
	a := remote.Addr().As4()
	want := fmt.Sprintf("%08X:%04X", binary.LittleEndian.Uint32(a[:]), remote.Port())
	for _, line := range strings.Split(string(data), "\n")[1:] {
		// sl local_address rem_address st tx_queue:rx_queue ...
		f := strings.Fields(line)
		if len(f) < 5 || f[2] != want {
			continue
		}
		st, _ := strconv.ParseInt(f[3], 16, 32)
		q, _, _ := strings.Cut(f[4], ":")
		n, _ := strconv.ParseInt(q, 16, 64)
		return int(st), int(n)
	}
	return 0, 0
}

// TestSlowClientTalksOnAfterBackendReset: a client slow to read that goes on
// sending after its backend has sent its whole answer, its FIN and then a
// reset (an abortive close, or a close with the client's later bytes unread)
// still gets the whole answer, then the EOF; its later bytes, which have
// nowhere to go, are read and dropped, and the backend, whose stream was
// whole, is not blamed. The proxy's write of the client's bytes to the dead
// backend failed (EPIPE), and the proxy took that for the backend breaking the
// connection: it reset the client, throwing away the answer it held, and
// counted a reset against the backend; the client read 4096 bytes of 1048576,
// then EOF (its write had taken the reset's error). With the whole answer in
// the client's socket, the proxy closed at once, and the client's next bytes
// met the closed socket, whose reset threw away the answer's unacknowledged
// rest: 4096 bytes of 8192, then EOF.
//
// In a network namespace of its own, for its buffer sizes (inSlowReaderNetns).
func TestSlowClientTalksOnAfterBackendReset(t *testing.T) {
	for _, tc := range []struct {
		name string
		size int // of the answer
		// end ends the backend's connection once its answer and FIN are
		// acknowledged, and the client has talked on.
		end func(t *testing.T, c *net.TCPConn)
	}{
		{"abortive close", 1 << 20, abortiveClose},
		{"close with bytes unread", 1 << 20, func(t *testing.T, c *net.TCPConn) {
			if !waitfor.Cond(5*time.Second, func() bool { return recvQueue(c) > 0 }) {
				t.Errorf("the backend: the client's later bytes did not come")
			}
			c.Close() // the host answers the unread bytes with a reset
		}},
		// All of it in the client's socket (its receive buffer and the
		// proxy's send queue) when the client talks on: the proxy holds none.
		{"answer in the sockets", 8 << 10, abortiveClose},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !inSlowReaderNetns(t) {
				return
			}
			answer := bytes.Repeat([]byte("a"), tc.size)
			be := startFinThenReset(t, nil, answer, tc.end)
			s, rec, c := askSlowly(t, be)
			// The client talks on, not yet reading: before the backend's
			// reset (which the second case waits for), and after it.
			c.Write([]byte("more\n"))
			<-be.reset
			time.Sleep(100 * time.Millisecond)
			c.Write([]byte("more\n"))
			time.Sleep(100 * time.Millisecond)
			// It reads the answer, talking on between reads (what the proxy
			// has not yet sent, and the client not yet acknowledged, would
			// be lost if these bytes met a closed socket).
			readWholeBy4K(t, c, answer, func() {
				c.Write([]byte("more\n")) // fails once the proxy has closed, the answer the client's
			})
			checkNotBlamed(t, s, rec, 5*time.Second)
		})
	}
}

// sendQueue is the bytes c has sent and its peer has not acknowledged (SIOCOUTQ).
func sendQueue(c *net.TCPConn) int { return ioctlInt(c, unix.SIOCOUTQ) }

// recvQueue is the bytes c has received and not read (SIOCINQ).
func recvQueue(c *net.TCPConn) int { return ioctlInt(c, unix.SIOCINQ) }

func ioctlInt(c *net.TCPConn, req uint) int {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1
	}
	n := -1
	rc.Control(func(fd uintptr) {
		if v, err := unix.IoctlGetInt(int(fd), req); err == nil {
			n = v
		}
	})
	return n
}

// TestCutStreamResetsItsReader: a connection the proxy closes while bytes for
// a peer that stopped reading are still on their way (held by the proxy, or on
// the in-kernel path by the kernel) sends that peer a reset, so it cannot take
// the bytes it got for the whole stream, as a FIN would have it: at the idle
// timeout and at a drain's deadline. On the in-kernel path the close sent a
// FIN: the client read 4 MiB, then EOF.
func TestCutStreamResetsItsReader(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		// cut makes the proxy close the connection, once its backend's
		// writes have stalled.
		cut func(t *testing.T, s *Service)
	}{
		{"idle timeout", Config{IdleTimeout: 300 * time.Millisecond}, func(t *testing.T, s *Service) {
			waitfor.Value(t, 10*time.Second, "the idle timeout", func() (any, bool) {
				n := s.Snapshot().Backends[0].IdleTimeouts
				return n, n == 1
			})
		}},
		{"drain deadline", Config{DrainTimeout: 300 * time.Millisecond}, func(t *testing.T, s *Service) {
			if err := s.SetDraining(s.Snapshot().Backends[0].Addr, true); err != nil {
				t.Fatal(err)
			}
			waitfor.Value(t, 10*time.Second, "the drain's deadline", active(s, 0))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var written atomic.Int64
			be := startBackend(t, "a", netip.AddrPort{}, func(_ string, c *net.TCPConn) {
				buf := make([]byte, 64<<10)
				for range 1024 { // at most 64 MiB: ends when the proxy closes
					n, err := c.Write(buf)
					written.Add(int64(n))
					if err != nil {
						return
					}
				}
			})
			cfg := tc.cfg
			cfg.Backends = []Backend{{Addr: be.addr()}}
			s := startProxy(t, cfg)
			c := dial(t, s)
			// Nothing read until the proxy has given up on the connection.
			waitfor.Value(t, 10*time.Second, "the backend's writes stalled", func() (any, bool) {
				n := written.Load()
				time.Sleep(100 * time.Millisecond)
				return fmt.Sprintf("%d bytes written", n), n > 0 && n == written.Load()
			})
			tc.cut(t, s)
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			n, err := io.Copy(io.Discard, c)
			if err == nil || !strings.Contains(err.Error(), "reset") {
				t.Fatalf("read %d bytes, then %v; want a reset", n, err)
			}
		})
	}
}

// TestLingerIsBounded: a lingering connection (its backend gone after a
// whole answer) whose client talks on and never reads closes at lingerMax,
// even with no idle timeout, and frees its slot and the backend's count;
// the outcome is the backend's whole stream, a success.
func TestLingerIsBounded(t *testing.T) {
	if !inSlowReaderNetns(t) {
		return
	}
	setLinger(t, 500*time.Millisecond, lingerLimit)
	be := startFinThenReset(t, nil, bytes.Repeat([]byte("a"), 8<<10), abortiveClose)
	s, rec, conn := askSlowly(t, be) // no IdleTimeout
	<-be.reset
	// The client talks on and never reads.
	for range 3 {
		time.Sleep(50 * time.Millisecond)
		conn.Write([]byte("more\n"))
	}
	checkNotBlamed(t, s, rec, 10*time.Second)
}

// TestLingerBoundsUnreadAnswer: a client that neither reads nor sends after
// its backend has sent its whole answer, its FIN and then a reset is closed at
// lingerMax, even with no idle timeout, and gets a reset, as the answer's rest
// is lost; the backend, whose stream was whole, is not blamed. The proxy (or,
// forwarding in the kernel, the kernel) held the answer's rest for the client,
// and the connection, its slot and the backend's count lasted until the idle
// timeout, or for good without one.
func TestLingerBoundsUnreadAnswer(t *testing.T) {
	if !inSlowReaderNetns(t) {
		return
	}
	setLinger(t, 500*time.Millisecond, lingerLimit)
	answer := bytes.Repeat([]byte("a"), 1<<20)
	be := startFinThenReset(t, nil, answer, abortiveClose)
	s, rec, c := askSlowly(t, be) // no IdleTimeout
	<-be.reset
	checkNotBlamed(t, s, rec, 10*time.Second)
	n, err := io.Copy(io.Discard, c)
	if err == nil || !strings.Contains(err.Error(), "reset") || n >= int64(len(answer)) {
		t.Errorf("the client read %d bytes of %d, then %v; want fewer, then a reset", n, len(answer), err)
	}
}

// TestLingerLetsSlowReaderFinish: a client that reads a whole answer from a
// backend gone after its FIN slowly, taking longer than lingerMax in all but
// never pausing that long, gets all of it, then the EOF: the bound is on a
// client that takes none of the answer, not on a slow one.
func TestLingerLetsSlowReaderFinish(t *testing.T) {
	if !inSlowReaderNetns(t) {
		return
	}
	setLinger(t, 2*time.Second, lingerLimit) // 20 of the client's reads
	answer := bytes.Repeat([]byte("a"), 192<<10)
	be := startFinThenReset(t, nil, answer, abortiveClose)
	s, rec, c := askSlowly(t, be) // no IdleTimeout
	<-be.reset
	// 4 KiB every 100 ms: about 5 s for the answer.
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	readWholeBy4K(t, c, answer, func() { time.Sleep(100 * time.Millisecond) }) // the client's pace
	checkNotBlamed(t, s, rec, 5*time.Second)
}

// setLinger sets lingerMax and lingerLimit for the rest of t, until after the
// proxies it started have stopped (t.Cleanup runs the last registered first).
func setLinger(t *testing.T, stretch, limit time.Duration) {
	t.Helper()
	m, l := lingerMax, lingerLimit
	t.Cleanup(func() { lingerMax, lingerLimit = m, l })
	lingerMax, lingerLimit = stretch, limit
}

// inSlowReaderNetns is inOwnNetns with the buffer sizes of the tests of a
// backend that resets after its FIN: send buffers of 16 KiB, so the proxy
// holds an answer's rest while its client does not read, and receive buffers
// of 4 MiB, so a whole answer and its FIN reach the proxy's host before the
// reset.
func inSlowReaderNetns(t *testing.T) bool {
	t.Helper()
	return inOwnNetns(t, map[string]string{
		"net.ipv4.tcp_wmem": "4096 16384 16384",
		"net.ipv4.tcp_rmem": "4096 4194304 4194304",
	})
}

// slowReaderDial dials addr with a receive buffer of 4 KiB: a client that
// reads slowly. The connection is closed when the test ends.
func slowReaderDial(t *testing.T, addr netip.AddrPort) *net.TCPConn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var err error
		rc.Control(func(fd uintptr) { err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4096) })
		return err
	}}
	conn, err := d.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn.(*net.TCPConn)
}

// finThenReset is a backend that, for its one client, reads a line, sends
// answer and its FIN, waits until the proxy's host has acknowledged them
// (acked closes), and then ends the connection with end, which resets it.
// reset closes when end has returned.
type finThenReset struct {
	*testBackend
	acked, reset chan struct{}
}

// startFinThenReset starts a finThenReset on ln, or on a listener of its own
// if ln is nil.
func startFinThenReset(t *testing.T, ln net.Listener, answer []byte, end func(t *testing.T, c *net.TCPConn)) *finThenReset {
	t.Helper()
	b := &finThenReset{acked: make(chan struct{}), reset: make(chan struct{})}
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", loopback0.String()); err != nil {
			t.Fatal(err)
		}
	}
	b.testBackend = serveBackend(t, "a", ln, func(_ string, c *net.TCPConn) {
		defer close(b.reset)
		readLine(c)
		c.Write(answer)
		c.CloseWrite()
		// (Cond, not Value: this is the backend's goroutine, not the test's.)
		if !waitfor.Cond(5*time.Second, func() bool { return sendQueue(c) == 0 }) {
			t.Errorf("the backend's answer: %d bytes unacknowledged after 5 s; want 0", sendQueue(c))
		}
		close(b.acked)
		end(t, c)
	})
	return b
}

// askSlowly starts a proxy to be (no idle timeout), with a recorder as its
// Observer, and has a slow reader (slowReaderDial, a deadline 10 s away) send
// be its request; it returns once be's answer and FIN are acknowledged.
func askSlowly(t *testing.T, be *finThenReset) (*Service, *recorder, *net.TCPConn) {
	t.Helper()
	rec := &recorder{}
	s := startProxy(t, Config{Backends: []Backend{{Addr: be.addr()}}, Observer: rec, Logger: discardLogger()})
	c := slowReaderDial(t, s.Addr())
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("hi\n")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-be.acked:
	case <-time.After(10 * time.Second):
		t.Fatal("the backend's answer: not acknowledged after 10 s")
	}
	return s, rec, c
}

// readWholeBy4K reads c to its end, 4 KiB a read, calling between after each
// read but the last, and checks that it got answer, then EOF.
func readWholeBy4K(t *testing.T, c io.Reader, answer []byte, between func()) {
	t.Helper()
	var got []byte
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			if err != io.EOF || !bytes.Equal(got, answer) {
				t.Errorf("answer: got %d bytes, then %v; want %d bytes, then EOF", len(got), err, len(answer))
			}
			return
		}
		between()
	}
}

// readWhole reads c to its end and checks that it got answer, then EOF.
func readWhole(t *testing.T, c io.Reader, answer []byte) {
	t.Helper()
	got, err := io.ReadAll(c)
	if err != nil || !bytes.Equal(got, answer) {
		t.Errorf("answer: got %d bytes, %v; want %d bytes, then EOF", len(got), err, len(answer))
	}
}

// abortiveClose closes c with a reset (SO_LINGER 0).
func abortiveClose(_ *testing.T, c *net.TCPConn) {
	c.SetLinger(0)
	c.Close()
}

// checkNotBlamed waits up to timeout for s to end its one connection, and
// checks that its one backend was not blamed for it: no connection left, no
// reset nor idle timeout counted, and a success the one outcome reported.
func checkNotBlamed(t *testing.T, s *Service, rec *recorder, timeout time.Duration) {
	t.Helper()
	waitfor.Value(t, timeout, "0 active connections", active(s, 0))
	b := s.Snapshot().Backends[0]
	if b.Active != 0 || b.Resets != 0 || b.IdleTimeouts != 0 {
		t.Errorf("backend: active %d, resets %d, idle timeouts %d; want 0, 0, 0", b.Active, b.Resets, b.IdleTimeouts)
	}
	if got, want := rec.list(), []string{b.Addr.String() + " success"}; !slices.Equal(got, want) {
		t.Errorf("outcomes: got %q; want %q", got, want)
	}
}

// TestLingerLetsSlowAcknowledgerFinish: a client that talks on and reads, at
// its own steady pace, a whole answer from a backend gone after its FIN gets
// all of it, then the EOF, also when the proxy's socket to it has a send
// buffer that the client takes longer than lingerMax to empty. The proxy saw
// the client take some of the answer only when it wrote more of it, and with
// the whole answer in its send queue never: it closed at lingerMax, and the
// client's next bytes met the closed socket, whose reset threw away the
// answer's unacknowledged rest: the client read 532,480 bytes of 3 MiB (its
// write took the reset's error, so its read found the end).
func TestLingerLetsSlowAcknowledgerFinish(t *testing.T) {
	// Send buffers of 4 MiB: the whole answer goes into the proxy's socket
	// to the client at once.
	if !inOwnNetns(t, map[string]string{
		"net.ipv4.tcp_wmem": "4096 4194304 4194304",
		"net.ipv4.tcp_rmem": "4096 4194304 4194304",
	}) {
		return
	}
	setLinger(t, 2*time.Second, lingerLimit)
	answer := bytes.Repeat([]byte("a"), 3<<20)
	be := startFinThenReset(t, nil, answer, abortiveClose)
	s, rec, c := askSlowly(t, be) // no IdleTimeout
	<-be.reset
	// 4 KiB every 5 ms at most: more than 3 s for the answer.
	c.SetDeadline(time.Now().Add(60 * time.Second))
	readWholeBy4K(t, c, answer, func() {
		c.Write([]byte("more\n")) // fails once the proxy has closed, the answer the client's
		time.Sleep(5 * time.Millisecond)
	})
	checkNotBlamed(t, s, rec, 5*time.Second)
}

// TestLingerLimitBoundsTricklingReader: a lingering connection whose client
// acknowledges a little of the answer often enough that no lingerMax passes
// without some, but would take far longer than lingerLimit for all of it,
// closes at lingerLimit, with a reset for the client, as the answer's rest is
// lost; the backend is not blamed. Each acknowledgement gave the client
// lingerMax more, with no end: one taking a few bytes a lingerMax held the
// connection, its slot and the backend's count for days.
//
// In a network namespace of its own, for its buffer sizes: the proxy's send
// buffer of 16 KiB (inSlowReaderNetns), so that it holds the answer's rest,
// or of 4 MiB, so that the whole answer is in its socket.
func TestLingerLimitBoundsTricklingReader(t *testing.T) {
	for _, tc := range []struct {
		name string
		wmem string
	}{
		{"rest held by the proxy", "4096 16384 16384"},
		{"all in the send buffer", "4096 4194304 4194304"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !inOwnNetns(t, map[string]string{
				"net.ipv4.tcp_wmem": tc.wmem,
				"net.ipv4.tcp_rmem": "4096 4194304 4194304",
			}) {
				return
			}
			setLinger(t, time.Second, 3*time.Second)
			answer := bytes.Repeat([]byte("a"), 1<<20)
			be := startFinThenReset(t, nil, answer, abortiveClose)
			s, rec, c := askSlowly(t, be) // no IdleTimeout
			<-be.reset
			// 4 KiB every 100 ms at most, talking on: 25 s or more for the
			// answer.
			c.SetDeadline(time.Now().Add(15 * time.Second))
			got, buf := 0, make([]byte, 4096)
			var err error
			for err == nil {
				var n int
				n, err = c.Read(buf)
				got += n
				c.Write([]byte("more\n")) // fails once the proxy has closed
				time.Sleep(100 * time.Millisecond)
			}
			if errors.Is(err, os.ErrDeadlineExceeded) || got >= len(answer) {
				t.Errorf("the client read %d bytes of %d, then %v; want fewer, then the connection closed", got, len(answer), err)
			}
			checkNotBlamed(t, s, rec, 5*time.Second)
		})
	}
}
