package xdptest

import (
	"errors"
	"fmt"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"
)

func TestUnavailable(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("create netns x: unshare: %w", unix.EPERM), true},
		{fmt.Errorf("attach: %w", unix.EOPNOTSUPP), true},
		{fmt.Errorf("load: %w", ebpf.ErrNotSupported), true},
		{errors.New("backend-1 answered; want backend-0"), false},
		{fmt.Errorf("add veth: %w", unix.EEXIST), false},
	} {
		if got := Unavailable(tc.err); got != tc.want {
			t.Errorf("Unavailable(%v) = %v; want %v", tc.err, got, tc.want)
		}
	}
}

// TestVerifierRejectionIsABug loads a program the verifier rejects (it
// returns without setting r0): its EACCES must not read as "unavailable".
func TestVerifierRejectionIsABug(t *testing.T) {
	_, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.XDP,
		Instructions: asm.Instructions{asm.Return()},
		License:      "GPL",
	})
	if _, ok := errors.AsType[*ebpf.VerifierError](err); !ok {
		SkipOrFail(t, fmt.Errorf("load a program: got %v; want a verifier error", err))
	}
	if !errors.Is(err, unix.EACCES) {
		t.Logf("verifier error does not wrap EACCES on this kernel: %v", err)
	}
	if Unavailable(err) {
		t.Errorf("Unavailable(verifier error) = true; want false")
	}
}
