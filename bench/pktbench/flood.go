package pktbench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/weir-lb/weir/bench/pktgen"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/config"
)

// SYN floods against established streams. TCP streams run from the
// generator namespace through weir nat's stream service (VIP4:ProbePort,
// the probe service: one backend, a server on ProbeBackend in the sink
// namespace that counts and discards what it reads) while the generator
// floods the balancer with SYNs from FloodFlows spoofed sources × FloodPorts
// source ports: pktgen.Src4's 198.18.0.0/15, which the balancer namespace
// routes back to the generator's link, whose sink drops what comes back,
// and nowhere else. A flood aims at one of:
//
//   - the nat service VIP4:Port, whose NATBackends backends are addresses
//     behind s0, where the far sink counts and drops the flood's SYNs as
//     backends on other machines would take them. It shares the VIP, the
//     program, its flow tables and its per-CPU new-flow limit with the
//     streams' service, not its backend: what the flood costs the streams is
//     the balancer's work, not a backend's kernel answering it on this
//     machine;
//   - VIP4:NoServicePort, a port of the same address that no service has:
//     the program passes it to the balancer namespace's stack, which has no
//     route to the VIP (a route lookup, an ICMP unreachable that the kernel
//     rate-limits to about 1,000/s, a drop): what the kernel pays for a frame
//     XDP does not take.
//
// Streams are dialled and moving before the flood starts (a flood's
// new-flow limit would otherwise drop their SYNs too); after it stops each
// must deliver again within streamRecover, or it counts as broken.
//
// Two arrangements of the two CPUs (napi.go says why they matter):
//
//   - A flat-out flood, the capacity cases: as in every other case, the
//     generator's CPU does all the work (the frames are polled on it as it
//     sends them), and the rate the balancer takes is compared with the
//     floor's. ManyStreams interactive streams (TestSYNFlood's: 4 KiB every
//     100 ms each) run on the same CPU and check that established flows come
//     through it.
//   - SplitCPU, the comparisons: the generator has a CPU to itself and sends
//     at a fixed rate whatever the balancer costs, as a wire would; l0 is
//     polled by a kernel thread on the other CPU, where the FloodStreams
//     bulk streams and every other part of the line run. A flood's frames
//     share l0's ring and poll with the streams' and take their CPU: the
//     streams' throughput against their throughput with no flood says what
//     the flood costs them.

const (
	// NoServicePort is a port of VIP4 that no service has.
	NoServicePort = 81
	// FloodFlows × FloodPorts are the flood's distinct 5-tuples: every
	// source address of pktgen's range from each of FloodPorts source
	// ports (a kind of frame each), about a million. A tuple comes round
	// again after that many frames, when the half-open table has long
	// forgotten it (32,768 entries per CPU, and with the limit on at most
	// 125,000 new entries a second), so every SYN of the flood is a new
	// flow to the program, as from random sources.
	FloodFlows = pktgen.MaxFlows
	FloodPorts = pktgen.MaxTemplates
	// FloodStreams is how many bulk streams a comparison measures.
	FloodStreams = 4
	// ManyStreams is how many interactive streams ride a flat-out flood.
	ManyStreams = 200

	// streamChunk is what a bulk stream writes per call; interactive
	// streams write streamBurst every streamEvery.
	streamChunk = 64 << 10
	streamBurst = 4 << 10
	streamEvery = 100 * time.Millisecond
	// streamStart bounds the wait for every stream to deliver before the
	// load starts; streamRecover the wait, after the load stops, for every
	// stream to deliver again (a stream starved by a flood may be in
	// retransmission back-off).
	streamStart   = 3 * time.Second
	streamRecover = 3 * time.Second
	// streamDial bounds each stream's connect.
	streamDial = 2 * time.Second
)

// FloodRates are the fixed rates, in frames/s, at which floods aimed at the
// service and at no service are compared: from one the balancer's CPU takes
// with room to spare to one beyond what it takes aimed anywhere.
var FloodRates = []float64{0.25e6, 0.5e6, 1e6, 2e6}

// The new-flow limit at the config's default: DefaultNewFlowRate per CPU and
// a tenth of a second's worth of burst (userspace/config fills the burst in
// that way).
const (
	floodLimitRate  = config.DefaultNewFlowRate
	floodLimitBurst = config.DefaultNewFlowRate / 10
)

// The balancers of the flood cases: weir nat native with the new-flow limit
// at the config's default and with it off (loader.Options' zero value, as in
// every other weir case).
var (
	WeirNATLimit = Balancer{
		Name: fmt.Sprintf("weir nat native, new-flow limit %d/s", floodLimitRate), Group: "weir", Path: PathFar, Floor: "floor redirect native",
		Setup: setupWeirOpts(loader.ModeNative, loader.ForwardNAT, loader.Options{NewFlowRate: floodLimitRate, NewFlowBurst: floodLimitBurst}),
	}
	WeirNATNoLimit = Balancer{
		Name: "weir nat native, new-flow limit off", Group: "weir", Path: PathFar, Floor: "floor redirect native",
		Setup: setupWeirOpts(loader.ModeNative, loader.ForwardNAT, loader.Options{}),
	}
)

