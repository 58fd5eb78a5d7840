// Command health benchmarks the health checker at scale: N TCP backends (one
// wildcard listener in a separate process answers N distinct 127.x.y.z
// addresses) checked every interval for a while, reporting the checker's CPU,
// memory and the p99 lag between a check's scheduled and actual start, beside a
// bare dial-and-close loop at the same rate as the baseline.
//
//	go run ./bench/health                      # 10,000 backends, 1s, 30s
//	go run ./bench/health -duration 5s         # a quick run
//
// It runs in a network namespace of its own (root needed; -netns=false runs in
// the current one), so the hundreds of thousands of TIME_WAIT sockets it leaves
// vanish with it and nothing it does touches the host's network. Every process
// it starts dies with it.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/health"
)

const roleEnv = "WEIR_HEALTHBENCH_ROLE"

type options struct {
	backends    int
	interval    time.Duration
	timeout     time.Duration
	duration    time.Duration
	baseline    time.Duration
	maxInFlight int
	netns       bool
	jsonOut     bool
	cpuProfile  string
}

func main() {
	var o options
	flag.IntVar(&o.backends, "backends", 10000, "number of backends (distinct 127.x.y.z addresses)")
	flag.DurationVar(&o.interval, "interval", time.Second, "check interval")
	flag.DurationVar(&o.timeout, "timeout", time.Second, "check timeout")
	flag.DurationVar(&o.duration, "duration", envDuration("WEIR_HEALTHBENCH_DURATION", 30*time.Second), "measured run of the checker (env WEIR_HEALTHBENCH_DURATION)")
	flag.DurationVar(&o.baseline, "baseline", 0, "measured run of the bare dial loop (0: a third of -duration; negative: skip)")
	flag.IntVar(&o.maxInFlight, "max-in-flight", 0, "Checker.MaxInFlight (0: the default)")
	flag.BoolVar(&o.netns, "netns", true, "run in a network namespace of its own (needs root)")
	flag.BoolVar(&o.jsonOut, "json", false, "print the report as JSON")
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the checker's measured run to this file")
	flag.Parse()
	if o.baseline == 0 {
		o.baseline = o.duration / 3
	}
	if o.backends < 1 || o.backends > 250*250*200 || o.duration <= 0 || o.interval <= 0 {
		fail(errors.New("need 1..12,500,000 backends and positive -duration and -interval"))
	}

	var err error
	switch os.Getenv(roleEnv) {
	case "listener":
		err = listener()
	case "runner":
		err = runner(o)
	default:
		err = parent(o)
	}
	if err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench/health:", err)
	os.Exit(1)
}

func envDuration(name string, def time.Duration) time.Duration {
	if v := os.Getenv(name); v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			return d
		}
	}
	return def
}

// child starts this program again in role, dying with its parent.
func child(role string, newNet bool) (*exec.Cmd, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable: %w", err)
	}
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Env = append(os.Environ(), roleEnv+"="+role)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if newNet {
		cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWNET
	}
	return cmd, nil
}

// parent runs the runner, in a fresh network namespace unless told otherwise.
func parent(o options) error {
	cmd, err := child("runner", o.netns)
	if err != nil {
		return err
	}
	cmd.Stdout = os.Stdout
	if err := cmd.Start(); err != nil {
		if o.netns {
			return fmt.Errorf("start runner in a new network namespace: %w (run as root, or pass -netns=false)", err)
		}
		return fmt.Errorf("start runner: %w", err)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sig)
	done := make(chan error, 1)
	// Exits when the runner does; the runner is bounded by its own deadline.
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-sig:
		cmd.Process.Kill()
		<-done
		return errors.New("interrupted")
	}
}

// listener accepts and closes connections on a wildcard port until its stdin
// closes, then reports its CPU use.
func listener() error {
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	fmt.Println(ln.Addr().(*net.TCPAddr).Port)
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		// Exits when ln is closed below.
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
	}
	bufio.NewReader(os.Stdin).ReadString('\n') // EOF when the runner is done
	ln.Close()
	wg.Wait()
	return nil
}

