// Command http benchmarks weir's http data plane side by side with HAProxy (mode
// http, h2 to clients and backends), nginx (http2, grpc_pass) and Caddy
// (reverse_proxy), all in front of the same two backends on loopback.
//
//	flock /tmp/weir-bench.lock go run ./bench/http              # 3 interleaved runs
//	go run ./bench/http -runs 5 -d 5s -only weir,haproxy
//
// Per target it measures HTTP/1.1 keep-alive requests/s (h2load --h1, 50
// connections, -n requests; with -loads h1post also POSTs of a 512-byte JSON
// body, h2load's -d), HTTP/2 multiplexed requests/s (h2load, 4
// connections × 64 streams, -n requests), gRPC unary calls/s (grpc-go, 4 channels × 32 calls in flight),
// WebSocket messages echoed/s (x/net/websocket, 50 connections, one 64-byte
// message at a time on each, for -d), the p50 and p99 of each (from h2load's per-request log and the gRPC client's own
// timings), the target's CPU time per request (from /proc; for HTTP/1.1 also its
// kernel share, and its system calls per request from perf stat), and its RSS with
// 1,000 idle HTTP/2 client connections open, and with 1,000 idle HTTP/1.1
// keep-alive ones (and so the memory per idle connection of each). Targets are interleaved in every run, the order rotated; results
// are medians over the runs, printed as a markdown table with every figure also
// as a ratio to HAProxy's, and written as JSON under -out.
//
// The backends run in a child process of their own (internal/httpbackend: HTTP/1.1,
// h2c and gRPC on one port each), and so does weir (-serve weir), so no target
// shares a Go runtime with the load generators. It installs haproxy, nginx, caddy, perf
// and nghttp2-client with apt-get if missing, bounds every step in time, and
// stops only the processes it started.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	_ "net/http/pprof"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"golang.org/x/net/websocket"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testpb "google.golang.org/grpc/interop/grpc_testing"

	"github.com/weir-lb/weir/bench/internal/benchproc"
	"github.com/weir-lb/weir/bench/internal/benchstat"
	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/userspace/httplb"
)

var (
	runs     = flag.Int("runs", 3, "interleaved runs; results are medians")
	duration = flag.Duration("d", 4*time.Second, "length of the gRPC load")
	requests = flag.Int("n", 60000, "requests of each h2load load")
	idle     = flag.Int("idle", 1000, "idle HTTP/2 client connections held for the RSS measure")
	outDir   = flag.String("out", "bench/results/http", "results directory")
	only     = flag.String("only", "", "comma-separated targets (default all)")
	install  = flag.Bool("install", true, "apt-get install missing tools")
	timeout  = flag.Duration("timeout", 30*time.Minute, "bound on the whole run")
	serve    = flag.String("serve", "", "internal: run backends or weir (child process)")
	threads  = flag.Int("threads", 2, "threads or workers of every target (GOMAXPROCS for weir)")
	variants = flag.String("variants", "", `more weir targets, each with settings of its own, interleaved with the rest: "name:KEY=V,KEY=V;name2:..." with keys GOGC, GOMEMLIMIT, GOMAXPROCS (the runtime's; GOMAXPROCS overrides -threads), H2CONNS (upstream HTTP/2 connections per backend), UPSTREAM (auto, http1, h2c; of the HTTP/1.1 and h2 fronts, not gRPC's), NETHTTP2 (1: HTTP/2 clients through net/http's server and transport, not the frame engine), NETHTTP1 (1: HTTP/1.1 clients through net/http's server, not weir's connection loop) and BIN (another build of this program to run weir from, e.g. main's, for a before/after)`)
	pprof    = flag.String("pprof", "", "serve weir's net/http/pprof on this address (for a profile: go tool pprof http://ADDR/debug/pprof/profile)")
	loads    = flag.String("loads", "h1,h2,grpc,ws,idle,idle1,idlews", "the loads to run, of h1, h1post (HTTP/1.1 POSTs of a 512-byte JSON body), h2, grpc, ws (WebSocket echoes), idle (HTTP/2 connections held), idle1 (HTTP/1.1 connections held) and idlews (WebSockets held); an A/B of one path runs only its load, and so more rounds in the same time")
)

