package rerun

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/xdptest"
)

const xdpTX = 3

func loadT(t *testing.T) *Rig {
	t.Helper()
	r, err := Load()
	xdptest.Check(t, err)
	t.Cleanup(func() { r.Close() })
	return r
}

func testFrame(v6 bool, proto uint8) []byte {
	src, dst := netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("10.9.8.7")
	if v6 {
		src, dst = netip.MustParseAddr("fd00::1:2:3"), netip.MustParseAddr("fd00::9:8:7")
	}
	return packet.Frame{
		SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, DstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2},
		Src: netip.AddrPortFrom(src, 40000), Dst: netip.AddrPortFrom(dst, 80),
		Proto: proto, TCPFlags: packet.SYN, Payload: make([]byte, 64),
	}.Build()
}

func swapMACs(f []byte) []byte {
	out := bytes.Clone(f)
	copy(out[0:6], f[6:12])
	copy(out[6:12], f[0:6])
	return out
}

// TestKernelKeepsFrame checks the premise of the wrapper: BPF_PROG_TEST_RUN's repeat
// loop runs every iteration on the frame as the last one left it (net/bpf/test_run.c,
// bpf_test_run: the xdp_buff is set up once, before the loop). Without the wrapper,
// ten runs of PushFloor grow the frame by ten times 20 bytes.
func TestKernelKeepsFrame(t *testing.T) {
	r := loadT(t)
	in := testFrame(false, packet.ProtoTCP)
	out := make([]byte, len(in)+256)
	opts := ebpf.RunOptions{Data: in, DataOut: out, Repeat: 10}
	action, err := r.PushFloor().Run(&opts)
	if err != nil || action != xdpTX || len(opts.DataOut) != len(in)+10*20 {
		t.Fatalf("got %d, %d bytes, %v; want XDP_TX, %d bytes", action, len(opts.DataOut), err, len(in)+10*20)
	}
}

// TestRestore checks that every iteration starts from the frame as given, whether
// the program under test left it as it was, moved its start or rewrote it.
func TestRestore(t *testing.T) {
	r := loadT(t)
	in := testFrame(false, packet.ProtoTCP)
	for _, tc := range []struct {
		name   string
		prog   *ebpf.Program
		prefix int // bytes the program puts in front of the frame
	}{
		{"floor", r.Floor(), 0},
		{"push", r.PushFloor(), 20},
		{"push-pull", r.PushPullFloor(), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, repeat := range []int{1, 2, 1000} {
				action, out, err := r.Output(tc.prog, in, repeat, false)
				if err != nil {
					t.Fatal(err)
				}
				// The floors swap the first 12 bytes they see; behind them the
				// frame must be the original, once.
				if action != xdpTX || len(out) != len(in)+tc.prefix || !bytes.Equal(out[tc.prefix+12:], in[12:]) {
					t.Fatalf("repeat %d: action %d, %d bytes %x; want %d, %d bytes ending %x", repeat, action, len(out), out, xdpTX, len(in)+tc.prefix, in[12:])
				}
				if tc.prefix == 0 && !bytes.Equal(out, swapMACs(in)) {
					t.Fatalf("repeat %d: got %x; want %x", repeat, out, swapMACs(in))
				}
			}
		})
	}
}

// TestRepeats checks that the wrapper ran as often as asked and reached its target.
func TestRepeats(t *testing.T) {
	r := loadT(t)
	res, err := r.Run(r.Floor(), testFrame(true, packet.ProtoTCP), 10000, false)
	if err != nil {
		t.Fatal(err)
	}
	if res.Action != xdpTX || res.Repeats < 10000 || res.PerRun <= 0 {
		t.Fatalf("got %+v; want XDP_TX, >= 10000 repeats, a duration", res)
	}
}

// TestNoTarget: without a program under test the wrapper aborts.
func TestNoTarget(t *testing.T) {
	r := loadT(t)
	if err := r.objs.Target.Delete(uint32(0)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Fatal(err)
	}
	var frame [frameMax]byte
	copy(frame[:], testFrame(false, packet.ProtoTCP))
	if err := r.objs.FrameLen.Set(uint32(100)); err != nil {
		t.Fatal(err)
	}
	ret, _, err := r.objs.Rerun.Test(frame[:100])
	if err != nil || ret != 0 {
		t.Fatalf("got %d, %v; want XDP_ABORTED", ret, err)
	}
}

func isNotExist(err error) bool {
	return err != nil && bytes.Contains([]byte(err.Error()), []byte("not exist"))
}

// TestOtherObject checks that the wrapper tail-calls a program that is not part of
// its own object, as it does weir's. The kernel (6.18) only lets a program into the
// wrapper's prog array if its expected attach type is the wrapper's (BPF_XDP, what
// SEC("xdp") gives): loaded without one, the update fails with EINVAL.
func TestOtherObject(t *testing.T) {
	r := loadT(t)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.XDP, AttachType: ebpf.AttachXDP, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 42), asm.Return()},
	})
	xdptest.Check(t, err)
	defer prog.Close()
	action, _, err := r.Output(prog, testFrame(false, packet.ProtoTCP), 10, false)
	if err != nil || action != 42 {
		t.Fatalf("got %d, %v; want 42", action, err)
	}
}

