package balance

import (
	"container/heap"
	"errors"
	"fmt"
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

// MaglevSize returns 65537, or when n > 655 the next prime >= 100*n (Maglev's <=1% imbalance rule).
//
// Memory: 4 bytes an entry, so 256 KiB per table up to 655 backends, then about 400 bytes
// per backend: 1,000 backends take 100,003 entries (391 KiB), 10,000 take 1,000,003
// (3.8 MiB). The XDP loader keeps two generations per service (double buffer), so twice that.
func MaglevSize(n int) uint32 {
	if n <= 655 {
		return DefaultMaglevSize
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
// backends. Backends with Weight 0 or !Usable get no entries. It is a pure function of
// (IDs, weights, usable flags, size, seed) — never of slice order (sort by ID internally) or
// map iteration — so every balancer node computes the same table.
//
// The fill is the paper's: each backend walks its own permutation of the slots
// (offset + j×skip mod size, from two hashes of its ID and the seed) and takes the next
// free slot on its turn. Weights decide the turns: each backend's entry count is fixed
// up front at its weighted share of the table (largest remainder, ties to the smaller
// ID), and turns go in order of (turns taken + 1) ÷ weight, ties to the smaller ID. With
// equal weights that is exactly the paper's round robin over backends sorted by ID.
func BuildMaglev(backends []Backend, size uint32, seed uint64) ([]uint32, error) {
	return buildMaglev(backends, size, seed, true)
}

// buildMaglev is BuildMaglev; fast allows the round-robin fill for equal weights
// (tests compare it with the heap's).
func buildMaglev(backends []Backend, size uint32, seed uint64, fast bool) ([]uint32, error) {
	if !isPrime(size) {
		return nil, fmt.Errorf("build maglev table: size %d: %w", size, ErrSizeNotPrime)
	}
	if err := checkUnique(backends); err != nil {
		return nil, fmt.Errorf("build maglev table: %w", err)
	}
	var order []int // indexes of usable backends, sorted by ID
	for i, b := range backends {
		if b.Usable && b.Weight > 0 {
			order = append(order, i)
		}
	}
	if len(order) == 0 {
		return nil, fmt.Errorf("build maglev table: %w", ErrNoBackend)
	}
	if uint64(len(order)) > uint64(size) {
		return nil, fmt.Errorf("build maglev table: size %d for %d usable backends: %w", size, len(order), ErrSizeTooSmall)
	}
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(backends[a].ID, backends[b].ID) })

	n := len(order)
	m := uint64(size)
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
	const empty = ^uint32(0)
	table := make([]uint32, size)
	for i := range table {
		table[i] = empty
	}
	if fast && equalWeights(t.w) {
		fillRoundRobin(table, order, quota, pos, skip)
		return table, nil
	}
	// The reference fill (fast false, for tests) runs container/heap; the same
	// operations on the concrete type skip its interface calls.
	initHeap, pop, fix := t.init, t.popTop, t.fixTop
	if !fast {
		initHeap = func() { heap.Init(t) }
		pop = func() { heap.Pop(t) }
		fix = func() { heap.Fix(t, 0) }
	}
	initHeap()
	for filled := uint64(0); filled < m; filled++ {
		k := t.idx[0]
		for table[pos[k]] != empty {
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
	return table, nil
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
	const empty = ^uint32(0)
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