// FloodService and FloodNoService are where floods aim.
var (
	FloodService   = netip.AddrPortFrom(VIP4, Port)
	FloodNoService = netip.AddrPortFrom(VIP4, NoServicePort)
)

// FloodCases are the SYN-flood cases with the floor they are read against.
func FloodCases() []Case {
	return append([]Case{{Balancer: FloorRedirectNative, Flows: 1000}}, floodCases()...)
}

// floodCases: for each limit setting, ManyStreams interactive streams alone
// and through a flat-out flood aimed at the service; then, split, the bulk
// streams alone (for each limit setting) and at each of FloodRates through
// floods aimed at the service (limit on and off) and at no service.
func floodCases() []Case {
	flood := func(b Balancer, dst netip.AddrPort, rate float64) Case {
		return Case{Balancer: b, Flows: FloodFlows, SrcPorts: FloodPorts, Packet: pktgen.Packet{SYN: true, Dst: dst}, Rate: rate}
	}
	var cs []Case
	for _, b := range []Balancer{WeirNATLimit, WeirNATNoLimit} {
		alone := Case{Balancer: b, Idle: true}
		flat := flood(b, FloodService, 0)
		for _, c := range []*Case{&alone, &flat} {
			c.Streams, c.Interactive = ManyStreams, true
		}
		cs = append(cs, alone, flat)
	}
	split := func(c Case) Case {
		c.Streams, c.SplitCPU = FloodStreams, true
		return c
	}
	cs = append(cs, split(Case{Balancer: WeirNATLimit, Idle: true}), split(Case{Balancer: WeirNATNoLimit, Idle: true}))
	for _, r := range FloodRates {
		cs = append(cs,
			split(flood(WeirNATLimit, FloodService, r)),
			split(flood(WeirNATNoLimit, FloodService, r)),
			split(flood(WeirNATLimit, FloodNoService, r)),
		)
	}
	return cs
}

// floodTarget names where frames to dst go on the line: a service of
// setupWeir's, or no service.
func floodTarget(dst netip.AddrPort) string {
	switch dst {
	case netip.AddrPortFrom(VIP4, Port), netip.AddrPortFrom(VIP6, Port):
		return "service " + dst.String()
	}
	return dst.String() + " (no service)"
}

// floodTaken is the frames weir's program took a verdict on that were aimed
// at dst: those the service counted (forwarded), those dropped before it
// counts them (over the new-flow rate, for want of a port or a half-open
// slot, no backend) and those passed as no service. The streams' frames are
// another service's and are in none of these.
func floodTaken(st loader.Stats, dst netip.AddrPort) uint64 {
	n := st.Services[loader.ServiceKey{VIP: dst, Protocol: loader.TCP}].Packets
	for _, r := range []loader.Reason{
		loader.ReasonDropFlowRate, loader.ReasonDropHalfOpenFull, loader.ReasonDropNATPorts,
		loader.ReasonDropNoBackend, loader.ReasonPassNotService,
	} {
		n += st.Reasons[r].Packets
	}
	return n
}

// streams are established TCP connections from the generator namespace to
// the stream service, each written by a goroutine of its own (flat out, or
// interactive) and read by a server that counts and discards. Close stops
// them all.
type streams struct {
	ln          net.Listener
	cpu         int // writers' and readers' CPU; < 0: unpinned
	interactive bool
	wg          sync.WaitGroup

	closing atomic.Bool
	clients []*streamClient

	mu     sync.Mutex
	served []*streamServed // one per accepted connection, in accept order
}

// streamClient is one stream's sending end.
type streamClient struct {
	c   *net.TCPConn
	err atomic.Pointer[error] // the first write error, unless it came from Close
}

// streamServed is one stream's receiving end.
type streamServed struct {
	c   net.Conn
	n   atomic.Int64
	err atomic.Pointer[error] // the first read error, unless it came from Close
}

