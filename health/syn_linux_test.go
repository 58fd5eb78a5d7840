package health

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

func synEnv(t *testing.T) checkEnv {
	ns := newNetNS(t)
	return checkEnv{
		listen: func(network, addr string) (ln net.Listener, err error) {
			err = ns.do(func() error { ln, err = net.Listen(network, addr); return err })
			return ln, err
		},
		run: ns.run,
	}
}

// start starts c.Run on a thread inside the namespace, so that its raw
// sockets and its port reservation are the namespace's; stop ends it and
// waits for it.
func (n *netNS) start(t *testing.T, c *Checker) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	// Exits when stop cancels ctx; its thread stays locked, so the runtime
	// discards it rather than reuse a thread in the namespace.
	go func() {
		runtime.LockOSThread()
		h, err := netns.GetFromName(n.name)
		if err == nil {
			err = netns.Set(h)
			h.Close()
		}
		if err != nil {
			done <- fmt.Errorf("enter %s: %w", n.name, err)
			return
		}
		done <- c.Run(ctx)
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: got %v; want nil", err)
			}
		})
	}
}

// run starts c.Run inside the namespace and stops it at the end of the test.
func (n *netNS) run(t *testing.T, c *Checker) {
	t.Helper()
	t.Cleanup(n.start(t, c))
}

// readNS reads a file as a thread of the namespace sees it (/proc/sys/net
// belongs to the reader's namespace).
func (n *netNS) readNS(t *testing.T, name string) string {
	t.Helper()
	var b []byte
	if err := n.do(func() (err error) { b, err = os.ReadFile(name); return err }); err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// TestSynChecks: syn checks of IPv4 and IPv6 backends pass without the
// backend's application seeing a connection, a closed port fails at once with
// the connect method's error, and Run reserves the source ports in its
// namespace while it runs and restores the setting after.
func TestSynChecks(t *testing.T) {
	ns := newNetNS(t)
	var accepted atomic.Int32
	listen := func(addr string) string {
		var ln net.Listener
		if err := ns.do(func() (err error) { ln, err = net.Listen("tcp", addr); return err }); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		wg.Add(1)
		// Exits when the cleanup closes ln.
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				accepted.Add(1)
				c.Close()
			}
		}()
		t.Cleanup(func() { ln.Close(); wg.Wait() })
		return ln.Addr().String()
	}
	up4, up6 := listen("127.0.0.1:0"), listen("[::1]:0")
	// A port nothing listens on: its SYN is answered with an RST.
	var closed string
	if err := ns.do(func() error {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		closed = ln.Addr().String()
		return ln.Close()
	}); err != nil {
		t.Fatal(err)
	}
	before := ns.readNS(t, reservedPortsFile)
	// A socket that holds a port of the range before Run: the checks leave it out.
	listen("127.0.0.1:62050")

	var (
		mu      sync.Mutex
		results = map[string][]Result{}
	)
	c := &Checker{SynPorts: [2]uint16{62000, 62099}, OnCheck: func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		results[r.ID] = append(results[r.ID], r)
	}}
	cfg := Config{Check: Check{Method: MethodSyn, Interval: 20 * time.Millisecond, Timeout: 500 * time.Millisecond, Rise: 1, Fall: 1}}
	if err := c.SetService("web", cfg); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"up4", "up6", "closed"} {
		addr := map[string]string{"up4": up4, "up6": up6, "closed": closed}[id]
		if err := c.Set(Backend{ID: id, Addr: addr, Service: "web"}); err != nil {
			t.Fatal(err)
		}
	}
	stop := ns.start(t, c)
	defer stop()
	waitfor.Value(t, 5*time.Second, "5 checks of each backend", func() (any, bool) {
		mu.Lock()
		defer mu.Unlock()
		ok := true
		for _, id := range []string{"up4", "up6", "closed"} {
			ok = ok && len(results[id]) >= 5
		}
		return fmt.Sprint(len(results["up4"]), len(results["up6"]), len(results["closed"])), ok
	})
	if got := ns.readNS(t, reservedPortsFile); !strings.Contains(got, "62000-62099") {
		t.Errorf("ip_local_reserved_ports while running: got %q; want it to hold 62000-62099", got)
	}
	if st := c.Syn(); !st.Open || st.Err != nil || st.ReserveErr != nil || st.Excluded != 1 {
		t.Errorf("Syn: got %+v; want open, reserved, one port excluded", st)
	}
	stop()
	if got := ns.readNS(t, reservedPortsFile); got != before {
		t.Errorf("ip_local_reserved_ports after Run: got %q; want %q restored", got, before)
	}

	mu.Lock()
	defer mu.Unlock()
	for _, id := range []string{"up4", "up6"} {
		for _, r := range results[id] {
			if r.Err != nil || r.Method != MethodSyn {
				t.Errorf("%s: got %v by %v; want a pass by syn", id, r.Err, r.Method)
			}
		}
	}
	for _, r := range results["closed"] {
		// At once: an RST, not a timeout.
		if r.Err == nil || r.Err.Error() != "connect: connection refused" || r.Duration > 100*time.Millisecond {
			t.Errorf("closed: got %v after %v; want connect: connection refused at once", r.Err, r.Duration)
		}
	}
	if n := accepted.Load(); n != 0 {
		t.Errorf("connections the backends accepted: got %d; want 0 (the kernel resets the half-open ones)", n)
	}
}

