package config

import (
	"fmt"
	"net"
	"net/netip"
	"net/textproto"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
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
	if c.XDP.PreviousTableWindow == nil {
		c.XDP.PreviousTableWindow = ptr(duration(DefaultPreviousTableWindow))
	}
	if c.XDP.PinPath == "" {
		c.XDP.PinPath = DefaultPinPath
	}
	if c.Admin.Socket == "" {
		c.Admin.Socket = DefaultAdminSocket
	}
	if c.Metrics.Listen == "" {
		c.Metrics.Listen, c.Metrics.listenDefault = DefaultMetricsListen, true
	}
	if c.Log.Format == "" {
		c.Log.Format = DefaultLogFormat
	}
	if c.Log.Level == "" {
		c.Log.Level = strings.ToLower(DefaultLogLevel.String())
	}
	if b := c.BGP; b != nil {
		if b.DrainTimeout == nil {
			b.DrainTimeout = ptr(duration(DefaultBGPDrainTime))
		}
		for i := range b.Peers {
			p := &b.Peers[i]
			if p.Port == 0 {
				p.Port = DefaultBGPPort
			}
			if p.HoldTime == nil {
				p.HoldTime = ptr(duration(DefaultHoldTime))
			}
			if p.Keepalive == 0 && *p.HoldTime > 0 {
				p.Keepalive = duration(max(time.Second, (p.HoldTime.D() / 3).Truncate(time.Second)))
			}
		}
	}
	for i := range c.Services {
		c.Services[i].defaults()
		if c.Services[i].BGP.Announce == nil {
			c.Services[i].BGP.Announce = ptr(true)
		}
	}
}

func (s *fileService) defaults() {
	if s.Protocol == "" {
		s.Protocol = DefaultProtocol
	}
	if s.DataPlane == "" {
		s.DataPlane = DefaultDataPlane
	}
	if s.Mode == "" {
		s.Mode = DefaultMode
	}
	if s.Algorithm == "" {
		s.Algorithm = AlgorithmMaglev
		if s.DataPlane == DataPlaneProxy || s.DataPlane == DataPlaneHTTP {
			s.Algorithm = AlgorithmLeastConn
		}
	}
	if s.Hash == "" && s.Algorithm.XDP() && s.DataPlane != DataPlaneHTTP {
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
	// A setting left out takes its default; one written 0 is refused by validate
	// (it must be positive), not taken for the default.
	if h.Interval == nil {
		h.Interval = ptr(duration(DefaultInterval))
	}
	if h.Timeout == nil {
		// From a wrong interval, no timeout: the interval's error is the one to read.
		h.Timeout = ptr(duration(DefaultTimeout))
		if *h.Interval > 0 {
			h.Timeout = ptr(duration(min(DefaultTimeout, h.Interval.D())))
		}
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
	if ps.BaseEjection == nil {
		ps.BaseEjection = ptr(duration(DefaultBaseEjection))
	}
	if ps.MaxEjection == nil {
		ps.MaxEjection = ptr(duration(max(DefaultMaxEjection, ps.BaseEjection.D())))
	}
	if ps.MaxEjectionPercent == nil {
		ps.MaxEjectionPercent = ptr(DefaultMaxEjectionPct)
	}
	if s.PanicThreshold == nil {
		s.PanicThreshold = ptr(DefaultPanicThreshold)
	}
	px := &s.Proxy
	if px.ConnectTimeout == nil {
		px.ConnectTimeout = ptr(duration(DefaultConnectTimeout))
	}
	if px.IdleTimeout == nil {
		px.IdleTimeout = ptr(duration(DefaultIdleTimeout))
	}
	if px.Retries == nil {
		px.Retries = ptr(DefaultRetries)
	}
	if px.SockMap == "" {
		px.SockMap = SockMapAuto
	}
	px.TCPKeepalive.defaults()
	if s.DataPlane == DataPlaneHTTP {
		if s.HTTP == nil {
			s.HTTP = &fileHTTP{}
		}
		s.HTTP.defaults()
	}
	for i := range s.Backends {
		b := &s.Backends[i]
		if b.Weight == nil {
			b.Weight = ptr(int64(DefaultWeight))
		}
	}
}

// checker collects validation errors.
type checker struct {
	errs []*FieldError
	dir  string // relative paths are taken from here ("": the working directory)
}

func (c *checker) bad(path, format string, args ...any) {
	c.errs = append(c.errs, &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)})
}

