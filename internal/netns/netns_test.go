package netns_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// testPrefix begins the names of these tests' namespaces: see testName.
const testPrefix = "wns"

// testName is a name for a test's namespace, /run/netns/<name>: the
// process's pid and a sequence number (topo.UniqueName) and role. The first
// call in a process removes what runs of these tests killed midway left.
func testName(role string) string { return topo.UniqueName(testPrefix) + "-" + role }

// newNS creates a namespace named after the test and removes it at cleanup.
func newNS(t *testing.T, suffix string) *netns.NS {
	t.Helper()
	ns, err := netns.New(testName(suffix))
	xdptest.Check(t, err)
	t.Cleanup(func() {
		if err := ns.Close(); err != nil {
			t.Error(err)
		}
	})
	return ns
}

// currentNetNS identifies the calling thread's namespace by inode.
func currentNetNS(t *testing.T) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestNewDoClose(t *testing.T) {
	ns := newNS(t, "a")

	if _, err := os.Stat(ns.Path()); err != nil {
		t.Fatalf("mount point: %v", err)
	}
	hostIno := currentNetNS(t)

	var inner uint64
	var loUp bool
	err := ns.Do(func() error {
		var st unix.Stat_t
		if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
			return err
		}
		inner = st.Ino
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		loUp = lo.Attrs().Flags&(1<<0) != 0 // net.FlagUp
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var want unix.Stat_t
	if err := unix.Stat(ns.Path(), &want); err != nil {
		t.Fatal(err)
	}
	if inner != want.Ino {
		t.Errorf("Do ran in netns inode %d; want %d", inner, want.Ino)
	}
	if inner == hostIno {
		t.Errorf("Do ran in the host's namespace")
	}
	if !loUp {
		t.Errorf("lo is down in the new namespace")
	}

	// Errors from fn come back unchanged.
	sentinel := errors.New("sentinel")
	if err := ns.Do(func() error { return sentinel }); !errors.Is(err, sentinel) {
		t.Errorf("Do returned %v; want %v", err, sentinel)
	}

	// Panics are re-raised in the caller.
	func() {
		defer func() {
			if v := recover(); v != "boom" {
				t.Errorf("recovered %v; want boom", v)
			}
		}()
		ns.Do(func() error { panic("boom") })
	}()

	// Goexit (t.FailNow, t.SkipNow) in fn ends the caller's goroutine.
	exited := make(chan bool)
	// Exits through the Goexit that Do passes on.
	go func() {
		defer func() { exited <- true }()
		ns.Do(func() error { runtime.Goexit(); return nil })
		exited <- false
	}()
	if !<-exited {
		t.Errorf("Do returned after fn called runtime.Goexit")
	}

	if err := ns.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ns.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := os.Stat(ns.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("after Close, stat %s: %v; want not exist", ns.Path(), err)
	}
	if err := ns.Do(func() error { return nil }); !errors.Is(err, netns.ErrClosed) {
		t.Errorf("Do after Close: %v; want netns.ErrClosed", err)
	}
}

func TestNewExisting(t *testing.T) {
	ns := newNS(t, "dup")
	_, err := netns.New(ns.Name())
	if !errors.Is(err, os.ErrExist) {
		t.Fatalf("New(%q) twice: %v; want os.ErrExist", ns.Name(), err)
	}
	// The failed New must not have removed the first one's mount.
	if _, err := os.Stat(ns.Path()); err != nil {
		t.Fatal(err)
	}
}

// TestSockets checks that sockets created in a namespace stay there: a
// listener in one namespace on 127.0.0.1 is reachable from the same
// namespace and not from another one.
func TestSockets(t *testing.T) {
	a := newNS(t, "sa")
	b := newNS(t, "sb")

	ln, err := a.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	// Exits when ln is closed at cleanup.
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			io.WriteString(c, "hello from a")
			c.Close()
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := a.DialContext(ctx, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	c.Close()
	if err != nil || string(got) != "hello from a" {
		t.Fatalf("read %q, %v; want %q", got, err, "hello from a")
	}

	if c, err := b.DialContext(ctx, "tcp", ln.Addr().String()); err == nil {
		c.Close()
		t.Fatalf("dial from another namespace reached %s", ln.Addr())
	}

	pc, err := a.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	uc, err := a.DialContext(ctx, "udp", pc.LocalAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	if _, err := uc.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	pc.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 8)
	if n, _, err := pc.ReadFrom(buf); err != nil || string(buf[:n]) != "x" {
		t.Fatalf("udp read %q, %v; want x", buf[:n], err)
	}
}

func TestDialRejectsNames(t *testing.T) {
	ns := newNS(t, "names")
	_, err := ns.DialContext(context.Background(), "tcp", "localhost:80")
	if err == nil || !strings.Contains(err.Error(), "IP literal") {
		t.Fatalf("dial localhost: %v; want an IP literal error", err)
	}
}

func TestList(t *testing.T) {
	ns := newNS(t, "list")
	names, err := netns.List(ns.Name())
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 1 || names[0] != ns.Name() {
		t.Fatalf("List(%q) = %v; want [%s]", ns.Name(), names, ns.Name())
	}
	if err := netns.RemoveMounted(ns.Name()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(netns.RunDir, ns.Name())); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("after RemoveMounted: %v", err)
	}
}

// TestRemoveSymlinkLeavesTarget: a /run/netns entry that is a symlink, here
// to a tmpfs mounted in the test's directory, is no namespace: removing it
// by name (RemoveMounted, as a cleanup of a crashed run does) removes the
// link, and Open refuses it (so no Close can act on it); both leave what it
// points to mounted.
func TestRemoveSymlinkLeavesTarget(t *testing.T) {
	for _, c := range []struct {
		name    string
		remove  func(name string) error
		removed bool // the link
	}{
		{"RemoveMounted", netns.RemoveMounted, true},
		{"Open", func(name string) error {
			ns, err := netns.Open(name)
			if err == nil {
				return ns.Close()
			}
			return err
		}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			target := t.TempDir()
			if err := unix.Mount("tmpfs", target, "tmpfs", 0, "size=64k"); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH) })
			name := testName("link" + c.name)
			link := filepath.Join(netns.RunDir, name)
			if err := netns.PrepareRunDir(); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(target, link); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.Remove(link) })
			err := c.remove(name)
			if _, lerr := os.Lstat(link); c.removed != errors.Is(lerr, os.ErrNotExist) {
				t.Errorf("the symlink %s after %s: %v; want it removed: %t", link, c.name, lerr, c.removed)
			}
			if !c.removed && (err == nil || !strings.Contains(err.Error(), "is a symlink, not a network namespace")) {
				t.Errorf("%s of the symlink %s: %v; want it refused as a symlink", c.name, link, err)
			}
			var st unix.Statfs_t
			if err := unix.Statfs(target, &st); err != nil || st.Type != unix.TMPFS_MAGIC {
				t.Errorf("%s after %s removed a symlink to it: not a tmpfs (%v); want it left mounted", target, c.name, err)
			}
		})
	}
}

