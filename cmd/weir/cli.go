package main

import (
	"flag"
	"fmt"
	"io"
)

// command is one subcommand's flag set and how it is called.
type command struct {
	*flag.FlagSet
	name, args, about string
	stdout            io.Writer // where -h prints
	positional        []string
}

// Arg is the i-th positional argument, wherever it stood among the flags.
func (c *command) Arg(i int) string {
	if i < len(c.positional) {
		return c.positional[i]
	}
	return ""
}

// NArg is the number of positional arguments.
func (c *command) NArg() int { return len(c.positional) }

// newFlagSet returns the flags of `weir name`; args is the positional part of its
// usage line ("SERVICE BACKEND"), about what it does.
func newFlagSet(name, args, about string, stdout, stderr io.Writer) *command {
	c := &command{FlagSet: flag.NewFlagSet("weir "+name, flag.ContinueOnError), name: name, args: args, about: about, stdout: stdout}
	c.SetOutput(stderr)
	c.Usage = func() {
		w := c.Output()
		fmt.Fprintf(w, "usage: %s\n\n%s\n", c.usageLine(), c.about)
		n := 0
		c.VisitAll(func(*flag.Flag) { n++ })
		if n > 0 {
			fmt.Fprintln(w, "\nflags (before or after the arguments; -x and --x are the same):")
			c.PrintDefaults()
		}
	}
	return c
}

func (c *command) usageLine() string {
	line := "weir " + c.name
	if c.args != "" {
		line += " " + c.args
	}
	n := 0
	c.VisitAll(func(*flag.Flag) { n++ })
	if n > 0 {
		line += " [flags]"
	}
	return line
}

// parseFlags parses args, flags and positional arguments in any order ("--" ends
// the flags), and checks there are min..max positional ones (max < 0: any). -h and
// --help print the usage to stdout and return flag.ErrHelp, which exits 0.
func parseFlags(c *command, args []string, min, max int) error {
	for _, a := range args {
		if a == "--" {
			break
		}
		if a == "-h" || a == "-help" || a == "--help" {
			c.SetOutput(c.stdout)
			c.Usage()
			return flag.ErrHelp
		}
	}
	var pos []string
	rest := args
	for {
		if err := c.Parse(rest); err != nil {
			return fmt.Errorf("%s: %w (see weir %s -h)", c.name, err, c.name)
		}
		rest = c.Args()
		if len(rest) == 0 {
			break
		}
		if rest[0] == "--" {
			pos = append(pos, rest[1:]...)
			break
		}
		pos = append(pos, rest[0])
		rest = rest[1:]
	}
	c.positional = pos
	if len(pos) < min || max >= 0 && len(pos) > max {
		var what string
		switch {
		case len(pos) >= min:
			what = fmt.Sprintf("unexpected argument %q", pos[max])
		case min == max:
			what = fmt.Sprintf("%s, want %d", arguments(len(pos)), min)
		default:
			what = fmt.Sprintf("%s, want at least %d", arguments(len(pos)), min)
		}
		return fmt.Errorf("%s: %s: usage: %s", c.name, what, c.usageLine())
	}
	return nil
}

// errUsage wraps a message about how a command is called.
func errUsage(c *command, format string, args ...any) error {
	return fmt.Errorf("%s: %s: usage: %s", c.name, fmt.Sprintf(format, args...), c.usageLine())
}

// arguments says "1 argument" or "n arguments".
func arguments(n int) string {
	if n == 1 {
		return "1 argument"
	}
	return fmt.Sprintf("%d arguments", n)
}
