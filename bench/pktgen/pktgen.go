package pktgen

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/packet"
)

// Source addresses: flow f of a run comes from Src4 + f or Src6 + f, port
// SrcPort (or its kind's own). Both ranges are reserved for benchmarking (RFC 2544: 198.18.0.0/15;
// RFC 5180: 2001:2::/48), and both have room for MaxFlows flows.
var (
	Src4 = netip.MustParseAddr("198.18.0.0")
	Src6 = netip.MustParseAddr("2001:2::")
)

const (
	// SrcPort is every frame's source port unless its kind has its own;
	// flows of a kind differ by source address.
	SrcPort = 40000
	// MaxFlows is the most distinct flows a run cycles through (17 bits of
	// source address).
	MaxFlows = 1 << 17
	// MaxTemplates is the most kinds of frame in one mix (generator.c).
	MaxTemplates = 8
	// DefaultSize is the frame size when Packet.Size is 0: 64 bytes on the
	// wire, FCS included, the classic line-rate frame.
	DefaultSize = 64
	// fcs is the Ethernet frame check sequence, counted in sizes but never
	// in a veth's frames.
	fcs = 4

	scheduleLen   = 64
	templateBytes = 80
	// chunk bounds one BPF_PROG_RUN call of Run: a few seconds at the rates
	// this machine reaches, so even a lost stop signal ends a call soon.
	chunk = 1 << 24
)

// Packet is one kind of frame in a mix.
type Packet struct {
	IPv6 bool
	UDP  bool
	// SYN sends TCP SYNs (each a new flow to a balancer); otherwise TCP
	// frames are ACKs with payload (established flows). Ignored for UDP.
	SYN bool
	// Size is the Ethernet frame size with its 4-byte FCS, as RFC 2544
	// counts it; 0 means DefaultSize. It is raised to what the headers need
	// (an IPv6 TCP frame is at least 78).
	Size int
	// Weight is this kind's share of the mix, relative to the others; 0
	// counts as 1. Shares are rounded to 64ths.
	Weight int
	// Dst, if set, is where this kind goes instead of Config's Dst4 or
	// Dst6 (of the kind's family), so one mix can aim at several services.
	Dst netip.AddrPort
	// SrcPort, if not 0, is this kind's source port instead of SrcPort, so
	// kinds that differ only by port multiply the distinct 5-tuples a run
	// sends: each kind cycles through every flow's source address.
	SrcPort uint16
}

func (p Packet) String() string {
	return fmt.Sprintf("%s %dB", p.Traffic(), p.FrameSize())
}

// Traffic names the kind without its size: "v4 tcp ack", "v6 tcp syn", "v4 udp".
func (p Packet) Traffic() string {
	s := "v4"
	if p.IPv6 {
		s = "v6"
	}
	switch {
	case p.UDP:
		s += " udp"
	case p.SYN:
		s += " tcp syn"
	default:
		s += " tcp ack"
	}
	return s
}

// FrameSize is the frame's size with FCS after raising Size to the headers'
// length.
func (p Packet) FrameSize() int {
	size := p.Size
	if size == 0 {
		size = DefaultSize
	}
	hdr := 14 + 20
	if p.IPv6 {
		hdr = 14 + 40
	}
	if p.UDP {
		hdr += 8
	} else {
		hdr += 20
	}
	// 60 bytes is Ethernet's minimum frame without FCS.
	return max(size, hdr+fcs, 60+fcs)
}

// Config says what a Generator sends.
type Config struct {
	// SrcMAC and DstMAC address every frame: the sending link's MAC and
	// the next hop's.
	SrcMAC, DstMAC net.HardwareAddr
	// Dst4 and Dst6 are where IPv4 and IPv6 frames go (a VIP and port),
	// unless a kind of the mix has its own Dst.
	Dst4, Dst6 netip.AddrPort
	// Flows is the number of distinct 5-tuples, 1..MaxFlows; 0 means 1.
	// Frames cycle through the flows in order.
	Flows int
	// Mix lists the kinds of frame; empty means one IPv4 TCP ACK of
	// DefaultSize.
	Mix []Packet
	// Rate is frames per second per sending CPU; 0 sends flat out.
	Rate float64
}