// Loopback ports.
const (
	backendA, backendB = "127.0.0.1:18181", "127.0.0.1:18182"
	frontH1            = "127.0.0.1:19180" // HTTP/1.1 clients
	frontH2            = "127.0.0.1:19181" // h2c clients, plain HTTP
	frontGRPC          = "127.0.0.1:19182" // gRPC clients
)

func main() {
	flag.Parse()
	if *serve != "" {
		if err := serveChild(*serve); err != nil {
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

// serveChild runs the backends or weir's http plane until SIGTERM.
func serveChild(what string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	switch what {
	case "backends":
		for _, a := range []struct{ name, addr string }{{"a", backendA}, {"b", backendB}} {
			b, err := httpbackend.Start(a.name, a.addr)
			if err != nil {
				return err
			}
			defer b.Close()
		}
		<-ctx.Done()
		return nil
	case "weir":
		if *pprof != "" {
			// Exits with the process.
			go func() { log.Print(http.ListenAndServe(*pprof, nil)) }()
		}
		h2conns, _ := strconv.Atoi(os.Getenv("H2CONNS"))
		upstream, ok := map[string]httplb.Upstream{"": httplb.UpstreamAuto, "auto": httplb.UpstreamAuto,
			"http1": httplb.UpstreamHTTP1, "h2c": httplb.UpstreamH2C}[os.Getenv("UPSTREAM")]
		if !ok {
			return fmt.Errorf("UPSTREAM=%q: want auto, http1 or h2c", os.Getenv("UPSTREAM"))
		}
		var bs []httplb.Backend
		for _, a := range []string{backendA, backendB} {
			bs = append(bs, httplb.Backend{Addr: netip.MustParseAddrPort(a), Weight: 1, Usable: true})
		}
		var wg sync.WaitGroup
		for _, l := range []string{frontH1, frontH2, frontGRPC} {
			up := upstream
			if l == frontGRPC {
				up = httplb.UpstreamAuto // gRPC needs HTTP/2 end to end
			}
			s, err := httplb.Listen(httplb.Config{Name: l, Listen: netip.MustParseAddrPort(l), Algorithm: "round_robin",
				Retries: 2, RetryBudget: 0.2, XForwardedFor: true, XForwardedProto: true, H2Conns: h2conns, Upstream: up, NetHTTP2: os.Getenv("NETHTTP2") == "1", NetHTTP1: os.Getenv("NETHTTP1") == "1",
				Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))}, bs)
			if err != nil {
				return err
			}
			// Exits when ctx is done and the service has drained.
			wg.Go(func() {
				if err := s.Serve(ctx); err != nil {
					log.Print(err)
				}
			})
		}
		wg.Wait()
		return nil
	}
	return fmt.Errorf("-serve %q: want backends or weir", what)
}

type target struct {
	name  string
	start func(ctx context.Context, dir string) (*benchproc.Proc, error)
}

// result is one target's measures in one run.
type result struct {
	H1RPS, H1P50, H1P99       float64 // /s, ms, ms
	H2RPS, H2P50, H2P99       float64
	GRPCRPS, GRPCP50, GRPCP99 float64
	H1CPU, H2CPU, GRPCCPU     float64 // µs of the target's CPU per request
	H1SysCPU                  float64 // of H1CPU, µs in the kernel
	H1Syscalls                float64 // system calls per HTTP/1.1 request
	PostRPS, PostP50, PostP99 float64 // HTTP/1.1 POSTs of postBody
	PostCPU                   float64 // µs of the target's CPU per POST
	WSRPS, WSP50, WSP99       float64 // WebSocket messages echoed /s, round trip ms
	WSCPU                     float64 // µs of the target's CPU per message echoed
	IdleRSS                   float64 // MB with -idle h2 connections open
	IdleConnKB                float64 // KB per idle h2 connection
	Idle1RSS, Idle1ConnKB     float64 // the same for HTTP/1.1 keep-alive connections
	IdleWSRSS, IdleWSConnKB   float64 // the same for WebSockets, each having echoed one message
}

func run(ctx context.Context) error {
	if *install {
		if err := ensureTools(ctx); err != nil {
			return err
		}
	}
	dir, err := os.MkdirTemp("", "weir-httpbench-")
	if err != nil {
		return fmt.Errorf("temp dir: %w", err)
	}
	defer os.RemoveAll(dir)
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if err := benchproc.PortsFree(backendA, backendB, frontH1, frontH2, frontGRPC); err != nil {
		return err
	}
	be, err := benchproc.Start(dir, "backends", nil, self, "-serve", "backends")
	if err != nil {
		return err
	}
	defer be.Stop()
	if err := benchproc.WaitPorts(ctx, backendA, backendB); err != nil {
		return err
	}
	targets := []target{
		{"weir", func(ctx context.Context, dir string) (*benchproc.Proc, error) {
			return benchproc.Start(dir, "weir", []string{"GOMAXPROCS=" + strconv.Itoa(*threads)}, self, "-serve", "weir", "-pprof", *pprof)
		}},
	}
	vs, err := benchproc.ParseVariants(*variants, self, []string{"GOGC", "GOMEMLIMIT", "GOMAXPROCS", "H2CONNS", "UPSTREAM", "NETHTTP2", "NETHTTP1"})
	if err != nil {
		return err
	}
	for _, v := range vs {
		targets = append(targets, target{"weir-" + v.Name, func(ctx context.Context, dir string) (*benchproc.Proc, error) {
			env := append([]string{"GOMAXPROCS=" + strconv.Itoa(*threads)}, v.Env...)
			return benchproc.Start(dir, "weir-"+v.Name, env, v.Bin, "-serve", "weir")
		}})
	}
	targets = append(targets, []target{
		{"haproxy", startHAProxy},
		{"nginx", startNginx},
		{"caddy", startCaddy},
	}...)
	if *only != "" {
		keep := strings.Split(*only, ",")
		// -variants are kept: they were asked for by name.
		targets = slices.DeleteFunc(targets, func(t target) bool { return !slices.Contains(keep, t.name) && !strings.HasPrefix(t.name, "weir-") })
	}
	results := map[string][]result{}
	for r := range *runs {
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
	return report(targets, results)
}

func measure(ctx context.Context, dir string, t target) (result, error) {
	var res result
	if err := benchproc.PortsFree(frontH1, frontH2, frontGRPC); err != nil {
		return res, err
	}
	p, err := t.start(ctx, dir)
	if err != nil {
		return res, err
	}
	defer p.Stop()
	if err := benchproc.WaitPorts(ctx, frontH1, frontH2, frontGRPC); err != nil {
		return res, err
	}
	// Warm up: pools to the backends, the runtime's heap.
	if _, err := h2load(ctx, dir, "-n", "2000", "-c", "4", "-m", "16", "http://"+frontH2+"/"); err != nil {
		return res, err
	}
	want := strings.Split(*loads, ",")
	if slices.Contains(want, "h1") {
		user, sys := p.CPUSplit()
		h1, err := h2load(ctx, dir, "--h1", "-c", "50", "-n", strconv.Itoa(*requests), "http://"+frontH1+"/")
		if err != nil {
			return res, err
		}
		user2, sys2 := p.CPUSplit()
		res.H1RPS, res.H1P50, res.H1P99 = h1.rps, h1.p50, h1.p99
		res.H1CPU, res.H1SysCPU = perReq(user2+sys2-user-sys, h1.n), perReq(sys2-sys, h1.n)
		// System calls are counted in a load of their own: counting costs each
		// call a little, which would weigh on the figures above, and more on the
		// target that makes more calls.
		count := benchproc.CountSyscalls(p.PIDs(), "raw_syscalls:sys_enter")
		h1c, err := h2load(ctx, dir, "--h1", "-c", "50", "-n", strconv.Itoa(max(*requests/4, 1000)), "http://"+frontH1+"/")
		calls, cerr := count.Stop()
		if err != nil {
			return res, err
		}
		if cerr == nil && h1c.n > 0 {
			res.H1Syscalls = float64(calls["raw_syscalls:sys_enter"]) / float64(h1c.n)
		}
	}
	if slices.Contains(want, "h1post") {
		body := filepath.Join(dir, "post.json")
		if err := os.WriteFile(body, postBody(512), 0o644); err != nil {
			return res, err
		}
		cpu := p.CPU()
		post, err := h2load(ctx, dir, "--h1", "-c", "50", "-n", strconv.Itoa(*requests), "-d", body,
			"-H", "Content-Type: application/json", "http://"+frontH1+"/")
		if err != nil {
			return res, err
		}
		res.PostRPS, res.PostP50, res.PostP99, res.PostCPU = post.rps, post.p50, post.p99, perReq(p.CPU()-cpu, post.n)
	}
	if slices.Contains(want, "h2") {
		cpu := p.CPU()
		h2, err := h2load(ctx, dir, "-c", "4", "-m", "64", "-n", strconv.Itoa(*requests), "http://"+frontH2+"/")
		if err != nil {
			return res, err
		}
		res.H2RPS, res.H2P50, res.H2P99, res.H2CPU = h2.rps, h2.p50, h2.p99, perReq(p.CPU()-cpu, h2.n)
	}
	if slices.Contains(want, "grpc") {
		cpu := p.CPU()
		g, err := grpcLoad(ctx, frontGRPC, 4, 32, *duration)
		if err != nil {
			return res, err
		}
		res.GRPCRPS, res.GRPCP50, res.GRPCP99, res.GRPCCPU = g.rps, g.p50, g.p99, perReq(p.CPU()-cpu, g.n)
	}
	if slices.Contains(want, "ws") {
		cpu := p.CPU()
		w, err := wsLoad(ctx, frontH1, 50, *duration)
		if err != nil {
			return res, err
		}
		res.WSRPS, res.WSP50, res.WSP99, res.WSCPU = w.rps, w.p50, w.p99, perReq(p.CPU()-cpu, w.n)
	}
	// RSS with -idle connections open, then with twice as many: the second batch's
	// growth is what an idle connection costs. Against the RSS right after the
	// loads, a Go proxy's garbage (collected and handed back meanwhile) can outweigh
	// the connections and make the difference negative. The HTTP/1.1 connections
	// come after the HTTP/2 ones, which stay open, so neither measure reuses what
	// the other's connections freed.
	var cs []net.Conn
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	for _, m := range []struct {
		load        string
		addr        string
		oneRequest  func(net.Conn, string) error
		rssMB, kbPC *float64
	}{
		{"idle", frontH2, idleH2, &res.IdleRSS, &res.IdleConnKB},
		{"idle1", frontH1, idleH1, &res.Idle1RSS, &res.Idle1ConnKB},
		{"idlews", frontH1, idleWS, &res.IdleWSRSS, &res.IdleWSConnKB},
	} {
		if !slices.Contains(want, m.load) {
			continue
		}
		rss, err := holdIdle(ctx, m.addr, p, &cs, m.oneRequest)
		if err != nil {
			return res, err
		}
		rss2, err := holdIdle(ctx, m.addr, p, &cs, m.oneRequest)
		if err != nil {
			return res, err
		}
		*m.rssMB, *m.kbPC = rss, (rss2-rss)*1024/float64(*idle)
	}
	return res, nil
}

func perReq(cpuSeconds float64, n int) float64 {
	if n == 0 {
		return 0
	}
	return cpuSeconds * 1e6 / float64(n)
}

// load is one workload's outcome.
type load struct {
	n             int     // requests answered
	rps, p50, p99 float64 // /s, ms, ms
}

var (
	h2loadDone = regexp.MustCompile(`requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded`)
	h2loadRate = regexp.MustCompile(`finished in [^,]+, ([\d.]+) req/s`)
)

// h2load runs nghttp2's h2load with a per-request log, from which p50 and p99
// come.
func h2load(ctx context.Context, dir string, args ...string) (load, error) {
	logPath := filepath.Join(dir, "h2load.log")
	os.Remove(logPath)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "h2load", append([]string{"--log-file", logPath}, args...)...).CombinedOutput()
	if err != nil {
		return load{}, fmt.Errorf("h2load %v: %w\n%s", args, err, out)
	}
	m := h2loadDone.FindSubmatch(out)
	rate := h2loadRate.FindSubmatch(out)
	if m == nil || rate == nil {
		return load{}, fmt.Errorf("h2load %v: output not understood:\n%s", args, out)
	}
	done, _ := strconv.Atoi(string(m[1]))
	ok, _ := strconv.Atoi(string(m[2]))
	if ok < done {
		return load{}, fmt.Errorf("h2load %v: %d of %d requests failed\n%s", args, done-ok, done, out)
	}
	data, err := os.ReadFile(logPath)
	if err != nil {
		return load{}, err
	}
	var lat []float64
	for line := range strings.Lines(string(data)) {
		if f := strings.Fields(line); len(f) >= 3 {
			us, _ := strconv.ParseFloat(f[2], 64)
			lat = append(lat, us/1000)
		}
	}
	l := load{n: ok}
	l.rps, _ = strconv.ParseFloat(string(rate[1]), 64)
	l.p50, l.p99 = pct(lat, 0.5), pct(lat, 0.99)
	return l, nil
}

func pct(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	sort.Float64s(v)
	return v[min(len(v)-1, int(float64(len(v))*q))]
}

// grpcLoad makes unary calls on channels channels, inflight at a time on each,
// for d.
func grpcLoad(ctx context.Context, addr string, channels, inflight int, d time.Duration) (load, error) {
	end := time.Now().Add(d)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var lat []float64
	var errs atomic.Int64
	var firstErr atomic.Value
	for range channels {
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return load{}, err
		}
		defer cc.Close()
		c := testpb.NewTestServiceClient(cc)
		for range inflight {
			// Exits after d (or when ctx is done).
			wg.Go(func() {
				var mine []float64
				req := &testpb.SimpleRequest{Payload: &testpb.Payload{Body: make([]byte, 64)}}
				for ctx.Err() == nil && time.Now().Before(end) {
					t0 := time.Now()
					if _, err := c.UnaryCall(ctx, req); err != nil {
						if ctx.Err() == nil {
							errs.Add(1)
							firstErr.CompareAndSwap(nil, err)
						}
						continue
					}
					mine = append(mine, float64(time.Since(t0).Microseconds())/1000)
				}
				mu.Lock()
				lat = append(lat, mine...)
				mu.Unlock()
			})
		}
	}
	wg.Wait()
	if n := errs.Load(); n > 0 {
		return load{}, fmt.Errorf("grpc: %d calls failed, first: %v", n, firstErr.Load())
	}
	return load{n: len(lat), rps: float64(len(lat)) / d.Seconds(), p50: pct(lat, 0.5), p99: pct(lat, 0.99)}, nil
}

