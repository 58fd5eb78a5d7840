package topo

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/xdptest"
)

// testPrefix names this package's topologies; see TestMain.
const testPrefix = "wt"

func TestMain(m *testing.M) {
	// Namespaces left by an earlier crashed run of this package; those of
	// other live runs are kept (see CleanupStale).
	CleanupStale(testPrefix)
	os.Exit(m.Run())
}

func newTopo(t *testing.T, cfg Config) *Topology {
	t.Helper()
	cfg.Name = UniqueName(testPrefix)
	return NewT(t, cfg)
}

func TestTopology(t *testing.T) {
	topo := newTopo(t, Config{})
	if len(topo.Backends) != 3 {
		t.Fatalf("got %d backends; want 3", len(topo.Backends))
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := topo.ServeBackends(ctx); err != nil {
		t.Fatal(err)
	}

	t.Run("HTTP to each backend", func(t *testing.T) {
		for i, be := range topo.Backends {
			for _, ip := range []netip.Addr{be.IP4, be.IP6} {
				before := topo.Served(i)
				got, err := topo.Get(ctx, ip)
				if err != nil {
					t.Fatal(err)
				}
				if got != be.Name {
					t.Errorf("GET %s: got %q; want %q", URL(ip), got, be.Name)
				}
				if after := topo.Served(i); after != before+1 {
					t.Errorf("Served(%d) went %d -> %d; want +1", i, before, after)
				}
			}
		}
	})

	t.Run("UDP to each backend", func(t *testing.T) {
		for _, be := range topo.Backends {
			for _, ip := range []netip.Addr{be.IP4, be.IP6} {
				got, err := topo.AskUDP(ctx, netip.AddrPortFrom(ip, UDPPort), 0)
				if err != nil {
					t.Fatal(err)
				}
				if got != be.Name {
					t.Errorf("UDP %s: got %q; want %q", ip, got, be.Name)
				}
			}
		}
	})

	t.Run("fixed local port", func(t *testing.T) {
		be := topo.Backends[0]
		// The same 5-tuple twice in a row: the second connect must not
		// fail on the first one's TIME_WAIT.
		for range 2 {
			c, err := topo.DialTCP(ctx, netip.AddrPortFrom(be.IP4, HTTPPort), 40000)
			if err != nil {
				t.Fatal(err)
			}
			if got := c.LocalAddr().String(); got != "10.77.0.1:40000" {
				t.Errorf("local address %s; want 10.77.0.1:40000", got)
			}
			fmt.Fprintf(c, "GET / HTTP/1.0\r\n\r\n")
			buf := make([]byte, 512)
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Read(buf); err != nil {
				t.Fatal(err)
			}
			// Who closes first (and so holds TIME_WAIT) is a race
			// between client and server; a reset leaves none.
			c.SetLinger(0)
			c.Close()
		}
	})

	t.Run("fixed local port after TIME_WAIT", func(t *testing.T) {
		dst := netip.AddrPortFrom(topo.Backends[1].IP4, HTTPPort)
		for i := range 3 {
			c, err := topo.DialTCP(ctx, dst, 40001)
			if err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			// The client closes first, so its end goes to TIME_WAIT.
			c.Close()
			time.Sleep(20 * time.Millisecond)
		}
	})

	t.Run("backends hold the VIPs on lo", func(t *testing.T) {
		for _, be := range topo.Backends {
			err := be.NS.Do(func() error {
				lo, err := netlink.LinkByName("lo")
				if err != nil {
					return err
				}
				addrs, err := netlink.AddrList(lo, netlink.FAMILY_ALL)
				if err != nil {
					return err
				}
				found := map[string]bool{}
				for _, a := range addrs {
					found[a.IPNet.String()] = true
				}
				for _, want := range []string{"10.77.100.1/32", "fd77:100::1/128"} {
					if !found[want] {
						return fmt.Errorf("%s: lo has %v; want %s", be.Name, addrs, want)
					}
				}
				return nil
			})
			if err != nil {
				t.Error(err)
			}
		}
	})

	t.Run("client routes VIPs via the balancer", func(t *testing.T) {
		for _, vip := range []netip.Addr{topo.VIP4, topo.VIP6} {
			err := topo.Client.NS.Do(func() error {
				routes, err := netlink.RouteGet(vip.AsSlice())
				if err != nil {
					return err
				}
				if len(routes) != 1 {
					return fmt.Errorf("route get %s: %v", vip, routes)
				}
				want := topo.Balancer.IP4
				if vip.Is6() {
					want = topo.Balancer.IP6
				}
				if got := routes[0].Gw.String(); got != want.String() {
					return fmt.Errorf("route to %s via %s; want via %s", vip, got, want)
				}
				return nil
			})
			if err != nil {
				t.Error(err)
			}
		}
	})

	t.Run("native XDP_PASS on the balancer's peer", func(t *testing.T) {
		mode, err := topo.PeerXDPMode(topo.Balancer)
		if err != nil {
			t.Fatal(err)
		}
		if mode != "native" {
			t.Errorf("balancer peer %s: XDP mode %q; want native", topo.Balancer.PeerLink, mode)
		}
		mode, err = topo.PeerXDPMode(topo.Client)
		if err != nil {
			t.Fatal(err)
		}
		if mode != "" {
			t.Errorf("client peer %s: XDP mode %q; want none (PeerXDPBalancer)", topo.Client.PeerLink, mode)
		}
	})

	t.Run("tx checksum offload off", func(t *testing.T) {
		for _, h := range topo.Hosts() {
			on, err := TxChecksum(h)
			if err != nil {
				t.Fatal(err)
			}
			if on {
				t.Errorf("%s %s: tx checksum offload on; want off", h.Name, h.Link)
			}
		}
	})
}

func TestPeerXDPAll(t *testing.T) {
	topo := newTopo(t, Config{Backends: 2, PeerXDP: PeerXDPAll})
	for _, h := range topo.Hosts() {
		mode, err := topo.PeerXDPMode(h)
		if err != nil {
			t.Fatal(err)
		}
		if mode != "native" {
			t.Errorf("%s peer %s: XDP mode %q; want native", h.Name, h.PeerLink, mode)
		}
	}
	// Traffic still flows through peers running XDP_PASS.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := topo.ServeBackends(ctx); err != nil {
		t.Fatal(err)
	}
	for _, be := range topo.Backends {
		if got, err := topo.Get(ctx, be.IP6); err != nil || got != be.Name {
			t.Errorf("GET %s: %q, %v; want %q", URL(be.IP6), got, err, be.Name)
		}
	}
}

