package config

import (
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

func ptr[T any](v T) *T { return &v }

// defaults fills in every setting the file left out.
func (c *file) defaults() {
	for i := range c.Interfaces {
		if c.Interfaces[i].Attach == "" {
			c.Interfaces[i].Attach = AttachAuto
		}
	}
	if c.XDP.NewFlowRate == nil {
		c.XDP.NewFlowRate = ptr(uint32(DefaultNewFlowRate))
	}
	if c.XDP.PinPath == "" {
		c.XDP.PinPath = DefaultPinPath
	}
	if c.Admin.Socket == "" {
		c.Admin.Socket = DefaultAdminSocket
	}
	if c.Metrics.Listen == "" {
		c.Metrics.Listen = DefaultMetricsListen
	}
	if c.Log.Format == "" {
		c.Log.Format = DefaultLogFormat
	}
	if c.Log.Level == "" {
		c.Log.Level = strings.ToLower(DefaultLogLevel.String())
	}
	for i := range c.Services {
		c.Services[i].defaults()
	}
}

func (s *fileService) defaults() {
	if s.Protocol == "" {
		s.Protocol = DefaultProtocol
	}
	s.Protocol = Protocol(strings.ToLower(string(s.Protocol)))
	if s.DataPlane == "" {
		s.DataPlane = DefaultDataPlane
	}
	if s.Mode == "" {
		s.Mode = DefaultMode
	}
	if s.Algorithm == "" {
		s.Algorithm = AlgorithmMaglev
		if s.DataPlane == DataPlaneProxy {
			s.Algorithm = AlgorithmLeastConn
		}
	}
	if s.Hash == "" && s.Algorithm.XDP() {
		s.Hash = HashFiveTuple
		if s.Algorithm == AlgorithmSourceHash {
			s.Hash = HashSource
		}
	}
	if s.AllDown == "" {
		s.AllDown = DefaultAllDown
	}
	if s.DrainTimeout == nil {
		s.DrainTimeout = ptr(duration(DefaultDrainTimeout))
	}
	h := &s.Health
	if h.Type == "" {
		h.Type = DefaultHealthType
	}
	if h.Method == "" {
		h.Method = DefaultHealthMethod
	}
	if h.Interval == 0 {
		h.Interval = duration(DefaultInterval)
	}
	if h.Timeout == 0 {
		h.Timeout = duration(min(DefaultTimeout, h.Interval.D()))
	}
	if h.Rise == nil {
		h.Rise = ptr(DefaultRise)
	}
	if h.Fall == nil {
		h.Fall = ptr(DefaultFall)
	}
	if h.Jitter == nil {
		h.Jitter = ptr(DefaultJitter)
	}
	if h.Initial == "" {
		h.Initial = DefaultHealthInitial
	}
	if h.Type == CheckHTTP {
		if h.Path == "" {
			h.Path = DefaultHTTPPath
		}
		if len(h.ExpectStatus) == 0 {
			h.ExpectStatus = []string{"200-399"}
		}
	}
	ps := &s.Passive
	if ps.Consecutive == nil {
		ps.Consecutive = ptr(DefaultConsecutive)
	}
	if ps.BaseEjection == 0 {
		ps.BaseEjection = duration(DefaultBaseEjection)
	}
	if ps.MaxEjection == 0 {
		ps.MaxEjection = duration(max(DefaultMaxEjection, ps.BaseEjection.D()))
	}
	if ps.MaxEjectionPercent == nil {
		ps.MaxEjectionPercent = ptr(DefaultMaxEjectionPct)
	}
	if s.PanicThreshold == nil {
		s.PanicThreshold = ptr(DefaultPanicThreshold)
	}
	px := &s.Proxy
	if px.ConnectTimeout == 0 {
		px.ConnectTimeout = duration(DefaultConnectTimeout)
	}
	if px.IdleTimeout == 0 {
		px.IdleTimeout = duration(DefaultIdleTimeout)
	}
	if px.Retries == nil {
		px.Retries = ptr(DefaultRetries)
	}
	if px.SockMap == "" {
		px.SockMap = SockMapAuto
	}
	for i := range s.Backends {
		b := &s.Backends[i]
		if b.Weight == nil {
			b.Weight = ptr(int64(DefaultWeight))
		}
		if b.CheckAddress == "" {
			b.CheckAddress = b.Address
		}
	}
}

// checker collects validation errors.
type checker struct{ errs []*FieldError }

func (c *checker) bad(path, format string, args ...any) {
	c.errs = append(c.errs, &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)})
}

