package httplb

import (
	"encoding/binary"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
)

// coalesceLimit bounds the bytes a coalescing connection holds for writing;
// past it a Write waits, so a peer that does not read still pushes back.
const coalesceLimit = 256 << 10

// coalescingConn gathers the writes that come while one is in the kernel into
// the next system call. Go's HTTP/2 server and client each flush their buffer
// after every frame or request they queue, one flush at a time, so at many
// streams a connection makes a write(2) per response or request. Here a Write
// queues its bytes and returns; one goroutine, started when the queue was
// empty, writes the queue out until it stays empty, so what comes while it is
// in the kernel goes out in its next write. A failed write fails the Writes
// after it. Close returns at once and the queue still goes out before the
// socket closes (for at most drainWait); CloseWrite waits for it.
//
// HTTP/1.1 gains nothing (a connection has one answer at a time) and would pay
// a goroutine per answer, so a served connection queues only once it has been
// seen to speak HTTP/2 by prior knowledge; until then, and under TLS, Write
// writes directly.
type coalescingConn struct {
	net.Conn

	sniffed bool // the first read was looked at (read by one goroutine at a time)

	mu    sync.Mutex
	cond  sync.Cond // signalled when a write finishes
	async bool      // writes queue
	buf   []byte    // queued, not yet handed to the kernel
	spare []byte
	// The pool's holders of buf and spare (nil while a slice has none):
	// both go back to writeBufPool when the queue runs dry, so an idle
	// connection holds no write buffer.
	bufH, spareH *[]byte
	writing      bool // the flusher goroutine runs
	closed       bool // Close was called: the flusher closes the socket when done
	err          error
	// onDrain, when set, is called (without mu) once the queue has gone out
	// after room reported it full; the frame engine sets it.
	onDrain   func()
	wantDrain bool

	// stats, set on a client's connection (coalescingListener), counts it in
	// clientTimeouts once timedOut is set (clientFailed).
	stats    *stats
	timedOut atomic.Bool
}

func newCoalescingConn(c net.Conn, async bool) *coalescingConn {
	cc := &coalescingConn{Conn: c, async: async, sniffed: async}
	cc.cond.L = &cc.mu
	return cc
}

func (c *coalescingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.clientFailed(err)
	}
	if !c.sniffed && n > 0 {
		c.sniffed = true
		// net/http reads the preface in two short reads ("PRI * HTTP/2.0", then the
		// rest); no HTTP/1.1 request starts with "PRI ".
		if m := min(n, len(http2.ClientPreface)); m >= 4 && string(p[:m]) == http2.ClientPreface[:m] {
			c.mu.Lock()
			c.async = true
			c.mu.Unlock()
		}
	}
	return n, err
}

func (c *coalescingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	if !c.async {
		c.mu.Unlock()
		n, err := c.Conn.Write(p)
		if err != nil {
			c.clientFailed(err)
		}
		return n, err
	}
	defer c.mu.Unlock()
	for c.err == nil && !c.closed && len(c.buf) > 0 && len(c.buf)+len(p) > coalesceLimit {
		c.cond.Wait()
	}
	return c.appendLocked(p)
}

// appendLocked queues p and starts the flusher if it is not running; mu is
// held.
func (c *coalescingConn) appendLocked(p []byte) (int, error) {
	switch {
	case c.closed:
		return 0, net.ErrClosed
	case c.err != nil:
		return 0, c.err
	}
	if c.bufH == nil {
		c.bufH = writeBufPool.Get().(*[]byte)
		c.buf = (*c.bufH)[:0]
	}
	c.buf = append(c.buf, p...)
	if !c.writing {
		c.writing = true
		// Exits when the queue is empty (or a write fails).
		go c.flush()
	}
	return len(p), nil
}

// queueHardLimit bounds what queue takes from a peer that stopped reading:
// past it the connection is failed.
const queueHardLimit = 8 << 20

var errQueueFull = errors.New("peer not reading: write queue full")

// queue is Write that never waits for room: the frame engine holds its locks
// while it writes, and checks room before each DATA frame instead.
func (c *coalescingConn) queue(p []byte) (int, error) {
	return c.queue2(p, nil)
}

// queue2 queues a and b, one behind the other, as queue does.
func (c *coalescingConn) queue2(a, b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil && len(c.buf)+len(a)+len(b) > queueHardLimit {
		// The peer takes nothing: its reader fails on the closed socket, and
		// the frame engine ends the connection.
		c.err = errQueueFull
		c.Conn.Close()
	}
	if n, err := c.appendLocked(a); err != nil || len(b) == 0 {
		return n, err
	}
	c.buf = append(c.buf, b...)
	return len(a) + len(b), nil
}

// queueData queues an HTTP/2 DATA frame (RFC 9113 6.1, no padding) for
// streamID, with END_STREAM if end. The payload goes straight into the queue:
// http2.Framer's WriteData copies it into a buffer of its own first, one copy
// more per byte, and keeps that buffer at the largest frame's size for as long
// as the connection lives, idle or not (TestIdleH2Memory).
func (c *coalescingConn) queueData(streamID uint32, end bool, p []byte) {
	var h [9]byte
	h[0], h[1], h[2] = byte(len(p)>>16), byte(len(p)>>8), byte(len(p))
	h[3] = byte(http2.FrameData)
	if end {
		h[4] = byte(http2.FlagDataEndStream)
	}
	binary.BigEndian.PutUint32(h[5:], streamID&(1<<31-1))
	c.queue2(h[:], p)
}

