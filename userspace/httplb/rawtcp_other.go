//go:build !linux

package httplb

import "net"

// rawConnOf returns c: raw system calls are done on Linux only.
func rawConnOf(c net.Conn) net.Conn { return c }
