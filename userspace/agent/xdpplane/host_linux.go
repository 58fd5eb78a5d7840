package xdpplane

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Capabilities the XDP data plane needs (linux/capability.h).
const (
	capNetAdmin = 12
	capSysAdmin = 21
	capBPF      = 39
)

// checkPrivileges reports, with the fix, a process that cannot load and attach XDP.
func checkPrivileges() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("check privileges: capget: %w", err)
	}
	has := func(c uint) bool { return data[c/32].Effective&(1<<(c%32)) != 0 }
	var missing []string
	if !has(capBPF) && !has(capSysAdmin) {
		missing = append(missing, "CAP_BPF")
	}
	if !has(capNetAdmin) {
		missing = append(missing, "CAP_NET_ADMIN")
	}
	if len(missing) > 0 {
		return fmt.Errorf("check privileges: missing %v: run weir as root, or grant CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN (for bpffs); or, where no service needs XDP (data_plane xdp, udp), run without it (weir run --no-xdp): %w", missing, unix.EPERM)
	}
	return nil
}

// ensureBPFFS makes sure dir (the pin directory) lies on a bpf filesystem and
// exists. If it does not: under /sys/fs/bpf it mounts one on /sys/fs/bpf (where
// systems keep it); elsewhere on dir itself.
func ensureBPFFS(dir string) error {
	const root = "/sys/fs/bpf"
	if onBPFFS(dir) {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("create pin directory %s: %w", dir, err)
		}
		return nil
	}
	mountAt := dir
	if dir == root || strings.HasPrefix(dir, root+"/") {
		mountAt = root
	}
	if !onBPFFS(mountAt) {
		if err := os.MkdirAll(mountAt, 0o700); err != nil {
			return fmt.Errorf("mount bpffs on %s: %w", mountAt, err)
		}
		if err := unix.Mount("bpffs", mountAt, "bpf", 0, "mode=0700"); err != nil {
			return fmt.Errorf("mount bpffs on %s: %w (mount it yourself: mount -t bpf bpffs %s)", mountAt, err, mountAt)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create pin directory %s: %w", dir, err)
	}
	if !onBPFFS(dir) {
		return fmt.Errorf("pin directory %s is not on a bpffs mount: set xdp.pin_path under %s", dir, root)
	}
	return nil
}

// onBPFFS reports whether path exists on a bpf filesystem, or does not exist and its
// nearest existing parent is one (so MkdirAll creates it there).
func onBPFFS(path string) bool {
	for p := path; ; p = filepath.Dir(p) {
		var st unix.Statfs_t
		err := unix.Statfs(p, &st)
		if err == nil {
			return st.Type == unix.BPF_FS_MAGIC
		}
		if !errors.Is(err, unix.ENOENT) || p == "/" {
			return false
		}
	}
}

// errNeighbourPending says resolution was started and the MAC is not known yet.
var errNeighbourPending = errors.New("neighbour resolution pending")

// resolveMAC returns the Ethernet address of an on-link backend from the
// neighbour table, after checking that it is reached directly (no gateway)
// through one of the XDP interfaces. If the table has no valid entry it asks the
// kernel to resolve the address (NTF_USE, as `ip neigh replace ... use` does) and
// returns an error wrapping errNeighbourPending; a later call finds the answer.
func resolveMAC(ip netip.Addr, xdpLinks map[int]string) (net.HardwareAddr, error) {
	routes, err := netlink.RouteGet(ip.AsSlice())
	if err != nil || len(routes) == 0 {
		return nil, fmt.Errorf("no route to %s: %w", ip, err)
	}
	r := routes[0]
	if r.Gw != nil {
		return nil, fmt.Errorf("%s is reached through the gateway %s, but dsr needs backends on a segment of the balancer's interface", ip, r.Gw)
	}
	name, ok := xdpLinks[r.LinkIndex]
	if !ok {
		l, _ := netlink.LinkByIndex(r.LinkIndex)
		ifname := fmt.Sprint(r.LinkIndex)
		if l != nil {
			ifname = l.Attrs().Name
		}
		return nil, fmt.Errorf("%s is reached through %s, which is not in interfaces: XDP_TX can only send out of the interface the packet came in on", ip, ifname)
	}
	fam := unix.AF_INET
	if ip.Is6() {
		fam = unix.AF_INET6
	}
	neighs, err := netlink.NeighList(r.LinkIndex, fam)
	if err != nil {
		return nil, fmt.Errorf("list neighbours on %s: %w", name, err)
	}
	const valid = netlink.NUD_REACHABLE | netlink.NUD_STALE | netlink.NUD_DELAY | netlink.NUD_PROBE | netlink.NUD_PERMANENT | netlink.NUD_NOARP
	for _, n := range neighs {
		if a, ok := netip.AddrFromSlice(n.IP); ok && a.Unmap() == ip && n.State&valid != 0 && len(n.HardwareAddr) == 6 {
			return n.HardwareAddr, nil
		}
	}
	err = netlink.NeighSet(&netlink.Neigh{LinkIndex: r.LinkIndex, Family: fam, IP: ip.AsSlice(), State: netlink.NUD_NONE, Flags: netlink.NTF_USE})
	if err != nil {
		return nil, fmt.Errorf("%s on %s: no neighbour entry, and asking the kernel to resolve it failed: %w", ip, name, err)
	}
	return nil, fmt.Errorf("%s on %s: %w (the kernel is sending ARP/ND; if this persists the backend is unreachable)", ip, name, errNeighbourPending)
}