// TestCloseRemovesEverything checks that Close, even with servers running
// and called twice, leaves no namespace behind.
func TestCloseRemovesEverything(t *testing.T) {
	name := UniqueName(testPrefix)
	topo, err := New(Config{Name: name, Backends: 2})
	xdptest.Check(t, err)
	t.Cleanup(func() { topo.Close() })
	if err := topo.ServeBackends(context.Background()); err != nil {
		t.Fatal(err)
	}
	names, err := netns.List(name + "-")
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 5 { // client, lb, be0, be1, br
		t.Errorf("namespaces %v; want 5", names)
	}
	if err := topo.Close(); err != nil {
		t.Fatal(err)
	}
	if err := topo.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if names, _ := netns.List(name + "-"); len(names) != 0 {
		t.Errorf("after Close, /run/netns has %v", names)
	}
	if err := topo.ServeBackends(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("ServeBackends after Close: %v; want ErrClosed", err)
	}
}

// TestNewFailureCleansUp makes New fail half-way (a name that is already
// taken by the last namespace it would create) and checks that it removed
// what it had created.
func TestNewFailureCleansUp(t *testing.T) {
	name := UniqueName(testPrefix)
	blocker, err := netns.New(name + "-be0")
	xdptest.Check(t, err)
	t.Cleanup(func() { blocker.Close() })

	_, err = New(Config{Name: name, Backends: 1})
	if !errors.Is(err, os.ErrExist) {
		t.Fatalf("New with a taken namespace name: %v; want os.ErrExist", err)
	}
	names, _ := netns.List(name + "-")
	if len(names) != 1 || names[0] != blocker.Name() {
		t.Errorf("after failed New, /run/netns has %v; want only %s", names, blocker.Name())
	}
}

func TestCleanupStale(t *testing.T) {
	// A prefix of this process's own, so parallel runs of this test do
	// not see each other's namespaces: of one width, so that none begins
	// another's (under wx1234, wx12341's names read as a pid's).
	prefix := fmt.Sprintf("wx%07d", os.Getpid())
	pid := strconv.FormatInt(int64(os.Getpid()), 36)
	pid = strings.Repeat("0", pidWidth-len(pid)) + pid
	names := map[string]bool{ // name -> removed by CleanupStale
		prefix + deadPID(t) + "0-lb": true,  // a dead pid: crashed
		prefix + deadPID(t) + "1":    true,  // UniqueName's alone, as a test's one namespace
		prefix + pid + "1":           false, // the same, live
		prefix + "demo-lb":           false, // no pid: not a name UniqueName(prefix) makes
		prefix + "-354-4":            false, // another package's name that begins with the prefix
		prefix + pid + "0-lb":        false, // a live pid (ours): kept
		// A live name of the longer prefix prefix+"a", whose "a"+pid[:4]
		// reads as a pid past pid_max, so dead.
		prefix + "a" + pid + "0-lb": false,
	}
	for name := range names {
		ns, err := netns.New(name)
		xdptest.Check(t, err)
		// Not closed before CleanupStale, as if its process had crashed;
		// closed at the end to release the handle (and to remove it if
		// CleanupStale did not).
		t.Cleanup(func() { ns.Close() })
	}

	if err := CleanupStale(prefix); err != nil {
		t.Fatal(err)
	}
	for name, removed := range names {
		_, err := os.Stat(filepath.Join(netns.RunDir, name))
		if gone := errors.Is(err, os.ErrNotExist); gone != removed {
			t.Errorf("%s: removed = %v; want %v", name, gone, removed)
		}
	}
}

