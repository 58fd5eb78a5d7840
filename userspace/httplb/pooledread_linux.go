package httplb

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
)

// pooledReader reads a connection into buffers taken from a pool only while
// bytes are there: a connection waiting for its next bytes holds no buffer.
// A tunnel's directions (WebSockets are idle most of the time) and the
// HTTP/1.1 loop's wait for a client's next request read through one; two
// 32 KiB buffers held through every wait were most of what an idle tunnel cost
// (TestIdleTunnelMemory).
//
// The wait is the runtime poller's, through the socket's RawConn, so the
// connection's read deadline holds as for its Read: the read is tried first,
// and when it finds nothing the buffer goes back to the pool before the
// goroutine parks. A connection that is not a socket (TLS) is read with its
// own Read into a buffer held throughout (raw is false).
type pooledReader struct {
	src   net.Conn
	pool  *sync.Pool      // of *[]byte
	rc    syscall.RawConn // nil: src.Read
	call  func(fd uintptr) bool
	bp    *[]byte // the buffer in hand, nil while none is
	n     int
	errno syscall.Errno
}

func newPooledReader(src net.Conn, pool *sync.Pool) *pooledReader {
	r := &pooledReader{src: src, pool: pool}
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

// raw reports whether a wait holds no buffer.
func (r *pooledReader) raw() bool { return r.rc != nil }

// read returns the next bytes from src, in a pooled buffer that stays the
// reader's until release; io.EOF at src's end.
func (r *pooledReader) read() ([]byte, error) {
	if r.rc == nil {
		if r.bp == nil {
			r.bp = r.pool.Get().(*[]byte)
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
func (r *pooledReader) readOnce(fd uintptr) bool {
	if r.bp == nil {
		r.bp = r.pool.Get().(*[]byte)
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
func (r *pooledReader) release() {
	if r.bp != nil {
		r.pool.Put(r.bp)
		r.bp = nil
	}
}