// wsLoad opens conns WebSocket connections to addr's /ws (x/net/websocket, the
// backends echo) and on each sends a 64-byte message and waits for its echo, over
// and over, for d; it returns messages echoed per second and their round trips.
func wsLoad(ctx context.Context, addr string, conns int, d time.Duration) (load, error) {
	var wss []*websocket.Conn
	defer func() {
		for _, ws := range wss {
			ws.Close()
		}
	}()
	for range conns {
		ws, err := websocket.Dial("ws://"+addr+"/ws", "", "http://"+addr+"/")
		if err != nil {
			return load{}, fmt.Errorf("websocket: %w", err)
		}
		wss = append(wss, ws)
	}
	end := time.Now().Add(d)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var lat []float64
	var firstErr atomic.Value
	msg := strings.Repeat("m", 64)
	for _, ws := range wss {
		// Exits after d, when ctx is done, or on the connection's first error.
		wg.Go(func() {
			var mine []float64
			var got string
			for ctx.Err() == nil && time.Now().Before(end) {
				t0 := time.Now()
				ws.SetDeadline(t0.Add(10 * time.Second))
				if err := websocket.Message.Send(ws, msg); err != nil {
					firstErr.CompareAndSwap(nil, err)
					break
				}
				if err := websocket.Message.Receive(ws, &got); err != nil || got != msg {
					firstErr.CompareAndSwap(nil, fmt.Errorf("echo %q: %v", got, err))
					break
				}
				mine = append(mine, float64(time.Since(t0).Microseconds())/1000)
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if err := firstErr.Load(); err != nil && ctx.Err() == nil {
		return load{}, fmt.Errorf("websocket: %v", err)
	}
	return load{n: len(lat), rps: float64(len(lat)) / d.Seconds(), p50: pct(lat, 0.5), p99: pct(lat, 0.99)}, nil
}

// holdIdle opens -idle more HTTP/2 connections to addr, each having answered one
// request, adds them to cs, and returns p's RSS (MB) a second later.
// holdIdle opens -idle connections to addr, each making one request with
// oneRequest and then left open, and returns the target's RSS in MB.
func holdIdle(ctx context.Context, addr string, p *benchproc.Proc, cs *[]net.Conn, oneRequest func(c net.Conn, addr string) error) (float64, error) {
	for range *idle {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		c, err := net.DialTimeout("tcp", addr, 3*time.Second)
		if err != nil {
			return 0, fmt.Errorf("idle connections: %w", err)
		}
		*cs = append(*cs, c)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if err := oneRequest(c, addr); err != nil {
			return 0, fmt.Errorf("idle connections: %w", err)
		}
		c.SetDeadline(time.Time{})
	}
	time.Sleep(time.Second)
	return p.Mem("VmRSS"), nil
}

// idleH2 makes one HTTP/2 request (prior knowledge) and reads its answer.
func idleH2(c net.Conn, addr string) error {
	var hdr strings.Builder
	enc := hpack.NewEncoder(&hdr)
	for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", addr}, {":path", "/"}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	io.WriteString(c, http2.ClientPreface)
	fr := http2.NewFramer(c, c)
	fr.WriteSettings()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte(hdr.String()), EndHeaders: true, EndStream: true})
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return err
		}
		if s, ok := f.(*http2.SettingsFrame); ok && !s.IsAck() {
			fr.WriteSettingsAck()
		}
		if f.Header().StreamID == 1 && f.Header().Flags.Has(http2.FlagDataEndStream) {
			return nil
		}
	}
}

