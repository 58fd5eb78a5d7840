package bgp

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

func svc(name, vip string, announce bool, backends ...plan.Backend) plan.Service {
	return plan.Service{Config: config.Service{Name: name, VIP: netip.MustParseAddrPort(vip),
		BGP: config.Announce{Enabled: announce, MED: 5, Communities: []uint32{65000<<16 | 1}}}, Installed: true, Backends: backends}
}

var (
	up       = plan.Backend{Usable: true, Health: health.Up, Weight: 1}
	down     = plan.Backend{Health: health.Down, Weight: 1}
	panicked = plan.Backend{Usable: true, Health: health.Down, Weight: 1} // panic mode: down but used
	drained  = plan.Backend{Usable: true, Health: health.Up, Weight: 1, Drained: true}
	weight0  = plan.Backend{Usable: true, Health: health.Up}
	v4       = netip.MustParsePrefix("10.80.100.1/32")
	v6       = netip.MustParsePrefix("fd80:100::1/128")
	v4policy = Route{Prefix: v4, MED: 5, Communities: []uint32{65000<<16 | 1}}
)

func withServices(r Route, s ...string) Route { r.Services = s; return r }

func TestRoutes(t *testing.T) {
	allDown := svc("web", "10.80.100.1:80", true, up)
	allDown.AllDown = true
	out := svc("web", "10.80.100.1:80", true, up)
	out.Installed, out.Note = false, "all_down: pass"
	// "fresh": a service whose backends are up by health.initial, none checked yet.
	fresh := svc("fresh", "10.80.100.1:80", true, up)
	noChecks := svc("fresh", "10.80.100.1:80", true, up)
	noChecks.Config.Health.Type = config.CheckNone
	for _, c := range []struct {
		name     string
		services []plan.Service
		drained  bool
		want     []Route
		withheld []Withheld
	}{
		{"one usable backend announces", []plan.Service{svc("web", "10.80.100.1:80", true, down, up)}, false,
			[]Route{withServices(v4policy, "web")}, nil},
		{"no usable backend withdraws", []plan.Service{svc("web", "10.80.100.1:80", true, down, drained, weight0)}, false,
			nil, []Withheld{{v4, "web: no backend usable and up"}}},
		{"every backend down, used in panic mode, withdraws", []plan.Service{svc("web", "10.80.100.1:80", true, panicked, panicked)}, false,
			nil, []Withheld{{v4, "web: no backend usable and up"}}},
		{"all down (keep_last keeps them usable) withdraws", []plan.Service{allDown}, false,
			nil, []Withheld{{v4, "web: no backend usable and up"}}},
		{"out of the data plane withdraws", []plan.Service{out}, false,
			nil, []Withheld{{v4, "web: out of the data plane: all_down: pass"}}},
		{"drained node withdraws all", []plan.Service{svc("web", "10.80.100.1:80", true, up), svc("web6", "[fd80:100::1]:80", true, up)}, true,
			nil, []Withheld{{v4, "the node is drained (weir node undrain announces again)"}, {v6, "the node is drained (weir node undrain announces again)"}}},
		{"up by health.initial before any check withdraws", []plan.Service{fresh}, false,
			nil, []Withheld{{v4, "fresh: waiting for the first health checks of its backends"}}},
		{"an unconfirmed service beside a confirmed one on the VIP announces", []plan.Service{fresh, svc("web", "10.80.100.1:443", true, up)}, false,
			[]Route{withServices(v4policy, "web")}, nil},
		{"without active checks nothing is waited for", []plan.Service{noChecks}, false,
			[]Route{withServices(v4policy, "fresh")}, nil},
		{"announce false is never announced nor listed", []plan.Service{svc("web", "10.80.100.1:80", false, up)}, false, nil, nil},
		{"announce false beside a service that announces the address", []plan.Service{svc("web", "10.80.100.1:80", true, up), svc("quiet", "10.80.100.1:81", false, down)}, false,
			[]Route{withServices(v4policy, "web")}, nil},
		{"one of two services on a VIP keeps it up", []plan.Service{svc("web", "10.80.100.1:80", true, down), svc("tls", "10.80.100.1:443", true, up)}, false,
			[]Route{withServices(v4policy, "tls")}, nil},
		{"both services on a VIP", []plan.Service{svc("web", "10.80.100.1:80", true, up), svc("tls", "10.80.100.1:443", true, up)}, false,
			[]Route{withServices(v4policy, "web", "tls")}, nil},
		{"IPv6 is a /128", []plan.Service{svc("web6", "[fd80:100::1]:80", true, up)}, false,
			[]Route{{Prefix: v6, Services: []string{"web6"}, MED: 5, Communities: []uint32{65000<<16 | 1}}}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, withheld := Routes(&plan.Desired{Services: c.services}, c.drained, func(service string) bool { return service != "fresh" })
			if !reflect.DeepEqual(got, c.want) {
				t.Errorf("routes: got %+v; want %+v", got, c.want)
			}
			if !reflect.DeepEqual(withheld, c.withheld) {
				t.Errorf("withheld: got %+v; want %+v", withheld, c.withheld)
			}
		})
	}
}
