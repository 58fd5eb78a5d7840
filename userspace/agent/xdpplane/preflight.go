package xdpplane

import (
	"errors"
	"fmt"
	"net"

	"github.com/weir-lb/weir/userspace/config"
)

// Preflight checks, without loading anything, what the host must offer the config's
// XDP services: the interfaces exist, and nat and tunnel services have the
// balancer's own address and the forwarding their next-hop lookups need. It
// returns one line per problem, in operator words with the fix; `weir validate`
// prints them. A service with data_plane auto that fails one is served by the proxy.
func Preflight(cfg *config.Config) []string {
	var out []string
	if len(cfg.Interfaces) == 0 {
		return nil
	}
	x := &Plane{links: map[int]string{}, addrs: cfg.Addresses}
	for _, in := range cfg.Interfaces {
		iface, err := net.InterfaceByName(in.Name)
		if err != nil {
			out = append(out, fmt.Sprintf("interfaces: %s: %v: XDP cannot attach to it (every service falls back to the proxy, udp ones fail)", in.Name, err))
			continue
		}
		x.links[iface.Index] = in.Name
	}
	if len(x.links) == 0 {
		return out
	}
	if len(x.addrs) == 0 {
		x.addrs, _ = interfaceAddrs(cfg.Interfaces[0].Name)
	}
	var clashes config.Errors
	if errors.As(speakerPortClashes(cfg, x.addrs, ""), &clashes) {
		for _, e := range clashes {
			out = append(out, e.Error()+", so the agent refuses the file here")
		}
	}
	for i := range cfg.Services {
		s := &cfg.Services[i]
		if s.DataPlane == config.DataPlaneProxy || s.DataPlane == config.DataPlaneHTTP || !s.Algorithm.XDP() {
			continue
		}
		if err := x.modeReady(s); err != nil {
			fallback := "so it falls back to the proxy (data_plane auto)"
			switch {
			case s.DataPlane == config.DataPlaneXDP:
				fallback = "so it cannot start (data_plane xdp)"
			case s.Protocol == config.UDP:
				fallback = "so it cannot start (udp is served by XDP only)"
			}
			out = append(out, fmt.Sprintf("service %q: %v, %s", s.Name, err, fallback))
		}
	}
	return out
}