// idleH1 makes one HTTP/1.1 keep-alive request and reads its answer whole.
func idleH1(c net.Conn, addr string) error {
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: "+addr+"\r\n\r\n"); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	return err
}

// idleWS opens a WebSocket over c (the backends echo at /ws) and has one
// 64-byte message echoed, so the proxy has moved bytes both ways through the
// tunnel before it sits idle.
func idleWS(c net.Conn, addr string) error {
	cfg, err := websocket.NewConfig("ws://"+addr+"/ws", "http://"+addr+"/")
	if err != nil {
		return err
	}
	ws, err := websocket.NewClient(cfg, c)
	if err != nil {
		return err
	}
	msg := strings.Repeat("m", 64)
	if err := websocket.Message.Send(ws, msg); err != nil {
		return err
	}
	var got string
	if err := websocket.Message.Receive(ws, &got); err != nil || got != msg {
		return fmt.Errorf("echo %q: %v", got, err)
	}
	return nil
}

// --- the other targets ---

func startHAProxy(_ context.Context, dir string) (*benchproc.Proc, error) {
	cfg := fmt.Sprintf(`global
  nbthread %d
  maxconn 9000
defaults
  mode http
  timeout connect 3s
  timeout client 60s
  timeout server 60s
  option http-keep-alive
  # The forwarding headers weir adds by default (x_forwarded_for,
  # x_forwarded_proto; X-Forwarded-Proto is set per frontend, as an anonymous
  # defaults section takes no http-request rule), so both do the same work.
  option forwardfor
frontend h1
  bind %s
  http-request set-header X-Forwarded-Proto http
  default_backend be_h1
frontend h2
  bind %s proto h2
  http-request set-header X-Forwarded-Proto http
  default_backend be_h2
frontend grpc
  bind %s proto h2
  http-request set-header X-Forwarded-Proto http
  default_backend be_h2
backend be_h1
  balance roundrobin
  http-reuse always
  server a %s
  server b %s
backend be_h2
  balance roundrobin
  http-reuse always
  server a %s proto h2
  server b %s proto h2
`, *threads, frontH1, frontH2, frontGRPC, backendA, backendB, backendA, backendB)
	path := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	return benchproc.Start(dir, "haproxy", nil, "haproxy", "-db", "-f", path)
}

