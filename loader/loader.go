// Package loader loads weir's XDP program, attaches it to interfaces and owns every
// one of its maps behind typed methods: nothing else in weir touches a BPF map.
package loader

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/userspace/balance"
)

// Defaults of Options, as bpf/consts.h (enum defaults) holds them: the committed
// object's table sizes and nat settings. Program.Sizes and Program.NAT report what a
// loaded program uses.
const (
	DefaultConntrackSize = uint32(bpf.WeirDefaultsDEFAULT_CONNTRACK_SIZE)
	DefaultHalfOpenSize  = uint32(bpf.WeirDefaultsDEFAULT_HALF_OPEN_SIZE)
	// MinHalfOpenSize is the least half-open size a ConntrackSize alone gives.
	MinHalfOpenSize   = uint32(bpf.WeirDefaultsMIN_HALF_OPEN_SIZE)
	DefaultNATPortMin = uint16(bpf.WeirDefaultsDEFAULT_NAT_PORT_MIN)
	DefaultNATPortMax = uint16(bpf.WeirDefaultsDEFAULT_NAT_PORT_MAX)
	DefaultTCPIdle    = time.Duration(bpf.WeirDefaultsDEFAULT_TCP_IDLE_S) * time.Second
	DefaultTCPClosing = time.Duration(bpf.WeirDefaultsDEFAULT_TCP_CLOSING_S) * time.Second
	DefaultUDPIdle    = time.Duration(bpf.WeirDefaultsDEFAULT_UDP_IDLE_S) * time.Second
	DefaultHalfOpen   = time.Duration(bpf.WeirDefaultsDEFAULT_HALF_OPEN_S) * time.Second
)

// Options are fixed for the life of a loaded program.
type Options struct {
	// HashSeed seeds the flow hash and the Maglev tables. Balancer nodes that share
	// traffic behind one router must use the same seed to pick the same backends.
	HashSeed uint32
	// ConntrackSize is how many established flows each connection table remembers;
	// 0 keeps the default (DefaultConntrackSize). There is a table per family
	// and kind (dsr and tunnel, nat) and a nat reverse table per family, all of this
	// size; the kernel allocates them whole at load (see docs/datapath.md for bytes
	// per entry).
	ConntrackSize uint32
	// HalfOpenSize is how many flows the half-open table remembers: flows whose
	// client has sent only a first packet (a SYN, a lone UDP datagram), the only ones
	// a spoofed-source flood makes. 0: a quarter of ConntrackSize (at least
	// MinHalfOpenSize), or DefaultHalfOpenSize with the default connection table.
	HalfOpenSize uint32
	// NewFlowRate limits the new flows each CPU records per second; 0: no limit. Over
	// it, a new nat flow is dropped (drop_flow_rate) and a new dsr or tunnel flow is
	// sent by the lookup table without being recorded (flow_untracked). NewFlowBurst
	// is how many flows may come at once above the rate (0: a tenth of a second's).
	NewFlowRate, NewFlowBurst uint32
	// PreviousTableWindow is how long a service's replaced lookup table stays
	// addressable after a change: a TCP packet that is not a SYN and that the
	// connection table does not know (a connection opened on another node that the
	// network moved here, or forgotten here) is sent by the previous generation's
	// pick while its backend is usable (flow_fallback). 0: no fallback. The
	// generation expires when ExpirePreviousTables runs past the window (the agent
	// calls it every second) or when the next change replaces it.
	PreviousTableWindow time.Duration
	// NAT is the source side of nat-mode services.
	NAT NATOptions
	// PinPath, a directory on a bpf filesystem (e.g. /sys/fs/bpf/weir), pins the maps
	// and links there so that the program outlives the process and the next Load
	// takes over without dropping flows (see pin.go). Empty: nothing is pinned.
	PinPath string
}

// NATOptions configure full NAT. A nat-mode service needs the address of its family.
type NATOptions struct {
	// Addr4 and Addr6 are the balancer's own addresses that nat flows leave from and
	// replies come back to.
	Addr4, Addr6 netip.Addr
	// PortMin..PortMax are the source ports handed out per (backend, protocol);
	// default DefaultNATPortMin..DefaultNATPortMax (10000..32767), clear of Linux's
	// ip_local_port_range (32768..60999), so the host's own connections to backends
	// (health checks) never collide.
	PortMin, PortMax uint16
	// Idle timeouts: established TCP (default DefaultTCPIdle, 15 min), TCP after an
	// RST or a FIN each way (DefaultTCPClosing, 10 s), UDP (DefaultUDPIdle, 30 s). A
	// FIN one way half-closes a flow, which keeps TCPIdle. An expired flow's port may
	// be reused.
	TCPIdle, TCPClosing, UDPIdle time.Duration
	// HalfOpen is how long a flow whose client has sent only its first packet keeps
	// its port and backend (default DefaultHalfOpen, 5 s); sooner if the backend's
	// port ring comes round to its port first.
	HalfOpen time.Duration
}

