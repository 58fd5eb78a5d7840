//go:build !race

package httplb

import (
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// rawTCP is a TCP connection whose reads and small writes enter the kernel with
// RawSyscall, without telling the Go scheduler that a system call is in progress.
// The socket stays in the runtime poller: a read or write that finds the socket
// not ready parks the goroutine there as net.Conn's would, and deadlines work as
// they do on a net.Conn.
//
// Why: on loopback (and on any host where the balancer shares CPUs with busy
// neighbours) a write runs the receiver's TCP stack inline and its thread is
// often preempted inside it by the receiver it woke. With syscall.Syscall, the
// scheduler's monitor (sysmon) then finds the P "in a system call" across two of
// its ticks, takes it away and hands it to another thread (a futex wake-up), and
// the first thread, back from the call, must find a P again or sleep (another
// futex). Under HTTP/1.1 keep-alive load those hand-offs, and sysmon waking every
// 20 µs while it keeps finding some, were a tenth of weir's CPU in a perf profile.
// A raw call keeps its P. The splice proxy does the same for the same reason
// (userspace/proxy/rawsys_linux.go).
//
// The cost: the goroutine cannot be preempted, and the P runs nothing else, for
// as long as the call lasts. Non-blocking calls on a socket last microseconds;
// writes larger than rawWriteMax (which run the receiver's stack for all their
// bytes) go through the scheduler as before. Under the race detector the
// connection is left as it is (rawtcp_other.go): raw calls would hide the
// buffers they read and write from it.
type rawTCP struct {
	*net.TCPConn
	rc syscall.RawConn

	// The callbacks handed to rc, made once (a closure made per call would
	// escape and allocate), with their inputs and results here. busyR and
	// busyW guard them: a second reader or writer at the same time (net.Conn
	// allows it; weir's HTTP/1.1 path does not do it) takes net.Conn's path.
	rd, wr       func(fd uintptr) bool
	rbuf, wbuf   []byte
	rn, wn       int
	rerr, werr   syscall.Errno
	busyR, busyW atomic.Bool
}

// rawWriteMax is the largest write issued raw.
const rawWriteMax = 64 << 10

// rawConnOf returns c with raw reads and writes if it is a TCP connection, else c.
func rawConnOf(c net.Conn) net.Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	r := &rawTCP{TCPConn: tc, rc: rc}
	r.rd, r.wr = r.readOnce, r.writeSome
	return r
}

func (c *rawTCP) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if !c.busyR.CompareAndSwap(false, true) {
		return c.TCPConn.Read(p)
	}
	c.rbuf, c.rn, c.rerr = p, 0, 0
	err := c.rc.Read(c.rd)
	n, errno := c.rn, c.rerr
	c.rbuf = nil
	c.busyR.Store(false)
	if err := c.failure("read", err, errno); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, io.EOF
	}
	return n, nil
}

// readOnce is c.rd: one read(2); false (wait in the poller) if nothing is there.
func (c *rawTCP) readOnce(fd uintptr) bool {
	for {
		r, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&c.rbuf[0])), uintptr(len(c.rbuf)))
		switch e {
		case 0:
			c.rn = int(r)
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		}
		c.rerr = e
		return true
	}
}

func (c *rawTCP) Write(p []byte) (int, error) {
	if len(p) == 0 || len(p) > rawWriteMax || !c.busyW.CompareAndSwap(false, true) {
		return c.TCPConn.Write(p)
	}
	c.wbuf, c.wn, c.werr = p, 0, 0
	err := c.rc.Write(c.wr)
	n, errno := c.wn, c.werr
	c.wbuf = nil
	c.busyW.Store(false)
	return n, c.failure("write", err, errno)
}

// writeSome is c.wr: writes until all of wbuf is gone or the socket is full
// (false: wait in the poller, then go on). A peer that has gone fails the call
// with EPIPE; the SIGPIPE that comes with it is ignored by the Go runtime for
// any descriptor but standard output and error.
func (c *rawTCP) writeSome(fd uintptr) bool {
	for c.wn < len(c.wbuf) {
		b := c.wbuf[c.wn:]
		r, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
		switch e {
		case 0:
			if r == 0 {
				c.werr = syscall.EIO // a write that moves nothing would loop forever
				return true
			}
			c.wn += int(r)
			continue
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		}
		c.werr = e
		return true
	}
	return true
}

// failure is op's error, from the poller (err) or the system call (errno),
// wrapped as net.Conn's methods wrap theirs, so callers' checks (timeouts,
// net.ErrClosed) see what they would see from the connection itself; nil if
// neither failed.
func (c *rawTCP) failure(op string, err error, errno syscall.Errno) error {
	switch {
	case err != nil:
		if oe, ok := err.(*net.OpError); ok { // the raw connection's own ("raw-read")
			err = oe.Err
		}
	case errno != 0:
		err = os.NewSyscallError(op, errno)
	default:
		return nil
	}
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}