func startNginx(_ context.Context, dir string) (*benchproc.Proc, error) {
	cfg := fmt.Sprintf(`worker_processes %d;
pid %s/nginx.pid;
error_log %s/nginx-error.log;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 100000000;
  client_body_temp_path %s;
  proxy_temp_path %s;
  upstream h1 { server %s; server %s; keepalive 64; keepalive_requests 100000000; }
  upstream g { server %s; server %s; keepalive 64; keepalive_requests 100000000; }
  # The forwarding headers weir adds by default, as HAProxy's config does too (the
  # proxy_pass locations set theirs: one proxy_set_header there drops the inherited).
  grpc_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
  grpc_set_header X-Forwarded-Proto $scheme;
  server { listen %s;
    location / { proxy_pass http://h1; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for; proxy_set_header X-Forwarded-Proto $scheme; }
    # nginx passes an upgrade on only when told to (HAProxy, Caddy and weir do it by default).
    location /ws { proxy_pass http://h1; proxy_http_version 1.1; proxy_set_header Upgrade $http_upgrade; proxy_set_header Connection "upgrade"; proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for; proxy_set_header X-Forwarded-Proto $scheme; proxy_read_timeout 60s; }
  }
  server { listen %s http2; location / { proxy_pass http://h1; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for; proxy_set_header X-Forwarded-Proto $scheme; } }
  server { listen %s http2; location / { grpc_pass grpc://g; } }
}
`, *threads, dir, dir, dir, dir, backendA, backendB, backendA, backendB, frontH1, frontH2, frontGRPC)
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	return benchproc.Start(dir, "nginx", nil, "nginx", "-c", path, "-p", dir, "-g", "daemon off;")
}

