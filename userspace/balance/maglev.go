package balance

import (
	"cmp"
	"container/heap"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strings"
)

// DefaultMaglevSize is the Maglev paper's table size for small services: a prime, 256 KiB
// as uint32 entries.
const DefaultMaglevSize = 65537

// Sentinel errors of BuildMaglev, to check with errors.Is.
var (
	ErrSizeNotPrime = errors.New("maglev table size is not prime")
	ErrSizeTooSmall = errors.New("maglev table smaller than the number of usable backends")
)

// maglevLadder is the table sizes MaglevSize picks from, smallest first: 65537,
// then for k = 1..5 the smallest prime >= 65537 × 2^k, roughly doubling, and last
// 4194301, the largest prime below 2^22 and the largest table_size (config's
// MaxTableSize), where the doubling would pass it. The step that holds 100 × n
// serves every count up to it, so adding or removing one backend changes the size
// only where a step ends (656, 1312, 2622, 5244, 10487, 20973 and 41944
// backends), not at every count past 655. 2097211 holds 100 entries for each of
// the XDP program's 16,384 backend slots. TestMaglevLadder checks each step.
var maglevLadder = [...]uint32{DefaultMaglevSize, 131101, 262151, 524309, 1048601, 2097211, 4194301}

// MaglevSize returns the smallest step of a ladder of primes that roughly doubles
// (65537, 131101, 262151, 524309, 1048601, 2097211, 4194301) holding at least 100
// entries a backend (Maglev's <= 1% imbalance rule): 65537 up to 655 backends,
// 131101 up to 1311, and so on. Past the last step (more than 41,943 backends, which
// only the proxy may serve in one service) it is the next prime >= 100*n.
//
// Memory: 4 bytes an entry, so 256 KiB per table up to 655 backends, then 512 KiB
// up to 1,311, 1 MiB up to 2,621, 2 MiB up to 5,243, 4 MiB up to 10,486 and 8 MiB up
// to 20,972: at most about twice 100 entries a backend. The XDP loader keeps two
// generations per service (double buffer), so twice that.
func MaglevSize(n int) uint32 {
	for _, size := range maglevLadder {
		if uint64(size) >= 100*uint64(max(n, 0)) {
			return size
		}
	}
	return nextPrime(uint32(100 * n))
}

func nextPrime(n uint32) uint32 {
	for !isPrime(n) {
		n++
	}
	return n
}

func isPrime(n uint32) bool {
	if n < 2 {
		return false
	}
	if n%2 == 0 {
		return n == 2
	}
	for d := uint32(3); uint64(d)*uint64(d) <= uint64(n); d += 2 {
		if n%d == 0 {
			return false
		}
	}
	return true
}

// BuildMaglev fills a Maglev lookup table of the given prime size. Entry i is an index into
// backends. It is a pure function of (IDs, weights, usable flags, size, seed) — never of
// slice order (sort by ID internally) or map iteration — so every balancer node computes
// the same table.
//
// The table is built in two steps, so that a backend leaving for a while (down, draining)
// moves its own slots and no other:
//
//   - The base is Maglev's fill over every backend with a weight, usable or not: each
//     walks its own permutation of the slots (offset + j×skip mod size, from two hashes
//     of its ID and the seed) and takes the next free slot on its turn. Weights decide
//     the turns: each backend's entry count is fixed up front at its weighted share of
//     the table (largest remainder, ties to the smaller ID), and turns go in order of
//     (turns taken + 1) ÷ weight, ties to the smaller ID. With equal weights that is
//     exactly the paper's round robin over backends sorted by ID.
//
//   - The slots of backends that are not usable are then handed out again (see spill):
//     each goes to the usable backend that reaches it first along a second permutation
//     of its own, turns again by weight, and no usable backend takes much more than its
//     share of a table rebuilt without the unusable ones.
//
//   - A backend that ramps (Ramp) keeps as many of its base slots as its share with
//     its weight scaled by Ramp asks for, first in an order by a hash of slot and
//     backend, and hands the others out with the unusable ones'. Its kept set only
//     grows as Ramp does, so a slow-start step moves its own slots and the few that
//     caps shift.
//
// When every backend with a weight is usable and none ramps the table is the base
// alone. Adding or removing a backend, or changing a weight, rebuilds the base and
// moves what Maglev moves (see TestMaglevDisruption); a backend going down or coming
// back moves exactly its own slots. Backends with Weight 0 get no entries and are not
// part of the base.
func BuildMaglev(backends []Backend, size uint32, seed uint64) ([]uint32, error) {
	return buildMaglev(backends, size, seed, fillFast)
}