func oneOf[T ~string](c *checker, path string, got T, want ...T) bool {
	if slices.Contains(want, got) {
		return true
	}
	c.bad(path, "must be %s, got %q", orList(want), got)
	return false
}

func orList[T ~string](w []T) string {
	s := make([]string, len(w))
	for i, v := range w {
		s[i] = string(v)
	}
	if len(s) == 1 {
		return s[0]
	}
	return strings.Join(s[:len(s)-1], ", ") + " or " + s[len(s)-1]
}

func (c *checker) positive(path string, d duration) {
	if d <= 0 {
		c.bad(path, "must be positive, got %v", d)
	}
}

// addr parses an IP literal (no zone, IPv4 dotted).
func (c *checker) addr(path, s string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(s)
	switch {
	case s == "":
		c.bad(path, "missing: write an IP address")
	case err != nil:
		c.bad(path, "must be an IP address, got %q", s)
	case a.Zone() != "":
		c.bad(path, "must be an address without a zone, got %q", s)
	case a.Is4In6():
		c.bad(path, "write IPv4 addresses in dotted form, got %q", s)
	default:
		return a, true
	}
	return netip.Addr{}, false
}

// addrPort parses ip:port with a port in 1..65535.
func (c *checker) addrPort(path, s string) (netip.AddrPort, bool) {
	if s == "" {
		c.bad(path, "missing: write address:port ([address]:port for IPv6)")
		return netip.AddrPort{}, false
	}
	ap, err := netip.ParseAddrPort(s)
	switch {
	case err != nil:
		c.bad(path, "must be address:port ([address]:port for IPv6), got %q", s)
	case ap.Addr().Zone() != "":
		c.bad(path, "must be an address without a zone, got %q", s)
	case ap.Addr().Is4In6():
		c.bad(path, "write IPv4 addresses in dotted form, got %q", s)
	case ap.Port() == 0:
		c.bad(path, "port must be 1..65535, got 0")
	default:
		return ap, true
	}
	return netip.AddrPort{}, false
}

var (
	nameRE   = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)
	ifnameRE = regexp.MustCompile(`^[^/\s:]{1,15}$`)
)

func family(a netip.Addr) string {
	if a.Is4() {
		return "IPv4"
	}
	return "IPv6"
}

