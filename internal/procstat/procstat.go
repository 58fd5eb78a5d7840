// Package procstat reads a process's /proc/PID/stat line.
package procstat

import (
	"bytes"
	"os"
	"strings"
)

// Fields is /proc/PID/stat from field 3 on: Fields(pid)[0] is field 3, the
// state, and field N is Fields(pid)[N-3]. pid is a number or "self". It is nil
// when there is no such process.
func Fields(pid string) []string {
	b, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return nil
	}
	// The command name, field 2, is in parentheses and may hold spaces.
	return strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
}
