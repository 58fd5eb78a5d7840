// Command weir is the load balancer's one binary. Subcommands:
//
//	weir demo [-backends N] [-requests N] [-mode auto|native|generic]
//
// More (run, validate, status, drain, weight, reload, decap) arrive with the agent.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

const usage = `weir: an L4 load balancer with an XDP data plane

usage:
  weir demo [flags]   build a demo topology in network namespaces, balance real
                      traffic with XDP, print who answered, remove everything

run 'weir COMMAND -h' for a command's flags
`

func main() {
	// A closed stdout (weir demo | head) must not kill the process before it removes
	// its namespaces: with SIGPIPE ignored the write fails and teardown still runs.
	signal.Ignore(syscall.SIGPIPE)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "weir:", err)
		}
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command given")
	}
	switch args[0] {
	case "demo":
		return runDemo(ctx, args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", args[0])
}