func (o *NATOptions) setVariables(spec *ebpf.CollectionSpec) error {
	if o.PortMin == 0 && o.PortMax == 0 {
		o.PortMin, o.PortMax = DefaultNATPortMin, DefaultNATPortMax
	}
	if o.PortMin == 0 || o.PortMin > o.PortMax {
		return fmt.Errorf("nat ports %d..%d: need 1 <= min <= max", o.PortMin, o.PortMax)
	}
	if o.Addr4.IsValid() && !o.Addr4.Is4() {
		return fmt.Errorf("nat addr4 %s: not an IPv4 address", o.Addr4)
	}
	if o.Addr6.IsValid() && (!o.Addr6.Is6() || o.Addr6.Is4In6()) {
		return fmt.Errorf("nat addr6 %s: not an IPv6 address", o.Addr6)
	}
	if o.TCPIdle == 0 {
		o.TCPIdle = DefaultTCPIdle
	}
	if o.TCPClosing == 0 {
		o.TCPClosing = DefaultTCPClosing
	}
	if o.UDPIdle == 0 {
		o.UDPIdle = DefaultUDPIdle
	}
	if o.HalfOpen == 0 {
		o.HalfOpen = DefaultHalfOpen
	}
	var a4 uint32
	var a6 [4]uint32
	if o.Addr4.IsValid() {
		a4 = addrWords(o.Addr4)[0]
	}
	if o.Addr6.IsValid() {
		a6 = addrWords(o.Addr6)
	}
	for name, v := range map[string]any{
		bpf.WeirVarNatAddr4:     a4,
		bpf.WeirVarNatAddr6:     a6,
		bpf.WeirVarNatPortMin:   o.PortMin,
		bpf.WeirVarNatPortMax:   o.PortMax,
		bpf.WeirVarTcpIdleNs:    uint64(o.TCPIdle),
		bpf.WeirVarTcpClosingNs: uint64(o.TCPClosing),
		bpf.WeirVarUdpIdleNs:    uint64(o.UDPIdle),
		bpf.WeirVarHalfOpenNs:   uint64(o.HalfOpen),
	} {
		if err := spec.Variables[name].Set(v); err != nil {
			return fmt.Errorf("set %s: %w", name, err)
		}
	}
	return nil
}

// setFlowLimit sets the program's new-flow rate limit: each new flow costs
// 1/NewFlowRate seconds of credit, and NewFlowBurst flows' worth may be drawn ahead.
func (o *Options) setFlowLimit(spec *ebpf.CollectionSpec) error {
	if o.NewFlowRate > 0 && o.NewFlowBurst == 0 {
		o.NewFlowBurst = max(o.NewFlowRate/10, 1)
	}
	interval, burst := o.flowLimitNs()
	for name, v := range map[string]uint64{
		bpf.WeirVarNewFlowIntervalNs: interval,
		bpf.WeirVarNewFlowBurstNs:    burst,
	} {
		if err := spec.Variables[name].Set(v); err != nil {
			return fmt.Errorf("set %s: %w", name, err)
		}
	}
	return nil
}

// flowLimitNs is the new-flow limit as the program holds it: the credit one flow
// costs and the credit that may be drawn ahead, in ns (0, 0: no limit).
func (o *Options) flowLimitNs() (interval, burst uint64) {
	if o.NewFlowRate == 0 {
		return 0, 0
	}
	interval = uint64(time.Second) / uint64(o.NewFlowRate)
	return interval, interval * uint64(o.NewFlowBurst)
}

// ObjectHash is the SHA-256 of the XDP object this binary loads (weir version).
func ObjectHash() string { return bpf.ObjectHash() }

// Program is weir's loaded XDP program with its maps. Its methods are safe for
// concurrent use.
type Program struct {
	mu          sync.Mutex
	opts        Options
	objs        bpf.WeirObjects
	innerSpec   *ebpf.MapSpec
	attachments map[string]*attachment
	services    map[ServiceKey]*serviceState
	vipRefs     map[netip.Addr]int
	serviceIDs  *slotQueue
	backendIDs  *slotQueue
	rings       *natRings       // each slot's nat port ring, one per backend and protocol
	ns          *netns.NsHandle // namespace of the first Attach, for neighbour entries
	nextHopErr  error           // the last keepNextHops failure, for NextHopError
	closed      bool
}

type attachment struct {
	link    link.Link
	mode    Mode
	ifindex int
}

