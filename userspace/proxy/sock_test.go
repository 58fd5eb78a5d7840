package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
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
	fd, err := startDial(&sa, false, &tcpOpts{})
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
	fd2, err := startDial(&dead, false, &tcpOpts{})
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

// TestKernelCountsFINOfClosedSource: at a sockmap connection's close, a source
// whose peer's FIN is in holds nothing for that FIN, also when the source is
// closed (TCP_CLOSE: the proxy had sent its own FIN first, so the peer's FIN
// took it through TIME_WAIT). The count took the FIN, which
// tcpi_bytes_received counts, for a byte the kernel still held only in
// CLOSE_WAIT, LAST_ACK and CLOSING, so a close in the few milliseconds before
// the loop saw that EOF (an idle timeout, a drain's deadline) reset the other
// peer where a FIN was due. A byte the source received and nobody took is
// still held.
func TestKernelCountsFINOfClosedSource(t *testing.T) {
	for _, tc := range []struct {
		name  string
		bytes string // the backend sends these, then its FIN
		holds bool
	}{
		{"FIN only", "", false},
		{"a byte and the FIN", "x", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The proxy's socket to the backend (the source) and the
			// backend's; the proxy's socket to the client (the destination).
			src, be := tcpPair(t)
			_, dst := tcpPair(t)
			srcFD, dstFD := sysFD(t, src), sysFD(t, dst)
			if tc.bytes != "" {
				if _, err := be.Write([]byte(tc.bytes)); err != nil {
					t.Fatal(err)
				}
			}
			src.CloseWrite()
			be.Close()
			waitfor.Value(t, 5*time.Second, "the source closed", func() (any, bool) {
				ti, err := tcpInfoRaw(srcFD)
				return fmt.Sprintf("state %d, %v", ti.State, err), err == nil && ti.State == unix.BPF_TCP_CLOSE
			})
			c := &conn{fd: [2]int{dstFD, srcFD}}
			if _, holds := (&loop{}).kernelHolds(c, down); holds != tc.holds {
				t.Errorf("the kernel holds bytes: %v; want %v", holds, tc.holds)
			}
		})
	}
}

// tcpPair returns both ends of a loopback TCP connection: the dialer's and the
// accepted one. Both are closed when the test ends.
func tcpPair(t *testing.T) (dialed, accepted *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", loopback0.String())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	a, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return d.(*net.TCPConn), a.(*net.TCPConn)
}

// sysFD is c's own descriptor (not a dup), valid while c is open.
func sysFD(t *testing.T, c *net.TCPConn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	rc.Control(func(f uintptr) { fd = int(f) })
	return fd
}

// TestChildInheritsNoDescriptor: a process started while connections are open
// holds none of the proxy's descriptors (sockets, pipes, epoll sets,
// eventfds): every one is opened close-on-exec, in the call that makes it. A
// child's copy of a socket would keep its connection open after the proxy
// closed it, with no FIN and no reset for the peer until the child exits.
func TestChildInheritsNoDescriptor(t *testing.T) {
	// What this process inherited itself passes on too: not the proxy's.
	before := fdTargets(t, "/proc/self/fd")
	be := startBackend(t, "a", netip.AddrPort{}, hello)
	s := startProxy(t, Config{Backends: []Backend{{Addr: be.addr()}}})
	c := dial(t, s)
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if line, err := readLine(c); err != nil || line != "a" {
		t.Fatalf("greeting: got %q, %v; want \"a\"", line, err)
	}
	// Bulk, so that on the copy path the loop has taken pipes too.
	if err := roundTrip(c, strings.Repeat("x", 1<<20)); err != nil {
		t.Fatalf("echo: %v", err)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	// Start returns once the child has run exec, so its descriptors are those
	// it kept. Only kinds the proxy opens are looked at: the dynamic loader
	// may hold a file of its own for a moment.
	var held []string
	for n, target := range fdTargets(t, fmt.Sprintf("/proc/%d/fd", cmd.Process.Pid)) {
		if n <= 2 || before[n] == target {
			continue
		}
		for _, kind := range []string{"socket:", "pipe:", "anon_inode:"} {
			if strings.HasPrefix(target, kind) {
				held = append(held, fmt.Sprintf("%d -> %s", n, target))
			}
		}
	}
	if len(held) > 0 {
		t.Errorf("descriptors the child inherited: %q; want none", held)
	}
}

// fdTargets reads a /proc/PID/fd directory: what each descriptor refers to.
func fdTargets(t *testing.T, dir string) map[int]string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	targets := make(map[int]string, len(ents))
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if target, err := os.Readlink(dir + "/" + e.Name()); err == nil { // else closed meanwhile
			targets[n] = target
		}
	}
	return targets
}
