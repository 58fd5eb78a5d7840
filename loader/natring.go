package loader

import "net/netip"

// natRings gives every backend slot the nat port ring it takes source ports from
// (backend.nat_ring, an index of nat_cursor). A port claim in the nat reverse tables
// is keyed by the backend's address, port and protocol, not by its slot, so two
// services with the same backend must hand out its ports from one ring: with a ring
// each, both would hand out the same ports one after the other and take each other's
// half-open flows' claims over. So there is one ring per (backend, protocol), shared
// by the slots that hold it and released with the last of them. A new ring takes the
// number of the slot that first holds it when that number is free, so a backend
// in one service keeps the ring (and the ring position) its slot had before rings
// were shared.
type natRings struct {
	byKey    map[ringKey]*natRing
	used     map[uint32]bool
	capacity uint32
}

// ringKey is what a port claim's key holds of the backend (its family is the address's).
type ringKey struct {
	backend netip.AddrPort
	proto   Protocol
}

type natRing struct {
	id   uint32
	refs int
}

func newNATRings(capacity uint32) *natRings {
	return &natRings{byKey: make(map[ringKey]*natRing), used: make(map[uint32]bool), capacity: capacity}
}

// take returns the ring of k for one more slot, preferring the number prefer for a
// new ring. There are never more rings than slots in use, so a free number exists.
func (r *natRings) take(k ringKey, prefer uint32) uint32 {
	if g := r.byKey[k]; g != nil {
		g.refs++
		return g.id
	}
	id := prefer
	if r.used[id] || id >= r.capacity {
		for id = 0; r.used[id]; id++ {
		}
	}
	r.used[id] = true
	r.byKey[k] = &natRing{id: id, refs: 1}
	return id
}

// ring is k's ring number; ok is false if no slot holds k.
func (r *natRings) ring(k ringKey) (id uint32, ok bool) {
	g := r.byKey[k]
	if g == nil {
		return 0, false
	}
	return g.id, true
}

// give releases one slot's hold on k's ring.
func (r *natRings) give(k ringKey) {
	g := r.byKey[k]
	if g == nil {
		return
	}
	if g.refs--; g.refs == 0 {
		delete(r.byKey, k)
		delete(r.used, g.id)
	}
}
