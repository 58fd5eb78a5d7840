package loader

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// socketPair is a connection the way the proxy holds it: a client connected to a
// front listener (accepted as c) and a backend (accepted as b) dialled as s.
type socketPair struct {
	client, c, s, b net.Conn
	cfd, sfd        int
}

func newSocketPair(t *testing.T) *socketPair {
	t.Helper()
	front, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()
	back, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	p := &socketPair{}
	var errs [4]error
	p.client, errs[0] = net.Dial("tcp", front.Addr().String())
	p.c, errs[1] = front.Accept()
	p.s, errs[2] = net.Dial("tcp", back.Addr().String())
	p.b, errs[3] = back.Accept()
	if err := errors.Join(errs[:]...); err != nil {
		t.Fatal(err)
	}
	for _, c := range []net.Conn{p.client, p.c, p.s, p.b} {
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(5 * time.Second))
	}
	p.cfd, p.sfd = sysFD(t, p.c), sysFD(t, p.s)
	return p
}

// sysFD is the descriptor of c itself (not a dup), valid while c is open.
func sysFD(t *testing.T, c net.Conn) int {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	rc.Control(func(f uintptr) { fd = int(f) })
	return fd
}

func TestSockMapForwardsBothWays(t *testing.T) {
	m, err := LoadSockMap()
	if err != nil {
		t.Fatalf("load sockmap: %v", err)
	}
	defer m.Close()
	p := newSocketPair(t)
	if err := m.Pair(p.cfd, p.sfd); err != nil {
		t.Fatalf("pair: %v", err)
	}
	for _, tc := range []struct {
		name     string
		from, to net.Conn
		fd       int // the paired socket the bytes reach
		msg      string
	}{
		{"client to backend", p.client, p.b, p.cfd, "request"},
		{"backend to client", p.b, p.client, p.sfd, "response"},
	} {
		sent := monotonicNow(t)
		if _, err := tc.from.Write([]byte(tc.msg)); err != nil {
			t.Fatalf("%s: write: %v", tc.name, err)
		}
		got := make([]byte, len(tc.msg))
		if _, err := io.ReadFull(tc.to, got); err != nil || string(got) != tc.msg {
			t.Fatalf("%s: got %q, %v; want %q", tc.name, got, err, tc.msg)
		}
		// A second message: the first one's time stays.
		tc.from.Write([]byte(tc.msg))
		io.ReadFull(tc.to, got)
		received := monotonicNow(t)
		first, err := m.Forget(tc.fd)
		if err != nil || first < sent || first > received {
			t.Errorf("%s: first bytes at %d, %v; want between the write (%d) and the read (%d)", tc.name, first, err, sent, received)
		}
		if first, err := m.Forget(tc.fd); first != 0 || err != nil {
			t.Errorf("%s: forgotten socket: got %d, %v; want 0, nil", tc.name, first, err)
		}
	}
	if err := m.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Fatalf("second close: got %v; want nil", err)
	}
	if err := m.Pair(p.cfd, p.sfd); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("pair after close: got %v; want net.ErrClosed", err)
	}
}

// monotonicNow is CLOCK_MONOTONIC in ns, the clock of Forget's times.
func monotonicNow(t *testing.T) int64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return ts.Nano()
}

// TestSockMapRefusesClosingSocket: the kernel pairs only established sockets. A
// backend that has already closed is refused, the client's socket leaves the map
// again (it reads as a plain socket), and no byte is lost.
func TestSockMapRefusesClosingSocket(t *testing.T) {
	m, err := LoadSockMap()
	if err != nil {
		t.Fatalf("load sockmap: %v", err)
	}
	defer m.Close()
	p := newSocketPair(t)
	p.b.Close()
	// The backend's FIN makes the proxy's socket readable (EOF).
	if n, err := p.s.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("backend socket: got %d, %v; want EOF", n, err)
	}
	err = m.Pair(p.cfd, p.sfd)
	var pe *PairError
	if !errors.As(err, &pe) || pe.Lost() {
		t.Fatalf("pair with a closed backend: got %v; want a PairError, nothing lost", err)
	}
	if _, err := p.client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1)
	if _, err := io.ReadFull(p.c, got); err != nil || string(got) != "x" {
		t.Fatalf("client socket after a refused pair: got %q, %v; want \"x\"", got, err)
	}
}
