// Package demo is weir's built-in demonstration: a client, a balancer and backends in
// network namespaces, the XDP program on the balancer's interface, real HTTP over new
// TCP connections (and UDP) to the VIPs, and a table of who answered beside what the
// program counted. `weir demo` prints it; the package's test runs the same scenario
// and checks it, in native and generic mode.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sort"
	"sync"
	"text/tabwriter"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/loader"
)

// Options of a demo run. Zero values take the defaults.
type Options struct {
	Backends int         // default 3
	Requests int         // new TCP connections per round, default 300
	Mode     loader.Mode // attach mode, default auto
	Out      io.Writer   // where the tables go; nil prints nothing
}

// Round is one batch of requests and what happened to it.
type Round struct {
	Title    string
	Sent     int
	Answers  map[string]int            // backend name -> requests it answered
	Failures []error                   // requests that got no answer
	XDP      map[string]loader.Counter // backend name -> packets the program sent it
}

// Report is what a run saw.
type Report struct {
	Mode     loader.Mode // the attach mode the program got
	Backends []string
	Rounds   []Round
	Reasons  map[loader.Reason]loader.Counter
}

// NamePrefix prefixes the demo's namespaces; a crashed run's are removed at start.
const NamePrefix = "wdm"

// NATVIP is the demo's full-nat VIP, routed by the client via the balancer like the
// others but held by no backend.
var NATVIP = netip.MustParseAddr("10.77.100.2")