// oneOf checks an enum. Every enum is spelt exactly as the docs write it, in
// lower case, as YAML keys are: a value in other case is refused like any other
// (a hint says so), rather than some enums taking it and others not.
func oneOf[T ~string](c *checker, path string, got T, want ...T) bool {
	if slices.Contains(want, got) {
		return true
	}
	hint := ""
	if lower := T(strings.ToLower(string(got))); lower != got && slices.Contains(want, lower) {
		hint = fmt.Sprintf(" (values are lower case: write %s)", lower)
	}
	c.bad(path, "must be %s, got %q%s", orList(want), got, hint)
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

// addr parses an IP literal as ipLiteral does, and refuses an IPv6 link-local
// address, which no address field can use.
func (c *checker) addr(path, s string) (netip.Addr, bool) {
	a, ok := c.ipLiteral(path, s)
	if ok && a.Is6() && a.IsLinkLocalUnicast() {
		c.linkLocal(path, a)
		return netip.Addr{}, false
	}
	return a, ok
}

// ipLiteral parses an IP literal (no zone, IPv4 dotted). Most fields want addr;
// bgp.router_id, an IPv4 identifier rather than an address, says what else is
// wrong with an IPv6 one.
func (c *checker) ipLiteral(path, s string) (netip.Addr, bool) {
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

// linkLocal refuses an IPv6 link-local address: fe80::/10 exists once per link,
// and without a zone (which no address field takes) nothing can bind it, dial it
// or route to it.
func (c *checker) linkLocal(path string, a netip.Addr) {
	c.bad(path, "%s is an IPv6 link-local address, which means something only with a zone (an interface), and this field takes none: use a global or unique-local (fd00::/8) address", a)
}

// unicast parses an IP literal as addr does, and refuses the unspecified and
// multicast addresses, which no session or route can go to.
func (c *checker) unicast(path, s string) (netip.Addr, bool) {
	a, ok := c.addr(path, s)
	if ok && (a.IsUnspecified() || a.IsMulticast()) {
		c.bad(path, "must be a unicast address, got %s", a)
		return netip.Addr{}, false
	}
	return a, ok
}

// addrPort parses ip:port with a port in 1..65535.
func (c *checker) addrPort(path, s string) (netip.AddrPort, bool) {
	if s == "" {
		c.bad(path, "missing: write address:port ([address]:port for IPv6)")
		return netip.AddrPort{}, false
	}
	ap, ok := c.hostPort(path, s)
	if ok && ap.Port() == 0 {
		c.bad(path, "port must be 1..65535, got 0")
		return netip.AddrPort{}, false
	}
	return ap, ok
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
func (cfg *file) validate(dir string) []*FieldError {
	c := &checker{dir: dir}
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
		if i == MaxInterfaces {
			c.bad(p, "the XDP program attaches to at most %d interfaces, and %d are listed", MaxInterfaces, len(cfg.Interfaces))
		}
	}
	for _, t := range []struct {
		field string
		size  uint32
	}{{"xdp.conntrack_size", cfg.XDP.ConntrackSize}, {"xdp.half_open_size", cfg.XDP.HalfOpenSize}} {
		if size := t.size; size != 0 && (size < MinFlowTableSize || size > MaxFlowTableSize) {
			c.bad(t.field, "must be %d..%d flows (or left out for the program's default); each table is reserved whole at load, about 730 bytes of kernel memory per unit over all of them, got %d",
				MinFlowTableSize, MaxFlowTableSize, size)
		}
	}
	if d := cfg.XDP.HalfOpenTimeout.D(); d < 0 || d > 0 && (d < 100*time.Millisecond || d > 10*time.Minute) {
		c.bad("xdp.half_open_timeout", "must be 100ms..10m, got %s", d)
	}
	if cfg.XDP.NewFlowRate != nil && *cfg.XDP.NewFlowRate > 1_000_000_000 {
		c.bad("xdp.new_flow_rate", "must be 0 (no limit) ..1000000000 flows per second per CPU, got %d", *cfg.XDP.NewFlowRate)
	}
	if w := cfg.XDP.PreviousTableWindow; w != nil && (w.D() < 0 || w.D() > 24*time.Hour) {
		c.bad("xdp.previous_table_window", "must be 0 (no fallback) ..24h, got %s", w.D())
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
	// The agent's own listeners, which nothing else may bind: see clashes.
	var own []ownListener
	// The BGP speaker listens on its port at every address of both families.
	if b := cfg.BGP; b != nil && b.ListenPort > 0 && b.ListenPort <= 65535 {
		own = append(own, ownListener{"bgp.listen_port", netip.AddrPortFrom(netip.IPv6Unspecified(), uint16(b.ListenPort))})
	}
	ownOnce := func(field string, ap netip.AddrPort) {
		for _, o := range own {
			if clashes(o.addr, ap) {
				c.bad(field, "%s is also %s (%s): give one of them another address", ap, o.field, o.addr)
			}
		}
		own = append(own, ownListener{field, ap})
	}
	if cfg.Metrics.Listen != "off" {
		if ap, ok := c.hostPort("metrics.listen", cfg.Metrics.Listen); ok {
			if !cfg.Metrics.Public && !ap.Addr().IsLoopback() {
				c.bad("metrics.listen", "%s is not a loopback address, so every metric would be served to the network: set metrics.public: true if that is meant", ap.Addr())
			}
			if !cfg.Metrics.listenDefault {
				ownOnce("metrics.listen", ap)
			} else {
				// Left out, it is reported on the listener the file names.
				for _, o := range own {
					if clashes(o.addr, ap) {
						c.bad(o.field, "%s is also the default metrics.listen (%s): set metrics.listen to another address (or off), or change this one", o.addr, ap)
					}
				}
				own = append(own, ownListener{"the default metrics.listen", ap})
			}
		}
	}
	if cfg.Admin.Listen != "" {
		if ap, ok := c.addrPort("admin.listen", cfg.Admin.Listen); ok {
			if !ap.Addr().IsLoopback() {
				c.bad("admin.listen", "must be a loopback address (the admin API has no authentication), got %s", ap)
			}
			ownOnce("admin.listen", ap)
		}
	}
	oneOf(c, "log.format", cfg.Log.Format, LogText, LogJSON)
	oneOf(c, "log.level", cfg.Log.Level, "debug", "info", "warn", "error")

	xdpPossible := len(cfg.Interfaces) > 0
	var xdpCount xdpSlots
	names := map[string]int{}
	keys := map[string]int{}
	type listenUse struct {
		service int
		what    string
	}
	listens := map[netip.AddrPort]listenUse{}
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
		if xdpPossible && s.serving().XDP {
			xdpCount.add(c, p, s)
		}
		vipTaken := false
		if s.VIPAddr.IsValid() && (s.Protocol == TCP || s.Protocol == UDP) {
			if j, dup := keys[s.Key()]; dup {
				vipTaken = true
				c.bad(p+".vip", "%s %s is already served by services[%d] (%q): one VIP, port and protocol per service",
					s.Protocol, s.VIPAddr, j, cfg.Services[j].Name)
			}
			keys[s.Key()] = i
		}
		// Two listeners on one address would both bind it (SO_REUSEPORT) and share
		// its connections, whichever service names it and whichever defaults to its VIP.
		listenOnce := func(field, explicit string, a netip.AddrPort, what string) {
			for _, o := range own {
				if clashes(o.addr, a) {
					where := p + "." + field
					if explicit == "" {
						where = p + ".vip"
					}
					c.bad(where, "%s is also %s (%s), where the agent listens itself: give one of them another address", a, o.field, o.addr)
				}
			}
			u, dup := listens[a]
			switch {
			case dup && explicit != "":
				c.bad(p+"."+field, "%s is already the %s of services[%d] (%q)", a, u.what, u.service, cfg.Services[u.service].Name)
			case dup && !vipTaken:
				c.bad(p+".vip", "%s is already the %s of services[%d] (%q), and this service listens on its VIP: set %s",
					a, u.what, u.service, cfg.Services[u.service].Name, field)
			}
			listens[a] = listenUse{i, what}
		}
		// XDP takes every tcp packet to an xdp service's VIP before the host's stack
		// sees it, so a listener on that address would get none: another
		// service's, or the agent's own (metrics.listen, admin.listen). One of the
		// agent's on every address still gets the packets to the others.
		if s.VIPAddr.IsValid() && s.Protocol == TCP && s.serving().Else == "" && !vipTaken {
			if u, dup := listens[s.VIPAddr]; dup {
				c.bad(p+".vip", "%s is already the %s of services[%d] (%q), and XDP would take every tcp packet to it: give one of them another address",
					s.VIPAddr, u.what, u.service, cfg.Services[u.service].Name)
			}
			for _, o := range own {
				if o.addr == s.VIPAddr {
					c.bad(p+".vip", "%s is also %s, where the agent listens itself, and XDP would take every tcp packet to it: give one of them another address",
						s.VIPAddr, o.field)
				}
			}
			listens[s.VIPAddr] = listenUse{i, "VIP (served by XDP)"}
		}
		if s.Proxy.ListenAddr.IsValid() && s.Protocol == TCP && s.serving().Else == DataPlaneProxy {
			listenOnce("proxy.listen", s.Proxy.Listen, s.Proxy.ListenAddr, "proxy address")
		}
		if h := s.HTTP; h != nil && h.ListenAddr.IsValid() && s.DataPlane == DataPlaneHTTP {
			listenOnce("http.listen", h.Listen, h.ListenAddr, "listen address")
		}
	}
	cfg.validateBGP(c) // after the services: it reads their parsed VIPs
	return c.errs
}

// xdpSlots counts what the services XDP may serve take of the program's fixed
// capacities, so that a file it cannot hold is refused here, naming the service
// or backend past the limit, rather than when the agent applies it.
type xdpSlots struct {
	services, backends int
	entries            uint64 // lookup table entries
	entriesFull        bool   // reported once
}

func (x *xdpSlots) add(c *checker, p string, s *fileService) {
	x.services++
	if x.services == MaxXDPServices+1 { // the first past the limit, reported once
		c.bad(p, "the XDP program holds at most %d services, and this is service %d that XDP may serve (data_plane xdp, or auto with maglev, maglev_p2c or source_hash): serve the rest with data_plane proxy or on another node", MaxXDPServices, x.services)
	}
	for j := range s.Backends {
		x.backends++
		if x.backends == MaxXDPBackends+1 {
			c.bad(fmt.Sprintf("%s.backends[%d]", p, j), "the XDP program holds at most %d backends over all its services (each service's own, a backend in two services counting twice), and this is backend %d: serve some services with data_plane proxy or on another node", MaxXDPBackends, x.backends)
		}
	}
	if s.TableSize > MaxTableSize {
		return // refused on its own
	}
	size, where := uint64(s.TableSize), p+".table_size"
	if size == 0 {
		size, where = uint64(DefaultTableSize(len(s.Backends))), p
	}
	tables := uint64(1)
	if s.Algorithm == AlgorithmMaglevP2C {
		tables = 2
	}
	x.entries += tables * size
	if x.entries > MaxTableEntries && !x.entriesFull {
		x.entriesFull = true
		c.bad(where, "the XDP program holds at most %d lookup table entries over all its services (1 GiB, and as much again for their previous generations), and with this service's %d they would be %d: give services a smaller table_size, or serve some with data_plane proxy or on another node",
			MaxTableEntries, tables*size, x.entries)
	}
}

// ownListener is one of the agent's own TCP listeners (admin.listen,
// metrics.listen, the BGP speaker's on bgp.listen_port).
type ownListener struct {
	field string
	addr  netip.AddrPort
}

// clashes reports whether a listener on b cannot bind beside the agent's own
// listener on own: the agent binds its own without SO_REUSEPORT, so they clash
// on one port at one address, or when either is a wildcard (Go listens on
// both families for 0.0.0.0 as for [::]). Port 0 picks a free port.
func clashes(own, b netip.AddrPort) bool {
	return own.Port() != 0 && own.Port() == b.Port() &&
		(own.Addr() == b.Addr() || own.Addr().IsUnspecified() || b.Addr().IsUnspecified())
}

// validateBGP checks the speaker's settings and every service's announce policy.
func (cfg *file) validateBGP(c *checker) {
	b := cfg.BGP
	if b == nil {
		for i, s := range cfg.Services {
			a := s.BGP
			if len(a.Communities) > 0 || a.MED != 0 || a.LocalPref != 0 || a.Announce != nil && !*a.Announce {
				c.bad(fmt.Sprintf("services[%d].bgp", i), "an announce policy needs the top-level bgp section (the node's ASN, router_id and peers)")
			}
		}
		return
	}
	if b.ASN == 0 {
		c.bad("bgp.asn", "missing: the node's AS number, 1..4294967295")
	}
	if a, ok := c.ipLiteral("bgp.router_id", b.RouterID); ok {
		switch {
		case !a.Is4():
			c.bad("bgp.router_id", "must be an IPv4 address (BGP identifiers are 32 bits), got %s", a)
		case a.IsUnspecified():
			c.bad("bgp.router_id", "must not be 0.0.0.0: a BGP identifier is not 0 (RFC 6286), and peers refuse it; use the node's own IPv4 address")
		}
		b.RouterAddr = a
	}
	if b.ListenPort < 0 || b.ListenPort > 65535 {
		c.bad("bgp.listen_port", "must be 0 (no listener: the node dials its peers) ..65535, got %d", b.ListenPort)
	}
	b.NextHops = nil
	for i, s := range b.NextHop {
		p := fmt.Sprintf("bgp.next_hop[%d]", i)
		a, ok := c.unicast(p, s)
		if !ok {
			continue
		}
		if slices.ContainsFunc(b.NextHops, func(n netip.Addr) bool { return n.Is4() == a.Is4() }) {
			c.bad(p, "one next hop per address family; %s is the second %s one", a, family(a))
			continue
		}
		b.NextHops = append(b.NextHops, a)
	}
	if b.DrainTimeout.D() < 0 {
		c.bad("bgp.drain_timeout", "must be 0 or positive, got %v", *b.DrainTimeout)
	}
	if len(b.Peers) == 0 {
		c.bad("bgp.peers", "missing: list at least one peer (address, asn)")
	}
	families := map[bool]bool{} // is IPv4 -> a next hop can be sent
	for _, n := range b.NextHops {
		families[n.Is4()] = true
	}
	seen := map[netip.Addr]int{}
	for i := range b.Peers {
		pr := &b.Peers[i]
		p := fmt.Sprintf("bgp.peers[%d]", i)
		if a, ok := c.unicast(p+".address", pr.Address); ok {
			if j, dup := seen[a]; dup {
				c.bad(p+".address", "%s is already bgp.peers[%d]", a, j)
			}
			seen[a] = i
			pr.Addr = a
			families[a.Is4()] = true
		}
		if pr.ASN == 0 {
			c.bad(p+".asn", "missing: the peer's AS number, 1..4294967295")
		}
		if pr.Port < 1 || pr.Port > 65535 {
			c.bad(p+".port", "must be 1..65535, got %d", pr.Port)
		}
		switch h := pr.HoldTime.D(); {
		case h == 0:
			// RFC 4271 allows 0 (no keepalives), but weir's BGP speaker
			// (GoBGP) takes 0 for "unset" and proposes 90s instead.
			c.bad(p+".hold_time", "must be 3s..65535s: weir's BGP speaker cannot propose 0 (no keepalives)")
		case h < 3*time.Second || h > 65535*time.Second:
			c.bad(p+".hold_time", "must be 3s..65535s (RFC 4271), got %v", h)
		case h%time.Second != 0:
			c.bad(p+".hold_time", "must be whole seconds (BGP carries seconds), got %v", h)
		case pr.Keepalive.D() < time.Second || pr.Keepalive.D() >= h || pr.Keepalive.D()%time.Second != 0:
			c.bad(p+".keepalive", "must be whole seconds, at least 1s and below hold_time (%v), got %v", h, pr.Keepalive)
		}
		if len(pr.Password) > 80 {
			c.bad(p+".password", "must be at most 80 bytes (the TCP MD5 key limit), got %d", len(pr.Password))
		}
		if pr.Multihop < 0 || pr.Multihop > 255 {
			c.bad(p+".multihop", "must be 0 (directly connected) or a TTL of 1..255, got %d", pr.Multihop)
		}
	}
	cfg.validateBGPPort(c)
	// Services that share a VIP address share its route, so they must agree on it.
	policy := map[netip.Addr]int{}
	for i := range cfg.Services {
		s := &cfg.Services[i]
		p := fmt.Sprintf("services[%d].bgp", i)
		s.BGP.Comms = nil
		for j, cs := range s.BGP.Communities {
			v, ok := parseCommunity(cs)
			if !ok {
				c.bad(fmt.Sprintf("%s.communities[%d]", p, j), "must be ASN:value, each 0..65535, such as 65000:100, got %q", cs)
				continue
			}
			s.BGP.Comms = append(s.BGP.Comms, v)
		}
		if !s.VIPAddr.IsValid() || !*s.BGP.Announce {
			continue
		}
		vip := s.VIPAddr.Addr()
		if !families[vip.Is4()] {
			c.bad(p, "the %s VIP %s has no next hop to be announced with: add an %s bgp.next_hop or an %s peer", family(vip), vip, family(vip), family(vip))
		}
		if j, ok := policy[vip]; ok {
			o := &cfg.Services[j].BGP
			if !slices.Equal(o.Communities, s.BGP.Communities) || o.MED != s.BGP.MED || o.LocalPref != s.BGP.LocalPref {
				c.bad(p, "services[%d] announces the same address %s with another policy: one route per address, so give both the same bgp settings", j, vip)
			}
			continue
		}
		policy[vip] = i
	}
}

// validateBGPPort refuses a tcp VIP that XDP may serve at bgp.listen_port on
// an address peers reach the speaker at: the node's own (addresses,
// bgp.router_id, bgp.next_hop). XDP takes every tcp packet to the VIP before the
// host's stack sees it, so a peer's session there would go to the service's
// backends instead of the speaker. A VIP at another address is let be: the
// speaker listens at every address, but peers dial the node's own.
func (cfg *file) validateBGPPort(c *checker) {
	b := cfg.BGP
	if b.ListenPort <= 0 || b.ListenPort > 65535 || len(cfg.Interfaces) == 0 {
		return
	}
	own := map[netip.Addr]string{} // address -> the first field that names it
	name := func(a netip.Addr, field string) {
		if _, ok := own[a]; a.IsValid() && !ok {
			own[a] = field
		}
	}
	for i, str := range cfg.Addresses {
		a, _ := netip.ParseAddr(str) // refused above if it does not parse
		name(a, fmt.Sprintf("addresses[%d]", i))
	}
	name(b.RouterAddr, "bgp.router_id")
	for i, str := range b.NextHop {
		a, _ := netip.ParseAddr(str)
		name(a, fmt.Sprintf("bgp.next_hop[%d]", i))
	}
	for i := range cfg.Services {
		s := &cfg.Services[i]
		where, ok := own[s.VIPAddr.Addr()]
		if ok && s.VIPAddr.IsValid() && takesSpeakerPort(s.VIPAddr, s.Protocol, s.serving().XDP, uint16(b.ListenPort)) {
			c.bad(fmt.Sprintf("services[%d].vip", i), "%s", speakerPortClash(s.VIPAddr, where))
		}
	}
}

// takesSpeakerPort reports whether XDP would take the BGP sessions peers open
// to vip's address on the speaker's port: a tcp VIP that XDP may serve there.
func takesSpeakerPort(vip netip.AddrPort, proto Protocol, mayUseXDP bool, listenPort uint16) bool {
	return vip.Port() == listenPort && proto == TCP && mayUseXDP
}

// speakerPortClash is the error of a VIP at the node's own address (named by
// where) on bgp.listen_port.
func speakerPortClash(vip netip.AddrPort, where string) string {
	return fmt.Sprintf("%s is the node's own address (%s) at bgp.listen_port, where BGP peers reach the speaker, and XDP would take every tcp packet to it for this service's backends: give the VIP another address or port", vip, where)
}

func parseCommunity(s string) (uint32, bool) {
	hi, lo, ok := strings.Cut(s, ":")
	a, errA := strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
	b, errB := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
	return uint32(a)<<16 | uint32(b), ok && errA == nil && errB == nil
}

// hostPort parses address:port with a port in 0..65535 (0: any free one), as
// resolve parses it, so what passes here resolves.
func (c *checker) hostPort(path, s string) (netip.AddrPort, bool) {
	ap, err := netip.ParseAddrPort(s)
	switch {
	case err != nil:
		c.bad(path, "must be address:port ([address]:port for IPv6), got %q", s)
	case ap.Addr().Zone() != "":
		c.bad(path, "must be an address without a zone, got %q", s)
	case ap.Addr().Is4In6():
		c.bad(path, "write IPv4 addresses in dotted form, got %q", s)
	case ap.Addr().Is6() && ap.Addr().IsLinkLocalUnicast():
		c.linkLocal(path, ap.Addr())
	default:
		return ap, true
	}
	return netip.AddrPort{}, false
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
	dpOK := oneOf(c, p+".data_plane", s.DataPlane, DataPlaneAuto, DataPlaneXDP, DataPlaneProxy, DataPlaneHTTP)
	modeOK := oneOf(c, p+".mode", s.Mode, ModeNAT, ModeDSR, ModeTunnel)
	algoOK := oneOf(c, p+".algorithm", s.Algorithm, Algorithms()...)
	oneOf(c, p+".all_down", s.AllDown, AllDownDrop, AllDownPass, AllDownKeepLast)

	// Which data planes can serve this service, from the config alone.
	if dpOK && algoOK && protoOK {
		hashAlgo := s.Algorithm.XDP()
		switch {
		case s.DataPlane == DataPlaneXDP && !hashAlgo:
			c.bad(p+".algorithm", "%s needs the proxy data plane (it sees every connection end; XDP serves only maglev, maglev_p2c and source_hash): use data_plane proxy or auto, or algorithm maglev", s.Algorithm)
		case s.DataPlane == DataPlaneXDP && !xdpPossible:
			c.bad(p+".data_plane", "xdp needs at least one entry in interfaces")
		case s.Protocol == UDP && (s.DataPlane == DataPlaneProxy || s.DataPlane == DataPlaneHTTP):
			who := "the proxy"
			if s.DataPlane == DataPlaneHTTP {
				who = "the http data plane"
			}
			c.bad(p+".data_plane", "%s serves tcp only: use data_plane xdp or auto for a udp service", who)
		case s.DataPlane == DataPlaneHTTP:
			// Every algorithm serves http; its hash key is http.hash_by.
		case s.Protocol == UDP && !hashAlgo:
			c.bad(p+".algorithm", "%s is a proxy algorithm and the proxy serves tcp only: use maglev, maglev_p2c or source_hash for a udp service", s.Algorithm)
		case s.Protocol == UDP && !xdpPossible:
			c.bad(p+".protocol", "udp is served by XDP only, and interfaces is empty: list an interface to attach XDP to")
		}
		switch {
		case s.DataPlane == DataPlaneHTTP:
			if s.Hash != "" {
				c.bad(p+".hash", "the http data plane hashes by http.hash_by (source, header:NAME or cookie:NAME); remove hash")
			}
		case s.Hash != "" && !hashAlgo:
			c.bad(p+".hash", "only maglev, maglev_p2c and source_hash hash; %s does not (remove hash)", s.Algorithm)
		case hashAlgo && oneOf(c, p+".hash", s.Hash, HashFiveTuple, HashSource) &&
			s.Algorithm == AlgorithmSourceHash && s.Hash != HashSource:
			c.bad(p+".hash", "source_hash always hashes the source address; remove hash or use maglev")
		case s.Algorithm == AlgorithmMaglevP2C && s.Hash == HashSource:
			c.bad(p+".hash", "maglev_p2c may send one client's flows to either of two backends, which breaks source affinity; use hash 5tuple, or algorithm maglev or source_hash")
		}
		// Only a service XDP may serve: not data_plane proxy or http, nor auto with an
		// algorithm XDP does not serve.
		switch {
		case s.AllDown != AllDownPass:
		case s.DataPlane == DataPlaneProxy || s.DataPlane == DataPlaneHTTP:
			c.bad(p+".all_down", "pass hands packets to the host's stack, which only XDP can do; use drop or keep_last")
		case !hashAlgo:
			c.bad(p+".all_down", "pass hands packets to the host's stack, which only XDP can do, and XDP does not serve %s; use drop or keep_last", s.Algorithm)
		}
	}
	if s.SlowStart < 0 {
		c.bad(p+".slow_start", "must be 0 or positive, got %v", s.SlowStart)
	}
	if s.DrainTimeout.D() < 0 {
		c.bad(p+".drain_timeout", "must be 0 (no limit) or positive, got %v", *s.DrainTimeout)
	}
	if s.TableSize != 0 && (!isPrime(s.TableSize) || int(s.TableSize) < len(s.Backends) || s.TableSize > MaxTableSize) {
		c.bad(p+".table_size", "must be a prime from the number of backends (%d) to %d, got %d; leave it out to pick one", len(s.Backends), MaxTableSize, s.TableSize)
	}
	if *s.PanicThreshold < 0 || *s.PanicThreshold > 100 {
		c.bad(p+".panic_threshold", "must be 0..100 (percent; 0 turns panic mode off), got %d", *s.PanicThreshold)
	}
	s.Health.validate(c, p+".health")
	s.Passive.validate(c, p+".passive")
	s.Proxy.validate(c, p+".proxy", s.VIPAddr)
	if s.HTTP != nil && s.DataPlane != DataPlaneHTTP {
		c.bad(p+".http", "only data_plane http uses it, and data_plane is %s", s.DataPlane)
	} else if s.HTTP != nil {
		s.HTTP.validate(c, p+".http", s.VIPAddr, s.Algorithm)
	}

	// The XDP mode's needs, for a service XDP may serve: not one the proxy or the
	// http plane serves whatever happens (data_plane proxy or http, or auto with an
	// algorithm XDP does not serve). (The balancer's own addresses that nat and
	// tunnel send from are checked when the agent starts: they default to the
	// interface's.)
	planes := s.serving()
	usesXDP := planes.XDP && xdpPossible && modeOK && vipOK

	if len(s.Backends) == 0 {
		c.bad(p+".backends", "missing: a service needs at least one backend")
	}
	// Where the service itself takes connections: a backend there would send every
	// connection round to the service again.
	self := map[netip.AddrPort]string{}
	if vipOK && planes.XDP {
		self[vip] = "VIP"
	}
	if vipOK && s.Protocol == TCP {
		switch {
		case s.DataPlane == DataPlaneHTTP && s.HTTP != nil && s.HTTP.Listen != "":
			self[s.HTTP.ListenAddr] = "http.listen"
		case planes.Else == DataPlaneProxy && s.Proxy.Listen != "":
			self[s.Proxy.ListenAddr] = "proxy.listen"
		case planes.Else != "":
			self[vip] = "VIP" // the listener's address by default
		}
	}
	seen := map[netip.AddrPort]int{}
	total, badWeight := int64(0), false
	for i := range s.Backends {
		b := &s.Backends[i]
		bp := fmt.Sprintf("%s.backends[%d]", p, i)
		if ap, ok := c.addrPort(bp+".address", b.Address); ok {
			b.Addr = ap
			if what, ok := self[ap]; ok && ap.IsValid() {
				c.bad(bp+".address", "%s is this service's own %s: every connection would come back to the service", ap, what)
			}
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
			// dsr rewrites only MACs and tunnel carries the client's packet unchanged
			// inside its outer header: either way it reaches the backend's VIP:port.
			if usesXDP && (s.Mode == ModeDSR || s.Mode == ModeTunnel) && ap.Port() != vip.Port() {
				c.bad(bp+".address", "%s mode cannot change the port: the backend must listen on the VIP's port %d, got %d", s.Mode, vip.Port(), ap.Port())
			}
		}
		// Checks go to the address unless the file names another: a wrong address is
		// reported once, as address.
		b.CheckAddr = b.Addr
		if b.CheckAddress != "" {
			b.CheckAddr = netip.AddrPort{}
			if ap, ok := c.addrPort(bp+".check_address", b.CheckAddress); ok {
				b.CheckAddr = ap
			}
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

// serving is which data planes may serve the service (Service.Serving); XDP
// only when interfaces are listed.
func (s *fileService) serving() Serving { return serving(s.DataPlane, s.Algorithm, s.Protocol) }

func (h *fileHealth) validate(c *checker, p string) {
	typeOK := oneOf(c, p+".type", h.Type, CheckTCP, CheckHTTP, CheckNone)
	if oneOf(c, p+".method", h.Method, MethodAuto, MethodSyn, MethodConnect) && typeOK &&
		h.Method == MethodSyn && h.Type != CheckTCP {
		c.bad(p+".method", "syn applies to tcp checks only, and type is %s", h.Type)
	}
	switch iv := h.Interval.D(); {
	case iv < MinHealthInterval:
		c.bad(p+".interval", "must be at least %v (checking more often only loads the backends and the checker), got %v", MinHealthInterval, iv)
	case h.Timeout.D() < MinHealthTimeout:
		c.bad(p+".timeout", "must be at least %v (a shorter one fails healthy backends whenever the host is busy), got %v", MinHealthTimeout, h.Timeout.D())
	case h.Timeout.D() > iv:
		c.bad(p+".timeout", "must be at most interval (%v), so a check ends before the next one of its backend starts, got %v", iv, h.Timeout.D())
	}
	if *h.Rise < 1 {
		c.bad(p+".rise", "must be at least 1, got %d", *h.Rise)
	}
	if *h.Fall < 1 {
		c.bad(p+".fall", "must be at least 1, got %d", *h.Fall)
	}
	if !(*h.Jitter >= 0 && *h.Jitter <= 0.5) { // NaN too
		c.bad(p+".jitter", "must be 0..0.5, got %g", *h.Jitter)
	}
	oneOf(c, p+".initial", h.Initial, InitialUp, InitialDown, InitialUnknown)
	if !typeOK || h.Type == CheckHTTP {
		// Both go into the check's request as written, where a space or a control
		// character would make a request no server takes.
		// (With a misspelt type the path has no default: only one the file names is
		// checked.)
		if (h.Path != "" || h.Type == CheckHTTP) && (!strings.HasPrefix(h.Path, "/") || strings.IndexFunc(h.Path, spaceOrControl) >= 0) {
			c.bad(p+".path", "must start with / and hold no spaces or control characters, got %q", h.Path)
		}
		if strings.IndexFunc(h.Host, spaceOrControl) >= 0 || strings.Contains(h.Host, "/") {
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

// spaceOrControl reports a byte a request line or header value may not hold as
// weir writes them: space, tab, line breaks and other control characters.
func spaceOrControl(r rune) bool { return r == ' ' || unicode.IsControl(r) }

func (ps *filePassive) validate(c *checker, p string) {
	if *ps.Consecutive < 0 {
		c.bad(p+".consecutive", "must be 0 (off) or positive, got %d", *ps.Consecutive)
	}
	c.positive(p+".base_ejection", *ps.BaseEjection)
	if *ps.MaxEjection < *ps.BaseEjection {
		c.bad(p+".max_ejection", "must be at least base_ejection (%v), got %v", *ps.BaseEjection, *ps.MaxEjection)
	}
	// 1, not 0: the checker always allows one ejection, and takes a 0 for
	// its default (10), so a 0 written here would have allowed more, not fewer.
	if *ps.MaxEjectionPercent < 1 || *ps.MaxEjectionPercent > 100 {
		c.bad(p+".max_ejection_percent", "must be 1..100 (one backend may always be ejected), got %d", *ps.MaxEjectionPercent)
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
	c.positive(p+".connect_timeout", *px.ConnectTimeout)
	c.positive(p+".idle_timeout", *px.IdleTimeout)
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
	px.TCPKeepalive.validate(c, p+".tcp_keepalive")
	px.TCPUserTimeout.validate(c, p+".tcp_user_timeout")
}

func (k *fileTCPKeepalive) defaults() {
	for _, f := range []*fileKeepalive{k.Client, k.Backend} {
		if f == nil {
			continue
		}
		if f.Idle == nil {
			f.Idle = ptr(duration(DefaultKeepaliveIdle))
		}
		if f.Interval == nil {
			f.Interval = ptr(duration(DefaultKeepaliveInterval))
		}
		if f.Count == nil {
			f.Count = ptr(DefaultKeepaliveCount)
		}
	}
}

func (k *fileTCPKeepalive) validate(c *checker, p string) {
	for _, side := range []struct {
		name string
		f    *fileKeepalive
	}{{"client", k.Client}, {"backend", k.Backend}} {
		if side.f == nil {
			continue
		}
		sp := p + "." + side.name
		c.keepaliveSeconds(sp+".idle", *side.f.Idle, MaxKeepaliveIdle)
		c.keepaliveSeconds(sp+".interval", *side.f.Interval, MaxKeepaliveInterval)
		if n := *side.f.Count; n < 1 || n > MaxKeepaliveCount {
			c.bad(sp+".count", "must be 1..%d (probes unanswered before the connection ends), got %d", MaxKeepaliveCount, n)
		}
	}
}

func (u *fileTCPUserTimeout) validate(c *checker, p string) {
	for _, side := range []struct {
		name string
		d    *duration
	}{{"client", u.Client}, {"backend", u.Backend}} {
		if d := side.d; d != nil && (*d <= 0 || d.D()%time.Millisecond != 0 || d.D() > MaxUserTimeout) {
			c.bad(p+"."+side.name, "must be whole milliseconds, 1ms..24h, got %v", *d)
		}
	}
}

// keepaliveSeconds checks a TCP keepalive time: the kernel takes whole seconds,
// 1 to most, which the message gives in seconds as the docs and tcp(7) do.
func (c *checker) keepaliveSeconds(path string, d duration, most time.Duration) {
	if d <= 0 || d.D()%time.Second != 0 || d.D() > most {
		c.bad(path, "must be whole seconds, 1s..%ds (the kernel's limits), got %v", most/time.Second, d)
	}
}

func (h *fileHTTP) defaults() {
	if h.Upstream == "" {
		h.Upstream = DefaultHTTPUpstream
	}
	if h.H2Engine == "" {
		h.H2Engine = DefaultH2Engine
	}
	if h.H1Engine == "" {
		h.H1Engine = DefaultH1Engine
	}
	if h.LeastTime == "" {
		h.LeastTime = LeastTimeHeader
	}
	if h.HashBy == "" {
		h.HashBy = string(HashBySource)
	}
	if h.ConnectTimeout == nil {
		h.ConnectTimeout = ptr(duration(DefaultConnectTimeout))
	}
	if h.IdleTimeout == nil {
		h.IdleTimeout = ptr(duration(DefaultHTTPIdle))
	}
	if h.ReadHeaderTimeout == nil {
		h.ReadHeaderTimeout = ptr(duration(DefaultHeaderTimeout))
	}
	h.TCPKeepalive.defaults()
	if h.MaxHeaderBytes == nil {
		h.MaxHeaderBytes = ptr(DefaultMaxHeaderBytes)
	}
	if h.Retries == nil {
		h.Retries = ptr(DefaultHTTPRetries)
	}
	if h.RetryBudget == nil {
		h.RetryBudget = ptr(DefaultRetryBudget)
	}
	if h.XForwardedFor == nil {
		h.XForwardedFor = ptr(true)
	}
	if h.XForwardedProto == nil {
		h.XForwardedProto = ptr(true)
	}
}

var headerNameRE = regexp.MustCompile("^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")

func (h *fileHTTP) validate(c *checker, p string, vip netip.AddrPort, algo Algorithm) {
	h.ListenAddr = vip
	if h.Listen != "" {
		h.ListenAddr = netip.AddrPort{}
		if ap, ok := c.addrPort(p+".listen", h.Listen); ok {
			h.ListenAddr = ap
		}
	}
	if (h.TLS.Cert == "") != (h.TLS.Key == "") {
		c.bad(p+".tls", "name both cert and key, or neither (cleartext)")
	}
	h.TLS.Cert = c.path(h.TLS.Cert)
	h.TLS.Key = c.path(h.TLS.Key)
	oneOf(c, p+".upstream", h.Upstream, UpstreamAuto, UpstreamHTTP1, UpstreamH2C)
	oneOf(c, p+".h2_engine", h.H2Engine, H2EngineFrames, H2EngineNetHTTP)
	oneOf(c, p+".h1_engine", h.H1Engine, H1EngineLoop, H1EngineNetHTTP)
	if oneOf(c, p+".least_time", h.LeastTime, LeastTimeHeader, LeastTimeLastByte) &&
		h.LeastTime != LeastTimeHeader && algo != AlgorithmLeastTime {
		c.bad(p+".least_time", "only algorithm least_time uses it, and algorithm is %s", algo)
	}
	kind, name, _ := strings.Cut(h.HashBy, ":")
	h.Hash = HashBy{Kind: HashByKind(kind), Name: name}
	if h.Hash.Kind == HashByHeader {
		// Field names are case-insensitive: header:host and header:Host are one
		// key, so a reload between them moves no request (weir plan).
		h.Hash.Name = textproto.CanonicalMIMEHeaderKey(name)
	}
	switch {
	case !oneOf(c, p+".hash_by", h.Hash.Kind, HashBySource, HashByHeader, HashByCookie):
	case h.Hash.Kind == HashBySource && name != "":
		c.bad(p+".hash_by", "source takes no name, got %q", h.HashBy)
	case h.Hash.Kind != HashBySource && !headerNameRE.MatchString(name):
		c.bad(p+".hash_by", "write %s:NAME with a %s name, got %q", kind, kind, h.HashBy)
	case h.Hash.Kind != HashBySource && !algo.XDP():
		c.bad(p+".hash_by", "only maglev, maglev_p2c and source_hash hash, and algorithm is %s", algo)
	}
	c.positive(p+".connect_timeout", *h.ConnectTimeout)
	c.positive(p+".idle_timeout", *h.IdleTimeout)
	c.positive(p+".read_header_timeout", *h.ReadHeaderTimeout)
	h.TCPKeepalive.validate(c, p+".tcp_keepalive")
	h.TCPUserTimeout.validate(c, p+".tcp_user_timeout")
	if h.TryTimeout < 0 {
		c.bad(p+".try_timeout", "must be 0 (none) or positive, got %v", h.TryTimeout)
	}
	if h.Timeout < 0 {
		c.bad(p+".timeout", "must be 0 (none) or positive, got %v", h.Timeout)
	}
	if *h.MaxHeaderBytes < 1024 || *h.MaxHeaderBytes > 16<<20 {
		c.bad(p+".max_header_bytes", "must be 1024..16777216, got %d", *h.MaxHeaderBytes)
	}
	if *h.Retries < 0 || *h.Retries > 10 {
		c.bad(p+".retries", "must be 0..10, got %d", *h.Retries)
	}
	if !(*h.RetryBudget >= 0 && *h.RetryBudget <= 1) { // NaN too
		c.bad(p+".retry_budget", "must be 0..1 (a share of requests), got %g", *h.RetryBudget)
	}
	for i, m := range h.RetryGRPC {
		svc, method, ok := strings.Cut(strings.TrimPrefix(m, "/"), "/")
		if m != "*" && (!strings.HasPrefix(m, "/") || !ok || svc == "" || method == "" || strings.Contains(method, "/")) {
			c.bad(fmt.Sprintf("%s.retry_grpc[%d]", p, i), "must be /package.Service/Method, /package.Service/* or *, got %q", m)
		}
	}
}

// path makes a file's path absolute, taking a relative one from the config
// file's directory; "" stays "".
func (c *checker) path(p string) string {
	switch {
	case p == "" || filepath.IsAbs(p):
		return p
	case c.dir != "":
		return filepath.Join(c.dir, p)
	}
	if abs, err := filepath.Abs(p); err == nil {
		return abs
	}
	return p
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
