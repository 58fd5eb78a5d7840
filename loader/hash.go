package loader

import (
	"encoding/binary"
	"math/bits"
	"net/netip"

	"github.com/weir-lb/weir/bpf"
)

// Flow is a packet's 5-tuple as the program reads it.
type Flow struct {
	Src, Dst netip.AddrPort
	Protocol Protocol
}

// flowKey is a flow as the program's keys hold it (see addrWords and portWord).
func flowKey(f Flow) bpf.WeirFlowKey {
	return bpf.WeirFlowKey{
		Src: addrWords(f.Src.Addr()), Dst: addrWords(f.Dst.Addr()),
		Sport: portWord(f.Src.Port()), Dport: portWord(f.Dst.Port()),
		Proto: uint8(f.Protocol), Family: family(f.Dst.Addr()),
	}
}

// flowHash is bpf/hash.h's flow_hash on a key as the program holds it: the one Go
// copy of it, which Explain and the model (model_sim_test.go) both use to predict
// the lookup-table entry a packet takes. The C hashes the address words and ports
// as they lie in memory (network byte order read on a little-endian CPU); the key's
// words hold them the same way.
func flowHash(f *bpf.WeirFlowKey, seed uint32, sourceOnly bool) uint32 {
	h := seed
	for _, w := range f.Src {
		h = hashWord(h, w)
	}
	if !sourceOnly {
		for _, w := range f.Dst {
			h = hashWord(h, w)
		}
		h = hashWord(h, uint32(f.Sport)<<16|uint32(f.Dport))
		h = hashWord(h, uint32(f.Proto))
	}
	return hashFinal(h)
}

// OuterHash is what tunnel mode puts in the outer IPv6 flow label (its low 20 bits) and
// IPv4 ID (its low 16 bits, as the program stores them) of a flow's packets.
func OuterHash(f Flow) uint32 {
	k := flowKey(f)
	return entropyHash(&k)
}

// entropyHash is bpf/hash.h's entropy_hash on a key as the program holds it.
func entropyHash(f *bpf.WeirFlowKey) uint32 {
	h := f.Src[0] ^ f.Src[1] ^ f.Src[2] ^ f.Src[3]
	h ^= bits.RotateLeft32(f.Dst[0]^f.Dst[1]^f.Dst[2]^f.Dst[3], 16)
	h ^= (uint32(f.Sport)<<16 | uint32(f.Dport)) ^ uint32(f.Proto)
	h *= 0x9e3779b1
	return h ^ h>>16
}

func hashWord(h, k uint32) uint32 {
	k *= 0xcc9e2d51
	k = bits.RotateLeft32(k, 15)
	k *= 0x1b873593
	h ^= k
	h = bits.RotateLeft32(h, 13)
	return h*5 + 0xe6546b64
}

func hashFinal(h uint32) uint32 {
	h ^= h >> 16
	h *= 0x85ebca6b
	h ^= h >> 13
	h *= 0xc2b2ae35
	h ^= h >> 16
	return h
}

// addrWords lays an address out as the program's keys hold it: network byte order,
// IPv4 in the first word, read as native (little-endian) words.
func addrWords(a netip.Addr) [4]uint32 {
	var b [16]byte
	if a.Is4() {
		v4 := a.As4()
		copy(b[:], v4[:])
	} else {
		b = a.As16()
	}
	var w [4]uint32
	for i := range w {
		w[i] = binary.LittleEndian.Uint32(b[i*4:])
	}
	return w
}

// portWord is a port in network byte order, as a native uint16 holds it.
func portWord(p uint16) uint16 { return bits.ReverseBytes16(p) }

func family(a netip.Addr) uint8 {
	if a.Is4() {
		return familyIPv4
	}
	return familyIPv6
}

const (
	familyIPv4 = 2  // AF_INET
	familyIPv6 = 10 // AF_INET6
)
