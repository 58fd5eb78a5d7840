// Package config is weir's configuration file: its parsing, defaults and validation,
// and the typed model the rest of the agent runs on.
//
// A file is YAML. Unknown fields are errors, so a misspelt setting never passes for
// its default. Parse and Load report every problem at once, each naming the field by
// its path and, where known, its line:
//
//	weir.yaml:14: services[1].backends[3].weight: must be 0..65535, got 70000
//
// The YAML form is private to this package. What Load returns is resolved once:
// enums are typed (Protocol, Mode, Algorithm, DataPlane, HashKey, ...), durations are
// time.Duration, addresses netip values, and every default is filled in, so no
// caller sees a string to parse again, an "unset" pointer or a sentinel. A Config is
// never modified after Load; the agent keeps and compares whole values. A setting
// whose default belongs to the XDP program (table sizes, the half-open timeout) is
// 0 here and means "the program's default"; the agent reads the loaded program's
// values back. The package knows nothing of BPF, the proxy or the health checker,
// and builds on every OS.
package config

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"time"
)

// Defaults applied to settings the file leaves out.
const (
	DefaultAdminSocket   = "/run/weir/weir.sock"
	DefaultMetricsListen = "127.0.0.1:9470"
	DefaultPinPath       = "/sys/fs/bpf/weir"
	DefaultNewFlowRate   = 125000 // per CPU per second, as Katran's MAX_CONN_RATE
	// DefaultPreviousTableWindow is how long a replaced lookup table serves
	// connections no flow table knows (docs/datapath.md: the previous-table
	// fallback): about the age of the oldest connections worth keeping across a
	// node failure, since open connections are mostly long-lived ones.
	DefaultPreviousTableWindow = time.Hour
	DefaultLogFormat           = LogText
	DefaultLogLevel            = slog.LevelInfo
	DefaultProtocol            = TCP
	DefaultDataPlane           = DataPlaneAuto
	DefaultMode                = ModeNAT
	DefaultAllDown             = AllDownDrop
	DefaultDrainTimeout        = 30 * time.Second
	DefaultHealthType          = CheckTCP
	DefaultHealthMethod        = MethodAuto
	DefaultInterval            = 2 * time.Second
	DefaultTimeout             = time.Second
	DefaultRise                = 2
	DefaultFall                = 3
	DefaultJitter              = 0.1
	DefaultHealthInitial       = InitialUp
	DefaultHTTPPath            = "/"
	DefaultConsecutive         = 5
	DefaultBaseEjection        = 30 * time.Second
	DefaultMaxEjection         = 300 * time.Second
	DefaultMaxEjectionPct      = 10
	DefaultPanicThreshold      = 50
	DefaultConnectTimeout      = 3 * time.Second
	DefaultIdleTimeout         = 10 * time.Minute
	DefaultRetries             = 1
	DefaultWeight              = 1
	DefaultHTTPUpstream        = UpstreamAuto
	DefaultH2Engine            = H2EngineFrames
	DefaultH1Engine            = H1EngineLoop
	DefaultHTTPRetries         = 2
	DefaultRetryBudget         = 0.2
	DefaultHTTPIdle            = 5 * time.Minute
	DefaultHeaderTimeout       = 10 * time.Second
	DefaultMaxHeaderBytes      = 64 << 10
	MaxWeight                  = 65535
	DefaultKeepaliveIdle       = 60 * time.Second
	DefaultKeepaliveInterval   = 10 * time.Second
	DefaultKeepaliveCount      = 6
)

// The kernel's limits on TCP keepalive (tcp(7): MAX_TCP_KEEPIDLE,
// MAX_TCP_KEEPINTVL, MAX_TCP_KEEPCNT).
const (
	MaxKeepaliveIdle     = 32767 * time.Second
	MaxKeepaliveInterval = 32767 * time.Second
	MaxKeepaliveCount    = 127
)

