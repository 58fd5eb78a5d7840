package config

import (
	"fmt"
	"net/netip"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// The file's YAML form: private, decoded and validated here, then resolved into
// the typed model (see resolve.go). Fields are exported for the decoder only.

// file is one configuration file as written.
type file struct {
	// Interfaces the XDP program is attached to. None: no XDP, every service is
	// served by the proxy.
	Interfaces []fileInterface `yaml:"interfaces,omitempty"`
	XDP        fileXDP         `yaml:"xdp,omitempty"`
	// Addresses are the balancer's own addresses: the source of nat mode's
	// translated packets and of tunnel mode's outer header. Default: the first
	// address of each family on the first interface.
	Addresses []string    `yaml:"addresses,omitempty"`
	Admin     fileAdmin   `yaml:"admin,omitempty"`
	Metrics   fileMetrics `yaml:"metrics,omitempty"`
	Log       fileLog     `yaml:"log,omitempty"`
	// BGP runs a BGP speaker that announces the VIPs. Default none.
	BGP      *fileBGP      `yaml:"bgp,omitempty"`
	Services []fileService `yaml:"services"`

	Addrs []netip.Addr `yaml:"-"` // Addresses, parsed
}

// Interface is one network interface to attach XDP to.
type fileInterface struct {
	Name string `yaml:"name"`
	// Attach is native, generic or auto (native, else generic). Default auto.
	Attach Attach `yaml:"attach,omitempty"`
}

// XDP holds the settings of the XDP program, fixed while it is loaded.
type fileXDP struct {
	// HashSeed seeds flow hashing and the Maglev tables; balancers behind one
	// router's ECMP must share it. Default 0.
	HashSeed uint32 `yaml:"hash_seed,omitempty"`
	// ConntrackSize is how many established flows the connection table holds.
	// Default: the program's (262144).
	ConntrackSize uint32 `yaml:"conntrack_size,omitempty"`
	// HalfOpenSize is how many flows the half-open table holds: flows that have
	// sent only their first packet, the only ones a spoofed flood makes. Default a
	// quarter of ConntrackSize, at least 1024 (the program's rule).
	HalfOpenSize uint32 `yaml:"half_open_size,omitempty"`
	// HalfOpenTimeout is how long a nat flow keeps its port before its client's
	// second packet. Default 5s.
	HalfOpenTimeout duration `yaml:"half_open_timeout,omitempty"`
	// NewFlowRate is how many new flows per second each CPU records; over it new
	// nat flows are dropped and new dsr/tunnel flows forwarded unrecorded. 0 turns
	// the limit off. Default 125000.
	NewFlowRate *uint32 `yaml:"new_flow_rate,omitempty"`
	// NewFlowBurst is how many new flows may come at once above the rate. Default a
	// tenth of a second's worth.
	NewFlowBurst uint32 `yaml:"new_flow_burst,omitempty"`
	// PreviousTableWindow is how long a service's replaced lookup table still
	// sends TCP packets (not SYNs) whose connection no flow table knows: opened on
	// another node whose flows the router moved here, or before this node forgot
	// it. 0 turns the fallback off. Default 1h.
	PreviousTableWindow *duration `yaml:"previous_table_window,omitempty"`
	// PinPath is where maps and the link are pinned (bpffs). Default /sys/fs/bpf/weir.
	PinPath string `yaml:"pin_path,omitempty"`
	// DetachOnStop removes the program when the agent stops. Default false: the data
	// plane stays in place so a restart loses no flow.
	DetachOnStop bool `yaml:"detach_on_stop,omitempty"`
}

// Admin is the admin API's listeners.
type fileAdmin struct {
	// Socket is the unix socket path, mode 0600. Default /run/weir/weir.sock.
	Socket string `yaml:"socket,omitempty"`
	// Listen is an optional TCP address (loopback only: the API has no
	// authentication). Default none.
	Listen string `yaml:"listen,omitempty"`
}

// Metrics is the Prometheus endpoint.
type fileMetrics struct {
	// Listen is host:port for /metrics. Default 127.0.0.1:9470; "off" turns it off.
	Listen string `yaml:"listen,omitempty"`
	// Public must be true for a listen address other than loopback: the metrics
	// name every service and backend, and nobody off the host should read them by
	// accident.
	Public bool `yaml:"public,omitempty"`

	listenDefault bool // Listen is the default, not the file's
}

// Log configures log/slog.
type fileLog struct {
	Format LogFormat `yaml:"format,omitempty"` // text or json; default text
	Level  string    `yaml:"level,omitempty"`  // debug, info, warn or error; default info
}

// Service is one VIP and its backends.
type fileService struct {
	// Name identifies the service in the CLI, logs and metrics: [A-Za-z0-9_.-]+.
	Name string `yaml:"name"`
	// VIP is address:port ([v6]:port for IPv6).
	VIP string `yaml:"vip"`
	// Protocol is tcp or udp. Default tcp.
	Protocol Protocol `yaml:"protocol,omitempty"`
	// DataPlane is auto, xdp or proxy. Default auto.
	DataPlane DataPlane `yaml:"data_plane,omitempty"`
	// Mode is the XDP forwarding mode: nat, dsr or tunnel. Default nat.
	Mode Mode `yaml:"mode,omitempty"`
	// Algorithm is one of Algorithms(). Default maglev, or least_conn when
	// DataPlane is proxy.
	Algorithm Algorithm `yaml:"algorithm,omitempty"`
	// Hash is the hash key of maglev: 5tuple or source. Default 5tuple (source
	// for source_hash).
	Hash HashKey `yaml:"hash,omitempty"`
	// TableSize is the Maglev table size, a prime; 0 picks one from the number
	// of backends.
	TableSize uint32 `yaml:"table_size,omitempty"`
	// AllDown is drop, pass or keep_last. Default drop.
	AllDown AllDown `yaml:"all_down,omitempty"`
	// DrainTimeout bounds how long a removed or drained backend keeps its
	// connections on the proxy and its tunnels on the http plane. Default 30s;
	// 0 means no limit.
	DrainTimeout *duration `yaml:"drain_timeout,omitempty"`
	// SlowStart ramps a backend's weight up after it is added or becomes usable again.
	SlowStart duration    `yaml:"slow_start,omitempty"`
	Health    fileHealth  `yaml:"health,omitempty"`
	Passive   filePassive `yaml:"passive,omitempty"`
	// PanicThreshold is a percentage: below this share of usable backends,
	// every backend is used. Default 50; 0 turns panic mode off.
	PanicThreshold *int      `yaml:"panic_threshold,omitempty"`
	Proxy          fileProxy `yaml:"proxy,omitempty"`
	HTTP           *fileHTTP `yaml:"http,omitempty"`
	// BGP is the VIP's announce policy; it applies when bgp is configured.
	BGP      fileAnnounce  `yaml:"bgp,omitempty"`
	Backends []fileBackend `yaml:"backends"`

	VIPAddr netip.AddrPort `yaml:"-"` // VIP, parsed
}

// Health is a service's active health check.
type fileHealth struct {
	Type CheckType `yaml:"type,omitempty"` // tcp, http or none; default tcp
	// Method of tcp checks: syn (half-open, needs CAP_NET_RAW), connect, or
	// auto (default): syn when the agent has CAP_NET_RAW.
	Method   CheckMethod `yaml:"method,omitempty"`
	Interval *duration   `yaml:"interval,omitempty"` // default 2s
	Timeout  *duration   `yaml:"timeout,omitempty"`  // default 1s, at most Interval
	Rise     *int        `yaml:"rise,omitempty"`     // default 2
	Fall     *int        `yaml:"fall,omitempty"`     // default 3
	// Jitter spreads checks over interval × (1 ± jitter); 0..0.5, default 0.1.
	Jitter *float64 `yaml:"jitter,omitempty"`
	// Initial is the state of a new backend: up, down or unknown. Default up,
	// so a restarted agent keeps sending to its backends.
	Initial Initial `yaml:"initial,omitempty"`
	// HTTP checks only.
	Path         string   `yaml:"path,omitempty"`
	Host         string   `yaml:"host,omitempty"`
	ExpectStatus []string `yaml:"expect_status,omitempty"` // "200", "200-399"; default 200-399
	ExpectBody   string   `yaml:"expect_body,omitempty"`

	Status []StatusRange `yaml:"-"` // ExpectStatus, parsed
}

// Passive is outlier ejection from what the proxy sees of its connections.
type filePassive struct {
	// Consecutive failures that eject a backend. Default 5; 0 turns it off.
	Consecutive        *int      `yaml:"consecutive,omitempty"`
	BaseEjection       *duration `yaml:"base_ejection,omitempty"` // default 30s
	MaxEjection        *duration `yaml:"max_ejection,omitempty"`  // default 300s, at least BaseEjection
	MaxEjectionPercent *int      `yaml:"max_ejection_percent,omitempty"`
}

// Proxy holds the settings that apply when the proxy serves the service.
type fileProxy struct {
	// Listen is the address the proxy binds. Default the VIP.
	Listen             string    `yaml:"listen,omitempty"`
	ConnectTimeout     *duration `yaml:"connect_timeout,omitempty"` // default 3s
	IdleTimeout        *duration `yaml:"idle_timeout,omitempty"`    // default 10m
	Retries            *int      `yaml:"retries,omitempty"`
	MaxConns           int       `yaml:"max_conns,omitempty"`
	MaxConnsPerBackend int       `yaml:"max_conns_per_backend,omitempty"`
	ProxyProtocol      int       `yaml:"proxy_protocol,omitempty"` // 0, 1 or 2
	SockMap            SockMap   `yaml:"sockmap,omitempty"`        // auto (default), on, off
	// TCPKeepalive probes idle peers of the client and backend sockets. Default off.
	TCPKeepalive fileTCPKeepalive `yaml:"tcp_keepalive,omitempty"`
	// TCPUserTimeout bounds how long sent bytes may go unacknowledged on the
	// client and backend sockets. Default off (the kernel's retransmissions).
	TCPUserTimeout fileTCPUserTimeout `yaml:"tcp_user_timeout,omitempty"`

	ListenAddr netip.AddrPort `yaml:"-"` // Listen, parsed
}

// fileTCPKeepalive is TCP keepalive on a data plane's client and backend
// sockets; a side that is left out keeps the plane's default.
type fileTCPKeepalive struct {
	Client  *fileKeepalive `yaml:"client,omitempty"`
	Backend *fileKeepalive `yaml:"backend,omitempty"`
}

// fileKeepalive is TCP keepalive on one side's sockets: after Idle with nothing
// received a probe every Interval, and Count unanswered probes end the
// connection. Whole seconds: the kernel takes seconds.
type fileKeepalive struct {
	Idle     *duration `yaml:"idle,omitempty"`     // default 60s
	Interval *duration `yaml:"interval,omitempty"` // default 10s
	Count    *int      `yaml:"count,omitempty"`    // default 6
}

// A side named with no value ("client:") is on, with the defaults.
func (*fileKeepalive) onWhenNamed() {}

// fileTCPUserTimeout is TCP_USER_TIMEOUT on a data plane's client and backend
// sockets; a side that is left out has none.
type fileTCPUserTimeout struct {
	Client  *duration `yaml:"client,omitempty"`
	Backend *duration `yaml:"backend,omitempty"`
}

// HTTP holds the settings of the http data plane (data_plane: http).
type fileHTTP struct {
	// Listen is the address the http plane binds. Default the VIP.
	Listen string `yaml:"listen,omitempty"`
	// TLS: certificate and key files (PEM); with them, TLS with HTTP/2 by ALPN.
	TLS struct {
		Cert string `yaml:"cert,omitempty"`
		Key  string `yaml:"key,omitempty"`
	} `yaml:"tls,omitempty"`
	// Upstream is auto (default: as the client spoke), http1 or h2c.
	Upstream Upstream `yaml:"upstream,omitempty"`
	// H2Engine is frames (default) or net_http: what serves HTTP/2 clients.
	H2Engine H2Engine `yaml:"h2_engine,omitempty"`
	// H1Engine is loop (default) or net_http: what serves HTTP/1.1 clients.
	H1Engine H1Engine `yaml:"h1_engine,omitempty"`
	// LeastTime is header (default) or last_byte, for algorithm least_time.
	LeastTime LeastTime `yaml:"least_time,omitempty"`
	// HashBy is source (default), header:NAME or cookie:NAME, for maglev and
	// source_hash.
	HashBy            string    `yaml:"hash_by,omitempty"`
	ConnectTimeout    *duration `yaml:"connect_timeout,omitempty"`     // default 3s
	TryTimeout        duration  `yaml:"try_timeout,omitempty"`         // default none
	Timeout           duration  `yaml:"timeout,omitempty"`             // default none
	IdleTimeout       *duration `yaml:"idle_timeout,omitempty"`        // default 5m
	ReadHeaderTimeout *duration `yaml:"read_header_timeout,omitempty"` // default 10s
	MaxHeaderBytes    *int      `yaml:"max_header_bytes,omitempty"`    // default 65536
	Retries           *int      `yaml:"retries,omitempty"`             // default 2
	RetryBudget       *float64  `yaml:"retry_budget,omitempty"`        // default 0.2
	RetryGRPC         []string  `yaml:"retry_grpc,omitempty"`
	XForwardedFor     *bool     `yaml:"x_forwarded_for,omitempty"`   // default true
	Forwarded         bool      `yaml:"forwarded,omitempty"`         // default false
	XForwardedProto   *bool     `yaml:"x_forwarded_proto,omitempty"` // default true
	AccessLog         bool      `yaml:"access_log,omitempty"`
	// TCPKeepalive probes idle peers of the client and backend sockets. Default
	// Go's runtime's (15s, 15s, 9 probes; 30s idle for backend connections but
	// the frame engine's and tunnels').
	TCPKeepalive fileTCPKeepalive `yaml:"tcp_keepalive,omitempty"`
	// TCPUserTimeout bounds how long sent bytes may go unacknowledged on the
	// client and backend sockets. Default off (the kernel's retransmissions).
	TCPUserTimeout fileTCPUserTimeout `yaml:"tcp_user_timeout,omitempty"`

	ListenAddr netip.AddrPort `yaml:"-"` // Listen, parsed
	Hash       HashBy         `yaml:"-"` // HashBy, parsed
}

// Backend is one real server.
type fileBackend struct {
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
	Initial Initial `yaml:"initial,omitempty"`

	Addr      netip.AddrPort `yaml:"-"` // Address, parsed
	CheckAddr netip.AddrPort `yaml:"-"` // CheckAddress (or Address), parsed
}

// BGP is the node's BGP speaker.
type fileBGP struct {
	// ASN is the node's AS number, 1..4294967295.
	ASN uint32 `yaml:"asn"`
	// RouterID is an IPv4 address identifying the speaker.
	RouterID string `yaml:"router_id"`
	// ListenPort accepts sessions there; 0 (default): no listener, the node
	// dials its peers.
	ListenPort int `yaml:"listen_port,omitempty"`
	// NextHop is at most one address per family. Default: the session's own
	// local address.
	NextHop []string `yaml:"next_hop,omitempty"`
	// DrainTimeout is how long a drained node keeps serving the flows that
	// still reach it. Default 30s.
	DrainTimeout *duration  `yaml:"drain_timeout,omitempty"`
	Peers        []filePeer `yaml:"peers"`

	RouterAddr netip.Addr   `yaml:"-"` // RouterID, parsed
	NextHops   []netip.Addr `yaml:"-"` // NextHop, parsed
}

// Peer is one BGP neighbour.
type filePeer struct {
	Address string `yaml:"address"`
	ASN     uint32 `yaml:"asn"`
	// Port is the peer's BGP port. Default 179.
	Port     int    `yaml:"port,omitempty"`
	Password string `yaml:"password,omitempty"`
	// HoldTime is 3s..65535s. Default 90s.
	HoldTime *duration `yaml:"hold_time,omitempty"`
	// Keepalive defaults to a third of HoldTime.
	Keepalive duration `yaml:"keepalive,omitempty"`
	// Multihop is the TTL for a peer more than one hop away, 1..255. Default
	// 0: directly connected.
	Multihop int `yaml:"multihop,omitempty"`

	Addr netip.Addr `yaml:"-"` // Address, parsed
}

// Announce is a service's BGP announce policy.
type fileAnnounce struct {
	// Announce the VIP while the service is usable. Default true.
	Announce *bool `yaml:"announce,omitempty"`
	// Communities are "ASN:value" standard communities.
	Communities []string `yaml:"communities,omitempty"`
	MED         uint32   `yaml:"med,omitempty"`
	LocalPref   uint32   `yaml:"local_pref,omitempty"`

	Comms []uint32 `yaml:"-"` // Communities, parsed
}

// duration is a time.Duration written as Go writes it: 500ms, 2s, 1m30s.
type duration time.Duration

// D returns the time.Duration.
func (d duration) D() time.Duration { return time.Duration(d) }

func (d duration) String() string { return time.Duration(d).String() }

// UnmarshalYAML reads "2s". A malformed value is reported with the other type
// errors of the file.
func (d *duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(strings.TrimSpace(n.Value))
	if n.Kind != yaml.ScalarNode || err != nil {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: must be a duration such as 500ms, 2s or 1m, got %s", n.Line, describe(n))}}
	}
	*d = duration(v)
	return nil
}

// MarshalYAML writes "2s".
func (d duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

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
func (s *fileService) Key() string { return string(s.Protocol) + "/" + s.VIPAddr.String() }
