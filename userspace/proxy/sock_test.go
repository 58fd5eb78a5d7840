package proxy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func noDelay(t *testing.T, s *sock) int {
	t.Helper()
	var v int
	var serr error
	if err := s.rc.Control(func(fd uintptr) { v, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY) }); err != nil || serr != nil {
		t.Fatalf("getsockopt TCP_NODELAY: %v %v", err, serr)
	}
	return v
}

// The accepted socket comes from accept4 with the peer's address and inherits
// TCP_NODELAY from the listener (no setsockopt per connection).
func TestAcceptReturnsPeerAndInheritsNoDelay(t *testing.T) {
	s, err := Listen(context.Background(), Config{Name: "accept", Listen: loopback0, AcceptLoops: 1,
		Backends: []Backend{{Addr: netip.MustParseAddrPort("127.0.0.1:1")}}, Logger: discardLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fd, src, err := accept(s.lns[0].rc)
	if err != nil {
		t.Fatal(err)
	}
	a, err := newSock(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer a.close()
	if want := c.LocalAddr().(*net.TCPAddr).AddrPort(); src != want {
		t.Errorf("peer: got %v; want %v", src, want)
	}
	if v := noDelay(t, a); v == 0 {
		t.Errorf("accepted socket TCP_NODELAY: got %d; want set (inherited)", v)
	}
	if la, err := a.localAddr(); err != nil || la != s.Addr() {
		t.Errorf("local address: got %v, %v; want %v", la, err, s.Addr())
	}
}

func TestDialBackend(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	s, err := dialBackend(ap, time.Second)
	if err != nil {
		t.Fatalf("dial listener: %v", err)
	}
	peer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	if v := noDelay(t, s); v == 0 {
		t.Errorf("dialed socket TCP_NODELAY: got %d; want set", v)
	}
	if err := s.write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2)
	peer.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := peer.Read(buf); err != nil || string(buf) != "hi" {
		t.Errorf("peer read: got %q, %v; want hi", buf, err)
	}
	s.close()

	dead := closedPort(t)
	if _, err := dialBackend(dead, time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("dial closed port: got %v; want ECONNREFUSED", err)
	}

	hole := blackhole(t)
	start := time.Now()
	_, err = dialBackend(hole, 100*time.Millisecond)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("dial black hole: got %v; want a timeout", err)
	}
	if d := time.Since(start); d < 90*time.Millisecond || d > time.Second {
		t.Errorf("dial black hole returned after %v; want about 100ms", d)
	}
}
