//go:build !linux

package httplb

import "net"

// tunnelReader reads one direction of a tunnel into a pooled copy buffer held
// throughout (tunnelread_linux.go gives it back while the direction waits).
type tunnelReader struct {
	src net.Conn
	bp  *[]byte
}

func newTunnelReader(src net.Conn) *tunnelReader { return &tunnelReader{src: src} }

func (r *tunnelReader) read() ([]byte, error) {
	if r.bp == nil {
		r.bp = bufPool.Get().(*[]byte)
	}
	n, err := r.src.Read(*r.bp)
	return (*r.bp)[:n], err
}

func (r *tunnelReader) release() {
	if r.bp != nil {
		bufPool.Put(r.bp)
		r.bp = nil
	}
}
