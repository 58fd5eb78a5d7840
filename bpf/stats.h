// stats.h: per-CPU counters. No atomics: each CPU owns its slot.
#pragma once

#include "maps.h"

static __always_inline void count(void *map, __u32 index, __u32 bytes)
{
	struct counter *c = bpf_map_lookup_elem(map, &index);

	if (c) {
		c->packets++;
		c->bytes += bytes;
	}
}

// verdict counts a packet under reason and returns action, so a step ends with
// `return verdict(...)`.
static __always_inline int verdict(int action, enum stat_reason reason, __u32 bytes)
{
	count(&global_stats, reason, bytes);
	return action;
}
