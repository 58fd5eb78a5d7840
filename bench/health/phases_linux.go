package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/health"
)

type phaseEnv struct {
	o                 options
	addrs             []netip.Addr
	tcpPort, httpPort uint16
	topo              *topology
	listenerPid       int
	profile           bool // write the CPU profile of this checker phase
}

func (e *phaseEnv) run(ctx context.Context, phase string) (result, error) {
	switch phase {
	case "syn":
		return e.runChecker(ctx, phase, health.Check{Kind: health.TCP, Method: health.MethodSyn}, e.tcpPort)
	case "connect":
		return e.runChecker(ctx, phase, health.Check{Kind: health.TCP, Method: health.MethodConnect}, e.tcpPort)
	case "http":
		return e.runChecker(ctx, phase, health.Check{Kind: health.HTTP}, e.httpPort)
	case "connect-loop":
		return e.runConnectLoop(ctx)
	case "syn-loop":
		return e.runSynLoop(ctx)
	}
	return result{}, fmt.Errorf("unknown phase %q", phase)
}

// measure waits out -duration (or ctx), sampling the heap every second, and
// returns the CPU samples at both ends and the peak heap in use.
func (e *phaseEnv) measure(ctx context.Context, start func()) (a, b cpuSample, heap uint64, err error) {
	if e.profile {
		f, err := os.Create(e.o.cpuProfile)
		if err != nil {
			return a, b, 0, err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return a, b, 0, err
		}
		defer pprof.StopCPUProfile()
	}
	start()
	a = sample(e.listenerPid, e.topo.napi)
	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	for end := a.t.Add(e.o.duration); time.Now().Before(end); {
		select {
		case <-ticker.C:
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			heap = max(heap, ms.HeapInuse)
		case <-ctx.Done():
			return a, b, 0, ctx.Err()
		}
	}
	return a, sample(e.listenerPid, e.topo.napi), heap, nil
}

