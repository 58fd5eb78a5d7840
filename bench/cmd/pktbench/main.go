// Command pktbench measures packets per second through a balancer namespace
// with weir's own XDP packet generator: null, floor, weir and the kernel's
// forwarding and nftables NAT, each case repeated, with softirq time per
// frame, a few cases again from trafgen (netsniff-ng) as a second generator,
// TCP probe latency through weir nat and nftables DNAT under load, and SYN
// floods against established TCP streams through weir nat; it writes a
// markdown table, JSON samples and PNG plots. It needs root and a
// kernel with XDP (BPF_F_TEST_XDP_LIVE_FRAMES: Linux 5.18 or later);
// nftables cases need the nft binary, trafgen's the trafgen binary (left out
// if missing). Everything runs in network namespaces it creates and removes.
//
//	go run ./bench/cmd/pktbench -out bench/results/pkt
//	go run ./bench/cmd/pktbench -smoke          # a few seconds: does the pipeline work?
//	go run ./bench/cmd/pktbench -new -out /tmp/x # only trafgen, latency, softirq
//	go run ./bench/cmd/pktbench -flood           # only the SYN floods and their floor
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"syscall"
	"time"

	"github.com/weir-lb/weir/bench/pktbench"
)

func main() {
	var (
		opts    pktbench.Options
		out     = flag.String("out", "", "directory for results.md, results.json and the plots (empty: print the table only)")
		smoke   = flag.Bool("smoke", false, "run a few short cases once: checks the pipeline, measures nothing")
		only    = flag.String("cases", "", "run only the cases whose name matches this regular expression")
		onlyNew = flag.Bool("new", false, "run only the trafgen, latency and CPU-cost cases with the null case and floors they are read against")
		flood   = flag.Bool("flood", false, "run only the SYN-flood cases (streams through weir nat alone and under floods) with the floor they are read against")
	)
	flag.IntVar(&opts.Runs, "runs", 3, "rounds; every round runs every case once, interleaved")
	flag.DurationVar(&opts.Duration, "duration", time.Second, "measured window per case and round")
	flag.DurationVar(&opts.Warmup, "warmup", 300*time.Millisecond, "sending before each window opens")
	flag.IntVar(&opts.CPU, "cpu", 0, "CPU to pin the generator to (default the last; -1: unpinned)")
	flag.Parse()

	cases := pktbench.DefaultCases()
	if *onlyNew {
		cases = pktbench.NewCases()
	}
	if *flood {
		cases = pktbench.FloodCases()
	}
	if !pktbench.TrafgenAvailable() {
		fmt.Fprintln(os.Stderr, "pktbench: trafgen not found (install netsniff-ng): leaving out the second generator's cases")
	}
	if *smoke {
		cases = pktbench.SmokeCases()
		opts.Runs, opts.Duration, opts.Warmup = 1, 200*time.Millisecond, 100*time.Millisecond
	}
	if *only != "" {
		re, err := regexp.Compile(*only)
		if err != nil {
			fatal(fmt.Errorf("-cases: %w", err))
		}
		var keep []pktbench.Case
		for _, c := range cases {
			if re.MatchString(c.Name()) {
				keep = append(keep, c)
			}
		}
		cases = keep
	}
	opts.Log = os.Stderr

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	start := time.Now()
	res, err := pktbench.Run(ctx, cases, opts)
	if err != nil {
		fatal(err)
	}
	rep := pktbench.NewReport(res, opts, time.Since(start))
	if err := rep.WriteMarkdown(os.Stdout); err != nil {
		fatal(err)
	}
	if *out != "" {
		if err := rep.Save(*out); err != nil {
			fatal(err)
		}
		fmt.Fprintf(os.Stderr, "wrote %s\n", *out)
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "pktbench:", err)
	os.Exit(1)
}
