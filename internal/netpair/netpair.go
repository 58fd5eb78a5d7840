// Package netpair gives tests two network namespaces joined by a veth, one
// address at each end, and a way to cut the link: a peer that vanishes
// without a FIN or a reset, as a host that lost power or a NAT that forgot
// the flow looks to the other.
package netpair

import (
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
)

// Pair is two namespaces, A and B, joined by a veth whose ends are named "a"
// and "b" and hold AddrA and AddrB.
type Pair struct {
	A, B         *netns.NS
	AddrA, AddrB netip.Addr
}

// New makes a Pair that is removed when the test ends.
func New(t testing.TB) *Pair {
	t.Helper()
	name := topo.UniqueName("wnp")
	p := &Pair{AddrA: netip.MustParseAddr("10.99.0.1"), AddrB: netip.MustParseAddr("10.99.0.2")}
	p.A, p.B = newNS(t, name+"-a"), newNS(t, name+"-b")
	if err := p.A.Do(func() error {
		nsFd, err := unix.Open(p.B.Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(nsFd)
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "a"}, PeerName: "b", PeerNamespace: netlink.NsFd(nsFd)}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("add veth: %w", err)
		}
		return addrUp("a", p.AddrA)
	}); err != nil {
		t.Fatal(err)
	}
	if err := p.B.Do(func() error { return addrUp("b", p.AddrB) }); err != nil {
		t.Fatal(err)
	}
	return p
}

// newNS creates a namespace that is removed when the test ends.
func newNS(t testing.TB, name string) *netns.NS {
	t.Helper()
	ns, err := netns.New(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	return ns
}

// addrUp gives the link called name the address a in a /30 and sets it up,
// in the calling thread's namespace.
func addrUp(name string, a netip.Addr) error {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("find %s: %w", name, err)
	}
	ipn := &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(30, 32)}
	if err := netlink.AddrAdd(link, &netlink.Addr{IPNet: ipn}); err != nil {
		return fmt.Errorf("address %s: %w", name, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}

// CutB takes B's end of the link down: from then on nothing B sent arrives,
// and nothing reaches it, and neither end is told anything.
func (p *Pair) CutB(t testing.TB) {
	t.Helper()
	if err := p.B.Do(func() error {
		link, err := netlink.LinkByName("b")
		if err == nil {
			err = netlink.LinkSetDown(link)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// DropPort makes a peer on port of this host vanish without a FIN or a reset:
// from then on nftables drops every TCP packet to and from the port that
// reaches the calling thread's network namespace. The rules stay with the
// namespace: call it only in one the test made (or runs in) alone.
func DropPort(t testing.TB, port uint16) {
	t.Helper()
	rules := fmt.Sprintf("table inet vanish { chain in { type filter hook input priority 0; tcp sport %[1]d drop; tcp dport %[1]d drop; }; }", port)
	if out, err := exec.Command("nft", rules).CombinedOutput(); err != nil {
		t.Fatalf("nft %s: %v: %s", rules, err, out)
	}
}

// VanishB cuts B's link (CutB) and checks what two services, each holding
// one connection from B, make of it (Outlived).
func (p *Pair) VanishB(t testing.TB, probed, unprobed func() int64) {
	t.Helper()
	p.CutB(t)
	Outlived(t, time.Now(), probed, unprobed)
}

// Outlived checks what two services, each holding one connection whose peer
// vanished at start, make of it: ends, whose count of open connections is
// given, finds the peer gone (TCP keepalive, say idle 1s, interval 1s, 2
// probes, or a TCP_USER_TIMEOUT of a second with bytes in flight) and must
// drop the connection within 20s, room for a loaded machine; holds, which
// does not, must still hold it a second after that.
func Outlived(t testing.TB, start time.Time, ends, holds func() int64) {
	t.Helper()
	waitfor.Value(t, 20*time.Second, "0 connections", func() (any, bool) {
		n := ends()
		return fmt.Sprintf("%d connections", n), n == 0
	})
	t.Logf("the service that finds it out ended the connection %v after the peer went", time.Since(start).Round(time.Millisecond))
	if waitfor.Cond(time.Second, func() bool { return holds() != 1 }) {
		t.Errorf("the service that does not find it out, %v after the peer went: got %d connections; want 1",
			time.Since(start).Round(time.Millisecond), holds())
	}
}
