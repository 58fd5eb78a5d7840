package httplb

import (
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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
