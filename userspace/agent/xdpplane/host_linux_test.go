package xdpplane

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
)

// TestInterfaceAddrsSkipsUnusableSources: with addresses left out, the
// balancer's own address of each family is the first one of the interface
// that may be a source. IPv6 lists the newest address of a scope first, so
// each case adds a usable address and then one that must not win: a temporary
// (privacy) address, a deprecated, a tentative and a DAD-failed one; IPv4
// adds an address and a secondary of its subnet. A deprecated address, or one
// still in duplicate address detection, that is the only one is still the
// balancer's own.
func TestInterfaceAddrsSkipsUnusableSources(t *testing.T) {
	ns := addrsNS(t)
	cases := []struct {
		name string
		// sysctls are written for the link under test before its addresses are
		// added, peer's addresses before its own.
		sysctls     map[string]string
		peer, addrs []*netlink.Addr
		// flag is what the kernel must have set on some address of the link
		// before the check means anything.
		flag int
		want netip.Addr
	}{
		{name: "temporary", sysctls: map[string]string{"net/ipv6/conf/%s/use_tempaddr": "2"},
			addrs: []*netlink.Addr{addr("2001:db8:1::1/64", unix.IFA_F_NODAD, 0, 0),
				// The kernel makes a temporary address of a mngtmpaddr one's prefix.
				addr("2001:db8:2::1/64", unix.IFA_F_NODAD|unix.IFA_F_MANAGETEMPADDR, 2000, 3000)},
			flag: unix.IFA_F_TEMPORARY, want: netip.MustParseAddr("2001:db8:2::1")},
		{name: "deprecated",
			addrs: []*netlink.Addr{addr("2001:db8:1::1/64", unix.IFA_F_NODAD, 0, 0),
				addr("2001:db8:2::1/64", unix.IFA_F_NODAD, 0, 3000)},
			flag: unix.IFA_F_DEPRECATED, want: netip.MustParseAddr("2001:db8:1::1")},
		{name: "deprecated only",
			// All there is, so the kernel sends from it, and so does nat.
			addrs: []*netlink.Addr{addr("2001:db8:2::1/64", unix.IFA_F_NODAD, 0, 3000)},
			flag:  unix.IFA_F_DEPRECATED, want: netip.MustParseAddr("2001:db8:2::1")},
		{name: "tentative",
			// DAD sends its one probe, then waits a retransmission time before the
			// address is usable: an hour here.
			sysctls: map[string]string{"net/ipv6/conf/%s/dad_transmits": "1", "net/ipv6/neigh/%s/retrans_time_ms": "3600000"},
			addrs: []*netlink.Addr{addr("2001:db8:1::1/64", unix.IFA_F_NODAD, 0, 0),
				addr("2001:db8:2::1/64", 0, 0, 0)},
			flag: unix.IFA_F_TENTATIVE, want: netip.MustParseAddr("2001:db8:1::1")},
		{name: "tentative only",
			// It will be usable in a moment; the agent reads it once.
			sysctls: map[string]string{"net/ipv6/conf/%s/dad_transmits": "1", "net/ipv6/neigh/%s/retrans_time_ms": "3600000"},
			addrs:   []*netlink.Addr{addr("2001:db8:2::1/64", 0, 0, 0)},
			flag:    unix.IFA_F_TENTATIVE, want: netip.MustParseAddr("2001:db8:2::1")},
		{name: "dadfailed",
			// The peer holds the address already and answers the probe.
			peer: []*netlink.Addr{addr("2001:db8:2::1/64", unix.IFA_F_NODAD, 0, 0)},
			addrs: []*netlink.Addr{addr("2001:db8:1::1/64", unix.IFA_F_NODAD, 0, 0),
				addr("2001:db8:2::1/64", 0, 0, 0)},
			flag: unix.IFA_F_DADFAILED, want: netip.MustParseAddr("2001:db8:1::1")},
		{name: "secondary",
			addrs: []*netlink.Addr{addr("10.9.0.1/24", 0, 0, 0), addr("10.9.0.2/24", 0, 0, 0)},
			flag:  unix.IFA_F_SECONDARY, want: netip.MustParseAddr("10.9.0.1")},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			link, peer := fmt.Sprintf("ia%d", i), fmt.Sprintf("ib%d", i)
			if err := ns.Do(func() error { return addVeth(link, peer, tc.sysctls, tc.peer, tc.addrs) }); err != nil {
				t.Fatal(err)
			}
			// The kernel sets temporary and DAD-failed addresses up after it
			// returns; wait for the flag the case is about.
			var got []netip.Addr
			deadline := time.Now().Add(30 * time.Second)
			for {
				var flagged bool
				err := ns.Do(func() error {
					nl, err := netlink.LinkByName(link)
					if err != nil {
						return err
					}
					list, err := netlink.AddrList(nl, unix.AF_UNSPEC)
					if err != nil {
						return err
					}
					flagged = slices.ContainsFunc(list, func(a netlink.Addr) bool { return a.Flags&tc.flag != 0 })
					got, err = interfaceAddrs(context.Background(), link, 0)
					return err
				})
				if err != nil {
					t.Fatal(err)
				}
				if flagged {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("no address of %s has flag %#x after 30s", link, tc.flag)
				}
				time.Sleep(20 * time.Millisecond)
			}
			if !slices.Contains(got, tc.want) || len(got) != 1 {
				t.Errorf("interfaceAddrs(%s) = %v; want [%s]", link, got, tc.want)
			}
		})
	}
}

