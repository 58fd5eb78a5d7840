// Package netns gives tests, the demo and benchmarks named network namespaces
// they can run code in and open sockets in.
//
// A namespace is created, and code runs in one only through Do, on a fresh
// goroutine's locked OS thread that is switched back to the namespace it
// started in before it is handed back to the Go runtime (or, should that
// fail, kept locked so the runtime ends it), so no goroutine of the process
// ever runs in a namespace it did not ask for. A socket belongs to the
// namespace it was created in for its whole life, so sockets made by Listen,
// ListenPacket and DialContext are created in the namespace and can then be
// used from any goroutine.
//
// Every namespace is bind-mounted at /run/netns/<name>, as `ip netns add`
// does, so `ip netns exec <name> ...` works on it while it lives, and a
// namespace left by a crashed process can be found and removed by name.
package netns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// RunDir is where namespaces are bind-mounted, the directory iproute2 uses.
const RunDir = "/run/netns"

// ErrClosed is returned by the methods of a closed NS.
var ErrClosed = errors.New("network namespace closed")

// NS is a named network namespace. Its methods are safe for concurrent use.
type NS struct {
	name string
	path string

	// mu guards fd against Close while a thread is switching into it.
	mu sync.RWMutex
	fd int // open handle on the namespace; -1 once closed
}

// New creates the network namespace name, bind-mounts it at /run/netns/<name>
// and brings its loopback up. It fails with an error wrapping os.ErrExist if
// that name is taken.
func New(name string) (*NS, error) {
	if err := validName(name); err != nil {
		return nil, err
	}
	if err := prepareRunDir(); err != nil {
		return nil, fmt.Errorf("create netns %s: %w", name, err)
	}
	path := filepath.Join(RunDir, name)

	// The mount point is created exclusively: a leftover namespace of the
	// same name, or a concurrent run that picked the same name, is an error
	// rather than something we would silently share and later unmount.
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return nil, fmt.Errorf("create netns %s: %w", name, err)
	}
	f.Close()

	if err := onOwnThread(func() error { return unshareAndMount(path) }); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("create netns %s: %w", name, err)
	}

	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		unmount(path)
		return nil, fmt.Errorf("create netns %s: open: %w", name, err)
	}
	return &NS{name: name, path: path, fd: fd}, nil
}

// Open returns a handle on an existing namespace mounted at
// /run/netns/<name>, for example one made by New in another process (weir demo
// --keep leaves its namespaces to a later process). Closing that handle unmounts
// and removes the namespace just like one made by New. It refuses what is no
// network namespace there: a symlink (never followed), a file that is no
// namespace (opened without blocking: a FIFO's open would), another kind of
// namespace.
func Open(name string) (*NS, error) {
	if err := validName(name); err != nil {
		return nil, err
	}
	path := filepath.Join(RunDir, name)
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("open netns %s: %s is a symlink, not a network namespace", name, path)
	}
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", name, err)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil || fs.Type != unix.NSFS_MAGIC {
		unix.Close(fd)
		return nil, fmt.Errorf("open netns %s: %s is not a namespace file (nsfs)", name, path)
	}
	if t, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE); err != nil || t != unix.CLONE_NEWNET {
		unix.Close(fd)
		return nil, fmt.Errorf("open netns %s: %s is a namespace, but not a network namespace", name, path)
	}
	return &NS{name: name, path: path, fd: fd}, nil
}

func validName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("netns name %q: must be a non-empty file name", name)
	}
	return nil
}

// prepareRunDir makes /run/netns a shared mount point, as iproute2 does, so
// that namespaces mounted under it are seen by mount namespaces created later
// (`ip netns exec` makes one).
func prepareRunDir() error {
	if err := os.MkdirAll(RunDir, 0o755); err != nil {
		return fmt.Errorf("mkdir %s: %w", RunDir, err)
	}
	err := unix.Mount("", RunDir, "none", unix.MS_SHARED|unix.MS_REC, "")
	if errors.Is(err, unix.EINVAL) {
		// Not a mount point yet: make it one by binding it onto itself.
		if err := unix.Mount(RunDir, RunDir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind-mount %s: %w", RunDir, err)
		}
		err = unix.Mount("", RunDir, "none", unix.MS_SHARED|unix.MS_REC, "")
	}
	if err != nil {
		return fmt.Errorf("make %s shared: %w", RunDir, err)
	}
	return nil
}

// unshareAndMount moves the calling thread into a new network namespace,
// pins it by bind-mounting it on path and brings up its loopback. The thread
// must be switched back or thrown away afterwards.
func unshareAndMount(path string) error {
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	if err := unix.Mount("/proc/thread-self/ns/net", path, "none", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind-mount on %s: %w", path, err)
	}
	// The package-level netlink functions open their socket in the calling
	// thread's namespace, which is the new one.
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		unmount(path)
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}

// onOwnThread runs fn, which may move its thread into another network
// namespace, on a locked thread of its own, and gives the thread back to the
// runtime once it is back in the namespace it started in. A thread that cannot
// be switched back stays locked, so the runtime ends it when fn is done. That
// must stay the exception: the runtime cannot end the process's main thread,
// which may be the one running fn, and parks it for good instead, leaving
// /proc/PID/ns/net (the main thread's) naming fn's namespace.
func onOwnThread(fn func() error) error {
	errc := make(chan error, 1)
	// Exits when fn returns.
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open current netns: %w", err)
			return
		}
		defer unix.Close(orig)
		err = fn()
		if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// unmount detaches the namespace's bind mount and removes the mount point;
