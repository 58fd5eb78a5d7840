package plan

import (
	"cmp"
	"net/netip"
	"slices"

	"github.com/weir-lb/weir/userspace/config"
)

// impact.go: what a change would move, for `weir plan` and `weir reload --max-move`,
// computed from two desired states and what the data planes hold now (their lookup
// tables and established flows), which the agent reads and passes in.

// TableChange compares two lookup tables (entry i: the backend a new flow whose hash
// is i modulo the table's size gets; an invalid address: no backend).
type TableChange struct {
	PrevSize, NextSize int
	// Moved is how many entries of the next table have a different owner than today,
	// and Share the share of new flows that would go to another backend than today
	// (flow hashes are uniform, so with tables of one size Share is Moved/NextSize;
	// resized tables are compared over sampleHashes evenly spread hashes).
	Moved int
	Share float64
	Moves []Move // by From, To
}

// Move is the share of new flows that goes from one backend to another.
type Move struct {
	From, To netip.AddrPort // invalid: no backend (new flows are refused)
	Slots    int            // entries of the next table (of today's if next has none; resized: Share × size, rounded)
	Share    float64
}

// sampleHashes is how many flow hashes compare tables of different sizes: 2^20,
// spread evenly over the 32-bit hash space, which puts the share within about 0.1%
// of the exact one.
const sampleHashes = 1 << 20

// CompareTables says which share of new flows prev and next send to different
// backends, and from which to which. A nil table sends every flow nowhere.
func CompareTables(prev, next []netip.AddrPort) TableChange {
	tc := TableChange{PrevSize: len(prev), NextSize: len(next)}
	if prev == nil && next == nil {
		return tc
	}
	moves := map[[2]netip.AddrPort]int{}
	owner := func(t []netip.AddrPort, h uint64) netip.AddrPort {
		if len(t) == 0 {
			return netip.AddrPort{}
		}
		return t[h%uint64(len(t))]
	}
	// Counts are in entries of the next table (of the current one when next has
	// none); resized tables are compared over a sample of hashes and scaled to it.
	ref, total := len(next), len(next)
	if ref == 0 {
		ref = len(prev)
	}
	if len(prev) != len(next) {
		total = sampleHashes
	}
	for i := range total {
		h := uint64(i)
		if total == sampleHashes {
			// A Weyl sequence: an odd multiplier modulo 2^32 spreads the sample evenly
			// over the hash space and over every residue of any table size.
			h = uint64(uint32(i) * 0x9e3779b1)
		}
		from, to := owner(prev, h), owner(next, h)
		if from != to {
			moves[[2]netip.AddrPort{from, to}]++
		}
	}
	moved := 0
	scale := func(n int) int { return int(float64(n)*float64(ref)/float64(total) + 0.5) }
	for k, n := range moves {
		tc.Moves = append(tc.Moves, Move{From: k[0], To: k[1], Share: float64(n) / float64(total), Slots: scale(n)})
		moved += n
	}
	tc.Share = float64(moved) / float64(total)
	tc.Moved = scale(moved)
	slices.SortFunc(tc.Moves, func(a, b Move) int {
		return cmp.Or(a.From.Compare(b.From), a.To.Compare(b.To))
	})
	return tc
}

// Flows is what a data plane holds of a service's established flows (XDP),
// connections (proxy) or requests in flight (the http plane).
type Flows struct {
	PerBackend map[netip.AddrPort]uint64
	// Clients are the http plane's client connections open now: none is a
	// backend's, as every request on one is balanced by itself.
	Clients uint64
	// Tunnels are the http plane's upgraded connections (WebSocket) per
	// backend, counted in PerBackend too: a drained one does not finish by
	// itself, it is closed once the drain timeout is up.
	Tunnels map[netip.AddrPort]uint64
	// Hashes are the flows' hashes as the service's lookup table is indexed by them
	// (XDP), a sample of its traffic; nil where the plane has no table.
	Hashes []uint32
}

// TrafficShare is the share of hashes (a sample of a service's flows) that next
// sends to another backend than prev: how a change would treat new flows like
// today's, where CompareTables assumes every hash alike. ok is false without hashes.
func TrafficShare(prev, next []netip.AddrPort, hashes []uint32) (share float64, ok bool) {
	if len(hashes) == 0 {
		return 0, false
	}
	owner := func(t []netip.AddrPort, h uint32) netip.AddrPort {
		if len(t) == 0 {
			return netip.AddrPort{}
		}
		return t[h%uint32(len(t))]
	}
	moved := 0
	for _, h := range hashes {
		if owner(prev, h) != owner(next, h) {
			moved++
		}
	}
	return float64(moved) / float64(len(hashes)), true
}