// MaxUserTimeout bounds TCP_USER_TIMEOUT, which the kernel takes in
// milliseconds up to 2^31-1 (24 days): a day is already far past the
// kernel's own limit on retransmissions (net.ipv4.tcp_retries2, ~15 minutes).
const MaxUserTimeout = 24 * time.Hour

// MinHealthInterval and MinHealthTimeout bound a health check's interval and
// timeout from below: ten checks a second of every backend is twenty times the
// default (HAProxy's inter is 2s too) and only loads the backends, and a check
// given under 10ms fails healthy backends whenever the host is busy.
const (
	MinHealthInterval = 100 * time.Millisecond
	MinHealthTimeout  = 10 * time.Millisecond
)

// Protocol is a service's transport protocol.
type Protocol string

// Protocols.
const (
	TCP Protocol = "tcp"
	UDP Protocol = "udp"
)

// DataPlane is what a service asks to be served by.
type DataPlane string

// Data planes a service can ask for.
const (
	// DataPlaneAuto: XDP when the host can attach it, the service's algorithm is one
	// XDP serves and the program passes its self-test; otherwise the proxy.
	DataPlaneAuto  DataPlane = "auto"
	DataPlaneXDP   DataPlane = "xdp"
	DataPlaneProxy DataPlane = "proxy"
	// DataPlaneHTTP: the http data plane, which terminates HTTP/1.1, HTTP/2 and
	// gRPC and balances every request, not every connection.
	DataPlaneHTTP DataPlane = "http"
)

// Mode is an XDP forwarding mode.
type Mode string

// XDP forwarding modes.
const (
	ModeNAT    Mode = "nat"
	ModeDSR    Mode = "dsr"
	ModeTunnel Mode = "tunnel"
)

// AllDown is what a service does when none of its backends is usable.
type AllDown string

// All-down policies.
const (
	// AllDownDrop drops new flows (XDP) or closes new connections (proxy).
	AllDownDrop AllDown = "drop"
	// AllDownPass removes the service from XDP, so its packets go to the host's own
	// stack until a backend is usable again. XDP only.
	AllDownPass AllDown = "pass"
	// AllDownKeepLast keeps the backends that were usable last in service.
	AllDownKeepLast AllDown = "keep_last"
)

// HashKey is what the hash-based algorithms hash.
type HashKey string

// Hash keys. A service whose algorithm does not hash has the zero HashKey.
const (
	HashFiveTuple HashKey = "5tuple"
	HashSource    HashKey = "source"
)

// Algorithm is a balancing algorithm, spelt as userspace/balance spells it (the
// agent's tests check that the two lists agree).
type Algorithm string

// Balancing algorithms.
const (
	AlgorithmRoundRobin        Algorithm = "round_robin"
	AlgorithmRandom            Algorithm = "random"
	AlgorithmLeastConn         Algorithm = "least_conn"
	AlgorithmWeightedLeastConn Algorithm = "weighted_least_conn"
	AlgorithmWeighted          Algorithm = "weighted"
	AlgorithmP2C               Algorithm = "p2c"
	AlgorithmEWMA              Algorithm = "ewma"
	AlgorithmLeastTime         Algorithm = "least_time"
	AlgorithmSourceHash        Algorithm = "source_hash"
	AlgorithmMaglev            Algorithm = "maglev"
	// AlgorithmMaglevP2C gives a new flow the less loaded of two Maglev candidates
	// (docs/algorithms.md).
	AlgorithmMaglevP2C Algorithm = "maglev_p2c"
)

// MaxTableSize is the largest table_size, the largest prime below 2^22: 16 MiB a
// table (32 MiB with maglev_p2c's second), about a second to build and write, and
// past where a larger table stops paying for itself (docs/algorithms.md).
const MaxTableSize = 4194301

