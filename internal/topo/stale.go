package topo

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
)

var nameSeq atomic.Uint64

// UniqueName returns prefix + <pid in base 36> + "_" + <sequence in base 36>,
// a topology name no other live process and no other call in this process
// uses. Keep prefix to 3 characters so the result fits MaxNameLen. Because
// the name carries the pid, CleanupStale can tell a crashed run's namespaces
// from those of a run that is still going.
func UniqueName(prefix string) string {
	for {
		name := prefix + strconv.FormatInt(int64(os.Getpid()), 36) + "_" + strconv.FormatUint(nameSeq.Add(1)-1, 36)
		// A namespace of that name can only be left by a crashed run
		// whose pid has been recycled; skip past it.
		if left, _ := netns.List(name + "-"); len(left) == 0 {
			return name
		}
	}
}

// CleanupStale unmounts and removes the namespaces /run/netns/<prefix>*
// left behind by earlier runs, which removes their links too. A namespace
// whose name came from UniqueName(prefix) and whose process is still alive
// is left alone, so parallel test processes can all call CleanupStale with
// the same prefix. Fixed names (such as the demo's) carry no pid and are
// always removed: use a prefix no live run is using.
func CleanupStale(prefix string) error {
	names, err := netns.List(prefix)
	if err != nil {
		return fmt.Errorf("cleanup stale %s*: %w", prefix, err)
	}
	var errs []error
	for _, name := range names {
		if pid, ok := ownerPID(prefix, name); ok && alive(pid) {
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
// UniqueName(prefix) + "-" + role.
func ownerPID(prefix, nsName string) (int, bool) {
	rest := strings.TrimPrefix(nsName, prefix)
	id, _, ok := strings.Cut(rest, "-")
	if !ok {
		return 0, false
	}
	pid36, seq, ok := strings.Cut(id, "_")
	if !ok {
		return 0, false
	}
	if _, err := strconv.ParseUint(seq, 36, 64); err != nil {
		return 0, false
	}
	pid, err := strconv.ParseInt(pid36, 36, 32)
	if err != nil || pid <= 0 {
		return 0, false
	}
	return int(pid), true
}

func alive(pid int) bool {
	err := unix.Kill(pid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}