type serviceState struct {
	id       uint32
	spec     Service
	slots    map[netip.AddrPort]uint32
	table    *ebpf.Map // the table packets use now
	previous *ebpf.Map // the generation it replaced; in prev_lookup_tables while prevSince is set
	// What each generation holds (tableSum: its slots, fingerprint: its backends'
	// identities; see fingerprint.go), when the current one was installed, and when
	// the previous one was replaced (zero: not addressable, or none).
	tableSum, prevSum      [sha256.Size]byte
	fingerprint, prevPrint string
	tableSince, prevSince  time.Time
}

// Load loads the program and creates its maps. It needs CAP_BPF and CAP_NET_ADMIN
// (or root).
func Load(opts Options) (_ *Program, err error) {
	spec, err := bpf.LoadWeir()
	if err != nil {
		return nil, fmt.Errorf("load xdp program: %w", err)
	}
	if err := spec.Variables[bpf.WeirVarHashSeed].Set(opts.HashSeed); err != nil {
		return nil, fmt.Errorf("load xdp program: set hash seed: %w", err)
	}
	if err := opts.NAT.setVariables(spec); err != nil {
		return nil, fmt.Errorf("load xdp program: %w", err)
	}
	if err := opts.setFlowLimit(spec); err != nil {
		return nil, fmt.Errorf("load xdp program: %w", err)
	}
	if opts.ConntrackSize > 0 {
		for _, name := range []string{bpf.WeirMapLbConntrack4, bpf.WeirMapLbConntrack6, bpf.WeirMapNatConntrack4,
			bpf.WeirMapNatConntrack6, bpf.WeirMapNatReverse4, bpf.WeirMapNatReverse6} {
			spec.Maps[name].MaxEntries = opts.ConntrackSize
		}
		if opts.HalfOpenSize == 0 {
			opts.HalfOpenSize = max(opts.ConntrackSize/4, MinHalfOpenSize)
		}
	}
	if opts.HalfOpenSize > 0 {
		for _, name := range []string{bpf.WeirMapLbHalfOpen4, bpf.WeirMapLbHalfOpen6, bpf.WeirMapNatHalfOpen4,
			bpf.WeirMapNatHalfOpen6, bpf.WeirMapNatHalfReverse4, bpf.WeirMapNatHalfReverse6} {
			spec.Maps[name].MaxEntries = opts.HalfOpenSize
		}
	}
	var adopting bool
	var loadOpts *ebpf.CollectionOptions
	if opts.PinPath != "" {
		if adopting, err = pinSetup(spec, opts.PinPath); err != nil {
			return nil, fmt.Errorf("load xdp program: %w", err)
		}
		loadOpts = &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: opts.PinPath}}
	}
	lookupTables := spec.Maps[bpf.WeirMapLookupTables]
	p := &Program{
		opts:        opts,
		innerSpec:   lookupTables.InnerMap.Copy(),
		attachments: make(map[string]*attachment),
		services:    make(map[ServiceKey]*serviceState),
		vipRefs:     make(map[netip.Addr]int),
		serviceIDs:  newSlotQueue(lookupTables.MaxEntries),
		backendIDs:  newSlotQueue(spec.Maps[bpf.WeirMapBackends].MaxEntries),
		rings:       newNATRings(spec.Maps[bpf.WeirMapNatCursor].MaxEntries),
	}
	if err := spec.LoadAndAssign(&p.objs, loadOpts); err != nil {
		switch {
		case errors.Is(err, unix.EPERM):
			return nil, fmt.Errorf("load xdp program: %w (run as root, or grant CAP_BPF and CAP_NET_ADMIN)", err)
		case errors.Is(err, ebpf.ErrMapIncompatible):
			return nil, fmt.Errorf("load xdp program: %w (the maps pinned in %s are from an incompatible version or settings; remove the directory to start afresh, dropping established flows)", err, opts.PinPath)
		}
		return nil, fmt.Errorf("load xdp program: %w", err)
	}
	if adopting {
		if err := p.adopt(); err != nil {
			p.objs.Close()
			return nil, fmt.Errorf("load xdp program: %w", err)
		}
	}
	return p, nil
}

// Mode is how a program is attached to an interface.
type Mode string

const (
	// ModeNative runs the program in the driver, before any socket buffer exists.
	ModeNative Mode = "native"
	// ModeGeneric runs it in the kernel's generic XDP hook: every driver, slower.
	ModeGeneric Mode = "generic"
	// ModeAuto tries native, then generic.
	ModeAuto Mode = "auto"
)

// ParseMode reads "native", "generic" or "auto".
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeNative, ModeGeneric, ModeAuto:
		return m, nil
	}
	return "", fmt.Errorf("attach mode %q: must be native, generic or auto", s)
}

