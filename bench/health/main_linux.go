// Command health benchmarks the health checker at scale: N backends (one
// wildcard TCP listener and one HTTP server in a process of their own, in a
// network namespace of their own, answering N distinct 10.x.y.z addresses
// routed to them over a veth pair) checked every interval, for each check
// method, beside two baselines at the same rate: a bare connect-and-close
// loop, and a bare raw-socket SYN loop.
//
//	go run ./bench/health                                    # 10,000 backends, 1s, 3 repeats of 15s
//	go run ./bench/health -backends 100000 -interval 10s     # 100,000 backends at 10s
//	go run ./bench/health -phases syn,syn-loop -repeat 1     # a quick look
//
// The figure for each phase is the CPU of the checker's process alone (user +
// system from /proc/self/stat). Beside it, as separate columns: the backend
// process's CPU, the CPU of the two veth devices' threaded NAPI kthreads (the
// receive softirq work of both ends, which would otherwise run in whichever
// process sent the packet and be charged to it, since this kernel has no
// CONFIG_IRQ_TIME_ACCOUNTING), the machine-wide softirq time and the machine's
// whole load (to see whether it was oversubscribed). Each figure is the median
// of -repeat runs, the phases interleaved.
//
// Everything runs in network namespaces of its own (root needed), so nothing
// touches the host's network and the TIME_WAIT sockets vanish with them. Every
// process it starts dies with it.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/procstat"
)

const roleEnv = "WEIR_HEALTHBENCH_ROLE"

type options struct {
	backends    int
	interval    time.Duration
	timeout     time.Duration
	duration    time.Duration
	repeat      int
	phases      []string
	maxInFlight int
	jsonOut     bool
	cpuProfile  string
}

// The phases, in the order they run in each repeat.
var allPhases = []string{"syn", "connect", "http", "connect-loop", "syn-loop"}

func main() {
	var o options
	var phases string
	flag.IntVar(&o.backends, "backends", 10000, "number of backends (distinct 10.x.y.z addresses)")
	flag.DurationVar(&o.interval, "interval", time.Second, "check interval")
	flag.DurationVar(&o.timeout, "timeout", time.Second, "check timeout")
	flag.DurationVar(&o.duration, "duration", envDuration("WEIR_HEALTHBENCH_DURATION", 15*time.Second), "measured run of each phase (env WEIR_HEALTHBENCH_DURATION)")
	flag.IntVar(&o.repeat, "repeat", 3, "runs of each phase; figures are medians")
	flag.StringVar(&phases, "phases", strings.Join(allPhases, ","), "phases to run: "+strings.Join(allPhases, ", "))
	flag.IntVar(&o.maxInFlight, "max-in-flight", 0, "Checker.MaxInFlight (0: the default)")
	flag.BoolVar(&o.jsonOut, "json", false, "print the report as JSON")
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the last checker phase to this file")
	flag.Parse()
	for _, p := range strings.Split(phases, ",") {
		if !slices.Contains(allPhases, p) {
			fail(fmt.Errorf("-phases: unknown phase %q; want some of %s", p, strings.Join(allPhases, ", ")))
		}
		o.phases = append(o.phases, p)
	}
	if o.backends < 1 || o.backends > 250*250*250 || o.duration <= 0 || o.interval <= 0 || o.repeat < 1 {
		fail(errors.New("need 1..15,625,000 backends, positive -duration and -interval, and -repeat >= 1"))
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

// child starts this program again in role, in a network namespace of its own,
// dying with its parent.
func child(role string, flags uintptr) (*exec.Cmd, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable: %w", err)
	}
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Env = append(os.Environ(), roleEnv+"="+role)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Cloneflags: syscall.CLONE_NEWNET | flags}
	return cmd, nil
}

