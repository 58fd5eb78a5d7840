package loader

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bpf"
)

// Pinning lets the agent restart without dropping a flow. With Options.PinPath set,
// every map is pinned there by name and every attachment's link as link-<ifname>:
// when the process ends — even killed — the program stays attached and keeps
// balancing with the maps as they were. The next Load adopts the pinned maps and
// rebuilds its view of the services from them (same service ids, same backend
// slots), and Attach adopts the pinned link, swapping the new program in without a
// gap. Connection-table entries point at backend slots, and a backend keeps its slot
// as long as its address stays in the service, so established flows — nat ports
// included — survive the restart.

// pinSetup prepares spec for pinning under dir and reports whether an earlier run
// left maps there.
func pinSetup(spec *ebpf.CollectionSpec, dir string) (adopting bool, err error) {
	var fs unix.Statfs_t
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return false, fmt.Errorf("pin path %s: %w", dir, err)
	}
	if err := unix.Statfs(dir, &fs); err != nil {
		return false, fmt.Errorf("pin path %s: %w", dir, err)
	}
	if fs.Type != unix.BPF_FS_MAGIC {
		return false, fmt.Errorf("pin path %s is not on a bpf filesystem: mount one (mount -t bpf bpf /sys/fs/bpf) or choose a path under it", dir)
	}
	for name, m := range spec.Maps {
		// .rodata and friends hold the program's settings: they belong to one load.
		if !strings.HasPrefix(name, ".") {
			m.Pinning = ebpf.PinByName
		}
	}
	_, err = os.Stat(filepath.Join(dir, bpf.WeirMapServices))
	return err == nil, nil
}

// adopt rebuilds the services and slot queues from maps an earlier run pinned.
// Weights are not stored in the maps, so adopted backends report weight 0 until the
// agent sets its configuration (SetService).
func (p *Program) adopt() error {
	var (
		key bpf.WeirVipKey
		val bpf.WeirService
	)
	usedServices := make(map[uint32]bool)
	byID := make(map[uint32]*serviceState)
	it := p.objs.Services.Iterate()
	for it.Next(&key, &val) {
		addr := addrFromWords(key.Addr, key.Family)
		if key.Proto == 0 {
			p.vipRefs[addr]++ // an address-only key: counted again below
			continue
		}
		sk := ServiceKey{VIP: netip.AddrPortFrom(addr, portWord(key.Port)), Protocol: Protocol(key.Proto)}
		st := &serviceState{id: val.Id, slots: make(map[netip.AddrPort]uint32)}
		st.spec = Service{Key: sk, Forwarding: Forwarding(val.Mode), SourceHash: val.Flags&serviceFlagSourceHash != 0,
			P2C: val.Flags&serviceFlagP2C != 0}
		p.services[sk] = st
		byID[val.Id] = st
		usedServices[val.Id] = true
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("adopt services: %w", err)
	}
	// vipRefs counts services per address, not address keys.
	for addr := range p.vipRefs {
		p.vipRefs[addr] = 0
	}
	for sk := range p.services {
		p.vipRefs[sk.VIP.Addr()]++
	}

	usedSlots := make(map[uint32]bool)
	adopted := make(map[uint32]bpf.WeirBackend)
	var slot uint32
	var be bpf.WeirBackend
	bit := p.objs.Backends.Iterate()
	for bit.Next(&slot, &be) {
		st, ok := byID[be.ServiceId]
		if be.Family == 0 || !ok {
			continue
		}
		addr := netip.AddrPortFrom(addrFromWords(be.Addr, be.Family), portWord(be.Port))
		st.slots[addr] = slot
		st.spec.Backends = append(st.spec.Backends, Backend{
			Addr: addr, MAC: append(net.HardwareAddr(nil), be.Mac[:]...), Usable: be.Flags&backendFlagUsable != 0,
		})
		usedSlots[slot] = true
		adopted[slot] = be
	}
	if err := bit.Err(); err != nil {
		return fmt.Errorf("adopt backends: %w", err)
	}
	if err := p.adoptRings(adopted, byID); err != nil {
		return fmt.Errorf("adopt backends: %w", err)
	}
	for _, st := range byID {
		if err := p.adoptTables(st); err != nil {
			for _, st := range byID {
				st.closeTables()
			}
			return fmt.Errorf("adopt lookup tables: %w", err)
		}
	}
	p.serviceIDs.remove(usedServices)
	p.backendIDs.remove(usedSlots)
	if err := p.recountLoads(usedSlots); err != nil {
		return fmt.Errorf("adopt: %w", err)
	}
	return nil
}

