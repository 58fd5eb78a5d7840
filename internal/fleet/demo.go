package fleet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/weir-lb/weir/internal/demo"
	"github.com/weir-lb/weir/internal/topo"
)

// DemoOptions are what `weir demo fleet` runs with.
type DemoOptions struct {
	Out       io.Writer
	AgentArgv func(config string) []string
	Env       []string
	// Dir holds the configs, sockets and logs. Default a new directory
	// under /run, removed at the end but for the logs an error names.
	Dir     string
	Streams int // default 60
}

// DemoReport is what the demo saw.
type DemoReport struct {
	NextHops []netip.Addr // the router's, with every node up
	Shares   []int        // streams per node before the failure
	// RouterPackets are the packets to the VIP the router sent each node, by then.
	RouterPackets []uint64
	Killed        int // the node that died
	Withdrawn     time.Duration
	Streams       int
	Broken        int
	After         []netip.Addr // the router's next hops after the failure
	FirstError    error
}

// Demo runs the fleet demo: three nodes announce a dsr VIP to BIRD, the router's
// ECMP route and each node's BGP status are shown, streams spread over the nodes,
// the busiest node dies, and the streams go on through the others. When ctx ends
// midway it stops there, removes everything and returns context.Cause(ctx)
// itself, joined with what it could not remove, if anything. Its error is
// one line.
func Demo(ctx context.Context, o DemoOptions) (rep DemoReport, err error) {
	defer func() { err = demo.OneLine(err) }()
	out := o.Out
	if out == nil {
		out = io.Discard
	}
	if o.Streams == 0 {
		o.Streams = 60
	}
	if o.Dir == "" {
		if o.Dir, err = os.MkdirTemp("/run", "weir-demo-fleet-"); err != nil {
			return rep, fmt.Errorf("demo fleet: %w", err)
		}
		defer func() { removeExceptNamed(o.Dir, err) }()
	}
	f, err := Start(Options{AgentArgv: o.AgentArgv, Env: o.Env, Dir: o.Dir})
	if err != nil {
		return rep, fmt.Errorf("demo fleet: %w", err)
	}
	defer func() {
		if ctx.Err() != nil {
			// What failed once ctx ended failed because it ended.
			err = context.Cause(ctx)
		}
		if cerr := f.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	so := ServiceOptions{Mode: "dsr", VIP: topo.FleetVIP4, Backends: f.T.DSR, HashSeed: 7}
	if err := f.WriteConfigs(so); err != nil {
		return rep, err
	}
	fmt.Fprintf(out, "weir demo fleet: a client, a router running BIRD 2, %d weir nodes and %d dsr backends in network namespaces (%s...)\n",
		len(f.Nodes), len(f.T.DSR), f.T.Name)
	fmt.Fprintf(out, "each node runs the agent (XDP on its fabric link) and peers over eBGP (AS %d) with the router (AS %d), hold time %s\n",
		NodeASN, RouterASN, f.opts.HoldTime)
	// The first agent that fails stops the others' start: all have
	// returned before Close stops them.
	actx, cancelStart := context.WithCancel(ctx)
	errs := make(chan error, len(f.Nodes))
	for i := range f.Nodes {
		// Exits when node i's agent answers or fails, or actx ends.
		go func() { errs <- f.StartAgent(actx, i) }()
	}
	var startErr error
	for range f.Nodes {
		if err := <-errs; err != nil && startErr == nil {
			startErr = err
			cancelStart()
		}
	}
	cancelStart()
	if startErr != nil {
		return rep, startErr
	}
	prefix := netip.PrefixFrom(so.VIP, 32)
	if _, err := f.WaitNextHops(ctx, prefix, f.NodeIPs(All(len(f.Nodes))...), 10*time.Second); err != nil {
		return rep, err
	}
	if err := f.CountNextHops(so.VIP); err != nil {
		return rep, err
	}
	rep.NextHops, _ = f.KernelNextHops(prefix)
	fmt.Fprintf(out, "\n$ ip -n %s route show %s      # the router's ECMP route, installed by BIRD\n%s\n", f.T.RouterNS.Name(), prefix, f.KernelRoute(prefix))
	if b, err := f.Birdc("show protocols"); err == nil {
		fmt.Fprintf(out, "\n$ birdc show protocols\n%s", b)
	}
	st, err := f.Nodes[0].Client.Status(ctx)
	if err != nil {
		return rep, err
	}
	fmt.Fprintln(out, "\n$ weir status      # on node-0: the BGP part")
	st.BGP.WriteTable(out)

	dst := netip.AddrPortFrom(so.VIP, StreamPort)
	so2 := streamOpts(o.Streams)
	fmt.Fprintf(out, "\n%d TCP streams from %d client addresses to %s, each sending %d KiB in %s and checking every byte of the echo\n",
		o.Streams, len(f.T.ClientAddrs), dst, so2.Chunks*so2.Chunk/1024, time.Duration(so2.Chunks)*so2.Interval)
	sctx, cancel := context.WithCancel(ctx)
	ss := f.StartStreams(sctx, dst, so2)
	defer func() {
		// A return midway cuts the streams: they end before the topology goes.
		cancel()
		ss.Wait()
	}()
	select {
	case <-ss.Halfway():
	case <-ctx.Done():
		return rep, ctx.Err()
	}
	owners, err := f.Owners(ctx, "stream", ss.Locals())
	if err != nil {
		return rep, err
	}
	rep.Shares = shareOf(owners, len(f.Nodes))
	fmt.Fprintln(out, "per node: the streams its flow table tracks (weir explain on each node), the packets the router's ECMP")
	fmt.Fprintln(out, "sent it (an nftables counter per next hop in the router), and the packets its XDP program forwarded:")
	routed, err := f.NextHopPackets()
	if err != nil {
		return rep, err
	}
	rep.RouterPackets = routed
	for i, n := range f.Nodes {
		st, _ := n.Client.Status(ctx)
		var pk uint64
		for _, s := range st.Services {
			pk += s.Packets
		}
		fmt.Fprintf(out, "  node-%d  %-3d streams (%2.0f%%)  router %d packets  xdp %d packets\n", i, rep.Shares[i], 100*float64(rep.Shares[i])/float64(o.Streams), routed[i], pk)
	}
	victim := 0
	for i, n := range rep.Shares {
		if n > rep.Shares[victim] {
			victim = i
		}
	}
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}
	rep.Killed = victim
	fmt.Fprintf(out, "\nnode-%d dies: its agent gets SIGKILL and its link is deleted, in the middle of %d streams\n", victim, rep.Shares[victim])
	start := time.Now()
	if err := f.Signal(victim, syscall.SIGKILL); err != nil {
		return rep, err
	}
	f.WaitAgent(victim, 5*time.Second)
	if err := f.T.DeleteNodeLink(victim); err != nil {
		return rep, err
	}
	var rest []int
	for i := range f.Nodes {
		if i != victim {
			rest = append(rest, i)
		}
	}
	if _, err := f.WaitNextHops(ctx, prefix, f.NodeIPs(rest...), f.opts.HoldTime+time.Second); err != nil {
		return rep, err
	}
	rep.Withdrawn = time.Since(start)
	rep.After, _ = f.KernelNextHops(prefix)
	fmt.Fprintf(out, "the router withdrew it in %s:\n%s\n", rep.Withdrawn.Round(time.Millisecond), f.KernelRoute(prefix))
	res := ss.Wait()
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}
	rep.Streams = len(res)
	rep.Broken, rep.FirstError = Failed(res)
	after, _ := f.Owners(ctx, "stream", ss.Locals())
	fmt.Fprintf(out, "\nstreams finished: %d of %d intact; streams per node at the end: %s\n", rep.Streams-rep.Broken, rep.Streams, formatShares(shareOf(after, len(f.Nodes)), victim))
	if rep.Broken > 0 {
		fmt.Fprintf(out, "FAIL: %d streams broke; the first: %v\n", rep.Broken, rep.FirstError)
	} else {
		fmt.Fprintln(out, "the surviving nodes picked the same backends for the moved flows (same config, same hash_seed, no shared state)")
	}
	return rep, nil
}