func startCaddy(_ context.Context, dir string) (*benchproc.Proc, error) {
	cfg := fmt.Sprintf(`{
  admin off
  auto_https off
  servers {
    protocols h1 h2c
  }
}
http://%s {
  reverse_proxy %s %s {
    lb_policy round_robin
  }
}
http://%s {
  reverse_proxy %s %s {
    lb_policy round_robin
  }
}
http://%s {
  reverse_proxy %s %s {
    lb_policy round_robin
    transport http {
      versions h2c 2
    }
  }
}
`, frontH1, backendA, backendB, frontH2, backendA, backendB, frontGRPC, backendA, backendB)
	path := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	return benchproc.Start(dir, "caddy", []string{"XDG_DATA_HOME=" + dir, "XDG_CONFIG_HOME=" + dir, "GOMAXPROCS=" + strconv.Itoa(*threads)},
		"caddy", "run", "--config", path, "--adapter", "caddyfile")
}

func ensureTools(ctx context.Context) error {
	need := map[string]string{"haproxy": "haproxy", "nginx": "nginx", "caddy": "caddy", "h2load": "nghttp2-client", "perf": "linux-perf"}
	var pkgs []string
	for bin, pkg := range need {
		if _, err := exec.LookPath(bin); err != nil {
			pkgs = append(pkgs, pkg)
		}
	}
	return benchproc.AptInstall(ctx, pkgs)
}