// report is what one run measured.
type report struct {
	Phase        string  `json:"phase"`
	Backends     int     `json:"backends"`
	Interval     string  `json:"interval"`
	Seconds      float64 `json:"seconds"`
	Checks       int64   `json:"checks"`
	Failed       int64   `json:"failed"`
	ChecksPerSec float64 `json:"checks_per_sec"`
	CPUPercent   float64 `json:"cpu_percent_of_one_core"`
	UserPercent  float64 `json:"user_percent"`
	SysPercent   float64 `json:"sys_percent"`
	CPUPerCheck  string  `json:"cpu_per_check"`
	LagP50       string  `json:"lag_p50,omitempty"`
	LagP99       string  `json:"lag_p99,omitempty"`
	LagMax       string  `json:"lag_max,omitempty"`
	HeapInuseMiB float64 `json:"heap_inuse_mib,omitempty"`
	RSSMiB       float64 `json:"rss_mib,omitempty"`
	PeakRSSMiB   float64 `json:"peak_rss_mib,omitempty"`
	Goroutines   int     `json:"goroutines,omitempty"`
}

// runner starts the listener, runs the checker and then the baseline, and
// prints the report.
func runner(o options) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*(o.duration+max(o.baseline, 0))+time.Minute)
	defer cancel()
	if o.netns {
		if err := setLinkUp("lo"); err != nil {
			return err
		}
	}
	lcmd, err := child("listener", false)
	if err != nil {
		return err
	}
	stdin, err := lcmd.StdinPipe()
	if err != nil {
		return err
	}
	out, err := lcmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := lcmd.Start(); err != nil {
		return fmt.Errorf("start listener: %w", err)
	}
	stopListener := func() {
		stdin.Close()
		lcmd.Wait()
	}
	defer stopListener()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		return fmt.Errorf("read listener port: %w", err)
	}
	port, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		return fmt.Errorf("listener port %q: %w", line, err)
	}

	addrs := make([]string, o.backends)
	for i := range addrs {
		// 127.1.0.1 upwards, never a .0 or .255 octet.
		addrs[i] = fmt.Sprintf("127.%d.%d.%d:%d", 1+i/(250*250), i/250%250+1, i%250+1, port)
	}

	var reports []report
	r, err := runChecker(ctx, o, addrs)
	if err != nil {
		return err
	}
	reports = append(reports, r)
	if o.baseline > 0 {
		r, err := runBaseline(ctx, o, addrs)
		if err != nil {
			return err
		}
		reports = append(reports, r)
	}
	stopListener()
	if u, ok := lcmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
		wall := reports[0].Seconds
		for _, r := range reports[1:] {
			wall += r.Seconds + o.interval.Seconds()
		}
		user, sys := tv(u.Utime), tv(u.Stime)
		reports = append(reports, report{Phase: "listener (backend side, whole run)", Backends: o.backends,
			Interval: o.interval.String(), Seconds: wall,
			CPUPercent: 100 * (user + sys) / wall, UserPercent: 100 * user / wall, SysPercent: 100 * sys / wall,
			PeakRSSMiB: float64(u.Maxrss) / 1024})
	}
	if o.jsonOut {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(reports)
	}
	fmt.Printf("health checker: %d TCP backends, interval %v, timeout %v, %d CPUs, %s\n",
		o.backends, o.interval, o.timeout, runtime.NumCPU(), runtime.Version())
	for _, r := range reports {
		fmt.Printf("\n%s (%.1fs measured)\n", r.Phase, r.Seconds)
		fmt.Printf("  CPU          %.1f%% of one core (user %.1f%%, sys %.1f%%)\n", r.CPUPercent, r.UserPercent, r.SysPercent)
		if r.Checks > 0 {
			fmt.Printf("  checks       %d (%.0f/s), %d failed, %s CPU each\n", r.Checks, r.ChecksPerSec, r.Failed, r.CPUPerCheck)
		}
		if r.LagP99 != "" {
			fmt.Printf("  start lag    p50 %s, p99 %s, max %s\n", r.LagP50, r.LagP99, r.LagMax)
		}
		if r.HeapInuseMiB > 0 {
			fmt.Printf("  memory       heap in use %.1f MiB, RSS %.1f MiB, peak RSS %.1f MiB, %d goroutines\n",
				r.HeapInuseMiB, r.RSSMiB, r.PeakRSSMiB, r.Goroutines)
		} else if r.PeakRSSMiB > 0 {
			fmt.Printf("  memory       peak RSS %.1f MiB\n", r.PeakRSSMiB)
		}
	}
	return nil
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

