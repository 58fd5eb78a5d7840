package loader

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
)

// The long-connection workload: every backend holds a connection for p2cHold before
// it answers and closes, backend p2cSlow three times as long; clients open
// p2cConns connections at p2cRate a second (exponential gaps).
const (
	p2cPort  = 9200
	p2cHold  = 30 * time.Millisecond
	p2cSlow  = 2
	p2cRate  = 500.0
	p2cConns = 1500
)

// holdServer is one backend's server: it counts its open connections.
type holdServer struct {
	open     atomic.Int64
	accepted atomic.Int64
}

// serveHold starts a server on ns's port p2cPort (every address: the VIP on lo for
// dsr, the backend's own for nat) that reads a line, waits hold, answers and closes.
func serveHold(t *testing.T, ns *netns.NS, hold time.Duration) *holdServer {
	t.Helper()
	ln, err := ns.Listen("tcp", fmt.Sprintf(":%d", p2cPort))
	if err != nil {
		t.Fatal(err)
	}
	s := &holdServer{}
	var conns sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		conns.Wait()
	})
	// Exits when the listener is closed at cleanup.
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.open.Add(1)
			s.accepted.Add(1)
			conns.Add(1)
			// Exits after one answer, or when the client goes away.
			go func() {
				defer conns.Done()
				defer s.open.Add(-1)
				defer c.Close()
				c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
					return
				}
				time.Sleep(hold)
				io.WriteString(c, "done\n")
			}()
		}
	}()
	return s
}

// p2cRun is what one workload measured.
type p2cRun struct {
	maxOverMean    float64  // busiest backend's open connections ÷ the mean, averaged over samples
	slowShare      float64  // share of connections the slow backend accepted
	mean, p50, p99 float64  // connection time, ms
	second         float64  // share of new flows that took their second candidate
	accepted       [3]int64 // per backend
	meanOpen       [3]float64
}

