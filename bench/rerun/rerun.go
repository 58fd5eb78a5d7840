package rerun

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"
)

// frameMax is rerun.c's FRAME_MAX.
const frameMax = 512

// Rig is the loaded wrapper with its floors. One run at a time: the wrapper's state
// is shared by every run.
type Rig struct {
	objs RerunObjects
}

// Load loads the wrapper and the floors. It needs CAP_BPF and CAP_PERFMON (root): the
// wrapper finds the frame's place by subtracting pointers, which the verifier allows
// only programs loaded with CAP_PERFMON.
func Load() (*Rig, error) {
	r := &Rig{}
	if err := LoadRerunObjects(&r.objs, nil); err != nil {
		return nil, fmt.Errorf("load rerun: %w", err)
	}
	return r, nil
}

// Close releases the programs and the wrapper's map.
func (r *Rig) Close() error { return r.objs.Close() }

// Floor swaps the frame's MACs and returns XDP_TX: the least an XDP forwarder does,
// the yardstick of every ratio.
func (r *Rig) Floor() *ebpf.Program { return r.objs.FloorTx }

// PushFloor is Floor after growing the frame by 20 bytes at the front (one
// bpf_xdp_adjust_head), as an encapsulating program does; only meaningful under Run,
// which takes them off again.
func (r *Rig) PushFloor() *ebpf.Program { return r.objs.FloorPush }

// PushPullFloor grows the frame by 20 bytes at the front and takes them off again
// (two bpf_xdp_adjust_head calls), then is Floor: honest with and without Run.
func (r *Rig) PushPullFloor() *ebpf.Program { return r.objs.FloorPushPull }

// Result is what one Run measured.
type Result struct {
	Action  uint32        // the last iteration's verdict
	PerRun  time.Duration // the kernel's mean time per iteration, wrapper included
	Repeats uint64        // iterations the wrapper ran (more than asked if a signal interrupted the run)
	// TailMoves counts iterations that found the frame's end moved by the last: each
	// paid a bpf_xdp_adjust_tail the floor does not. 0 for every path weir's
	// benchmarks measure.
	TailMoves uint64
}

// Run runs target repeat times in one BPF_PROG_TEST_RUN, every iteration on frame as
// given: the wrapper restores it before tail-calling target. With newFlows every
// iteration is a new flow (see NewFlow). target must be an XDP program loaded for
// BPF_XDP (SEC("xdp")): Linux 6.18 keeps programs of another expected attach type out
// of the wrapper's prog array. Call Run in the network namespace whose devices and
// routes target's helpers (fib lookups, the ingress device) should see.
func (r *Rig) Run(target *ebpf.Program, frame []byte, repeat int, newFlows bool) (Result, error) {
	if err := r.prepare(target, frame, newFlows); err != nil {
		return Result{}, err
	}
	runs0, tail0, err := r.counters()
	if err != nil {
		return Result{}, err
	}
	// cilium/ebpf retries a run that a signal interrupted, on a new buffer: the
	// wrapper must record the frame's place again.
	ret, d, err := r.objs.Rerun.Benchmark(frame, repeat, r.restart)
	if err != nil {
		return Result{}, fmt.Errorf("rerun: %w", err)
	}
	runs1, tail1, err := r.counters()
	if err != nil {
		return Result{}, err
	}
	return Result{Action: ret, PerRun: d, Repeats: runs1 - runs0, TailMoves: tail1 - tail0}, nil
}

// Output is Run without the timing, returning the frame as the last of repeat
// iterations left it: for checking that every iteration saw the frame it should.
func (r *Rig) Output(target *ebpf.Program, frame []byte, repeat int, newFlows bool) (uint32, []byte, error) {
	if err := r.prepare(target, frame, newFlows); err != nil {
		return 0, nil, err
	}
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+256), Repeat: uint32(repeat), Reset: r.restart}
	ret, err := r.objs.Rerun.Run(&opts)
	if err != nil {
		return 0, nil, fmt.Errorf("rerun: %w", err)
	}
	return ret, opts.DataOut, nil
}

// restart readies the wrapper for cilium/ebpf's retry of an interrupted run (see Run).
func (r *Rig) restart() { _ = r.objs.Started.Set(uint32(0)) }

// prepare points the wrapper at target, frame and, with newFlows, the words to vary.
func (r *Rig) prepare(target *ebpf.Program, frame []byte, newFlows bool) error {
	if len(frame) < 14 || len(frame) > frameMax {
		return fmt.Errorf("rerun: frame of %d bytes: need 14..%d", len(frame), frameMax)
	}
	if err := r.objs.Target.Put(uint32(0), target); err != nil {
		return fmt.Errorf("rerun: set target: %w", err)
	}
	var buf [frameMax]byte
	copy(buf[:], frame)
	var v vary
	if newFlows {
		var err error
		if v, err = varyOffsets(frame); err != nil {
			return err
		}
	}
	for _, s := range []struct {
		v   *ebpf.Variable
		val any
	}{
		{r.objs.Frame, buf},
		{r.objs.FrameLen, uint32(len(frame))},
		{r.objs.VarySportOff, v.sport},
		{r.objs.VarySaddrOff, v.saddr},
		{r.objs.VaryL4csumOff, v.l4csum},
		{r.objs.VaryL3csumOff, v.l3csum},
		{r.objs.Started, uint32(0)},
	} {
		if err := s.v.Set(s.val); err != nil {
			return fmt.Errorf("rerun: set variable: %w", err)
		}
	}
	return nil
}