// Frame returns the frame the generator sends for kind p of flow f: the
// bytes of its template, with the source address and checksums of flow f.
// Frames the generator sends carry these bytes up to the end of the headers;
// the payload is zeros here and whatever a recycled page held on the wire.
func (c Config) Frame(p Packet, f int) []byte {
	src, dst := Src4, c.dst(p)
	if p.IPv6 {
		src = Src6
	}
	src = flowAddr(src, f)
	sport := uint16(SrcPort)
	if p.SrcPort != 0 {
		sport = p.SrcPort
	}
	fr := packet.Frame{
		SrcMAC: c.SrcMAC, DstMAC: c.DstMAC,
		Src: netip.AddrPortFrom(src, sport), Dst: dst,
		Proto: packet.ProtoTCP, TCPFlags: packet.ACK,
	}
	if p.UDP {
		fr.Proto = packet.ProtoUDP
	} else if p.SYN {
		fr.TCPFlags = packet.SYN
	}
	hdr := len(fr.Build())
	fr.Payload = make([]byte, p.FrameSize()-fcs-hdr)
	return fr.Build()
}

// dst is where frames of kind p go: p.Dst, or Dst4 or Dst6 by family.
func (c Config) dst(p Packet) netip.AddrPort {
	switch {
	case p.Dst.IsValid():
		return p.Dst
	case p.IPv6:
		return c.Dst6
	}
	return c.Dst4
}

// template is the generator's description of one kind of frame.
func (c Config) template(p Packet) GeneratorTemplate {
	b := c.Frame(p, 0)
	t := GeneratorTemplate{FrameLen: uint16(len(b))}
	l4 := 14 + 20
	if p.IPv6 {
		l4 = 14 + 40
		t.SrcOff = 14 + 8 + 12
	} else {
		t.IpCsumOff = 14 + 10
		t.SrcOff = 14 + 12
	}
	t.L4CsumOff = uint16(l4 + 16)
	if p.UDP {
		t.L4CsumOff = uint16(l4 + 6)
		t.Udp = 1
	}
	t.CopyLen = uint16(min(len(b), templateBytes))
	copy(t.Bytes[:], b[:t.CopyLen])
	return t
}

func (c *Config) validate() error {
	if c.Flows == 0 {
		c.Flows = 1
	}
	if len(c.Mix) == 0 {
		c.Mix = []Packet{{}}
	}
	switch {
	case len(c.SrcMAC) != 6 || len(c.DstMAC) != 6:
		return fmt.Errorf("generator: src and dst MAC must be 6-byte Ethernet addresses, got %q and %q", c.SrcMAC, c.DstMAC)
	case c.Flows < 1 || c.Flows > MaxFlows:
		return fmt.Errorf("generator: flows must be 1..%d, got %d", MaxFlows, c.Flows)
	case len(c.Mix) > MaxTemplates:
		return fmt.Errorf("generator: mix: at most %d kinds of frame, got %d", MaxTemplates, len(c.Mix))
	case c.Rate < 0:
		return fmt.Errorf("generator: rate must be >= 0 frames/s, got %g", c.Rate)
	}
	for i, p := range c.Mix {
		dst := c.dst(p)
		if !dst.IsValid() || dst.Addr().Is6() != p.IPv6 || dst.Port() == 0 {
			return fmt.Errorf("generator: mix[%d] %s: destination %s: want an IPv%d address and a port (set Dst4/Dst6 or the kind's Dst)", i, p, dst, map[bool]int{false: 4, true: 6}[p.IPv6])
		}
		if p.Weight < 0 {
			return fmt.Errorf("generator: mix[%d] %s: weight must be >= 0, got %d", i, p, p.Weight)
		}
		if p.FrameSize()-fcs > 4000 {
			return fmt.Errorf("generator: mix[%d]: size must be at most %d, got %d", i, 4000+fcs, p.Size)
		}
	}
	return nil
}

// schedule spreads the mix's weights over 64 slots, largest remainders
// first, each kind getting at least one slot.
func schedule(mix []Packet) [scheduleLen]uint8 {
	total := 0
	for _, p := range mix {
		total += max(p.Weight, 1)
	}
	var s [scheduleLen]uint8
	slot := 0
	// Bresenham-style interleave: kind i appears near its share of every
	// stretch of the schedule, not in one block.
	credit := make([]float64, len(mix))
	for slot < scheduleLen {
		best := 0
		for i, p := range mix {
			credit[i] += float64(max(p.Weight, 1)) / float64(total)
			if credit[i] > credit[best] {
				best = i
			}
		}
		credit[best]--
		s[slot] = uint8(best)
		slot++
	}
	return s
}

// Counter is frames and bytes summed over CPUs.
type Counter struct {
	Packets, Bytes uint64
}

// Sub returns c - o.
func (c Counter) Sub(o Counter) Counter {
	return Counter{c.Packets - o.Packets, c.Bytes - o.Bytes}
}