// Attach attaches the program to the named interface and returns the mode it got.
// The interface is looked up in the calling thread's network namespace.
func (p *Program) Attach(ifname string, mode Mode) (Mode, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return "", fmt.Errorf("attach xdp to %s: %w", ifname, net.ErrClosed)
	}
	if _, ok := p.attachments[ifname]; ok {
		return "", fmt.Errorf("attach xdp to %s: already attached; detach it first", ifname)
	}
	var a *attachment
	if p.opts.PinPath != "" {
		iface, err := net.InterfaceByName(ifname)
		if err != nil {
			return "", fmt.Errorf("attach xdp to %s: %w (check the interface name and network namespace)", ifname, err)
		}
		adopted, ok, err := p.adoptLink(ifname, iface.Index)
		if err != nil {
			return "", fmt.Errorf("attach xdp to %s: %w", ifname, err)
		}
		a = adopted
		if !ok {
			if a, err = attachXDP(p.objs.WeirXdp, ifname, mode); err != nil {
				return "", err
			}
			if err := a.link.Pin(p.linkPin(ifname)); err != nil {
				a.link.Close()
				return "", fmt.Errorf("attach xdp to %s: pin link: %w", ifname, err)
			}
		}
	} else {
		var err error
		if a, err = attachXDP(p.objs.WeirXdp, ifname, mode); err != nil {
			return "", err
		}
	}
	// nat packets may leave by any interface the program is attached to.
	if err := p.objs.TxPorts.Put(uint32(a.ifindex), uint32(a.ifindex)); err != nil {
		a.link.Close()
		return "", fmt.Errorf("attach xdp to %s: add to tx_ports: %w", ifname, err)
	}
	p.attachments[ifname] = a
	p.rememberNamespace()
	// Services added before the first attach had no namespace to resolve in.
	for _, st := range p.services {
		p.nextHopErr = p.keepNextHops(st.spec)
	}
	return a.mode, nil
}

// NextHopError is the last failure to set up the neighbour entries of nat and tunnel
// backends' next hops (nil if none): such backends still work, but their first
// packets depend on the kernel's own resolution.
func (p *Program) NextHopError() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nextHopErr
}

// attachXDP attaches prog to ifname in mode (auto: native, then generic).
func attachXDP(prog *ebpf.Program, ifname string, mode Mode) (*attachment, error) {
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		return nil, fmt.Errorf("attach xdp to %s: %w (check the interface name and network namespace)", ifname, err)
	}
	var tries []Mode
	switch mode {
	case ModeNative, ModeGeneric:
		tries = []Mode{mode}
	case ModeAuto, "":
		tries = []Mode{ModeNative, ModeGeneric}
	default:
		return nil, fmt.Errorf("attach xdp to %s: mode %q: must be native, generic or auto", ifname, mode)
	}
	var errs []error
	for _, m := range tries {
		flags := link.XDPDriverMode
		if m == ModeGeneric {
			flags = link.XDPGenericMode
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: iface.Index, Flags: flags})
		if err == nil {
			return &attachment{link: l, mode: m, ifindex: iface.Index}, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", m, err))
	}
	err = errors.Join(errs...)
	if mode == ModeNative && errors.Is(err, unix.EOPNOTSUPP) {
		return nil, fmt.Errorf("attach xdp to %s: %w (the driver has no native XDP: use generic or auto)", ifname, err)
	}
	return nil, fmt.Errorf("attach xdp to %s: %w", ifname, err)
}

// Detach removes the program from the named interface.
func (p *Program) Detach(ifname string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	a, ok := p.attachments[ifname]
	if !ok {
		return fmt.Errorf("detach xdp from %s: not attached", ifname)
	}
	delete(p.attachments, ifname)
	_ = p.objs.TxPorts.Delete(uint32(a.ifindex))
	if p.opts.PinPath != "" {
		_ = a.link.Unpin()
	}
	if err := a.link.Close(); err != nil {
		return fmt.Errorf("detach xdp from %s: %w", ifname, err)
	}
	return nil
}

// Attachments returns the interfaces the program is attached to, with their modes.
func (p *Program) Attachments() map[string]Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]Mode, len(p.attachments))
	for name, a := range p.attachments {
		out[name] = a.mode
	}
	return out
}

// Close detaches the program from every interface, then releases the program and
// its maps. It is idempotent.
func (p *Program) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	var errs []error
	if p.opts.PinPath != "" {
		errs = append(errs, p.unpinAll())
	}
	return errors.Join(append(errs, p.closeHandles())...)
}