// ShareChange is, for a plane that picks without a table (round robin, least
// connections...), the least share of new flows that must go elsewhere when the
// backends' shares change from prev's to next's: the sum of the shares backends
// lose. A backend's share is its part of the table weights of the backends that
// take new flows where the algorithm honours weights (see WeighsBackends), else
// an equal part: what round robin and random give, and what the load-aware
// algorithms give backends alike.
func ShareChange(prev, next *Service) float64 {
	p, n := shares(prev), shares(next)
	if len(p) == 0 && len(n) == 0 {
		return 0
	}
	if len(p) == 0 || len(n) == 0 {
		return 1
	}
	d := 0.0
	for a, x := range p {
		d += max(0, x-n[a])
	}
	return d
}

// IndependentChange is the share of new flows that go to another backend when the
// service moves to a data plane that chooses independently of the one it leaves (XDP
// and the proxy): one minus the chance that two independent picks by the two planes'
// shares agree.
func IndependentChange(prev, next *Service) float64 {
	p, n := shares(prev), shares(next)
	if len(p) == 0 && len(n) == 0 {
		return 0
	}
	same := 0.0
	for a, x := range p {
		same += x * n[a]
	}
	return 1 - same
}

// shares is each backend's share of s's new flows: of the table weights of its
// backends that take new flows, or equal where its algorithm ignores weights.
func shares(s *Service) map[netip.AddrPort]float64 {
	out := map[netip.AddrPort]float64{}
	if s == nil {
		return out
	}
	weight := func(b *Backend) float64 {
		if !WeighsBackends(s) {
			return 1
		}
		return float64(b.Weight) * b.TableShare()
	}
	sum := 0.0
	for i := range s.Backends {
		if b := &s.Backends[i]; b.takesNew() {
			sum += weight(b)
		}
	}
	for i := range s.Backends {
		if b := &s.Backends[i]; b.takesNew() && sum > 0 {
			out[b.Config.Addr] = weight(b) / sum
		}
	}
	return out
}

// WeighsBackends reports whether s's data plane gives backends new flows by their
// weights: XDP always (a weighted Maglev table), the proxy and the http plane for
// weighted, weighted_least_conn and the Maglev ones (maglev, source_hash and
// maglev_p2c, whose two candidates come from weighted tables and compare load per
// weight). Their other algorithms treat every backend that takes new flows alike
// (userspace/balance), weight 0 only keeping one out.
func WeighsBackends(s *Service) bool {
	switch s.Config.Algorithm {
	case config.AlgorithmWeighted, config.AlgorithmWeightedLeastConn, config.AlgorithmMaglev, config.AlgorithmSourceHash,
		config.AlgorithmMaglevP2C:
		return true
	}
	return s.Plane == XDP
}

// Fate is what a change does to a backend's established flows or connections.
type Fate string

// Fates.
const (
	// Stay: they go on with their backend, as before.
	Stay Fate = "stay"
	// Drain: they go on with their backend, which takes no new ones (until the drain
	// timeout, where there is one).
	Drain Fate = "drain"
	// Reset: their next packets are balanced anew, to whichever backend the table
	// gives, or, without a service, passed to the host: their connections break.
	Reset Fate = "reset"
)

// NewDataPlane says whether next needs a new data plane for prev's service rather
// than an update of the one it has: a placement change, a new XDP entry (a new VIP
// or protocol; any other change updates the entry in place), or a change rebuilt
// names on a plane that listens (Rebuilt; the http plane's own, which applies more
// in place). It returns why, in operator words ("" when not).
func NewDataPlane(prev, next *Service, rebuilt func(a, b *config.Service) bool) string {
	switch {
	case prev == nil || next == nil:
		return ""
	case prev.Plane != next.Plane:
		return "moves from " + string(prev.Plane) + " to " + string(next.Plane) + ": " + next.Why
	case next.Plane == XDP:
		if prev.Config.VIP != next.Config.VIP || prev.Config.Protocol != next.Config.Protocol {
			return "a new entry in the XDP program: its vip or protocol changed"
		}
		return ""
	case !rebuilt(&prev.Config, &next.Config):
		return ""
	case next.Plane == HTTP:
		return "a new listener on http: its vip, http.listen, TLS certificate, drain_timeout, connect, idle or read-header timeout, header size limit, h2_engine, h1_engine, tcp_keepalive or tcp_user_timeout changed"
	}
	return "a new listener on " + string(next.Plane) + ": its vip, protocol, data_plane, mode, algorithm, drain_timeout or proxy settings changed"
}

