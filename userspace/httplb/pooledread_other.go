//go:build !linux

package httplb

import (
	"net"
	"sync"
)

// pooledReader reads a connection into a pooled buffer held throughout
// (pooledread_linux.go gives it back while the connection waits).
type pooledReader struct {
	src  net.Conn
	pool *sync.Pool // of *[]byte
	bp   *[]byte
}

func newPooledReader(src net.Conn, pool *sync.Pool) *pooledReader {
	return &pooledReader{src: src, pool: pool}
}

func (r *pooledReader) raw() bool { return false }

func (r *pooledReader) read() ([]byte, error) {
	if r.bp == nil {
		r.bp = r.pool.Get().(*[]byte)
	}
	n, err := r.src.Read(*r.bp)
	return (*r.bp)[:n], err
}

func (r *pooledReader) release() {
	if r.bp != nil {
		r.pool.Put(r.bp)
		r.bp = nil
	}
}