// addrsNS is a namespace of its own for a test of the node's own address.
func addrsNS(t *testing.T) *netns.NS {
	t.Helper()
	ns, err := netns.New(topo.UniqueName("wia"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	return ns
}

// addr is an address to add, with its flags and lifetimes (0: for ever).
func addr(s string, flags, preferred, valid int) *netlink.Addr {
	p := netip.MustParsePrefix(s)
	return &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())},
		Flags: flags, PreferedLft: preferred, ValidLft: valid}
}

// addVeth adds the veth pair link and peer, both up, in the calling thread's
// namespace; writes sysctls ("%s" is link) before any address is added; then
// adds peerAddrs to peer and addrs to link.
func addVeth(link, peer string, sysctls map[string]string, peerAddrs, addrs []*netlink.Addr) error {
	return addVethUp(link, peer, []string{peer, link}, sysctls, peerAddrs, addrs)
}

// addVethUp is addVeth with only the ends named in up set up.
func addVethUp(link, peer string, up []string, sysctls map[string]string, peerAddrs, addrs []*netlink.Addr) error {
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: link}, PeerName: peer}); err != nil {
		return fmt.Errorf("add veth %s: %w", link, err)
	}
	for _, name := range up {
		if err := setUp(name); err != nil {
			return err
		}
	}
	for k, v := range sysctls {
		if err := os.WriteFile("/proc/sys/"+fmt.Sprintf(k, link), []byte(v), 0); err != nil {
			return err
		}
	}
	for _, l := range []struct {
		name  string
		addrs []*netlink.Addr
	}{{peer, peerAddrs}, {link, addrs}} {
		if err := addAddrs(l.name, l.addrs...); err != nil {
			return err
		}
	}
	return nil
}

// setUp sets link name up.
func setUp(name string) error {
	if err := netlink.LinkSetUp(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}}); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}

// addAddrs adds addrs to link name.
func addAddrs(name string, addrs ...*netlink.Addr) error {
	nl, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	for _, a := range addrs {
		if err := netlink.AddrAdd(nl, a); err != nil {
			return fmt.Errorf("add %s to %s: %w", a.IPNet, name, err)
		}
	}
	return nil
}

// TestInterfaceAddrsWaitsForDAD: the agent reads its own address once, at
// start; where the only one is still in duplicate address detection it waits
// for DAD to end, so it takes the address once DAD has passed, and none once
// DAD fails because another host holds it, rather than keeping for its whole
// run an address that is not its own. Beside a deprecated address (a prefix
// being renumbered away) it waits too, and takes the new one once preferred.
// It waits as well on a link that is up but has no carrier yet when the agent
// starts (a NIC still negotiating, a veth whose peer comes up a moment later),
// whose DAD runs once the carrier comes.
func TestInterfaceAddrsWaitsForDAD(t *testing.T) {
	ns := addrsNS(t)
	own := netip.MustParseAddr("2001:db8:2::1")
	for i, tc := range []struct {
		name string
		// retransMs is the link's wait after its DAD probe; a peer that holds
		// the address answers the probe.
		retransMs int
		peer      []*netlink.Addr
		// old is an address the link has before own.
		old *netlink.Addr
		// lateCarrier: the peer is down as the addresses are added, and comes
		// up once interfaceAddrs has begun.
		lateCarrier bool
		want        []netip.Addr
	}{
		{name: "passes", retransMs: 1500, want: []netip.Addr{own}},
		{name: "fails", retransMs: 3600000, peer: []*netlink.Addr{addr(own.String()+"/64", unix.IFA_F_NODAD, 0, 0)}},
		{name: "passes beside a deprecated one", retransMs: 1500, old: addr("2001:db8:1::1/64", unix.IFA_F_NODAD, 0, 3000), want: []netip.Addr{own}},
		{name: "late carrier, fails", retransMs: 3600000, peer: []*netlink.Addr{addr(own.String()+"/64", unix.IFA_F_NODAD, 0, 0)}, lateCarrier: true},
		{name: "late carrier, passes beside a deprecated one", retransMs: 1500, old: addr("2001:db8:1::1/64", unix.IFA_F_NODAD, 0, 3000), lateCarrier: true, want: []netip.Addr{own}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			link, peer := fmt.Sprintf("da%d", i), fmt.Sprintf("db%d", i)
			// The probe goes after a random delay of up to 2s, so the address
			// is still in DAD when read.
			sysctls := map[string]string{"net/ipv6/conf/%s/dad_transmits": "1",
				"net/ipv6/conf/%s/router_solicitation_delay": "2",
				"net/ipv6/neigh/%s/retrans_time_ms":          fmt.Sprint(tc.retransMs)}
			var got []netip.Addr
			var flags int
			err := ns.Do(func() error {
				addrs := []*netlink.Addr{addr(own.String()+"/64", 0, 0, 0)}
				if tc.old != nil {
					addrs = []*netlink.Addr{tc.old, addrs[0]}
				}
				up := []string{peer, link}
				if tc.lateCarrier {
					up = []string{link}
				}
				if err := addVethUp(link, peer, up, sysctls, tc.peer, addrs); err != nil {
					return err
				}
				carrier := make(chan error, 1)
				if tc.lateCarrier {
					// Exits once the peer is up, 200ms after interfaceAddrs
					// began; received from below.
					go func() {
						time.Sleep(200 * time.Millisecond)
						carrier <- ns.Do(func() error { return setUp(peer) })
					}()
				} else {
					carrier <- nil
				}
				var err error
				got, err = interfaceAddrs(context.Background(), link, 30*time.Second)
				if err := <-carrier; err != nil {
					return err
				}
				if err != nil {
					return err
				}
				// The flags the address has as it is returned.
				flags, err = addrFlags(link, own)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tc.want) || len(got) > 0 && flags&unix.IFA_F_TENTATIVE != 0 {
				t.Errorf("interfaceAddrs(%s) = %v, the address's flags %#x; want %v, out of DAD", link, got, flags, tc.want)
			}
		})
	}
}

