//go:build !unix

package health

// openFileLimit: no per-process limit to respect here.
func openFileLimit() int { return 1 << 30 }