// MaxTableEntries bounds the Maglev lookup table entries of every service XDP
// may serve together (table_size, or DefaultTableSize when it is left out;
// twice that for maglev_p2c's second table): 2^28 entries, 1 GiB of kernel
// memory at 4 bytes an entry, and as much again for the previous generation
// the fallback keeps. Without it 1,024 services at the largest table_size
// would take 16 GiB (32 GiB with their previous tables). Every file that leaves
// table_size out fits: the most its default sizes reach, 1,024 maglev_p2c
// services over 16,384 backends with some at the end of a step (DefaultTableSize),
// take about 140 million entries, about half of it.
const MaxTableEntries = 1 << 28

// DefaultTableSize is the Maglev table size a service of n backends gets when
// it names none, as the XDP program picks it (userspace/balance.MaglevSize; the
// agent's tests check that the two agree): the smallest step of tableLadder
// with 100 entries a backend (at most 1% imbalance), past its last step the
// first prime from 100 entries a backend.
func DefaultTableSize(n int) uint32 {
	for _, size := range tableLadder {
		if uint64(size) >= 100*uint64(max(n, 0)) {
			return size
		}
	}
	return nextPrime(uint32(100 * n))
}

// tableLadder is the default table sizes: the first prime from 65537 × 2^k for
// each k while that stays below MaxTableSize, then MaxTableSize. Sizes that
// roughly double mean one backend added or removed changes a table's size only
// at the end of a step, not at every count past 655 backends.
var tableLadder = func() []uint32 {
	var sizes []uint32
	for base := uint32(65537); nextPrime(base) < MaxTableSize; base *= 2 {
		sizes = append(sizes, nextPrime(base))
	}
	return append(sizes, MaxTableSize)
}()

func nextPrime(n uint32) uint32 {
	for !isPrime(n) {
		n++
	}
	return n
}

// MinFlowTableSize and MaxFlowTableSize bound xdp.conntrack_size and
// xdp.half_open_size. The kernel reserves every flow table whole at load: six
// tables of each size (dsr/tunnel and nat flows and nat's reverse entries, per
// family), about 730 bytes per unit of size in all (docs/datapath.md), so the
// largest, 16.7 million flows a table, reserves about 11.4 GiB; a node that
// needs more is better split than grown.
// Below the smallest, a host with many CPUs leaves each CPU's LRU list (the
// tables' BPF_F_NO_COMMON_LRU) a handful of flows.
const (
	MinFlowTableSize = 1024
	MaxFlowTableSize = 1 << 24
)

// The XDP program's fixed capacities (bpf/consts.h; the agent's tests check that
// the two agree): services it serves, backends over all of them (one slot per
// backend of each service), and interfaces it attaches to.
const (
	MaxXDPServices = 1024
	MaxXDPBackends = 16384
	MaxInterfaces  = 64
)

// Algorithms lists every algorithm a service may name.
func Algorithms() []Algorithm {
	return []Algorithm{AlgorithmRoundRobin, AlgorithmRandom, AlgorithmLeastConn, AlgorithmWeightedLeastConn,
		AlgorithmWeighted, AlgorithmP2C, AlgorithmEWMA, AlgorithmLeastTime, AlgorithmSourceHash, AlgorithmMaglev, AlgorithmMaglevP2C}
}

// XDP reports whether the XDP data plane can serve the algorithm: only the
// hash-based ones, which need no per-connection state beyond the flow table.
func (a Algorithm) XDP() bool {
	return a == AlgorithmMaglev || a == AlgorithmSourceHash || a == AlgorithmMaglevP2C
}

// Attach is how the XDP program is attached to an interface.
type Attach string

// Attach modes.
const (
	AttachAuto    Attach = "auto" // native, else generic
	AttachNative  Attach = "native"
	AttachGeneric Attach = "generic"
)

// CheckType is the kind of a service's active health check.
type CheckType string

// Check types.
const (
	CheckTCP  CheckType = "tcp"
	CheckHTTP CheckType = "http"
	CheckNone CheckType = "none"
)

// CheckMethod is how tcp checks test a backend.
type CheckMethod string

