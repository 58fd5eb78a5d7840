package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/weir-lb/weir/internal/demo"
	"github.com/weir-lb/weir/internal/fleet"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && (args[0] == "down" || args[0] == "hold") {
		return runDemoSub(ctx, args[0], args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "fleet" {
		return runDemoFleet(ctx, args[1:], stdout, stderr)
	}
	fs := newFlagSet("demo", "",
		"Build a client, a balancer and backends in network namespaces, run the agent on them\n"+
			"(weir run, in the balancer's namespace) and show it balancing real traffic: health,\n"+
			"drain, reloads, the proxy. Without --keep it removes everything when done;\nweir demo down removes what --keep left. weir demo fleet shows three nodes announcing\na VIP over BGP to a router (weir demo fleet -h).\n"+
			"WEIR_DEMO_NAME=NAME (3 letters a-z, not a prefix weir uses itself, such as wdm or wfl)\nruns it beside the default one: in "+
			"/run/weir-demo-NAME, its namespaces' names beginning with NAME.", stdout, stderr)
	backends := fs.Int("backends", 3, "backends the config starts with (1..50; a reload adds one more)")
	requests := fs.Int("requests", 300, "new TCP connections per round")
	mode := fs.String("mode", "auto", "XDP attach mode: auto, native or generic")
	keep := fs.Bool("keep", false, "leave the topology and the agent running, and print what to try (weir demo down removes them)")
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return err
	}
	switch *mode {
	case "auto", "native", "generic":
	default:
		return fmt.Errorf("demo: --mode: must be auto, native or generic, got %q", *mode)
	}
	if *backends < 1 || *backends > 50 {
		return fmt.Errorf("demo: --backends must be 1..50, got %d", *backends)
	}
	if *requests < 3 {
		return fmt.Errorf("demo: --requests must be at least 3, got %d", *requests)
	}
	dir, prefix, err := demoPlace()
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	if os.Geteuid() != 0 {
		return errors.New("demo: needs root to create network namespaces and load XDP (run it as root, or with sudo)")
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	cleaned := cutShortOnSecondSignal(stderr, prefix+"*")
	rep, err := demo.Run(ctx, demo.Options{Backends: *backends, Requests: *requests, Attach: *mode, Keep: *keep, Out: stdout,
		AgentArgv: func(cfg string) []string { return []string{exe, "run", "-c", cfg} },
		HoldArgv:  func(state, prefix string) []string { return []string{exe, "demo", "hold", state, prefix} },
		Dir:       dir, NamePrefix: prefix})
	cleaned()
	if stopped(ctx, err) {
		fmt.Fprintf(stdout, "\ndemo stopped (%v): the agent is stopped; namespaces, links and the XDP program are removed\n", err)
		return nil
	}
	if err != nil {
		return err
	}
	failed := 0
	for _, s := range rep.Steps {
		if !s.OK {
			failed++
		}
	}
	if !*keep {
		fmt.Fprintln(stdout, "\ndemo done: the agent is stopped; namespaces, links and the XDP program are removed")
	}
	if failed > 0 {
		return fmt.Errorf("demo: %d of %d steps did not go as expected (see FAIL above)", failed, len(rep.Steps))
	}
	return nil
}

// demoPlace is where weir demo keeps its files (its lock is DIR.lock) and how
// its namespaces' names begin: /run/weir-demo and wdm, or, for a demo beside
// that one (weir's tests run theirs so), what WEIR_DEMO_NAME says.
func demoPlace() (dir, prefix string, err error) {
	return demo.Place(os.Getenv(demo.NameEnv))
}

func runDemoFleet(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo fleet", "",
		"Build a router running BIRD 2, three weir nodes and dsr backends in network namespaces,\n"+
			"run the agent on each node (weir run) announcing the VIP over BGP, and show the router's\n"+
			"ECMP route, the streams per node, and one node killed while the streams go on.\n"+
			"Needs BIRD 2 and nftables (apt-get install bird2 nftables, or make deps). Removes\neverything when done.", stdout, stderr)
	streams := fs.Int("streams", 60, "long-lived TCP streams to run (1..150)")
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return err
	}
	if *streams < 1 || *streams > 150 {
		return fmt.Errorf("demo fleet: --streams must be 1..150, got %d", *streams)
	}
	if os.Geteuid() != 0 {
		return errors.New("demo fleet: needs root to create network namespaces and load XDP (run it as root, or with sudo)")
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("demo fleet: %w", err)
	}
	cleaned := cutShortOnSecondSignal(stderr, "wfl*")
	rep, err := fleet.Demo(ctx, fleet.DemoOptions{Out: stdout, Streams: *streams,
		AgentArgv: func(cfg string) []string { return []string{exe, "run", "-c", cfg} }})
	cleaned()
	if stopped(ctx, err) {
		fmt.Fprintf(stdout, "\ndemo stopped (%v): agents and BIRD stopped; namespaces, links and XDP programs removed\n", err)
		return nil
	}
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, "\ndemo done: agents and BIRD stopped; namespaces, links and XDP programs removed")
	if rep.Broken > 0 {
		return fmt.Errorf("demo fleet: %d of %d streams broke", rep.Broken, rep.Streams)
	}
	return nil
}

