package httplb

import (
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// stats are a service's counters.
type stats struct {
	conns     atomic.Int64
	accepted  atomic.Uint64
	inflight  atomic.Int64
	requests  atomic.Uint64
	noBackend atomic.Uint64
}

func (s *stats) connState(_ net.Conn, st http.ConnState) {
	switch st {
	case http.StateNew:
		s.conns.Add(1)
		s.accepted.Add(1)
	case http.StateClosed, http.StateHijacked:
		s.conns.Add(-1)
	}
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
// minPerSecond lets a quiet service retry too. The balance is capped, so a
// long quiet spell does not save up a burst.
type retryBudget struct {
	ratio float64

	mu      sync.Mutex
	balance float64
	last    time.Time
}

const (
	budgetCap          = 100
	budgetMinPerSecond = 10
)

func newRetryBudget(ratio float64) *retryBudget {
	return &retryBudget{ratio: ratio, balance: budgetMinPerSecond, last: time.Now()}
}

func (b *retryBudget) deposit() {
	if b.ratio == 0 {
		return
	}
	b.mu.Lock()
	b.balance = min(budgetCap, b.balance+b.ratio)
	b.mu.Unlock()
}

func (b *retryBudget) withdraw() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	b.balance = min(budgetCap, b.balance+now.Sub(b.last).Seconds()*budgetMinPerSecond)
	b.last = now
	if b.balance < 1 {
		return false
	}
	b.balance--
	return true
}
