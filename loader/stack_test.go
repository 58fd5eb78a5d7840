package loader

import (
	"fmt"
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

// stackDepth is the stack the verifier holds a program to (512 bytes): its own
// frame and, through bpf-to-bpf calls, the deepest chain of its callees' frames on
// top (each callee has a frame of its own, below its caller's). The verifier adds
// the frames each rounded up to 16 bytes (for a JITed program; the interpreter
// rounds to 32), so the sum counts them so too. insns is the program with its
// functions, each opened by its symbol, as cilium/ebpf links them.
func stackDepth(insns asm.Instructions) int {
	funcs := map[string]asm.Instructions{}
	var name string
	for _, ins := range insns {
		if s := ins.Symbol(); s != "" {
			name = s
		}
		funcs[name] = append(funcs[name], ins)
	}
	depths := map[string]int{}
	var chain func(fn string) int
	chain = func(fn string) int {
		if d, ok := depths[fn]; ok {
			return d
		}
		depths[fn] = 0 // BPF has no recursion; this only stops a loop in a bad object
		callees := 0
		for _, ins := range funcs[fn] {
			if ins.IsFunctionCall() {
				callees = max(callees, chain(ins.Reference()))
			}
		}
		depths[fn] = (frameDepth(funcs[fn])+15)&^15 + callees
		return depths[fn]
	}
	return chain(insns[0].Symbol())
}

// frameDepth is the deepest byte of its own frame a function's instructions reach,
// as the verifier counts it: the lowest offset from r10 of a load or store through
// r10, or of a pointer made from r10 (`rX = r10; rX += -N`, handed to a helper or
// used for a later access). The scan is linear: a register stops counting as a frame
// pointer copy at its next write, a call clobbers r0-r5.
func frameDepth(insns asm.Instructions) int {
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

var verifierStackDepth = regexp.MustCompile(`stack depth (\d+)[+\d]*`)

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
	own := frameDepth(prog.Instructions[:functionLen(prog.Instructions)])
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
	// The first figure is the program's own frame (with bpf-to-bpf calls, each
	// callee's follows: "464+32").
	verified, _ := strconv.Atoi(m[1])
	t.Logf("the verifier reports %s", m[0])
	if verified > own {
		t.Errorf("the verifier's stack depth is %d; the scan of the object's own frame found %d", verified, own)
	}
}

// functionLen is the number of instructions of the first function in insns: up to
// the next one's symbol.
func functionLen(insns asm.Instructions) int {
	for i := 1; i < len(insns); i++ {
		if insns[i].Symbol() != "" {
			return i
		}
	}
	return len(insns)
}

// TestStackDepthAddsCalledFrames: a bpf-to-bpf call's frame lies below its caller's,
// so a program of 192 bytes calling a function of 304 needs 496, past the budget,
// though neither frame alone is.
func TestStackDepthAddsCalledFrames(t *testing.T) {
	insns := asm.Instructions{
		asm.StoreImm(asm.R10, -192, 0, asm.Word).WithSymbol("prog"),
		asm.Call.Label("deep"),
		asm.Call.Label("shallow"),
		asm.Return(),
		asm.StoreImm(asm.R10, -304, 0, asm.Word).WithSymbol("deep"),
		asm.Return(),
		asm.Mov.Reg(asm.R1, asm.R10).WithSymbol("shallow"),
		asm.Add.Imm(asm.R1, -16),
		asm.Return(),
	}
	if got := stackDepth(insns); got != 496 {
		t.Errorf("stackDepth = %d; want 496", got)
	}
	if got := frameDepth(insns[:functionLen(insns)]); got != 192 {
		t.Errorf("the program's own frame = %d; want 192", got)
	}
}

// TestStackDepthRoundsFrames: the verifier adds the frames of a call chain each
// rounded up to 16 bytes. A program of 440 bytes calling down a chain of five
// functions of 8 bytes each has frames of 480 bytes, within the budget, yet the
// verifier counts 448 + 5 × 16 = 528 and refuses it; one of 456 calling three
// (464 + 3 × 16 = 512) it loads. stackDepth must say what the verifier holds, past
// 512 for the first.
func TestStackDepthRoundsFrames(t *testing.T) {
	for _, tc := range []struct {
		own, callees int
		want         int
		loads        bool
	}{
		{440, 5, 528, false},
		{456, 3, 512, true},
	} {
		name := fmt.Sprintf("%d calling %d of 8", tc.own, tc.callees)
		t.Run(name, func(t *testing.T) {
			insns := stackChain(tc.own, tc.callees)
			if got := stackDepth(insns); got != tc.want {
				t.Errorf("stackDepth = %d; want %d", got, tc.want)
			}
			prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, Instructions: insns, License: "GPL"})
			if err == nil {
				prog.Close()
			}
			if loads := err == nil; loads != tc.loads {
				t.Errorf("the verifier loads it: %v (%v); want %v", loads, err, tc.loads)
			}
		})
	}
}

// stackChain is a program with a frame of own bytes that calls down a chain of
// callees functions, each with a frame of 8 bytes, and returns XDP_PASS.
func stackChain(own, callees int) asm.Instructions {
	frame := func(sym string, depth int) asm.Instructions {
		return asm.Instructions{
			asm.Mov.Imm(asm.R1, 0).WithSymbol(sym),
			asm.StoreMem(asm.R10, int16(-depth), asm.R1, asm.DWord),
		}
	}
	insns := frame("prog", own)
	for i := range callees {
		insns = append(insns, asm.Call.Label(fmt.Sprintf("f%d", i)), asm.Mov.Imm(asm.R0, 2), asm.Return())
		insns = append(insns, frame(fmt.Sprintf("f%d", i), 8)...)
	}
	return append(insns, asm.Mov.Imm(asm.R0, 2), asm.Return())
}
