package served

// Tally sums a service's counters over the servers it has had, so that none
// goes back when a server is replaced (by a reload, or started anew after one
// stopped on its own): the running server's, those of the servers replaced or
// removed that still serve or drain, and what the drained ones counted.
//
// N is a data plane's snapshot of one server. Set a Tally's Drained method as
// the set's Drained, and call Prune after each Commit.
type Tally[S Server, N any] struct {
	Set *Set[S]
	// Snap reads a server's snapshot.
	Snap func(S) N
	// Merge adds src to dst: its counters and its open connections or
	// requests; a backend dst lacks is added only with add.
	Merge func(dst *N, src N, add bool)
	// Idle clears the open connections or requests of a drained server's
	// snapshot: only its counters are carried.
	Idle func(*N)

	carried map[string]N // by service name; guarded by the set's lock
}

// Snapshot returns the named service's sum, and whether it is served.
func (t *Tally[S, N]) Snapshot(name string) (sum N, ok bool) {
	t.Set.View(name, func(srv S, serving bool, others []S) {
		if !serving {
			return
		}
		sum, ok = t.Snap(srv), true
		for _, old := range others {
			t.Merge(&sum, t.Snap(old), true)
		}
		if was, found := t.carried[name]; found {
			t.Merge(&sum, was, false)
		}
	})
	return sum, ok
}

// Drained carries what a retired server of the named service counted; the
// set calls it, with its lock held, once the server has drained. It carries
// them for a service a change in progress removes too, which Abort may give
// back; Prune forgets them once the change is committed. The counts of a
// server that drains after its service's removal was committed are dropped,
// not left for a service of that name added later.
func (t *Tally[S, N]) Drained(name string, srv S) {
	if !t.Set.mayServe(name) {
		return // removed: its series go
	}
	if t.carried == nil {
		t.carried = make(map[string]N)
	}
	now := t.Snap(srv)
	t.Idle(&now)
	t.Merge(&now, t.carried[name], true)
	t.carried[name] = now
}

// Prune forgets the counters of services the set no longer serves.
func (t *Tally[S, N]) Prune() {
	t.Set.View("", func(S, bool, []S) {
		for name := range t.carried {
			if _, ok := t.Set.Get(name); !ok {
				delete(t.carried, name)
			}
		}
	})
}

// Entry returns the element of *list that match picks, appending mk() first
// when none does and add holds; nil when none does and add does not. A
// Tally's Merge finds a backend's counters with it.
func Entry[E any](list *[]E, match func(*E) bool, add bool, mk func() E) *E {
	for i := range *list {
		if match(&(*list)[i]) {
			return &(*list)[i]
		}
	}
	if !add {
		return nil
	}
	*list = append(*list, mk())
	return &(*list)[len(*list)-1]
}
