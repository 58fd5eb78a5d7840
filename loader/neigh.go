package loader

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// keepNextHops asks the kernel to keep resolved the neighbour that each nat or tunnel
// backend is reached through (the backend itself, or the gateway of its route), as a
// managed neighbour entry (Linux 5.16+: the kernel resolves it and keeps it
// reachable without traffic). bpf_fib_lookup then finds it, and no packet has to wait
// in the kernel for resolution — which for IPv6 would not even work, since the
// kernel refuses to forward a packet carrying its own source address.
//
// It works in the network namespace of the first Attach, whatever thread calls it,
// and is best effort: an existing entry (static, or already resolved) is left as it
// is, and a backend without a route is left to the program, which counts its packets
// as drop_no_route.
func (p *Program) keepNextHops(s Service) error {
	if s.Forwarding == ForwardDSR || p.ns == nil {
		return nil
	}
	h, err := netlink.NewHandleAt(*p.ns)
	if err != nil {
		return fmt.Errorf("keep next hops resolved: %w", err)
	}
	defer h.Close()
	var errs []error
	for _, b := range s.Backends {
		ip := b.Addr.Addr()
		routes, err := h.RouteGet(ip.AsSlice())
		if err != nil || len(routes) == 0 {
			errs = append(errs, fmt.Errorf("backend %s: no route: %w", b.Addr, err))
			continue
		}
		hop := routes[0].Gw
		if hop == nil {
			hop = ip.AsSlice()
		}
		fam := netlink.FAMILY_V4
		if ip.Is6() {
			fam = netlink.FAMILY_V6
		}
		n := &netlink.Neigh{LinkIndex: routes[0].LinkIndex, Family: fam, IP: hop,
			State: netlink.NUD_NONE, FlagsExt: netlink.NTF_EXT_MANAGED}
		if err := h.NeighAdd(n); err != nil && !errors.Is(err, unix.EEXIST) {
			errs = append(errs, fmt.Errorf("backend %s: managed neighbour %s: %w", b.Addr, hop, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("keep next hops resolved: %w", errors.Join(errs...))
	}
	return nil
}

// rememberNamespace keeps a handle on the calling thread's network namespace, where
// the program was first attached, for the neighbour work above.
func (p *Program) rememberNamespace() {
	if p.ns != nil {
		return
	}
	if h, err := netns.Get(); err == nil {
		p.ns = &h
	}
}
