package httplb

import (
	"errors"
	"net"
	"sync"
	"syscall"
)

// failConn is a connection to a backend that http.Transport reads and
// writes from two goroutines at once (its reader waits for the answer while
// its writer sends a body, or HTTP/2's frames). The kernel tells why the
// connection failed (ETIMEDOUT: the backend stopped acknowledging, by
// TCP_USER_TIMEOUT or keepalive) to the first read or write that asks; the
// other finds the socket just closed (EOF, EPIPE). Whichever of the two the
// transport reports, a failConn has it report ETIMEDOUT if the other heard
// it, so the try counts as a timeout, as the frame engine's connections
// count it (coalescingConn.writeErr).
type failConn struct {
	net.Conn
	mu   sync.Mutex
	cond sync.Cond
	busy [2]bool  // a read, a write under way
	err  [2]error // the first error of the reads, of the writes
}

func newFailConn(c net.Conn) *failConn {
	fc := &failConn{Conn: c}
	fc.cond.L = &fc.mu
	return fc
}

func (c *failConn) Read(p []byte) (int, error)  { return c.op(0, p) }
func (c *failConn) Write(p []byte) (int, error) { return c.op(1, p) }

// op reads (i 0) or writes (i 1) p. A failure that is not ETIMEDOUT returns
// the other side's ETIMEDOUT if it had that, first waiting, on a socket the
// kernel has closed, for the other side's operation under way, which fails
// at once there.
func (c *failConn) op(i int, p []byte) (int, error) {
	c.mu.Lock()
	c.busy[i] = true
	c.mu.Unlock()
	var n int
	var err error
	if i == 0 {
		n, err = c.Conn.Read(p)
	} else {
		n, err = c.Conn.Write(p)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.busy[i] = false
	// The other side may wait for this operation's end (below), however it
	// ends: a read on a socket the kernel closed still returns the bytes that
	// came before, and a write may have finished just before it closed.
	c.cond.Broadcast()
	if err == nil {
		return n, nil
	}
	if c.err[i] == nil {
		c.err[i] = err
	}
	if errors.Is(err, syscall.ETIMEDOUT) {
		return n, err
	}
	if c.busy[1-i] && socketClosed(c.Conn) {
		c.await(1 - i)
	}
	if o := c.err[1-i]; errors.Is(o, syscall.ETIMEDOUT) {
		// Whatever failed this one since (the socket closed, or closed by
		// the transport once the other side failed) came of the timeout.
		err = o
	}
	return n, err
}

// await waits, c.mu held, until side i's operation under way, if any, has
// ended.
func (c *failConn) await(i int) {
	for c.busy[i] {
		c.cond.Wait()
	}
}