// validate checks every setting and cross-setting rule and fills in the parsed
// fields. It assumes defaults have been applied.
func (cfg *file) validate() []*FieldError {
	c := &checker{}
	seenIf := map[string]int{}
	for i, in := range cfg.Interfaces {
		p := fmt.Sprintf("interfaces[%d]", i)
		switch j, dup := seenIf[in.Name]; {
		case in.Name == "":
			c.bad(p+".name", "missing: name the interface to attach XDP to, e.g. eth0")
		case !ifnameRE.MatchString(in.Name):
			c.bad(p+".name", "must be an interface name (up to 15 characters, no '/', ':' or spaces), got %q", in.Name)
		case dup:
			c.bad(p+".name", "%q is already listed as interfaces[%d]", in.Name, j)
		}
		seenIf[in.Name] = i
		oneOf(c, p+".attach", in.Attach, AttachNative, AttachGeneric, AttachAuto)
	}
	if d := cfg.XDP.HalfOpenTimeout.D(); d < 0 || d > 0 && (d < 100*time.Millisecond || d > 10*time.Minute) {
		c.bad("xdp.half_open_timeout", "must be 100ms..10m, got %s", d)
	}
	if cfg.XDP.NewFlowRate != nil && *cfg.XDP.NewFlowRate > 1_000_000_000 {
		c.bad("xdp.new_flow_rate", "must be 0 (no limit) ..1000000000 flows per second per CPU, got %d", *cfg.XDP.NewFlowRate)
	}
	if cfg.XDP.PinPath != "" && !filepath.IsAbs(cfg.XDP.PinPath) {
		c.bad("xdp.pin_path", "must be an absolute path under a bpffs mount, got %q", cfg.XDP.PinPath)
	}
	cfg.Addrs = nil
	for i, s := range cfg.Addresses {
		p := fmt.Sprintf("addresses[%d]", i)
		if a, ok := c.addr(p, s); ok {
			if j := slices.Index(cfg.Addrs, a); j >= 0 {
				c.bad(p, "%s is already listed", a)
				continue
			}
			cfg.Addrs = append(cfg.Addrs, a)
		}
	}
	if !filepath.IsAbs(cfg.Admin.Socket) {
		c.bad("admin.socket", "must be an absolute path, got %q", cfg.Admin.Socket)
	}
	if cfg.Admin.Listen != "" {
		if ap, ok := c.addrPort("admin.listen", cfg.Admin.Listen); ok && !ap.Addr().IsLoopback() {
			c.bad("admin.listen", "must be a loopback address (the admin API has no authentication), got %s", ap)
		}
	}
	if cfg.Metrics.Listen != "off" {
		if c.hostPort("metrics.listen", cfg.Metrics.Listen) && !cfg.Metrics.Public {
			if ap := netip.MustParseAddrPort(cfg.Metrics.Listen); !ap.Addr().IsLoopback() {
				c.bad("metrics.listen", "%s is not a loopback address, so every metric would be served to the network: set metrics.public: true if that is meant", ap.Addr())
			}
		}
	}
	oneOf(c, "log.format", cfg.Log.Format, LogText, LogJSON)
	oneOf(c, "log.level", cfg.Log.Level, "debug", "info", "warn", "error")

	xdpPossible := len(cfg.Interfaces) > 0
	names := map[string]int{}
	keys := map[string]int{}
	listens := map[netip.AddrPort]int{}
	for i := range cfg.Services {
		s := &cfg.Services[i]
		p := fmt.Sprintf("services[%d]", i)
		switch j, dup := names[s.Name]; {
		case s.Name == "":
			c.bad(p+".name", "missing: every service needs a name (letters, digits, '_', '.', '-')")
		case !nameRE.MatchString(s.Name):
			c.bad(p+".name", "must be 1-64 letters, digits, '_', '.' or '-', got %q", s.Name)
		case dup:
			c.bad(p+".name", "%q is already the name of services[%d]", s.Name, j)
		}
		names[s.Name] = i
		s.validate(c, p, xdpPossible)
		if s.VIPAddr.IsValid() && (s.Protocol == TCP || s.Protocol == UDP) {
			if j, dup := keys[s.Key()]; dup {
				c.bad(p+".vip", "%s %s is already served by services[%d] (%q): one VIP, port and protocol per service",
					s.Protocol, s.VIPAddr, j, cfg.Services[j].Name)
			}
			keys[s.Key()] = i
		}
		if s.Proxy.ListenAddr.IsValid() && s.Protocol == TCP && s.DataPlane != DataPlaneXDP {
			if j, dup := listens[s.Proxy.ListenAddr]; dup && s.Proxy.Listen != "" {
				c.bad(p+".proxy.listen", "%s is already the proxy address of services[%d]", s.Proxy.ListenAddr, j)
			}
			listens[s.Proxy.ListenAddr] = i
		}
	}
	return c.errs
}