// notSource are the address flags of an address that is never the balancer's
// own: a temporary (privacy) IPv6 address goes away after its lifetime (the
// public address it was made from is there too), a DAD-failed one belongs to
// another host, and an IPv4 secondary is only an alias of its subnet's
// primary, which the same list holds (the kernel's IFA_F_SECONDARY is
// IFA_F_TEMPORARY's bit, named for IPv4).
const notSource = unix.IFA_F_TEMPORARY | unix.IFA_F_DADFAILED | unix.IFA_F_SECONDARY

// sourceRank orders the other addresses, the first choice lowest: a preferred
// one; a deprecated one, which the kernel's source selection avoids while
// another is preferred (RFC 6724 rule 3) and uses when it is all there is (RFC
// 4862 5.5.4 keeps it usable); one still in duplicate address detection, which
// the kernel sends from once DAD passes, a second or so after it was added:
// the agent reads its own address once, at start, which may be that second
// after the network came up.
func sourceRank(flags int) int {
	switch {
	case flags&unix.IFA_F_TENTATIVE != 0:
		return 2
	case flags&unix.IFA_F_DEPRECATED != 0:
		return 1
	}
	return 0
}

// dadWait is how long the agent, choosing its own address at start, waits for
// duplicate address detection to end on the address it would take: the
// kernel's default DAD, one probe a second after a random delay of up to a
// second, is over in 2s.
const dadWait = 3 * time.Second

// interfaceAddrs returns the global unicast address of each family on a link
// that may be a source (see notSource) and ranks first (sourceRank), the first
// listed of that rank. Where a family has no preferred address but one still
// in duplicate address detection, it waits, up to wait, for DAD to end, and
// chooses again: such an address is then taken once DAD passes (before a
// deprecated one), never once it fails (another host holds it), and still in
// DAD only when DAD outlasts wait and nothing else is there. It waits no
// longer once ctx is done (the agent stops as it starts): it chooses from the
// addresses as they are then. Nor does it wait on a link that is
// administratively down, where DAD does not run (see sourceAddrs).
func interfaceAddrs(ctx context.Context, ifname string, wait time.Duration) ([]netip.Addr, error) {
	deadline := time.Now().Add(wait)
	for {
		addrs, tentative, err := sourceAddrs(ifname)
		if err != nil || !tentative || !time.Now().Before(deadline) || ctx.Err() != nil {
			return addrs, err
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// sourceAddrs is interfaceAddrs as the link's addresses are now; tentative
// says whether a family has no preferred address but one still in duplicate
// address detection, and the link is up. On a link that is down the kernel
// keeps the address tentative, running no DAD, until someone sets it up. A
// link that is up runs DAD, or will once it has carrier: a NIC still
// negotiating its link, a bond or a veth whose peer comes up a moment later
// has none yet, and a link that lost its carrier after coming up goes on with
// DAD. Waiting there takes the address DAD passes over a deprecated one, and
// never one that fails DAD, as on a link with carrier; on a link that stays
// without carrier it only costs the wait.
func sourceAddrs(ifname string) (out []netip.Addr, tentative bool, err error) {
	l, err := netlink.LinkByName(ifname)
	if err != nil {
		return nil, false, fmt.Errorf("interface %s: %w", ifname, err)
	}
	dad := l.Attrs().RawFlags&unix.IFF_UP != 0
	addrs, err := netlink.AddrList(l, unix.AF_UNSPEC)
	if err != nil {
		return nil, false, fmt.Errorf("interface %s: list addresses: %w", ifname, err)
	}
	var best [2]netip.Addr // IPv4, IPv6
	var rank [2]int
	var inDAD [2]bool
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok || !ip.Unmap().IsGlobalUnicast() || a.Flags&notSource != 0 {
			continue
		}
		ip = ip.Unmap()
		f := 0
		if ip.Is6() {
			f = 1
		}
		inDAD[f] = inDAD[f] || a.Flags&unix.IFA_F_TENTATIVE != 0
		if r := sourceRank(a.Flags); !best[f].IsValid() || r < rank[f] {
			best[f], rank[f] = ip, r
		}
	}
	for f, ip := range best {
		if ip.IsValid() {
			out = append(out, ip)
			tentative = tentative || dad && inDAD[f] && rank[f] > 0
		}
	}
	return out, tentative, nil
}
