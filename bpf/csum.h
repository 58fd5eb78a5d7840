// csum.h: incremental Internet checksum updates (RFC 1624, eqn. 3:
// HC' = ~(~HC + ~m + m')). Words are summed as they lie in memory: the one's
// complement sum is the same in either byte order, so nothing is swapped.
#pragma once

#include <linux/types.h>

static __always_inline __u32 csum_start(__u16 check)
{
	return (__u16)~check;
}

static __always_inline __u32 csum_add16(__u32 sum, __u16 from, __u16 to)
{
	return sum + (__u16)~from + to;
}

static __always_inline __u32 csum_add32(__u32 sum, __u32 from, __u32 to)
{
	sum = csum_add16(sum, from & 0xffff, to & 0xffff);
	return csum_add16(sum, from >> 16, to >> 16);
}

static __always_inline __u16 csum_finish(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}