// adoptRings rebuilds the nat port rings of the adopted backends (by slot): the slots
// of one backend and protocol keep the ring they share, and get one (their first
// slot's number where free) where they do not share one, as from a weir that kept a
// ring per slot, whose entries all name ring 0. The program runs meanwhile; a slot
// whose ring changes may hand out a few ports its new ring handed out recently.
func (p *Program) adoptRings(adopted map[uint32]bpf.WeirBackend, byID map[uint32]*serviceState) error {
	groups := make(map[ringKey][]uint32)
	for slot, be := range adopted {
		st := byID[be.ServiceId]
		k := ringKey{netip.AddrPortFrom(addrFromWords(be.Addr, be.Family), portWord(be.Port)), st.spec.Key.Protocol}
		groups[k] = append(groups[k], slot)
	}
	keys := slices.SortedFunc(maps.Keys(groups), func(a, b ringKey) int {
		return cmp.Compare(slices.Min(groups[a]), slices.Min(groups[b]))
	})
	// agreed is the ring all of a group's slots name, if they name one.
	agreed := func(slots []uint32) (uint32, bool) {
		ring := adopted[slots[0]].NatRing
		for _, s := range slots {
			if adopted[s].NatRing != ring {
				return 0, false
			}
		}
		return ring, ring < p.rings.capacity
	}
	// Rings named after one of their own slots first (most rings; and from an older
	// weir only slot 0's names its own), then other agreed ones, then the rest.
	var rest []ringKey
	for pass := range 2 {
		for _, k := range keys {
			slots := groups[k]
			ring, ok := agreed(slots)
			if !ok {
				if pass == 0 {
					rest = append(rest, k)
				}
				continue
			}
			if slices.Contains(slots, ring) != (pass == 0) {
				continue
			}
			if p.rings.used[ring] {
				rest = append(rest, k)
				continue
			}
			for range slots {
				p.rings.take(k, ring)
			}
		}
	}
	for _, k := range rest {
		slots := groups[k]
		for _, s := range slots {
			ring := p.rings.take(k, slices.Min(slots))
			be := adopted[s]
			if be.NatRing == ring {
				continue
			}
			be.NatRing = ring
			if err := p.objs.Backends.Put(s, be); err != nil {
				return fmt.Errorf("nat ring of slot %d: %w", s, err)
			}
		}
	}
	return nil
}

// recountLoads sets backend_load of the slots in use to what the connection tables
// hold: the established flows the program has not counted closed yet (nat: not
// closing; dsr and tunnel: no LB_FLOW_CLOSED), which are the ones it will uncount
// later. A restart so corrects the drift of flows the LRU forgot and starts true
// counts where maps of a version without backend_load were adopted. The program
// runs meanwhile: a flow that opens or closes during the walk may be missed, once.
func (p *Program) recountLoads(used map[uint32]bool) error {
	counts := make(map[uint32]int64, len(used))
	fp := p.flowPairs()
	lbOpen := func(f bpf.WeirLbFlow) (uint32, bool) {
		return f.BackendId, f.CreatedS&uint32(bpf.WeirLbFlowBitsLB_FLOW_CLOSED) == 0
	}
	natOpen := func(f bpf.WeirNatFlow) (uint32, bool) {
		return f.BackendId, f.Flags&bpf.WeirFlowFlagsFLOW_F_CLOSING == 0
	}
	for _, err := range []error{
		countOpen[bpf.WeirFlowKey4](fp[lbConntrack].v4, lbOpen, counts),
		countOpen[bpf.WeirFlowKey](fp[lbConntrack].v6, lbOpen, counts),
		countOpen[bpf.WeirFlowKey4](fp[natConntrack].v4, natOpen, counts),
		countOpen[bpf.WeirFlowKey](fp[natConntrack].v6, natOpen, counts),
	} {
		if err != nil {
			return fmt.Errorf("recount flows: %w", err)
		}
	}
	for slot := range used {
		if err := p.objs.BackendLoad.Put(slot, counts[slot]); err != nil {
			return fmt.Errorf("recount flows: backend slot %d: %w", slot, err)
		}
	}
	return nil
}