// hostPort checks host:port where host is an IP literal, and reports whether it is
// one.
func (c *checker) hostPort(path, s string) bool {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		c.bad(path, "must be address:port, got %q", s)
		return false
	}
	ok := true
	if a, err := netip.ParseAddr(host); err != nil || a.Zone() != "" {
		c.bad(path, "must be an IP address and port, got %q", s)
		ok = false
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		c.bad(path, "port must be 0..65535, got %q", port)
		ok = false
	}
	return ok
}

func (s *fileService) validate(c *checker, p string, xdpPossible bool) {
	vip, vipOK := c.addrPort(p+".vip", s.VIP)
	if vipOK && (vip.Addr().IsUnspecified() || vip.Addr().IsMulticast()) {
		c.bad(p+".vip", "must be a unicast address, got %s", vip.Addr())
		vipOK = false
	}
	if vipOK {
		s.VIPAddr = vip
	}
	protoOK := oneOf(c, p+".protocol", s.Protocol, TCP, UDP)
	dpOK := oneOf(c, p+".data_plane", s.DataPlane, DataPlaneAuto, DataPlaneXDP, DataPlaneProxy)
	modeOK := oneOf(c, p+".mode", s.Mode, ModeNAT, ModeDSR, ModeTunnel)
	algoOK := oneOf(c, p+".algorithm", s.Algorithm, Algorithms()...)
	oneOf(c, p+".all_down", s.AllDown, AllDownDrop, AllDownPass, AllDownKeepLast)

	// Which data planes can serve this service, from the config alone.
	if dpOK && algoOK && protoOK {
		hashAlgo := s.Algorithm.XDP()
		switch {
		case s.DataPlane == DataPlaneXDP && !hashAlgo:
			c.bad(p+".algorithm", "%s needs the proxy data plane (it sees every connection end; XDP serves only maglev and source_hash): use data_plane proxy or auto, or algorithm maglev", s.Algorithm)
		case s.DataPlane == DataPlaneXDP && !xdpPossible:
			c.bad(p+".data_plane", "xdp needs at least one entry in interfaces")
		case s.Protocol == UDP && s.DataPlane == DataPlaneProxy:
			c.bad(p+".data_plane", "the proxy serves tcp only: use data_plane xdp or auto for a udp service")
		case s.Protocol == UDP && !hashAlgo:
			c.bad(p+".algorithm", "%s is a proxy algorithm and the proxy serves tcp only: use maglev or source_hash for a udp service", s.Algorithm)
		case s.Protocol == UDP && !xdpPossible:
			c.bad(p+".protocol", "udp is served by XDP only, and interfaces is empty: list an interface to attach XDP to")
		}
		if s.Hash != "" && !hashAlgo {
			c.bad(p+".hash", "only maglev and source_hash hash; %s does not (remove hash)", s.Algorithm)
		} else if hashAlgo && oneOf(c, p+".hash", s.Hash, HashFiveTuple, HashSource) &&
			s.Algorithm == AlgorithmSourceHash && s.Hash != HashSource {
			c.bad(p+".hash", "source_hash always hashes the source address; remove hash or use maglev")
		}
		if s.DataPlane == DataPlaneXDP && s.SlowStart > 0 {
			c.bad(p+".slow_start", "only the proxy ramps weights; remove it or use data_plane proxy or auto")
		}
		if s.DataPlane == DataPlaneProxy && s.AllDown == AllDownPass {
			c.bad(p+".all_down", "pass hands packets to the host's stack, which only XDP can do; use drop or keep_last")
		}
	}
	if s.SlowStart < 0 {
		c.bad(p+".slow_start", "must be 0 or positive, got %v", s.SlowStart)
	}
	if s.DrainTimeout.D() < 0 {
		c.bad(p+".drain_timeout", "must be 0 (no limit) or positive, got %v", *s.DrainTimeout)
	}
	if s.TableSize != 0 && (!isPrime(s.TableSize) || int(s.TableSize) < len(s.Backends)) {
		c.bad(p+".table_size", "must be a prime at least the number of backends (%d), got %d; leave it out to pick one", len(s.Backends), s.TableSize)
	}
	if *s.PanicThreshold < 0 || *s.PanicThreshold > 100 {
		c.bad(p+".panic_threshold", "must be 0..100 (percent; 0 turns panic mode off), got %d", *s.PanicThreshold)
	}
	s.Health.validate(c, p+".health")
	s.Passive.validate(c, p+".passive")
	s.Proxy.validate(c, p+".proxy", s.VIPAddr)

	// The XDP mode's needs, unless the proxy serves the service whatever happens.
	// (The balancer's own addresses that nat and tunnel send from are checked when
	// the agent starts: they default to the interface's.)
	usesXDP := s.DataPlane != DataPlaneProxy && xdpPossible && modeOK && vipOK

	if len(s.Backends) == 0 {
		c.bad(p+".backends", "missing: a service needs at least one backend")
	}
	seen := map[netip.AddrPort]int{}
	total, badWeight := int64(0), false
	for i := range s.Backends {
		b := &s.Backends[i]
		bp := fmt.Sprintf("%s.backends[%d]", p, i)
		if ap, ok := c.addrPort(bp+".address", b.Address); ok {
			b.Addr = ap
			if j, dup := seen[ap]; dup {
				c.bad(bp+".address", "%s is already backends[%d]; merge the entries", ap, j)
			}
			seen[ap] = i
			if ap.Addr().IsUnspecified() || ap.Addr().IsMulticast() {
				c.bad(bp+".address", "must be a unicast address, got %s", ap.Addr())
			}
			if usesXDP && s.Mode == ModeNAT && ap.Addr().Is4() != vip.Addr().Is4() {
				c.bad(bp+".address", "nat mode keeps the VIP's family (%s), got %s", family(vip.Addr()), ap.Addr())
			}
			if usesXDP && s.Mode == ModeDSR && ap.Port() != vip.Port() {
				c.bad(bp+".address", "dsr mode cannot change the port: the backend must listen on the VIP's port %d, got %d", vip.Port(), ap.Port())
			}
		}
		if ap, ok := c.addrPort(bp+".check_address", b.CheckAddress); ok {
			b.CheckAddr = ap
		}
		switch w := *b.Weight; {
		case w < 0 || w > MaxWeight:
			c.bad(bp+".weight", "must be 0..%d, got %d", MaxWeight, w)
			badWeight = true // reported; "every weight is 0" would only add noise
		default:
			total += w
		}
		if b.MAC != "" {
			if hw, err := net.ParseMAC(b.MAC); err != nil || len(hw) != 6 {
				c.bad(bp+".mac", "must be a 6-byte Ethernet address such as 02:00:00:00:00:01, got %q", b.MAC)
			}
		}
		if b.Initial != "" {
			oneOf(c, bp+".initial", b.Initial, InitialUp, InitialDown, InitialUnknown)
		}
		if b.MaxConns < 0 {
			c.bad(bp+".max_conns", "must be 0 (the service's limit) or positive, got %d", b.MaxConns)
		}
	}
	if len(s.Backends) > 0 && total == 0 && !badWeight {
		c.bad(p+".backends", "every weight is 0, so no backend could take a flow; give at least one a weight > 0")
	}
}

