package httplb

import (
	"net"
	"net/http"
	"sync/atomic"
	"time"
)

// connState is net/http's server's hook: it counts the connections, and a
// connection handed to the server is fresh no more once its first request is
// answered (StateActive comes before the server looks whether it is shutting
// down, and drops the request if so) or it closed.
func (s *Service) connState(c net.Conn, st http.ConnState) {
	s.stats.connState(c, st)
	if st != http.StateNew && st != http.StateActive {
		s.freshDone(c)
	}
}

// addFresh records c, about to be handed to net/http's server, as fresh: it
// has yet to read its first request (waitFresh).
func (s *Service) addFresh(c net.Conn) {
	s.freshMu.Lock()
	defer s.freshMu.Unlock()
	if s.fresh == nil {
		s.fresh = map[net.Conn]struct{}{}
	}
	s.fresh[c] = struct{}{}
}

// freshDone records that c is fresh no more, if it was.
func (s *Service) freshDone(c net.Conn) {
	s.freshMu.Lock()
	defer s.freshMu.Unlock()
	if _, ok := s.fresh[c]; !ok {
		return
	}
	delete(s.fresh, c)
	if len(s.fresh) == 0 && s.freshGone != nil {
		close(s.freshGone)
		s.freshGone = nil
	}
}

// waitFresh waits until every connection handed to net/http's server has had
// its first request answered or closed (at the header time if it sent
// none), or until abandon is closed; meanwhile the server's answers say
// Connection: close, as they do once its Shutdown began. Called once no more
// connections reach the server.
func (s *Service) waitFresh(abandon <-chan struct{}) {
	s.freshMu.Lock()
	if len(s.fresh) == 0 {
		s.freshMu.Unlock()
		return
	}
	s.srv.SetKeepAlivesEnabled(false)
	gone := make(chan struct{})
	s.freshGone = gone
	s.freshMu.Unlock()
	select {
	case <-gone:
	case <-abandon:
	}
}

// stats are a service's counters.
type stats struct {
	// countedAtAccept: the split listener counts connections as it accepts
	// them, so net/http's StateNew is not counted again.
	countedAtAccept bool
	conns           atomic.Int64
	accepted        atomic.Uint64
	inflight        atomic.Int64
	requests        atomic.Uint64
	noBackend       atomic.Uint64
	acceptErrors    atomic.Uint64 // accept errors waited out (patientListener)
	clientTimeouts  atomic.Uint64 // client connections that failed with ETIMEDOUT (clientFailed)
}

func (s *stats) connState(_ net.Conn, st http.ConnState) {
	switch st {
	case http.StateNew:
		if s.countedAtAccept {
			return
		}
		s.conns.Add(1)
		s.accepted.Add(1)
	case http.StateClosed, http.StateHijacked:
		s.conns.Add(-1)
	}
}

// accept counts a connection the split listener accepted.
func (s *stats) accept() {
	s.conns.Add(1)
	s.accepted.Add(1)
}

// backendStats are one backend's counters.
type backendStats struct {
	requests atomic.Uint64
	retries  atomic.Uint64
	classes  [6]atomic.Uint64
}

// count counts one try's answer by status class; 0: no answer.
func (b *backendStats) count(status int) {
	b.requests.Add(1)
	c := status / 100
	if c < 1 || c > 5 {
		c = 0
	}
	b.classes[c].Add(1)
}

// retryBudget bounds retries to a share of requests, as Finagle's budget does:
// every request deposits ratio, every retry withdraws one, and a floor of
// budgetMinPerSecond lets a quiet service retry too. The balance is capped, so
// a long quiet spell does not save up a burst. Tokens are counted in
// thousandths in one atomic word, so the deposit every request makes takes no
// lock.
type retryBudget struct {
	ratio   int64 // thousandths of a token per request
	balance atomic.Int64
	last    atomic.Int64 // monotonic ns of the last floor refill
}

const (
	budgetCap          = 100 * 1000
	budgetMinPerSecond = 10
)

func newRetryBudget(ratio float64) *retryBudget {
	b := &retryBudget{ratio: int64(ratio * 1000)}
	b.balance.Store(budgetMinPerSecond * 1000)
	b.last.Store(nanotime())
	return b
}

// epoch anchors nanotime to the monotonic clock.
var epoch = time.Now()

func nanotime() int64 { return int64(time.Since(epoch)) }

func (b *retryBudget) deposit() {
	if b.ratio == 0 || b.balance.Load() >= budgetCap {
		return // over the cap by at most the deposits racing this one
	}
	b.balance.Add(b.ratio)
}

func (b *retryBudget) withdraw() bool {
	now := nanotime()
	if last := b.last.Load(); now > last && b.last.CompareAndSwap(last, now) {
		refill := (now - last) * budgetMinPerSecond * 1000 / int64(time.Second)
		if v := b.balance.Add(refill); v > budgetCap {
			b.balance.Add(budgetCap - v)
		}
	}
	for {
		v := b.balance.Load()
		if v < 1000 {
			return false
		}
		if b.balance.CompareAndSwap(v, v-1000) {
			return true
		}
	}
}