// Check methods. The agent resolves auto: syn when it has CAP_NET_RAW,
// connect otherwise.
const (
	MethodAuto    CheckMethod = "auto"
	MethodSyn     CheckMethod = "syn"     // half-open: a SYN from a raw socket, the kernel resets
	MethodConnect CheckMethod = "connect" // a full TCP connect and close
)

// Initial is a backend's health state when it is first added.
type Initial string

// Initial health states.
const (
	InitialUp      Initial = "up"
	InitialDown    Initial = "down"
	InitialUnknown Initial = "unknown"
)

// LogFormat is how logs are written.
type LogFormat string

// Log formats.
const (
	LogText LogFormat = "text"
	LogJSON LogFormat = "json"
)

// Config is one configuration file, resolved.
type Config struct {
	// Interfaces the XDP program is attached to. None: no XDP, every service is
	// served by the proxy.
	Interfaces []Interface
	XDP        XDP
	// Addresses are the balancer's own addresses: the source of nat mode's
	// translated packets and of tunnel mode's outer header. Empty: the first address
	// of each family on the first interface.
	Addresses []netip.Addr
	Admin     Admin
	Metrics   Metrics
	Log       Log
	// BGP is the node's BGP speaker, which announces the VIPs to the routers; the
	// zero value (ASN 0): no speaker.
	BGP      BGP
	Services []Service

	lines map[string]int // where each setting is written, by path (see Line)
}

// Line returns the line of the file the setting at path (services[0].http.tls)
// is written on, or its nearest enclosing setting's: so that a problem found
// after parsing (a certificate that does not load) is reported as the file's
// own errors are. 0 when the file does not say (a default, or a Config not
// parsed).
func (c *Config) Line(path string) int { return lineIn(c.lines, path) }

// TLSPairError is the error of the named service's certificate and key that do
// not load (err), at http.tls of the file at file, as `weir validate` and the
// agent's reloads report it; nil when c has no such service.
func (c *Config) TLSPairError(file, service string, err error) *FieldError {
	i := slices.IndexFunc(c.Services, func(s Service) bool { return s.Name == service })
	if i < 0 {
		return nil
	}
	h := &c.Services[i].HTTP
	return c.ServiceError(file, service, "http.tls", fmt.Errorf("cert %s and key %s do not load: %w", h.TLSCert, h.TLSKey, err))
}

// ServiceError is err, a problem of the named service found after parsing (a
// certificate that does not load, a change the XDP program has no slots for),
// at its setting sub ("http.tls"; "": the service itself) of the file at file,
// with its line, as the file's own errors are reported, and wrapping err; nil
// when c has no such service.
func (c *Config) ServiceError(file, service, sub string, err error) *FieldError {
	i := slices.IndexFunc(c.Services, func(s Service) bool { return s.Name == service })
	if i < 0 {
		return nil
	}
	path := fmt.Sprintf("services[%d]", i)
	if sub != "" {
		path += "." + sub
	}
	return c.ErrorAt(file, path, err)
}

// ErrorAt is err, a problem found after parsing, at path (a field, or an entry
// such as "interfaces[1]") of the file at file, with its line, as the file's own
// errors are reported, and wrapping err.
func (c *Config) ErrorAt(file, path string, err error) *FieldError {
	return &FieldError{File: file, Line: c.Line(path), Path: path, Msg: err.Error(), Err: err}
}

// SpeakerPortClashes refuses, as validation refuses one at an address the file
// names (addresses, bgp.router_id, bgp.next_hop), each tcp VIP that XDP may
// serve at one of addrs on bgp.listen_port: addrs are the node's own addresses
// that only the host knows, the first interface's when the file leaves
// addresses out, and where names them in the error. Each is reported at its
// vip's line of the file at file; nil when none clashes.
func (c *Config) SpeakerPortClashes(file string, addrs []netip.Addr, where string) error {
	if c.BGP.ASN == 0 || c.BGP.ListenPort == 0 || len(c.Interfaces) == 0 {
		return nil
	}
	var es Errors
	for i := range c.Services {
		s := &c.Services[i]
		if slices.Contains(addrs, s.VIP.Addr()) && takesSpeakerPort(s.VIP, s.Protocol, s.Serving().XDP, c.BGP.ListenPort) {
			path := fmt.Sprintf("services[%d].vip", i)
			es = append(es, &FieldError{File: file, Line: c.Line(path), Path: path, Msg: speakerPortClash(s.VIP, where)})
		}
	}
	if es == nil {
		return nil
	}
	return es
}