func runChecker(ctx context.Context, o options, addrs []string) (report, error) {
	var (
		measuring     atomic.Bool
		checks, fails atomic.Int64
		hist          = new(lagHist)
	)
	c := &health.Checker{
		MaxInFlight: o.maxInFlight,
		OnCheck: func(r health.Result) {
			if !measuring.Load() {
				return
			}
			checks.Add(1)
			if r.Err != nil {
				fails.Add(1)
			}
			hist.add(r.Lag())
		},
	}
	cfg := health.Config{Check: health.Check{Interval: o.interval, Timeout: o.timeout, Jitter: health.DefaultJitter, Initial: health.Up}}
	if err := c.SetService("bench", cfg); err != nil {
		return report{}, err
	}
	for _, a := range addrs {
		if err := c.Set(health.Backend{ID: a, Service: "bench"}); err != nil {
			return report{}, err
		}
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	// Exits when halt cancels rctx, on every return path.
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

	// The first interval spreads the first checks; measure after it.
	time.Sleep(o.interval)
	measuring.Store(true)
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return report{}, err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return report{}, err
		}
		defer pprof.StopCPUProfile()
	}
	u0, t0 := rusage(), time.Now()
	var peakHeap uint64
	ticker := time.NewTicker(time.Second)
	for end := t0.Add(o.duration); time.Now().Before(end); {
		select {
		case <-ticker.C:
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			peakHeap = max(peakHeap, ms.HeapInuse)
		case <-ctx.Done():
			ticker.Stop()
			return report{}, ctx.Err()
		}
	}
	ticker.Stop()
	u1, t1 := rusage(), time.Now()
	measuring.Store(false)
	goroutines := runtime.NumGoroutine()
	rss, peak := procRSS()
	if err := halt(); err != nil {
		return report{}, err
	}

	r := cpuReport("health.Checker", o, u0, u1, t1.Sub(t0), checks.Load(), fails.Load())
	r.LagP50 = hist.quantile(0.50).String()
	r.LagP99 = hist.quantile(0.99).String()
	r.LagMax = time.Duration(hist.max.Load()).String()
	r.HeapInuseMiB = float64(peakHeap) / (1 << 20)
	r.RSSMiB, r.PeakRSSMiB = rss, peak
	r.Goroutines = goroutines
	return r, nil
}

// runBaseline dials and closes every address once per interval with nothing
// else: no state, no hysteresis, no heap. What the checker spends beyond it is
// its own overhead; the rest is the kernel's price of a TCP connect.
func runBaseline(ctx context.Context, o options, addrs []string) (report, error) {
	time.Sleep(o.interval) // let the checker's connections drain
	var checks, fails atomic.Int64
	d := net.Dialer{KeepAlive: -1}
	sem := make(chan struct{}, 1024)
	var wg sync.WaitGroup
	const tick = time.Millisecond
	perTick := max(1, len(addrs)*int(tick)/int(o.interval))
	ticker := time.NewTicker(tick)
	defer ticker.Stop()
	u0, t0 := rusage(), time.Now()
	next := 0
	for end := t0.Add(o.baseline); time.Now().Before(end); {
		select {
		case <-ticker.C:
		case <-ctx.Done():
			wg.Wait()
			return report{}, ctx.Err()
		}
		for range perTick {
			a := addrs[next%len(addrs)]
			next++
			sem <- struct{}{}
			wg.Add(1)
			// Exits when the dial ends, within the timeout.
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				cctx, cancel := context.WithTimeout(ctx, o.timeout)
				defer cancel()
				checks.Add(1)
				conn, err := d.DialContext(cctx, "tcp", a)
				if err != nil {
					fails.Add(1)
					return
				}
				conn.Close()
			}()
		}
	}
	wg.Wait()
	u1, t1 := rusage(), time.Now()
	return cpuReport("baseline: bare dial+close loop at the same rate", o, u0, u1, t1.Sub(t0), checks.Load(), fails.Load()), nil
}

func cpuReport(phase string, o options, u0, u1 syscall.Rusage, wall time.Duration, checks, fails int64) report {
	user := tv(u1.Utime) - tv(u0.Utime)
	sys := tv(u1.Stime) - tv(u0.Stime)
	s := wall.Seconds()
	r := report{Phase: phase, Backends: o.backends, Interval: o.interval.String(), Seconds: s,
		Checks: checks, Failed: fails, ChecksPerSec: float64(checks) / s,
		CPUPercent: 100 * (user + sys) / s, UserPercent: 100 * user / s, SysPercent: 100 * sys / s}
	if checks > 0 {
		r.CPUPerCheck = time.Duration((user + sys) / float64(checks) * 1e9).Round(100 * time.Nanosecond).String()
	}
	return r
}

func rusage() syscall.Rusage {
	var u syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &u)
	return u
}

func tv(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }

// procRSS returns the current and peak resident set in MiB.
func procRSS() (rss, peak float64) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		kb, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "VmRSS:":
			rss = kb / 1024
		case "VmHWM:":
			peak = kb / 1024
		}
	}
	return rss, peak
}

func setLinkUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get %s flags: %w", name, err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}
