package main

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// The two namespaces: the runner's (the checker) and the listener's (the
// backends), joined by a veth pair; the listener's namespace holds all of
// backendNet as local addresses (a local route on lo, "AnyIP").
var (
	checkerAddr = netip.MustParsePrefix("192.168.77.1/30")
	backendAddr = netip.MustParsePrefix("192.168.77.2/30")
	backendNet  = netip.MustParsePrefix("10.0.0.0/8")
)

type topology struct {
	src  netip.Addr
	napi []int // pids of the veths' threaded NAPI kthreads
}

// setupNet joins the runner's namespace to the listener's (that of pid). The
// veth devices get GRO on and threaded NAPI, so each receive runs in a kthread
// of its own, not in the softirq of whichever process sent the packet: the
// checker is not charged for the backends' kernel work, nor they for its.
func setupNet(pid int) (*topology, error) {
	// A sysfs of this network namespace, in this process's own mount
	// namespace, for /sys/class/net/*/threaded.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return nil, fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount("sysfs", "/sys", "sysfs", 0, ""); err != nil {
		return nil, fmt.Errorf("mount sysfs: %w", err)
	}
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return nil, err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return nil, fmt.Errorf("set lo up: %w", err)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "hc0"}, PeerName: "hc1"}
	if err := netlink.LinkAdd(veth); err != nil {
		return nil, fmt.Errorf("add veth: %w", err)
	}
	for _, name := range []string{"hc0", "hc1"} {
		// veth has NAPI (and so can thread it) only when up with GRO on.
		l, err := netlink.LinkByName(name)
		if err != nil {
			return nil, err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return nil, fmt.Errorf("set %s up: %w", name, err)
		}
		if err := ethtoolSet(name, 0x2c /* ETHTOOL_SGRO */, 1); err != nil {
			return nil, err
		}
		// veth_xmit hands a packet to the peer's NAPI only if it could be
		// aggregated, which with TSO on the sender it never is (6.18,
		// veth_skb_is_eligible_for_gro); check traffic gains nothing from TSO.
		if err := ethtoolSet(name, 0x1f /* ETHTOOL_STSO */, 0); err != nil {
			return nil, err
		}
		if err := os.WriteFile("/sys/class/net/"+name+"/threaded", []byte("1\n"), 0o644); err != nil {
			return nil, fmt.Errorf("threaded napi on %s: %w", name, err)
		}
	}
	peer, err := netlink.LinkByName("hc1")
	if err != nil {
		return nil, err
	}
	if err := netlink.LinkSetNsPid(peer, pid); err != nil {
		return nil, fmt.Errorf("move hc1 to the listener: %w", err)
	}
	hc0, err := netlink.LinkByName("hc0")
	if err != nil {
		return nil, err
	}
	if err := netlink.AddrAdd(hc0, &netlink.Addr{IPNet: ipNet(checkerAddr)}); err != nil {
		return nil, fmt.Errorf("address hc0: %w", err)
	}
	if err := netlink.LinkSetUp(hc0); err != nil {
		return nil, fmt.Errorf("set hc0 up: %w", err)
	}
	if err := netlink.RouteAdd(&netlink.Route{Dst: ipNet(backendNet), Gw: backendAddr.Addr().AsSlice(), LinkIndex: hc0.Attrs().Index}); err != nil {
		return nil, fmt.Errorf("route backends: %w", err)
	}

	nsh, err := netns.GetFromPid(pid)
	if err != nil {
		return nil, fmt.Errorf("listener namespace: %w", err)
	}
	defer nsh.Close()
	h, err := netlink.NewHandleAt(nsh)
	if err != nil {
		return nil, fmt.Errorf("netlink in the listener namespace: %w", err)
	}
	defer h.Close()
	blo, err := h.LinkByName("lo")
	if err != nil {
		return nil, err
	}
	hc1, err := h.LinkByName("hc1")
	if err != nil {
		return nil, err
	}
	for _, step := range []func() error{
		func() error { return h.LinkSetUp(blo) },
		func() error { return h.AddrAdd(hc1, &netlink.Addr{IPNet: ipNet(backendAddr)}) },
		func() error { return h.LinkSetUp(hc1) },
		func() error {
			return h.RouteAdd(&netlink.Route{Dst: ipNet(backendNet), Type: unix.RTN_LOCAL, Table: unix.RT_TABLE_LOCAL,
				Scope: netlink.SCOPE_HOST, LinkIndex: blo.Attrs().Index})
		},
	} {
		if err := step(); err != nil {
			return nil, fmt.Errorf("set up the listener namespace: %w", err)
		}
	}
	t := &topology{src: checkerAddr.Addr()}
	// The kthreads start when the devices come up.
	for deadline := time.Now().Add(5 * time.Second); len(t.napi) < 2 && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		t.napi = napiThreads()
	}
	if len(t.napi) < 2 {
		return nil, fmt.Errorf("threaded napi: found %d kthreads for hc0 and hc1; want 2", len(t.napi))
	}
	return t, nil
}

// napiThreads finds the pids of the kthreads named napi/hc0-* and napi/hc1-*.
// Kernel threads are visible from every pid namespace we run in, and there is
// one pair per benchmark run, so a concurrent run's would also match; the
// machine-wide lock keeps runs apart.
func napiThreads() []int {
	var pids []int
	dirs, _ := filepath.Glob("/proc/[0-9]*/comm")
	for _, d := range dirs {
		b, err := os.ReadFile(d)
		if err != nil {
			continue
		}
		comm := strings.TrimSpace(string(b))
		if strings.HasPrefix(comm, "napi/hc0-") || strings.HasPrefix(comm, "napi/hc1-") {
			var pid int
			fmt.Sscanf(d, "/proc/%d/comm", &pid)
			pids = append(pids, pid)
		}
	}
	return pids
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// ethtoolSet runs one set-value SIOCETHTOOL command (struct ethtool_value).
func ethtoolSet(ifname string, cmd, data uint32) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("ethtool %s: %w", ifname, err)
	}
	defer unix.Close(fd)
	v := struct{ cmd, data uint32 }{cmd, data}
	var ifr struct {
		name [unix.IFNAMSIZ]byte
		data unsafe.Pointer
		_    [24 - unsafe.Sizeof(uintptr(0))]byte
	}
	copy(ifr.name[:], ifname)
	ifr.data = unsafe.Pointer(&v)
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
	runtime.KeepAlive(&ifr)
	runtime.KeepAlive(&v)
	if errno != 0 {
		return fmt.Errorf("ethtool %s: cmd %#x: %w", ifname, cmd, errno)
	}
	return nil
}

// listener accepts and closes TCP connections on one wildcard port and serves
// HTTP on another, kept alive, until its stdin closes.
func listener() error {
	raiseFileLimit()
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	hln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		return fmt.Errorf("listen http: %w", err)
	}
	fmt.Println(ln.Addr().(*net.TCPAddr).Port, hln.Addr().(*net.TCPAddr).Port)
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		// Exits when ln is closed below.
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "2")
		w.Write([]byte("ok"))
	}), ReadHeaderTimeout: 10 * time.Second}
	wg.Add(1)
	// Exits when srv is closed below.
	go func() {
		defer wg.Done()
		srv.Serve(hln)
	}()
	var b [1]byte
	os.Stdin.Read(b[:]) // EOF when the runner is done
	ln.Close()
	srv.Close()
	wg.Wait()
	return nil
}
