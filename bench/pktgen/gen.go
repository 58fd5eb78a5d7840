// Package pktgen is weir's packet generator and sink. The generator is an XDP
// program run through BPF_PROG_RUN with live frames (BPF_F_TEST_XDP_LIVE_FRAMES):
// every XDP_TX it returns leaves the named interface as a real frame, several
// million a second from one CPU. The sink is an XDP program that counts what
// arrives on a receiving interface per CPU and drops it. Floor is the least an
// XDP forwarder does (swap MACs, XDP_TX), the yardstick the benchmark compares
// weir with.
//
// The generated bindings and objects are committed; `make bench-pkt-generate`
// rebuilds them with the compiler and flags the Makefile pins.
package pktgen

//go:generate go tool bpf2go -target bpfel -type template -type gen_config -type gen_state Generator generator.c
//go:generate go tool bpf2go -target bpfel -type counter Sink sink.c
//go:generate go tool bpf2go -target bpfel Floor floor.c
