// Command sim is a discrete-event simulation of weir's balancing algorithms: K
// independent balancers in front of N FIFO backends under Poisson arrivals, measuring
// response-time percentiles and queue lengths per algorithm. It checks four claims the
// algorithms are known by and writes a markdown table and PNG plots:
//
//	go run ./bench/sim            # writes bench/results/sim/{results.md,*.png}
//
// Every random draw comes from PCG generators seeded from -seed, and runs are collected
// by index, so the same command prints the same numbers on any machine.
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"time"
)

func main() {
	out := flag.String("out", "bench/results/sim", "directory for results.md and the plots")
	seed := flag.Uint64("seed", 1, "seed of every random draw")
	quick := flag.Bool("quick", false, "a 10x smaller run, for a smoke test")
	flag.Parse()
	sc := fullScale
	if *quick {
		sc = quickScale
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		log.Fatal(err)
	}
	start := time.Now()
	report, err := simulate(*out, sc, *seed)
	if err != nil {
		log.Fatal(err)
	}
	path := filepath.Join(*out, "results.md")
	if err := os.WriteFile(path, []byte(report), 0o644); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s\nwrote %s and plots in %.1fs\n", report, path, time.Since(start).Seconds())
}

// simulate runs the four experiments, draws their plots into dir and returns the report.
func simulate(dir string, sc scale, seed uint64) (string, error) {
	ml := maxLoad(sc, seed)
	hd := herd(sc, seed)
	sd := slowdown(sc, seed)
	us := utilSweep(sc, seed)
	cs := connections(sc, seed)
	for _, f := range []func() error{
		func() error { return plotMaxLoad(dir, ml) },
		func() error { return plotHerd(dir, hd) },
		func() error { return plotSlowdown(dir, sd) },
		func() error { return plotUtil(dir, us) },
	} {
		if err := f(); err != nil {
			return "", err
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Balancing algorithm simulation\n\n")
	fmt.Fprintf(&b, "`go run ./bench/sim -seed %d` (jobs per queueing run: %d). Time unit: ms; a nominal backend's service time is exponential with mean 1 ms; arrivals are Poisson at the stated utilisation of total capacity and spread uniformly over the K balancers; response time = queueing + service; max queue = most requests at one backend at once (waiting + in service). Percentiles exclude the first 10%% of arrivals.\n\n", seed, sc.jobs)

	b.WriteString("## 1. Maximum load: random ~ ln n / ln ln n, P2C ~ ln ln n / ln 2\n\n")
	b.WriteString("Static: n connections placed on n backends (no departures), fullest backend, mean over trials. Dynamic: n backends at utilisation 0.9, single balancer, the largest queue seen in a run of the same length per backend.\n\n")
	b.WriteString(row("n", "trials", "random max", "ln n/ln ln n", "p2c max", "ln ln n/ln 2", "random max queue (ρ 0.9)", "p2c max queue (ρ 0.9)"))
	b.WriteString(row("---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"))
	for _, r := range ml {
		qr, qp := "", ""
		if r.hasQueue {
			qr, qp = fmt.Sprint(r.queueRandom), fmt.Sprint(r.qP2C)
		}
		b.WriteString(row(fmt.Sprint(r.n), fmt.Sprint(r.trials), fmt.Sprintf("%.2f", r.random), fmt.Sprintf("%.2f", r.theoryRandom),
			fmt.Sprintf("%.2f", r.p2c), fmt.Sprintf("%.2f", r.theoryP2C), qr, qp))
	}
	b.WriteString("\n![max load](max-load.png)\n\n")

	fmt.Fprintf(&b, "## 2. Herd behaviour: K independent balancers, %d backends, utilisation %.1f\n\n", herdN, herdUtil)
	fmt.Fprintf(&b, "*own* view: each balancer knows only its own in-flight requests. *shared* view: the true queue lengths published every %.0f ms, plus the balancer's own sends since.\n\n", herdRefresh)
	b.WriteString(row("policy", "view", "p99 K=1", "p99 K=4", "p99 K=16", "p99.9 K=16", "max queue K=1", "K=4", "K=16"))
	b.WriteString(row("---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"))
	for i := 0; i < len(hd); i += len(herdKs) {
		r := hd[i : i+len(herdKs)]
		b.WriteString(row(r[0].policy, r[0].view.String(), fmtMs(r[0].res.p99), fmtMs(r[1].res.p99), fmtMs(r[2].res.p99), fmtMs(r[2].res.p999),
			fmt.Sprint(r[0].res.maxQueue), fmt.Sprint(r[1].res.maxQueue), fmt.Sprint(r[2].res.maxQueue)))
	}
	b.WriteString("\n")
	for _, r := range hd {
		if r.policy == "maglev_p2c" && r.view == viewOwn {
			fmt.Fprintf(&b, "maglev_p2c, K=%d: %.1f%% of new flows took their second candidate.\n", r.k, 100*r.res.second)
		}
	}
	b.WriteString("\n![herd](herd-p99.png)\n\n")

	fmt.Fprintf(&b, "## 3. Shifting load off a slowed backend\n\n")
	fmt.Fprintf(&b, "%d backends, utilisation %.1f, K balancers each with its own view; at t = %.0f ms backend 0 becomes %.0f× slower (requests starting service after it). Shares are over %d seeded repetitions in %.0f ms bins; *shift* is the time from the slowdown until a bin's share first falls to half the share before it; *sent in first 100 ms* counts requests sent to the slowed backend per repetition.\n\n",
		slowN, slowUtil, slowAt, slowFactor, sc.reps, slowBin)
	b.WriteString(row("policy", "K", "share before", "shift (ms)", "sent in first 100 ms", "share in last 500 ms", "p99 (ms, median of runs)"))
	b.WriteString(row("---", "---:", "---:", "---:", "---:", "---:", "---:"))
	for _, r := range sd {
		shift := "never"
		if r.shift == r.shift { // not NaN
			shift = fmt.Sprintf("%.0f", r.shift)
		}
		b.WriteString(row(r.policy, fmt.Sprint(r.k), fmt.Sprintf("%.1f%%", 100*r.preShare), shift, fmt.Sprintf("%.1f", r.sentFirst),
			fmt.Sprintf("%.1f%%", 100*r.afterShare), fmtMs(r.p99)))
	}
	for _, k := range slowKs {
		fmt.Fprintf(&b, "\n![slowdown, K = %d](slowdown-share-k%d.png)\n", k, k)
	}
	b.WriteString("\n")

	b.WriteString("## 4. p99 by utilisation with heterogeneous backends\n\n")
	b.WriteString("One balancer, 10 backends. A cell marked † ended with a queue of more than 100 requests at one backend: the arrival share it gets exceeds its capacity, so its p99 grows with the run's length.\n\n")
	for _, sc := range scenarios() {
		fmt.Fprintf(&b, "**%s**: %s. p99 (ms):\n\n", sc.name, sc.desc)
		cells := []string{"policy"}
		align := []string{"---"}
		for _, u := range utils {
			cells = append(cells, fmt.Sprintf("ρ %.2f", u))
			align = append(align, "---:")
		}
		b.WriteString(row(cells...))
		b.WriteString(row(align...))
		for _, p := range utilPolicies {
			cells := []string{p}
			for _, r := range us {
				if r.scenario == sc.name && r.policy == p {
					c := fmtMs(r.res.p99)
					if r.res.finalQueue > 100 {
						c += " †"
					}
					cells = append(cells, c)
				}
			}
			b.WriteString(row(cells...))
		}
		fmt.Fprintf(&b, "\n![%s](util-p99-%s.png)\n\n", sc.name, sc.name)
	}

	b.WriteString("## 5. maglev_p2c against long connections on one backend\n\n")
	fmt.Fprintf(&b, "3 backends hold connections open for an exponential time (no queueing), backend %d three times as long (mean 3 ms against 1 ms). K balancer nodes behind ECMP each count only their own open connections, as XDP does, and maglev_p2c takes its second candidate when the first has more than an eighth more; p2c and least_conn (the proxy's, own view) for comparison. *flows* is the mean number open at once under maglev; *max/mean* the busiest backend's open connections over the mean, averaged over arrivals; *second* the share of new flows that took their second candidate (the flows a node that knows nothing of load would send elsewhere).\n\n", connSlow)
	b.WriteString(row("flows", "K", "policy", "max/mean open", "share to the slow backend", "p99 connection time (ms)", "second"))
	b.WriteString(row("---:", "---:", "---", "---:", "---:", "---:", "---:"))
	for _, r := range cs {
		second := "–"
		if r.policy == "maglev_p2c" {
			second = fmt.Sprintf("%.1f%%", 100*r.res.second)
		}
		b.WriteString(row(fmt.Sprint(r.flows), fmt.Sprint(r.k), r.policy, fmt.Sprintf("%.2f", r.res.maxOverMean),
			fmt.Sprintf("%.1f%%", 100*r.res.share[connSlow]), fmtMs(r.res.p99), second))
	}
	b.WriteString("\n")
	return b.String(), nil
}
