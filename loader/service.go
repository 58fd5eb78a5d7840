package loader

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/userspace/balance"
)

// Protocol is the L4 protocol of a service, numbered as in IP headers.
type Protocol uint8

const (
	TCP Protocol = 6
	UDP Protocol = 17
)

func (p Protocol) String() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	}
	return fmt.Sprintf("proto(%d)", uint8(p))
}

// ServiceKey names a service the way the program matches packets: VIP, port, protocol.
type ServiceKey struct {
	VIP      netip.AddrPort
	Protocol Protocol
}

func (k ServiceKey) String() string { return k.Protocol.String() + "/" + k.VIP.String() }

// Forwarding is how a service's packets reach its backends (bpf/consts.h enum mode).
type Forwarding uint32

const (
	// ForwardDSR rewrites the destination MAC and sends the frame back out (L2 direct
	// server return): backends hold the VIP on loopback and answer clients directly.
	ForwardDSR = Forwarding(bpf.WeirModeMODE_DSR)
	// ForwardNAT translates both directions (DNAT to the backend, SNAT to the
	// balancer's address): backends need no change.
	ForwardNAT = Forwarding(bpf.WeirModeMODE_NAT)
	// ForwardTunnel encapsulates the client's packet (IPIP, IP6IP6, or across
	// families) to the backend, which may sit in another subnet behind routers; the
	// backend decapsulates (weir decap, or the kernel's ipip/ip6tnl), holds the VIP
	// and answers the client directly.
	ForwardTunnel = Forwarding(bpf.WeirModeMODE_TUNNEL)
)

func (f Forwarding) String() string {
	switch f {
	case ForwardDSR:
		return "dsr"
	case ForwardNAT:
		return "nat"
	case ForwardTunnel:
		return "tunnel"
	}
	return fmt.Sprintf("forwarding(%d)", uint32(f))
}

// Service is a VIP and the backends that share its traffic.
type Service struct {
	Key        ServiceKey
	Forwarding Forwarding
	// SourceHash hashes the client address only, so one client always reaches the same
	// backend (while the backend set is unchanged), instead of hashing the 5-tuple.
	SourceHash bool
	// TableSize is the Maglev lookup table size, a prime; 0 picks balance.MaglevSize.
	TableSize uint32
	// P2C (maglev_p2c) gives a new flow the less loaded of two candidates: its slot
	// in the lookup table and in a second table of the same size, built from
	// balance.P2CSeed(HashSeed) and held after the first in the same inner map,
	// compared by active flows per weight (bpf/select.h).
	P2C      bool
	Backends []Backend
}

// Backend is one real server of a service.
type Backend struct {
	// Addr identifies the backend (and is where nat and tunnel modes send to). In dsr
	// mode only the MAC is used on the wire: the port must equal the VIP's.
	Addr netip.AddrPort
	// MAC is the backend's (or the next hop's) Ethernet address, for dsr; nat finds
	// the next hop itself.
	MAC net.HardwareAddr
	// Weight is the backend's share of new flows relative to the others; 0 takes none.
	Weight uint32
	// Usable is false while the backend is unhealthy: it gets no new flows and its
	// established flows are moved to another backend.
	Usable bool
	// Draining takes the backend out of the lookup table while its established flows
	// stay with it (maintenance, removal with a grace period).
	Draining bool
	// Ramp is the part of its weight's share the lookup table gives the backend while
	// it slow-starts, in units of balance.RampFull (0: all of it); see
	// balance.Backend.Ramp.
	Ramp uint32
}

// Errors a caller can test for with errors.Is.
var (
	ErrInvalidService = errors.New("invalid service")
	ErrServiceExists  = errors.New("service already exists")
	ErrNoService      = errors.New("no such service")
	ErrNoBackend      = errors.New("no such backend")
	ErrCapacity       = errors.New("capacity exhausted")
)

// MaxWeight bounds a backend's weight, so table building stays exact in 64 bits.
const MaxWeight = 65535

func (s *Service) validate() error {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("service %s: %s: %w", s.Key, fmt.Sprintf(format, args...), ErrInvalidService)
	}
	vip := s.Key.VIP.Addr()
	switch {
	case !vip.IsValid():
		return fail("vip: missing address")
	case vip.Is4In6():
		return fail("vip %s: write IPv4 addresses in dotted form", vip)
	case vip.IsUnspecified() || vip.IsMulticast():
		return fail("vip %s: must be a unicast address", vip)
	case s.Key.VIP.Port() == 0:
		return fail("vip: port must be 1..65535, got 0")
	case s.Forwarding > ForwardTunnel:
		return fail("forwarding must be nat, dsr or tunnel, got %s", s.Forwarding)
	case s.Key.Protocol != TCP && s.Key.Protocol != UDP:
		return fail("protocol must be tcp or udp, got %s", s.Key.Protocol)
	case len(s.Backends) == 0:
		return fail("backends: at least one backend is needed")
	}
	seen := make(map[netip.AddrPort]bool, len(s.Backends))
	weights := uint64(0)
	for i, b := range s.Backends {
		where := fmt.Sprintf("backends[%d] %s", i, b.Addr)
		switch {
		case !b.Addr.IsValid() || !b.Addr.Addr().IsValid():
			return fail("backends[%d]: address missing or invalid", i)
		case b.Addr.Addr().Is4In6():
			return fail("%s: write IPv4 addresses in dotted form", where)
		case seen[b.Addr]:
			return fail("%s: listed twice; merge the entries or change the port", where)
		case s.Forwarding == ForwardDSR && len(b.MAC) != 6:
			return fail("%s: mac must be a 6-byte Ethernet address, got %q", where, b.MAC.String())
		case s.Forwarding == ForwardNAT && b.Addr.Addr().Is4() != vip.Is4():
			return fail("%s: nat mode needs backends of the VIP's address family", where)
		case s.Forwarding == ForwardNAT && b.Addr.Port() == 0:
			return fail("%s: nat mode needs the backend's port", where)
		case b.Weight > MaxWeight:
			return fail("%s: weight must be 0..%d, got %d", where, MaxWeight, b.Weight)
		case b.Ramp > balance.RampFull:
			return fail("%s: ramp must be 0..%d, got %d", where, balance.RampFull, b.Ramp)
		}
		seen[b.Addr] = true
		weights += uint64(b.Weight)
	}
	if weights == 0 {
		return fail("backends: every weight is 0, so no backend could take a flow; give at least one a weight > 0")
	}
	return nil
}