// parent runs the runner in fresh network and mount namespaces.
func parent(o options) error {
	cmd, err := child("runner", syscall.CLONE_NEWNS)
	if err != nil {
		return err
	}
	cmd.Stdout = os.Stdout
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start runner in new network namespace: %w (run as root)", err)
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

// result is what one phase measured once, or the medians of its repeats.
type result struct {
	Phase        string  `json:"phase"`
	Method       string  `json:"method,omitempty"` // as the checker reports it in effect
	Backends     int     `json:"backends"`
	Interval     string  `json:"interval"`
	Seconds      float64 `json:"seconds"`
	Checks       float64 `json:"checks"`
	Failed       float64 `json:"failed"`
	ChecksPerSec float64 `json:"checks_per_sec"`
	// Percent of one core over the measured run.
	CheckerCPU  float64 `json:"checker_cpu_percent"`
	CheckerUser float64 `json:"checker_user_percent"`
	CheckerSys  float64 `json:"checker_sys_percent"`
	CPUPerCheck float64 `json:"checker_cpu_per_check_us"`
	ListenerCPU float64 `json:"listener_cpu_percent"`
	NAPICPU     float64 `json:"veth_napi_cpu_percent"`
	SoftirqCPU  float64 `json:"machine_softirq_percent"`
	MachineCPU  float64 `json:"machine_busy_percent"`
	// VethDrops counts the packets the veth pair dropped (its rings hold 256
	// packets; a NAPI kthread that does not get a CPU in time loses some).
	VethDrops  float64 `json:"veth_drops"`
	LagP50     float64 `json:"lag_p50_ms,omitempty"`
	LagP99     float64 `json:"lag_p99_ms,omitempty"`
	LagMax     float64 `json:"lag_max_ms,omitempty"`
	HeapInuse  float64 `json:"heap_inuse_mib,omitempty"`
	RSS        float64 `json:"rss_mib,omitempty"`
	Goroutines float64 `json:"goroutines,omitempty"`
}

// runner sets up the backends' namespace, runs every phase -repeat times and
// prints the medians.
func runner(o options) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(o.repeat*len(o.phases))*(o.duration+2*o.interval+5*time.Second)+time.Minute)
	defer cancel()
	raiseFileLimit()
	lcmd, err := child("listener", 0)
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
		return fmt.Errorf("read listener ports: %w", err)
	}
	var tcpPort, httpPort uint16
	if _, err := fmt.Sscan(line, &tcpPort, &httpPort); err != nil {
		return fmt.Errorf("listener ports %q: %w", line, err)
	}
	topo, err := setupNet(lcmd.Process.Pid)
	if err != nil {
		return err
	}

	addrs := make([]netip.Addr, o.backends)
	for i := range addrs {
		// 10.1.1.1 upwards, never a .0 or .255 octet.
		addrs[i] = netip.AddrFrom4([4]byte{10, byte(1 + i/(250*250)), byte(i/250%250 + 1), byte(i%250 + 1)})
	}
	env := &phaseEnv{o: o, addrs: addrs, tcpPort: tcpPort, httpPort: httpPort, topo: topo, listenerPid: lcmd.Process.Pid}
	runs := map[string][]result{}
	for rep := range o.repeat {
		for _, ph := range o.phases {
			if err := ctx.Err(); err != nil {
				return err
			}
			env.profile = o.cpuProfile != "" && rep == o.repeat-1
			r, err := env.run(ctx, ph)
			if err != nil {
				return fmt.Errorf("phase %s: %w", ph, err)
			}
			fmt.Fprintf(os.Stderr, "bench/health: run %d/%d %-12s checker %5.1f%% of a core, %6.0f checks/s, %5.0f failed, %4.0f veth drops, lag p99 %.1fms, machine %3.0f%%\n",
				rep+1, o.repeat, ph, r.CheckerCPU, r.ChecksPerSec, r.Failed, r.VethDrops, r.LagP99, r.MachineCPU)
			runs[ph] = append(runs[ph], r)
			time.Sleep(time.Second) // let the last answers and TIME_WAITs settle
		}
	}
	var results []result
	for _, ph := range o.phases {
		results = append(results, medians(runs[ph]))
	}
	if o.jsonOut {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(results)
	}
	printTable(o, results)
	return nil
}

var phaseNames = map[string]string{
	"syn":          "checker, tcp, method syn",
	"connect":      "checker, tcp, method connect",
	"http":         "checker, http, kept-alive connections",
	"connect-loop": "baseline: bare connect+close loop",
	"syn-loop":     "baseline: bare raw SYN loop",
}

func printTable(o options, rs []result) {
	fmt.Printf("health checker: %d backends, interval %v, timeout %v, %d CPUs, %s; medians of %d runs of %v\n",
		o.backends, o.interval, o.timeout, runtime.NumCPU(), runtime.Version(), o.repeat, o.duration)
	fmt.Println("CPU in % of one core; checker = the checking process alone (user+sys); listener = the backends' process;")
	fmt.Println("napi = the veths' receive kthreads; softirq and machine = the whole machine (other users included)")
	fmt.Println()
	fmt.Println("| phase | method | checks/s | failed | veth drops | checker CPU | user | sys | µs/check | listener | napi | softirq | machine | lag p50 | lag p99 | RSS MiB |")
	fmt.Println("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range rs {
		lag50, lag99, rss := "-", "-", "-"
		if r.LagP99 > 0 {
			lag50, lag99 = fmt.Sprintf("%.1f ms", r.LagP50), fmt.Sprintf("%.1f ms", r.LagP99)
		}
		if r.RSS > 0 {
			rss = fmt.Sprintf("%.0f", r.RSS)
		}
		method := r.Method
		if method == "" {
			method = "-"
		}
		fmt.Printf("| %s | %s | %.0f | %.0f | %.0f | %.1f %% | %.1f | %.1f | %.1f | %.1f %% | %.1f %% | %.1f %% | %.0f %% | %s | %s | %s |\n",
			phaseNames[r.Phase], method, r.ChecksPerSec, r.Failed, r.VethDrops, r.CheckerCPU, r.CheckerUser, r.CheckerSys, r.CPUPerCheck,
			r.ListenerCPU, r.NAPICPU, r.SoftirqCPU, r.MachineCPU, lag50, lag99, rss)
	}
}

