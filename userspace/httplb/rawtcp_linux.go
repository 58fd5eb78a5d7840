//go:build !race

package httplb

import (
	"io"
	"net"
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
	r  rawOp // reads: readOnce
	w  rawOp // writes: writeSome
}

// rawOp is one direction's raw call: the callback handed to the RawConn, made
// once (a closure made per call would escape and allocate), with its input and
// results. busy guards it: a second reader or writer at the same time (net.Conn
// allows it; weir's HTTP/1.1 path does not do it) takes net.Conn's path.
type rawOp struct {
	call  func(fd uintptr) bool
	buf   []byte
	n     int
	errno syscall.Errno
	busy  atomic.Bool
}

// run hands p to the callback through rc's Write (write) or Read, and returns
// what the callback did and the poller's error; the caller has claimed busy, and
// run gives it back.
func (o *rawOp) run(rc syscall.RawConn, write bool, p []byte) (int, syscall.Errno, error) {
	o.buf, o.n, o.errno = p, 0, 0
	var err error
	if write {
		err = rc.Write(o.call)
	} else {
		err = rc.Read(o.call)
	}
	n, errno := o.n, o.errno
	o.buf = nil
	o.busy.Store(false)
	return n, errno, err
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
	r.r.call, r.w.call = r.readOnce, r.writeSome
	return r
}

func (c *rawTCP) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if !c.r.busy.CompareAndSwap(false, true) {
		return c.TCPConn.Read(p)
	}
	n, errno, err := c.r.run(c.rc, false, p)
	if err := sockFailure(c, "read", err, errno); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, io.EOF
	}
	return n, nil
}

// readOnce is c.r's call: one read(2); false (wait in the poller) if nothing is
// there.
func (c *rawTCP) readOnce(fd uintptr) bool {
	for {
		n, e := sysRead(fd, c.r.buf)
		switch e {
		case 0:
			c.r.n = n
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		}
		c.r.errno = e
		return true
	}
}

func (c *rawTCP) Write(p []byte) (int, error) {
	if len(p) == 0 || len(p) > rawWriteMax || !c.w.busy.CompareAndSwap(false, true) {
		return c.TCPConn.Write(p)
	}
	n, errno, err := c.w.run(c.rc, true, p)
	return n, sockFailure(c, "write", err, errno)
}

// sysRead is one read(2), raw (sysread_race_linux.go has the one the race
// detector sees).
func sysRead(fd uintptr, p []byte) (int, syscall.Errno) {
	r, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(r), e
}

// writeSome is c.w's call: writes until all of its buffer is gone or the socket is full
// (false: wait in the poller, then go on). A peer that has gone fails the call
// with EPIPE; the SIGPIPE that comes with it is ignored by the Go runtime for
// any descriptor but standard output and error.
func (c *rawTCP) writeSome(fd uintptr) bool {
	for c.w.n < len(c.w.buf) {
		b := c.w.buf[c.w.n:]
		r, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
		switch e {
		case 0:
			if r == 0 {
				c.w.errno = syscall.EIO // a write that moves nothing would loop forever
				return true
			}
			c.w.n += int(r)
			continue
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		}
		c.w.errno = e
		return true
	}
	return true
}