// closeHandles releases every handle the process holds, links first: an unpinned
// link detaches the program as it closes, a pinned one stays (Release). Called with
// p.mu held.
func (p *Program) closeHandles() error {
	p.closed = true
	var errs []error
	for name, a := range p.attachments {
		if err := a.link.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close link of %s: %w", name, err))
		}
	}
	p.attachments = nil
	for _, s := range p.services {
		s.closeTables()
	}
	if err := p.objs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close xdp objects: %w", err))
	}
	if p.ns != nil {
		p.ns.Close()
	}
	return errors.Join(errs...)
}

// AddService installs a new service with its backends and lookup table.
func (p *Program) AddService(s Service) error {
	if err := p.validate(&s); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return err
	}
	if _, ok := p.services[s.Key]; ok {
		return fmt.Errorf("add service %s: %w; update it instead", s.Key, ErrServiceExists)
	}
	id, ok := p.serviceIDs.take()
	if !ok {
		return fmt.Errorf("add service %s: all %d service slots in use: %w", s.Key, p.serviceIDs.capacity, ErrCapacity)
	}
	st := &serviceState{id: id, slots: make(map[netip.AddrPort]uint32)}
	if err := p.zeroCounters(p.objs.ServiceStats, id); err != nil {
		p.serviceIDs.give(id)
		return fmt.Errorf("add service %s: %w", s.Key, err)
	}
	if err := p.apply(st, s); err != nil {
		p.releaseService(st)
		return fmt.Errorf("add service %s: %w", s.Key, err)
	}
	// The service key goes in last: until then no packet can reach a half-made service.
	if err := p.objs.Services.Put(vipKey(s.Key), serviceValue(s, id)); err != nil {
		p.releaseService(st)
		return fmt.Errorf("add service %s: %w", s.Key, err)
	}
	if err := p.refVIP(s.Key.VIP.Addr()); err != nil {
		_ = p.objs.Services.Delete(vipKey(s.Key))
		p.releaseService(st)
		return fmt.Errorf("add service %s: %w", s.Key, err)
	}
	p.services[s.Key] = st
	p.nextHopErr = p.keepNextHops(s)
	return nil
}

// UpdateService replaces a service's settings and backends. Backends that stay keep
// their slots, so their established flows stay with them; the new lookup table
// replaces the old one in one step.
func (p *Program) UpdateService(s Service) error {
	if err := p.validate(&s); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return err
	}
	st, ok := p.services[s.Key]
	if !ok {
		return fmt.Errorf("update service %s: %w; add it first", s.Key, ErrNoService)
	}
	if err := p.apply(st, s); err != nil {
		return fmt.Errorf("update service %s: %w", s.Key, err)
	}
	if err := p.objs.Services.Put(vipKey(s.Key), serviceValue(s, st.id)); err != nil {
		return fmt.Errorf("update service %s: %w", s.Key, err)
	}
	p.nextHopErr = p.keepNextHops(s)
	return nil
}

// DeleteService removes a service; its packets are passed to the stack from then on.
func (p *Program) DeleteService(key ServiceKey) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return err
	}
	st, ok := p.services[key]
	if !ok {
		return fmt.Errorf("delete service %s: %w", key, ErrNoService)
	}
	if err := p.objs.Services.Delete(vipKey(key)); err != nil {
		return fmt.Errorf("delete service %s: %w", key, err)
	}
	delete(p.services, key)
	p.unrefVIP(key.VIP.Addr())
	p.releaseService(st)
	return nil
}

// SetBackendUsable marks one backend of a service usable or unusable (for example
// from a health check). An unusable backend leaves the lookup table (only its own
// share of entries moves) and its established flows are re-selected.
func (p *Program) SetBackendUsable(key ServiceKey, backend netip.AddrPort, usable bool) error {
	return p.changeBackend(key, backend, fmt.Sprintf("usable=%t", usable), func(b *Backend) { b.Usable = usable })
}

// SetBackendDraining drains a backend (or ends its draining): it leaves the lookup
// table, so it gets no new flows, while its established flows stay with it.
func (p *Program) SetBackendDraining(key ServiceKey, backend netip.AddrPort, draining bool) error {
	return p.changeBackend(key, backend, fmt.Sprintf("draining=%t", draining), func(b *Backend) { b.Draining = draining })
}

// SetBackendWeight changes one backend's weight; only its share of the lookup table
// moves, and established flows stay where they are.
func (p *Program) SetBackendWeight(key ServiceKey, backend netip.AddrPort, weight uint32) error {
	return p.changeBackend(key, backend, fmt.Sprintf("weight=%d", weight), func(b *Backend) { b.Weight = weight })
}

