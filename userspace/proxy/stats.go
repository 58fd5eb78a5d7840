package proxy

import (
	"net/netip"
	"sync/atomic"
	"time"
)

type serviceCounters struct {
	accepted     atomic.Uint64
	active       atomic.Int64
	unserved     atomic.Uint64
	acceptErrors atomic.Uint64
	// clientTimeouts counts client connections that failed with ETIMEDOUT.
	clientTimeouts atomic.Uint64
	bytesIn        atomic.Uint64 // client to backend
	bytesOut       atomic.Uint64 // backend to client
}

type backendCounters struct {
	connects        atomic.Uint64
	connectFailures atomic.Uint64
	connectNanos    atomic.Uint64
	resets          atomic.Uint64
	idleTimeouts    atomic.Uint64
	ejections       atomic.Uint64
	bytesIn         atomic.Uint64
	bytesOut        atomic.Uint64
}

// Snapshot is a service's counters at one moment, for the agent's metrics. Counters
// only grow; Active* are gauges.
type Snapshot struct {
	Service      string
	Accepted     uint64 // client connections accepted
	Active       int64  // client connections being handled now
	Unserved     uint64 // closed at once: no usable backend or every attempt failed
	AcceptErrors uint64
	// ClientTimeouts counts client connections the kernel gave up on because
	// the client stopped acknowledging (ETIMEDOUT: TCP keepalive probes, or
	// bytes sent to it, unanswered; ClientKeepalive, ClientUserTimeout).
	ClientTimeouts uint64
	BytesIn        uint64 // client to backends
	BytesOut       uint64 // backends to clients
	Backends       []BackendSnapshot
}

// BackendSnapshot is one current backend's state and counters. Counters of removed
// backends are not reported once they are gone.
type BackendSnapshot struct {
	Addr            netip.AddrPort
	Weight          uint32
	Usable          bool // per active health checks
	Draining        bool
	Ejected         bool // by passive health, for now
	Active          int64
	Connects        uint64        // successful connects
	ConnectFailures uint64        // failed dials (each attempt)
	ConnectTime     time.Duration // sum over Connects: mean = ConnectTime / Connects
	Resets          uint64        // connections the backend broke mid-stream
	IdleTimeouts    uint64
	Ejections       uint64
	BytesIn         uint64 // to the backend
	BytesOut        uint64 // from the backend
}

// Snapshot returns the service's counters.
func (s *Service) Snapshot() Snapshot {
	snap := Snapshot{
		Service:        s.cfg.Name,
		Accepted:       s.stats.accepted.Load(),
		Active:         s.stats.active.Load(),
		Unserved:       s.stats.unserved.Load(),
		AcceptErrors:   s.stats.acceptErrors.Load(),
		ClientTimeouts: s.stats.clientTimeouts.Load(),
		BytesIn:        s.stats.bytesIn.Load(),
		BytesOut:       s.stats.bytesOut.Load(),
	}
	now := monotonic()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range s.backends {
		snap.Backends = append(snap.Backends, BackendSnapshot{
			Addr:            b.ap,
			Weight:          b.cfg.Weight,
			Usable:          b.usable,
			Draining:        b.draining,
			Ejected:         b.ejectedUntil.Load() > now,
			Active:          b.active.Load(),
			Connects:        b.c.connects.Load(),
			ConnectFailures: b.c.connectFailures.Load(),
			ConnectTime:     time.Duration(b.c.connectNanos.Load()),
			Resets:          b.c.resets.Load(),
			IdleTimeouts:    b.c.idleTimeouts.Load(),
			Ejections:       b.c.ejections.Load(),
			BytesIn:         b.c.bytesIn.Load(),
			BytesOut:        b.c.bytesOut.Load(),
		})
	}
	return snap
}

// SpliceStats are process-wide counters of how bytes move: through splice(2) (bulk
// directions), how many pipes are open (pooled plus in use), and through read/write
// (small messages, and the start of every direction).
type SpliceStats struct {
	Calls     uint64 // splice(2) calls that moved bytes, either half
	Bytes     uint64 // bytes moved from sockets into pipes
	PipesOpen int64
	Copied    uint64 // bytes moved with read(2)/write(2)

	Redirected   uint64 // connections forwarded in the kernel (Config.Redirector)
	RedirectErrs uint64 // connections that could not be paired and used the copy path
	Kernel       uint64 // bytes the kernel forwarded, counted as their connections end
	FlushWaits   uint64 // EOFs that waited for the kernel to forward the last bytes
}

// Splices returns the process-wide splice counters.
func Splices() SpliceStats {
	return SpliceStats{Calls: spliceCalls.Load(), Bytes: splicedIn.Load(), PipesOpen: pipesOpen.Load(), Copied: copiedBytes.Load(),
		Redirected: redirected.Load(), RedirectErrs: redirectErrs.Load(), Kernel: kernelBytes.Load(), FlushWaits: flushWaits.Load()}
}
