//go:build unix

package health

import "syscall"

// openFileLimit is the process's soft RLIMIT_NOFILE (which Go raises to the
// hard limit at start on Linux).
func openFileLimit() int {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) != nil || l.Cur > 1<<30 {
		return 1 << 30
	}
	return int(l.Cur)
}