// runHoldWorkload opens p2cConns connections to vip through the balancer and samples
// the backends' open connections every 5 ms while they run.
func runHoldWorkload(t *testing.T, tp *topo.Topology, p *Program, vip netip.AddrPort, servers []*holdServer, seed uint64) p2cRun {
	t.Helper()
	before, err := p.Stats()
	if err != nil {
		t.Fatal(err)
	}
	accepted0 := make([]int64, len(servers))
	for i, s := range servers {
		accepted0[i] = s.accepted.Load()
	}
	var r p2cRun
	stop := make(chan struct{})
	sampled := make(chan struct{})
	// Samples until stop closes.
	go func() {
		defer close(sampled)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		var n int
		var sums [3]float64
		for {
			select {
			case <-stop:
				if n > 0 {
					r.maxOverMean /= float64(n)
					for i := range sums {
						r.meanOpen[i] = sums[i] / float64(n)
					}
				}
				return
			case <-tick.C:
			}
			var total, top int64
			for i, s := range servers {
				o := s.open.Load()
				total += o
				top = max(top, o)
				sums[i] += float64(o)
			}
			if total > 0 {
				r.maxOverMean += float64(top) * float64(len(servers)) / float64(total)
				n++
			}
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rng := rand.New(rand.NewPCG(seed, 1))
	times := make([]float64, p2cConns)
	errs := make(chan error, p2cConns)
	var clients sync.WaitGroup
	next := time.Now()
	for i := range p2cConns {
		next = next.Add(time.Duration(rng.ExpFloat64() / p2cRate * float64(time.Second)))
		time.Sleep(time.Until(next))
		clients.Add(1)
		// Exits when its connection ends (or ctx's deadline).
		go func() {
			defer clients.Done()
			start := time.Now()
			c, err := tp.Client.NS.DialContext(ctx, "tcp", vip.String())
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.WriteString(c, "hold\n"); err != nil {
				errs <- err
				return
			}
			got, err := io.ReadAll(c)
			if err != nil || string(got) != "done\n" {
				errs <- fmt.Errorf("read %q: %v", got, err)
				return
			}
			times[i] = float64(time.Since(start).Microseconds()) / 1000
		}()
	}
	clients.Wait()
	close(stop)
	<-sampled
	close(errs)
	if n := len(errs); n > 0 {
		t.Fatalf("%d of %d connections failed; first: %v", n, p2cConns, <-errs)
	}
	var total int64
	for i, s := range servers {
		r.accepted[i] = s.accepted.Load() - accepted0[i]
		total += r.accepted[i]
	}
	r.slowShare = float64(r.accepted[p2cSlow]) / float64(total)
	slices.Sort(times)
	r.p50, r.p99 = times[len(times)/2], times[len(times)*99/100]
	for _, x := range times {
		r.mean += x / float64(len(times))
	}
	after, err := p.Stats()
	if err != nil {
		t.Fatal(err)
	}
	news := after.Reasons[ReasonFlowNew].Packets - before.Reasons[ReasonFlowNew].Packets
	seconds := after.Reasons[ReasonFlowSecondChoice].Packets - before.Reasons[ReasonFlowSecondChoice].Packets
	if news > 0 {
		r.second = float64(seconds) / float64(news)
	}
	return r
}

// TestP2CLongConnections puts maglev_p2c to the test with real connections through
// XDP, in nat and dsr mode: 3 backends, one holding its connections three times as
// long. maglev splits new flows evenly, so the slow backend holds three times the
// others' open connections; maglev_p2c must send it less and even out the open
// connections, and every count in backend_load must be back at 0 once the
// connections have closed (nat counts both directions' FINs, dsr the client's).
func TestP2CLongConnections(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wpc"), Backends: 3})
	servers := make([]*holdServer, len(tp.Backends))
	for i, b := range tp.Backends {
		hold := p2cHold
		if i == p2cSlow {
			hold *= 3
		}
		servers[i] = serveHold(t, b.NS, hold)
	}
	p := attachBalancer(t, tp, ModeNative, Options{HashSeed: 7, NAT: NATOptions{Addr4: tp.Balancer.IP4}})
	for _, fwd := range []Forwarding{ForwardNAT, ForwardDSR} {
		t.Run(fwd.String(), func(t *testing.T) {
			s := Service{Key: ServiceKey{netip.AddrPortFrom(tp.VIP4, p2cPort), TCP}, Forwarding: fwd}
			for _, b := range tp.Backends {
				be := Backend{Addr: netip.AddrPortFrom(b.IP4, p2cPort), Weight: 1, Usable: true}
				if fwd == ForwardDSR {
					be.MAC = b.MAC
				}
				s.Backends = append(s.Backends, be)
			}
			runs := map[bool]p2cRun{}
			for _, p2c := range []bool{false, true} {
				s.P2C = p2c
				if err := p.SetService(s); err != nil {
					t.Fatal(err)
				}
				r := runHoldWorkload(t, tp, p, s.Key.VIP, servers, 11)
				runs[p2c] = r
				name := map[bool]string{false: "maglev", true: "maglev_p2c"}[p2c]
				t.Logf("%s %s: open max/mean %.2f, mean open %.1f/%.1f/%.1f, accepted %v (slow %.1f%%), connection time mean %.1f ms p50 %.1f ms p99 %.1f ms, second candidate %.1f%%",
					fwd, name, r.maxOverMean, r.meanOpen[0], r.meanOpen[1], r.meanOpen[2], r.accepted, 100*r.slowShare, r.mean, r.p50, r.p99, 100*r.second)
				// Every connection has closed: the program's counts are back at 0.
				ok := waitfor.Cond(5*time.Second, func() bool {
					for _, b := range s.Backends {
						if p.load(t, s.Key, b.Addr) != 0 {
							return false
						}
					}
					return true
				})
				if !ok {
					var loads []int64
					for _, b := range s.Backends {
						loads = append(loads, p.load(t, s.Key, b.Addr))
					}
					t.Errorf("%s: backend_load %v after every connection closed; want all 0", name, loads)
				}
			}
			mg, pc := runs[false], runs[true]
			if mg.second != 0 {
				t.Errorf("maglev took a second candidate for %.1f%% of flows; want none", 100*mg.second)
			}
			if pc.maxOverMean >= mg.maxOverMean || pc.slowShare >= mg.slowShare {
				t.Errorf("maglev_p2c open max/mean %.2f, slow share %.3f; want both below maglev's %.2f, %.3f",
					pc.maxOverMean, pc.slowShare, mg.maxOverMean, mg.slowShare)
			}
		})
	}
}
