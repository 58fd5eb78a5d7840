package proxy

import (
	"io"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestSiblingsWaiting: a loop sees that another loop of the process has events
// waiting (here a connection in the other's listener), and does not take its own
// for another's; a loop alone has nobody to yield to.
func TestSiblingsWaiting(t *testing.T) {
	var loops []*loop
	for range 2 {
		ln, err := listen(netip.MustParseAddrPort("127.0.0.1:0"), tcpOpts{})
		if err != nil {
			t.Fatal(err)
		}
		l, err := newLoop(&Service{}, ln)
		if err != nil {
			ln.close()
			t.Fatal(err)
		}
		t.Cleanup(func() {
			l.ep.Close()
			unix.Close(l.wake)
			ln.close()
		})
		loops = append(loops, l)
	}
	addr, err := getsocknameRaw(loops[0].ln.fd)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// Only loop 0 runs: its pending connection is its own.
	stop0 := loops[0].running()
	if loops[0].siblingsWaiting() {
		t.Error("a loop alone sees a sibling waiting")
	}
	stop1 := loops[1].running()
	defer stop1()
	waitfor.Value(t, 5*time.Second, "loop 1 sees loop 0's pending connection", func() (any, bool) {
		w := loops[1].siblingsWaiting()
		return w, w
	})
	if loops[0].siblingsWaiting() {
		t.Error("loop 0 takes its own pending connection for a sibling's")
	}
	stop0()
	if loops[1].siblingsWaiting() {
		t.Error("loop 0 has stopped running, and loop 1 still sees it waiting")
	}
}

// TestKeepAliveAllocatesNothing: once a connection is established, moving a
// request and its answer through the proxy allocates nothing (6 allocations per
// exchange had cost a garbage collection about every second under load). The
// whole process's allocations are counted, so the client and the echoing
// backend, which allocate nothing per message once running, are in the count too.
func TestKeepAliveAllocatesNothing(t *testing.T) {
	b := startBackend(t, "b", netip.AddrPort{}, echo)
	s := startProxy(t, Config{Backends: []Backend{{Addr: b.addr()}}, AcceptLoops: 1})
	c := dial(t, s)
	msg := []byte("a small request\n")
	got := make([]byte, len(msg))
	exchange := func() {
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatal(err)
		}
	}
	for range 200 {
		exchange()
	}
	const n = 2000
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		exchange()
	}
	runtime.ReadMemStats(&after)
	if per := float64(after.Mallocs-before.Mallocs) / n; per > 0.05 {
		t.Errorf("%.2f allocations per request and answer through the proxy; want none", per)
	}
}
