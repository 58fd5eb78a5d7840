package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

// Connections and loops that wait, on a peer that does not read or on a free
// slot, and that run out of descriptors: a reset ends them, a pause costs no
// CPU, and a shortage of this host's is not blamed on a backend.

// TestResetWhileBlocked: a peer that resets while its bytes wait for the other
// side, which does not read, ends the connection, and the other side gets a
// reset. Nothing else would end it: the side that does not read may never
// drain, and there is no idle timeout.
func TestResetWhileBlocked(t *testing.T) {
	for _, c := range []struct {
		name     string
		clientRS bool // the client resets an upload; else the backend a download
	}{
		{"client resets its upload", true},
		{"backend resets its download", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			stop := make(chan struct{})
			reset := make(chan struct{})
			be := startBackend(t, "a", netip.AddrPort{}, func(_ string, conn *net.TCPConn) {
				if !c.clientRS {
					// Writes until the proxy's buffers and the client's
					// window are full (the client reads nothing), then resets.
					writeUntilFull(conn)
					conn.SetLinger(0)
					conn.Close()
					close(reset)
					return
				}
				<-stop // reads nothing
			})
			t.Cleanup(func() { close(stop) })
			s := startProxy(t, Config{Backends: []Backend{{Addr: be.addr()}}, Logger: discardLogger(), ShutdownTimeout: time.Second})
			conn := dial(t, s)
			waitfor.Value(t, 5*time.Second, "the connection up", active(s, 1))
			if c.clientRS {
				writeUntilFull(conn)
				conn.SetLinger(0)
				conn.Close()
			} else {
				<-reset
			}
			waitfor.Value(t, 5*time.Second, "the connection ended", active(s, 0))
			if !c.clientRS {
				conn.SetReadDeadline(time.Now().Add(5 * time.Second))
				var err error
				for err == nil {
					_, err = conn.Read(make([]byte, 64<<10))
				}
				if !errors.Is(err, unix.ECONNRESET) {
					t.Errorf("the client read to %v; want a reset, so it does not take the download for whole", err)
				}
			}
		})
	}
}

// writeUntilFull writes to conn until its peer's window and every buffer on the
// way are full: a write that has not ended in half a second.
func writeUntilFull(conn net.Conn) {
	conn.SetWriteDeadline(time.Now().Add(500 * time.Millisecond))
	buf := make([]byte, 1<<20)
	for {
		if _, err := conn.Write(buf); err != nil {
			return
		}
	}
}

// TestPausedLoopIdlesAfterAcceptError: a loop that backed off after an accept
// error (out of descriptors) and then waits for a slot at MaxConns uses no CPU
// while it waits. It armed its wake-up for the back-off's end, in the past by
// then, and woke at once over and over.
func TestPausedLoopIdlesAfterAcceptError(t *testing.T) {
	var s *Service
	for attempt := 1; s == nil; attempt++ {
		if s = pausedAfterAcceptError(t); s == nil {
			// A descriptor freed elsewhere in the process (an earlier test's
			// connection ending late) let an accept through: the loops paused
			// with no error, and this attempt tests nothing.
			if attempt == 5 {
				t.Fatalf("no accept failed with the descriptors taken, %d times", attempt)
			}
			t.Logf("attempt %d: a client was accepted with no accept error; again with a new service", attempt)
		}
	}
	// The back-off (up to a second) ends: one client is served, and the loops
	// wait for its slot with the others queued.
	waitfor.Value(t, 5*time.Second, "one connection served", active(s, 1))
	time.Sleep(1100 * time.Millisecond) // past any back-off still running

	// A loop that wakes over and over uses a whole CPU, or, on a loaded
	// machine, its share of one: seen as little as 80 ms in the second with
	// 6 busy processes beside it. Either way its threads are runnable (running
	// or waiting for a CPU) the whole window, every window: 1.09-1.61 s summed
	// over the process's threads, measured, with the race detector too. Paused
	// loops leave the process's other threads (this test's, the runtime's, the
	// race detector's, and what an earlier test left running), which under load
	// wait for a CPU too: up to 290 ms seen with 4 busy processes and the race
	// detector. The bound sits between the two, and as what the other threads
	// do comes and goes while a spinning loop spins on, one window of a few
	// within it is enough.
	const window, windows = time.Second, 4
	var seen []string
	for range windows {
		cpu0, ready0 := cpuTime(), runnable(t)
		time.Sleep(window)
		cpu, ready := cpuTime()-cpu0, runnable(t).since(ready0)
		if cpu <= window/4 && ready <= window*3/4 {
			t.Logf("the process used %v of CPU, its threads runnable %v, in %v (earlier windows: %v)", cpu, ready, window, seen)
			return
		}
		seen = append(seen, fmt.Sprintf("%v of CPU, runnable %v", cpu, ready))
	}
	t.Errorf("in each of %d windows of %v with one idle connection and its loops paused, the process used: %v; want next to none", windows, window, seen)
}