// cutShortOnSecondSignal lets a user cut a demo's cleanup short: the first
// SIGINT, SIGTERM or SIGHUP stops the demo, which then removes what it made; a
// second exits at once, status 130, saying that the namespaces named left and
// what runs in them may remain. The caller calls the returned func as soon as
// the demo has returned, its cleanup done: from then on no signal says that
// anything was cut short (one that comes then is left to the caller's
// context, which the first has ended, and the demo ends as it would have).
func cutShortOnSecondSignal(stderr io.Writer, left string) (cleaned func()) {
	sig := make(chan os.Signal, 2)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	var mu sync.Mutex
	over := false // the cleanup is done
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // exits when cleaned is called, or ends the process
		defer wg.Done()
		for n := 0; ; {
			select {
			case s := <-sig:
				if n++; n < 2 {
					continue
				}
				// Both at once may be ready: the select picks either.
				mu.Lock()
				if over {
					mu.Unlock()
					return
				}
				fmt.Fprintf(stderr, "weir: demo: %v again: cleanup cut short; namespaces %s, their links and processes may be left (the next run of the demo removes the namespaces)\n", s, left)
				os.Exit(130)
			case <-done:
				return
			}
		}
	}()
	return func() {
		mu.Lock()
		over = true
		mu.Unlock()
		signal.Stop(sig)
		close(done)
		wg.Wait()
	}
}

// stopped reports whether a demo ended because a signal ended ctx, having
// removed everything it made: the demos then return the signal (ctx's cause)
// itself, and what failed on the way out besides.
func stopped(ctx context.Context, err error) bool {
	return err != nil && ctx.Err() != nil && err == context.Cause(ctx)
}

func runDemoSub(ctx context.Context, cmd string, args []string, stdout, stderr io.Writer) error {
	switch cmd {
	case "down":
		fs := newFlagSet("demo down", "", "Stop the agent and the backends weir demo --keep left, and remove its namespaces.\n"+
			"WEIR_DEMO_NAME names the kept demo, if it was run with one.", stdout, stderr)
		if err := parseFlags(fs, args, 0, 0); err != nil {
			return err
		}
		dir, prefix, err := demoPlace()
		if err != nil {
			return fmt.Errorf("demo down: %w", err)
		}
		if err := demo.Down(dir, prefix); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "the kept demo is removed: agent stopped, namespaces gone")
		return nil
	default: // hold: internal, run by weir demo --keep
		if len(args) != 2 {
			return errors.New("demo hold: usage: weir demo hold STATE PREFIX (run by weir demo --keep)")
		}
		// Only a demo's own prefix: weir's tests and demo fleet name their
		// namespaces with the others, which a state file could then name.
		if prefix := args[1]; prefix != demo.NamePrefix {
			if _, p, err := demo.Place(prefix); err != nil || p != prefix {
				return fmt.Errorf("demo hold: PREFIX %q is no demo's: a demo's namespaces begin %s or its %s (3 letters a-z that weir's own tests and demos do not use)", prefix, demo.NamePrefix, demo.NameEnv)
			}
		}
		return demo.Hold(ctx, args[0], args[1])
	}
}
