package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/weir-lb/weir/userspace/agent/admin"
)

// runNode is `weir node drain|undrain`: the node's BGP announcements as a whole.
func runNode(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || (args[0] != "drain" && args[0] != "undrain") {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help") {
			fmt.Fprint(stdout, nodeUsage)
			return nil
		}
		fmt.Fprint(stderr, nodeUsage)
		return fmt.Errorf("node: want drain or undrain")
	}
	cmd := "node " + args[0]
	about := "Withdraw every BGP route of this node: the routers send it no new flows, and it keeps\n" +
		"serving the flows that still reach it. --wait returns once bgp.drain_timeout has passed,\n" +
		"when the node can be stopped. Lasts until weir node undrain or a restart."
	if args[0] == "undrain" {
		about = "End the node's drain: its VIPs are announced again where their services are usable."
	}
	fs := newFlagSet(cmd, "", about, stdout, stderr)
	wait := new(bool)
	if args[0] == "drain" {
		fs.BoolVar(wait, "wait", false, "wait until bgp.drain_timeout has passed since the drain")
	}
	socket := adminFlags(fs)
	if err := parseFlags(fs, args[1:], 0, 0); err != nil {
		return err
	}
	path, err := socket()
	if err != nil {
		return fmt.Errorf("%s: %w", cmd, err)
	}
	c := admin.NewClient(path)
	drain := args[0] == "drain"
	if err := c.NodeDrain(ctx, drain); err != nil {
		return fmt.Errorf("%s: %w", cmd, err)
	}
	if !drain {
		fmt.Fprintln(stdout, "node undrained: its usable VIPs are announced again")
		return nil
	}
	st, err := c.Status(ctx)
	if err != nil || st.BGP == nil {
		return fmt.Errorf("%s: drained, but the status could not be read: %v", cmd, err)
	}
	fmt.Fprintf(stdout, "node drained: every BGP route withdrawn; flows still arriving are served until %s\n", st.BGP.DrainUntil.Format(time.RFC3339))
	if !*wait {
		return nil
	}
	select {
	case <-time.After(time.Until(st.BGP.DrainUntil)):
	case <-ctx.Done():
		return fmt.Errorf("%s: %w", cmd, ctx.Err())
	}
	fmt.Fprintln(stdout, "drain_timeout has passed: the node can be stopped")
	return nil
}

const nodeUsage = `usage:
  weir node drain [--wait]   withdraw every BGP route of this node; established flows keep being served
  weir node undrain          announce the node's usable VIPs again
`
