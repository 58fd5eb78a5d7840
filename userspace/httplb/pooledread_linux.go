package httplb

import (
	"io"
	"net"
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
	heldBuffer
	src   net.Conn
	rc    syscall.RawConn // nil: src.Read
	call  func(fd uintptr) bool
	n     int
	errno syscall.Errno
}

func newPooledReader(src net.Conn, pool *sync.Pool) *pooledReader {
	r := &pooledReader{heldBuffer: heldBuffer{pool: pool}, src: src}
	switch c := src.(type) {
	case interface{ rawReadConn() syscall.RawConn }:
		r.rc = c.rawReadConn()
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
		return r.readFrom(r.src)
	}
	r.n, r.errno = 0, 0
	err := r.rc.Read(r.call) // sets r.errno, so it goes first
	if err := sockFailure(r.src, "read", err, r.errno); err != nil {
		r.release()
		return nil, err
	}
	if r.n == 0 {
		r.release()
		return nil, io.EOF
	}
	return (*r.bp)[:r.n], nil
}

// readOnce is the RawConn's callback: one read into a buffer taken for it;
// false (wait in the poller) if nothing is there, with the buffer given back.
func (r *pooledReader) readOnce(fd uintptr) bool {
	b := r.take()
	for {
		n, errno := sysRead(fd, b)
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
