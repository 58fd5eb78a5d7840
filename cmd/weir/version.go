package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/weir-lb/weir/loader"
)

// runVersion prints what this binary is: the module version, the commit and build
// date it was built from (when go build recorded them), and the hash of the XDP
// object it carries, so two nodes can tell whether they run the same data plane.
func runVersion(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", "", "Print the module version, commit, build date and the BPF object's hash.", stdout, stderr)
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return err
	}
	version, commit, date, dirty := "(devel)", "unknown", "unknown", ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		if bi.Main.Version != "" {
			version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				commit = s.Value
			case "vcs.time":
				date = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					dirty = " (modified)"
				}
			}
		}
	}
	fmt.Fprintf(stdout, "weir %s\ncommit %s%s\nbuilt %s with %s\nbpf object sha256 %s\n", version, commit, dirty, date, runtime.Version(), loader.ObjectHash())
	return nil
}
