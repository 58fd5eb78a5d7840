package health

import (
	"context"
	"errors"
	"sync"
)

// ErrClosed is returned by Subscription.Next after Close.
var ErrClosed = errors.New("subscription closed")

// Subscription is an ordered stream of Changes for one consumer. It never
// blocks the Checker: changes queue until Next takes them, and a backend's
// queued change is merged with its newer ones (From kept, the rest updated),
// so a consumer that falls behind holds at most one change per backend and
// still ends at the latest state.
type Subscription struct {
	c     *Checker
	mu    sync.Mutex
	queue []Change
	head  int
	pos   map[string]int // backend ID -> its index in queue
	ready chan struct{}  // holds a token while queue has changes
	done  bool
}

// Subscribe starts a subscription. Its first changes describe every backend
// as it is now (From == To, Reason "current"), so a consumer needs no separate
// Snapshot and misses nothing between the two. Close it when done.
func (c *Checker) Subscribe() *Subscription {
	s := &Subscription{c: c, pos: make(map[string]int), ready: make(chan struct{}, 1)}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.init()
	now := c.now()
	for _, st := range c.snapshotLocked() {
		s.push(Change{ID: st.ID, Service: st.Service, From: st.State, To: st.State,
			Usable: st.Usable, Panic: st.Panic, Reason: "current", Time: now})
	}
	c.subs[s] = struct{}{}
	return s
}

// Next returns the next change, waiting for one until ctx is done.
func (s *Subscription) Next(ctx context.Context) (Change, error) {
	for {
		s.mu.Lock()
		if s.done {
			s.mu.Unlock()
			return Change{}, ErrClosed
		}
		if s.head < len(s.queue) {
			ch := s.queue[s.head]
			s.queue[s.head] = Change{}
			delete(s.pos, ch.ID)
			s.head++
			if s.head == len(s.queue) {
				s.queue, s.head = s.queue[:0], 0
			} else {
				select {
				case s.ready <- struct{}{}:
				default:
				}
			}
			s.mu.Unlock()
			if ch.ID == "" {
				continue // a forgotten change
			}
			return ch, nil
		}
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return Change{}, ctx.Err()
		case <-s.ready:
		}
	}
}

// Close ends the subscription; a Next waiting on it returns ErrClosed.
func (s *Subscription) Close() {
	s.c.mu.Lock()
	delete(s.c.subs, s)
	s.c.mu.Unlock()
	s.mu.Lock()
	s.done = true
	s.queue, s.pos = nil, nil
	s.mu.Unlock()
	select {
	case s.ready <- struct{}{}:
	default:
	}
}

// Watch calls fn with every change, in order, until ctx is done; then it
// returns ctx's error. It starts with the current state of every backend, as
// Subscribe does. fn runs on the caller's goroutine.
func (c *Checker) Watch(ctx context.Context, fn func(Change)) error {
	s := c.Subscribe()
	defer s.Close()
	for {
		ch, err := s.Next(ctx)
		if err != nil {
			return err
		}
		fn(ch)
	}
}

// push queues ch, merging it into a queued change of the same backend.
func (s *Subscription) push(ch Change) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return
	}
	if i, ok := s.pos[ch.ID]; ok {
		ch.From = s.queue[i].From
		s.queue[i] = ch
		return
	}
	if s.head > 0 && s.head >= len(s.queue)/2 {
		// Compact so a consumer that never quite catches up does not grow
		// the queue without bound.
		n := copy(s.queue, s.queue[s.head:])
		clear(s.queue[n:])
		s.queue = s.queue[:n]
		for i := range s.queue {
			s.pos[s.queue[i].ID] = i
		}
		s.head = 0
	}
	s.pos[ch.ID] = len(s.queue)
	s.queue = append(s.queue, ch)
	select {
	case s.ready <- struct{}{}:
	default:
	}
}

// forget drops a queued change of a removed backend, so a consumer is not
// told about a backend after it removed it.
func (s *Subscription) forget(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.pos[id]
	if !ok {
		return
	}
	delete(s.pos, id)
	// Leave a hole rather than shift the queue; Next skips it.
	s.queue[i] = Change{}
}
