// Command proxy benchmarks weir's splice proxy side by side with HAProxy (mode tcp,
// leastconn; splice-auto and forced splice; 1 and 2 threads), nginx stream (least_conn;
// 1 and 2 workers) and the direct path, all on loopback.
//
//	go run ./bench/proxy            # 3 interleaved runs, 3 s per case
//	go run ./bench/proxy -runs 5 -d 5s -only weir,haproxy-2t-splice
//
// Per target it measures new connections/s with one request each (wrk, Connection:
// close) and p50/p99, keep-alive requests/s and p99, bulk throughput with iperf3 (1 and
// 4 streams), the proxy's CPU time per short connection, its system calls per
// connection and splice calls (perf stat on the syscall tracepoints), peak RSS, and RSS
// and descriptors at 1,000 idle connections. Targets are interleaved in every run;
// results are medians over the runs, written as a markdown table, JSON and PNG plots
// (gnuplot) under -out.
//
// It installs haproxy, nginx, its stream module, wrk, iperf3 and gnuplot with apt-get
// if missing, bounds every step in time, and stops only the processes it started.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"math"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/weir-lb/weir/bench/internal/benchproc"
	"github.com/weir-lb/weir/bench/internal/benchstat"
)

var (
	runs      = flag.Int("runs", 3, "interleaved runs; results are medians")
	duration  = flag.Duration("d", 3*time.Second, "length of each load")
	conns     = flag.Int("c", 50, "wrk connections")
	idle      = flag.Int("idle", 1000, "idle connections held for the RSS/descriptor measure")
	outDir    = flag.String("out", "bench/results/proxy", "results directory")
	only      = flag.String("only", "", "comma-separated targets (default all)")
	install   = flag.Bool("install", true, "apt-get install missing tools")
	timeout   = flag.Duration("timeout", 40*time.Minute, "bound on the whole run")
	serve     = flag.Bool("serve", false, "internal: run weir's proxy (child process)")
	pprofAddr = flag.String("pprof", "", "with -serve: serve net/http/pprof on this address, for profiles of a proxy run by hand")
	variants  = flag.String("variants", "", `more weir targets, interleaved with the rest, each "weir-NAME": "name:KEY=V,KEY=V;name2:..." with keys GOMAXPROCS (default 2), LOOPS (event loops per service; default one per P) and BIN (another build of this program to run weir from, e.g. main's, for a before/after in one run); they are measured and shown, not judged against the goals`)
)

// Loopback ports used by the bench.
const (
	httpA, httpB = "127.0.0.1:18081", "127.0.0.1:18082" // nginx HTTP backends
	iperfAddr    = "127.0.0.1:15201"                    // iperf3 server
	proxyHTTP    = "127.0.0.1:19080"                    // every proxy's HTTP front
	proxyBulk    = "127.0.0.1:19201"                    // every proxy's bulk front
)

func main() {
	flag.Parse()
	if *serve {
		if err := serveWeir(); err != nil {
			log.Fatal(err)
		}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		log.Fatal(err)
	}
}

// target is one thing measured: a proxy (or nothing, for direct).
type target struct {
	name  string
	http  string // address wrk uses
	bulk  string // address iperf3 uses
	start func(ctx context.Context, dir string) (*benchproc.Proc, error)
	// variant: a -variants target, measured beside weir's own but not judged
	// against the goals.
	variant bool
}

// result is one target's measures in one run.
type result struct {
	ConnRPS, ConnP50, ConnP99 float64 // /s, ms, ms
	KARPS, KAP50, KAP99       float64
	Bulk1, Bulk4              float64 // Gbit/s
	CPUPerConn                float64 // µs of proxy CPU per short connection
	SyscallsPerConn           float64
	CPUPerKAReq               float64 // µs of proxy CPU per keep-alive request
	SyscallsPerKAReq          float64
	SegmentsPerConn           float64 // TCP segments sent on the machine per short connection, every socket counted
	SplicesBulk               float64 // splice calls during the 1-stream bulk
	PeakRSS                   float64 // MB
	IdleRSS                   float64 // MB at -idle connections
	FDsPerConn                float64 // descriptors per idle proxied connection
}