// Generator is a loaded generator program with its configuration. Its
// methods are safe for concurrent use; Close it when done.
type Generator struct {
	cfg   Config
	objs  GeneratorObjects
	input []byte // the run's input frame: as long as the longest kind

	mu     sync.Mutex
	closed bool
}

// New loads the generator program and configures it. It needs CAP_BPF and
// CAP_NET_ADMIN (or root).
func New(cfg Config) (*Generator, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	g := &Generator{cfg: cfg}
	if err := LoadGeneratorObjects(&g.objs, nil); err != nil {
		return nil, fmt.Errorf("load generator: %w", err)
	}
	for i, p := range cfg.Mix {
		t := cfg.template(p)
		if err := g.objs.Templates.Put(uint32(i), &t); err != nil {
			g.objs.Close()
			return nil, fmt.Errorf("generator: set template %d: %w", i, err)
		}
		if n := int(t.FrameLen); n > len(g.input) {
			g.input = cfg.Frame(p, 0)
		}
	}
	gc := GeneratorGenConfig{Flows: uint32(cfg.Flows), Schedule: schedule(cfg.Mix)}
	if cfg.Rate > 0 {
		gc.IntervalNs = uint64(max(1, 1e9/cfg.Rate))
	}
	if err := g.objs.Config.Put(uint32(0), &gc); err != nil {
		g.objs.Close()
		return nil, fmt.Errorf("generator: set config: %w", err)
	}
	return g, nil
}

// Config returns the generator's configuration with defaults filled in.
func (g *Generator) Config() Config { return g.cfg }

// Close releases the program and its maps. It is idempotent; call it only
// after Run and Send have returned.
func (g *Generator) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	return g.objs.Close()
}

// Sent returns the frames sent so far, over every run and CPU. A frame
// counts once the program hands it to the interface (XDP_TX): frames the
// receiving side of the link then drops (a full ring) count as sent.
func (g *Generator) Sent() (Counter, error) {
	var per []GeneratorGenState
	if err := g.objs.State.Lookup(uint32(0), &per); err != nil {
		return Counter{}, fmt.Errorf("generator: read counters: %w", err)
	}
	var c Counter
	for _, s := range per {
		c.Packets += s.Packets
		c.Bytes += s.Bytes
	}
	return c, nil
}

// Send runs the program n times in one call, from the calling goroutine's
// thread switched into ns, sending out of the interface ifindex (an index in
// ns). With Rate 0 that is exactly n frames, the rest sent again when a
// signal interrupts the call; with a rate, runs that come too early send
// nothing, and an interrupted call is an error. It returns when the kernel is
// done. Run must not send with the same generator meanwhile.
func (g *Generator) Send(ns *netns.NS, ifindex int, n uint32) error {
	return ns.Do(func() error {
		// The generator's flow counters are per CPU, and a long live-frames run
		// may migrate when it yields (the kernel re-enables migration around
		// cond_resched): pinned, every frame continues the same counters, so n
		// frames of n flows are n distinct flows even on a loaded machine.
		restore, err := pinFirstAllowed()
		if err != nil {
			return err
		}
		defer restore()
		before, err := g.Sent()
		if err != nil {
			return err
		}
		for left := n; ; {
			err = g.liveRun(ifindex, left)
			if !errors.Is(err, unix.EINTR) || g.cfg.Rate > 0 {
				break
			}
			// A signal to the thread (the Go runtime's preemption, say)
			// ends the call after some of the frames: each one sent is
			// counted (at Rate 0 every run sends one), so send the rest.
			now, err := g.Sent()
			if err != nil {
				return err
			}
			if sent := now.Packets - before.Packets; sent < uint64(n) {
				left = n - uint32(sent)
				continue
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("generator: send %d frames on ifindex %d in %s: %w", n, ifindex, ns, err)
		}
		return nil
	})
}

// Run sends until ctx is done, out of the interface ifindex inside ns, from
// one thread per entry of cpus, each pinned to that CPU (an entry < 0 leaves
// its thread unpinned; empty cpus means one unpinned thread). Each thread
// makes long BPF_PROG_RUN calls, since each call costs tens of milliseconds
// of setup; when ctx is done Run interrupts them with a signal and returns
// once every thread is back.
func (g *Generator) Run(ctx context.Context, ns *netns.NS, ifindex int, cpus []int) error {
	if len(cpus) == 0 {
		cpus = []int{-1}
	}
	var (
		mu   sync.Mutex
		tids = make(map[int]bool) // threads inside their run loop
		wg   sync.WaitGroup
		errs = make([]error, len(cpus))
	)
	for i, cpu := range cpus {
		wg.Add(1)
		// Exits when ctx is done and the thread's current call is
		// interrupted, or on the first error.
		go func() {
			defer wg.Done()
			errs[i] = ns.Do(func() error {
				if cpu >= 0 {
					restore, err := pin(cpu)
					if err != nil {
						return err
					}
					defer restore()
				}
				tid := unix.Gettid()
				mu.Lock()
				tids[tid] = true
				mu.Unlock()
				defer func() {
					mu.Lock()
					delete(tids, tid)
					mu.Unlock()
				}()
				for ctx.Err() == nil {
					err := g.liveRun(ifindex, chunk)
					if err != nil && !errors.Is(err, unix.EINTR) {
						return fmt.Errorf("generator: run on ifindex %d in %s (cpu %d): %w", ifindex, ns, cpu, err)
					}
				}
				return nil
			})
		}()
	}
	done := make(chan struct{})
	// Exits when every sending goroutine has returned.
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		// A signal that lands just before a thread enters the kernel is
		// handled in user space and missed, so keep signalling until every
		// thread is out of its loop. SIGURG is the Go runtime's own
		// preemption signal, harmless to every goroutine.
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
	signal:
		for {
			mu.Lock()
			for tid := range tids {
				unix.Tgkill(unix.Getpid(), tid, unix.SIGURG)
			}
			mu.Unlock()
			select {
			case <-done:
				break signal
			case <-tick.C:
			}
		}
	}
	return errors.Join(errs...)
}

