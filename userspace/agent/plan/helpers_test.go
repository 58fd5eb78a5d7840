package plan

import (
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/config"
)

// t0 is the tests' clock; no test reads the real one.
var t0 = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)

var (
	addrA = netip.MustParseAddrPort("10.0.0.1:80")
	addrB = netip.MustParseAddrPort("10.0.0.2:80")
	addrC = netip.MustParseAddrPort("10.0.0.3:80")
	vip1  = netip.MustParseAddrPort("192.0.2.1:80")
	vip2  = netip.MustParseAddrPort("192.0.2.2:80")

	macA = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x01}
	macB = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x02}
)

// cfgBackend is a backend as config.Load resolves it: weight 1, initially up.
func cfgBackend(addr netip.AddrPort) config.Backend {
	return config.Backend{Address: addr.String(), Addr: addr, Weight: config.DefaultWeight,
		CheckAddr: addr, Initial: config.DefaultHealthInitial}
}

// cfgService is a service as config.Load resolves it with every default, with a
// backend of weight 1 at each address.
func cfgService(name string, vip netip.AddrPort, addrs ...netip.AddrPort) config.Service {
	s := config.Service{
		Name: name, VIP: vip, Protocol: config.DefaultProtocol, DataPlane: config.DefaultDataPlane,
		Mode: config.DefaultMode, Algorithm: config.AlgorithmMaglev, Hash: config.HashFiveTuple,
		AllDown: config.DefaultAllDown, DrainTimeout: config.DefaultDrainTimeout,
		Health: config.Health{Type: config.DefaultHealthType, Interval: config.DefaultInterval,
			Timeout: config.DefaultTimeout, Rise: config.DefaultRise, Fall: config.DefaultFall,
			Jitter: config.DefaultJitter, Initial: config.DefaultHealthInitial},
		Proxy: config.Proxy{Listen: vip, ConnectTimeout: config.DefaultConnectTimeout,
			IdleTimeout: config.DefaultIdleTimeout, Retries: config.DefaultRetries},
	}
	for _, a := range addrs {
		s.Backends = append(s.Backends, cfgBackend(a))
	}
	return s
}

// flowIdle stands for the program's established-flow idle timeout.
const flowIdle = 15 * time.Minute

// input is the planner's input for services all placed on plane.
func input(plane Plane, services ...config.Service) Input {
	in := Input{Placement: map[string]Placement{}, Health: map[string]Health{},
		Overrides: map[string]Override{}, MACs: map[netip.Addr]MAC{}, FlowIdle: flowIdle, Now: t0}
	for _, s := range services {
		in.Services = append(in.Services, s)
		in.Placement[s.Name] = Placement{Plane: plane, Why: "test"}
	}
	return in
}

var (
	up   = Health{State: health.Up, Usable: true}
	down = Health{State: health.Down}
)

// planOne plans in and returns its only service.
func planOne(t *testing.T, in Input, prev Desired) Service {
	t.Helper()
	d := Plan(in, prev)
	if len(d.Services) != 1 {
		t.Fatalf("got %d services; want 1", len(d.Services))
	}
	return d.Services[0]
}

// mustBackend is the service's backend at addr.
func mustBackend(t *testing.T, s *Service, addr netip.AddrPort) *Backend {
	t.Helper()
	b := s.Backend(addr)
	if b == nil {
		t.Fatalf("service %q: no backend %v", s.Name(), addr)
	}
	return b
}

// usable lists, in order, the addresses of the service's backends that are Usable.
func usable(s *Service) string {
	var out []string
	for _, b := range s.Backends {
		if b.Usable {
			out = append(out, b.Config.Addr.String())
		}
	}
	return "[" + strings.Join(out, " ") + "]"
}

// leavers lists, in order, a service's leaving backends and their Until.
func leavers(s *Service) string {
	var out []string
	for _, b := range s.Leaving {
		out = append(out, b.Config.Addr.String()+"@"+b.Until.Sub(t0).String())
	}
	return "[" + strings.Join(out, " ") + "]"
}