// Defaults of the BGP settings.
const (
	DefaultBGPPort      = 179
	DefaultHoldTime     = 90 * time.Second
	DefaultBGPDrainTime = 30 * time.Second
)

// BGP is the node's BGP speaker.
type BGP struct {
	// ASN is the node's own AS number; 0: no speaker.
	ASN      uint32
	RouterID netip.Addr // IPv4
	// ListenPort is where the speaker accepts sessions; 0: it only dials its peers.
	ListenPort uint16
	// NextHop holds at most one address per family, sent as the routes' next hop;
	// for a family without one, the session's own local address.
	NextHop []netip.Addr
	// DrainTimeout is how long `weir node drain` expects established flows to
	// keep coming to this node after its routes are withdrawn.
	DrainTimeout time.Duration
	Peers        []Peer
}

// NextHopFor returns the configured next hop of a's family, if any.
func (b *BGP) NextHopFor(a netip.Addr) (netip.Addr, bool) {
	for _, n := range b.NextHop {
		if n.Is4() == a.Is4() {
			return n, true
		}
	}
	return netip.Addr{}, false
}

// Peer is one BGP neighbour, a router.
type Peer struct {
	Address netip.Addr
	ASN     uint32
	// Port is the peer's BGP port (default 179).
	Port uint16
	// Password turns on TCP MD5 signatures (RFC 2385); "": none.
	Password string
	// HoldTime is proposed to the peer (the session uses the smaller of the two);
	// Keepalive is how often this side sends keepalives (default a third of it).
	HoldTime  time.Duration
	Keepalive time.Duration
	// Multihop is the TTL of the session's packets for a peer more than one hop
	// away; 0: directly connected.
	Multihop uint8
}

// Announce is how a service's VIP is announced over BGP.
type Announce struct {
	// Enabled: the VIP is announced while the service is usable (default true
	// when bgp is configured).
	Enabled bool
	// Communities are standard communities, ASN<<16 | value.
	Communities []uint32
	// MED is sent when not 0. LOCAL_PREF reaches iBGP peers only, as LocalPref when
	// not 0, else as GoBGP's default, 100.
	MED       uint32
	LocalPref uint32
}

// Interface is one network interface to attach XDP to.
type Interface struct {
	Name   string
	Attach Attach
}

// XDP holds the settings of the XDP program, fixed while it is loaded. Zero sizes
// and timeouts take the program's defaults.
type XDP struct {
	// HashSeed seeds flow hashing and the Maglev tables; balancers behind one
	// router's ECMP must share it.
	HashSeed uint32
	// ConntrackSize is how many established flows the connection table holds.
	ConntrackSize uint32
	// HalfOpenSize is how many flows the half-open table holds: flows that have sent
	// only their first packet, the only ones a spoofed flood makes.
	HalfOpenSize uint32
	// HalfOpenTimeout is how long a nat flow keeps its port before its client's
	// second packet.
	HalfOpenTimeout time.Duration
	// NewFlowRate is how many new flows per second each CPU records; over it new nat
	// flows are dropped and new dsr/tunnel flows forwarded unrecorded. 0: no limit.
	NewFlowRate uint32
	// NewFlowBurst is how many new flows may come at once above the rate.
	NewFlowBurst uint32
	// PreviousTableWindow is how long a service's replaced lookup table still
	// sends TCP packets whose connection no flow table knows (opened on another
	// node, or before this one forgot it); 0: no fallback.
	PreviousTableWindow time.Duration
	// PinPath is where maps and the link are pinned (bpffs).
	PinPath string
	// DetachOnStop removes the program when the agent stops; otherwise it stays in
	// place so a restart loses no flow.
	DetachOnStop bool
}