// SetBackendRamp sets the part of its share the lookup table gives a slow-starting
// backend (Backend.Ramp; 0 ends the ramp).
func (p *Program) SetBackendRamp(key ServiceKey, backend netip.AddrPort, ramp uint32) error {
	return p.changeBackend(key, backend, fmt.Sprintf("ramp=%d", ramp), func(b *Backend) { b.Ramp = ramp })
}

// SetBackendState sets what SetBackendUsable, SetBackendDraining, SetBackendWeight
// and SetBackendRamp set, in one change: the lookup table is built and installed once.
func (p *Program) SetBackendState(key ServiceKey, backend netip.AddrPort, usable, draining bool, weight, ramp uint32) error {
	return p.changeBackend(key, backend, fmt.Sprintf("usable=%t draining=%t weight=%d ramp=%d", usable, draining, weight, ramp), func(b *Backend) {
		b.Usable, b.Draining, b.Weight, b.Ramp = usable, draining, weight, ramp
	})
}

// changeBackend applies change to one backend of a service, validating the result
// like UpdateService: a failure leaves the service as it was.
func (p *Program) changeBackend(key ServiceKey, backend netip.AddrPort, what string, change func(*Backend)) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return err
	}
	st, ok := p.services[key]
	if !ok {
		return fmt.Errorf("set backend %s of service %s %s: %w", backend, key, what, ErrNoService)
	}
	next := st.spec
	next.Backends = append([]Backend(nil), st.spec.Backends...)
	found := false
	for i := range next.Backends {
		if next.Backends[i].Addr == backend {
			change(&next.Backends[i])
			found = true
		}
	}
	if !found {
		return fmt.Errorf("set backend %s of service %s %s: %w", backend, key, what, ErrNoBackend)
	}
	if err := p.validate(&next); err != nil {
		return fmt.Errorf("set backend %s %s: %w", backend, what, err)
	}
	if err := p.apply(st, next); err != nil {
		return fmt.Errorf("set backend %s of service %s %s: %w", backend, key, what, err)
	}
	return nil
}

// NAT returns the nat settings the program was loaded with, defaults filled in.
func (p *Program) NAT() NATOptions { return p.opts.NAT }

// NATPortRange returns the source ports nat flows are given, lo..hi inclusive.
func (p *Program) NATPortRange() (lo, hi uint16) { return p.opts.NAT.PortMin, p.opts.NAT.PortMax }

// Sizes returns how many flows each connection table and each half-open table holds,
// as loaded (with pinned maps: as the pinned maps were created).
func (p *Program) Sizes() (conntrack, halfOpen uint32) {
	return p.objs.LbConntrack4.MaxEntries(), p.objs.LbHalfOpen4.MaxEntries()
}

// Services returns the installed services as last set.
func (p *Program) Services() []Service {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Service, 0, len(p.services))
	for _, st := range p.services {
		s := st.spec
		s.Backends = append([]Backend(nil), s.Backends...)
		out = append(out, s)
	}
	return out
}

func (p *Program) usable() error {
	if p.closed {
		return fmt.Errorf("xdp program: %w", net.ErrClosed)
	}
	return nil
}

// apply writes a service's backends and swaps in its new lookup table. Order matters
// for packets in flight: new and kept backends are written first, then the table
// that refers to them is swapped in, and only then are removed backends cleared.
func (p *Program) apply(st *serviceState, s Service) error {
	slots := make(map[netip.AddrPort]uint32, len(s.Backends))
	var fresh []uint32
	var freshRings []ringKey
	undo := func() {
		for _, id := range fresh {
			p.backendIDs.give(id)
		}
		for _, k := range freshRings {
			p.rings.give(k)
		}
	}
	for _, b := range s.Backends {
		id, ok := st.slots[b.Addr]
		if !ok {
			if id, ok = p.backendIDs.take(); !ok {
				undo()
				return fmt.Errorf("backend %s: all %d backend slots in use: %w", b.Addr, p.backendIDs.capacity, ErrCapacity)
			}
			fresh = append(fresh, id)
			k := ringKey{b.Addr, s.Key.Protocol}
			p.rings.take(k, id)
			freshRings = append(freshRings, k)
			if err := p.zeroCounters(p.objs.BackendStats, id); err != nil {
				undo()
				return err
			}
			if err := p.zeroCounters(p.objs.BackendFlows, id); err != nil {
				undo()
				return err
			}
			if err := p.objs.BackendLoad.Put(id, int64(0)); err != nil {
				undo()
				return fmt.Errorf("reset load of backend %s: %w", b.Addr, err)
			}
		}
		slots[b.Addr] = id
	}

	gen, err := p.tableEntries(s, slots)
	if err != nil {
		undo()
		return err
	}
	// An unchanged table is not a new generation: swapping in a copy would push the
	// real previous one out of the fallback.
	same := gen.sum == st.tableSum && (gen.values == nil) == (st.table == nil)
	var table *ebpf.Map
	if !same && gen.values != nil {
		if table, err = p.newTable(gen.values); err != nil {
			undo()
			return err
		}
	}
	for _, b := range s.Backends {
		ring, _ := p.rings.ring(ringKey{b.Addr, s.Key.Protocol})
		if err := p.objs.Backends.Put(slots[b.Addr], backendValue(b, st.id, ring)); err != nil {
			if table != nil {
				table.Close()
			}
			undo()
			return fmt.Errorf("backend %s: %w", b.Addr, err)
		}
	}
	if !same {
		if table != nil {
			if err := p.objs.LookupTables.Put(st.id, table); err != nil {
				table.Close()
				undo()
				return fmt.Errorf("swap lookup table: %w", err)
			}
		} else if err := p.objs.LookupTables.Delete(st.id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			undo()
			return fmt.Errorf("clear lookup table: %w", err)
		}
		now := time.Now()
		p.keepPrevious(st, gen.sum, now)
		st.table, st.tableSum, st.fingerprint, st.tableSince = table, gen.sum, gen.fingerprint, now
	}

	for addr, id := range st.slots {
		if _, kept := slots[addr]; !kept {
			p.clearBackend(id)
			p.rings.give(ringKey{addr, st.spec.Key.Protocol})
		}
	}
	st.slots = slots
	st.spec = s
	st.spec.Backends = append([]Backend(nil), s.Backends...)
	return nil
}

