package topo

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
)

var nameSeq atomic.Uint64

// cleanedPrefixes are the prefixes UniqueName has run CleanupStale for.
var cleanedPrefixes sync.Map

// pidWidth is the width of the base-36 pid in UniqueName: 36^5 exceeds the
// kernel's largest pid_max, pidMaxLimit.
const pidWidth = 5

// pidMaxLimit is the kernel's largest pid_max (PID_MAX_LIMIT, 2^22 on 64-bit
// systems): 2hwcg in base 36, so a pid's first digit in a name is 0, 1 or 2.
const pidMaxLimit = 1 << 22

// UniqueName returns prefix + <pid, 5 base-36 digits> + <sequence number in
// base 36>, a topology name that no other live process and no other call in
// this process uses, e.g. "wt01kxz0". With a prefix of up to 3 characters
// the first 1296 names of a process fit MaxNameLen. Because the name carries
// the pid, CleanupStale can tell a crashed run's namespaces from those of a
// run that is still going.
//
// The first call for a prefix in a process also removes what crashed runs with
// that prefix left behind (CleanupStale), so a killed test run's namespaces do
// not outlive the next run.
//
// In a test binary UniqueName panics on a prefix not in ReservedPrefixes:
// add a test's new prefix there, where weir demo's name check sees it.
func UniqueName(prefix string) string {
	if inTest() && !slices.Contains(ReservedPrefixes, prefix) {
		panic(fmt.Sprintf("topo.UniqueName(%q): a prefix not in topo.ReservedPrefixes; add it there, so that WEIR_DEMO_NAME refuses it", prefix))
	}
	return uniqueName(prefix)
}

// uniqueName is UniqueName without the check of prefix.
func uniqueName(prefix string) string {
	if _, done := cleanedPrefixes.LoadOrStore(prefix, true); !done {
		_ = CleanupStale(prefix)
	}
	own := ProcessPrefix(prefix)
	for {
		name := own + strconv.FormatUint(nameSeq.Add(1)-1, 36)
		// A namespace of that name, alone (a test's one namespace) or with
		// a role, can only be left by a crashed run whose pid has been
		// recycled; skip past it.
		// A name whose check fails otherwise (too long, no access) is
		// returned too: creating it will say why, where skipping past it
		// would loop forever.
		left, _ := netns.List(name + "-")
		if _, err := os.Lstat(filepath.Join(netns.RunDir, name)); len(left) == 0 && err != nil {
			return name
		}
	}
}

// ReservedPrefixes are the prefixes weir's own tests, benchmarks and demos
// give UniqueName. Each run removes the namespaces of its prefix whose
// process has exited (CleanupStale), a kept weir demo's among them: weir
// demo refuses a name (WEIR_DEMO_NAME) that is one of these or begins one
// (wfc begins wfc0, whose names a dead pid's wfc names can look like).
var ReservedPrefixes = []string{
	// topo.New's, NewTwoArmed's and NewRouted's defaults; weir demo's
	// own (demo.NamePrefix) and weir demo fleet's.
	"w", "wta", "wrt", "wdm", FleetPrefix,
	// Tests: internal/demo, cmd/weir, internal/topo, internal/netns,
	// internal/fleet.
	"wdt", "wdc", "wdx", "wsd", "wvh", "wvm", "wt", "wns", "wfe",
	// Tests: loader.
	"wn", "wnb", "wnt", "wat", "wfb", "wpc", "wpe", "wst", "wur", "wfz",
	// Tests: health.
	"whc",
	// Tests: userspace/agent and its packages.
	"bgp", "cap", "pfl", "spa", "wag", "wap", "was", "wti", "war", "wpl", "wrr", "wfc0", "wfc1", "wfc2", "wia",
	// internal/netpair, for the proxy's and the http plane's tests.
	"wnp",
	// bench/pktbench, and bench/pktgen's tests.
	"wpb", "wpg",
}

// inTest reports whether this is a test binary: package testing registers
// its flags (test.v among them) when one starts. topo links into weir, so it
// cannot import testing to ask.
func inTest() bool { return flag.Lookup("test.v") != nil }

// ProcessPrefix is how every name UniqueName(prefix) returns in this process
// begins: the namespaces listed under it are this process's, not those of
// another process (a demo, a test package) using the same prefix at the same
// time.
func ProcessPrefix(prefix string) string {
	pid := strconv.FormatInt(int64(os.Getpid()), 36)
	return prefix + strings.Repeat("0", pidWidth-len(pid)) + pid
}

// CleanupStale unmounts and removes the namespaces /run/netns/<prefix>*
// left behind by earlier runs, which removes their links too. Only names
// UniqueName(prefix) makes are removed, and of those only ones whose process
// has exited, so parallel test processes can all call CleanupStale with the
// same prefix. A name that carries no pid is left alone: it is not this
// prefix's (a shorter prefix begins other packages' names, "w" all of
// weir's, and a user's namespace may begin with any prefix). Nor is one of
// a longer prefix that goes on with a letter ("wta..." under "wt"): no pid
// begins with one. A longer prefix that goes on with a digit ("wt0") is
// not told apart: give no two prefixes that. A name whose
// process has exited is removed though what it made may be meant to outlive
// it (a kept weir demo's namespaces carry the pid of the demo, gone once it
// has handed them on): use a prefix no live run uses, and hold what keeps
// others off it (weir demo's lock) while calling.
func CleanupStale(prefix string) error {
	names, err := netns.List(prefix)
	if err != nil {
		return fmt.Errorf("cleanup stale %s*: %w", prefix, err)
	}
	var errs []error
	for _, name := range names {
		if pid, ok := ownerPID(prefix, name); !ok || alive(pid) {
			continue
		}
		if err := netns.RemoveMounted(name); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cleanup stale %s*: %w", prefix, err)
	}
	return nil
}

// ownerPID parses the pid out of a namespace name made from
// UniqueName(prefix) + "-" + role, or UniqueName(prefix) alone (a test's
// single namespace).
func ownerPID(prefix, nsName string) (int, bool) {
	rest, ok := strings.CutPrefix(nsName, prefix)
	if !ok {
		return 0, false
	}
	id, _, _ := strings.Cut(rest, "-")
	if len(id) <= pidWidth {
		return 0, false
	}
	if _, err := strconv.ParseUint(id[pidWidth:], 36, 64); err != nil {
		return 0, false
	}
	// A longer prefix's name continues with a letter where a pid begins
	// (wta... under wt): past pidMaxLimit, it carries no pid of this prefix.
	pid, err := strconv.ParseInt(id[:pidWidth], 36, 64)
	if err != nil || pid <= 0 || pid > pidMaxLimit {
		return 0, false
	}
	return int(pid), true
}

func alive(pid int) bool {
	err := unix.Kill(pid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}