// pausedAfterAcceptError starts a service of MaxConns 1 and two loops whose
// accepts fail for want of descriptors, and returns it once one has; nil if a
// client was accepted with no accept failing.
func pausedAfterAcceptError(t *testing.T) *Service {
	t.Helper()
	a := startBackend(t, "a", netip.AddrPort{}, hello)
	s := startProxy(t, Config{Backends: []Backend{{Addr: a.addr()}}, MaxConns: 1, AcceptLoops: 2, Logger: discardLogger()})
	for range 4 { // the service serves (its loops are up)
		c := dial(t, s)
		readLine(c)
		c.Close()
	}
	waitfor.Value(t, 5*time.Second, "no connection", active(s, 0))

	// Out of descriptors: the queued clients' accepts fail with EMFILE. The
	// listeners' SO_REUSEPORT hash spreads 8 clients over both loops (all on
	// one: 1 time in 128), so both back off, and the one that does not take
	// the single slot afterwards waits paused with its back-off's time past.
	// The backend's sides of those connections close on goroutines of its
	// own: a descriptor they free after the filling would let the proxy's
	// accept through, and the loops would pause with no error.
	waitIdle(t, a)
	fds := fillFDs(t)
	defer fds.restore()
	for clients, tries := 0, 0; clients < 8 && tries < 16; tries++ {
		// A descriptor for the client's own socket; the proxy's accept has none.
		fds.free(1)
		c, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			continue // something of the process's took the descriptor first
		}
		clients++
		t.Cleanup(func() { c.Close() })
		fds.fill() // any descriptor freed meanwhile
	}
	// An accept fails, or, with a descriptor freed elsewhere, one gets through
	// and takes the single slot: then none will fail.
	waitfor.Value(t, 5*time.Second, "an accept error, or a client accepted", func() (any, bool) {
		st := s.Snapshot()
		return fmt.Sprintf("%d accept errors, %d active", st.AcceptErrors, st.Active), st.AcceptErrors > 0 || st.Active > 0
	})
	if s.Snapshot().AcceptErrors == 0 {
		return nil
	}
	return s
}

func cpuTime() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// threadTimes is, per thread of the process, how long it has run or waited on
// a run queue (/proc/self/task/*/schedstat).
type threadTimes map[string]time.Duration

// runnable reads the process's threadTimes.
func runnable(t *testing.T) threadTimes {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	out := threadTimes{}
	for _, task := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + task.Name() + "/schedstat")
		if err != nil {
			continue // the thread has exited
		}
		var ran, waited int64
		if _, err := fmt.Sscan(string(b), &ran, &waited); err != nil {
			t.Fatalf("thread %s: schedstat %q: %v", task.Name(), b, err)
		}
		out[task.Name()] = time.Duration(ran + waited)
	}
	return out
}

// since sums what each thread added after before; a thread that started
// meanwhile counts whole, one that exited meanwhile not at all.
func (after threadTimes) since(before threadTimes) time.Duration {
	var d time.Duration
	for tid, at := range after {
		d += at - before[tid]
	}
	return d
}

// fdFiller holds every descriptor the process may open under a lowered limit,
// so that the next socket, accept or pipe fails with EMFILE until it frees some.
type fdFiller struct {
	old unix.Rlimit
	fds []int
}

func fillFDs(t *testing.T) *fdFiller {
	f := &fdFiller{}
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &f.old); err != nil {
		t.Fatal(err)
	}
	lim := unix.Rlimit{Cur: uint64(countFDs(t) + 64), Max: f.old.Max}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	f.fill()
	t.Cleanup(f.restore)
	return f
}

// fill takes every descriptor the limit leaves.
func (f *fdFiller) fill() {
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return
		}
		f.fds = append(f.fds, fd)
	}
}

// waitIdle waits until b holds no connection.
func waitIdle(t *testing.T, b *testBackend) {
	t.Helper()
	waitfor.Value(t, 5*time.Second, "the backend's connections closed", func() (any, bool) {
		b.mu.Lock()
		defer b.mu.Unlock()
		return len(b.conns), len(b.conns) == 0
	})
}

// free closes n of the held descriptors.
func (f *fdFiller) free(n int) {
	for _, fd := range f.fds[len(f.fds)-n:] {
		unix.Close(fd)
	}
	f.fds = f.fds[:len(f.fds)-n]
}

// restore closes them all and puts the limit back.
func (f *fdFiller) restore() {
	f.free(len(f.fds))
	unix.Setrlimit(unix.RLIMIT_NOFILE, &f.old)
}