// startStreams listens on ProbeBackend:ProbePort in the sink namespace,
// dials n streams to VIP4:ProbePort from the generator namespace, starts
// them (interactive, or writing flat out), and returns once every one has
// delivered bytes (within streamStart). Writers and readers run on threads
// pinned to cpu (< 0: unpinned). No connection lives longer than limit.
func startStreams(l *Line, n int, interactive bool, cpu int, limit time.Duration) (_ *streams, err error) {
	ln, err := l.Sink.Listen("tcp4", netip.AddrPortFrom(ProbeBackend, ProbePort).String())
	if err != nil {
		return nil, fmt.Errorf("stream server: %w", err)
	}
	s := &streams{ln: ln, cpu: cpu, interactive: interactive}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	deadline := time.Now().Add(limit)
	s.wg.Add(1)
	// Exits when Close closes the listener.
	go s.accept(deadline)
	dst := netip.AddrPortFrom(VIP4, ProbePort).String()
	for i := range n {
		ctx, cancel := context.WithTimeout(context.Background(), streamDial)
		c, err := l.Gen.DialWith(ctx, &net.Dialer{}, "tcp4", dst)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("stream %d of %d: %w", i+1, n, err)
		}
		sc := &streamClient{c: c.(*net.TCPConn)}
		sc.c.SetDeadline(deadline)
		s.clients = append(s.clients, sc)
	}
	// Writers start once every stream is open: a dial behind streams
	// already writing flat out would queue behind them. Interactive ones
	// start spread over one interval, so that together they write evenly
	// and every window holds as many of their writes.
	for i, sc := range s.clients {
		s.wg.Add(1)
		// Exits when Close closes the connection, on a write error, or at
		// the deadline.
		go s.write(sc, time.Duration(i)*streamEvery/time.Duration(n))
	}
	for until := time.Now().Add(streamStart); ; time.Sleep(5 * time.Millisecond) {
		_, per := s.delivered()
		moving := 0
		for _, v := range per {
			if v > 0 {
				moving++
			}
		}
		if moving == n {
			return s, nil
		}
		if time.Now().After(until) {
			return nil, fmt.Errorf("streams: %d of %d delivered bytes within %v of being dialled; want all (is the stream service up?)", moving, n, streamStart)
		}
	}
}

// accept serves each connection until Close.
func (s *streams) accept(deadline time.Time) {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		c.SetDeadline(deadline)
		sv := &streamServed{c: c}
		s.mu.Lock()
		s.served = append(s.served, sv)
		s.mu.Unlock()
		s.wg.Add(1)
		// Exits at the stream's end: Close, an error or the deadline.
		go s.read(sv)
	}
}

// pin locks the calling goroutine to its thread and the thread to s.cpu; the
// returned func undoes both.
func (s *streams) pin() (func(), error) {
	if s.cpu < 0 {
		return func() {}, nil
	}
	runtime.LockOSThread()
	restore, err := pinThread(s.cpu)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	return func() {
		restore()
		runtime.UnlockOSThread()
	}, nil
}

// write sends zeros on sc until its connection ends: flat out, or, after
// delay, streamBurst every streamEvery.
func (s *streams) write(sc *streamClient, delay time.Duration) {
	defer s.wg.Done()
	unpin, err := s.pin()
	if err != nil {
		sc.err.Store(&err)
		return
	}
	defer unpin()
	buf := make([]byte, streamChunk)
	var tick <-chan time.Time
	if s.interactive {
		buf = buf[:streamBurst]
		time.Sleep(delay)
		t := time.NewTicker(streamEvery)
		defer t.Stop()
		tick = t.C
	}
	for {
		if tick != nil {
			// Close ends the wait: the write on a closed connection fails.
			<-tick
		}
		if _, err := sc.c.Write(buf); err != nil {
			if !s.closing.Load() {
				sc.err.Store(&err)
			}
			return
		}
	}
}

// read counts and discards what sv's connection delivers until it ends.
func (s *streams) read(sv *streamServed) {
	defer s.wg.Done()
	unpin, err := s.pin()
	if err != nil {
		sv.err.Store(&err)
		return
	}
	defer unpin()
	buf := make([]byte, 256<<10)
	for {
		n, err := sv.c.Read(buf)
		sv.n.Add(int64(n))
		if err != nil {
			if !s.closing.Load() && !errors.Is(err, io.EOF) {
				sv.err.Store(&err)
			}
			return
		}
	}
}

// delivered returns the bytes the server has read in all and per stream
// (in accept order).
func (s *streams) delivered() (total int64, per []int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	per = make([]int64, len(s.served))
	for i, sv := range s.served {
		per[i] = sv.n.Load()
		total += per[i]
	}
	return total, per
}

// idle counts the streams that delivered nothing between two readings of
// delivered (streams that never connected count too).
func (s *streams) idle(before, after []int64) int {
	n := len(s.clients) - len(after)
	for i, v := range after {
		if i >= len(before) || v <= before[i] {
			n++
		}
	}
	return n
}

// broken waits, up to within, for every stream to deliver beyond what
// delivered returned as since, and returns how many did not, or met an
// error (a reset, say) on either end, whichever is more.
func (s *streams) broken(ctx context.Context, since []int64, within time.Duration) int {
	until := time.Now().Add(within)
	for {
		_, now := s.delivered()
		stuck := s.idle(since, now)
		if stuck > 0 && time.Now().Before(until) && ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
			continue
		}
		sent, got := 0, 0
		for _, c := range s.clients {
			if c.err.Load() != nil {
				sent++
			}
		}
		s.mu.Lock()
		for _, sv := range s.served {
			if sv.err.Load() != nil {
				got++
			}
		}
		s.mu.Unlock()
		return max(stuck, sent, got)
	}
}

// Close ends every stream and the server and waits for their goroutines.
// It is idempotent.
func (s *streams) Close() error {
	s.closing.Store(true)
	err := s.ln.Close()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	for _, c := range s.clients {
		// No lingering: a stream's unsent bytes are of no interest.
		c.c.SetLinger(0)
		c.c.Close()
	}
	s.mu.Lock()
	for _, sv := range s.served {
		sv.c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}
