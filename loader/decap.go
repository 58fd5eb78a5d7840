package loader

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bpf"
)

// Decap is weir's tunnel decapsulation program, for backends of tunnel-mode services
// on hosts without the kernel's ipip/ip6tnl modules. It strips the outer header of
// tunnel packets sent to one of the addresses it is given and passes the client's
// packet up the stack, which holds the VIP. It takes them from any source until
// SetSources names the balancers'.
type Decap struct {
	mu          sync.Mutex
	objs        bpf.DecapObjects
	addrs       []netip.Addr
	sources     map[bpf.DecapDecapSource]bool // what decap_sources holds
	attachments map[string]*attachment
	closed      bool
}

// LoadDecap loads the decapsulation program for tunnel packets to addrs.
func LoadDecap(addrs []netip.Addr) (*Decap, error) {
	d := &Decap{attachments: make(map[string]*attachment), sources: make(map[bpf.DecapDecapSource]bool)}
	if err := bpf.LoadDecapObjects(&d.objs, nil); err != nil {
		if errors.Is(err, unix.EPERM) {
			return nil, fmt.Errorf("load decap program: %w (run as root, or grant CAP_BPF and CAP_NET_ADMIN)", err)
		}
		return nil, fmt.Errorf("load decap program: %w", err)
	}
	if err := d.SetAddrs(addrs); err != nil {
		d.Close()
		return nil, err
	}
	if err := d.SetSources(nil); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// anySource is what SetSources holds for no prefixes: every address of both families.
var anySource = []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")}

// SetSources replaces the prefixes tunnel packets may come from (the balancers'
// addresses); a tunnel packet to us from anywhere else is dropped and counted
// Foreign. None: any source. It takes as many as decap_sources holds; a list it
// refuses (too long, or holding something that is not a prefix) leaves the one
// before in force.
func (d *Decap) SetSources(prefixes []netip.Prefix) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("decap: %w", net.ErrClosed)
	}
	if len(prefixes) == 0 {
		prefixes = anySource
	}
	want := make(map[bpf.DecapDecapSource]netip.Prefix, len(prefixes))
	for _, p := range prefixes {
		if !p.IsValid() || p.Addr().Is4In6() {
			return fmt.Errorf("decap source %s: want an IPv4 or IPv6 prefix", p)
		}
		p = p.Masked()
		want[bpf.DecapDecapSource{Prefixlen: 32 + uint32(p.Bits()), Family: uint32(family(p.Addr())), Addr: addrWords(p.Addr())}] = p
	}
	capacity := int(d.objs.DecapSources.MaxEntries())
	if len(want) > capacity {
		return fmt.Errorf("decap sources: %d prefixes, at most %d", len(want), capacity)
	}
	var stale []bpf.DecapDecapSource
	for key := range d.sources {
		if _, ok := want[key]; !ok {
			stale = append(stale, key)
		}
	}
	// New prefixes go in before stale ones go out, so no source that both lists let
	// in is refused meanwhile; but when the two lists together would not fit the
	// trie, the stale ones go first.
	deleteStale := func() {
		for _, key := range stale {
			if err := d.objs.DecapSources.Delete(key); err == nil || errors.Is(err, ebpf.ErrKeyNotExist) {
				delete(d.sources, key)
			}
		}
	}
	if len(want)+len(stale) > capacity {
		deleteStale()
	}
	for key, p := range want {
		if err := d.objs.DecapSources.Put(key, uint8(1)); err != nil {
			return fmt.Errorf("decap source %s: %w", p, err)
		}
		d.sources[key] = true
	}
	deleteStale()
	return nil
}

// SetAddrs replaces the addresses whose tunnel packets are decapsulated.
func (d *Decap) SetAddrs(addrs []netip.Addr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("decap: %w", net.ErrClosed)
	}
	want := make(map[netip.Addr]bool, len(addrs))
	for _, a := range addrs {
		if !a.IsValid() || a.Is4In6() {
			return fmt.Errorf("decap address %s: want an IPv4 or IPv6 address", a)
		}
		want[a] = true
		key := bpf.DecapDecapKey{Addr: addrWords(a), Family: uint32(family(a))}
		if err := d.objs.DecapAddrs.Put(key, uint8(1)); err != nil {
			return fmt.Errorf("decap address %s: %w", a, err)
		}
	}
	for _, a := range d.addrs {
		if !want[a] {
			_ = d.objs.DecapAddrs.Delete(bpf.DecapDecapKey{Addr: addrWords(a), Family: uint32(family(a))})
		}
	}
	d.addrs = append([]netip.Addr(nil), addrs...)
	return nil
}

// Attach attaches the program to an interface of this (backend) host, looked up in
// the calling thread's network namespace, and returns the mode it got.
func (d *Decap) Attach(ifname string, mode Mode) (Mode, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return "", fmt.Errorf("attach decap to %s: %w", ifname, net.ErrClosed)
	}
	if _, ok := d.attachments[ifname]; ok {
		return "", fmt.Errorf("attach decap to %s: already attached", ifname)
	}
	a, err := attachXDP(d.objs.WeirDecap, ifname, mode)
	if err != nil {
		return "", err
	}
	d.attachments[ifname] = a
	return a.mode, nil
}

// DecapStats counts what the decapsulation program did.
type DecapStats struct {
	Decapsulated Counter // outer header removed, passed up
	NotOurs      Counter // not a tunnel packet to one of our addresses, passed untouched
	Malformed    Counter // a tunnel packet to us whose headers or lengths do not hold together, dropped
	Foreign      Counter // a tunnel packet to us from outside the sources SetSources gave, dropped
}

// Stats reads the program's counters.
func (d *Decap) Stats() (DecapStats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return DecapStats{}, fmt.Errorf("decap: %w", net.ErrClosed)
	}
	var st DecapStats
	for reason, dst := range map[bpf.DecapDecapReason]*Counter{
		bpf.DecapDecapReasonDECAP_OK:        &st.Decapsulated,
		bpf.DecapDecapReasonDECAP_NOT_OURS:  &st.NotOurs,
		bpf.DecapDecapReasonDECAP_MALFORMED: &st.Malformed,
		bpf.DecapDecapReasonDECAP_FOREIGN:   &st.Foreign,
	} {
		var perCPU []bpf.DecapDecapCounter
		if err := d.objs.DecapStats.Lookup(uint32(reason), &perCPU); err != nil {
			return DecapStats{}, fmt.Errorf("read decap counters: %w", err)
		}
		for _, v := range perCPU {
			dst.Packets += v.Packets
			dst.Bytes += v.Bytes
		}
	}
	return st, nil
}

// Close detaches the program everywhere, then releases it. It is idempotent.
func (d *Decap) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	var errs []error
	for name, a := range d.attachments {
		if err := a.link.Close(); err != nil {
			errs = append(errs, fmt.Errorf("detach decap from %s: %w", name, err))
		}
	}
	d.attachments = nil
	if err := d.objs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close decap objects: %w", err))
	}
	return errors.Join(errs...)
}