// room reports whether the queue has room for more DATA; if not, onDrain is
// called once it has gone out.
func (c *coalescingConn) room() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.buf) < coalesceLimit {
		return true
	}
	c.wantDrain = true
	return false
}

// queueWriter is a coalescingConn whose writes queue (for a Framer).
type queueWriter struct{ c *coalescingConn }

func (w queueWriter) Write(p []byte) (int, error) { return w.c.queue(p) }

// flush writes what was queued while a write was under way, until nothing is.
func (c *coalescingConn) flush() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.buf) > 0 && c.err == nil {
		out, outH := c.buf, c.bufH
		if c.spareH == nil {
			c.spareH = writeBufPool.Get().(*[]byte)
			c.spare = *c.spareH
		}
		c.buf, c.bufH = c.spare[:0], c.spareH
		c.mu.Unlock()
		_, err := c.Conn.Write(out)
		c.mu.Lock()
		c.spare, c.spareH = out[:0], outH
		if err != nil {
			c.err = err
			c.clientFailed(err)
		}
		c.cond.Broadcast()
	}
	// The burst is out: its buffers go back to the pool rather than stay
	// with a connection that may now idle for minutes (after a large answer
	// they had grown to its size).
	putWriteBuf(c.spareH, c.spare)
	c.spare, c.spareH = nil, nil
	if len(c.buf) == 0 {
		putWriteBuf(c.bufH, c.buf)
		c.buf, c.bufH = nil, nil
	}
	c.writing = false
	c.cond.Broadcast()
	if c.closed {
		c.Conn.Close()
	}
	if c.wantDrain && c.onDrain != nil {
		c.wantDrain = false
		fn := c.onDrain
		c.mu.Unlock()
		fn()
		c.mu.Lock()
	}
}

// writeErr returns the error a write of c failed with, nil if none has. On a
// socket the kernel has closed it first waits for a write under way, which
// fails at once there: the kernel tells why a connection failed (ETIMEDOUT,
// ECONNRESET) to the first read or write that asks, and the others find the
// socket just closed (EOF, EPIPE), so a read that failed so may have left the
// reason to the writer.
func (c *coalescingConn) writeErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.writing && c.err == nil && socketClosed(c.Conn) {
		for c.writing && c.err == nil {
			c.cond.Wait()
		}
	}
	return c.err
}

// writeBufPool holds the queues' buffers between bursts (*[]byte, grown by
// the bursts that used them, up to writeBufKeep).
var writeBufPool = sync.Pool{New: func() any { return new([]byte) }}

// writeBufKeep is the largest buffer the pool keeps; a larger one (a burst of
// a large answer) is left to the collector.
const writeBufKeep = 64 << 10

// putWriteBuf gives b, held by h, back to writeBufPool.
func putWriteBuf(h *[]byte, b []byte) {
	if h == nil {
		return
	}
	if cap(b) > writeBufKeep {
		b = nil
	}
	*h = b[:0]
	writeBufPool.Put(h)
}

// drainWait bounds how long a closed connection's queue may take to go out to a
// peer that does not read.
const drainWait = time.Second

// Close does not wait for the queue: net/http's server closes its connections
// one after another, and a peer that does not read must not hold up the rest.
// The flusher closes the socket once the queue is out, or once its write has
// failed on the deadline set here.
func (c *coalescingConn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return net.ErrClosed
	}
	c.closed = true
	c.cond.Broadcast() // writers waiting for room fail now
	if c.writing {
		c.Conn.SetWriteDeadline(time.Now().Add(drainWait))
		return nil
	}
	return c.Conn.Close()
}

// drain waits until every queued byte is written, a write has failed, or
// drainWait has passed (then the write under way fails on its deadline).
func (c *coalescingConn) drain() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.writing {
		c.Conn.SetWriteDeadline(time.Now().Add(drainWait))
	}
	for c.writing {
		c.cond.Wait()
	}
}

// CloseWrite half-closes a TCP connection, as net/http's server does before it
// closes one it answered an error on.
func (c *coalescingConn) CloseWrite() error {
	c.drain()
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// clientFailed counts c, a client's connection, in clientTimeouts if err, which
// a read or write of it returned, says the kernel gave the client up: its
// keepalive probes or the bytes sent to it went unacknowledged (ETIMEDOUT: TCP
// keepalive, TCP_USER_TIMEOUT), as the proxy counts its clients. Every engine
// tells the connection it was accepted as what its reads and writes of the
// client's socket return, however it makes them (some go around c: raw reads,
// the HTTP/1.1 loop's socket); a connection counts once, however many paths
// see the error (a TLS connection's error is seen by the TLS layer and by c
// below it). A connection weir dialed (no stats) counts nowhere.
func (c *coalescingConn) clientFailed(err error) {
	if c == nil || c.stats == nil || !errors.Is(err, syscall.ETIMEDOUT) {
		return
	}
	if c.timedOut.CompareAndSwap(false, true) {
		c.stats.clientTimeouts.Add(1)
	}
}

// coalescingListener makes every accepted connection a coalescingConn that
// counts in stats (clientFailed).
type coalescingListener struct {
	net.Listener
	stats *stats
}

func (l coalescingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	cc := newCoalescingConn(c, false)
	cc.stats = l.stats
	return cc, nil
}
