// Package bpf holds weir's XDP program and the Go bindings bpf2go generates for it.
// The generated files are committed so that building weir needs no clang; `make
// generate` rebuilds them with the compiler and flags the Makefile pins.
package bpf

//go:generate go tool bpf2go -target bpfel -type vip_key -type service -type backend -type flow_key -type flow_state -type counter -type stat_reason -type nat_entry -type flow_count -type next_hop Weir weir.c
