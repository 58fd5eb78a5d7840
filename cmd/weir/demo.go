package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/weir-lb/weir/internal/demo"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && (args[0] == "down" || args[0] == "hold") {
		return runDemoSub(ctx, args[0], args[1:], stdout, stderr)
	}
	fs := newFlagSet("demo", "",
		"Build a client, a balancer and backends in network namespaces, run the agent on them\n"+
			"(weir run, in the balancer's namespace) and show it balancing real traffic: health,\n"+
			"drain, reloads, the proxy. Without --keep it removes everything when done;\nweir demo down removes what --keep left.", stdout, stderr)
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
	if os.Geteuid() != 0 {
		return errors.New("demo: needs root to create network namespaces and load XDP (run it as root, or with sudo)")
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	rep, err := demo.Run(ctx, demo.Options{Backends: *backends, Requests: *requests, Attach: *mode, Keep: *keep, Out: stdout,
		AgentArgv: func(cfg string) []string { return []string{exe, "run", "-c", cfg} },
		HoldArgv:  func(state string) []string { return []string{exe, "demo", "hold", state} }})
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

func runDemoSub(ctx context.Context, cmd string, args []string, stdout, stderr io.Writer) error {
	switch cmd {
	case "down":
		fs := newFlagSet("demo down", "", "Stop the agent and the backends weir demo --keep left, and remove its namespaces.", stdout, stderr)
		if err := parseFlags(fs, args, 0, 0); err != nil {
			return err
		}
		if err := demo.Down(""); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "the kept demo is removed: agent stopped, namespaces gone")
		return nil
	default: // hold: internal, run by weir demo --keep
		if len(args) != 1 {
			return errors.New("demo hold: usage: weir demo hold STATE (run by weir demo --keep)")
		}
		return demo.Hold(ctx, args[0])
	}
}