func run(ctx context.Context) error {
	if *install {
		if err := ensureTools(ctx); err != nil {
			return err
		}
	}
	dir, err := os.MkdirTemp("", "weir-proxybench-")
	if err != nil {
		return fmt.Errorf("temp dir: %w", err)
	}
	defer os.RemoveAll(dir)
	var procs []*benchproc.Proc
	defer func() {
		for _, p := range procs {
			p.Stop()
		}
	}()
	if err := benchproc.PortsFree(httpA, httpB, iperfAddr); err != nil {
		return err
	}
	be, err := startNginxBackend(ctx, dir)
	if err != nil {
		return err
	}
	procs = append(procs, be)
	ip, err := benchproc.Start(dir, "iperf3-server", nil, "iperf3", "-s", "-p", port(iperfAddr))
	if err != nil {
		return err
	}
	procs = append(procs, ip)
	if err := benchproc.WaitPorts(ctx, httpA, httpB, iperfAddr); err != nil {
		return err
	}

	targets := allTargets()
	if *only != "" {
		keep := strings.Split(*only, ",")
		targets = slices.DeleteFunc(targets, func(t target) bool { return !slices.Contains(keep, t.name) && t.name != "direct" })
	}
	vts, err := variantTargets()
	if err != nil {
		return err
	}
	targets = append(targets, vts...)
	results := map[string][]result{}
	for r := range *runs {
		// Rotate the order so no target always runs first or last.
		order := append(slices.Clone(targets[r%len(targets):]), targets[:r%len(targets)]...)
		for _, t := range order {
			log.Printf("run %d/%d: %s", r+1, *runs, t.name)
			res, err := measure(ctx, dir, t)
			if err != nil {
				return fmt.Errorf("run %d: %s: %w", r+1, t.name, err)
			}
			results[t.name] = append(results[t.name], res)
			log.Printf("  %+v", res)
		}
	}
	return report(ctx, targets, results)
}

func allTargets() []target {
	ts := []target{
		{name: "direct", http: httpA, bulk: iperfAddr},
	}
	for _, procs := range []int{1, 2} {
		ts = append(ts, target{
			name: fmt.Sprintf("weir-%dp", procs), http: proxyHTTP, bulk: proxyBulk,
			start: func(ctx context.Context, dir string) (*benchproc.Proc, error) {
				return startWeir(ctx, dir, procs, false)
			},
		})
	}
	ts = append(ts, target{
		name: "weir-1p-sockmap", http: proxyHTTP, bulk: proxyBulk,
		start: func(ctx context.Context, dir string) (*benchproc.Proc, error) { return startWeir(ctx, dir, 1, true) },
	})
	for _, threads := range []int{1, 2} {
		for _, splice := range []string{"auto", "splice"} {
			ts = append(ts, target{
				name: fmt.Sprintf("haproxy-%dt-%s", threads, splice), http: proxyHTTP, bulk: proxyBulk,
				start: func(ctx context.Context, dir string) (*benchproc.Proc, error) {
					return startHAProxy(ctx, dir, threads, splice)
				},
			})
		}
	}
	for _, workers := range []int{1, 2} {
		ts = append(ts, target{
			name: fmt.Sprintf("nginx-%dw", workers), http: proxyHTTP, bulk: proxyBulk,
			start: func(ctx context.Context, dir string) (*benchproc.Proc, error) {
				return startNginxStream(ctx, dir, workers)
			},
		})
	}
	return ts
}

