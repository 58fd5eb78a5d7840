package loader

import (
	"errors"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/weir-lb/weir/bpf"
	"golang.org/x/sys/unix"
)

// socketPair is a connection the way the proxy holds it: a client connected to a
// front listener (accepted as c) and a backend (accepted as b) dialled as s.
type socketPair struct {
	client, c, s, b net.Conn
	cfd, sfd        int
}

func newSocketPair(t *testing.T) *socketPair {
	t.Helper()
	front, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()
	back, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	p := &socketPair{}
	var errs [4]error
	p.client, errs[0] = net.Dial("tcp", front.Addr().String())
	p.c, errs[1] = front.Accept()
	p.s, errs[2] = net.Dial("tcp", back.Addr().String())
	p.b, errs[3] = back.Accept()
	if err := errors.Join(errs[:]...); err != nil {
		t.Fatal(err)
	}
	for _, c := range []net.Conn{p.client, p.c, p.s, p.b} {
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(5 * time.Second))
	}
	p.cfd, p.sfd = sysFD(t, p.c), sysFD(t, p.s)
	return p
}

// sysFD is the descriptor of c itself (not a dup), valid while c is open.
func sysFD(t *testing.T, c net.Conn) int {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	rc.Control(func(f uintptr) { fd = int(f) })
	return fd
}

func TestSockMapForwardsBothWays(t *testing.T) {
	m, err := LoadSockMap()
	if err != nil {
		t.Fatalf("load sockmap: %v", err)
	}
	defer m.Close()
	p := newSocketPair(t)
	cookies, err := m.Pair(p.cfd, p.sfd)
	if err != nil {
		t.Fatalf("pair: %v", err)
	}
	var sent, received [2]int64 // by the paired socket the bytes reach: client's, backend's
	for i, tc := range []struct {
		name     string
		from, to net.Conn
		msg      string
	}{
		{"client to backend", p.client, p.b, "request"},
		{"backend to client", p.b, p.client, "response"},
	} {
		sent[i] = monotonicNow(t)
		if _, err := tc.from.Write([]byte(tc.msg)); err != nil {
			t.Fatalf("%s: write: %v", tc.name, err)
		}
		got := make([]byte, len(tc.msg))
		if _, err := io.ReadFull(tc.to, got); err != nil || string(got) != tc.msg {
			t.Fatalf("%s: got %q, %v; want %q", tc.name, got, err, tc.msg)
		}
		// A second message: the first one's time stays.
		tc.from.Write([]byte(tc.msg))
		io.ReadFull(tc.to, got)
		received[i] = monotonicNow(t)
	}
	p.c.Close()
	p.s.Close()
	first, err := m.Forget(cookies)
	if err != nil {
		t.Errorf("forget: %v", err)
	}
	for i, side := range []string{"client's socket", "backend's socket"} {
		if first[i] < sent[i] || first[i] > received[i] {
			t.Errorf("%s: first bytes at %d; want between the write (%d) and the read (%d)", side, first[i], sent[i], received[i])
		}
	}
	if first, err := m.Forget(cookies); first != [2]int64{} || err != nil {
		t.Errorf("forgotten sockets: got %d, %v; want [0 0], nil", first, err)
	}
	if err := m.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Fatalf("second close: got %v; want nil", err)
	}
	if _, err := m.Pair(p.cfd, p.sfd); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("pair after close: got %v; want net.ErrClosed", err)
	}
}

// monotonicNow is CLOCK_MONOTONIC in ns, the clock of Forget's times.
func monotonicNow(t *testing.T) int64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return ts.Nano()
}

// closedBackendPair loads a sockmap and makes a connection whose backend has
// closed, which the kernel refuses to pair.
func closedBackendPair(t *testing.T) (*SockMap, *socketPair) {
	t.Helper()
	m, err := LoadSockMap()
	if err != nil {
		t.Fatalf("load sockmap: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	p := newSocketPair(t)
	p.b.Close()
	// The backend's FIN makes the proxy's socket readable (EOF).
	if n, err := p.s.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("backend socket: got %d, %v; want EOF", n, err)
	}
	return m, p
}

// TestSockMapRefusesClosingSocket: the kernel pairs only established sockets. A
// backend that has already closed is refused, the client's socket leaves the map
// again (it reads as a plain socket), and no byte is lost.
func TestSockMapRefusesClosingSocket(t *testing.T) {
	m, p := closedBackendPair(t)
	_, err := m.Pair(p.cfd, p.sfd)
	var pe *PairError
	if !errors.As(err, &pe) || pe.Lost() {
		t.Fatalf("pair with a closed backend: got %v; want a PairError, nothing lost", err)
	}
	if _, err := p.client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1)
	if _, err := io.ReadFull(p.c, got); err != nil || string(got) != "x" {
		t.Fatalf("client socket after a refused pair: got %q, %v; want \"x\"", got, err)
	}
}