// countOpen adds, for every entry of a flow table that open says is open, one to
// counts of its backend slot.
func countOpen[K, V any](m *ebpf.Map, open func(V) (uint32, bool), counts map[uint32]int64) error {
	var k K
	var v V
	it := m.Iterate()
	for it.Next(&k, &v) {
		if id, ok := open(v); ok {
			counts[id]++
		}
	}
	return it.Err()
}

func addrFromWords(w [4]uint32, fam uint8) netip.Addr {
	var b [16]byte
	for i, x := range w {
		b[i*4], b[i*4+1], b[i*4+2], b[i*4+3] = byte(x), byte(x>>8), byte(x>>16), byte(x>>24)
	}
	if fam == familyIPv4 {
		return netip.AddrFrom4([4]byte(b[:4]))
	}
	return netip.AddrFrom16(b)
}

// remove takes ids in use out of the free queue.
func (q *slotQueue) remove(used map[uint32]bool) {
	kept := q.free[:0]
	for _, id := range q.free {
		if !used[id] {
			kept = append(kept, id)
		}
	}
	q.free = kept
}

func (p *Program) linkPin(ifname string) string {
	return filepath.Join(p.opts.PinPath, "link-"+ifname)
}

// adoptLink takes over the link an earlier run pinned for ifname, if it is still
// attached to that interface, and swaps this program in. ok is false if there was
// none (or a stale one, which it removes).
func (p *Program) adoptLink(ifname string, ifindex int) (a *attachment, ok bool, err error) {
	path := p.linkPin(ifname)
	l, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("adopt pinned link %s: %w", path, err)
	}
	info, err := l.Info()
	if err != nil || info.XDP() == nil || int(info.XDP().Ifindex) != ifindex {
		// Pinned for an interface that is gone or renumbered: not ours any more.
		l.Unpin()
		l.Close()
		return nil, false, nil
	}
	if err := l.Update(p.objs.WeirXdp); err != nil {
		l.Close()
		return nil, false, fmt.Errorf("adopt pinned link %s: swap program: %w", path, err)
	}
	mode := ModeGeneric
	if nl, err := netlink.LinkByIndex(ifindex); err == nil && nl.Attrs().Xdp != nil && nl.Attrs().Xdp.AttachMode == nlXDPAttachedDrv {
		mode = ModeNative
	}
	return &attachment{link: l, mode: mode, ifindex: ifindex}, true, nil
}

// nlXDPAttachedDrv is XDP_ATTACHED_DRV of the kernel's link attributes.
const nlXDPAttachedDrv = 1

// SetService adds the service, or updates it if it is installed (for example adopted
// from pinned maps after a restart).
func (p *Program) SetService(s Service) error {
	p.mu.Lock()
	_, exists := p.services[s.Key]
	p.mu.Unlock()
	if exists {
		return p.UpdateService(s)
	}
	return p.AddService(s)
}

// Release closes this process's handles on the program, its maps and links, but
// leaves what is pinned in place: the program stays attached and keeps balancing,
// and the next Load with the same PinPath takes over. Without PinPath it is Close.
func (p *Program) Release() error {
	if p.opts.PinPath == "" {
		return p.Close()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	return p.closeHandles()
}

// unpinAll removes every pin of the program (links first), for Close.
func (p *Program) unpinAll() error {
	var errs []error
	for name, a := range p.attachments {
		if err := a.link.Unpin(); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin link of %s: %w", name, err))
		}
	}
	maps := []*ebpf.Map{p.objs.Services, p.objs.Backends, p.objs.LookupTables, p.objs.PrevLookupTables, p.objs.NewFlowLimit, p.objs.NatCursor,
		p.objs.ServiceStats, p.objs.BackendStats, p.objs.GlobalStats, p.objs.BackendFlows, p.objs.TxPorts,
		p.objs.BackendLoad}
	for _, fp := range p.flowPairs() {
		maps = append(maps, fp.v4, fp.v6)
	}
	for _, m := range maps {
		if err := m.Unpin(); err != nil {
			errs = append(errs, err)
		}
	}
	// Links an earlier run pinned for interfaces this process never attached (say,
	// one dropped from the configuration): removing the pin detaches them.
	if stale, err := filepath.Glob(filepath.Join(p.opts.PinPath, "link-*")); err == nil {
		for _, path := range stale {
			if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("unpin %s: %w", path, err))
			}
		}
	}
	// The directory goes too if nothing else lives in it.
	_ = os.Remove(p.opts.PinPath)
	return errors.Join(errs...)
}