// medians takes the median of every figure over rs independently.
func medians(rs []result) result {
	m := rs[0]
	med := func(get func(r *result) *float64) {
		var v []float64
		for i := range rs {
			v = append(v, *get(&rs[i]))
		}
		slices.Sort(v)
		*get(&m) = v[len(v)/2]
	}
	for _, f := range []func(r *result) *float64{
		func(r *result) *float64 { return &r.Seconds },
		func(r *result) *float64 { return &r.Checks },
		func(r *result) *float64 { return &r.Failed },
		func(r *result) *float64 { return &r.ChecksPerSec },
		func(r *result) *float64 { return &r.CheckerCPU },
		func(r *result) *float64 { return &r.CheckerUser },
		func(r *result) *float64 { return &r.CheckerSys },
		func(r *result) *float64 { return &r.CPUPerCheck },
		func(r *result) *float64 { return &r.ListenerCPU },
		func(r *result) *float64 { return &r.NAPICPU },
		func(r *result) *float64 { return &r.SoftirqCPU },
		func(r *result) *float64 { return &r.MachineCPU },
		func(r *result) *float64 { return &r.VethDrops },
		func(r *result) *float64 { return &r.LagP50 },
		func(r *result) *float64 { return &r.LagP99 },
		func(r *result) *float64 { return &r.LagMax },
		func(r *result) *float64 { return &r.HeapInuse },
		func(r *result) *float64 { return &r.RSS },
		func(r *result) *float64 { return &r.Goroutines },
	} {
		med(f)
	}
	return m
}

// raiseFileLimit lifts RLIMIT_NOFILE as far as it may go: kept-alive HTTP
// checks hold one connection per backend. Without CAP_SYS_RESOURCE (in a
// container, say) only the soft limit can rise, to the hard one.
func raiseFileLimit() {
	for _, n := range []uint64{1 << 20, 1 << 18} {
		if unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: n, Max: n}) == nil {
			return
		}
	}
	var l unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &l) == nil {
		l.Cur = l.Max
		unix.Setrlimit(unix.RLIMIT_NOFILE, &l)
	}
}

// cpuSample is the CPU time, in clock ticks, of what the benchmark charges.
type cpuSample struct {
	t              time.Time
	user, sys      uint64 // this process
	listener, napi uint64
	softirq, busy  uint64 // the whole machine
	drops          uint64 // packets the veth pair dropped, both directions
}

// clkTck is USER_HZ, the unit of /proc's CPU times; 100 on every Linux port
// Go supports.
const clkTck = 100

func sample(listenerPid int, napi []int) cpuSample {
	s := cpuSample{t: time.Now()}
	s.user, s.sys = procTimes("self")
	lu, ls := procTimes(strconv.Itoa(listenerPid))
	s.listener = lu + ls
	for _, pid := range napi {
		u, sy := procTimes(strconv.Itoa(pid))
		s.napi += u + sy
	}
	for _, f := range []string{"tx_dropped", "rx_dropped"} {
		// hc0's tx_dropped counts what hc1 could not take, rx_dropped the reverse.
		if b, err := os.ReadFile("/sys/class/net/hc0/statistics/" + f); err == nil {
			n, _ := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
			s.drops += n
		}
	}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
		var total uint64
		for i, v := range f[1:] {
			n, _ := strconv.ParseUint(v, 10, 64)
			if i == 3 || i == 4 || i >= 8 { // idle, iowait; guest time is in user already
				continue
			}
			total += n
			if i == 6 {
				s.softirq = n
			}
		}
		s.busy = total
	}
	return s
}

// procTimes reads utime and stime of /proc/<pid>/stat.
func procTimes(pid string) (user, sys uint64) {
	f := procstat.Fields(pid) // state is f[0]; utime and stime are fields 14 and 15 of the line
	if len(f) < 13 {
		return 0, 0
	}
	user, _ = strconv.ParseUint(f[11], 10, 64)
	sys, _ = strconv.ParseUint(f[12], 10, 64)
	return user, sys
}

// fill sets r's CPU columns from two samples.
func (r *result) fill(a, b cpuSample, checks, failed int64) {
	wall := b.t.Sub(a.t).Seconds()
	pct := func(ticks uint64) float64 { return 100 * float64(ticks) / clkTck / wall }
	r.Seconds = wall
	r.Checks, r.Failed = float64(checks), float64(failed)
	r.ChecksPerSec = float64(checks) / wall
	r.CheckerUser, r.CheckerSys = pct(b.user-a.user), pct(b.sys-a.sys)
	r.CheckerCPU = r.CheckerUser + r.CheckerSys
	if checks > 0 {
		r.CPUPerCheck = float64(b.user+b.sys-a.user-a.sys) / clkTck / float64(checks) * 1e6
	}
	r.ListenerCPU = pct(b.listener - a.listener)
	r.NAPICPU = pct(b.napi - a.napi)
	r.SoftirqCPU = pct(b.softirq - a.softirq)
	r.MachineCPU = pct(b.busy - a.busy)
	r.VethDrops = float64(b.drops - a.drops)
}

func procRSS() (rss float64) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	return 0
}
