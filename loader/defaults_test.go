package loader

import (
	"strings"
	"testing"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/internal/xdptest"
)

// TestReasonsNamed fails when bpf/consts.h's enum stat_reason gains a reason that
// loader has no name for (reasonNames), or two reasons share a name.
func TestReasonsNamed(t *testing.T) {
	if int(reasonMax) != len(reasonNames) {
		t.Errorf("enum stat_reason has %d reasons; reasonNames names %d", reasonMax, len(reasonNames))
	}
	seen := make(map[string]Reason)
	for _, r := range Reasons() {
		name := r.String()
		if name == "" || strings.HasPrefix(name, "reason(") {
			t.Errorf("reason %d has no name: add it to reasonNames", uint32(r))
			continue
		}
		if other, dup := seen[name]; dup {
			t.Errorf("reasons %d and %d are both named %q", uint32(other), uint32(r), name)
		}
		seen[name] = r
	}
}

// TestDefaultsMatchObject holds loader's exported defaults against the committed
// object: its table sizes and the initial values of its nat settings.
func TestDefaultsMatchObject(t *testing.T) {
	spec, err := bpf.LoadWeir()
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]uint32{
		bpf.WeirMapLbConntrack4: DefaultConntrackSize, bpf.WeirMapNatReverse6: DefaultConntrackSize,
		bpf.WeirMapLbHalfOpen4: DefaultHalfOpenSize, bpf.WeirMapNatHalfReverse6: DefaultHalfOpenSize,
	} {
		if got := spec.Maps[name].MaxEntries; got != want {
			t.Errorf("map %s: %d entries; want %d", name, got, want)
		}
	}
	var lo, hi uint16
	if err := spec.Variables[bpf.WeirVarNatPortMin].Get(&lo); err != nil {
		t.Fatal(err)
	}
	if err := spec.Variables[bpf.WeirVarNatPortMax].Get(&hi); err != nil {
		t.Fatal(err)
	}
	if lo != DefaultNATPortMin || hi != DefaultNATPortMax {
		t.Errorf("nat ports %d..%d; want %d..%d", lo, hi, DefaultNATPortMin, DefaultNATPortMax)
	}
	for name, want := range map[string]uint64{
		bpf.WeirVarTcpIdleNs: uint64(DefaultTCPIdle), bpf.WeirVarTcpClosingNs: uint64(DefaultTCPClosing),
		bpf.WeirVarUdpIdleNs: uint64(DefaultUDPIdle), bpf.WeirVarHalfOpenNs: uint64(DefaultHalfOpen),
	} {
		var got uint64
		if err := spec.Variables[name].Get(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s: %d; want %d", name, got, want)
		}
	}
}

// TestLoadedSettings: a program reports the sizes and nat settings it was loaded
// with, defaults filled in.
func TestLoadedSettings(t *testing.T) {
	for _, tc := range []struct {
		name                string
		opts                Options
		conntrack, halfOpen uint32
		portMin, portMax    uint16
	}{
		{"defaults", Options{}, DefaultConntrackSize, DefaultHalfOpenSize, DefaultNATPortMin, DefaultNATPortMax},
		{"conntrack only", Options{ConntrackSize: 2048, NAT: NATOptions{PortMin: 20000, PortMax: 20099}},
			2048, MinHalfOpenSize, 20000, 20099},
		{"both", Options{ConntrackSize: 1 << 16, HalfOpenSize: 4096}, 1 << 16, 4096, DefaultNATPortMin, DefaultNATPortMax},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Load(tc.opts)
			xdptest.Check(t, err)
			defer p.Close()
			if c, h := p.Sizes(); c != tc.conntrack || h != tc.halfOpen {
				t.Errorf("Sizes() = %d, %d; want %d, %d", c, h, tc.conntrack, tc.halfOpen)
			}
			if lo, hi := p.NATPortRange(); lo != tc.portMin || hi != tc.portMax {
				t.Errorf("NATPortRange() = %d..%d; want %d..%d", lo, hi, tc.portMin, tc.portMax)
			}
			if n := p.NAT(); n.TCPIdle != DefaultTCPIdle || n.TCPClosing != DefaultTCPClosing ||
				n.UDPIdle != DefaultUDPIdle || n.HalfOpen != DefaultHalfOpen {
				t.Errorf("NAT() timeouts %v, %v, %v, %v; want the defaults", n.TCPIdle, n.TCPClosing, n.UDPIdle, n.HalfOpen)
			}
		})
	}
}
