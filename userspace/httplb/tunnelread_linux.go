package httplb

import (
	"io"
	"net"
	"os"
	"syscall"
)

// tunnelReader reads one direction of a tunnel into copy buffers taken from
// bufPool only while bytes are there: a direction waiting for its next
// message holds no buffer. Most tunnels (WebSockets) are idle most of the
// time, and two 32 KiB buffers held through every wait were most of what an
// idle tunnel cost (TestIdleTunnelMemory).
//
// The wait is the runtime poller's, through the socket's RawConn: the read
// is tried first, and when it finds nothing the buffer goes back to the pool
// before the goroutine parks. A connection that is not a socket (TLS) is read
// with its own Read into a buffer held throughout, as before.
type tunnelReader struct {
	src   net.Conn
	rc    syscall.RawConn // nil: src.Read
	call  func(fd uintptr) bool
	bp    *[]byte // the buffer in hand, nil while none is
	n     int
	errno syscall.Errno
}

func newTunnelReader(src net.Conn) *tunnelReader {
	r := &tunnelReader{src: src}
	switch c := src.(type) {
	case interface{ tunnelRawConn() syscall.RawConn }:
		r.rc = c.tunnelRawConn()
	case syscall.Conn:
		r.rc, _ = c.SyscallConn()
	}
	if r.rc != nil {
		r.call = r.readOnce
	}
	return r
}

// read returns the next bytes from src, in a pooled buffer that stays the
// reader's until release; io.EOF at src's end.
func (r *tunnelReader) read() ([]byte, error) {
	if r.rc == nil {
		if r.bp == nil {
			r.bp = bufPool.Get().(*[]byte)
		}
		n, err := r.src.Read(*r.bp)
		return (*r.bp)[:n], err
	}
	r.n, r.errno = 0, 0
	if err := r.rc.Read(r.call); err != nil {
		r.release()
		if oe, ok := err.(*net.OpError); ok { // the raw connection's own ("raw-read")
			err = oe.Err
		}
		return nil, &net.OpError{Op: "read", Net: "tcp", Source: r.src.LocalAddr(), Addr: r.src.RemoteAddr(), Err: err}
	}
	switch {
	case r.errno != 0:
		r.release()
		return nil, &net.OpError{Op: "read", Net: "tcp", Source: r.src.LocalAddr(), Addr: r.src.RemoteAddr(), Err: os.NewSyscallError("read", r.errno)}
	case r.n == 0:
		r.release()
		return nil, io.EOF
	}
	return (*r.bp)[:r.n], nil
}

// readOnce is the RawConn's callback: one read into a buffer taken for it;
// false (wait in the poller) if nothing is there, with the buffer given back.
func (r *tunnelReader) readOnce(fd uintptr) bool {
	if r.bp == nil {
		r.bp = bufPool.Get().(*[]byte)
	}
	for {
		n, errno := sysRead(fd, *r.bp)
		switch errno {
		case 0:
			r.n = n
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			r.release()
			return false
		}
		r.errno = errno
		return true
	}
}

// release gives the buffer in hand back to the pool.
func (r *tunnelReader) release() {
	if r.bp != nil {
		bufPool.Put(r.bp)
		r.bp = nil
	}
}