// TestOutOfDescriptorsBlamesNoBackend: a dial that fails because the proxy is
// out of descriptors leaves the backend's health alone. It was counted as the
// backend's failed connect, and with eject_after 1 a healthy backend was
// ejected: every client refused for eject_for once descriptors were back.
func TestOutOfDescriptorsBlamesNoBackend(t *testing.T) {
	a := startBackend(t, "a", netip.AddrPort{}, hello)
	rec := &recorder{}
	s := startProxy(t, Config{Backends: []Backend{{Addr: a.addr()}}, EjectAfter: 1, EjectFor: time.Minute, AcceptLoops: 1,
		Observer: rec, Logger: discardLogger()})
	warm := dial(t, s) // the loop and its descriptors are up
	readLine(warm)
	warm.Close()
	var fds *fdFiller
	for attempt := 1; ; attempt++ {
		waitfor.Value(t, 5*time.Second, "no connection", active(s, 0))
		rec.mu.Lock()
		rec.got = nil
		rec.mu.Unlock()
		waitIdle(t, a)
		if fds == nil {
			fds = fillFDs(t)
		} else {
			fds.fill()
		}
		fds.free(2) // the client's socket and the accepted one; the dial's socket fails
		c, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
		if err != nil {
			break
		}
		// Served: the dial had a descriptor, which only a close elsewhere in the
		// process (an earlier test's connection ending late) can have given it,
		// so this attempt tested nothing. Take what was freed and go again.
		if attempt == 5 {
			t.Fatalf("the client was served with no descriptor left for the dial, %d times", attempt)
		}
		t.Logf("attempt %d: a descriptor freed elsewhere let the dial through; again", attempt)
	}
	fds.restore()
	if got := rec.list(); len(got) != 0 {
		t.Errorf("outcomes reported for the backend: %q; want none", got)
	}
	b := s.Snapshot().Backends[0]
	if b.Ejected || b.ConnectFailures != 0 {
		t.Errorf("backend: ejected %v, %d connect failures; want neither", b.Ejected, b.ConnectFailures)
	}
	c2 := dial(t, s)
	if name, err := readLine(c2); err != nil || name != "a" {
		t.Errorf("the next client: %q, %v; want served by a", name, err)
	}
}

// TestDrainDeadlineEndsDials: a connection whose dial of a draining backend has
// not finished when the drain's deadline comes is closed then, as the
// established ones are; it was left to its connect timeout, or, if the dial
// finished after the deadline, open for good.
func TestDrainDeadlineEndsDials(t *testing.T) {
	slow := blackhole(t) // a connect to it hangs
	s := startProxy(t, Config{Backends: []Backend{{Addr: slow}}, DrainTimeout: 200 * time.Millisecond,
		ConnectTimeout: time.Minute, Logger: discardLogger()})
	c := dial(t, s)
	waitfor.Value(t, 5*time.Second, "the dial in progress", active(s, 1))
	if err := s.SetDraining(slow, true); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); isTimeout(err) {
		t.Fatalf("the client still waits 10 s after the drain began (deadline 200 ms)")
	}
	waitfor.Value(t, 5*time.Second, "no connection", active(s, 0))
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

// TestReaddedBackendKeepsItsConnections: a backend removed and added again while
// a connection of its removal is open is the same backend: that connection
// counts against its max_conns, and the removal's drain deadline no longer
// closes it. A fresh backend had started at no connections, and the old drain
// closed the connection, which the backend was serving again.
func TestReaddedBackendKeepsItsConnections(t *testing.T) {
	a := startBackend(t, "a", netip.AddrPort{}, hello)
	s := startProxy(t, Config{Backends: []Backend{{Addr: a.addr(), MaxConns: 1}}, DrainTimeout: 300 * time.Millisecond,
		Logger: discardLogger()})
	c1 := dial(t, s)
	if name, err := readLine(c1); err != nil || name != "a" {
		t.Fatalf("first client: %q, %v", name, err)
	}
	if err := s.SetBackends(nil); err != nil {
		t.Fatal(err)
	}
	if err := s.SetBackends([]Backend{{Addr: a.addr(), MaxConns: 1}}); err != nil {
		t.Fatal(err)
	}
	if got := s.Snapshot().Backends[0].Active; got != 1 {
		t.Errorf("the re-added backend counts %d connections; want 1, the one open", got)
	}
	c2 := dial(t, s)
	c2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if name, err := readLine(c2); err == nil {
		t.Errorf("a second client was served by %q past max_conns 1", name)
	}
	time.Sleep(600 * time.Millisecond) // past the removal's drain deadline
	if err := roundTrip(c1, "still"); err != nil {
		t.Errorf("the first client's connection after the removal's drain deadline: %v; want it open", err)
	}
}
