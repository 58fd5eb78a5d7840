//go:build !linux

package httplb

import (
	"net"
	"sync"
)

// pooledReader reads a connection into a pooled buffer held throughout
// (pooledread_linux.go gives it back while the connection waits).
type pooledReader struct {
	heldBuffer
	src net.Conn
}

func newPooledReader(src net.Conn, pool *sync.Pool) *pooledReader {
	return &pooledReader{heldBuffer: heldBuffer{pool: pool}, src: src}
}

func (r *pooledReader) raw() bool { return false }

func (r *pooledReader) read() ([]byte, error) { return r.readFrom(r.src) }