// TestSynRemoveInFlight: removing a backend whose SYN is unanswered frees its
// source port at once and reports nothing for it.
func TestSynRemoveInFlight(t *testing.T) {
	ns := newNetNS(t)
	hole := ns.listen(t, "127.0.0.1:0").Addr().String()
	ns.dropSYN(t, netip.MustParseAddrPort(hole).Port())
	var results atomic.Int32
	c := &Checker{SynPorts: [2]uint16{62100, 62109}, OnCheck: func(Result) { results.Add(1) }}
	if err := c.SetService("web", Config{Check: Check{Method: MethodSyn, Interval: 10 * time.Millisecond, Timeout: 5 * time.Second}}); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if err := c.Set(Backend{ID: fmt.Sprint("hole", i), Addr: hole, Service: "web"}); err != nil {
			t.Fatal(err)
		}
	}
	ns.run(t, c)
	free := func() int {
		c.mu.RLock()
		defer c.mu.RUnlock()
		if c.syn == nil {
			return -1
		}
		return c.syn.freePorts()
	}
	waitfor.Value(t, 5*time.Second, "all 10 ports in use", func() (any, bool) { return free(), free() == 0 })
	for i := range 10 {
		c.Remove(fmt.Sprint("hole", i))
	}
	if n := free(); n != 10 {
		t.Errorf("free ports after Remove: got %d; want 10", n)
	}
	if n := results.Load(); n != 0 {
		t.Errorf("results reported: got %d; want 0", n)
	}
}

func TestPktInfo(t *testing.T) {
	src4 := [4]byte{10, 0, 0, 1}
	if got, want := pktInfo4(make([]byte, 64), src4), unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: src4}); !bytes.Equal(got, want) {
		t.Errorf("pktInfo4: got %x; want %x", got, want)
	}
	src6 := netip.MustParseAddr("fd00::1").As16()
	if got, want := pktInfo6(make([]byte, 64), src6), unix.PktInfo6(&unix.Inet6Pktinfo{Addr: src6}); !bytes.Equal(got, want) {
		t.Errorf("pktInfo6: got %x; want %x", got, want)
	}
}