// Admin is the admin API's listeners.
type Admin struct {
	// Socket is the unix socket path, mode 0600.
	Socket string
	// Listen is an optional loopback TCP address (the API has no authentication);
	// the zero value: none.
	Listen netip.AddrPort
}

// Metrics is the Prometheus endpoint.
type Metrics struct {
	// Listen is where /metrics is served (port 0 picks one); the zero value: off.
	Listen netip.AddrPort
	// Public: Listen may be other than loopback (the file said so).
	Public bool
}

// Log configures log/slog.
type Log struct {
	Format LogFormat
	Level  slog.Level
}

// Service is one VIP and its backends.
type Service struct {
	// Name identifies the service in the CLI, logs and metrics: [A-Za-z0-9_.-]+.
	Name      string
	VIP       netip.AddrPort
	Protocol  Protocol
	DataPlane DataPlane
	// Mode is the XDP forwarding mode.
	Mode      Mode
	Algorithm Algorithm
	// Hash is the hash key of maglev and source_hash; zero for other algorithms.
	Hash HashKey
	// TableSize is the Maglev table size, a prime up to MaxTableSize; 0 picks one
	// from the number of backends (docs/algorithms.md).
	TableSize uint32
	AllDown   AllDown
	// DrainTimeout bounds how long a removed or drained backend keeps its
	// connections; 0: no limit.
	DrainTimeout time.Duration
	// SlowStart ramps a backend's share up from a tenth of its weight's to all of it
	// after it is added or becomes usable again (every data plane; see
	// docs/algorithms.md); 0: off.
	SlowStart time.Duration
	Health    Health
	Passive   Passive
	// PanicThreshold is a percentage: below this share of usable backends, every
	// backend is used. 0: panic mode off.
	PanicThreshold int
	Proxy          Proxy
	// BGP is how the VIP is announced when the node runs a BGP speaker.
	BGP Announce
	// HTTP holds the http data plane's settings (data_plane: http only).
	HTTP     HTTP
	Backends []Backend
}

// Key is how the data planes tell services apart: "tcp/10.0.0.1:80".
func (s *Service) Key() string { return string(s.Protocol) + "/" + s.VIP.String() }

// Serving is which data planes may serve a service, from the file alone: the
// agent places it by this (XDP if XDP may serve it and can here, else Else),
// and `weir validate` checks the host by it.
type Serving struct {
	// XDP: XDP may serve it: data_plane xdp, or auto with an algorithm XDP
	// serves (maglev, maglev_p2c, source_hash).
	XDP bool
	// Else is the plane that serves it where XDP does not: the one data_plane
	// names (proxy, http), the proxy for auto; "" when only XDP may serve it.
	Else DataPlane
	// Why says why only XDP may serve it ("data_plane xdp", "udp is served by
	// XDP only"); "" when Else is not.
	Why string
}

// Serving is which data planes may serve s.
func (s *Service) Serving() Serving { return serving(s.DataPlane, s.Algorithm, s.Protocol) }

func serving(dp DataPlane, algo Algorithm, proto Protocol) Serving {
	switch {
	case dp == DataPlaneProxy || dp == DataPlaneHTTP:
		return Serving{Else: dp}
	case dp == DataPlaneXDP:
		return Serving{XDP: true, Why: "data_plane xdp"}
	case proto == UDP: // the proxy and the http plane serve tcp only
		return Serving{XDP: dp == DataPlaneAuto && algo.XDP(), Why: "udp is served by XDP only"}
	}
	return Serving{XDP: dp == DataPlaneAuto && algo.XDP(), Else: DataPlaneProxy}
}

