package demo

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

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

// lock takes dir's lock and records this process as its holder. It opens
// the lock file without following a symlink: it would write through one.
func lock(dir string) (*os.File, error) {
	f, err := os.OpenFile(lockPath(dir), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("lock: %s is a symlink, not a demo's lock; remove it", lockPath(dir))
	}
	if err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, busy(dir)
		}
		return nil, fmt.Errorf("lock %s: %w", lockPath(dir), err)
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