// fillMode says how buildMaglev fills: every mode builds the same table (tested).
type fillMode int

const (
	fillReference fillMode = iota // every turn through container/heap
	fillFast                      // the cheapest way for the case (BuildMaglev's)
	fillProbe                     // the spill's slots by probing turns, as the reference
	fillEvents                    // the spill's slots by each one's earliest taker
)

// buildMaglev is BuildMaglev with the fill's mode.
func buildMaglev(backends []Backend, size uint32, seed uint64, mode fillMode) ([]uint32, error) {
	if !isPrime(size) {
		return nil, fmt.Errorf("build maglev table: size %d: %w", size, ErrSizeNotPrime)
	}
	if err := checkUnique(backends); err != nil {
		return nil, fmt.Errorf("build maglev table: %w", err)
	}
	var base, up []int // indexes of weighted backends, and of the usable ones among them
	ramping := false
	for i, b := range backends {
		if b.Weight > 0 {
			base = append(base, i)
			if b.Usable {
				up = append(up, i)
				ramping = ramping || b.ramping()
			}
		}
	}
	if len(up) == 0 {
		return nil, fmt.Errorf("build maglev table: %w", ErrNoBackend)
	}
	if uint64(len(base)) > uint64(size) {
		return nil, fmt.Errorf("build maglev table: size %d for %d weighted backends: %w", size, len(base), ErrSizeTooSmall)
	}
	byID := func(a, b int) int { return strings.Compare(backends[a].ID, backends[b].ID) }
	slices.SortFunc(base, byID)
	slices.SortFunc(up, byID)
	table := fillBase(backends, base, uint64(size), seed, mode != fillReference)
	if len(up) < len(base) || ramping {
		spill(table, backends, up, seed, mode, ramping)
	}
	return table, nil
}

// fillBase is Maglev's fill of a table of size m over the backends in order (sorted by ID).
func fillBase(backends []Backend, order []int, m uint64, seed uint64, fast bool) []uint32 {
	n := len(order)
	quota := apportion(backends, order, m)
	t := &turns{w: make([]uint64, n), taken: make([]uint64, n)}
	pos := make([]uint64, n)
	skip := make([]uint64, n)
	for k, i := range order {
		id := backends[i].ID
		pos[k] = hashID(id, seed) % m
		skip[k] = hashID(id, seed^0x7f4a7c159e3779b9)%(m-1) + 1
		t.w[k] = uint64(backends[i].Weight)
		if quota[k] > 0 {
			t.idx = append(t.idx, k)
		}
	}
	table := make([]uint32, m)
	for i := range table {
		table[i] = emptySlot
	}
	if fast && equalWeights(t.w) {
		fillRoundRobin(table, order, quota, pos, skip)
		return table
	}
	initHeap, pop, fix := t.heapOps(fast)
	initHeap()
	for filled := uint64(0); filled < m; filled++ {
		k := t.idx[0]
		for table[pos[k]] != emptySlot {
			pos[k] += skip[k]
			if pos[k] >= m {
				pos[k] -= m
			}
		}
		table[pos[k]] = uint32(order[k])
		t.taken[k]++
		if t.taken[k] == quota[k] {
			pop()
		} else {
			fix()
		}
	}
	return table
}