// generation is one lookup table as apply builds it: the values of its inner map
// (nil when no backend is usable: the service then drops new flows and counts them
// as having no backend), what it holds by slot (sum) and by backend identity
// (fingerprint).
type generation struct {
	values      []uint32
	sum         [sha256.Size]byte
	fingerprint string
}

// tableEntries computes the service's Maglev table, and for maglev_p2c its second
// table (from balance.P2CSeed) after it in the same values, so one swap changes
// both; the second folds into the sum and fingerprint.
func (p *Program) tableEntries(s Service, slots map[netip.AddrPort]uint32) (generation, error) {
	seeds := []uint64{uint64(p.opts.HashSeed)}
	if s.P2C {
		seeds = append(seeds, balance.P2CSeed(uint64(p.opts.HashSeed)))
	}
	var gen generation
	for i, seed := range seeds {
		entries, err := maglevEntries(s, seed)
		if err != nil {
			return generation{}, err
		}
		if entries == nil {
			return generation{sum: tableSum("", nil, nil)}, nil
		}
		if i == 0 {
			// Entry 0 holds the size: it travels with the slots, so one swap changes all.
			gen.values = make([]uint32, 1, 1+len(seeds)*len(entries))
			gen.values[0] = uint32(len(entries))
		}
		addrs := make([]netip.AddrPort, len(entries))
		for j, e := range entries {
			gen.values = append(gen.values, slots[s.Backends[e].Addr])
			addrs[j] = s.Backends[e].Addr
		}
		fp, ids := fingerprint(p.opts.HashSeed, s.SourceHash, addrs)
		half := generation{sum: tableSum(fp, ids, slots), fingerprint: fp}
		if i == 0 {
			gen.sum, gen.fingerprint = half.sum, half.fingerprint
		} else {
			gen.withSecond(half)
		}
	}
	return gen, nil
}

// newTable creates and fills an inner map holding values.
func (p *Program) newTable(values []uint32) (*ebpf.Map, error) {
	spec := p.innerSpec.Copy()
	spec.MaxEntries = uint32(len(values))
	spec.Name = "weir_lut"
	table, err := ebpf.NewMap(spec)
	if err != nil {
		return nil, fmt.Errorf("create lookup table of %d entries: %w", len(values), err)
	}
	keys := make([]uint32, len(values))
	for i := range keys {
		keys[i] = uint32(i)
	}
	if _, err := table.BatchUpdate(keys, values, nil); err != nil {
		table.Close()
		return nil, fmt.Errorf("fill lookup table: %w", err)
	}
	return table, nil
}

// clearBackend zeroes a slot (so flows still pointing at it are re-selected) and
// returns it to the free queue, which hands out the longest-free slot first.
func (p *Program) clearBackend(id uint32) {
	_ = p.objs.Backends.Put(id, bpf.WeirBackend{})
	p.backendIDs.give(id)
}

func (p *Program) releaseService(st *serviceState) {
	_ = p.objs.LookupTables.Delete(st.id)
	_ = p.objs.PrevLookupTables.Delete(st.id)
	st.closeTables()
	for addr, id := range st.slots {
		p.clearBackend(id)
		p.rings.give(ringKey{addr, st.spec.Key.Protocol})
	}
	st.slots = nil
	p.serviceIDs.give(st.id)
}