func (e *phaseEnv) runChecker(ctx context.Context, phase string, check health.Check, port uint16) (result, error) {
	var (
		measuring     atomic.Bool
		checks, fails atomic.Int64
		hist          = new(lagHist)
		errMu         sync.Mutex
		errCounts     = map[string]int{}
	)
	c := &health.Checker{
		MaxInFlight: e.o.maxInFlight,
		OnCheck: func(r health.Result) {
			if !measuring.Load() {
				return
			}
			checks.Add(1)
			if r.Err != nil {
				fails.Add(1)
				errMu.Lock()
				if len(errCounts) < 10 {
					errCounts[r.Err.Error()]++
				}
				errMu.Unlock()
			}
			hist.add(r.Lag())
		},
	}
	check.Interval, check.Timeout, check.Jitter, check.Initial = e.o.interval, e.o.timeout, health.DefaultJitter, health.Up
	if err := c.SetService("bench", health.Config{Check: check}); err != nil {
		return result{}, err
	}
	for _, a := range e.addrs {
		if err := c.Set(health.Backend{ID: netip.AddrPortFrom(a, port).String(), Service: "bench"}); err != nil {
			return result{}, err
		}
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	// Exits when stop cancels rctx, on every return path (deferred below).
	go func() { done <- c.Run(rctx) }()
	halted := false
	var runErr error
	halt := func() error {
		if !halted {
			halted = true
			stop()
			runErr = <-done
		}
		return runErr
	}
	defer halt()

	// The first interval spreads the first checks (and opens the kept-alive
	// connections); measure after it.
	time.Sleep(e.o.interval + e.o.interval/5)
	a, b, heap, err := e.measure(ctx, func() { measuring.Store(true) })
	measuring.Store(false)
	if err != nil {
		return result{}, err
	}
	errMu.Lock()
	for e, n := range errCounts {
		fmt.Fprintf(os.Stderr, "bench/health: %s: %d checks failed: %s\n", phase, n, e)
	}
	if len(errCounts) > 0 {
		fmt.Fprintf(os.Stderr, "bench/health: %s: backends' kernel: %s\n", phase, tcpCounters(fmt.Sprintf("/proc/%d/net/netstat", e.listenerPid),
			"ListenOverflows", "ListenDrops", "SyncookiesSent", "TCPReqQFullDrop", "TCPReqQFullDoCookies"))
		fmt.Fprintf(os.Stderr, "bench/health: %s: checker's kernel: %s, raw socket drops %d\n", phase,
			tcpCounters("/proc/self/net/snmp", "InErrs", "OutRsts", "InSegs"), rawDrops())
	}
	errMu.Unlock()
	goroutines := runtime.NumGoroutine()
	rss := procRSS()
	method, merr := c.Method("bench")
	if err := halt(); err != nil {
		return result{}, err
	}
	r := result{Phase: phase, Backends: len(e.addrs), Interval: e.o.interval.String(), Method: method.String()}
	if merr != nil {
		r.Method += " (" + merr.Error() + ")"
	}
	if check.Kind == health.HTTP {
		r.Method = "http keep-alive"
	}
	r.fill(a, b, checks.Load(), fails.Load())
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	r.LagP50, r.LagP99, r.LagMax = ms(hist.quantile(0.50)), ms(hist.quantile(0.99)), ms(time.Duration(hist.max.Load()))
	r.HeapInuse = float64(heap) / (1 << 20)
	r.RSS = rss
	r.Goroutines = float64(goroutines)
	return r, nil
}

// pace calls send perTick times every millisecond for -duration, spreading one
// check of every address over each interval, as the checker does.
func (e *phaseEnv) pace(ctx context.Context, send func(i int)) error {
	const tick = time.Millisecond
	perTick := max(1, len(e.addrs)*int(tick)/int(e.o.interval))
	ticker := time.NewTicker(tick)
	defer ticker.Stop()
	next := 0
	for end := time.Now().Add(e.o.duration); time.Now().Before(end); {
		select {
		case <-ticker.C:
		case <-ctx.Done():
			return ctx.Err()
		}
		for range perTick {
			send(next % len(e.addrs))
			next++
		}
	}
	return nil
}

// runConnectLoop dials and closes every address once per interval with
// nothing else: no state, no hysteresis, no heap. What the checker's connect
// method spends beyond it is its own overhead.
func (e *phaseEnv) runConnectLoop(ctx context.Context) (result, error) {
	var checks, fails atomic.Int64
	d := net.Dialer{KeepAlive: -1}
	sem := make(chan struct{}, 1024)
	var wg sync.WaitGroup
	a := sample(e.listenerPid, e.topo.napi)
	err := e.pace(ctx, func(i int) {
		addr := netip.AddrPortFrom(e.addrs[i], e.tcpPort).String()
		sem <- struct{}{}
		wg.Add(1)
		// Exits when the dial ends, within the timeout.
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			cctx, cancel := context.WithTimeout(ctx, e.o.timeout)
			defer cancel()
			checks.Add(1)
			conn, err := d.DialContext(cctx, "tcp", addr)
			if err != nil {
				fails.Add(1)
				return
			}
			conn.Close()
		}()
	})
	wg.Wait()
	b := sample(e.listenerPid, e.topo.napi)
	if err != nil {
		return result{}, err
	}
	r := result{Phase: "connect-loop", Backends: len(e.addrs), Interval: e.o.interval.String()}
	r.fill(a, b, checks.Load(), fails.Load())
	return r, nil
}

