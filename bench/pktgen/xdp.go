package pktgen

import (
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"

	"github.com/weir-lb/weir/internal/netns"
)

// attachment is an XDP program attached through netlink to one link in one
// namespace (loader owns weir's links; the benchmark's own programs are held
// by the device, as internal/topo's are).
type attachment struct {
	ns     *netns.NS
	ifname string
	flags  int
}

// attach attaches prog to ifname inside ns, in native mode or, if generic,
// in the kernel's generic hook.
func attach(ns *netns.NS, ifname string, prog *ebpf.Program, generic bool) (*attachment, error) {
	flags := nl.XDP_FLAGS_DRV_MODE
	mode := "native"
	if generic {
		flags, mode = nl.XDP_FLAGS_SKB_MODE, "generic"
	}
	err := ns.Do(func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		return netlink.LinkSetXdpFdWithFlags(l, prog.FD(), flags)
	})
	if err != nil {
		return nil, fmt.Errorf("attach %s xdp to %s in %s: %w", mode, ifname, ns, err)
	}
	return &attachment{ns: ns, ifname: ifname, flags: flags}, nil
}

// detach removes the program; a link that is gone already is not an error.
func (a *attachment) detach() error {
	err := a.ns.Do(func() error {
		l, err := netlink.LinkByName(a.ifname)
		if _, ok := errors.AsType[netlink.LinkNotFoundError](err); ok {
			return nil
		}
		if err != nil {
			return err
		}
		return netlink.LinkSetXdpFdWithFlags(l, -1, a.flags)
	})
	if err != nil && !errors.Is(err, netns.ErrClosed) {
		return fmt.Errorf("detach xdp from %s in %s: %w", a.ifname, a.ns, err)
	}
	return nil
}

// Sink counts the frames arriving on one link and drops them (or passes
// them on). Its methods are safe for concurrent use.
type Sink struct {
	objs SinkObjects

	mu     sync.Mutex
	at     *attachment
	closed bool
}

// NewSink loads a sink. With pass it returns XDP_PASS after counting, so
// the frames go on to the kernel stack (tests check them through sockets).
func NewSink(pass bool) (*Sink, error) { return loadSink(pass, 0) }

// NewProbeSink loads a sink that counts and drops every frame except IPv4
// TCP frames from or to port, which it passes to the stack uncounted: the
// load is counted and dropped, latency probes to a service on port get
// through.
func NewProbeSink(port uint16) (*Sink, error) {
	if port == 0 {
		return nil, fmt.Errorf("load probe sink: port must be 1..65535, got 0")
	}
	return loadSink(false, port)
}

func loadSink(pass bool, port uint16) (*Sink, error) {
	spec, err := LoadSink()
	if err != nil {
		return nil, fmt.Errorf("load sink: %w", err)
	}
	if pass {
		if err := spec.Variables[SinkVarPass].Set(uint8(1)); err != nil {
			return nil, fmt.Errorf("load sink: %w", err)
		}
	}
	if port != 0 {
		// Network order, as the program compares it with the header.
		if err := spec.Variables[SinkVarPassPort].Set(port<<8 | port>>8); err != nil {
			return nil, fmt.Errorf("load sink: %w", err)
		}
	}
	s := &Sink{}
	if err := spec.LoadAndAssign(&s.objs, nil); err != nil {
		return nil, fmt.Errorf("load sink: %w", err)
	}
	return s, nil
}

// Attach attaches the sink in native mode to ifname inside ns. A sink
// counts on one link at a time.
func (s *Sink) Attach(ns *netns.NS, ifname string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.at != nil {
		return fmt.Errorf("attach sink to %s: sink closed or attached already", ifname)
	}
	at, err := attach(ns, ifname, s.objs.Sink, false)
	if err != nil {
		return err
	}
	s.at = at
	return nil
}

// Count returns the frames counted so far.
func (s *Sink) Count() (Counter, error) {
	var per []SinkCounter
	if err := s.objs.Counts.Lookup(uint32(0), &per); err != nil {
		return Counter{}, fmt.Errorf("sink: read counters: %w", err)
	}
	var c Counter
	for _, v := range per {
		c.Packets += v.Packets
		c.Bytes += v.Bytes
	}
	return c, nil
}

// Close detaches the sink, then releases it. It is idempotent.
func (s *Sink) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	var errs []error
	if s.at != nil {
		errs = append(errs, s.at.detach())
	}
	errs = append(errs, s.objs.Close())
	return errors.Join(errs...)
}

// Floor is the benchmark's yardstick forwarder, doing nothing but what any
// forwarder must: the XDP_TX floor swaps the frame's MACs and sends it back out,
// the path weir's dsr mode takes; the redirect floor writes a next hop's MACs
// and sends the frame out of another link through a devmap, the path weir's nat
// and tunnel modes take.
type Floor struct {
	objs FloorObjects
	out  string // the redirect floor's outgoing link; "" for the XDP_TX floor

	mu     sync.Mutex
	at     *attachment
	closed bool
}

// NewFloor loads the XDP_TX floor.
func NewFloor() (*Floor, error) {
	f := &Floor{}
	if err := LoadFloorObjects(&f.objs, nil); err != nil {
		return nil, fmt.Errorf("load floor: %w", err)
	}
	return f, nil
}

// NewRedirectFloor loads the redirect floor: frames leave by the link out
// (named in the namespace Attach is given) from srcMAC to dstMAC.
func NewRedirectFloor(out string, srcMAC, dstMAC net.HardwareAddr) (*Floor, error) {
	spec, err := LoadFloor()
	if err != nil {
		return nil, fmt.Errorf("load redirect floor: %w", err)
	}
	for name, mac := range map[string]net.HardwareAddr{FloorVarRedirectSmac: srcMAC, FloorVarRedirectDmac: dstMAC} {
		if len(mac) != 6 {
			return nil, fmt.Errorf("load redirect floor: %s must be a 6-byte Ethernet address, got %q", name, mac)
		}
		if err := spec.Variables[name].Set([6]byte(mac)); err != nil {
			return nil, fmt.Errorf("load redirect floor: set %s: %w", name, err)
		}
	}
	f := &Floor{out: out}
	if err := spec.LoadAndAssign(&f.objs, nil); err != nil {
		return nil, fmt.Errorf("load redirect floor: %w", err)
	}
	return f, nil
}

// Attach attaches the floor to ifname inside ns, natively or in the generic
// hook. The redirect floor's outgoing link is looked up in ns too.
func (f *Floor) Attach(ns *netns.NS, ifname string, generic bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed || f.at != nil {
		return fmt.Errorf("attach floor to %s: floor closed or attached already", ifname)
	}
	prog := f.objs.FloorTx
	if f.out != "" {
		prog = f.objs.FloorRedirect
		// A devmap resolves its ifindexes in the namespace of whoever
		// fills it.
		err := ns.Do(func() error {
			l, err := netlink.LinkByName(f.out)
			if err != nil {
				return err
			}
			return f.objs.OutPort.Put(uint32(0), uint32(l.Attrs().Index))
		})
		if err != nil {
			return fmt.Errorf("attach redirect floor: out link %s in %s: %w", f.out, ns, err)
		}
	}
	at, err := attach(ns, ifname, prog, generic)
	if err != nil {
		return err
	}
	f.at = at
	return nil
}

// Close detaches the floor, then releases it. It is idempotent.
func (f *Floor) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil
	}
	f.closed = true
	var errs []error
	if f.at != nil {
		errs = append(errs, f.at.detach())
	}
	errs = append(errs, f.objs.Close())
	return errors.Join(errs...)
}