func (h *fileHealth) validate(c *checker, p string) {
	typeOK := oneOf(c, p+".type", h.Type, CheckTCP, CheckHTTP, CheckNone)
	if oneOf(c, p+".method", h.Method, MethodAuto, MethodSyn, MethodConnect) && typeOK &&
		h.Method == MethodSyn && h.Type != CheckTCP {
		c.bad(p+".method", "syn applies to tcp checks only, and type is %s", h.Type)
	}
	c.positive(p+".interval", h.Interval)
	c.positive(p+".timeout", h.Timeout)
	if *h.Rise < 1 {
		c.bad(p+".rise", "must be at least 1, got %d", *h.Rise)
	}
	if *h.Fall < 1 {
		c.bad(p+".fall", "must be at least 1, got %d", *h.Fall)
	}
	if *h.Jitter < 0 || *h.Jitter > 0.5 {
		c.bad(p+".jitter", "must be 0..0.5, got %g", *h.Jitter)
	}
	oneOf(c, p+".initial", h.Initial, InitialUp, InitialDown, InitialUnknown)
	if !typeOK || h.Type == CheckHTTP {
		if !strings.HasPrefix(h.Path, "/") || strings.ContainsAny(h.Path, " \r\n") {
			c.bad(p+".path", "must start with / and hold no spaces or line breaks, got %q", h.Path)
		}
		if strings.ContainsAny(h.Host, " \r\n/") {
			c.bad(p+".host", "must be a host name, got %q", h.Host)
		}
		h.Status = nil
		for i, st := range h.ExpectStatus {
			lo, hi, isRange := strings.Cut(st, "-")
			if !isRange {
				hi = lo
			}
			a, errA := strconv.Atoi(strings.TrimSpace(lo))
			b, errB := strconv.Atoi(strings.TrimSpace(hi))
			if errA != nil || errB != nil || a < 100 || b > 599 || a > b {
				c.bad(fmt.Sprintf("%s.expect_status[%d]", p, i), "must be a status code or range within 100-599 such as 200 or 200-399, got %q", st)
				continue
			}
			h.Status = append(h.Status, StatusRange{a, b})
		}
		return
	}
	for field, set := range map[string]bool{"path": h.Path != "", "host": h.Host != "",
		"expect_status": len(h.ExpectStatus) > 0, "expect_body": h.ExpectBody != ""} {
		if set {
			c.bad(p+"."+field, "only http checks use it, and type is %s", h.Type)
		}
	}
}

