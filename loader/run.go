package loader

import (
	"fmt"
	"time"

	"github.com/cilium/ebpf"
)

// Action is an XDP verdict.
type Action uint32

const (
	XDPAborted Action = iota
	XDPDrop
	XDPPass
	XDPTX
	XDPRedirect
)

func (a Action) String() string {
	switch a {
	case XDPAborted:
		return "XDP_ABORTED"
	case XDPDrop:
		return "XDP_DROP"
	case XDPPass:
		return "XDP_PASS"
	case XDPTX:
		return "XDP_TX"
	case XDPRedirect:
		return "XDP_REDIRECT"
	}
	return fmt.Sprintf("xdp_action(%d)", uint32(a))
}

// Run runs the program once on a frame through BPF_PROG_TEST_RUN, against the live
// maps, and returns its verdict and the frame as the program left it. Tests and the
// agent's self-test use it; counters and the connection table change as for a real
// packet.
func (p *Program) Run(frame []byte) (Action, []byte, error) {
	return p.RunOn(frame, 0)
}

// xdpMD is the kernel's struct xdp_md, the context BPF_PROG_TEST_RUN accepts.
type xdpMD struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// RunOn is Run with the frame received on the interface with index ifindex (0: none),
// looked up in the calling thread's network namespace; nat's next-hop lookups need it.
func (p *Program) RunOn(frame []byte, ifindex int) (Action, []byte, error) {
	out := make([]byte, len(frame)+256)
	opts := ebpf.RunOptions{Data: frame, DataOut: out}
	if ifindex != 0 {
		opts.Context = xdpMD{DataEnd: uint32(len(frame)), IngressIfindex: uint32(ifindex)}
	}
	ret, err := p.objs.WeirXdp.Run(&opts)
	if err != nil {
		return 0, nil, fmt.Errorf("test-run xdp program: %w", err)
	}
	return Action(ret), opts.DataOut, nil
}

// Benchmark runs the program repeat times on one frame in the kernel and returns the
// mean time per run. The kernel hands every repeat the frame as the previous run left
// it, which is the same frame for dsr (it only swaps MACs); the benchmarks measure
// paths that rewrite or encapsulate the frame through bench/rerun, which restores it
// before every repeat (see bench_test.go).
func (p *Program) Benchmark(frame []byte, repeat int) (Action, time.Duration, error) {
	ret, d, err := p.objs.WeirXdp.Benchmark(frame, repeat, nil)
	if err != nil {
		return 0, 0, fmt.Errorf("benchmark xdp program: %w", err)
	}
	return Action(ret), d, nil
}