// keepRamped frees the base slots a ramping backend does not keep. It keeps its share
// by turn weight (or all its base slots, if fewer), the first of them in an order by a
// hash of slot and backend: so the count is exact, and a larger share keeps a
// superset of the slots a smaller one kept.
func keepRamped(table []uint32, backends []Backend, up []int, position []int32, seed uint64, share func(k int) uint64) {
	slotsOf := map[int32][]uint64{} // position in up → its base slots
	for i, owner := range table {
		if k := position[owner]; k >= 0 && backends[owner].ramping() {
			slotsOf[k] = append(slotsOf[k], uint64(i))
		}
	}
	for k, slots := range slotsOf { // each backend on its own: the order of keys is moot
		keepSeed := hashID(backends[up[k]].ID, seed^0x510e527fade682d1)
		slices.SortFunc(slots, func(a, b uint64) int {
			if ha, hb := mix64(a^keepSeed), mix64(b^keepSeed); ha != hb {
				return cmp.Compare(ha, hb)
			}
			return cmp.Compare(a, b)
		})
		for _, i := range slots[min(uint64(len(slots)), share(int(k))):] {
			table[i] = emptySlot
		}
	}
}

// emptySlot marks a slot no backend holds yet while a table is filled.
const emptySlot = ^uint32(0)

// spill hands the slots of the base's unusable backends to the usable ones in up
// (sorted by ID). It is rendezvous hashing over a second permutation per backend: a
// freed slot goes to the usable backend whose permutation reaches it at the earliest
// turn, so the owner of a freed slot depends only on the usable set, and a backend
// going down frees its own slots and moves nothing else. A cap keeps large spills
// even: no backend ends above its share of the whole table among the usable ones
// plus a slack; a capped backend stops taking slots and the next one along gets them.
//
// Balance after a spill: every usable backend holds at most its share, rounded up,
// plus 1 + 2√(freed slots ÷ usable backends) slots; one backend down of 100 at the
// default size leaves every other within 1 % of its share (see TestMaglevSpillBalance).
func spill(table []uint32, backends []Backend, up []int, seed uint64, mode fillMode, ramping bool) {
	m := uint64(len(table))
	n := len(up)
	position := make([]int32, len(backends)) // backend index → position in up, or -1
	for i := range position {
		position[i] = -1
	}
	for k, i := range up {
		position[i] = int32(k)
	}
	// Turn weights: the backends' weights, or while one ramps, each scaled by its
	// Ramp (RampFull for the others).
	weight := make([]uint64, n)
	var total uint64
	allRamp := true
	for k, i := range up {
		b := &backends[i]
		weight[k] = uint64(b.Weight)
		if ramping {
			weight[k] *= RampFull
			if b.ramping() {
				weight[k] = uint64(b.Weight) * uint64(b.Ramp)
			}
		}
		allRamp = allRamp && b.ramping()
		total += weight[k]
	}
	// share is a backend's exact share of the table by turn weight, rounded up (not
	// apportioned: which backends get a remainder slot shifts with every change).
	share := func(k int) uint64 {
		hi, lo := bits.Mul64(m, weight[k])
		q, rem := bits.Div64(hi, lo, total)
		if rem > 0 {
			q++
		}
		return q
	}
	if ramping {
		keepRamped(table, backends, up, position, seed, share)
	}
	count := make([]uint64, n)
	freed := uint64(0)
	for i, owner := range table {
		if owner != emptySlot {
			if k := position[owner]; k >= 0 {
				count[k]++
				continue
			}
			table[i] = emptySlot
		}
		freed++
	}
	// The cap is a backend's share plus a slack of twice the spread of what
	// rendezvous hands each one: a cap that rarely binds, so a further backend going
	// down moves little of what the others freed (with caps at the share a second
	// one of 1,000 would move 1.6 × its slots). A ramping backend gets no slack (it
	// is at its share from its own slots), unless every usable backend ramps.
	slack := 1 + uint64(2*math.Sqrt(float64(freed)/float64(n)))
	capOf := make([]uint64, n)
	t := &turns{w: make([]uint64, n), taken: make([]uint64, n)}
	pos := make([]uint64, n)
	skip := make([]uint64, n)
	for k, i := range up {
		id := backends[i].ID
		pos[k] = hashID(id, seed^0x3c6ef372fe94f82b) % m
		skip[k] = hashID(id, seed^0xa54ff53a5f1d36f1)%(m-1) + 1
		t.w[k] = weight[k]
		capOf[k] = share(k)
		if !backends[i].ramping() || allRamp {
			capOf[k] += slack
		}
		if count[k] < capOf[k] {
			t.idx = append(t.idx, k)
		}
	}
	// The caps leave room for every freed slot: they add up to at least the table
	// plus one slot per usable backend that does not ramp (per usable backend, if
	// all do), so while a slot is free some backend is below its cap, and its
	// permutation visits every slot (skip and m are coprime).
	//
	// Probing walks every turn, most of them onto slots that are taken: about
	// m × ln(freed) turns, each through a heap with weights. Computing each freed
	// slot's earliest taker directly costs freed × backends: less when little is
	// spilled, as when a backend is down or ramps, and with weights at any spill
	// measured (a round-robin probe is cheaper than a heap's).
	events := !equalWeights(t.w) || freed*uint64(n) <= 8*m
	if mode == fillEvents || mode == fillFast && events {
		spillByEvents(table, up, t, pos, skip, count, capOf)
		return
	}
	probe := func(k int) {
		p := pos[k]
		if pos[k] += skip[k]; pos[k] >= m {
			pos[k] -= m
		}
		if table[p] == emptySlot {
			table[p] = uint32(up[k])
			count[k]++
			freed--
		}
	}
	if mode != fillReference && equalWeights(t.w) {
		active := t.idx
		for freed > 0 {
			kept := active[:0]
			for _, k := range active {
				if freed > 0 {
					probe(k)
				}
				if count[k] < capOf[k] {
					kept = append(kept, k)
				}
			}
			active = kept
		}
		return
	}
	initHeap, pop, fix := t.heapOps(mode != fillReference)
	initHeap()
	for freed > 0 {
		k := t.idx[0]
		probe(k)
		t.taken[k]++
		if count[k] == capOf[k] {
			pop()
		} else {
			fix()
		}
	}
}