func (st *serviceState) closeTables() {
	if st.table != nil {
		st.table.Close()
		st.table = nil
	}
	if st.previous != nil {
		st.previous.Close()
		st.previous = nil
	}
}

// refVIP keeps one address-only key per VIP address, shared by the services on it:
// the program drops unbalanceable packets (fragments, truncated headers) to it.
func (p *Program) refVIP(addr netip.Addr) error {
	if p.vipRefs[addr] == 0 {
		key := bpf.WeirVipKey{Addr: addrWords(addr), Family: family(addr)}
		if err := p.objs.Services.Put(key, bpf.WeirService{}); err != nil {
			return fmt.Errorf("vip address %s: %w", addr, err)
		}
	}
	p.vipRefs[addr]++
	return nil
}

func (p *Program) unrefVIP(addr netip.Addr) {
	p.vipRefs[addr]--
	if p.vipRefs[addr] > 0 {
		return
	}
	delete(p.vipRefs, addr)
	_ = p.objs.Services.Delete(bpf.WeirVipKey{Addr: addrWords(addr), Family: family(addr)})
}

func vipKey(k ServiceKey) bpf.WeirVipKey {
	a := k.VIP.Addr()
	return bpf.WeirVipKey{
		Addr:   addrWords(a),
		Port:   portWord(k.VIP.Port()),
		Proto:  uint8(k.Protocol),
		Family: family(a),
	}
}

func serviceValue(s Service, id uint32) bpf.WeirService {
	v := bpf.WeirService{Id: id, Mode: bpf.WeirMode(s.Forwarding)}
	if s.SourceHash {
		v.Flags |= serviceFlagSourceHash
	}
	if s.P2C {
		v.Flags |= serviceFlagP2C
	}
	return v
}

func backendValue(b Backend, serviceID, natRing uint32) bpf.WeirBackend {
	v := bpf.WeirBackend{
		Addr:      addrWords(b.Addr.Addr()),
		Port:      portWord(b.Addr.Port()),
		Family:    family(b.Addr.Addr()),
		ServiceId: serviceID,
		Weight:    uint16(b.Weight), // validate bounds it by MaxWeight
		NatRing:   natRing,
	}
	copy(v.Mac[:], b.MAC)
	if b.Usable {
		v.Flags |= backendFlagUsable
	}
	return v
}

// Flag bits of bpf/consts.h.
const (
	serviceFlagSourceHash = bpf.WeirServiceFlagsSERVICE_F_SOURCE_HASH
	serviceFlagP2C        = bpf.WeirServiceFlagsSERVICE_F_P2C
	backendFlagUsable     = bpf.WeirBackendFlagsBACKEND_F_USABLE
)

// slotQueue hands out map indexes, oldest-freed first, so a slot just cleared is
// reused as late as possible and stale flows have time to age out of the LRU.
type slotQueue struct {
	free     []uint32
	capacity uint32
}

func newSlotQueue(n uint32) *slotQueue {
	q := &slotQueue{free: make([]uint32, n), capacity: n}
	for i := range q.free {
		q.free[i] = uint32(i)
	}
	return q
}

func (q *slotQueue) take() (uint32, bool) {
	if len(q.free) == 0 {
		return 0, false
	}
	id := q.free[0]
	q.free = q.free[1:]
	return id, true
}

func (q *slotQueue) give(id uint32) { q.free = append(q.free, id) }

// validate checks a service against itself and against the program's options.
func (p *Program) validate(s *Service) error {
	if err := s.validate(); err != nil {
		return err
	}
	switch s.Forwarding {
	case ForwardNAT:
		if s.Key.VIP.Addr().Is4() && !p.opts.NAT.Addr4.IsValid() ||
			s.Key.VIP.Addr().Is6() && !p.opts.NAT.Addr6.IsValid() {
			return fmt.Errorf("service %s: nat mode needs the balancer's own address of the VIP's family (loader Options.NAT): %w", s.Key, ErrInvalidService)
		}
	case ForwardTunnel:
		// The outer header's family is each backend's.
		for i, b := range s.Backends {
			if b.Addr.Addr().Is4() && !p.opts.NAT.Addr4.IsValid() || b.Addr.Addr().Is6() && !p.opts.NAT.Addr6.IsValid() {
				return fmt.Errorf("service %s: backends[%d] %s: tunnel mode needs the balancer's own address of the backend's family as the outer source (loader Options.NAT): %w",
					s.Key, i, b.Addr, ErrInvalidService)
			}
		}
	}
	return nil
}
