package proxy

import (
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestSetBackendsDuringConnects swaps the backend set over and over while
// clients connect: a connect that picks a backend just as it is removed (or
// removed and forgotten by the next change) must neither leak its lease or
// its slot nor escape the drain's deadline. At the end every backend the
// service ever had, current or removed, counts no connection and no lease in
// flight, and the connections the clients kept open on removed backends are
// closed by the drain's deadline.
func TestSetBackendsDuringConnects(t *testing.T) {
	names := []string{"a", "b", "c"}
	addrs := make([]netip.AddrPort, len(names))
	for i, n := range names {
		addrs[i] = startBackend(t, n, netip.AddrPort{}, hello).addr()
	}
	sets := [][]Backend{
		{{Addr: addrs[0]}, {Addr: addrs[1]}},
		{{Addr: addrs[1]}, {Addr: addrs[2]}},
		{{Addr: addrs[2]}},
		{{Addr: addrs[0]}, {Addr: addrs[1]}, {Addr: addrs[2], MaxConns: 2}},
		{},
		{{Addr: addrs[0], MaxConns: 1}},
	}
	const drain = 200 * time.Millisecond
	s := startProxy(t, Config{Backends: sets[0], DrainTimeout: drain, Retries: 1, AcceptLoops: 2,
		ConnectTimeout: time.Second, Logger: discardLogger()})

	// Every backend object the service has had: removed ones are forgotten
	// by a later change once they count no connection.
	seen := map[*backend]bool{}
	note := func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, b := range s.backends {
			seen[b] = true
		}
		for _, b := range s.leaving {
			seen[b] = true
		}
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var served atomic.Int64
	var kept sync.Map // connections left open: the drain must close them
	for i := range 8 {
		wg.Add(1)
		// Exits when stop is closed.
		go func() {
			defer wg.Done()
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				c, err := net.Dial("tcp", s.Addr().String())
				if err != nil {
					continue
				}
				c.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err := readLine(c); err == nil {
					served.Add(1)
					if (i+n)%4 == 0 {
						c.SetDeadline(time.Time{})
						kept.Store(c, true)
						continue
					}
				}
				c.Close()
			}
		}()
	}
	t.Cleanup(func() {
		kept.Range(func(c, _ any) bool { c.(net.Conn).Close(); return true })
	})
	end := time.Now().Add(2 * time.Second)
	for i := 0; time.Now().Before(end); i++ {
		if err := s.SetBackends(sets[i%len(sets)]); err != nil {
			t.Fatal(err)
		}
		note()
		if i%8 == 0 {
			time.Sleep(time.Millisecond) // let some connections get through to a set
		}
	}
	close(stop)
	wg.Wait()
	if served.Load() == 0 {
		t.Fatal("no client was served")
	}
	// Every backend removed: the drain's deadline closes what is left.
	if err := s.SetBackends(nil); err != nil {
		t.Fatal(err)
	}
	note()
	waitfor.Value(t, drain+10*time.Second, "every connection closed by the drain", active(s, 0))
	for b := range seen {
		if n := b.active.Load(); n != 0 {
			t.Errorf("backend %s (removed %v): %d active; want 0", b.addr, b.removed.Load(), n)
		}
		if n := s.bal.InFlight(b.addr); n != 0 {
			t.Errorf("backend %s: %d leases in flight; want 0", b.addr, n)
		}
	}
	t.Logf("%d clients served", served.Load())
}