// spillByEvents gives each free slot of table to the backend whose turns reach it
// first, as the probing fill does, without walking the turns: backend k's j-th turn
// (probing pos + j×skip) comes at (j+1) ÷ w, ties to the smaller k, so a slot's taker
// is the backend below its cap with the least (rank + 1) ÷ w, where rank is the slot's
// place in its permutation. Slots are settled in the order of their takers' turns; one
// whose taker reached its cap first goes to its next taker among those below theirs.
// t.idx holds the backends below their caps.
func spillByEvents(table []uint32, up []int, t *turns, pos, skip, count, capOf []uint64) {
	m := uint64(len(table))
	inverse := make([]uint64, len(up)) // of skip modulo m: rank = (slot - pos) × inverse
	for _, k := range t.idx {
		inverse[k] = modInverse(skip[k], m)
	}
	// (slot - pos) × inverse modulo m, by Barrett reduction: the product is below
	// 2^46, and mInv's quotient is at most one short.
	mInv := ^uint64(0) / m
	rank := func(k int, slot uint64) uint64 {
		d := slot + m - pos[k]
		if d >= m {
			d -= m
		}
		a := d * inverse[k]
		q, _ := bits.Mul64(a, mInv)
		if r := a - q*m; r < m {
			return r
		} else {
			return r - m
		}
	}
	// (r+1)/w of one backend against another's, cross-multiplied in 128 bits as
	// turns.Less does: while a backend ramps a turn weight is a weight times
	// RampFull, up to 2^48, and its product with a rank can pass 2^64.
	earlier := func(ra uint64, ka int, rb uint64, kb int) bool {
		xh, xl := bits.Mul64(ra+1, t.w[kb])
		yh, yl := bits.Mul64(rb+1, t.w[ka])
		if xh != yh {
			return xh < yh
		}
		return xl < yl || xl == yl && ka < kb
	}
	taker := func(slot uint64) (event, bool) {
		best := event{k: -1}
		for _, k := range t.idx {
			if count[k] >= capOf[k] {
				continue
			}
			if r := rank(k, slot); best.k < 0 || earlier(r, k, best.rank, best.k) {
				best = event{slot: slot, k: k, rank: r}
			}
		}
		return best, best.k >= 0
	}
	var q events
	q.earlier = earlier
	for i, owner := range table {
		if owner == emptySlot {
			if e, ok := taker(uint64(i)); ok {
				q.list = append(q.list, e)
			}
		}
	}
	heap.Init(&q)
	for len(q.list) > 0 {
		e := q.list[0]
		if count[e.k] < capOf[e.k] {
			table[e.slot] = uint32(up[e.k])
			count[e.k]++
			heap.Pop(&q)
			continue
		}
		// Its taker is capped: the next one along, whose turn comes later.
		if next, ok := taker(e.slot); ok {
			q.list[0] = next
			heap.Fix(&q, 0)
		} else {
			heap.Pop(&q) // unreachable: the caps leave room for every freed slot
		}
	}
}

