package xdpplane

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// TestLeavingBackendsDoNotSizeTheTable: past 655 backends a Maglev table's size
// follows the number of backends, a step of a ladder at a time, so a leaving
// backend (removed by a reload, draining until drain_timeout) counted in would,
// at the end of a step, give the table one size while it drains and another when
// it leaves: every slot would move a second time, at no reload, where weir plan
// never shows it. The table is sized by the configured backends alone. 1,311
// backends fill the step of 131101 slots; 1,312 would take the next.
func TestLeavingBackendsDoNotSizeTheTable(t *testing.T) {
	const n = 1311
	s := &plan.Service{Config: config.Service{Name: "web", VIP: netip.MustParseAddrPort("10.0.0.1:80"),
		Protocol: config.TCP, Mode: config.ModeNAT, Algorithm: config.AlgorithmMaglev}}
	for i := range n {
		addr := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), 80)
		s.Backends = append(s.Backends, plan.Backend{ID: fmt.Sprint("web/", addr), Config: config.Backend{Addr: addr, Weight: 1},
			Weight: 1, Usable: true, Healthy: true})
	}
	after, err := loader.LookupTable(spec(s), 7)
	if err != nil {
		t.Fatal(err)
	}
	leaver := plan.Backend{Config: config.Backend{Addr: netip.MustParseAddrPort("10.2.0.1:80"), Weight: 1}, Weight: 1, Healthy: true, Drained: true}
	s.Leaving = append(s.Leaving, leaver)
	during, err := loader.LookupTable(spec(s), 7)
	if err != nil {
		t.Fatal(err)
	}
	if len(during) != len(after) {
		t.Fatalf("table of %d backends: got %d slots while one more leaves, %d after; want the same size", n, len(during), len(after))
	}
	moved := 0
	for i := range after {
		if during[i] != after[i] {
			moved++
		}
	}
	if moved != 0 {
		t.Errorf("when the leaving backend leaves: %d of %d slots move; want none (it holds no slot)", moved, len(after))
	}
}