// runSynLoop sends a SYN to every address once per interval from one raw
// socket and counts the SYN-ACKs that a socket filter lets through: the floor
// of what a syn check can cost, with no matching, no timeouts, no state.
func (e *phaseEnv) runSynLoop(ctx context.Context) (result, error) {
	const lo, hi = 65000, 65535 // outside the checker's range
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		return result{}, fmt.Errorf("raw socket: %w", err)
	}
	filter := []unix.SockFilter{
		{Code: unix.BPF_LDX | unix.BPF_B | unix.BPF_MSH, K: 0},
		{Code: unix.BPF_LD | unix.BPF_H | unix.BPF_IND, K: 2},
		{Code: unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K, Jt: 0, Jf: 4, K: lo},
		{Code: unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K, Jt: 3, Jf: 0, K: hi},
		{Code: unix.BPF_LD | unix.BPF_B | unix.BPF_IND, K: 13},
		{Code: unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K, Jt: 0, Jf: 1, K: 0x16}, // SYN, ACK or RST
		{Code: unix.BPF_RET | unix.BPF_K, K: 128},
		{Code: unix.BPF_RET | unix.BPF_K, K: 0},
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &prog); err != nil {
		unix.Close(fd)
		return result{}, fmt.Errorf("attach filter: %w", err)
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 4<<20)
	f := os.NewFile(uintptr(fd), "syn-loop")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return result{}, err
	}
	var answered, sent, fails atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	// Exits when f is closed below.
	go func() {
		defer wg.Done()
		buf := make([]byte, 256)
		for {
			if err := rc.Read(func(fd uintptr) bool {
				for {
					n, err := unix.Read(int(fd), buf)
					if err != nil {
						return err != unix.EAGAIN
					}
					if n >= 20 && n >= int(buf[0]&0xf)*4+14 && buf[int(buf[0]&0xf)*4+13]&0x12 == 0x12 {
						answered.Add(1)
					}
				}
			}); err != nil {
				return
			}
		}
	}()
	src := e.topo.src.As4()
	pkt := make([]byte, 24)
	a := sample(e.listenerPid, e.topo.napi)
	err = e.pace(ctx, func(i int) {
		dst := e.addrs[i].As4()
		synPacket(pkt, src, dst, uint16(lo+i%(hi-lo+1)), e.tcpPort, rand.Uint32())
		sent.Add(1)
		if err := unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: dst}); err != nil {
			fails.Add(1)
		}
	})
	time.Sleep(50 * time.Millisecond) // the last answers
	b := sample(e.listenerPid, e.topo.napi)
	f.Close()
	wg.Wait()
	if err != nil {
		return result{}, err
	}
	r := result{Phase: "syn-loop", Backends: len(e.addrs), Interval: e.o.interval.String()}
	r.fill(a, b, sent.Load(), max(fails.Load(), sent.Load()-answered.Load()))
	return r, nil
}

// synPacket writes a TCP SYN with an MSS option into b (24 bytes).
func synPacket(b []byte, src, dst [4]byte, sport, dport uint16, seq uint32) {
	clear(b)
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	binary.BigEndian.PutUint32(b[4:], seq)
	b[12], b[13] = 6<<4, 0x02
	binary.BigEndian.PutUint16(b[14:], 64240)
	b[20], b[21] = 2, 4
	binary.BigEndian.PutUint16(b[22:], 1460)
	sum := uint32(6 + len(b))
	for _, p := range [][]byte{src[:], dst[:], b} {
		for i := 0; i+1 < len(p); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(p[i:]))
		}
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	binary.BigEndian.PutUint16(b[16:], ^uint16(sum))
}

// lagHist counts scheduling lags in 50µs buckets up to 10s.
type lagHist struct {
	buckets [200000]atomic.Uint32
	max     atomic.Int64
}

const lagBucket = 50 * time.Microsecond

func (h *lagHist) add(d time.Duration) {
	d = max(d, 0)
	i := min(int(d/lagBucket), len(h.buckets)-1)
	h.buckets[i].Add(1)
	for m := h.max.Load(); int64(d) > m && !h.max.CompareAndSwap(m, int64(d)); m = h.max.Load() {
	}
}

// quantile returns the upper edge of the bucket holding quantile q.
func (h *lagHist) quantile(q float64) time.Duration {
	var total uint64
	for i := range h.buckets {
		total += uint64(h.buckets[i].Load())
	}
	want := uint64(q * float64(total))
	var seen uint64
	for i := range h.buckets {
		seen += uint64(h.buckets[i].Load())
		if seen > want {
			return time.Duration(i+1) * lagBucket
		}
	}
	return time.Duration(len(h.buckets)) * lagBucket
}

// tcpCounters picks named counters out of a /proc/net/netstat or snmp file
// (pairs of a header line and a value line), for diagnosing failed checks.
func tcpCounters(file string, names ...string) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(string(b), "\n")
	var out []string
	for i := 0; i+1 < len(lines); i += 2 {
		keys, vals := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		for k := range keys {
			if k < len(vals) && slices.Contains(names, keys[k]) {
				out = append(out, keys[0]+keys[k]+"="+vals[k])
			}
		}
	}
	return strings.Join(out, " ")
}

// rawDrops sums the drops column of this namespace's raw sockets.
func rawDrops() (n uint64) {
	b, _ := os.ReadFile("/proc/self/net/raw")
	for _, line := range strings.Split(string(b), "\n")[1:] {
		if f := strings.Fields(line); len(f) > 0 {
			d, _ := strconv.ParseUint(f[len(f)-1], 10, 64)
			n += d
		}
	}
	return n
}