// TestTailMoves checks that a frame whose end the program moved is restored too,
// and counted: such a program pays a helper call its floor does not.
func TestTailMoves(t *testing.T) {
	r := loadT(t)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.XDP, AttachType: ebpf.AttachXDP, License: "MIT",
		Instructions: asm.Instructions{
			asm.Mov.Imm(asm.R2, -4),
			asm.FnXdpAdjustTail.Call(),
			asm.Mov.Imm(asm.R0, xdpTX),
			asm.Return(),
		},
	})
	xdptest.Check(t, err)
	defer prog.Close()
	in := testFrame(false, packet.ProtoTCP)
	action, out, err := r.Output(prog, in, 5, false)
	if err != nil || action != xdpTX || !bytes.Equal(out, in[:len(in)-4]) {
		t.Fatalf("got %d, %x, %v; want XDP_TX, %x", action, out, err, in[:len(in)-4])
	}
	res, err := r.Run(prog, in, 100, false)
	if err != nil || res.TailMoves != res.Repeats-1 {
		t.Fatalf("got %+v, %v; want a tail move on all but the first of the iterations", res, err)
	}
}

// TestNewFlows checks that every iteration gets the next new flow, with checksums
// that stay valid, and that Go's NewFlow predicts it.
func TestNewFlows(t *testing.T) {
	r := loadT(t)
	for _, tc := range []struct {
		name  string
		v6    bool
		proto uint8
	}{
		{"tcp4", false, packet.ProtoTCP},
		{"tcp6", true, packet.ProtoTCP},
		{"udp4", false, packet.ProtoUDP},
		{"udp6", true, packet.ProtoUDP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := testFrame(tc.v6, tc.proto)
			for _, repeat := range []int{1, 3, 40000} {
				n0, err := r.Flows()
				if err != nil {
					t.Fatal(err)
				}
				action, out, err := r.Output(r.Floor(), in, repeat, true)
				if err != nil {
					t.Fatal(err)
				}
				n1, err := r.Flows()
				if err != nil {
					t.Fatal(err)
				}
				want, err := NewFlow(in, n1-1)
				if err != nil {
					t.Fatal(err)
				}
				if action != xdpTX || n1-n0 < uint32(repeat) || !bytes.Equal(out, swapMACs(want)) {
					t.Fatalf("repeat %d: action %d, flows %d -> %d, got %x; want XDP_TX, +%d, %x", repeat, action, n0, n1, out, repeat, swapMACs(want))
				}
				if bytes.Equal(want[14:], in[14:]) {
					t.Fatalf("repeat %d: new flow %d is the original frame", repeat, n1-1)
				}
				checkSums(t, want, tc.v6, tc.proto)
			}
		})
	}
}

// checkSums verifies the IPv4 header checksum and the TCP/UDP checksum of an
// untagged frame.
func checkSums(t *testing.T, f []byte, v6 bool, proto uint8) {
	t.Helper()
	l4 := 14 + 20
	var pseudo []byte
	if v6 {
		l4 = 14 + 40
		pseudo = append(pseudo, f[22:54]...)
		pseudo = binary.BigEndian.AppendUint32(pseudo, uint32(len(f)-l4))
		pseudo = append(pseudo, 0, 0, 0, proto)
	} else {
		if s := packet.Checksum(f[14:34]); s != 0 {
			t.Fatalf("IPv4 header checksum: %#x over the header; want 0", s)
		}
		pseudo = append(pseudo, f[26:34]...)
		pseudo = append(pseudo, 0, proto)
		pseudo = binary.BigEndian.AppendUint16(pseudo, uint16(len(f)-l4))
	}
	if s := packet.Checksum(append(pseudo, f[l4:]...)); s != 0 {
		t.Fatalf("L4 checksum: %#x over pseudo-header and segment; want 0", s)
	}
}

// TestVaryOffsets rejects frames the wrapper cannot give new flows.
func TestVaryOffsets(t *testing.T) {
	for name, f := range map[string][]byte{
		"vlan": packet.Frame{VLAN: 5, Src: netip.MustParseAddrPort("10.0.0.1:1"), Dst: netip.MustParseAddrPort("10.0.0.2:2")}.Build(),
		"icmp": packet.Frame{Proto: packet.ProtoICMP, Src: netip.MustParseAddrPort("10.0.0.1:1"), Dst: netip.MustParseAddrPort("10.0.0.2:2"), ICMP: &packet.ICMP{Type: 8}}.Build(),
		"arp":  append(make([]byte, 12), 0x08, 0x06, 0, 0),
	} {
		if _, err := NewFlow(f, 1); err == nil {
			t.Errorf("%s: NewFlow succeeded; want an error", name)
		}
	}
}
