package config

import (
	"net"
	"net/netip"
	"time"
)

// resolve turns a validated file, defaults applied, into the model.
func (f *file) resolve() *Config {
	cfg := &Config{
		XDP: XDP{
			HashSeed:            f.XDP.HashSeed,
			ConntrackSize:       f.XDP.ConntrackSize,
			HalfOpenSize:        f.XDP.HalfOpenSize,
			HalfOpenTimeout:     f.XDP.HalfOpenTimeout.D(),
			NewFlowRate:         *f.XDP.NewFlowRate,
			NewFlowBurst:        f.XDP.NewFlowBurst,
			PreviousTableWindow: f.XDP.PreviousTableWindow.D(),
			PinPath:             f.XDP.PinPath,
			DetachOnStop:        f.XDP.DetachOnStop,
		},
		Addresses: f.Addrs,
		Admin:     Admin{Socket: f.Admin.Socket},
		Log:       Log{Format: f.Log.Format},
	}
	for _, in := range f.Interfaces {
		cfg.Interfaces = append(cfg.Interfaces, Interface{Name: in.Name, Attach: in.Attach})
	}
	if f.Admin.Listen != "" {
		cfg.Admin.Listen = netip.MustParseAddrPort(f.Admin.Listen) // validated
	}
	if f.Metrics.Listen != "off" {
		cfg.Metrics.Listen = netip.MustParseAddrPort(f.Metrics.Listen)
	}
	cfg.Metrics.Public = f.Metrics.Public
	cfg.Log.Level.UnmarshalText([]byte(f.Log.Level)) // validated
	if b := f.BGP; b != nil {
		cfg.BGP = BGP{ASN: b.ASN, RouterID: b.RouterAddr, ListenPort: uint16(b.ListenPort), NextHop: b.NextHops,
			DrainTimeout: b.DrainTimeout.D()}
		for _, p := range b.Peers {
			cfg.BGP.Peers = append(cfg.BGP.Peers, Peer{Address: p.Addr, ASN: p.ASN, Port: uint16(p.Port), Password: p.Password,
				HoldTime: p.HoldTime.D(), Keepalive: p.Keepalive.D(), Multihop: uint8(p.Multihop)})
		}
	}
	for i := range f.Services {
		s := f.Services[i].resolve()
		if f.BGP != nil {
			a := &f.Services[i].BGP
			s.BGP = Announce{Enabled: *a.Announce, Communities: a.Comms, MED: a.MED, LocalPref: a.LocalPref}
		}
		cfg.Services = append(cfg.Services, s)
	}
	return cfg
}

func (s *fileService) resolve() Service {
	h, ps, px := &s.Health, &s.Passive, &s.Proxy
	out := Service{
		Name:         s.Name,
		VIP:          s.VIPAddr,
		Protocol:     s.Protocol,
		DataPlane:    s.DataPlane,
		Mode:         s.Mode,
		Algorithm:    s.Algorithm,
		Hash:         s.Hash,
		TableSize:    s.TableSize,
		AllDown:      s.AllDown,
		DrainTimeout: s.DrainTimeout.D(),
		SlowStart:    s.SlowStart.D(),
		Health: Health{
			Type:         h.Type,
			Method:       h.Method,
			Interval:     h.Interval.D(),
			Timeout:      h.Timeout.D(),
			Rise:         *h.Rise,
			Fall:         *h.Fall,
			Jitter:       *h.Jitter,
			Initial:      h.Initial,
			Path:         h.Path,
			Host:         h.Host,
			ExpectStatus: h.Status,
			ExpectBody:   h.ExpectBody,
		},
		Passive: Passive{
			Consecutive:        *ps.Consecutive,
			BaseEjection:       ps.BaseEjection.D(),
			MaxEjection:        ps.MaxEjection.D(),
			MaxEjectionPercent: *ps.MaxEjectionPercent,
		},
		PanicThreshold: *s.PanicThreshold,
		Proxy: Proxy{
			Listen:             px.ListenAddr,
			ConnectTimeout:     px.ConnectTimeout.D(),
			IdleTimeout:        px.IdleTimeout.D(),
			Retries:            *px.Retries,
			MaxConns:           px.MaxConns,
			MaxConnsPerBackend: px.MaxConnsPerBackend,
			ProxyProtocol:      px.ProxyProtocol,
			SockMap:            px.SockMap,
			TCPKeepalive:       px.TCPKeepalive.resolve(),
			TCPUserTimeout:     px.TCPUserTimeout.resolve(),
		},
	}
	if h := s.HTTP; h != nil {
		out.HTTP = HTTP{
			Listen: h.ListenAddr, TLSCert: h.TLS.Cert, TLSKey: h.TLS.Key, Upstream: h.Upstream, H2Engine: h.H2Engine, H1Engine: h.H1Engine,
			LeastTime: h.LeastTime, HashBy: h.Hash, ConnectTimeout: h.ConnectTimeout.D(),
			TryTimeout: h.TryTimeout.D(), Timeout: h.Timeout.D(), IdleTimeout: h.IdleTimeout.D(),
			ReadHeaderTimeout: h.ReadHeaderTimeout.D(), MaxHeaderBytes: *h.MaxHeaderBytes,
			Retries: *h.Retries, RetryBudget: *h.RetryBudget, RetryGRPC: h.RetryGRPC,
			XForwardedFor: *h.XForwardedFor, Forwarded: h.Forwarded, XForwardedProto: *h.XForwardedProto,
			AccessLog: h.AccessLog, TCPKeepalive: h.TCPKeepalive.resolve(),
			TCPUserTimeout: h.TCPUserTimeout.resolve(),
		}
	}
	for _, b := range s.Backends {
		rb := Backend{Address: b.Address, Addr: b.Addr, Weight: uint32(*b.Weight), CheckAddr: b.CheckAddr,
			Drain: b.Drain, MaxConns: b.MaxConns, Initial: b.Initial}
		if rb.Initial == "" {
			rb.Initial = h.Initial
		}
		if b.MAC != "" {
			rb.MAC, _ = net.ParseMAC(b.MAC) // validated
		}
		out.Backends = append(out.Backends, rb)
	}
	return out
}

func (k fileTCPKeepalive) resolve() TCPKeepalive {
	side := func(f *fileKeepalive) Keepalive {
		if f == nil {
			return Keepalive{}
		}
		return Keepalive{Idle: f.Idle.D(), Interval: f.Interval.D(), Count: *f.Count}
	}
	return TCPKeepalive{Client: side(k.Client), Backend: side(k.Backend)}
}

func (u fileTCPUserTimeout) resolve() TCPUserTimeout {
	side := func(d *duration) time.Duration {
		if d == nil {
			return 0
		}
		return d.D()
	}
	return TCPUserTimeout{Client: side(u.Client), Backend: side(u.Backend)}
}
