package pktbench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/weir-lb/weir/internal/netns"
)

// Latency probes: a TCP echo server in the sink namespace at ProbeBackend
// behind a probe service (VIP4:ProbePort; weir nat and nftables DNAT send it
// there), and a prober in the generator namespace that sends a request over
// one established connection every ProbeInterval and times the echo. The
// line's sinks pass TCP frames of ProbePort to the stack, so probes cross a
// line whose sinks count and drop the load.
const (
	ProbePort     = 8080
	ProbeInterval = 2 * time.Millisecond
	// ProbeSize is a request's and its echo's TCP payload.
	ProbeSize = 64
	// probeTimeout fails a probe whose echo has not arrived by then (one
	// lost segment costs a retransmission timeout, ≥ 200 ms).
	probeTimeout = time.Second
)

// ProbeBackend is the echo server's address, on the sink namespace's
// loopback (10.78.3.0/24 is routed via s0).
var ProbeBackend = netip.MustParseAddr("10.78.3.100")

// echoServer echoes every connection's bytes, its handlers pinned to one CPU.
type echoServer struct {
	ln  net.Listener
	cpu int
	wg  sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]bool
}

// startEcho listens on addr inside ns. Handlers run on threads pinned to cpu
// (< 0: unpinned), so the echo's replies enter the line on that CPU.
func startEcho(ns *netns.NS, addr netip.AddrPort, cpu int) (*echoServer, error) {
	ln, err := ns.Listen("tcp4", addr.String())
	if err != nil {
		return nil, fmt.Errorf("echo server: %w", err)
	}
	e := &echoServer{ln: ln, cpu: cpu, conns: map[net.Conn]bool{}}
	e.wg.Add(1)
	// Exits when Close closes the listener.
	go e.accept()
	return e, nil
}

func (e *echoServer) accept() {
	defer e.wg.Done()
	for {
		c, err := e.ln.Accept()
		if err != nil {
			return
		}
		e.mu.Lock()
		e.conns[c] = true
		e.mu.Unlock()
		e.wg.Add(1)
		// Exits when the peer closes the connection or Close closes it.
		go e.serve(c)
	}
}

// serve echoes c's bytes until it ends.
func (e *echoServer) serve(c net.Conn) {
	defer e.wg.Done()
	defer func() {
		e.mu.Lock()
		delete(e.conns, c)
		e.mu.Unlock()
		c.Close()
	}()
	if e.cpu >= 0 {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		restore, err := pinThread(e.cpu)
		if err != nil {
			return
		}
		defer restore()
	}
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Close stops accepting, closes every connection and waits for the handlers.
func (e *echoServer) Close() error {
	err := e.ln.Close()
	e.mu.Lock()
	for c := range e.conns {
		c.Close()
	}
	e.mu.Unlock()
	e.wg.Wait()
	return err
}

// probeResult is what a prober measured: each probe's start and round trip,
// and the probes that failed (no echo within probeTimeout, or a connection
// that could not be made).
type probeResult struct {
	start []time.Time
	rtt   []time.Duration
	fails []time.Time
}

// within returns the round trips of probes started in [t0, t1) and the
// failures in it.
func (p probeResult) within(t0, t1 time.Time) (rtts []time.Duration, fails int) {
	for i, s := range p.start {
		if !s.Before(t0) && s.Before(t1) {
			rtts = append(rtts, p.rtt[i])
		}
	}
	for _, s := range p.fails {
		if !s.Before(t0) && s.Before(t1) {
			fails++
		}
	}
	return rtts, fails
}

// runProber probes dst from ns every ProbeInterval until ctx is done, from a
// thread pinned to cpu (< 0: unpinned), redialling after a failure.
func runProber(ctx context.Context, ns *netns.NS, dst netip.AddrPort, cpu int) (probeResult, error) {
	var res probeResult
	if cpu >= 0 {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		restore, err := pinThread(cpu)
		if err != nil {
			return res, err
		}
		defer restore()
	}
	req := make([]byte, ProbeSize)
	echo := make([]byte, ProbeSize)
	var c net.Conn
	defer func() {
		if c != nil {
			c.Close()
		}
	}()
	tick := time.NewTicker(ProbeInterval)
	defer tick.Stop()
	for seq := uint64(0); ; seq++ {
		select {
		case <-ctx.Done():
			return res, nil
		case <-tick.C:
		}
		start := time.Now()
		if c == nil {
			dctx, cancel := context.WithTimeout(ctx, probeTimeout)
			var err error
			c, err = ns.DialWith(dctx, &net.Dialer{}, "tcp4", dst.String())
			cancel()
			if err != nil {
				if ctx.Err() != nil {
					return res, nil
				}
				res.fails = append(res.fails, start)
				c = nil
				continue
			}
			c.(*net.TCPConn).SetNoDelay(true)
			start = time.Now()
		}
		req[0], req[1] = byte(seq), byte(seq>>8)
		c.SetDeadline(start.Add(probeTimeout))
		_, err := c.Write(req)
		if err == nil {
			_, err = io.ReadFull(c, echo)
		}
		if err == nil && (echo[0] != req[0] || echo[1] != req[1]) {
			err = errors.New("echo out of order")
		}
		if err != nil {
			if ctx.Err() != nil {
				return res, nil
			}
			res.fails = append(res.fails, start)
			c.Close()
			c = nil
			continue
		}
		res.start = append(res.start, start)
		res.rtt = append(res.rtt, time.Since(start))
	}
}

// percentile is the p-th percentile (0..1) of d by nearest rank, in µs.
func percentile(d []time.Duration, p float64) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(float64(len(s))*p+0.999999) - 1
	return float64(s[min(max(i, 0), len(s)-1)]) / 1e3
}
