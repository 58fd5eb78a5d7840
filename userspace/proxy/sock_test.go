package proxy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

func noDelay(t *testing.T, fd int) int {
	t.Helper()
	v, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY)
	if err != nil {
		t.Fatalf("getsockopt TCP_NODELAY: %v", err)
	}
	return v
}

// acceptOne accepts from a non-blocking listener, waiting up to a second.
func acceptOne(t *testing.T, lfd int) (int, netip.AddrPort) {
	t.Helper()
	var fd int
	var src netip.AddrPort
	var err error
	if !waitfor.Cond(time.Second, func() bool {
		fd, src, err = accept4Raw(lfd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		return err != unix.EAGAIN
	}) || err != nil {
		t.Fatalf("accept4: %v", err)
	}
	return fd, src
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
	fd, src := acceptOne(t, s.lns[0].fd)
	defer unix.Close(fd)
	if want := c.LocalAddr().(*net.TCPAddr).AddrPort(); src != want {
		t.Errorf("peer: got %v; want %v", src, want)
	}
	if v := noDelay(t, fd); v == 0 {
		t.Errorf("accepted socket TCP_NODELAY: got %d; want set (inherited)", v)
	}
	if la, err := getsocknameRaw(fd); err != nil || la != s.Addr() {
		t.Errorf("local address: got %v, %v; want %v", la, err, s.Addr())
	}
}

// Every listener of a service shares the port, also when it was 0.
func TestListenersShareThePort(t *testing.T) {
	s, err := Listen(context.Background(), Config{Name: "ports", Listen: loopback0, AcceptLoops: 3,
		Backends: []Backend{{Addr: netip.MustParseAddrPort("127.0.0.1:1")}}, Logger: discardLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i, ln := range s.lns {
		if ap, err := getsocknameRaw(ln.fd); err != nil || ap != s.Addr() {
			t.Errorf("listener %d: got %v, %v; want %v", i, ap, err, s.Addr())
		}
	}
}

func TestStartDial(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	sa := sockaddrOf(ln.Addr().(*net.TCPAddr).AddrPort())
	fd, err := startDial(&sa, false)
	if err != nil {
		t.Fatalf("dial listener: %v", err)
	}
	defer unix.Close(fd)
	peer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	if v := noDelay(t, fd); v == 0 {
		t.Errorf("dialed socket TCP_NODELAY: got %d; want set", v)
	}
	if !waitfor.Cond(time.Second, func() bool { _, err := writeRaw(fd, []byte("hi")); return err == nil }) {
		t.Fatal("write to the dialed socket never succeeded")
	}
	buf := make([]byte, 2)
	peer.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := peer.Read(buf); err != nil || string(buf) != "hi" {
		t.Errorf("peer read: got %q, %v; want hi", buf, err)
	}

	// A refused connect shows as SO_ERROR once it has failed.
	dead := sockaddrOf(closedPort(t))
	fd2, err := startDial(&dead, false)
	if err != nil {
		if !errors.Is(err, unix.ECONNREFUSED) {
			t.Fatalf("dial closed port: got %v; want ECONNREFUSED", err)
		}
		return
	}
	defer unix.Close(fd2)
	var soErr int
	waitfor.Cond(time.Second, func() bool {
		soErr, _ = unix.GetsockoptInt(fd2, unix.SOL_SOCKET, unix.SO_ERROR)
		return soErr != 0
	})
	if unix.Errno(soErr) != unix.ECONNREFUSED {
		t.Errorf("dial closed port: SO_ERROR %v; want ECONNREFUSED", unix.Errno(soErr))
	}
}