// TestInterfaceAddrsWaitEndsWithCtx: an agent told to stop as it starts does
// not wait out dadWait for its own address to end DAD: once ctx is done it
// takes the address as it is.
func TestInterfaceAddrsWaitEndsWithCtx(t *testing.T) {
	ns := addrsNS(t)
	own := netip.MustParseAddr("2001:db8:2::1")
	// DAD sends its one probe, then waits an hour before the address is usable.
	sysctls := map[string]string{"net/ipv6/conf/%s/dad_transmits": "1", "net/ipv6/neigh/%s/retrans_time_ms": "3600000"}
	if err := ns.Do(func() error {
		return addVeth("ca0", "cb0", sysctls, nil, []*netlink.Addr{addr(own.String()+"/64", 0, 0, 0)})
	}); err != nil {
		t.Fatal(err)
	}
	// Done once the wait is under way, not before it.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	t.Cleanup(cancel)
	var got []netip.Addr
	var flags int
	start := time.Now()
	err := ns.Do(func() (err error) {
		if got, err = interfaceAddrs(ctx, "ca0", dadWait); err != nil {
			return err
		}
		flags, err = addrFlags("ca0", own)
		return err
	})
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []netip.Addr{own}) || flags&unix.IFA_F_TENTATIVE == 0 {
		t.Errorf("interfaceAddrs(ca0) = %v, the address's flags %#x; want [%s], still in DAD", got, flags, own)
	}
	// Well within dadWait, with room for a loaded machine.
	if took >= dadWait*2/3 {
		t.Errorf("interfaceAddrs returned %v after start, ctx done after 100ms; want it to stop waiting then, well before dadWait (%v)", took, dadWait)
	}
}

// addrFlags returns the flags of address ip on link name (0: it has none).
func addrFlags(name string, ip netip.Addr) (int, error) {
	nl, err := netlink.LinkByName(name)
	if err != nil {
		return 0, err
	}
	list, err := netlink.AddrList(nl, unix.AF_UNSPEC)
	for _, a := range list {
		if a.IP.Equal(ip.AsSlice()) {
			return a.Flags, err
		}
	}
	return 0, err
}

// TestInterfaceAddrsNoWaitOnDownLink: duplicate address detection does not
// run on a link that is administratively down (its IPv6 addresses stay
// tentative until it is set up), so the agent, reading its own addresses at
// start, does not wait dadWait there for DAD to end: it takes them as they are
// at once. The link is a veth that is down, its peer up.
func TestInterfaceAddrsNoWaitOnDownLink(t *testing.T) {
	ns := addrsNS(t)
	own := netip.MustParseAddr("2001:db8:2::1")
	own4 := netip.MustParseAddr("192.0.2.1")
	var got []netip.Addr
	var took time.Duration
	err := ns.Do(func() error {
		addrs := []*netlink.Addr{addr(own.String()+"/64", 0, 0, 0), addr(own4.String()+"/24", 0, 0, 0)}
		if err := addVethUp("na0", "nb0", []string{"nb0"}, nil, nil, addrs); err != nil {
			return err
		}
		start := time.Now()
		var err error
		got, err = interfaceAddrs(context.Background(), "na0", dadWait)
		took = time.Since(start)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []netip.Addr{own4, own}) {
		t.Errorf("interfaceAddrs(na0) = %v; want [%s %s]", got, own4, own)
	}
	// A bound on a wait that should not happen (dadWait is 3s), with room for
	// a loaded machine.
	if took >= time.Second {
		t.Errorf("interfaceAddrs(na0), the link down, returned after %v; want at once, not after waiting for DAD (up to %v)", took, dadWait)
	}
}
