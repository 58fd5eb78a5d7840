package health

import "time"

// dueQueue holds the backends waiting for their next check, ordered by due
// time: a 4-ary min-heap of entries that carry their key, so that sifting
// reads and writes only the heap's own array. At 100,000 backends a heap that
// compared b.dueAt through each backend's pointer and wrote its index back on
// every swap took a cache miss per step; this one touches a backend only when
// it is pushed or popped.
//
// A backend leaves the queue lazily: unqueue and a re-queue bump b.dueSeq, so
// its old entry no longer matches and is skipped when it reaches the top.
// Stale entries are dropped in one pass when they outnumber the live ones.
type dueQueue struct {
	epoch time.Time // keys are nanoseconds since epoch
	h     []dueEntry
	live  int // backends queued (b.queued)
}

type dueEntry struct {
	key int64
	seq uint32
	b   *backend
}

func (q *dueQueue) keyOf(at time.Time) int64 {
	if q.epoch.IsZero() {
		// Any reading works as the origin: keys only compare with each other.
		q.epoch = at
	}
	// Sub uses the monotonic clock when both times have it, as Before does,
	// so a step of the wall clock does not reorder the queue.
	return int64(at.Sub(q.epoch))
}

func (e dueEntry) valid() bool { return e.b.queued && e.b.dueSeq == e.seq }

// push queues b at at, replacing its place if it was queued. It reports
// whether b is now the head, the only case in which the scheduler may need to
// wake sooner.
func (q *dueQueue) push(b *backend, at time.Time) bool {
	if !b.queued {
		q.live++
	}
	b.queued = true
	b.dueSeq++
	b.dueAt = at
	q.h = append(q.h, dueEntry{key: q.keyOf(at), seq: b.dueSeq, b: b})
	i := q.up(len(q.h) - 1)
	if len(q.h) > 2*q.live+1024 {
		q.compact()
		return q.h[0].b == b
	}
	return i == 0
}

// remove takes b out of the queue, if it is queued.
func (q *dueQueue) remove(b *backend) {
	if b.queued {
		b.queued = false
		b.dueSeq++
		q.live--
	}
}

// head returns the backend due first, or nil, dropping stale entries on top.
func (q *dueQueue) head() *backend {
	for len(q.h) > 0 {
		if e := q.h[0]; e.valid() {
			return e.b
		}
		q.pop()
	}
	return nil
}

// take removes and returns the head; head must have returned it.
func (q *dueQueue) take() *backend {
	b := q.h[0].b
	q.pop()
	q.remove(b)
	return b
}

func (q *dueQueue) len() int { return q.live }

func (q *dueQueue) pop() {
	n := len(q.h) - 1
	q.h[0] = q.h[n]
	q.h[n] = dueEntry{}
	q.h = q.h[:n]
	if n > 0 {
		q.down(0)
	}
}

func (q *dueQueue) up(i int) int {
	e := q.h[i]
	for i > 0 {
		p := (i - 1) / 4
		if q.h[p].key <= e.key {
			break
		}
		q.h[i] = q.h[p]
		i = p
	}
	q.h[i] = e
	return i
}

func (q *dueQueue) down(i int) {
	e := q.h[i]
	n := len(q.h)
	for {
		c := 4*i + 1
		if c >= n {
			break
		}
		m := c
		for j := c + 1; j < min(c+4, n); j++ {
			if q.h[j].key < q.h[m].key {
				m = j
			}
		}
		if q.h[m].key >= e.key {
			break
		}
		q.h[i] = q.h[m]
		i = m
	}
	q.h[i] = e
}

// compact drops the stale entries and rebuilds the heap.
func (q *dueQueue) compact() {
	live := q.h[:0]
	for _, e := range q.h {
		if e.valid() {
			live = append(live, e)
		}
	}
	clear(q.h[len(live):])
	q.h = live
	for i := (len(q.h) - 2) / 4; i >= 0 && len(q.h) > 1; i-- {
		q.down(i)
	}
}