func (ps *filePassive) validate(c *checker, p string) {
	if *ps.Consecutive < 0 {
		c.bad(p+".consecutive", "must be 0 (off) or positive, got %d", *ps.Consecutive)
	}
	c.positive(p+".base_ejection", ps.BaseEjection)
	if ps.MaxEjection < ps.BaseEjection {
		c.bad(p+".max_ejection", "must be at least base_ejection (%v), got %v", ps.BaseEjection, ps.MaxEjection)
	}
	if *ps.MaxEjectionPercent < 0 || *ps.MaxEjectionPercent > 100 {
		c.bad(p+".max_ejection_percent", "must be 0..100, got %d", *ps.MaxEjectionPercent)
	}
}

func (px *fileProxy) validate(c *checker, p string, vip netip.AddrPort) {
	px.ListenAddr = vip
	if px.Listen != "" {
		px.ListenAddr = netip.AddrPort{}
		if ap, ok := c.addrPort(p+".listen", px.Listen); ok {
			px.ListenAddr = ap
		}
	}
	c.positive(p+".connect_timeout", px.ConnectTimeout)
	c.positive(p+".idle_timeout", px.IdleTimeout)
	if *px.Retries < 0 {
		c.bad(p+".retries", "must be 0 or more, got %d", *px.Retries)
	}
	if px.MaxConns < 0 {
		c.bad(p+".max_conns", "must be 0 (no limit) or positive, got %d", px.MaxConns)
	}
	if px.MaxConnsPerBackend < 0 {
		c.bad(p+".max_conns_per_backend", "must be 0 (no limit) or positive, got %d", px.MaxConnsPerBackend)
	}
	if px.ProxyProtocol < 0 || px.ProxyProtocol > 2 {
		c.bad(p+".proxy_protocol", "must be 0 (off), 1 or 2, got %d", px.ProxyProtocol)
	}
	oneOf(c, p+".sockmap", px.SockMap, SockMapAuto, SockMapOn, SockMapOff)
}

func isPrime(n uint32) bool {
	if n < 2 {
		return false
	}
	for d := uint32(2); uint64(d)*uint64(d) <= uint64(n); d++ {
		if n%d == 0 {
			return false
		}
	}
	return true
}