// counters reads the wrapper's iteration and tail-move counters.
func (r *Rig) counters() (runs, tailMoves uint64, err error) {
	if err := r.objs.Runs.Get(&runs); err != nil {
		return 0, 0, fmt.Errorf("rerun: read runs: %w", err)
	}
	if err := r.objs.TailMoves.Get(&tailMoves); err != nil {
		return 0, 0, fmt.Errorf("rerun: read tail moves: %w", err)
	}
	return runs, tailMoves, nil
}

// Flows is how many new flows the wrapper has handed out: the next Run with newFlows
// starts at NewFlow(frame, Flows()).
func (r *Rig) Flows() (uint32, error) {
	var n uint32
	if err := r.objs.Flows.Get(&n); err != nil {
		return 0, fmt.Errorf("rerun: read flows: %w", err)
	}
	return n, nil
}

// vary is where in a frame the wrapper changes the flow: byte offsets of the source
// port, of the source address's last 16 bits and of the checksums covering them (0:
// none).
type vary struct {
	sport, saddr, l4csum, l3csum uint32
}

// varyOffsets finds the words to vary in an untagged Ethernet IPv4 or IPv6 frame
// carrying TCP or UDP right after the IP header.
func varyOffsets(f []byte) (vary, error) {
	var v vary
	var l4 int
	var proto byte
	switch binary.BigEndian.Uint16(f[12:]) {
	case 0x0800:
		if len(f) < 14+20 {
			return v, errors.New("rerun: new flows: truncated IPv4 header")
		}
		l4 = 14 + int(f[14]&0x0f)*4
		proto = f[14+9]
		v.saddr, v.l3csum = 14+12+2, 14+10
	case 0x86dd:
		if len(f) < 14+40 {
			return v, errors.New("rerun: new flows: truncated IPv6 header")
		}
		l4, proto = 14+40, f[14+6]
		v.saddr = 14 + 8 + 14
	default:
		return v, fmt.Errorf("rerun: new flows: ethertype %#04x: need untagged IPv4 or IPv6", binary.BigEndian.Uint16(f[12:]))
	}
	v.sport = uint32(l4)
	switch proto {
	case 6:
		v.l4csum = uint32(l4 + 16)
	case 17:
		v.l4csum = uint32(l4 + 6)
		if len(f) >= l4+8 && binary.BigEndian.Uint16(f[l4+6:]) == 0 && v.l3csum != 0 {
			v.l4csum = 0 // IPv4 UDP without a checksum keeps none
		}
	default:
		return v, fmt.Errorf("rerun: new flows: IP protocol %d: need TCP or UDP", proto)
	}
	if len(f) < int(v.l4csum)+2 || len(f) < l4+4 {
		return v, errors.New("rerun: new flows: truncated TCP/UDP header")
	}
	return v, nil
}

// NewFlow is the frame the wrapper hands the program under test as its n-th new
// flow (counting from 0 over the Rig's life): source port 1024 + (n & 0x7fff), the
// source address's last 16 bits xored with n >> 15, checksums updated.
func NewFlow(frame []byte, n uint32) ([]byte, error) {
	v, err := varyOffsets(frame)
	if err != nil {
		return nil, err
	}
	f := append([]byte(nil), frame...)
	port := uint16(1024 + n&0x7fff)
	oldPort := binary.BigEndian.Uint16(f[v.sport:])
	oldAddr := binary.BigEndian.Uint16(f[v.saddr:])
	addr := oldAddr ^ uint16(n>>15)
	if v.l4csum != 0 {
		c := binary.BigEndian.Uint16(f[v.l4csum:])
		c = csumReplace(csumReplace(c, oldPort, port), oldAddr, addr)
		binary.BigEndian.PutUint16(f[v.l4csum:], c)
	}
	if v.l3csum != 0 {
		c := binary.BigEndian.Uint16(f[v.l3csum:])
		binary.BigEndian.PutUint16(f[v.l3csum:], csumReplace(c, oldAddr, addr))
	}
	binary.BigEndian.PutUint16(f[v.sport:], port)
	binary.BigEndian.PutUint16(f[v.saddr:], addr)
	return f, nil
}

// csumReplace is RFC 1624 eqn. 3, as rerun.c's csum_replace2.
func csumReplace(check, old, new uint16) uint16 {
	sum := uint32(^check) + uint32(^old) + uint32(new)
	sum = sum&0xffff + sum>>16
	sum = sum&0xffff + sum>>16
	return ^uint16(sum)
}
