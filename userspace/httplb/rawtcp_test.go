//go:build linux && !race

package httplb

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// rawPair is a loopback TCP connection: the raw end (as the HTTP/1.1 path wraps
// its sockets) and the plain peer.
func rawPair(t *testing.T) (*rawTCP, *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type accepted struct {
		c   *net.TCPConn
		err error
	}
	ch := make(chan accepted, 1)
	go func() {
		c, err := ln.AcceptTCP()
		ch <- accepted{c, err}
	}()
	c, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	a := <-ch
	if a.err != nil {
		t.Fatal(a.err)
	}
	t.Cleanup(func() { c.Close(); a.c.Close() })
	r, ok := rawConnOf(c).(*rawTCP)
	if !ok {
		t.Fatal("rawConnOf did not wrap a *net.TCPConn")
	}
	return r, a.c
}

// TestRawTCPMovesBytes: reads and writes of every size, including raw writes
// that fill the socket (the send waits in the poller and goes on) and writes over
// rawWriteMax (net.Conn's path), arrive whole and in order.
func TestRawTCPMovesBytes(t *testing.T) {
	for _, size := range []int{1, 100, 4 << 10, rawWriteMax, rawWriteMax + 1, 1 << 20} {
		r, peer := rawPair(t)
		// A small send buffer, so the raw writes find the socket full many
		// times over.
		r.SetWriteBuffer(4 << 10)
		msg := make([]byte, size)
		for i := range msg {
			msg[i] = byte(i * 7)
		}
		got := make(chan []byte, 1)
		go func() {
			b := make([]byte, size)
			io.ReadFull(peer, b)
			got <- bytes.Clone(b)
			peer.Write(b) // back, for the raw end's reads
		}()
		if n, err := r.Write(msg); n != size || err != nil {
			t.Fatalf("%d bytes: Write = %d, %v", size, n, err)
		}
		if b := <-got; !bytes.Equal(b, msg) {
			t.Fatalf("%d bytes: the peer read other bytes", size)
		}
		back := make([]byte, size)
		if _, err := io.ReadFull(r, back); err != nil || !bytes.Equal(back, msg) {
			t.Fatalf("%d bytes: read back: %v", size, err)
		}
	}
}

// fillSocket writes until a write fails, which it returns; the peer reads
// nothing, so the socket fills and the last write waits in the poller. Bounded:
// 256 MiB, far more than a socket holds.
func fillSocket(r *rawTCP) error {
	b := make([]byte, rawWriteMax)
	for range 1 << 12 {
		if _, err := r.Write(b); err != nil {
			return err
		}
	}
	return nil
}

// TestRawTCPErrors: the raw end reports what net.Conn's methods report, so the
// HTTP/1.1 path's checks of them hold: EOF, a deadline's timeout, a reset peer,
// and its own close.
func TestRawTCPErrors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(r *rawTCP, peer *net.TCPConn)
		op    func(r *rawTCP) error
		check func(err error) bool
	}{
		{"peer closed: EOF",
			func(r *rawTCP, peer *net.TCPConn) { peer.Close() },
			func(r *rawTCP) error { _, err := r.Read(make([]byte, 10)); return err },
			func(err error) bool { return err == io.EOF }},
		{"read deadline: a timeout",
			func(r *rawTCP, peer *net.TCPConn) { r.SetReadDeadline(time.Now().Add(20 * time.Millisecond)) },
			func(r *rawTCP) error { _, err := r.Read(make([]byte, 10)); return err },
			func(err error) bool {
				var ne net.Error
				return errors.Is(err, os.ErrDeadlineExceeded) && errors.As(err, &ne) && ne.Timeout()
			}},
		{"write deadline on a full socket: a timeout",
			func(r *rawTCP, peer *net.TCPConn) { r.SetWriteDeadline(time.Now().Add(50 * time.Millisecond)) },
			fillSocket,
			func(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }},
		{"peer reset: the write fails",
			func(r *rawTCP, peer *net.TCPConn) {
				peer.SetLinger(0)
				peer.Close()
				time.Sleep(20 * time.Millisecond) // the reset is on loopback
			},
			func(r *rawTCP) error {
				for range 10 {
					if _, err := r.Write([]byte("x")); err != nil {
						return err
					}
				}
				return nil
			},
			func(err error) bool {
				var oe *net.OpError
				return errors.As(err, &oe) && oe.Op == "write"
			}},
		{"closed while a read waits: net.ErrClosed",
			func(r *rawTCP, peer *net.TCPConn) { time.AfterFunc(20*time.Millisecond, func() { r.Close() }) },
			func(r *rawTCP) error { _, err := r.Read(make([]byte, 10)); return err },
			func(err error) bool { return errors.Is(err, net.ErrClosed) }},
		{"closed while a write waits on a full socket: net.ErrClosed",
			func(r *rawTCP, peer *net.TCPConn) { time.AfterFunc(50*time.Millisecond, func() { r.Close() }) },
			fillSocket,
			func(err error) bool { return errors.Is(err, net.ErrClosed) }},
		{"closed here: net.ErrClosed",
			func(r *rawTCP, peer *net.TCPConn) { r.Close() },
			func(r *rawTCP) error { _, err := r.Read(make([]byte, 10)); return err },
			func(err error) bool { return errors.Is(err, net.ErrClosed) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, peer := rawPair(t)
			tc.setup(r, peer)
			if err := tc.op(r); !tc.check(err) {
				t.Errorf("got %v (%T)", err, err)
			}
		})
	}
}

// TestRawTCPReadWhileWriting: a read waits in the poller while writes go out
// on the same connection, and each sees its own bytes.
func TestRawTCPReadWhileWriting(t *testing.T) {
	r, peer := rawPair(t)
	read := make(chan error, 1)
	go func() {
		b := make([]byte, 5)
		_, err := io.ReadFull(r, b)
		if err == nil && string(b) != "reply" {
			err = errors.New("read " + string(b))
		}
		read <- err
	}()
	for range 100 {
		if _, err := r.Write([]byte("ping\n")); err != nil {
			t.Fatal(err)
		}
	}
	got := make([]byte, 500)
	if _, err := io.ReadFull(peer, got); err != nil || !bytes.Equal(got, bytes.Repeat([]byte("ping\n"), 100)) {
		t.Fatalf("peer read %q, %v", got, err)
	}
	peer.Write([]byte("reply"))
	readDone(t, read)
}

// readDone waits up to 5 s for a read's result on done, and fails on an error.
func readDone(t *testing.T, done <-chan error) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a read never returned")
	}
}

// TestRawTCPConcurrentReaders: two reads at once (net.Conn allows it) both
// complete; the second takes net.Conn's own path.
func TestRawTCPConcurrentReaders(t *testing.T) {
	r, peer := rawPair(t)
	done := make(chan error, 2)
	for range 2 {
		go func() {
			b := make([]byte, 1)
			_, err := r.Read(b)
			done <- err
		}()
	}
	time.Sleep(20 * time.Millisecond) // both parked, as far as a test can tell
	peer.Write([]byte("ab"))
	for range 2 {
		readDone(t, done)
	}
}
