// Command fleet measures a fleet of weir nodes behind a real router (internal/fleet:
// BIRD 2 peering over eBGP with three agents, each XDP on its fabric link):
//
//   - how the router's ECMP spreads flows over the nodes: -flows short TCP
//     connections from 65 client addresses, each flow's node found with weir
//     explain on every node, against the spread of a uniform random choice (the
//     binomial standard deviation of a node's count), and the router's own
//     counters (nftables, per next hop) of the packets it sent each node;
//
//   - how long a VIP takes to leave, and come back to, the router's kernel table:
//     from every backend failing its health checks (interval 200ms, fall 2), from
//     weir node drain, and back from the backends' return and from undrain.
//
//     sudo flock /tmp/weir-bench.lock go run ./bench/fleet              # 3 runs
//     sudo flock /tmp/weir-bench.lock go run ./bench/fleet -runs 5 -flows 3000
//
// Each figure is the median over -runs runs, each on a fresh fleet. The agents are
// this program re-executed (the agent package's Run, what weir run runs).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"math"
	"net/netip"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"time"

	"github.com/weir-lb/weir/internal/fleet"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/userspace/agent"
)

const agentEnv = "WEIR_BENCH_FLEET_AGENT"

var (
	runs    = flag.Int("runs", 3, "runs, each on a fresh fleet; figures are medians")
	flows   = flag.Int("flows", 1500, "short TCP flows per run for the ECMP share")
	repeats = flag.Int("repeat", 5, "withdraw/announce cycles per run and cause")
	timeout = flag.Duration("timeout", 10*time.Minute, "bound on the whole run")
)

func main() {
	if cfg := os.Getenv(agentEnv); cfg != "" {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		err := agent.New(agent.Options{ConfigPath: cfg}).Run(ctx)
		stop()
		if err != nil {
			log.Fatal(err)
		}
		return
	}
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	var res []result
	for r := range *runs {
		x, err := run(ctx)
		if err != nil {
			log.Fatalf("run %d: %v", r+1, err)
		}
		log.Printf("run %d: shares %v (max deviation %.2f σ); withdraw health %v drain %v; announce health %v undrain %v",
			r+1, x.shares, x.maxSigma, x.withdrawHealth, x.withdrawDrain, x.announceHealth, x.announceDrain)
		res = append(res, x)
	}
	report(res)
}

type result struct {
	shares                        []float64 // per node, of all flows
	routerShares                  []float64 // per node, of the packets the router sent to the VIP
	maxSigma                      float64   // the largest |count - n/3| in binomial σ
	withdrawHealth, withdrawDrain time.Duration
	announceHealth, announceDrain time.Duration
	detectHealth                  time.Duration // until node-0's status withdrew it
}

