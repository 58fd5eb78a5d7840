// hash.h: the flow hash that indexes a service's lookup table. It must be a pure
// function of the packet and the configured seed, so that every balancer node behind
// the same ECMP router picks the same backend. loader/hash.go mirrors it in Go.
#pragma once

#include "structs.h"

// Runtime switch set by the loader before load: the seed shared by all nodes.
volatile const __u32 hash_seed = 0;

static __always_inline __u32 rotl32(__u32 x, __u32 r)
{
	return (x << r) | (x >> (32 - r));
}

// murmur3's block step and finaliser: cheap, and every input bit reaches every output bit.
static __always_inline __u32 hash_word(__u32 h, __u32 k)
{
	k *= 0xcc9e2d51;
	k = rotl32(k, 15);
	k *= 0x1b873593;
	h ^= k;
	h = rotl32(h, 13);
	return h * 5 + 0xe6546b64;
}

static __always_inline __u32 hash_final(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

// flow_hash hashes the whole 5-tuple, or the source address alone for affinity.
static __always_inline __u32 flow_hash(const struct flow_key *f, int source_only)
{
	__u32 h = hash_seed;

	h = hash_word(h, f->src[0]);
	h = hash_word(h, f->src[1]);
	h = hash_word(h, f->src[2]);
	h = hash_word(h, f->src[3]);
	if (!source_only) {
		h = hash_word(h, f->dst[0]);
		h = hash_word(h, f->dst[1]);
		h = hash_word(h, f->dst[2]);
		h = hash_word(h, f->dst[3]);
		h = hash_word(h, ((__u32)f->sport << 16) | f->dport);
		h = hash_word(h, f->proto);
	}
	return hash_final(h);
}

// entropy_hash is a cheap mix of the whole 5-tuple for tunnel mode's outer IPv6 flow
// label and IPv4 ID: it only has to spread flows over the backend's receive queues
// and a router's ECMP paths, so it folds the words together and multiplies once
// (about 20 instructions) instead of running flow_hash (about 160) on every packet.
static __always_inline __u32 entropy_hash(const struct flow_key *f)
{
	__u32 h = f->src[0] ^ f->src[1] ^ f->src[2] ^ f->src[3];

	h ^= rotl32(f->dst[0] ^ f->dst[1] ^ f->dst[2] ^ f->dst[3], 16);
	h ^= ((__u32)f->sport << 16 | f->dport) ^ f->proto;
	h *= 0x9e3779b1; // 2^32 / the golden ratio
	return h ^ (h >> 16);
}

