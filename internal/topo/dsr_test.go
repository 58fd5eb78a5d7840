package topo

import (
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"

	"github.com/weir-lb/weir/internal/xdptest"
)

// macSwapProgram is the smallest L2 DSR balancer: every IPv4 or IPv6 frame
// gets dst MAC = to, src MAC = from and goes back out with XDP_TX; anything
// else passes. It proves the topology carries DSR traffic without depending
// on bpf/ or loader/.
func macSwapProgram(from, to net.HardwareAddr) (*ebpf.Program, error) {
	word := func(b []byte) int64 { return int64(int32(binary.LittleEndian.Uint32(b))) }
	half := func(b []byte) int64 { return int64(binary.LittleEndian.Uint16(b)) }
	// Ethertypes as a little-endian 16-bit load of the big-endian field
	// sees them.
	const (
		etherIPv4 = 0x0008
		etherIPv6 = 0xdd86
	)
	insns := asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // data
		asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // data_end
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, 14),
		asm.JGT.Reg(asm.R4, asm.R3, "pass"),
		asm.LoadMem(asm.R5, asm.R2, 12, asm.Half),
		asm.JEq.Imm(asm.R5, etherIPv4, "tx"),
		asm.JEq.Imm(asm.R5, etherIPv6, "tx"),
		asm.Ja.Label("pass"),
		asm.StoreImm(asm.R2, 0, word(to[0:4]), asm.Word).WithSymbol("tx"),
		asm.StoreImm(asm.R2, 4, half(to[4:6]), asm.Half),
		asm.StoreImm(asm.R2, 6, word(from[0:4]), asm.Word),
		asm.StoreImm(asm.R2, 10, half(from[4:6]), asm.Half),
		asm.Mov.Imm(asm.R0, 3), // XDP_TX
		asm.Return(),
		asm.Mov.Imm(asm.R0, 2).WithSymbol("pass"), // XDP_PASS
		asm.Return(),
	}
	return ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, Instructions: insns, License: "GPL"})
}

// attachBalancer attaches prog to the balancer's link in the given mode
// (nl.XDP_FLAGS_DRV_MODE or nl.XDP_FLAGS_SKB_MODE).
func attachBalancer(topo *Topology, prog *ebpf.Program, flags int) error {
	return topo.Balancer.NS.Do(func() error {
		link, err := netlink.LinkByName(topo.Balancer.Link)
		if err != nil {
			return err
		}
		return netlink.LinkSetXdpFdWithFlags(link, prog.FD(), flags)
	})
}

// TestDSR sends HTTP and UDP to the VIPs through a MAC-rewriting XDP_TX
// program on the balancer, native and generic, and checks that backend-0
// answers: the two kernel facts the topology handles (XDP_PASS on the
// balancer's peer, tx checksum offload off on the client) are what make the
// native case work.
func TestDSR(t *testing.T) {
	for _, mode := range []struct {
		name  string
		flags int
	}{
		{"native", nl.XDP_FLAGS_DRV_MODE},
		{"generic", nl.XDP_FLAGS_SKB_MODE},
	} {
		t.Run(mode.name, func(t *testing.T) {
			topo := newTopo(t, Config{Backends: 2})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := topo.ServeBackends(ctx); err != nil {
				t.Fatal(err)
			}

			target := topo.Backends[1]
			prog, err := macSwapProgram(topo.Balancer.MAC, target.MAC)
			xdptest.SkipOrFail(t, err)
			t.Cleanup(func() { prog.Close() })
			xdptest.SkipOrFail(t, attachBalancer(topo, prog, mode.flags))

			for _, vip := range []netip.Addr{topo.VIP4, topo.VIP6} {
				for range 5 {
					got, err := topo.Get(ctx, vip)
					if err != nil {
						t.Fatalf("GET %s: %v", URL(vip), err)
					}
					if got != target.Name {
						t.Fatalf("GET %s: answered by %q; want %q", URL(vip), got, target.Name)
					}
				}
				got, err := topo.AskUDP(ctx, netip.AddrPortFrom(vip, UDPPort), 0)
				if err != nil {
					t.Fatalf("UDP %s: %v", vip, err)
				}
				if got != target.Name {
					t.Fatalf("UDP %s: answered by %q; want %q", vip, got, target.Name)
				}
			}
			if n := topo.Served(0); n != 0 {
				t.Errorf("backend-0 served %d requests; want 0", n)
			}
			if n := topo.Served(1); n != 12 {
				t.Errorf("backend-1 served %d requests; want 12", n)
			}
		})
	}
}