// streamOpts are the demo's and tests' streams: n of them, 40 chunks of 4 KiB each
// way, 100ms apart (4s a stream), so a node dies in the middle of every one.
func streamOpts(n int) StreamOptions {
	return StreamOptions{Streams: n, Chunks: 40, Chunk: 4096, Interval: 100 * time.Millisecond, Timeout: 40 * time.Second}
}

// shareOf counts the streams per node.
func shareOf(owners []int, nodes int) []int {
	n := make([]int, nodes)
	for _, o := range owners {
		if o >= 0 {
			n[o]++
		}
	}
	return n
}

func formatShares(s []int, dead int) string {
	var parts []string
	for i, n := range s {
		if i == dead {
			parts = append(parts, fmt.Sprintf("node-%d dead", i))
			continue
		}
		parts = append(parts, fmt.Sprintf("node-%d %d", i, n))
	}
	return strings.Join(parts, ", ")
}

// removeExceptNamed removes dir and what is in it, but the files err names
// (the logs its message points to): those stay, and dir with them, for the
// user to read.
func removeExceptNamed(dir string, err error) {
	ents, _ := os.ReadDir(dir)
	kept := false
	for _, e := range ents {
		path := filepath.Join(dir, e.Name())
		if err != nil && strings.Contains(err.Error(), path) {
			kept = true
			continue
		}
		os.RemoveAll(path)
	}
	if !kept {
		os.Remove(dir)
	}
}