// event is a free slot and the backend whose turn takes it.
type event struct {
	slot, rank uint64
	k          int
}

// events is a min-heap of events by their turn.
type events struct {
	list    []event
	earlier func(ra uint64, ka int, rb uint64, kb int) bool
}

func (q *events) Len() int { return len(q.list) }
func (q *events) Less(a, b int) bool {
	return q.earlier(q.list[a].rank, q.list[a].k, q.list[b].rank, q.list[b].k)
}
func (q *events) Swap(a, b int) { q.list[a], q.list[b] = q.list[b], q.list[a] }
func (q *events) Push(x any)    { q.list = append(q.list, x.(event)) }
func (q *events) Pop() any {
	x := q.list[len(q.list)-1]
	q.list = q.list[:len(q.list)-1]
	return x
}

// modInverse is a's inverse modulo the prime m (extended Euclid).
func modInverse(a, m uint64) uint64 {
	r0, r1 := int64(m), int64(a%m)
	t0, t1 := int64(0), int64(1)
	for r1 != 0 {
		q := r0 / r1
		r0, r1 = r1, r0-q*r1
		t0, t1 = t1, t0-q*t1
	}
	if t0 < 0 {
		t0 += int64(m)
	}
	return uint64(t0)
}

func equalWeights(w []uint64) bool {
	for _, x := range w {
		if x != w[0] {
			return false
		}
	}
	return true
}

// fillRoundRobin is the fill for equal weights, where the heap's order of turns is a
// plain round robin in ID order over the backends short of their quota: the same
// table, without a heap operation per slot (a 1,000-backend table builds about twice
// as fast).
func fillRoundRobin(table []uint32, order []int, quota, pos, skip []uint64) {
	const empty = emptySlot
	m := uint64(len(table))
	active := make([]int, 0, len(order))
	for k := range order {
		if quota[k] > 0 {
			active = append(active, k)
		}
	}
	taken := make([]uint64, len(order))
	for filled := uint64(0); filled < m; {
		kept := active[:0]
		for _, k := range active {
			p, s := pos[k], skip[k]
			for table[p] != empty {
				if p += s; p >= m {
					p -= m
				}
			}
			pos[k] = p
			table[p] = uint32(order[k])
			filled++
			if taken[k]++; taken[k] < quota[k] {
				kept = append(kept, k)
			}
		}
		active = kept
	}
}

// apportion splits m slots among the ordered backends in proportion to weight by the
// largest remainder method (ties to the earlier, i.e. smaller, ID), so every count is
// within one slot of its exact share.
func apportion(backends []Backend, order []int, m uint64) []uint64 {
	var total uint64
	for _, i := range order {
		total += uint64(backends[i].Weight)
	}
	quota := make([]uint64, len(order))
	rem := make([]uint64, len(order))
	var given uint64
	for k, i := range order {
		hi, lo := bits.Mul64(m, uint64(backends[i].Weight))
		quota[k], rem[k] = bits.Div64(hi, lo, total)
		given += quota[k]
	}
	byRem := make([]int, len(order))
	for k := range byRem {
		byRem[k] = k
	}
	slices.SortStableFunc(byRem, func(a, b int) int {
		switch {
		case rem[a] > rem[b]:
			return -1
		case rem[a] < rem[b]:
			return 1
		}
		return 0
	})
	for _, k := range byRem[:m-given] {
		quota[k]++
	}
	return quota
}

// turns is a min-heap of backends (positions in ID order) keyed by
// (taken+1)/weight, ties to the smaller position.
type turns struct {
	idx   []int
	w     []uint64
	taken []uint64
}

