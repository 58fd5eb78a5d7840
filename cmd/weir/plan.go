package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// maxMove is the --max-move flag: a percentage, and whether it was given.
type maxMove struct {
	pct float64
	set bool
}

func (m *maxMove) String() string {
	if !m.set {
		return ""
	}
	return strconv.FormatFloat(m.pct, 'g', -1, 64)
}

func (m *maxMove) Set(s string) error {
	v, err := strconv.ParseFloat(strings.TrimSuffix(s, "%"), 64)
	if err != nil || !(v >= 0 && v <= 100) { // NaN too
		return fmt.Errorf("must be a percentage 0..100, got %q", s)
	}
	m.pct, m.set = v, true
	return nil
}

func maxMoveFlag(fs *command) *maxMove {
	m := &maxMove{}
	fs.Var(m, "max-move", "refuse a change that moves more than `PCT` percent of a service's new flows")
	return m
}

func runPlan(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("plan", "", "What applying a config (-c FILE; default: the file the agent runs, as weir reload would\nread it) would move, per service, without applying it: lookup-table slots that change\nowner, established flows reset or drained, proxy connections, http requests in flight and\nclient connections, new data planes.\nExit 1 if the reload would be refused (a certificate pair that does not load, no XDP\nslots for the change), each reason at its field and line; with --max-move, also if a\nservice would move more than PCT% of its new flows.", stdout, stderr)
	asJSON := fs.Bool("json", false, "print JSON, for scripts")
	maxMove := maxMoveFlag(fs)
	socket := adminFlags(fs)
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return err
	}
	path, err := socket()
	if err != nil {
		return fmt.Errorf("plan: %w", err)
	}
	var data []byte
	var name string
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "c" || f.Name == "config" {
			name = f.Value.String()
		}
	})
	if name != "" {
		if data, err = os.ReadFile(name); err != nil {
			return fmt.Errorf("plan: %w", err)
		}
		// The agent takes the file's relative paths (http.tls) from its directory,
		// which it knows only by a name that does not depend on this process's
		// working directory.
		if name, err = filepath.Abs(name); err != nil {
			return fmt.Errorf("plan: %w", err)
		}
	}
	var pct *float64
	if maxMove.set {
		pct = &maxMove.pct
	}
	p, err := admin.NewClient(path).Plan(ctx, data, name, pct)
	if err != nil {
		return reportRejected(stderr, "plan", "cannot plan this config", err)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(p); err != nil {
			return err
		}
	} else {
		p.WriteTable(stdout)
	}
	return planVerdict(stderr, p, maxMove.pct)
}

// planVerdict says on stderr why a reload of the planned file would not go
// through, a line for each reason (over --max-move pct, refused for a
// certificate pair or the XDP program's slots), as the table on stdout does;
// errReported if there is one.
func planVerdict(stderr io.Writer, p api.Plan, pct float64) error {
	if len(p.OverBudget) > 0 {
		fmt.Fprintf(stderr, "weir: plan: %s would move more than --max-move %g%% of new flows\n", strings.Join(p.OverBudget, ", "), pct)
	}
	if p.Refused != "" {
		fmt.Fprintf(stderr, "weir: plan: a reload would be refused: %s\n", p.Refused)
	}
	if len(p.OverBudget) > 0 || p.Refused != "" {
		return errReported
	}
	return nil
}

// reportRejected prints the agent's refusal of a command, one problem a line under
// headline, or returns err (not an answer from the agent) as cmd's.
func reportRejected(stderr io.Writer, cmd, headline string, err error) error {
	var re *admin.RequestError
	if !errors.As(err, &re) {
		return fmt.Errorf("%s: %w", cmd, err)
	}
	fmt.Fprintln(stderr, "weir: "+headline+":")
	for _, e := range re.Errors {
		fmt.Fprintln(stderr, "  "+e)
	}
	return errReported
}