// postBody is a JSON object of n bytes (n at least 32), the body of the h1post
// load's requests: a small API call's.
func postBody(n int) []byte {
	b := []byte(`{"id":12345,"items":["`)
	for len(b) < n-3 {
		b = append(b, 'a'+byte(len(b)%26))
	}
	return append(b, `"]}`...)
}

// --- report ---

func median(rs []result, f func(result) float64) float64 { return benchstat.Of(rs, f) }

func report(targets []target, results map[string][]result) error {
	cols := []struct {
		name string
		f    func(result) float64
	}{
		{"h1 req/s", func(r result) float64 { return r.H1RPS }},
		{"h1 p50 ms", func(r result) float64 { return r.H1P50 }},
		{"h1 p99 ms", func(r result) float64 { return r.H1P99 }},
		{"h1 CPU µs/req", func(r result) float64 { return r.H1CPU }},
		{"h1 kernel CPU µs/req", func(r result) float64 { return r.H1SysCPU }},
		{"h1 system calls/req", func(r result) float64 { return r.H1Syscalls }},
		{"h1 POST req/s", func(r result) float64 { return r.PostRPS }},
		{"h1 POST p50 ms", func(r result) float64 { return r.PostP50 }},
		{"h1 POST p99 ms", func(r result) float64 { return r.PostP99 }},
		{"h1 POST CPU µs/req", func(r result) float64 { return r.PostCPU }},
		{"h2 req/s", func(r result) float64 { return r.H2RPS }},
		{"h2 p50 ms", func(r result) float64 { return r.H2P50 }},
		{"h2 p99 ms", func(r result) float64 { return r.H2P99 }},
		{"h2 CPU µs/req", func(r result) float64 { return r.H2CPU }},
		{"gRPC calls/s", func(r result) float64 { return r.GRPCRPS }},
		{"gRPC p50 ms", func(r result) float64 { return r.GRPCP50 }},
		{"gRPC p99 ms", func(r result) float64 { return r.GRPCP99 }},
		{"gRPC CPU µs/call", func(r result) float64 { return r.GRPCCPU }},
		{"WebSocket msgs/s", func(r result) float64 { return r.WSRPS }},
		{"WebSocket p50 ms", func(r result) float64 { return r.WSP50 }},
		{"WebSocket p99 ms", func(r result) float64 { return r.WSP99 }},
		{"WebSocket CPU µs/msg", func(r result) float64 { return r.WSCPU }},
		{"RSS MB, idle h2 conns", func(r result) float64 { return r.IdleRSS }},
		{"KB per idle h2 conn", func(r result) float64 { return r.IdleConnKB }},
		{"RSS MB, idle h1 conns", func(r result) float64 { return r.Idle1RSS }},
		{"KB per idle h1 conn", func(r result) float64 { return r.Idle1ConnKB }},
		{"RSS MB, idle WebSockets", func(r result) float64 { return r.IdleWSRSS }},
		{"KB per idle WebSocket", func(r result) float64 { return r.IdleWSConnKB }},
	}
	var b strings.Builder
	fmt.Fprintf(&b, "medians of %d interleaved runs, %v per load, %d threads or workers each; (×) is the ratio to HAProxy's\n\n", *runs, *duration, *threads)
	fmt.Fprint(&b, "| measure |")
	for _, t := range targets {
		fmt.Fprintf(&b, " %s |", t.name)
	}
	fmt.Fprint(&b, "\n|---|")
	for range targets {
		fmt.Fprint(&b, "---|")
	}
	fmt.Fprintln(&b)
	medians := map[string]map[string]float64{}
	ratios := map[string]map[string]float64{}
	for _, c := range cols {
		if allZero(results, c.f) {
			continue // a load not run (-loads)
		}
		fmt.Fprintf(&b, "| %s |", c.name)
		base := median(results["haproxy"], c.f)
		for _, t := range targets {
			m := median(results[t.name], c.f)
			if medians[t.name] == nil {
				medians[t.name] = map[string]float64{}
			}
			medians[t.name][c.name] = m
			if base > 0 && t.name != "haproxy" {
				fmt.Fprintf(&b, " %.4g (%.2f×) |", m, m/base)
			} else {
				fmt.Fprintf(&b, " %.4g |", m)
			}
			if r, ok := benchstat.PairedRatio(results[t.name], results["haproxy"], c.f); ok && t.name != "haproxy" {
				if ratios[t.name] == nil {
					ratios[t.name] = map[string]float64{}
				}
				ratios[t.name][c.name] = r
			}
		}
		fmt.Fprintln(&b)
	}
	if len(ratios) > 0 {
		// Each run's figure over HAProxy's in the same run, then the median: on a
		// machine whose speed drifts between runs, steadier than a ratio of medians.
		fmt.Fprint(&b, "\nmedian of each run's ratio to HAProxy's in that run\n\n| measure |")
		for _, t := range targets {
			if ratios[t.name] != nil {
				fmt.Fprintf(&b, " %s |", t.name)
			}
		}
		fmt.Fprint(&b, "\n|---|")
		for _, t := range targets {
			if ratios[t.name] != nil {
				fmt.Fprint(&b, "---|")
			}
		}
		fmt.Fprintln(&b)
		for _, c := range cols {
			if allZero(results, c.f) {
				continue
			}
			fmt.Fprintf(&b, "| %s |", c.name)
			for _, t := range targets {
				if ratios[t.name] != nil {
					fmt.Fprintf(&b, " %.2f× |", ratios[t.name][c.name])
				}
			}
			fmt.Fprintln(&b)
		}
	}
	fmt.Print(b.String())
	if err := os.MkdirAll(*outDir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(*outDir, "results.md"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	js, err := json.MarshalIndent(map[string]any{"runs": results, "medians": medians, "paired_ratios": ratios}, "", "  ")
	if err != nil {
		return err
	}
	return errors.Join(os.WriteFile(filepath.Join(*outDir, "results.json"), js, 0o644))
}

func allZero(results map[string][]result, f func(result) float64) bool {
	for _, rs := range results {
		for _, r := range rs {
			if f(r) != 0 {
				return false
			}
		}
	}
	return true
}
