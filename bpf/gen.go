// Package bpf holds weir's BPF programs — the XDP balancer (weir.c), the tunnel
// decapsulator for backends (decap.c) and the proxy's in-kernel forwarding between
// two sockets (sockmap.c) — and the Go bindings bpf2go generates for them.
// One generate line per program: each is its own object, loaded on its own host.
// The generated files are committed so that building weir needs no clang; `make
// generate` rebuilds them with the compiler and flags the Makefile pins.
//
// The -type enums (stat_reason, mode and the flag sets) become Go constants that
// loader builds its own on; enum defaults needs no -type, since a variable
// (consts.h defaults_btf_anchor) has it as its type.
package bpf

//go:generate go tool bpf2go -target bpfel -type vip_key -type service -type backend -type flow_key -type flow_key4 -type lb_flow -type nat_flow -type counter -type stat_reason -type mode -type service_flags -type backend_flags -type flow_flags -type nat_entry -type nat_client -type flow_count -type next_hop Weir weir.c
//go:generate go tool bpf2go -target bpfel -type decap_key -type decap_source -type decap_counter -type decap_reason Decap decap.c
//go:generate go tool bpf2go -target bpfel -type splice_sock Sockmap sockmap.c