// measure starts t, runs every case against it and stops it.
func measure(ctx context.Context, dir string, t target) (result, error) {
	var res result
	var p *benchproc.Proc
	if t.start != nil {
		if err := benchproc.PortsFree(t.http, t.bulk); err != nil {
			return res, err
		}
		var err error
		if p, err = t.start(ctx, dir); err != nil {
			return res, err
		}
		defer p.Stop()
		if err := benchproc.WaitPorts(ctx, t.http, t.bulk); err != nil {
			return res, err
		}
	}
	url := "http://" + t.http + "/"

	// Short connections: one request each.
	var perf *perfStat
	cpu0 := p.CPU()
	if p != nil {
		perf = startPerf(p.PIDs())
	}
	segs0, _ := tcpOutSegs()
	w, err := runWrk(ctx, url, true)
	if err != nil {
		return res, err
	}
	sys, _ := stopPerf(perf)
	if segs1, err := tcpOutSegs(); err == nil && w.requests > 0 {
		res.SegmentsPerConn = float64(segs1-segs0) / float64(w.requests)
	}
	res.ConnRPS, res.ConnP50, res.ConnP99 = w.rps, w.p50, w.p99
	if p != nil && w.requests > 0 {
		res.CPUPerConn = (p.CPU() - cpu0) * 1e6 / float64(w.requests)
		res.SyscallsPerConn = float64(sys.syscalls) / float64(w.requests)
	}

	// Keep-alive.
	cpu0 = p.CPU()
	if p != nil {
		perf = startPerf(p.PIDs())
	}
	if w, err = runWrk(ctx, url, false); err != nil {
		return res, err
	}
	sys, _ = stopPerf(perf)
	res.KARPS, res.KAP50, res.KAP99 = w.rps, w.p50, w.p99
	if p != nil && w.requests > 0 {
		res.CPUPerKAReq = (p.CPU() - cpu0) * 1e6 / float64(w.requests)
		res.SyscallsPerKAReq = float64(sys.syscalls) / float64(w.requests)
	}

	// Bulk.
	if p != nil {
		perf = startPerf(p.PIDs())
	}
	if res.Bulk1, err = runIperf(ctx, t.bulk, 1); err != nil {
		return res, err
	}
	sys, _ = stopPerf(perf)
	res.SplicesBulk = float64(sys.splices)
	if res.Bulk4, err = runIperf(ctx, t.bulk, 4); err != nil {
		return res, err
	}

	if p != nil {
		res.PeakRSS = p.Mem("VmHWM")
		rss, fds, err := holdIdle(ctx, t.http, p)
		if err != nil {
			return res, err
		}
		res.IdleRSS, res.FDsPerConn = rss, fds
	}
	return res, nil
}

// tcpOutSegs is the machine's count of TCP segments sent (Tcp OutSegs in
// /proc/net/snmp). On loopback every segment is received too, so it measures the
// kernel's packet work: the client's, the proxy's both sides and the backend's.
func tcpOutSegs() (uint64, error) {
	raw, err := os.ReadFile("/proc/net/snmp")
	if err != nil {
		return 0, err
	}
	var names []string
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != "Tcp:" {
			continue
		}
		if names == nil {
			names = f
			continue
		}
		for i, n := range names {
			if n == "OutSegs" && i < len(f) {
				return strconv.ParseUint(f[i], 10, 64)
			}
		}
	}
	return 0, errors.New("no Tcp OutSegs in /proc/net/snmp")
}

// holdIdle opens -idle connections through p, each having done one request, and
// returns p's RSS (MB) and descriptors per connection while they are held.
func holdIdle(ctx context.Context, addr string, p *benchproc.Proc) (float64, float64, error) {
	fd0 := p.FDs()
	var cs []net.Conn
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	req := []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	buf := make([]byte, 4096)
	for range *idle {
		if ctx.Err() != nil {
			return 0, 0, ctx.Err()
		}
		c, err := net.DialTimeout("tcp", addr, 3*time.Second)
		if err != nil {
			return 0, 0, fmt.Errorf("idle connections: %w", err)
		}
		cs = append(cs, c)
		c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write(req); err != nil {
			return 0, 0, fmt.Errorf("idle connections: %w", err)
		}
		if _, err := c.Read(buf); err != nil {
			return 0, 0, fmt.Errorf("idle connections: %w", err)
		}
	}
	time.Sleep(500 * time.Millisecond)
	rss := p.Mem("VmRSS")
	fds := float64(p.FDs()-fd0) / float64(*idle)
	return rss, fds, nil
}

