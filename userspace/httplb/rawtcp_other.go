//go:build !linux || race

package httplb

import "net"

// rawConnOf returns c: raw system calls are done on Linux only, and not under
// the race detector, which does not see the buffers they read and write.
func rawConnOf(c net.Conn) net.Conn { return c }
