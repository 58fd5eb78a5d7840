package httplb

import (
	"net"
	"sync"
)

// poolBufReader is a buffered reader whose buffer comes from a pool and
// goes back to it whenever every byte read has been taken: a connection
// waiting for its next bytes holds none (pooledReader). The frame engine reads
// its HTTP/2 clients through one, where bufio.Reader would keep a buffer per
// connection for as long as it is open, idle or not.
type poolBufReader struct {
	pr   *pooledReader
	left []byte // read, not yet taken; in pr's buffer
	err  error  // came with the bytes in left; returned once they are taken
}

func newPoolBufReader(c net.Conn, pool *sync.Pool) *poolBufReader {
	return &poolBufReader{pr: newPooledReader(c, pool)}
}

func (r *poolBufReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if len(r.left) == 0 {
		if r.err != nil {
			return 0, r.err
		}
		b, err := r.pr.read()
		if len(b) == 0 {
			r.pr.release()
			return 0, err
		}
		r.left, r.err = b, err
	}
	n := copy(p, r.left)
	r.left = r.left[n:]
	if len(r.left) == 0 {
		// Nil, not empty: an empty slice into the buffer would keep it
		// alive after the pool has dropped it.
		r.left = nil
		r.pr.release()
	}
	return n, nil
}