// TestSynTimeoutsAndFewPorts: black-holed syn checks of services with
// different timeouts each time out after their own (the prober keeps one
// deadline queue per timeout), while healthy backends, many more than the
// source ports, wait for a free port and keep passing.
func TestSynTimeoutsAndFewPorts(t *testing.T) {
	ns := newNetNS(t)
	good := ns.listen(t, "127.0.0.1:0").Addr().String()
	hole := ns.listen(t, "127.0.0.1:0").Addr().String()
	ns.dropSYN(t, netip.MustParseAddrPort(hole).Port())
	const (
		short, long = 100 * time.Millisecond, 400 * time.Millisecond
		nGood       = 20
	)
	var (
		mu      sync.Mutex
		passes  = map[string]int{}
		timeout = map[string][]Result{}
		others  []Result
	)
	c := &Checker{SynPorts: [2]uint16{62200, 62209}, OnCheck: func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case r.Err == nil && r.Addr == good:
			passes[r.ID]++
		case errors.Is(r.Err, ErrTimeout) && r.Addr == hole:
			timeout[r.Service] = append(timeout[r.Service], r)
		default:
			others = append(others, r)
		}
	}}
	for name, to := range map[string]time.Duration{"short": short, "long": long, "good": short} {
		if err := c.SetService(name, Config{Check: Check{Method: MethodSyn, Interval: 50 * time.Millisecond, Timeout: to}}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 2 {
		for _, svc := range []string{"short", "long"} {
			if err := c.Set(Backend{ID: fmt.Sprint(svc, i), Addr: hole, Service: svc}); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range nGood {
		if err := c.Set(Backend{ID: fmt.Sprint("good", i), Addr: good, Service: "good"}); err != nil {
			t.Fatal(err)
		}
	}
	ns.run(t, c)
	waitfor.Value(t, 10*time.Second, "3 timeouts of each black hole service and 10 passes of each good backend", func() (any, bool) {
		mu.Lock()
		defer mu.Unlock()
		ok := len(timeout["short"]) >= 6 && len(timeout["long"]) >= 6
		least := -1
		for i := range nGood {
			n := passes[fmt.Sprint("good", i)]
			if least < 0 || n < least {
				least = n
			}
		}
		return fmt.Sprintf("timeouts %d short, %d long; least passes %d", len(timeout["short"]), len(timeout["long"]), least), ok && least >= 10
	})
	mu.Lock()
	defer mu.Unlock()
	for svc, to := range map[string]time.Duration{"short": short, "long": long} {
		for _, r := range timeout[svc] {
			// Not before the timeout; the upper bound only says "not stuck",
			// with room for a loaded machine, as in the black-hole test (the
			// error's text tells the timeouts apart).
			if r.Duration < to || r.Duration > to+700*time.Millisecond {
				t.Errorf("%s: timed out after %v; want about %v", r.ID, r.Duration, to)
			}
			if want := fmt.Sprintf("connect: timeout after %v", to); r.Err.Error() != want {
				t.Errorf("%s: got %q; want %q", r.ID, r.Err, want)
			}
		}
	}
	for _, r := range others {
		t.Errorf("%s: unexpected result %v", r.ID, r.Err)
	}
}

// TestSynUnreachable: a SYN that a firewall rejects with an ICMP destination
// unreachable fails at once, with the error a connect gets for it, for
// either method.
func TestSynUnreachable(t *testing.T) {
	for _, tt := range []struct {
		name string
		v6   bool
		code byte
		want string
	}{
		{"port unreachable", false, 3, "connect: connection refused"},
		{"host unreachable", false, 1, "connect: no route to host"},
		{"administratively prohibited", false, 13, "connect: no route to host"},
		{"IPv6 port unreachable", true, 4, "connect: connection refused"},
		{"IPv6 administratively prohibited", true, 1, "connect: permission denied"},
	} {
		for _, m := range []Method{MethodConnect, MethodSyn} {
			t.Run(tt.name+"/"+m.String(), func(t *testing.T) {
				ns := newNetNS(t)
				addr := ns.listen(t, map[bool]string{false: "127.0.0.1:0", true: "[::1]:0"}[tt.v6]).Addr().String()
				ns.rejectSYN(t, tt.v6, netip.MustParseAddrPort(addr).Port(), tt.code)
				got := make(chan Result, 1)
				c := &Checker{SynPorts: [2]uint16{62300, 62309}, OnCheck: func(r Result) {
					select {
					case got <- r:
					default:
					}
				}}
				if err := c.SetService("web", Config{Check: Check{Method: m, Interval: 50 * time.Millisecond, Timeout: 2 * time.Second}}); err != nil {
					t.Fatal(err)
				}
				if err := c.Set(Backend{ID: addr, Service: "web"}); err != nil {
					t.Fatal(err)
				}
				if m == MethodSyn {
					ns.run(t, c)
				} else {
					c.Dial = ns.dial
					run(t, c)
				}
				select {
				case r := <-got:
					// At once: well within the 2 s timeout.
					if r.Err == nil || r.Err.Error() != tt.want || r.Duration > time.Second || r.Method != m {
						t.Errorf("got %v after %v by %v; want %s at once by %v", r.Err, r.Duration, r.Method, tt.want, m)
					}
				case <-time.After(5 * time.Second):
					t.Fatal("no check result in 5s")
				}
			})
		}
	}
}

func TestParseUnreachable(t *testing.T) {
	src, dst := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	syn := make([]byte, ipv4Len+synLen)
	buildIPv4(syn, src.As4(), dst.As4(), 1)
	buildSYN(syn[ipv4Len:], src, dst, 61000, 80, 42)
	icmp4 := func(typ, code byte) []byte {
		b := make([]byte, 20, 20+8+28)
		b[0], b[9] = 0x45, unix.IPPROTO_ICMP
		b = append(b, typ, code, 0, 0, 0, 0, 0, 0)
		return append(b, syn[:28]...) // the IP header and 8 bytes of TCP
	}
	src6, dst6 := netip.MustParseAddr("fd00::1"), netip.MustParseAddr("fd00::2")
	icmp6 := func(typ, code byte) []byte {
		b := []byte{typ, code, 0, 0, 0, 0, 0, 0}
		ip := make([]byte, 40)
		ip[0], ip[6] = 0x60, unix.IPPROTO_TCP
		copy(ip[8:], src6.AsSlice())
		copy(ip[24:], dst6.AsSlice())
		return append(append(b, ip...), buildSYN(make([]byte, synLen), src6, dst6, 61000, 80, 42)...)
	}
	for _, tt := range []struct {
		name string
		b    []byte
		v6   bool
		ok   bool
		dst  netip.Addr
		err  unix.Errno
	}{
		{"port unreachable", icmp4(3, 3), false, true, dst, unix.ECONNREFUSED},
		{"host unreachable", icmp4(3, 1), false, true, dst, unix.EHOSTUNREACH},
		{"fragmentation needed: no verdict", icmp4(3, 4), false, true, dst, 0},
		{"not an unreachable", icmp4(11, 0), false, false, netip.Addr{}, 0},
		{"quote cut short", icmp4(3, 3)[:20+8+24], false, false, netip.Addr{}, 0},
		{"IPv6 port unreachable", icmp6(1, 4), true, true, dst6, unix.ECONNREFUSED},
		{"IPv6 no route", icmp6(1, 0), true, true, dst6, unix.ENETUNREACH},
		{"IPv6 packet too big", icmp6(2, 0), true, false, netip.Addr{}, 0},
	} {
		u, ok := parseUnreachable(tt.b, tt.v6)
		if ok != tt.ok || (ok && (u.dst != tt.dst || u.sport != 61000 || u.dport != 80 || u.seq != 42 || u.err != tt.err)) {
			t.Errorf("%s: got %+v, %t; want %v:80 from 61000, seq 42, %v, %t", tt.name, u, ok, tt.dst, tt.err, tt.ok)
		}
	}
}

// TestSynAllPortsHeld: when local sockets hold every port of the range, syn
// checks cannot be told apart from those sockets' traffic, so they connect
// instead and Method says why.
func TestSynAllPortsHeld(t *testing.T) {
	ns := newNetNS(t)
	up := ns.listen(t, "127.0.0.1:0").Addr().String()
	ns.listen(t, "127.0.0.1:62400")
	checked := make(chan Result, 1)
	// Dial: the connects of the fallback run on other threads than Run's.
	c := &Checker{SynPorts: [2]uint16{62400, 62400}, Dial: ns.dial, OnCheck: func(r Result) {
		select {
		case checked <- r:
		default:
		}
	}}
	if err := c.SetService("web", Config{Check: Check{Method: MethodSyn, Interval: 20 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: up, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	ns.run(t, c)
	// Every check is made by connect; the first may time out on a loaded
	// machine (20 ms: the interval), so a pass is waited for.
	deadline := time.After(5 * time.Second)
	for passed := false; !passed; {
		select {
		case r := <-checked:
			if r.Method != MethodConnect {
				t.Fatalf("check: got %v by %v; want connect", r.Err, r.Method)
			}
			passed = r.Err == nil
		case <-deadline:
			t.Fatal("no passing check in 5s")
		}
	}
	if m, err := c.Method("web"); m != MethodConnect || err == nil || !strings.Contains(err.Error(), "held by a local socket") {
		t.Errorf("Method: got %v, %v; want connect, every port held by a local socket", m, err)
	}
}

// TestSynSourceCache: the source address the kernel picks for a destination
// is asked once and remembered, until netlink reports a change of addresses
// (or routes, or rules) or the TTL runs out.
func TestSynSourceCache(t *testing.T) {
	ns := newNetNS(t)
	var p *synProber
	if err := ns.do(func() (err error) {
		p, err = openSyn([2]uint16{62500, 62509}, func(*backend, error, time.Time) {})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.do(func() error { p.close(); return nil }) })
	if p.routes < 0 {
		t.Fatal("no netlink socket to watch routes")
	}
	dst := netip.MustParseAddr("127.0.0.1")
	var cache srcEntry
	ask := func(at time.Time) (asked bool) {
		t.Helper()
		before := cache.at
		if err := ns.do(func() error {
			p.readRoutes(at)
			src, err := p.source(dst, netip.Addr{}, at, &cache)
			if err == nil && src != dst {
				err = fmt.Errorf("source: got %v; want %v", src, dst)
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return !cache.at.Equal(before)
	}
	t0 := time.Now()
	if !ask(t0) {
		t.Fatal("first use: not asked")
	}
	// The namespace's own setup (lo's addresses) may still be reported:
	// a few asks to let it pass, then the remembered one must be used.
	settled := false
	for k := range 5 {
		if !ask(t0.Add(time.Duration(k+1) * 100 * time.Millisecond)) {
			settled = true
			break
		}
	}
	if !settled {
		t.Error("nothing changed: asked every time; want the remembered one")
	}
	if err := ns.do(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(10, 9, 9, 9), Mask: net.CIDRMask(32, 32)}})
	}); err != nil {
		t.Fatal(err)
	}
	if !ask(t0.Add(2 * time.Second)) {
		t.Error("after an address was added: not asked again")
	}
	if ask(t0.Add(3 * time.Second)) {
		t.Error("after it was asked again: asked once more; want the remembered one")
	}
	if !ask(t0.Add(3*time.Second + srcTTL)) {
		t.Error("after the TTL: not asked again")
	}
}
