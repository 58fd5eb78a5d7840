package demo

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// One demo at a time uses a directory: a demo holds an exclusive flock(2) on
// <dir>.lock from before it touches anything until it has removed what it made,
// and a kept demo's hold process inherits it and holds it until weir demo down
// stops that process. The kernel drops the lock of a process that dies, so a
// killed demo leaves no stale lock; the file itself stays (removing a lock
// file lets two processes lock two different files of the same name).

// ErrBusy is what errors.Is finds in the error of a demo refused because
// another holds the lock of its directory; the error's text names the holder.
var ErrBusy = errors.New("another demo holds the lock")

type busyError string

func (e busyError) Error() string      { return string(e) }
func (busyError) Is(target error) bool { return target == ErrBusy }

func lockPath(dir string) string { return filepath.Clean(dir) + ".lock" }

// holderLine is what setHolder writes.
var holderLine = regexp.MustCompile(`^(run|kept) [0-9]+\n$`)

// lock takes dir's lock and records this process as its holder. It refuses
// a lock file that is not a demo's (a symlink, not a regular file, another
// user's, or one holding what setHolder does not write): it would write over
// it.
func lock(dir string) (*os.File, error) {
	notOurs := func(what string) error {
		return fmt.Errorf("lock: %s %s, not a demo's lock: a demo's lock is its directory's path with .lock added; give the demo a new directory", lockPath(dir), what)
	}
	f, err := os.OpenFile(lockPath(dir), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if errors.Is(err, unix.ELOOP) {
		return nil, notOurs("is a symlink")
	}
	if err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, notOurs("is not a regular file")
	}
	// Another user's (one made in /tmp) is one whose owner can hold it,
	// and write it, to turn the demo away.
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		f.Close()
		return nil, notOurs("belongs to uid " + strconv.Itoa(int(st.Uid)))
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, busy(dir)
		}
		return nil, fmt.Errorf("lock %s: %w", lockPath(dir), err)
	}
	b, err := io.ReadAll(io.LimitReader(f, 64))
	if err != nil || len(b) > 0 && !holderLine.Match(b) {
		f.Close()
		return nil, notOurs("holds what no demo wrote")
	}
	if err := setHolder(f, "run", os.Getpid()); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// setHolder records what holds the lock f: "run PID" for a demo that runs,
// "kept PID" (the agent's) for a kept one.
func setHolder(f *os.File, what string, pid int) error {
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if _, err := f.WriteAt([]byte(what+" "+strconv.Itoa(pid)+"\n"), 0); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	return nil
}

// busy says what holds dir's lock.
func busy(dir string) error {
	b, _ := os.ReadFile(lockPath(dir))
	what, pid, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
	switch what {
	case "kept":
		return busyError("a kept demo is up (weir demo --keep, agent pid " + pid + "); " + downCommand(dir) + " removes it")
	case "run":
		return busyError("another weir demo runs (pid " + pid + "); it removes what it made when it ends")
	default: // it has just taken the lock
		return busyError("another weir demo runs; it removes what it made when it ends")
	}
}

// kept reports whether dir's lock is held for a kept demo.
func kept(dir string) bool {
	b, _ := os.ReadFile(lockPath(dir))
	return strings.HasPrefix(string(b), "kept ")
}
