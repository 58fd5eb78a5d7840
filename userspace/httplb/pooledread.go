package httplb

import (
	"net"
	"sync"
)

// heldBuffer is a buffer taken from a pool when a read needs one and kept
// until release: how a pooledReader reads a connection it cannot wait on
// without reading (TLS, or any platform without the raw wait).
type heldBuffer struct {
	pool *sync.Pool // of *[]byte
	bp   *[]byte    // the buffer in hand, nil while none is
}

// take returns the buffer in hand, taking one from the pool if none is.
func (h *heldBuffer) take() []byte {
	if h.bp == nil {
		h.bp = h.pool.Get().(*[]byte)
	}
	return *h.bp
}

// readFrom reads src into the buffer in hand, which stays in hand.
func (h *heldBuffer) readFrom(src net.Conn) ([]byte, error) {
	b := h.take()
	n, err := src.Read(b)
	return b[:n], err
}

// release gives the buffer in hand back to the pool.
func (h *heldBuffer) release() {
	if h.bp != nil {
		h.pool.Put(h.bp)
		h.bp = nil
	}
}
