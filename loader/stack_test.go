package loader

import (
	"regexp"
	"strconv"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/internal/xdptest"
)

// stackBudget is the deepest stack offset, in bytes below the frame pointer, that
// the committed XDP program may use. Past 512 (MAX_BPF_STACK) clang refuses to
// compile it and the verifier to load it; the budget sits below so that a change
// which grows the stack fails here, by name, while there is still room to win the
// bytes back. The program used 464 when this was set (24 bytes more in weir_xdp's
// frame gave 488 here and in the verifier's statistics).
const stackBudget = 480

// stackDepth is the deepest stack byte the instructions reach, as the verifier
// counts it: the lowest offset from r10 of a load or store through r10, or of a
// pointer made from r10 (`rX = r10; rX += -N`, handed to a helper or used for a
// later access). The scan is linear: a register stops counting as a frame pointer
// copy at its next write, a call clobbers r0-r5.
func stackDepth(insns asm.Instructions) int {
	depth := 0
	note := func(off int64) {
		if int(-off) > depth {
			depth = int(-off)
		}
	}
	fp := map[asm.Register]int64{} // registers holding r10 + offset
	for _, ins := range insns {
		cls := ins.OpCode.Class()
		switch {
		case cls == asm.LdXClass:
			if ins.Src == asm.R10 {
				note(int64(ins.Offset))
			} else if off, ok := fp[ins.Src]; ok {
				note(off + int64(ins.Offset))
			}
		case cls == asm.StClass || cls == asm.StXClass:
			if ins.Dst == asm.R10 {
				note(int64(ins.Offset))
			} else if off, ok := fp[ins.Dst]; ok {
				note(off + int64(ins.Offset))
			}
			continue
		}
		if ins.OpCode.JumpOp() == asm.Call && cls.IsJump() {
			for r := asm.R0; r <= asm.R5; r++ {
				delete(fp, r)
			}
			continue
		}
		if cls == asm.ALU64Class {
			off, tracked := fp[ins.Dst]
			switch {
			case ins.OpCode.ALUOp() == asm.Mov && ins.OpCode.Source() == asm.RegSource && ins.Src == asm.R10:
				fp[ins.Dst] = 0
				continue
			case ins.OpCode.ALUOp() == asm.Mov && ins.OpCode.Source() == asm.RegSource:
				if src, ok := fp[ins.Src]; ok {
					fp[ins.Dst] = src
					continue
				}
			case tracked && ins.OpCode.ALUOp() == asm.Add && ins.OpCode.Source() == asm.ImmSource:
				fp[ins.Dst] = off + ins.Constant
				note(off + ins.Constant)
				continue
			case tracked && ins.OpCode.ALUOp() == asm.Sub && ins.OpCode.Source() == asm.ImmSource:
				fp[ins.Dst] = off - ins.Constant
				note(off - ins.Constant)
				continue
			}
		}
		if cls.IsALU() || cls == asm.LdClass || cls == asm.LdXClass {
			delete(fp, ins.Dst)
		}
	}
	return depth
}

var verifierStackDepth = regexp.MustCompile(`stack depth (\d+)`)

// TestStackBudget reads the committed object's XDP program and fails when its
// stack reaches past stackBudget. Where the program can be loaded, the verifier's
// own figure (its statistics' "stack depth") must not exceed the scan's, so the
// scan is shown to miss no way the program reaches the stack.
func TestStackBudget(t *testing.T) {
	spec, err := bpf.LoadWeir()
	if err != nil {
		t.Fatal(err)
	}
	prog := spec.Programs["weir_xdp"]
	if prog == nil {
		t.Fatal("the object holds no weir_xdp program")
	}
	depth := stackDepth(prog.Instructions)
	t.Logf("weir_xdp: deepest stack offset %d of %d bytes (budget %d)", depth, 512, stackBudget)
	if depth > stackBudget {
		t.Errorf("weir_xdp reaches %d bytes below the frame pointer; want at most %d (the verifier refuses 512)", depth, stackBudget)
	}
	if depth == 0 {
		t.Fatal("the scan found no stack access at all; it no longer reads the instructions right")
	}

	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{
		Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats},
	})
	xdptest.Check(t, err)
	t.Cleanup(func() { coll.Close() })
	m := verifierStackDepth.FindStringSubmatch(coll.Programs["weir_xdp"].VerifierLog)
	if m == nil {
		t.Fatalf("no stack depth in the verifier's statistics:\n%s", coll.Programs["weir_xdp"].VerifierLog)
	}
	verified, _ := strconv.Atoi(m[1])
	t.Logf("the verifier reports stack depth %d", verified)
	if verified > depth {
		t.Errorf("the verifier's stack depth is %d; the scan of the object found %d", verified, depth)
	}
}