// Run builds the topology, runs the rounds and removes everything, whatever happens.
func Run(ctx context.Context, opts Options) (_ Report, err error) {
	if opts.Backends == 0 {
		opts.Backends = 3
	}
	if opts.Requests == 0 {
		opts.Requests = 300
	}
	if opts.Mode == "" {
		opts.Mode = loader.ModeAuto
	}
	out := opts.Out
	if out == nil {
		out = io.Discard
	}
	if err := topo.CleanupStale(NamePrefix); err != nil {
		return Report{}, fmt.Errorf("demo: remove a crashed run's namespaces: %w", err)
	}
	t, err := topo.New(topo.Config{Name: topo.UniqueName(NamePrefix), Backends: opts.Backends})
	if err != nil {
		return Report{}, fmt.Errorf("demo: build topology: %w", err)
	}
	defer func() { err = errors.Join(err, t.Close()) }()
	if err := t.ServeBackends(ctx); err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}

	// nat needs forwarding on for its route lookups; its source is the balancer's address.
	if err := t.Balancer.NS.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644)
	}); err != nil {
		return Report{}, fmt.Errorf("demo: enable forwarding: %w", err)
	}
	prog, err := loader.Load(loader.Options{HashSeed: 1, NAT: loader.NATOptions{Addr4: t.Balancer.IP4, Addr6: t.Balancer.IP6}})
	if err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	defer func() { err = errors.Join(err, prog.Close()) }()
	var mode loader.Mode
	if err := t.Balancer.NS.Do(func() error {
		mode, err = prog.Attach(t.Balancer.Link, opts.Mode)
		return err
	}); err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	rep := Report{Mode: mode}
	fmt.Fprintf(out, "weir demo: XDP program attached to %s in namespace %s, %s mode\n",
		t.Balancer.Link, t.Balancer.NS.Name(), mode)

	names := make(map[netip.Addr]string)
	service := func(vip netip.Addr, port uint16, proto loader.Protocol) loader.Service {
		s := loader.Service{Key: loader.ServiceKey{VIP: netip.AddrPortFrom(vip, port), Protocol: proto}}
		for _, h := range t.Backends {
			ip := h.IP4
			if vip.Is6() {
				ip = h.IP6
			}
			names[ip] = h.Name
			s.Backends = append(s.Backends, loader.Backend{Addr: netip.AddrPortFrom(ip, port), MAC: h.MAC, Weight: 1, Usable: true})
		}
		return s
	}
	web4 := service(t.VIP4, topo.HTTPPort, loader.TCP)
	web6 := service(t.VIP6, topo.HTTPPort, loader.TCP)
	dns4 := service(t.VIP4, topo.UDPPort, loader.UDP)
	// A second VIP in full nat mode: the backends hold no VIP for it and answer the
	// balancer's address; the program translates both directions.
	natVIP := NATVIP
	web4nat := service(natVIP, topo.HTTPPort, loader.TCP)
	web4nat.Forwarding = loader.ForwardNAT
	for i := range web4nat.Backends {
		web4nat.Backends[i].MAC = nil
	}
	for _, s := range []loader.Service{web4, web6, dns4, web4nat} {
		if err := prog.AddService(s); err != nil {
			return rep, fmt.Errorf("demo: %w", err)
		}
		fmt.Fprintf(out, "service %s -> %d backends, %s\n", s.Key, len(s.Backends), s.Forwarding)
	}
	for _, h := range t.Backends {
		rep.Backends = append(rep.Backends, h.Name)
	}

	round := func(title string, svc loader.Service, n int, ask func(i int) (string, error)) error {
		before, err := prog.Stats()
		if err != nil {
			return err
		}
		r := Round{Title: title, Sent: n, Answers: make(map[string]int), XDP: make(map[string]loader.Counter)}
		var mu sync.Mutex
		var wg sync.WaitGroup
		work := make(chan int)
		const workers = 8
		for range workers {
			wg.Add(1)
			// Exits when work is closed.
			go func() {
				defer wg.Done()
				for i := range work {
					name, err := ask(i)
					mu.Lock()
					if err != nil {
						r.Failures = append(r.Failures, err)
					} else {
						r.Answers[name]++
					}
					mu.Unlock()
				}
			}()
		}
		for i := range n {
			work <- i
		}
		close(work)
		wg.Wait()
		after, err := prog.Stats()
		if err != nil {
			return err
		}
		for addr, c := range after.Backends[svc.Key] {
			was := before.Backends[svc.Key][addr]
			r.XDP[names[addr.Addr()]] = loader.Counter{Packets: c.Packets - was.Packets, Bytes: c.Bytes - was.Bytes}
		}
		rep.Rounds = append(rep.Rounds, r)
		printRound(out, r, rep.Backends)
		return nil
	}

	n := opts.Requests
	if err := round(fmt.Sprintf("%d HTTP requests to %s, each on a new TCP connection", n, web4.Key),
		web4, n, func(int) (string, error) { return t.Get(ctx, t.VIP4) }); err != nil {
		return rep, fmt.Errorf("demo: %w", err)
	}
	if err := round(fmt.Sprintf("%d HTTP requests to %s", n/3, web6.Key),
		web6, n/3, func(int) (string, error) { return t.Get(ctx, t.VIP6) }); err != nil {
		return rep, fmt.Errorf("demo: %w", err)
	}
	if err := round(fmt.Sprintf("%d UDP queries to %s from distinct ports", n/3, dns4.Key),
		dns4, n/3, func(i int) (string, error) { return t.AskUDP(ctx, dns4.Key.VIP, uint16(30000+i)) }); err != nil {
		return rep, fmt.Errorf("demo: %w", err)
	}

	if err := round(fmt.Sprintf("%d HTTP requests to %s (full nat: the backends see the balancer, not the client)", n, web4nat.Key),
		web4nat, n, func(int) (string, error) { return t.Get(ctx, natVIP) }); err != nil {
		return rep, fmt.Errorf("demo: %w", err)
	}

	down := web4.Backends[0]
	if err := prog.SetBackendUsable(web4.Key, down.Addr, false); err != nil {
		return rep, fmt.Errorf("demo: %w", err)
	}
	fmt.Fprintf(out, "\nmarked %s (%s) unusable\n", names[down.Addr.Addr()], down.Addr)
	if err := round(fmt.Sprintf("%d HTTP requests to %s with %s unusable", n, web4.Key, names[down.Addr.Addr()]),
		web4, n, func(int) (string, error) { return t.Get(ctx, t.VIP4) }); err != nil {
		return rep, fmt.Errorf("demo: %w", err)
	}

	stats, err := prog.Stats()
	if err != nil {
		return rep, fmt.Errorf("demo: %w", err)
	}
	rep.Reasons = stats.Reasons
	printReasons(out, stats.Reasons)
	return rep, nil
}

func printRound(out io.Writer, r Round, backends []string) {
	fmt.Fprintf(out, "\n%s\n", r.Title)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "backend\tanswered\tshare\txdp packets\txdp bytes\t")
	for _, b := range backends {
		share := 0.0
		if r.Sent > 0 {
			share = 100 * float64(r.Answers[b]) / float64(r.Sent)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f%%\t%d\t%d\t\n", b, r.Answers[b], share, r.XDP[b].Packets, r.XDP[b].Bytes)
	}
	fmt.Fprintf(tw, "failed\t%d\t\t\t\t\n", len(r.Failures))
	tw.Flush()
	if len(r.Failures) > 0 {
		fmt.Fprintf(out, "first failure: %v\n", r.Failures[0])
	}
}

func printReasons(out io.Writer, reasons map[loader.Reason]loader.Counter) {
	fmt.Fprintf(out, "\nXDP program counters\n")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "reason\tpackets\tbytes\t")
	keys := make([]loader.Reason, 0, len(reasons))
	for r := range reasons {
		keys = append(keys, r)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
	for _, r := range keys {
		if c := reasons[r]; c.Packets > 0 {
			fmt.Fprintf(tw, "%s\t%d\t%d\t\n", r, c.Packets, c.Bytes)
		}
	}
	tw.Flush()
}