// --- processes ---

// variantTargets are the -variants targets (kept whatever -only says: they were
// asked for by name).
func variantTargets() ([]target, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	vs, err := benchproc.ParseVariants(*variants, self, []string{"GOMAXPROCS", "LOOPS"})
	if err != nil {
		return nil, err
	}
	var ts []target
	for _, v := range vs {
		env := []string{"GOMAXPROCS=2"}
		for _, kv := range v.Env {
			if n, ok := strings.CutPrefix(kv, "LOOPS="); ok {
				kv = loopsEnv + "=" + n
			}
			env = append(env, kv) // a later GOMAXPROCS wins
		}
		ts = append(ts, target{
			name: "weir-" + v.Name, http: proxyHTTP, bulk: proxyBulk, variant: true,
			start: func(ctx context.Context, dir string) (*benchproc.Proc, error) {
				return benchproc.Start(dir, "weir-"+v.Name, env, v.Bin, "-serve")
			},
		})
	}
	return ts, nil
}

// startWeir runs weir's proxy in a child process with GOMAXPROCS procs (the analogue
// of HAProxy's nbthread and nginx's worker_processes), forwarding in the kernel
// (loader.SockMap) if sockmap is set.
func startWeir(ctx context.Context, dir string, procs int, sockmap bool) (*benchproc.Proc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	env := []string{"GOMAXPROCS=" + strconv.Itoa(procs)}
	if sockmap {
		env = append(env, sockmapEnv+"=1")
	}
	return benchproc.Start(dir, "weir", env, self, "-serve")
}

func startHAProxy(ctx context.Context, dir string, threads int, splice string) (*benchproc.Proc, error) {
	opt := "option splice-auto"
	if splice == "splice" {
		opt = "option splice-request\n  option splice-response"
	}
	cfg := fmt.Sprintf(`global
  nbthread %d
defaults
  mode tcp
  timeout connect 3s
  timeout client 60s
  timeout server 60s
  %s
listen http
  bind %s
  balance leastconn
  server a %s
  server b %s
listen bulk
  bind %s
  server a %s
`, threads, opt, proxyHTTP, httpA, httpB, proxyBulk, iperfAddr)
	path := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	return benchproc.Start(dir, "haproxy", nil, "haproxy", "-db", "-f", path)
}

func startNginxStream(ctx context.Context, dir string, workers int) (*benchproc.Proc, error) {
	prefix := filepath.Join(dir, "nginx-stream")
	os.MkdirAll(prefix, 0o755)
	cfg := fmt.Sprintf(`load_module /usr/lib/nginx/modules/ngx_stream_module.so;
worker_processes %d;
pid %s/nginx.pid;
error_log %s/error.log;
events { worker_connections 8192; }
stream {
  upstream http { least_conn; server %s; server %s; }
  upstream bulk { server %s; }
  server { listen %s reuseport; proxy_pass http; }
  server { listen %s reuseport; proxy_pass bulk; }
}
`, workers, prefix, prefix, httpA, httpB, iperfAddr, proxyHTTP, proxyBulk)
	path := filepath.Join(prefix, "nginx.conf")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	return benchproc.Start(dir, "nginx-stream", nil, "nginx", "-p", prefix, "-c", path, "-e", prefix+"/error.log", "-g", "daemon off;")
}

func startNginxBackend(ctx context.Context, dir string) (*benchproc.Proc, error) {
	prefix := filepath.Join(dir, "nginx-backend")
	os.MkdirAll(prefix, 0o755)
	cfg := fmt.Sprintf(`worker_processes 1;
pid %s/nginx.pid;
error_log %s/error.log;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 120s;
  server {
    listen %s backlog=4096;
    listen %s backlog=4096;
    location / { return 200 "ok\n"; }
  }
}
`, prefix, prefix, httpA, httpB)
	path := filepath.Join(prefix, "nginx.conf")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	return benchproc.Start(dir, "nginx-backend", nil, "nginx", "-p", prefix, "-c", path, "-e", prefix+"/error.log", "-g", "daemon off;")
}

