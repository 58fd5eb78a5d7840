//go:build race

package httplb

import "syscall"

// sysRead is read(2) through the scheduler, so the race detector sees the
// buffer written (rawtcp_linux.go has the raw call).
func sysRead(fd uintptr, p []byte) (int, syscall.Errno) {
	n, err := syscall.Read(int(fd), p)
	if err != nil {
		return 0, err.(syscall.Errno)
	}
	return n, 0
}