// Health is a service's active health check.
type Health struct {
	Type CheckType
	// Method is how tcp checks are made; http checks always connect.
	Method   CheckMethod
	Interval time.Duration
	Timeout  time.Duration
	Rise     int
	Fall     int
	// Jitter spreads checks over interval × (1 ± jitter); 0: none.
	Jitter float64
	// Initial is the state of a new backend, unless the backend names its own.
	Initial Initial
	// HTTP checks only.
	Path         string
	Host         string
	ExpectStatus []StatusRange
	ExpectBody   string
}

// StatusRange is an inclusive range of HTTP status codes.
type StatusRange struct{ Min, Max int }

// Passive is outlier ejection from what the data planes see of their connections.
type Passive struct {
	// Consecutive failures that eject a backend; 0: off.
	Consecutive        int
	BaseEjection       time.Duration
	MaxEjection        time.Duration
	MaxEjectionPercent int
}

// Proxy holds the settings that apply when the proxy serves the service.
type Proxy struct {
	// Listen is the address the proxy binds: the VIP unless the file names another.
	Listen             netip.AddrPort
	ConnectTimeout     time.Duration
	IdleTimeout        time.Duration
	Retries            int
	MaxConns           int // 0: no limit
	MaxConnsPerBackend int // 0: no limit
	ProxyProtocol      int // 0 off, 1 or 2
	// SockMap says when the kernel forwards a connection's bytes (a socket map and a
	// BPF stream verdict program) instead of the proxy copying or splicing them.
	SockMap SockMap
	// TCPKeepalive is TCP keepalive on the client and backend sockets.
	TCPKeepalive TCPKeepalive
	// TCPUserTimeout bounds how long sent bytes wait to be acknowledged.
	TCPUserTimeout TCPUserTimeout
}

// TCPKeepalive is TCP keepalive on a data plane's client and backend sockets.
type TCPKeepalive struct{ Client, Backend Keepalive }

// TCPUserTimeout is TCP_USER_TIMEOUT on a data plane's client and backend
// sockets (tcp(7)): a connection whose sent bytes stay unacknowledged this
// long (or, with keepalive on, whose probes go unanswered this long) fails.
// Whole milliseconds; 0: off, the kernel's retransmissions decide.
type TCPUserTimeout struct{ Client, Backend time.Duration }

// Keepalive is TCP keepalive on one side's sockets: after Idle with nothing
// received, a probe every Interval; Count unanswered probes end the connection.
// Durations are whole seconds. The zero value is off (the plane's default).
type Keepalive struct {
	Idle, Interval time.Duration
	Count          int
}

// On reports whether k is set.
func (k Keepalive) On() bool { return k.Idle > 0 }

// KeepAliveConfig is k as the net package and the data planes take it.
func (k Keepalive) KeepAliveConfig() net.KeepAliveConfig {
	return net.KeepAliveConfig{Enable: k.On(), Idle: k.Idle, Interval: k.Interval, Count: k.Count}
}

// Upstream is the protocol the http data plane speaks to backends.
type Upstream string

// Upstream protocols.
const (
	// UpstreamAuto: HTTP/2 (cleartext) for requests that came over HTTP/2, HTTP/1.1
	// for those that came over HTTP/1.1.
	UpstreamAuto  Upstream = "auto"
	UpstreamHTTP1 Upstream = "http1"
	UpstreamH2C   Upstream = "h2c"
)

// H2Engine is what serves the http data plane's HTTP/2 clients.
type H2Engine string

// HTTP/2 engines.
const (
	// H2EngineFrames: weir's frame engine (docs/http.md), for clients whose
	// requests go to backends over HTTP/2; the others are net/http's.
	H2EngineFrames H2Engine = "frames"
	// H2EngineNetHTTP: net/http's HTTP/2 server and transport for every client.
	H2EngineNetHTTP H2Engine = "net_http"
)

// H1Engine is what serves the http data plane's HTTP/1.1 clients.
type H1Engine string

// HTTP/1.1 engines.
const (
	// H1EngineLoop: weir's loop per connection (docs/http.md), reading requests
	// with the standard library's parser and writing answers itself.
	H1EngineLoop H1Engine = "loop"
	// H1EngineNetHTTP: net/http's server.
	H1EngineNetHTTP H1Engine = "net_http"
)