func port(addr string) string {
	_, p, _ := net.SplitHostPort(addr)
	return p
}

func ensureTools(ctx context.Context) error {
	need := map[string]string{
		"haproxy": "haproxy", "nginx": "nginx", "wrk": "wrk", "iperf3": "iperf3", "gnuplot": "gnuplot-nox", "perf": "linux-perf",
	}
	var pkgs []string
	for bin, pkg := range need {
		if _, err := exec.LookPath(bin); err != nil {
			pkgs = append(pkgs, pkg)
		}
	}
	if _, err := os.Stat("/usr/lib/nginx/modules/ngx_stream_module.so"); err != nil {
		pkgs = append(pkgs, "libnginx-mod-stream")
	}
	return benchproc.AptInstall(ctx, pkgs)
}

// --- load generators ---

type wrkResult struct {
	rps, p50, p99 float64
	requests      int64
}

var (
	reRPS  = regexp.MustCompile(`Requests/sec:\s+([\d.]+)`)
	reReqs = regexp.MustCompile(`(\d+) requests in`)
	reLat  = regexp.MustCompile(`(?m)^\s+(50|99)%\s+([\d.]+)(us|ms|s)`)
)

func runWrk(ctx context.Context, url string, closeEach bool) (wrkResult, error) {
	var res wrkResult
	args := []string{"-t1", "-c" + strconv.Itoa(*conns), "-d" + strconv.Itoa(int(duration.Seconds())) + "s", "--latency"}
	if closeEach {
		args = append(args, "-H", "Connection: close")
	}
	ctx, cancel := context.WithTimeout(ctx, *duration+20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "wrk", append(args, url)...).CombinedOutput()
	if err != nil {
		return res, fmt.Errorf("wrk: %w\n%s", err, out)
	}
	s := string(out)
	m := reRPS.FindStringSubmatch(s)
	if m == nil {
		return res, fmt.Errorf("wrk: no Requests/sec in output:\n%s", s)
	}
	res.rps, _ = strconv.ParseFloat(m[1], 64)
	if m := reReqs.FindStringSubmatch(s); m != nil {
		res.requests, _ = strconv.ParseInt(m[1], 10, 64)
	}
	for _, m := range reLat.FindAllStringSubmatch(s, -1) {
		v, _ := strconv.ParseFloat(m[2], 64)
		switch m[3] {
		case "us":
			v /= 1000
		case "s":
			v *= 1000
		}
		if m[1] == "50" {
			res.p50 = v
		} else {
			res.p99 = v
		}
	}
	if strings.Contains(s, "Socket errors") || strings.Contains(s, "Non-2xx") {
		log.Printf("wrk %s: %s", url, strings.TrimSpace(s[strings.Index(s, "requests in"):]))
	}
	return res, nil
}

