//go:build !linux

// Command health benchmarks the health checker; it needs Linux (network
// namespaces, getrusage, /proc).
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "bench/health: runs on Linux only")
	os.Exit(2)
}
