package loader

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/xdptest"
)

// floorProgram is the least an XDP forwarder can do: swap the MACs and XDP_TX. It is
// written in instructions here so the benchmark needs no second object file.
func floorProgram(tb testing.TB) *ebpf.Program {
	tb.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:    ebpf.XDP,
		License: "MIT",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // data
			asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // data_end
			asm.Mov.Reg(asm.R4, asm.R2),
			asm.Add.Imm(asm.R4, 14),
			asm.JGT.Reg(asm.R4, asm.R3, "pass"),
			asm.LoadMem(asm.R5, asm.R2, 0, asm.Word),
			asm.LoadMem(asm.R6, asm.R2, 4, asm.Half),
			asm.LoadMem(asm.R7, asm.R2, 6, asm.Word),
			asm.LoadMem(asm.R8, asm.R2, 10, asm.Half),
			asm.StoreMem(asm.R2, 0, asm.R7, asm.Word),
			asm.StoreMem(asm.R2, 4, asm.R8, asm.Half),
			asm.StoreMem(asm.R2, 6, asm.R5, asm.Word),
			asm.StoreMem(asm.R2, 10, asm.R6, asm.Half),
			asm.Mov.Imm(asm.R0, int32(XDPTX)),
			asm.Return(),
			asm.Mov.Imm(asm.R0, int32(XDPPass)).WithSymbol("pass"),
			asm.Return(),
		},
	})
	xdptest.Check(tb, err)
	tb.Cleanup(func() { prog.Close() })
	return prog
}

// BenchmarkPacket measures ns per packet through BPF_PROG_TEST_RUN beside the floor,
// interleaved run by run so both see the same machine. Each case reports the median
// and minimum over runs, and the ratio of medians to the floor.
//
// Every case is honest under repeat: dsr only swaps MACs, so each repeat sees an
// equivalent frame; a SYN always takes the lookup table and rewrites its connection
// table entry (as Katran does), so the new-flow case pays selection and insertion on
// every repeat; an established flow's first run inserts it, later runs hit it.
//
//	go test -run '^$' -bench Packet -benchtime 1x ./loader/
func BenchmarkPacket(b *testing.B) {
	const repeat = 1_000_000
	const runs = 7
	p := loadT(b)
	floor := floorProgram(b)
	svc4 := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(100, false, 80)}
	svc6 := Service{Key: ServiceKey{netip.AddrPortFrom(vip6, 80), TCP}, Backends: testBackends(100, true, 80)}
	for _, s := range []Service{svc4, svc6} {
		if err := p.AddService(s); err != nil {
			b.Fatal(err)
		}
	}
	frame := func(src, dst netip.Addr, dport uint16, flags uint8) []byte {
		return packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(src, 40000),
			Dst: netip.AddrPortFrom(dst, dport), TCPFlags: flags, Payload: make([]byte, 64)}.Build()
	}
	cases := []struct {
		name   string
		in     []byte
		action Action
	}{
		{"non-vip-pass", frame(client4, other4, 80, packet.ACK), XDPPass},
		{"established-v4", frame(client4, vip4, 80, packet.ACK), XDPTX},
		{"established-v6", frame(client6, vip6, 80, packet.ACK), XDPTX},
		{"syn-v4", frame(client4, vip4, 80, packet.SYN), XDPTX},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			var lb, fl []float64
			for range b.N {
				for range runs {
					action, d, err := p.Benchmark(tc.in, repeat)
					if err != nil || action != tc.action {
						b.Fatalf("action %s, err %v; want %s", action, err, tc.action)
					}
					lb = append(lb, float64(d.Nanoseconds()))
					_, fd, err := floor.Benchmark(tc.in, repeat, nil)
					if err != nil {
						b.Fatal(err)
					}
					fl = append(fl, float64(fd.Nanoseconds()))
				}
			}
			b.ReportMetric(median(lb), "ns/pkt")
			b.ReportMetric(slices.Min(lb), "min-ns/pkt")
			b.ReportMetric(median(fl), "floor-ns/pkt")
			b.ReportMetric(median(lb)/median(fl), "x-floor")
			b.ReportMetric(0, "ns/op")
		})
	}
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
