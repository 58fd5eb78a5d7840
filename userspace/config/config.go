// Package config is weir's configuration file: its types, parsing, defaults and
// validation.
//
// A file is YAML. Unknown fields are errors, so a misspelt setting never passes for
// its default. Parse and Load report every problem at once, each naming the field by
// its path and, where known, its line:
//
//	weir.yaml:14: services[1].backends[3].weight: must be 0..65535, got 70000
//
// A Config returned without error has every default filled in (pointer fields are
// non-nil) and its addresses parsed (the fields tagged yaml:"-"). The package knows
// nothing of BPF, the proxy or the health checker: the agent translates a Config into
// their settings. It builds on every OS.
package config

import (
	"fmt"
	"net/netip"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Defaults applied to settings the file leaves out.
const (
	DefaultAdminSocket     = "/run/weir/weir.sock"
	DefaultMetricsListen   = "127.0.0.1:9470"
	DefaultPinPath         = "/sys/fs/bpf/weir"
	DefaultConntrackSize   = 262144
	DefaultHalfOpenTimeout = 5 * time.Second
	DefaultNewFlowRate     = 125000 // per CPU per second, as Katran's MAX_CONN_RATE
	MinHalfOpenSize        = 1024
	DefaultLogFormat       = "text"
	DefaultLogLevel        = "info"
	DefaultProtocol        = "tcp"
	DefaultDataPlane       = DataPlaneAuto
	DefaultMode            = ModeNAT
	DefaultAllDown         = AllDownDrop
	DefaultDrainTimeout    = 30 * time.Second
	DefaultHealthType      = "tcp"
	DefaultInterval        = 2 * time.Second
	DefaultTimeout         = time.Second
	DefaultRise            = 2
	DefaultFall            = 3
	DefaultJitter          = 0.1
	DefaultHealthInitial   = "up"
	DefaultHTTPPath        = "/"
	DefaultConsecutive     = 5
	DefaultBaseEjection    = 30 * time.Second
	DefaultMaxEjection     = 300 * time.Second
	DefaultMaxEjectionPct  = 10
	DefaultPanicThreshold  = 50
	DefaultConnectTimeout  = 3 * time.Second
	DefaultIdleTimeout     = 10 * time.Minute
	DefaultRetries         = 1
	DefaultWeight          = 1
	MaxWeight              = 65535
)

// Data planes a service can ask for.
const (
	// DataPlaneAuto: XDP when the host can attach it, the service's algorithm is one
	// XDP serves and the program passes its self-test; otherwise the proxy.
	DataPlaneAuto  = "auto"
	DataPlaneXDP   = "xdp"
	DataPlaneProxy = "proxy"
)

// XDP forwarding modes.
const (
	ModeNAT    = "nat"
	ModeDSR    = "dsr"
	ModeTunnel = "tunnel"
)

// What a service does when none of its backends is usable.
const (
	// AllDownDrop drops new flows (XDP) or closes new connections (proxy).
	AllDownDrop = "drop"
	// AllDownPass removes the service from XDP, so its packets go to the host's own
	// stack until a backend is usable again. XDP only.
	AllDownPass = "pass"
	// AllDownKeepLast keeps the backends that were usable last in service.
	AllDownKeepLast = "keep_last"
)

// Hash keys of the hash-based algorithms.
const (
	HashFiveTuple = "5tuple"
	HashSource    = "source"
)

// Balancing algorithms, spelt as userspace/balance spells them (the agent's tests
// check that the two lists agree).
const (
	AlgorithmRoundRobin        = "round_robin"
	AlgorithmRandom            = "random"
	AlgorithmLeastConn         = "least_conn"
	AlgorithmWeightedLeastConn = "weighted_least_conn"
	AlgorithmWeighted          = "weighted"
	AlgorithmP2C               = "p2c"
	AlgorithmEWMA              = "ewma"
	AlgorithmSourceHash        = "source_hash"
	AlgorithmMaglev            = "maglev"
)

// Algorithms lists every algorithm a service may name.
func Algorithms() []string {
	return []string{AlgorithmRoundRobin, AlgorithmRandom, AlgorithmLeastConn, AlgorithmWeightedLeastConn,
		AlgorithmWeighted, AlgorithmP2C, AlgorithmEWMA, AlgorithmSourceHash, AlgorithmMaglev}
}

// XDPAlgorithm reports whether the XDP data plane can serve an algorithm: only the
// hash-based ones, which need no per-connection state beyond the flow table.
func XDPAlgorithm(a string) bool { return a == AlgorithmMaglev || a == AlgorithmSourceHash }

// Config is one configuration file.
type Config struct {
	// Interfaces the XDP program is attached to. None: no XDP, every service is
	// served by the proxy.
	Interfaces []Interface `yaml:"interfaces,omitempty"`
	XDP        XDP         `yaml:"xdp,omitempty"`
	// Addresses are the balancer's own addresses: the source of nat mode's
	// translated packets and of tunnel mode's outer header. Default: the first
	// address of each family on the first interface.
	Addresses []string  `yaml:"addresses,omitempty"`
	Admin     Admin     `yaml:"admin,omitempty"`
	Metrics   Metrics   `yaml:"metrics,omitempty"`
	Log       Log       `yaml:"log,omitempty"`
	Services  []Service `yaml:"services"`

	Addrs []netip.Addr `yaml:"-"` // Addresses, parsed
}

// Interface is one network interface to attach XDP to.
type Interface struct {
	Name string `yaml:"name"`
	// Attach is native, generic or auto (native, else generic). Default auto.
	Attach string `yaml:"attach,omitempty"`
}

// XDP holds the settings of the XDP program, fixed while it is loaded.
type XDP struct {
	// HashSeed seeds flow hashing and the Maglev tables; balancers behind one
	// router's ECMP must share it. Default 0.
	HashSeed uint32 `yaml:"hash_seed,omitempty"`
	// ConntrackSize is how many established flows the connection table holds.
	// Default 262144.
	ConntrackSize uint32 `yaml:"conntrack_size,omitempty"`
	// HalfOpenSize is how many flows the half-open table holds: flows that have
	// sent only their first packet, the only ones a spoofed flood makes. Default a
	// quarter of ConntrackSize, at least MinHalfOpenSize.
	HalfOpenSize uint32 `yaml:"half_open_size,omitempty"`
	// HalfOpenTimeout is how long a nat flow keeps its port before its client's
	// second packet. Default 5s.
	HalfOpenTimeout Duration `yaml:"half_open_timeout,omitempty"`
	// NewFlowRate is how many new flows per second each CPU records; over it new
	// nat flows are dropped and new dsr/tunnel flows forwarded unrecorded. 0 turns
	// the limit off. Default 125000.
	NewFlowRate *uint32 `yaml:"new_flow_rate,omitempty"`
	// NewFlowBurst is how many new flows may come at once above the rate. Default a
	// tenth of a second's worth.
	NewFlowBurst uint32 `yaml:"new_flow_burst,omitempty"`
	// PinPath is where maps and the link are pinned (bpffs). Default /sys/fs/bpf/weir.
	PinPath string `yaml:"pin_path,omitempty"`
	// DetachOnStop removes the program when the agent stops. Default false: the data
	// plane stays in place so a restart loses no flow.
	DetachOnStop bool `yaml:"detach_on_stop,omitempty"`
}

// Equal reports whether x and y are the same settings (NewFlowRate by value).
func (x XDP) Equal(y XDP) bool {
	rate := func(r *uint32) int64 {
		if r == nil {
			return -1
		}
		return int64(*r)
	}
	if rate(x.NewFlowRate) != rate(y.NewFlowRate) {
		return false
	}
	x.NewFlowRate, y.NewFlowRate = nil, nil
	return x == y
}

// Admin is the admin API's listeners.
type Admin struct {
	// Socket is the unix socket path, mode 0600. Default /run/weir/weir.sock.
	Socket string `yaml:"socket,omitempty"`
	// Listen is an optional TCP address (loopback only: the API has no
	// authentication). Default none.
	Listen string `yaml:"listen,omitempty"`
}

// Metrics is the Prometheus endpoint.
type Metrics struct {
	// Listen is host:port for /metrics. Default 127.0.0.1:9470; "off" turns it off.
	Listen string `yaml:"listen,omitempty"`
}

// Log configures log/slog.
type Log struct {
	Format string `yaml:"format,omitempty"` // text or json; default text
	Level  string `yaml:"level,omitempty"`  // debug, info, warn or error; default info
}

// Service is one VIP and its backends.
type Service struct {
	// Name identifies the service in the CLI, logs and metrics: [A-Za-z0-9_.-]+.
	Name string `yaml:"name"`
	// VIP is address:port ([v6]:port for IPv6).
	VIP string `yaml:"vip"`
	// Protocol is tcp or udp. Default tcp.
	Protocol string `yaml:"protocol,omitempty"`
	// DataPlane is auto, xdp or proxy. Default auto.
	DataPlane string `yaml:"data_plane,omitempty"`
	// Mode is the XDP forwarding mode: nat, dsr or tunnel. Default nat.
	Mode string `yaml:"mode,omitempty"`
	// Algorithm is one of Algorithms(). Default maglev, or least_conn when
	// DataPlane is proxy.
	Algorithm string `yaml:"algorithm,omitempty"`
	// Hash is the hash key of maglev: 5tuple or source. Default 5tuple (source
	// for source_hash).
	Hash string `yaml:"hash,omitempty"`
	// TableSize is the Maglev table size, a prime; 0 picks one from the number
	// of backends.
	TableSize uint32 `yaml:"table_size,omitempty"`
	// AllDown is drop, pass or keep_last. Default drop.
	AllDown string `yaml:"all_down,omitempty"`
	// DrainTimeout bounds how long a removed or drained backend keeps its
	// connections on the proxy. Default 30s; 0 means no limit.
	DrainTimeout *Duration `yaml:"drain_timeout,omitempty"`
	// SlowStart ramps a backend's weight up after it becomes usable (proxy only).
	SlowStart Duration `yaml:"slow_start,omitempty"`
	Health    Health   `yaml:"health,omitempty"`
	Passive   Passive  `yaml:"passive,omitempty"`
	// PanicThreshold is a percentage: below this share of usable backends,
	// every backend is used. Default 50; 0 turns panic mode off.
	PanicThreshold *int      `yaml:"panic_threshold,omitempty"`
	Proxy          Proxy     `yaml:"proxy,omitempty"`
	Backends       []Backend `yaml:"backends"`

	VIPAddr netip.AddrPort `yaml:"-"` // VIP, parsed
}

// Health is a service's active health check.
type Health struct {
	Type     string   `yaml:"type,omitempty"` // tcp, http or none; default tcp
	Interval Duration `yaml:"interval,omitempty"`
	Timeout  Duration `yaml:"timeout,omitempty"`
	Rise     *int     `yaml:"rise,omitempty"` // default 2
	Fall     *int     `yaml:"fall,omitempty"` // default 3
	// Jitter spreads checks over interval × (1 ± jitter); 0..0.5, default 0.1.
	Jitter *float64 `yaml:"jitter,omitempty"`
	// Initial is the state of a new backend: up, down or unknown. Default up,
	// so a restarted agent keeps sending to its backends.
	Initial string `yaml:"initial,omitempty"`
	// HTTP checks only.
	Path         string   `yaml:"path,omitempty"`
	Host         string   `yaml:"host,omitempty"`
	ExpectStatus []string `yaml:"expect_status,omitempty"` // "200", "200-399"; default 200-399
	ExpectBody   string   `yaml:"expect_body,omitempty"`

	Status []StatusRange `yaml:"-"` // ExpectStatus, parsed
}

// StatusRange is an inclusive range of HTTP status codes.
type StatusRange struct{ Min, Max int }

// Passive is outlier ejection from what the proxy sees of its connections.
type Passive struct {
	// Consecutive failures that eject a backend. Default 5; 0 turns it off.
	Consecutive        *int     `yaml:"consecutive,omitempty"`
	BaseEjection       Duration `yaml:"base_ejection,omitempty"`
	MaxEjection        Duration `yaml:"max_ejection,omitempty"`
	MaxEjectionPercent *int     `yaml:"max_ejection_percent,omitempty"`
}

// Proxy holds the settings that apply when the proxy serves the service.
type Proxy struct {
	// Listen is the address the proxy binds. Default the VIP.
	Listen             string   `yaml:"listen,omitempty"`
	ConnectTimeout     Duration `yaml:"connect_timeout,omitempty"`
	IdleTimeout        Duration `yaml:"idle_timeout,omitempty"`
	Retries            *int     `yaml:"retries,omitempty"`
	MaxConns           int      `yaml:"max_conns,omitempty"`
	MaxConnsPerBackend int      `yaml:"max_conns_per_backend,omitempty"`
	ProxyProtocol      int      `yaml:"proxy_protocol,omitempty"` // 0, 1 or 2

	ListenAddr netip.AddrPort `yaml:"-"` // Listen, parsed
}

// Backend is one real server.
type Backend struct {
	// Address is ip:port.
	Address string `yaml:"address"`
	// Weight is 0..65535, default 1; 0 takes no new flows.
	Weight *int64 `yaml:"weight,omitempty"`
	// CheckAddress is where health checks go. Default Address.
	CheckAddress string `yaml:"check_address,omitempty"`
	// MAC is the backend's Ethernet address for dsr. Default: resolved through
	// the balancer's neighbour table.
	MAC string `yaml:"mac,omitempty"`
	// Drain starts the backend drained: no new flows.
	Drain bool `yaml:"drain,omitempty"`
	// MaxConns limits the proxy's connections to it; 0 takes the service's.
	MaxConns int `yaml:"max_conns,omitempty"`
	// Initial is the backend's health state when it is first added: up, down or
	// unknown. Default: the service's health.initial.
	Initial string `yaml:"initial,omitempty"`

	Addr      netip.AddrPort `yaml:"-"` // Address, parsed
	CheckAddr netip.AddrPort `yaml:"-"` // CheckAddress (or Address), parsed
}

// Duration is a time.Duration written as Go writes it: 500ms, 2s, 1m30s.
type Duration time.Duration

// D returns the time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

func (d Duration) String() string { return time.Duration(d).String() }

// UnmarshalYAML reads "2s". A malformed value is reported with the other type
// errors of the file.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(strings.TrimSpace(n.Value))
	if n.Kind != yaml.ScalarNode || err != nil {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: must be a duration such as 500ms, 2s or 1m, got %s", n.Line, describe(n))}}
	}
	*d = Duration(v)
	return nil
}

// MarshalYAML writes "2s".
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	return fmt.Sprintf("%q", n.Value)
}

// Key is how the data planes tell services apart: "tcp/10.0.0.1:80".
func (s *Service) Key() string { return s.Protocol + "/" + s.VIPAddr.String() }

// ID is the backend's identity within its service: its address.
func (b *Backend) ID() string { return b.Addr.String() }