func (t *turns) Len() int { return len(t.idx) }
func (t *turns) Less(a, b int) bool {
	i, j := t.idx[a], t.idx[b]
	// (taken_i+1)/w_i < (taken_j+1)/w_j, cross-multiplied in 128 bits.
	ih, il := bits.Mul64(t.taken[i]+1, t.w[j])
	jh, jl := bits.Mul64(t.taken[j]+1, t.w[i])
	if ih != jh {
		return ih < jh
	}
	if il != jl {
		return il < jl
	}
	return i < j
}
func (t *turns) Swap(a, b int) { t.idx[a], t.idx[b] = t.idx[b], t.idx[a] }

// heapOps returns init, pop and fix of the heap: container/heap's for the reference
// fill (fast false, for tests), else the same operations on the concrete type, which
// skip its interface calls.
func (t *turns) heapOps(fast bool) (initHeap, pop, fix func()) {
	if !fast {
		return func() { heap.Init(t) }, func() { heap.Pop(t) }, func() { heap.Fix(t, 0) }
	}
	return t.init, t.popTop, t.fixTop
}

// init, fixTop and popTop are container/heap's Init, Fix(0) and Pop, step for step
// (so the order of turns is the same), on the concrete type.
func (t *turns) init() {
	n := len(t.idx)
	for i := n/2 - 1; i >= 0; i-- {
		t.down(i, n)
	}
}

func (t *turns) fixTop() { t.down(0, len(t.idx)) }

func (t *turns) popTop() {
	n := len(t.idx) - 1
	t.Swap(0, n)
	t.down(0, n)
	t.idx = t.idx[:n]
}

func (t *turns) down(i, n int) {
	for {
		j := 2*i + 1
		if j >= n || j < 0 {
			return
		}
		if j2 := j + 1; j2 < n && t.Less(j2, j) {
			j = j2
		}
		if !t.Less(j, i) {
			return
		}
		t.Swap(i, j)
		i = j
	}
}
func (t *turns) Push(x any) { t.idx = append(t.idx, x.(int)) }
func (t *turns) Pop() any {
	x := t.idx[len(t.idx)-1]
	t.idx = t.idx[:len(t.idx)-1]
	return x
}

// hashID is a 64-bit hash of a backend ID in the style of xxHash64 (multiply-rotate
// rounds over 8-byte words, an avalanche finaliser). It is written out here, not taken
// from hash/maphash, because every balancer node must compute the same value: maphash
// seeds are random per process.
func hashID(id string, seed uint64) uint64 {
	const (
		p1 = 0x9e3779b185ebca87
		p2 = 0xc2b2ae3d27d4eb4f
		p3 = 0x165667b19e3779f9
	)
	h := seed + p3 + uint64(len(id))*p1
	var word uint64
	var n uint
	round := func(w uint64) {
		w *= p2
		w = bits.RotateLeft64(w, 31) * p1
		h ^= w
		h = bits.RotateLeft64(h, 27)*p1 + p3
	}
	for i := 0; i < len(id); i++ {
		word |= uint64(id[i]) << (8 * n)
		if n++; n == 8 {
			round(word)
			word, n = 0, 0
		}
	}
	if n > 0 {
		round(word)
	}
	return mix64(h)
}

// mix64 is the splitmix64 finaliser: every input bit affects every output bit.
func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// P2CSeed is the seed of a maglev_p2c service's second table, derived from the seed
// of its first: a fixed function, so every balancer node builds the same pair, and a
// strong mix, so a slot's owners in the two tables are independent draws.
func P2CSeed(seed uint64) uint64 { return mix64(seed ^ 0x6d61676c65763263) }

// PreferSecond is maglev_p2c's choice between a flow's two candidates: the second
// (loadB active flows at weight weightB) only when the first's load per unit of weight
// exceeds it by more than an eighth. Ties and loads within the margin keep the first
// candidate, the one plain Maglev gives, so balancer nodes that see different loads
// still agree on most flows; a negative load (unknown) or a zero weight keeps the
// first too. The XDP program (bpf/select.h p2c_second) computes the same in 64 bits.
func PreferSecond(loadA int64, weightA uint32, loadB int64, weightB uint32) bool {
	if loadA < 0 || loadB < 0 || weightA == 0 || weightB == 0 {
		return false
	}
	return uint64(loadA)*uint64(weightB)*8 > uint64(loadB)*uint64(weightA)*9
}
