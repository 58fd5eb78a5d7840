package loader

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/cilium/ebpf"
)

// A fleet of balancers behind one router shares no state: each node must compute the
// same backend for the same new flow. A service's fingerprint says what its lookup
// table sends where, in terms every node agrees on — backends by address:port, not
// by the node-local slots the program's maps hold — together with what decides which
// entry a flow takes (the hash seed, source-only hashing). Nodes with the same
// configuration and the same view of backend health show the same fingerprint; an
// operator alerts when they differ.

// fingerprint returns the fingerprint (16 hex digits) of a table whose entry i sends
// flows to entries[i], and the backends it names, sorted.
func fingerprint(seed uint32, sourceHash bool, entries []netip.AddrPort) (string, []netip.AddrPort) {
	ids := slices.Clone(entries)
	slices.SortFunc(ids, func(a, b netip.AddrPort) int { return a.Compare(b) })
	ids = slices.Compact(ids)
	h := sha256.New()
	var w [18]byte
	word := func(v uint32) {
		binary.BigEndian.PutUint32(w[:4], v)
		h.Write(w[:4])
	}
	h.Write([]byte("weir maglev table v1"))
	word(seed)
	sourceOnly := uint32(0)
	if sourceHash {
		sourceOnly = 1
	}
	word(sourceOnly)
	word(uint32(len(entries)))
	word(uint32(len(ids)))
	for _, id := range ids {
		a := id.Addr().As16()
		copy(w[:16], a[:])
		binary.BigEndian.PutUint16(w[16:], id.Port())
		h.Write(w[:])
	}
	// Entries by their backend's rank among ids: 4 bytes each, not 18.
	rank := make(map[netip.AddrPort]uint32, len(ids))
	for i, id := range ids {
		rank[id] = uint32(i)
	}
	buf := make([]byte, 4*len(entries))
	for i, e := range entries {
		binary.BigEndian.PutUint32(buf[4*i:], rank[e])
	}
	h.Write(buf)
	return hex.EncodeToString(h.Sum(nil)[:8]), ids
}

// tableSum identifies a table by what the program reads: its fingerprint and the
// slot of each backend it names. Two tables with one sum have the same values.
func tableSum(print string, ids []netip.AddrPort, slots map[netip.AddrPort]uint32) [sha256.Size]byte {
	h := sha256.New()
	h.Write([]byte(print))
	var w [4]byte
	for _, id := range ids {
		binary.BigEndian.PutUint32(w[:], slots[id])
		h.Write(w[:])
	}
	return [sha256.Size]byte(h.Sum(nil))
}

// maxBriefGeneration is how long a table may serve and still be too brief to replace
// the previous generation (capped by the window): slow-start steps (one a second), a
// health flap, changes pushed one after another. Such a table collected few
// connections; the one before it holds the connections worth falling back to.
const maxBriefGeneration = time.Minute

// withSecond folds maglev_p2c's second table into a generation's sum and
// fingerprint: the service's picks depend on both.
func (g *generation) withSecond(second generation) {
	sum := sha256.Sum256(append(g.sum[:], second.sum[:]...))
	fp := sha256.Sum256([]byte(g.fingerprint + " " + second.fingerprint))
	g.sum, g.fingerprint = sum, hex.EncodeToString(fp[:8])
}

// keepPrevious makes the table apply is replacing (st.table) with one of sum next
// the previous generation: addressable by the fallback (prev_lookup_tables) when
// the window is on, and remembered for status either way; the one before it is let
// go. Two exceptions keep the connections the fallback is for. A table that served
// briefly (maxBriefGeneration) while a previous generation is addressable leaves
// that one in place, its window running on. A change back to the table before (a
// backend's health flapped down and up) keeps no previous generation: the
// connections the flap interrupted belong to the table that is current again.
func (p *Program) keepPrevious(st *serviceState, next [sha256.Size]byte, now time.Time) {
	revert := st.previous != nil && st.prevSum == next
	brief := !st.prevSince.IsZero() && now.Sub(st.tableSince) < min(maxBriefGeneration, p.opts.PreviousTableWindow)
	if brief && !revert {
		if st.table != nil {
			st.table.Close()
		}
		return
	}
	if st.previous != nil {
		st.previous.Close()
	}
	st.previous, st.prevSum, st.prevPrint, st.prevSince = st.table, st.tableSum, st.fingerprint, time.Time{}
	if revert {
		if st.previous != nil {
			st.previous.Close()
		}
		st.previous, st.prevSum, st.prevPrint = nil, [sha256.Size]byte{}, ""
	}
	if st.previous != nil && p.opts.PreviousTableWindow > 0 {
		// An outer map holds a valid inner map of the right spec without fail; if it
		// did fail, the fallback is off for this generation, no more.
		if err := p.objs.PrevLookupTables.Put(st.id, st.previous); err == nil {
			st.prevSince = now
			return
		}
	}
	_ = p.objs.PrevLookupTables.Delete(st.id)
}

// ExpirePreviousTables ends the fallback for every service whose previous lookup
// table was replaced more than Options.PreviousTableWindow before now. The agent
// calls it once a second.
func (p *Program) ExpirePreviousTables(now time.Time) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return err
	}
	var errs []error
	for key, st := range p.services {
		if st.prevSince.IsZero() || now.Sub(st.prevSince) <= p.opts.PreviousTableWindow {
			continue
		}
		if err := p.objs.PrevLookupTables.Delete(st.id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("expire previous table of %s: %w", key, err))
			continue
		}
		st.prevSince = time.Time{}
	}
	return errors.Join(errs...)
}