// deadPID is a pid no process has, at most the kernel's largest pid_max
// (2^22), in base 36 as UniqueName writes it.
func deadPID(t *testing.T) string {
	t.Helper()
	for pid := 1 << 22; pid > 1; pid-- {
		if !alive(pid) {
			s := strconv.FormatInt(int64(pid), 36)
			return strings.Repeat("0", pidWidth-len(s)) + s
		}
	}
	t.Fatal("no dead pid")
	return ""
}

func TestUniqueName(t *testing.T) {
	a, b := UniqueName("wt"), UniqueName("wt")
	if a == b {
		t.Errorf("UniqueName twice: %q and %q", a, b)
	}
	if len(a) > MaxNameLen {
		t.Errorf("UniqueName(wt) = %q: longer than %d", a, MaxNameLen)
	}
	if pid, ok := ownerPID("wt", a+"-lb"); !ok || pid != os.Getpid() {
		t.Errorf("ownerPID(%q) = %d, %v; want %d, true", a+"-lb", pid, ok, os.Getpid())
	}
}

// TestUniqueNameSkipsLeftName: a namespace left with the very name UniqueName
// would return next, with no role (a test's one namespace), is skipped past,
// as one with a role is: creating it again would fail.
func TestUniqueNameSkipsLeftName(t *testing.T) {
	own := ProcessPrefix(testPrefix)
	seq, err := strconv.ParseUint(strings.TrimPrefix(UniqueName(testPrefix), own), 36, 64)
	if err != nil {
		t.Fatal(err)
	}
	next := own + strconv.FormatUint(seq+1, 36)
	ns, err := netns.New(next)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	if got := UniqueName(testPrefix); got == next {
		t.Errorf("UniqueName with a namespace %s left: got %q; want another name", next, got)
	}
}

// TestUniqueNameCheckFails: a name whose check fails for another reason than
// its absence (here, too long for the file system) is returned, for creating it
// to report, instead of being skipped past for ever.
func TestUniqueNameCheckFails(t *testing.T) {
	got := make(chan string, 1)
	// Exits when UniqueName returns; before, it never did.
	go func() { got <- uniqueName(testPrefix + strings.Repeat("x", 300)) }()
	select {
	case name := <-got:
		if _, err := netns.New(name); err == nil {
			t.Errorf("netns.New(%.20s...) succeeded; want an error", name)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("UniqueName with a name too long to check did not return within 30s")
	}
}

func TestConfigErrors(t *testing.T) {
	for _, cfg := range []Config{
		{Name: "much-too-long-name"},
		{Name: "a/b"},
		{Name: "ok", Backends: MaxBackends + 1},
		{Name: "ok", Backends: -1},
		{Name: "ok", PeerXDP: 7},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) succeeded; want an error", cfg)
		}
	}
}

func TestOwnerPID(t *testing.T) {
	for _, tc := range []struct {
		name    string
		wantPID int
		wantOK  bool
	}{
		{"wt0002s0-lb", 100, true},
		{"wt0002s1a-be0", 100, true},
		{"wt2hwcg0-client", 4194304, true},
		{"wtdemo-lb", 0, false},
		{"wt0002s-lb", 0, false},
		{"wt0002s0", 100, true},   // UniqueName's alone, no role
		{"wt2hwch0-lb", 0, false}, // 4194305: past pid_max
		{"wta002s0-lb", 0, false}, // wta's: "a002s" is no pid
		{"wt0002s_-lb", 0, false},
	} {
		pid, ok := ownerPID("wt", tc.name)
		if pid != tc.wantPID || ok != tc.wantOK {
			t.Errorf("ownerPID(wt, %s) = %d, %v; want %d, %v", tc.name, pid, ok, tc.wantPID, tc.wantOK)
		}
	}
}

// TestUniqueNameRefusesUnreserved: in a test, UniqueName panics on a prefix
// that is not in ReservedPrefixes, so every test's prefix is listed where
// weir demo's name check refuses it.
func TestUniqueNameRefusesUnreserved(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "ReservedPrefixes") {
			t.Errorf("UniqueName(zzq) recovered %v; want a panic naming ReservedPrefixes", r)
		}
	}()
	UniqueName("zzq")
}
