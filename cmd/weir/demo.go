package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/weir-lb/weir/internal/demo"
	"github.com/weir-lb/weir/loader"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("weir demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	backends := fs.Int("backends", 3, "number of backend namespaces (1..200)")
	requests := fs.Int("requests", 300, "new TCP connections per round")
	mode := fs.String("mode", "auto", "XDP attach mode: auto, native or generic")
	if err := fs.Parse(args); err != nil {
		return err
	}
	m, err := loader.ParseMode(*mode)
	if err != nil {
		return fmt.Errorf("demo: -mode: %w", err)
	}
	if *backends < 1 || *backends > 200 {
		return fmt.Errorf("demo: -backends must be 1..200, got %d", *backends)
	}
	if *requests < 3 {
		return fmt.Errorf("demo: -requests must be at least 3, got %d", *requests)
	}
	if os.Geteuid() != 0 {
		return errors.New("demo: needs root to create network namespaces and load XDP: run it with sudo")
	}
	_, err = demo.Run(ctx, demo.Options{Backends: *backends, Requests: *requests, Mode: m, Out: stdout})
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, "\ndemo done: namespaces, links and the XDP program are removed")
	return nil
}