// PreviousTableWindow returns Options.PreviousTableWindow as loaded.
func (p *Program) PreviousTableWindow() time.Duration { return p.opts.PreviousTableWindow }

// TableInfo describes a service's lookup tables.
type TableInfo struct {
	// Fingerprint identifies the current table by its backends' addresses and
	// what picks an entry (see fingerprint.go): equal on every node that computes
	// the same table. Empty when no backend is usable (no table).
	Fingerprint string
	// Size is the table's number of entries (0: no table; maglev_p2c: each of its two).
	Size uint32
	// Previous is the fingerprint of the generation the current table replaced,
	// while the fallback may still use it (empty otherwise); PreviousSince is when
	// it was replaced.
	Previous      string
	PreviousSince time.Time
}

// Tables returns every service's TableInfo.
func (p *Program) Tables() map[ServiceKey]TableInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[ServiceKey]TableInfo, len(p.services))
	for key, st := range p.services {
		out[key] = st.info()
	}
	return out
}

func (st *serviceState) info() TableInfo {
	ti := TableInfo{Fingerprint: st.fingerprint}
	if st.table != nil {
		ti.Size = st.table.MaxEntries() - 1
		if st.spec.P2C {
			ti.Size /= 2 // the second table follows the first in the same map
		}
	}
	if !st.prevSince.IsZero() {
		ti.Previous, ti.PreviousSince = st.prevPrint, st.prevSince
	}
	return ti
}

// adoptTables takes over the lookup tables an earlier run pinned for an adopted
// service (its slots known): the current one, so that setting the same configuration
// again swaps nothing (maglev_p2c's second table with it), and the previous one, so
// that the fallback outlives a restart.
// An adopted previous generation's window starts again now (its age is not kept);
// its fingerprint names only the backends the service still has.
func (p *Program) adoptTables(st *serviceState) error {
	bySlot := make(map[uint32]netip.AddrPort, len(st.slots))
	for addr, slot := range st.slots {
		bySlot[slot] = addr
	}
	for _, t := range []struct {
		outer *ebpf.Map
		table **ebpf.Map
		sum   *[sha256.Size]byte
		print *string
	}{
		{p.objs.LookupTables, &st.table, &st.tableSum, &st.fingerprint},
		{p.objs.PrevLookupTables, &st.previous, &st.prevSum, &st.prevPrint},
	} {
		inner, values, err := lookupTable(t.outer, st.id)
		if err != nil {
			return err
		}
		if inner == nil {
			continue
		}
		// Entry 0 is the size M; one table of M entries follows, or two (maglev_p2c).
		if len(values) < 2 || values[0] == 0 || (len(values)-1)%int(values[0]) != 0 || (len(values)-1)/int(values[0]) > 2 {
			inner.Close()
			return fmt.Errorf("adopt %s of service id %d: %d values, not a table's size and its entries", t.outer, st.id, len(values))
		}
		var gen generation
		for half := 0; half < (len(values)-1)/int(values[0]); half++ {
			entries := make([]netip.AddrPort, values[0])
			for j, slot := range values[1+half*int(values[0]) : 1+(half+1)*int(values[0])] {
				entries[j] = bySlot[slot]
			}
			fp, ids := fingerprint(p.opts.HashSeed, st.spec.SourceHash, entries)
			g := generation{sum: tableSum(fp, ids, st.slots), fingerprint: fp}
			if half == 0 {
				gen = g
			} else {
				gen.withSecond(g)
			}
		}
		*t.table, *t.sum, *t.print = inner, gen.sum, gen.fingerprint
	}
	st.tableSince = time.Now()
	if st.previous != nil {
		st.prevSince = st.tableSince
	}
	return nil
}

// lookupTable opens the inner map an outer map of lookup tables holds for a
// service and reads it (nil, nil if it holds none).
func lookupTable(outer *ebpf.Map, id uint32) (*ebpf.Map, []uint32, error) {
	var inner *ebpf.Map
	err := outer.Lookup(id, &inner)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read %s of service id %d: %w", outer, id, err)
	}
	values, err := readArray[uint32](inner, inner.MaxEntries())
	if err != nil {
		inner.Close()
		return nil, nil, fmt.Errorf("read %s of service id %d: %w", outer, id, err)
	}
	return inner, values, nil
}

// readArray reads the first n entries of an array map.
func readArray[V any](m *ebpf.Map, n uint32) ([]V, error) {
	values := make([]V, n)
	if err := batchLookup(m, n, values); err != nil {
		return nil, err
	}
	return values, nil
}

// batchLookup reads the first n entries of an array map into values (n of them, or
// n times the CPUs for a per-CPU map).
func batchLookup[V any](m *ebpf.Map, n uint32, values []V) error {
	keys := make([]uint32, n)
	var cursor ebpf.MapBatchCursor
	got, err := m.BatchLookup(&cursor, keys, values, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	if got != int(n) {
		return fmt.Errorf("batch lookup: %d of %d entries", got, n)
	}
	return nil
}