func runIperf(ctx context.Context, addr string, streams int) (float64, error) {
	// The iperf3 server takes one test at a time and, on a loaded machine, can
	// still be closing the last one when the next begins; it answers "busy"
	// then, which is no measure of the proxy, so the test is tried again.
	retryUntil := time.Now().Add(10 * time.Second)
	for {
		gbps, err := iperfOnce(ctx, addr, streams)
		if err == nil || !strings.Contains(err.Error(), "server is busy") || time.Now().After(retryUntil) {
			return gbps, err
		}
		select {
		case <-ctx.Done():
			return 0, err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func iperfOnce(ctx context.Context, addr string, streams int) (float64, error) {
	host, p, _ := net.SplitHostPort(addr)
	ctx, cancel := context.WithTimeout(ctx, *duration+20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "iperf3", "-c", host, "-p", p, "-P", strconv.Itoa(streams),
		"-t", strconv.Itoa(int(duration.Seconds())), "-J").Output()
	var r struct {
		End struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
		Error string `json:"error"`
	}
	jerr := json.Unmarshal(out, &r)
	if r.Error != "" {
		// -J reports the server's refusal in its JSON, with a non-zero exit.
		return 0, fmt.Errorf("iperf3: %s", r.Error)
	}
	if err != nil {
		return 0, fmt.Errorf("iperf3: %w\n%s", err, out)
	}
	if jerr != nil {
		return 0, fmt.Errorf("iperf3: %v", jerr)
	}
	return r.End.SumReceived.BitsPerSecond / 1e9, nil
}

// perfStat counts a proxy's system calls and, of them, its splices.
type perfStat = benchproc.SyscallCount

type sysCounts struct{ syscalls, splices int64 }

func startPerf(pids []int) *perfStat {
	return benchproc.CountSyscalls(pids, "raw_syscalls:sys_enter", "syscalls:sys_enter_splice")
}

func stopPerf(ps *perfStat) (sysCounts, error) {
	m, err := ps.Stop()
	return sysCounts{syscalls: m["raw_syscalls:sys_enter"], splices: m["syscalls:sys_enter_splice"]}, err
}

// --- report ---

// median is the median of f over rs, with the least and the greatest value.
func median(rs []result, f func(result) float64) (med, lo, hi float64) {
	if len(rs) == 0 {
		return 0, 0, 0
	}
	v := make([]float64, 0, len(rs))
	for _, r := range rs {
		v = append(v, f(r))
	}
	med = benchstat.Median(v) // sorts v
	return med, v[0], v[len(v)-1]
}

type metric struct {
	key, title, unit string
	f                func(result) float64
	ratio            bool // also shown as a ratio to direct
	higher           bool // higher is better
}

var metrics = []metric{
	{"conn_rps", "new connections/s (1 request each)", "conn/s", func(r result) float64 { return r.ConnRPS }, true, true},
	{"conn_p50", "p50 latency, new connections", "ms", func(r result) float64 { return r.ConnP50 }, false, false},
	{"conn_p99", "p99 latency, new connections", "ms", func(r result) float64 { return r.ConnP99 }, false, false},
	{"ka_rps", "keep-alive requests/s", "req/s", func(r result) float64 { return r.KARPS }, true, true},
	{"ka_p99", "p99 latency, keep-alive", "ms", func(r result) float64 { return r.KAP99 }, false, false},
	{"bulk1", "bulk, 1 stream", "Gbit/s", func(r result) float64 { return r.Bulk1 }, true, true},
	{"bulk4", "bulk, 4 streams", "Gbit/s", func(r result) float64 { return r.Bulk4 }, true, true},
	{"cpu_per_conn", "proxy CPU per short connection", "µs", func(r result) float64 { return r.CPUPerConn }, false, false},
	{"syscalls_per_conn", "proxy system calls per short connection", "calls", func(r result) float64 { return r.SyscallsPerConn }, false, false},
	{"cpu_per_ka_req", "proxy CPU per keep-alive request", "µs", func(r result) float64 { return r.CPUPerKAReq }, false, false},
	{"syscalls_per_ka_req", "proxy system calls per keep-alive request", "calls", func(r result) float64 { return r.SyscallsPerKAReq }, false, false},
	{"segments_per_conn", "TCP segments sent per short connection (all sockets)", "segments", func(r result) float64 { return r.SegmentsPerConn }, false, false},
	{"splices_bulk", "splice calls during 1-stream bulk", "calls", func(r result) float64 { return r.SplicesBulk }, false, false},
	{"peak_rss", "peak RSS", "MB", func(r result) float64 { return r.PeakRSS }, false, false},
	{"idle_rss", "RSS at idle connections", "MB", func(r result) float64 { return r.IdleRSS }, false, false},
	{"fds_per_conn", "descriptors per idle connection", "fds", func(r result) float64 { return r.FDsPerConn }, false, false},
}

// metricOf is the accessor of the metric named key.
func metricOf(key string) func(result) float64 {
	for _, m := range metrics {
		if m.key == key {
			return m.f
		}
	}
	panic("no metric " + key)
}

func report(ctx context.Context, targets []target, results map[string][]result) error {
	if err := os.MkdirAll(*outDir, 0o755); err != nil {
		return err
	}
	raw, _ := json.MarshalIndent(results, "", "  ")
	if err := os.WriteFile(filepath.Join(*outDir, "results.json"), raw, 0o644); err != nil {
		return err
	}
	var b strings.Builder
	host, _ := os.Hostname()
	fmt.Fprintf(&b, "# weir proxy vs HAProxy vs nginx (loopback)\n\n")
	cmd := fmt.Sprintf("go run ./bench/proxy -runs %d -d %s -c %d", *runs, *duration, *conns)
	if *only != "" {
		cmd += " -only " + *only
	}
	if *variants != "" {
		cmd += fmt.Sprintf(" -variants %q", *variants)
	}
	fmt.Fprintf(&b, "`%s` on %s, %d CPUs (shared), %s. Medians of %d interleaved runs; "+
		"ratios are to direct in the same runs. HAProxy `auto` = `option splice-auto`, `splice` = `option splice-request` + "+
		"`splice-response`; the splice column says whether it spliced at all.\n\n",
		cmd, host, numCPU(), time.Now().UTC().Format("2006-01-02"), *runs)
	fmt.Fprintf(&b, "| target | new conn/s | ratio | p50 ms | p99 ms | keep-alive req/s | ratio | p99 ms | bulk 1 Gbit/s | ratio | bulk 4 Gbit/s | ratio | CPU µs/conn | syscalls/conn | CPU µs/keep-alive req | syscalls/keep-alive req | segments/conn | splice calls (bulk) | peak RSS MB | RSS MB @%d idle | fds/conn |\n", *idle)
	fmt.Fprintf(&b, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	direct := results["direct"]
	for _, t := range targets {
		rs := results[t.name]
		cell := func(key string, prec int) string {
			m, _, _ := median(rs, metricOf(key))
			if t.start == nil && m == 0 {
				return "-"
			}
			return strconv.FormatFloat(m, 'f', prec, 64)
		}
		ratio := func(key string) string {
			d, _, _ := median(direct, metricOf(key))
			m, _, _ := median(rs, metricOf(key))
			if d == 0 {
				return "-"
			}
			return fmt.Sprintf("%.2f", m/d)
		}
		cells := []string{t.name,
			cell("conn_rps", 0), ratio("conn_rps"), cell("conn_p50", 2), cell("conn_p99", 2),
			cell("ka_rps", 0), ratio("ka_rps"), cell("ka_p99", 2),
			cell("bulk1", 1), ratio("bulk1"), cell("bulk4", 1), ratio("bulk4"),
			cell("cpu_per_conn", 0), cell("syscalls_per_conn", 1), cell("cpu_per_ka_req", 1), cell("syscalls_per_ka_req", 1),
			cell("segments_per_conn", 1), cell("splices_bulk", 0), cell("peak_rss", 1), cell("idle_rss", 1), cell("fds_per_conn", 2)}
		fmt.Fprintf(&b, "| %s |\n", strings.Join(cells, " | "))
	}
	b.WriteString(targetsVsHAProxy(targets, results))
	if err := os.WriteFile(filepath.Join(*outDir, "results.md"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	fmt.Print(b.String())
	return plot(ctx, targets, results)
}

// targetsVsHAProxy checks the goals: weir (its configuration with the most new
// connections/s, not counting in-kernel forwarding) against HAProxy's best
// configuration for each measure. Two ratios: of the medians, and the median of each
// run's ratio (weir's to that HAProxy configuration's in the same run), which this
// machine's drift from minute to minute moves less.
func targetsVsHAProxy(targets []target, results map[string][]result) string {
	weir, wbest := "", math.Inf(-1)
	for _, t := range targets {
		if strings.HasPrefix(t.name, "weir") && !strings.HasSuffix(t.name, "sockmap") && !t.variant {
			if m, _, _ := median(results[t.name], metricOf("conn_rps")); m > wbest {
				weir, wbest = t.name, m
			}
		}
	}
	if weir == "" {
		return ""
	}
	best := func(f func(result) float64, higher bool, onlySplice bool) (string, float64) {
		name, v := "", math.NaN()
		for _, t := range targets {
			if !strings.HasPrefix(t.name, "haproxy") || (onlySplice && !strings.HasSuffix(t.name, "splice")) {
				continue
			}
			m, _, _ := median(results[t.name], f)
			if math.IsNaN(v) || (higher && m > v) || (!higher && m < v) {
				name, v = t.name, m
			}
		}
		return name, v
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n## Targets: %s (weir's best on new connections/s) against HAProxy's best configuration for each measure\n\n", weir)
	b.WriteString("| measure | weir | best HAProxy | ratio of medians | median of per-run ratios | target | met (per-run) |\n|---|---:|---:|---:|---:|---:|---|\n")
	row := func(title, key string, higher, onlySplice bool, want float64) {
		f := metricOf(key)
		name, h := best(f, higher, onlySplice)
		if name == "" {
			return
		}
		w, _, _ := median(results[weir], f)
		paired, _ := benchstat.PairedRatio(results[weir], results[name], f)
		met := (higher && paired >= want) || (!higher && paired <= want)
		op := ">="
		if !higher {
			op = "<="
		}
		fmt.Fprintf(&b, "| %s | %.4g | %.4g (%s) | %.2f | %.2f | %s %.1f | %v |\n", title, w, h, name, w/h, paired, op, want, met)
	}
	row("new connections/s", "conn_rps", true, false, 1.1)
	row("keep-alive requests/s", "ka_rps", true, false, 1.0)
	row("bulk 1 stream (vs forced splice)", "bulk1", true, true, 1.0)
	row("bulk 4 streams (vs forced splice)", "bulk4", true, true, 1.0)
	row("p99 new connections", "conn_p99", false, false, 1.0)
	row("p99 keep-alive", "ka_p99", false, false, 1.0)
	row("CPU per connection", "cpu_per_conn", false, false, 1.0)
	row("system calls per connection", "syscalls_per_conn", false, false, 1.0)
	w, _, _ := median(results[weir], metricOf("fds_per_conn"))
	fmt.Fprintf(&b, "| descriptors per connection | %.2f | | | | <= 3 | %v |\n", w, w <= 3)
	w, _, _ = median(results[weir], metricOf("idle_rss"))
	fmt.Fprintf(&b, "| RSS MB at %d connections | %.1f | | | | <= 40 | %v |\n", *idle, w, w <= 40)
	return b.String()
}

func plot(ctx context.Context, targets []target, results map[string][]result) error {
	if _, err := exec.LookPath("gnuplot"); err != nil {
		log.Printf("no gnuplot: skipping plots")
		return nil
	}
	for _, m := range metrics {
		var data strings.Builder
		for _, t := range targets {
			med, lo, hi := median(results[t.name], m.f)
			if t.start == nil && med == 0 {
				continue
			}
			fmt.Fprintf(&data, "%q %g %g %g\n", t.name, med, lo, hi)
		}
		dat := filepath.Join(*outDir, m.key+".dat")
		if err := os.WriteFile(dat, []byte(data.String()), 0o644); err != nil {
			return err
		}
		better := "lower is better"
		if m.higher {
			better = "higher is better"
		}
		script := fmt.Sprintf(`set terminal pngcairo size 900,420 font "sans,10"
set output %q
set title "%s (%s; median, bars min-max of %d runs)"
set ylabel %q
set style fill solid 0.6
set boxwidth 0.6
set yrange [0:*]
set xtics rotate by -25
set grid ytics
unset key
plot %q using 0:2:xtic(1) with boxes lc rgb "#4477aa", '' using 0:2:3:4 with yerrorbars lc rgb "black" pt 0, '' using 0:2:(sprintf("%%.3g",$2)) with labels offset 0,1
`, filepath.Join(*outDir, m.key+".png"), m.title, better, *runs, m.unit, dat)
		cmd := exec.CommandContext(ctx, "gnuplot")
		cmd.Stdin = strings.NewReader(script)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("gnuplot %s: %w\n%s", m.key, err, out)
		}
		os.Remove(dat)
	}
	return nil
}