func run(ctx context.Context) (x result, err error) {
	exe, err := os.Executable()
	if err != nil {
		return x, err
	}
	dir, err := os.MkdirTemp("", "weir-bench-fleet-")
	if err != nil {
		return x, err
	}
	defer os.RemoveAll(dir)
	f, err := fleet.Start(fleet.Options{Dir: dir,
		AgentArgv: func(cfg string) []string { return []string{"env", agentEnv + "=" + cfg, exe} }})
	if err != nil {
		return x, err
	}
	defer func() {
		if cerr := f.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	so := fleet.ServiceOptions{Mode: "dsr", VIP: topo.FleetVIP4, Backends: f.T.DSR, HashSeed: 7}
	if err := f.WriteConfigs(so); err != nil {
		return x, err
	}
	for i := range f.Nodes {
		if err := f.StartAgent(ctx, i); err != nil {
			return x, err
		}
	}
	prefix := netip.PrefixFrom(so.VIP, 32)
	all := f.NodeIPs(fleet.All(len(f.Nodes))...)
	if _, err := f.WaitNextHops(ctx, prefix, all, 10*time.Second); err != nil {
		return x, err
	}

	if err := f.CountNextHops(so.VIP); err != nil {
		return x, err
	}
	// ECMP share: short flows, in batches the client's ports and the nodes' flow
	// tables take in their stride.
	counts := make([]int, len(f.Nodes))
	for done := 0; done < *flows; {
		n := min(300, *flows-done)
		ss := f.StartStreams(ctx, netip.AddrPortFrom(so.VIP, fleet.StreamPort),
			fleet.StreamOptions{Streams: n, Chunks: 1, Chunk: 64, Interval: time.Millisecond, Timeout: 10 * time.Second})
		out := ss.Wait()
		if k, first := fleet.Failed(out); k > 0 {
			return x, fmt.Errorf("%d short flows failed: %v", k, first)
		}
		owners, err := f.Owners(ctx, "stream", ss.Locals())
		if err != nil {
			return x, err
		}
		for _, o := range owners {
			if o < 0 {
				return x, fmt.Errorf("a flow no node tracks")
			}
			counts[o]++
		}
		done += n
	}
	routed, err := f.NextHopPackets()
	if err != nil {
		return x, err
	}
	var total uint64
	for _, n := range routed {
		total += n
	}
	for _, n := range routed {
		x.routerShares = append(x.routerShares, float64(n)/float64(total))
	}
	p := 1 / float64(len(f.Nodes))
	sigma := math.Sqrt(float64(*flows) * p * (1 - p))
	for _, c := range counts {
		x.shares = append(x.shares, float64(c)/float64(*flows))
		x.maxSigma = max(x.maxSigma, math.Abs(float64(c)-float64(*flows)*p)/sigma)
	}

	// Convergence.
	var wh, wd, ah, ad, dh []time.Duration
	for range *repeats {
		start := time.Now()
		for _, b := range f.T.DSR {
			f.Servers().Kill(b.Name)
		}
		d, err := f.Nodes[0].WaitAnnounced(ctx, 0, 5*time.Second)
		if err != nil {
			return x, err
		}
		dh = append(dh, d)
		if _, err := f.WaitNextHops(ctx, prefix, nil, 5*time.Second); err != nil {
			return x, err
		}
		wh = append(wh, time.Since(start))
		start = time.Now()
		for _, b := range f.T.DSR {
			if err := f.Servers().Serve(b.NS, b.Name); err != nil {
				return x, err
			}
		}
		if _, err := f.WaitNextHops(ctx, prefix, all, 5*time.Second); err != nil {
			return x, err
		}
		ah = append(ah, time.Since(start))

		start = time.Now()
		if err := f.Nodes[0].Client.NodeDrain(ctx, true); err != nil {
			return x, err
		}
		if _, err := f.WaitNextHops(ctx, prefix, all[1:], 5*time.Second); err != nil {
			return x, err
		}
		wd = append(wd, time.Since(start))
		start = time.Now()
		if err := f.Nodes[0].Client.NodeDrain(ctx, false); err != nil {
			return x, err
		}
		if _, err := f.WaitNextHops(ctx, prefix, all, 5*time.Second); err != nil {
			return x, err
		}
		ad = append(ad, time.Since(start))
	}
	x.withdrawHealth, x.withdrawDrain, x.announceHealth, x.announceDrain, x.detectHealth =
		median(wh), median(wd), median(ah), median(ad), median(dh)
	return x, nil
}

func median[T int64 | float64 | time.Duration](v []T) T {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func report(res []result) {
	pick := func(g func(result) time.Duration) time.Duration {
		var v []time.Duration
		for _, r := range res {
			v = append(v, g(r))
		}
		return median(v)
	}
	fmt.Printf("\n%d runs, %d flows each, %d cycles per cause; medians\n\n", len(res), *flows, *repeats)
	fmt.Println("| node | share of flows (median of runs) | runs | share of the router's packets (median) | runs |")
	fmt.Println("|---|---:|---|---:|---|")
	for i := range res[0].shares {
		var v, w []float64
		for _, r := range res {
			v = append(v, r.shares[i])
			w = append(w, r.routerShares[i])
		}
		fmt.Printf("| node-%d | %.1f %% | %v | %.1f %% | %v |\n", i, 100*median(v), pct(v), 100*median(w), pct(w))
	}
	var sig []float64
	for _, r := range res {
		sig = append(sig, r.maxSigma)
	}
	fmt.Printf("\nlargest deviation from an even share: %.2f binomial σ (median of runs; a uniform random choice stays within 2 σ 95%% of the time)\n\n", median(sig))
	fmt.Println("| event | until the router's kernel route changed |")
	fmt.Println("|---|---|")
	fmt.Printf("| every backend fails health (interval 200ms, fall 2): withdrawn | %s (node-0's own status: %s) |\n", pick(func(r result) time.Duration { return r.withdrawHealth }).Round(time.Millisecond), pick(func(r result) time.Duration { return r.detectHealth }).Round(time.Millisecond))
	fmt.Printf("| backends back (rise 1): announced | %s |\n", pick(func(r result) time.Duration { return r.announceHealth }).Round(time.Millisecond))
	fmt.Printf("| weir node drain: withdrawn | %s |\n", pick(func(r result) time.Duration { return r.withdrawDrain }).Round(time.Millisecond))
	fmt.Printf("| weir node undrain: announced | %s |\n", pick(func(r result) time.Duration { return r.announceDrain }).Round(time.Millisecond))
}

func pct(v []float64) string {
	s := ""
	for i, x := range v {
		if i > 0 {
			s += ", "
		}
		s += fmt.Sprintf("%.1f", 100*x)
	}
	return s
}