// FlowFates says what going from prev to next (nil: the service is removed) does to
// the established flows of each backend prev's plane holds. The XDP program keeps a
// flow while its backend is in the service's entry and usable; its connection
// table is keyed by VIP and protocol, one per forwarding kind (nat, or dsr and
// tunnel). The proxy never cuts a connection on a change: removed, drained and
// rebuilt services' connections drain (see ServedFates).
func FlowFates(prev, next *Service) map[netip.AddrPort]Fate {
	if prev.Plane != XDP {
		return ServedFates(prev, next, Replaced(prev, next, Rebuilt))
	}
	out := map[netip.AddrPort]Fate{}
	all := append(slices.Clone(prev.Backends), prev.Leaving...)
	gone := next == nil || next.Plane != XDP || !next.Installed || !prev.Installed ||
		next.Config.VIP != prev.Config.VIP || next.Config.Protocol != prev.Config.Protocol ||
		(next.Config.Mode == config.ModeNAT) != (prev.Config.Mode == config.ModeNAT)
	for _, b := range all {
		was := xdpUsable(prev, &b)
		nb := findBackend(next, b.Config.Addr)
		switch {
		case !was:
			out[b.Config.Addr] = Stay // balanced anew already, whatever the change
		case gone || nb == nil || !xdpUsable(next, nb):
			out[b.Config.Addr] = Reset
		case xdpTakesNew(prev, &b) && !xdpTakesNew(next, nb):
			out[b.Config.Addr] = Drain
		default:
			out[b.Config.Addr] = Stay
		}
	}
	return out
}

// ServedFates is FlowFates for a plane that serves connections itself (the proxy:
// connections; the http plane: requests in flight), where replaced says whether
// the change gives the service a new server (see Replaced). Nothing is cut: the
// old server drains whatever it holds, a removed backend's connections or
// requests finish where they are, and so do a drained or weight-0 one's.
func ServedFates(prev, next *Service, replaced bool) map[netip.AddrPort]Fate {
	out := map[netip.AddrPort]Fate{}
	for _, b := range append(slices.Clone(prev.Backends), prev.Leaving...) {
		nb := findBackend(next, b.Config.Addr)
		switch {
		case replaced || nb == nil:
			out[b.Config.Addr] = Drain
		case b.takesNew() && (nb.Drained || nb.Weight == 0):
			out[b.Config.Addr] = Drain
		default:
			out[b.Config.Addr] = Stay
		}
	}
	return out
}

// Replaced says whether going from prev to next (nil: removed) retires prev's
// server on a plane that serves connections itself: the service is removed,
// moves plane, or changes a setting rebuilt says the server fixes while it
// listens (plan.Rebuilt for the proxy; the http plane applies more in place).
func Replaced(prev, next *Service, rebuilt func(a, b *config.Service) bool) bool {
	return next == nil || next.Plane != prev.Plane || rebuilt(&prev.Config, &next.Config)
}

// findBackend is s's backend, or its leaving one, at addr (nil if neither).
func findBackend(s *Service, addr netip.AddrPort) *Backend {
	if s == nil {
		return nil
	}
	if b := s.Backend(addr); b != nil {
		return b
	}
	for i := range s.Leaving {
		if s.Leaving[i].Config.Addr == addr {
			return &s.Leaving[i]
		}
	}
	return nil
}

func isLeaving(s *Service, b *Backend) bool { return s.Backend(b.Config.Addr) == nil }

// xdpUsable is the program's usable flag of b (xdpplane's spec: a leaving backend is
// usable while healthy).
func xdpUsable(s *Service, b *Backend) bool {
	if isLeaving(s, b) {
		return b.Healthy
	}
	return b.Usable
}

// xdpTakesNew reports whether the program's table gives b new flows.
func xdpTakesNew(s *Service, b *Backend) bool { return !isLeaving(s, b) && b.takesNew() }