// TestOpenRefusesOtherNamespace: a namespace of another kind mounted at a
// name (here this process's UTS namespace) is refused by Open, as setns into
// it would be by the kernel later.
func TestOpenRefusesOtherNamespace(t *testing.T) {
	if err := netns.PrepareRunDir(); err != nil {
		t.Fatal(err)
	}
	name := testName("uts")
	path := filepath.Join(netns.RunDir, name)
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(path) })
	err := unix.Mount("/proc/self/ns/uts", path, "", unix.MS_BIND, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(path, unix.MNT_DETACH) })
	// Not closed if opened: Close would unmount it, as a network namespace.
	if _, err = netns.Open(name); err == nil {
		t.Fatalf("Open of a UTS namespace succeeded; want it refused")
	}
	if want := "is a namespace, but not a network namespace"; !strings.Contains(err.Error(), want) {
		t.Errorf("Open of a UTS namespace: %v; want %q", err, want)
	}
}

// leaveEnv makes this test binary leave, as a run killed midway does: it
// makes a namespace as the tests do, prints its name and waits to be killed.
const leaveEnv = "WEIR_NETNS_TEST_LEAVE"

func leave() int {
	ns, err := netns.New(testName("left"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(ns.Name())
	select {}
}

// TestKilledRunsNamespaceRemoved: a namespace of these tests whose process
// was killed before its cleanup is removed by the next run of the tests (its
// first namespace), as topo.CleanupStale removes a dead pid's; one of a live
// run is not.
func TestKilledRunsNamespaceRemoved(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	child := exec.Command(exe, "-test.run", "^$")
	child.Env = append(os.Environ(), leaveEnv+"=1")
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	left := strings.TrimSpace(line)
	if err != nil || left == "" {
		t.Fatalf("the child said %q (%v); want a namespace's name", line, err)
	}
	path := filepath.Join(netns.RunDir, left)
	// Should the check below fail, the test removes it.
	t.Cleanup(func() { netns.RemoveMounted(left) })
	live := newNS(t, "live")
	child.Process.Kill()
	child.Wait()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the killed child's namespace: %v; want it left", err)
	}
	// The next run: its first namespace removes the dead run's.
	next := exec.Command(exe, "-test.run", "^TestList$")
	if b, err := next.CombinedOutput(); err != nil {
		t.Fatalf("the next run: %v\n%s", err, b)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after the next run: %v; want it removed", path, err)
	}
	if _, err := os.Stat(live.Path()); err != nil {
		t.Errorf("this live run's namespace %s after the next run: %v; want it kept", live.Name(), err)
	}
}