// the namespace itself goes away when nothing else holds it. A symlink at path
// is no namespace: it is removed, and what it points to left mounted.
func unmount(path string) error {
	var errs []error
	if err := unix.Unmount(path, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		errs = append(errs, fmt.Errorf("unmount %s: %w", path, err))
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("remove %s: %w", path, err))
	}
	return errors.Join(errs...)
}

// Name is the namespace's name under /run/netns.
func (n *NS) Name() string { return n.name }

// Path is the namespace's bind mount, /run/netns/<name>.
func (n *NS) Path() string { return n.path }

// String returns the name, so an NS prints usefully in messages.
func (n *NS) String() string { return n.name }

// Do runs fn on a locked OS thread switched into the namespace and returns
// fn's error. Goroutines that fn starts do not run in the namespace, but
// sockets fn creates stay in it. A panic in fn is re-raised in the caller,
// and runtime.Goexit in fn (t.Fatal, t.Skip) exits the caller's goroutine
// too, so tests may call t.Fatal inside fn.
//
// The thread is switched back before it is returned to the runtime; if that
// fails the thread is never unlocked, so the runtime discards it rather than
// letting another goroutine run in the wrong namespace.
func (n *NS) Do(fn func() error) error {
	type result struct {
		err      error
		returned bool // fn returned or panicked, as opposed to Goexit
		panicked bool
		panicVal any
	}
	done := make(chan result, 1)
	// Exits when fn returns, panics or calls Goexit; see doLocked for what
	// happens to its thread.
	go func() {
		var r result
		defer func() { done <- r }()
		r.err, r.panicked, r.panicVal = n.doLocked(fn)
		r.returned = true
	}()
	r := <-done
	switch {
	case r.panicked:
		panic(r.panicVal)
	case !r.returned:
		runtime.Goexit()
	}
	return r.err
}

// doLocked is the body of Do, running on its own goroutine.
func (n *NS) doLocked(fn func() error) (retErr error, panicked bool, panicVal any) {
	runtime.LockOSThread()

	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("netns %s: open current netns: %w", n.name, err), false, nil
	}
	defer unix.Close(orig)

	n.mu.RLock()
	if n.fd < 0 {
		n.mu.RUnlock()
		runtime.UnlockOSThread()
		return fmt.Errorf("netns %s: %w", n.name, ErrClosed), false, nil
	}
	err = unix.Setns(n.fd, unix.CLONE_NEWNET)
	n.mu.RUnlock()
	if err != nil {
		// setns failing leaves the thread where it was, but we cannot be
		// sure of that for every kernel: keep the thread locked so it dies.
		return fmt.Errorf("netns %s: setns: %w", n.name, err), false, nil
	}

	defer func() {
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: the runtime kills it when this
			// goroutine exits.
			err = fmt.Errorf("netns %s: restore thread's netns: %w", n.name, err)
			retErr = errors.Join(retErr, err)
			return
		}
		runtime.UnlockOSThread()
	}()

	defer func() {
		if v := recover(); v != nil {
			panicked, panicVal = true, v
		}
	}()
	return fn(), false, nil
}

// Listen is net.Listen with the socket created in the namespace.
func (n *NS) Listen(network, addr string) (net.Listener, error) {
	var ln net.Listener
	err := n.Do(func() (err error) {
		ln, err = net.Listen(network, addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", n.name, err)
	}
	return ln, nil
}

// ListenPacket is net.ListenPacket with the socket created in the namespace.
func (n *NS) ListenPacket(network, addr string) (net.PacketConn, error) {
	var pc net.PacketConn
	err := n.Do(func() (err error) {
		pc, err = net.ListenPacket(network, addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", n.name, err)
	}
	return pc, nil
}

// DialContext dials from the namespace with a zero net.Dialer.
// See DialWith for the rules on addr.
func (n *NS) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	return n.DialWith(ctx, &net.Dialer{}, network, addr)
}

// DialWith is d.DialContext with the socket created in the namespace, so
// d.LocalAddr, d.Control and the timeouts apply as usual.
//
// addr's host must be an IP literal: a name could resolve to several
// addresses, and net.Dialer races those from goroutines that would create
// their sockets outside the namespace.
func (n *NS) DialWith(ctx context.Context, d *net.Dialer, network, addr string) (net.Conn, error) {
	switch network {
	case "tcp", "tcp4", "tcp6", "udp", "udp4", "udp6":
	default:
		return nil, fmt.Errorf("netns %s: dial %s %s: network not supported", n.name, network, addr)
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("netns %s: dial %s %s: %w", n.name, network, addr, err)
	}
	if h, _, _ := strings.Cut(host, "%"); net.ParseIP(h) == nil {
		return nil, fmt.Errorf("netns %s: dial %s %s: host must be an IP literal", n.name, network, addr)
	}
	var c net.Conn
	err = n.Do(func() (err error) {
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", n.name, err)
	}
	return c, nil
}

// Close unmounts and removes the namespace. The namespace itself, with its
// links and routes, disappears once no socket or process uses it any more.
// Close is idempotent.
func (n *NS) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.fd < 0 {
		return nil
	}
	unix.Close(n.fd)
	n.fd = -1
	if err := unmount(n.path); err != nil {
		return fmt.Errorf("close netns %s: %w", n.name, err)
	}
	return nil
}

// RemoveMounted unmounts and removes /run/netns/<name> whoever created it,
// as `ip netns delete` does. It is for cleaning up after a crashed run.
func RemoveMounted(name string) error {
	if err := validName(name); err != nil {
		return err
	}
	return unmount(filepath.Join(RunDir, name))
}

// List returns the names of the namespaces mounted under /run/netns that
// start with prefix.
func List(prefix string) ([]string, error) {
	entries, err := os.ReadDir(RunDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", RunDir, err)
	}
	var names []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			names = append(names, e.Name())
		}
	}
	return names, nil
}
