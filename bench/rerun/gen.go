// Package rerun measures XDP programs in BPF_PROG_TEST_RUN's repeat mode on a frame
// that is the same at the start of every iteration, even for programs that rewrite
// or encapsulate it. The kernel's repeat loop runs the program again on the frame as
// the previous iteration left it; rerun.c, run as the outer program, puts the frame
// back (offset, length and bytes), optionally turns it into a new flow, and
// tail-calls the program under test. Floors measured through it pay the same restore,
// so the ratios of weir to a floor compare like with like.
//
// Test-only: nothing in weir's binary links it. The generated bindings and object
// are committed; `make bench-rerun-generate` rebuilds them with the compiler and
// flags the Makefile pins.
package rerun

//go:generate go tool bpf2go -target bpfel Rerun rerun.c
