package httplb

import (
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"golang.org/x/net/http2"
)

// goAwayConn is a backend connection of Go's HTTP/2 transport, which carries
// HTTP/1.1 clients' requests to HTTP/2 backends. The transport closes a
// connection without a GOAWAY, even one it closes idle because weir asked it
// to (CloseIdleConnections), and has no way to ask for one (its ClientConn's
// Shutdown is not reachable through net/http). RFC 9113 6.8 asks for a GOAWAY
// before a connection closes, so the backend knows the close is an orderly
// one. goAwayConn follows the frames the transport writes, and when it is
// closed while retire says so, it writes GOAWAY NO_ERROR first, if the
// transport's last frame went out whole and its reader waits for the
// backend. Closes the transport makes on its own (its idle timeout, a
// backend's protocol error) go as before: the connection cannot tell them
// apart from each other, and a GOAWAY NO_ERROR after a protocol error would
// say there was none. A protocol error is the reader's: it closes the
// connection once it has read the frame at fault, and never reads again, so
// a close while no Read waits is not taken for an idle one, even while
// retire is set.
type goAwayConn struct {
	*coalescingConn
	retire  *atomic.Bool // set while the backend's idle connections are being closed
	open    *h2Conns     // the backend's connections of the transport open: this one until Close
	reading atomic.Bool  // the transport's reader waits in Read
	closed  atomic.Bool  // Close has run

	// wmu keeps Writes in order, so the frames are followed in the order
	// they are queued, and guards where they stand. A Write holds it while
	// it waits for room in the queue, so Close only tries it: it never
	// waits behind a backend that reads nothing, and a Write under way
	// means no GOAWAY.
	wmu     sync.Mutex
	preface int     // bytes of the client preface yet to pass
	hdr     [9]byte // a frame header cut across writes
	hdrN    int
	left    int // payload bytes of the current frame yet to pass
}

// newGoAwayConn wraps c, kept in open until it is closed.
func newGoAwayConn(c *coalescingConn, retire *atomic.Bool, open *h2Conns) *goAwayConn {
	g := &goAwayConn{coalescingConn: c, retire: retire, open: open, preface: len(http2.ClientPreface)}
	open.add(g)
	return g
}

// h2Conns is a backend's connections of Go's HTTP/2 transport that are open,
// so that those the transport still holds when the service stops can be
// closed then.
type h2Conns struct {
	mu sync.Mutex
	m  map[*goAwayConn]struct{}
}

func (h *h2Conns) add(c *goAwayConn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.m == nil {
		h.m = map[*goAwayConn]struct{}{}
	}
	h.m[c] = struct{}{}
}

func (h *h2Conns) remove(c *goAwayConn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.m, c)
}

func (h *h2Conns) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.m)
}

// closeAll closes every connection open, busy or not.
func (h *h2Conns) closeAll() {
	h.mu.Lock()
	cs := slices.Collect(maps.Keys(h.m))
	h.mu.Unlock()
	for _, c := range cs {
		c.Close() // takes itself out of h
	}
}

func (c *goAwayConn) Read(p []byte) (int, error) {
	c.reading.Store(true)
	n, err := c.coalescingConn.Read(p)
	c.reading.Store(false)
	return n, err
}

func (c *goAwayConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	n, err := c.coalescingConn.Write(p)
	c.follow(p[:n])
	return n, err
}

// follow moves the frame boundary past p, the bytes written; wmu is held.
func (c *goAwayConn) follow(p []byte) {
	for len(p) > 0 {
		switch {
		case c.preface > 0:
			k := min(c.preface, len(p))
			c.preface -= k
			p = p[k:]
		case c.left > 0:
			k := min(c.left, len(p))
			c.left -= k
			p = p[k:]
		default:
			k := copy(c.hdr[c.hdrN:], p)
			c.hdrN += k
			p = p[k:]
			if c.hdrN == len(c.hdr) {
				c.left = int(c.hdr[0])<<16 | int(c.hdr[1])<<8 | int(c.hdr[2])
				c.hdrN = 0
			}
		}
	}
}

// goAwayNoError is a client's GOAWAY: no stream of the server's processed
// (weir turns push off), NO_ERROR.
var goAwayNoError = []byte{0, 0, 8, byte(http2.FrameGoAway), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

// Close runs under the transport's pool lock and, from closeIdle, weir's
// service lock: it must not wait for the backend. The GOAWAY is queued
// without waiting for room (a backend that reads nothing has it fail with
// the rest of the queue), and a Write still under way (waiting for room)
// means no GOAWAY: its frame may be cut. Nor does a reader that is not
// waiting in Read: the close may be its own, for the backend's protocol
// error.
func (c *goAwayConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.open.remove(c)
	}
	// Held until the socket is closed: no Write queues a frame behind the
	// GOAWAY.
	if c.retire.Load() && c.reading.Load() && c.wmu.TryLock() {
		defer c.wmu.Unlock()
		if c.preface == 0 && c.hdrN == 0 && c.left == 0 {
			c.coalescingConn.queue(goAwayNoError) // goes out before the socket closes
		}
	}
	return c.coalescingConn.Close()
}