// LeastTime is what algorithm least_time measures.
type LeastTime string

// Least-time measures, as NGINX Plus names them.
const (
	LeastTimeHeader   LeastTime = "header"    // until the response headers
	LeastTimeLastByte LeastTime = "last_byte" // until the response's last byte
)

// HashBy is what the http data plane's maglev and source_hash hash.
type HashBy struct {
	Kind HashByKind
	Name string // the header or cookie name
}

// HashByKind is the kind of an HTTP hash key.
type HashByKind string

// HTTP hash keys.
const (
	HashBySource HashByKind = "source" // the client's address
	HashByHeader HashByKind = "header"
	HashByCookie HashByKind = "cookie"
)

// HTTP holds the settings of the http data plane. Zero timeouts are off.
type HTTP struct {
	// Listen is the address the http plane binds: the VIP unless the file names
	// another.
	Listen netip.AddrPort
	// TLSCert and TLSKey are PEM files; with them clients speak TLS and HTTP/2 by
	// ALPN. Empty: cleartext, HTTP/1.1 and HTTP/2 (prior knowledge and h2c upgrade).
	TLSCert, TLSKey string
	Upstream        Upstream
	// H2Engine serves the HTTP/2 clients.
	H2Engine H2Engine
	// H1Engine serves the HTTP/1.1 clients.
	H1Engine H1Engine
	// LeastTime is algorithm least_time's measure; ewma measures until headers.
	LeastTime LeastTime
	// HashBy is the key of maglev and source_hash.
	HashBy            HashBy
	ConnectTimeout    time.Duration
	TryTimeout        time.Duration // one try at one backend, until its response headers
	Timeout           time.Duration // the whole request, every try
	IdleTimeout       time.Duration // a client connection with no request
	ReadHeaderTimeout time.Duration // a request's headers, against slow clients
	MaxHeaderBytes    int
	// Retries is how many other backends a request may be tried on.
	Retries int
	// RetryBudget is the share of requests that may be retries (over the last
	// seconds), so retries cannot multiply an overload.
	RetryBudget float64
	// RetryGRPC lists gRPC methods safe to retry: "/pkg.Service/Method",
	// "/pkg.Service/*" or "*".
	RetryGRPC       []string
	XForwardedFor   bool
	Forwarded       bool
	XForwardedProto bool
	AccessLog       bool
	// TCPKeepalive is TCP keepalive on the client and backend sockets; a side
	// left off keeps Go's runtime's.
	TCPKeepalive TCPKeepalive
	// TCPUserTimeout bounds how long sent bytes wait to be acknowledged.
	TCPUserTimeout TCPUserTimeout
}

// SockMap is the proxy's choice of in-kernel forwarding.
type SockMap string

// In-kernel forwarding settings.
const (
	// SockMapAuto forwards in the kernel where that measured faster than the proxy's
	// own copy and splice path (see docs/proxy.md), and falls back to the proxy on a
	// host without sockmap support. Default.
	SockMapAuto SockMap = "auto"
	SockMapOn   SockMap = "on"  // in the kernel where the host supports it, else the proxy
	SockMapOff  SockMap = "off" // the proxy copies and splices
)

// Backend is one real server.
type Backend struct {
	// Address as the file spells it, for messages; Addr is what it means.
	Address string
	Addr    netip.AddrPort
	// Weight is 0..MaxWeight; 0 takes no new flows.
	Weight uint32
	// CheckAddr is where health checks go.
	CheckAddr netip.AddrPort
	// MAC is the backend's Ethernet address for dsr; nil: resolved through the
	// balancer's neighbour table.
	MAC net.HardwareAddr
	// Drain starts the backend drained: no new flows.
	Drain bool
	// MaxConns limits the proxy's connections to it; 0 takes the service's.
	MaxConns int
	// Initial is the backend's health state when it is first added (its own, or its
	// service's).
	Initial Initial
}
