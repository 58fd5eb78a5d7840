package proxy

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// This file accepts and dials with raw non-blocking sockets and drives them through the
// runtime poller (os.NewFile registers a non-blocking descriptor with it), instead of
// net.TCPListener.Accept and net.Dialer. Per connection that saves what the net package
// does for every socket and the proxy never uses: getsockname on both sockets,
// getpeername on the accepted one (accept4 returns the peer), a TCP_NODELAY setsockopt
// on the accepted one (it inherits TCP_NODELAY from the listener, which sets it once),
// and the dialer's context, resolver and address plumbing.

// sock is a non-blocking TCP socket registered with the runtime poller.
type sock struct {
	f  *os.File
	rc syscall.RawConn
}

// newSock takes ownership of fd, a non-blocking socket; on an error fd is closed.
func newSock(fd int) (*sock, error) {
	f := os.NewFile(uintptr(fd), "")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &sock{f: f, rc: rc}, nil
}

// close closes the socket, waking any goroutine waiting on it. Safe to call twice.
func (s *sock) close() { s.f.Close() }

// closeWrite shuts down the sending half (a FIN to the peer).
func (s *sock) closeWrite() error {
	var serr error
	if err := s.rc.Control(func(fd uintptr) { serr = shutdownRaw(int(fd), unix.SHUT_WR) }); err != nil {
		return net.ErrClosed
	}
	if serr != nil && serr != unix.ENOTCONN {
		return serr
	}
	return nil
}

// setLinger0 makes the close send a reset instead of a FIN.
func (s *sock) setLinger0() {
	s.rc.Control(func(fd uintptr) {
		unix.SetsockoptLinger(int(fd), unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	})
}

// write writes all of b, waiting for the socket to be writable as needed.
func (s *sock) write(b []byte) error {
	for len(b) > 0 {
		var n int
		var werr error
		if err := s.rc.Write(func(fd uintptr) bool {
			for {
				n, werr = writeRaw(int(fd), b)
				if werr != unix.EINTR {
					break
				}
			}
			return werr != unix.EAGAIN
		}); err != nil {
			return net.ErrClosed
		}
		if werr != nil {
			return werr
		}
		b = b[n:]
	}
	return nil
}

// localAddr is the address the peer connected to (getsockname).
func (s *sock) localAddr() (netip.AddrPort, error) {
	var ap netip.AddrPort
	var serr error
	if err := s.rc.Control(func(fd uintptr) { ap, serr = getsocknameRaw(int(fd)) }); err != nil {
		return netip.AddrPort{}, net.ErrClosed
	}
	if serr != nil {
		return netip.AddrPort{}, fmt.Errorf("getsockname: %w", serr)
	}
	return ap, nil
}

// accept takes one connection from a listener, waiting in the poller while there is
// none. The new socket is non-blocking and close-on-exec.
func accept(ln syscall.RawConn) (int, netip.AddrPort, error) {
	var (
		nfd  int
		src  netip.AddrPort
		aerr error
	)
	err := ln.Read(func(fd uintptr) bool {
		for {
			nfd, src, aerr = accept4Raw(int(fd), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
			if aerr != syscall.EINTR && aerr != syscall.ECONNABORTED {
				break
			}
		}
		return aerr != syscall.EAGAIN
	})
	if err != nil {
		return -1, netip.AddrPort{}, net.ErrClosed // the only poller error: closed
	}
	if aerr != nil {
		return -1, netip.AddrPort{}, fmt.Errorf("accept4: %w", aerr)
	}
	return nfd, src, nil
}

// dialBackend connects a new non-blocking socket to ap within timeout. A timeout is
// reported as an error satisfying net.Error with Timeout() true.
//
// The socket is registered with the poller before connect(2), which then runs inside
// RawConn.Write's callback: the first call starts the connect (EINPROGRESS: wait for
// writability), later calls ask again (EALREADY: still waiting; EISCONN: connected; any
// other error: failed). Reading SO_ERROR instead would be racy here: RawConn.Write
// forgets readiness seen before it started, and SO_ERROR is 0 while still connecting.
func dialBackend(ap netip.AddrPort, timeout time.Duration) (*sock, error) {
	sa := sockaddrOf(ap)
	fd, err := unix.Socket(sa.family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socket: %w", err)
	}
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("set TCP_NODELAY: %w", err)
	}
	s, err := newSock(fd)
	if err != nil {
		return nil, err
	}
	s.f.SetWriteDeadline(time.Now().Add(timeout))
	var cerr error
	err = s.rc.Write(func(fd uintptr) bool {
		for {
			cerr = connectRaw(int(fd), &sa)
			if cerr != unix.EINTR {
				break
			}
		}
		switch cerr {
		case unix.EINPROGRESS, unix.EALREADY:
			return false
		case unix.EISCONN:
			cerr = nil
		}
		return true
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		s.close()
		return nil, fmt.Errorf("connect: %w", err) // os.ErrDeadlineExceeded is a net.Error
	}
	s.f.SetWriteDeadline(time.Time{})
	return s, nil
}

func sockaddrOf(ap netip.AddrPort) rawSockaddr {
	var zoneID uint32
	if z := ap.Addr().Zone(); z != "" {
		if ifi, err := net.InterfaceByName(z); err == nil {
			zoneID = uint32(ifi.Index)
		}
	}
	return newRawSockaddr(ap, zoneID)
}