// pin binds the calling thread to cpu and returns what restores its old set.
// pinFirstAllowed pins the calling thread to the lowest CPU it may run on.
func pinFirstAllowed() (func(), error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("generator: get cpu affinity: %w", err)
	}
	for cpu := 0; cpu < 1024; cpu++ {
		if set.IsSet(cpu) {
			return pin(cpu)
		}
	}
	return nil, fmt.Errorf("generator: no cpu in the thread's affinity set")
}

func pin(cpu int) (func(), error) {
	var old, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		return nil, fmt.Errorf("generator: get cpu affinity: %w", err)
	}
	set.Set(cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("generator: pin to cpu %d: %w", cpu, err)
	}
	return func() { unix.SchedSetaffinity(0, &old) }, nil
}

// xdpMD is struct xdp_md, the context of an XDP program run.
type xdpMD struct {
	data, dataEnd, dataMeta, ingressIfindex, rxQueueIndex, egressIfindex uint32
}

// progRunAttr is the test member of union bpf_attr for BPF_PROG_TEST_RUN.
// cilium/ebpf's Program.Run restarts a call a signal interrupts, but a
// signal is how a live-frames run of unknown length ends, so the generator
// makes the call itself.
type progRunAttr struct {
	progFD      uint32
	retval      uint32
	dataSizeIn  uint32
	dataSizeOut uint32
	dataIn      unsafe.Pointer
	dataOut     unsafe.Pointer
	repeat      uint32
	duration    uint32
	ctxSizeIn   uint32
	ctxSizeOut  uint32
	ctxIn       unsafe.Pointer
	ctxOut      unsafe.Pointer
	flags       uint32
	cpu         uint32
	batchSize   uint32
	_           uint32
}

// liveRun is one BPF_PROG_RUN call in live-frames mode: the program runs
// repeat times on frames initialised from g.input, and every XDP_TX is sent
// out of ifindex (looked up in the calling thread's network namespace).
func (g *Generator) liveRun(ifindex int, repeat uint32) error {
	md := xdpMD{dataEnd: uint32(len(g.input)), ingressIfindex: uint32(ifindex)}
	attr := progRunAttr{
		progFD:     uint32(g.objs.Generate.FD()),
		dataSizeIn: uint32(len(g.input)),
		dataIn:     unsafe.Pointer(&g.input[0]),
		repeat:     repeat,
		ctxSizeIn:  uint32(unsafe.Sizeof(md)),
		ctxIn:      unsafe.Pointer(&md),
		flags:      unix.BPF_F_TEST_XDP_LIVE_FRAMES,
	}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_TEST_RUN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	runtime.KeepAlive(&md)
	runtime.KeepAlive(g.input)
	if errno != 0 {
		return fmt.Errorf("bpf_prog_run live frames: %w", errno)
	}
	return nil
}

// flowAddr is base + f in the address's last 4 bytes.
func flowAddr(base netip.Addr, f int) netip.Addr {
	a := base.AsSlice()
	binary.BigEndian.PutUint32(a[len(a)-4:], binary.BigEndian.Uint32(a[len(a)-4:])+uint32(f))
	addr, _ := netip.AddrFromSlice(a)
	return addr
}