// TestSockMapRefusedPairCountsUnmarkedEntry: a refused pair whose client socket
// has an entry in splice_socks without the passed mark has lost bytes all the
// same: the program writes the entry before it marks it, so a Pair that looks in
// between finds it unmarked. The entry is seeded here, as the program would
// have left it at that instant.
func TestSockMapRefusedPairCountsUnmarkedEntry(t *testing.T) {
	m, p := closedBackendPair(t)
	cc, err := unix.GetsockoptUint64(p.cfd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.objs.SpliceSocks.Put(cc, bpf.SockmapSpliceSock{FirstNs: uint64(monotonicNow(t))}); err != nil {
		t.Fatal(err)
	}
	_, err = m.Pair(p.cfd, p.sfd)
	var pe *PairError
	if !errors.As(err, &pe) || !pe.Lost() {
		t.Fatalf("refused pair, client entry unmarked: got %v; want a PairError with bytes lost", err)
	}
	var st bpf.SockmapSpliceSock
	if err := m.objs.SpliceSocks.Lookup(cc, &st); err == nil {
		t.Errorf("client's entry still in splice_socks after the refused pair: %+v", st)
	}
}

// TestSockMapKeepsEveryPairsStamps: with as many connections paired as splice_peers
// holds, each of whose sockets has had bytes, splice_socks still holds every
// socket's entry: an entry the map evicts loses its socket's first-byte time, and
// for a socket whose bytes go to the proxy, its mark, so that later bytes would be
// forwarded past those the proxy still holds. Both maps are shrunk by the same
// factor, to 128 sockets: few enough that the CPUs' own free lists of splice_socks
// (up to 128 entries each) weigh as they do on a host of many CPUs at full size.
func TestSockMapKeepsEveryPairsStamps(t *testing.T) {
	const shrink = 512
	var peers uint32
	m, err := loadSockMap(func(spec *ebpf.CollectionSpec) {
		for _, name := range []string{"splice_peers", "splice_socks"} {
			spec.Maps[name].MaxEntries /= shrink
		}
		peers = spec.Maps["splice_peers"].MaxEntries
	})
	if err != nil {
		t.Fatalf("load sockmap: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	// Loopback delivers on the sender's CPU, which runs the program: the first
	// pair's bytes are sent from one CPU (it takes a free list of its own), the
	// others' from another, the way a busy CPU meets another's list.
	cpus := onCPU(t)
	pairs := make([][2]uint64, peers/2) // the sockets' cookies
	got := make([]byte, 1)
	for i := range pairs {
		p := newSocketPair(t)
		if pairs[i], err = m.Pair(p.cfd, p.sfd); err != nil {
			t.Fatalf("pair %d of %d: %v", i+1, len(pairs), err)
		}
		cpus.pin(min(i, 1) % len(cpus.allowed))
		for _, ends := range [][2]net.Conn{{p.client, p.b}, {p.b, p.client}} {
			if _, err := ends[0].Write([]byte("x")); err != nil {
				t.Fatalf("pair %d: write: %v", i+1, err)
			}
			if _, err := io.ReadFull(ends[1], got); err != nil {
				t.Fatalf("pair %d: read: %v", i+1, err)
			}
		}
	}
	missing := 0
	for _, cookies := range pairs {
		first, err := m.Forget(cookies)
		if err != nil {
			t.Fatalf("forget: %v", err)
		}
		for _, ns := range first {
			if ns == 0 {
				missing++
			}
		}
	}
	if missing > 0 {
		t.Errorf("first-byte times lost with %d sockets paired: got %d missing; want none", 2*len(pairs), missing)
	}
}

// cpuPinner runs the calling goroutine on one CPU at a time (pin), on a thread of
// its own; the test's end restores the thread's CPUs and releases it.
type cpuPinner struct {
	t       *testing.T
	allowed []int
}

func onCPU(t *testing.T) *cpuPinner {
	t.Helper()
	runtime.LockOSThread()
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("sched_getaffinity: %v", err)
	}
	p := &cpuPinner{t: t}
	for cpu := range 1024 {
		if set.IsSet(cpu) {
			p.allowed = append(p.allowed, cpu)
		}
	}
	t.Cleanup(func() {
		unix.SchedSetaffinity(0, &set)
		runtime.UnlockOSThread()
	})
	return p
}

// pin moves the calling thread to the i-th allowed CPU (a host with one has only
// the first).
func (p *cpuPinner) pin(i int) {
	p.t.Helper()
	var one unix.CPUSet
	one.Set(p.allowed[i])
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		p.t.Fatalf("sched_setaffinity: %v", err)
	}
}
