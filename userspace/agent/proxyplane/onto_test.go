package proxyplane

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// TestOntoAddressUnderLoad: reloads that give a service the address of
// another that leaves it in the same reload (two services swap their names;
// or one is removed and another moves onto its address, then back) lose no
// connection on it while clients keep opening connections: the moving
// service's new server takes the leaving one's listening sockets over, as a
// renamed service's does.
func TestOntoAddressUnderLoad(t *testing.T) {
	for _, tc := range []struct {
		name string
		// at is what runs after i reloads: service names by address,
		// "" for none (vip is "web"'s at 0, other "api"'s).
		at func(i int) (vip, other string)
	}{
		{"swap", func(i int) (string, string) {
			if i%2 == 0 {
				return "web", "api"
			}
			return "api", "web"
		}},
		{"onto_removed", func(i int) (string, string) {
			if i%2 == 0 {
				return "web", "api"
			}
			return "api", ""
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, vip, service := rebuildSetup(t, config.Proxy{})
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			other := l.Addr().(*net.TCPAddr).AddrPort()
			l.Close()
			// state is what runs after i reloads, by name.
			state := func(i int) map[string]*plan.Service {
				m := map[string]*plan.Service{}
				a, b := tc.at(i)
				for _, x := range []struct {
					name string
					at   netip.AddrPort
				}{{a, vip}, {b, other}} {
					if x.name != "" {
						s := service(x.name, config.Proxy{})
						s.Config.Proxy.Listen = x.at
						m[x.name] = s
					}
				}
				return m
			}
			if err := p.Add(state(0)["api"]); err != nil {
				t.Fatalf("add: %v", err)
			}
			p.Commit()
			load := churn.Start(t, vip.String(), 16, []byte("ping"), []byte("ping"))
			var others *churn.Load
			if _, b := tc.at(1); b != "" {
				others = churn.Start(t, other.String(), 16, []byte("ping"), []byte("ping"))
			}
			load.Each(t, 6, func(i int) {
				prev, next := state(i), state(i+1)
				was := map[string]any{}
				for name := range prev {
					was[name] = mustGet(t, p, name)
				}
				apply(t, p, prev, next)
				if i == 2 {
					// Refused: each name has its server again, which
					// serves on.
					p.Abort()
					for name := range prev {
						if mustGet(t, p, name) != was[name] {
							t.Fatalf("after the abort: %s's server is not the one it had", name)
						}
					}
					if !load.Progress(50, 10*time.Second) {
						t.Fatal("the load made no progress after the abort")
					}
					apply(t, p, prev, next)
				}
				p.Commit()
			})
			load.NoneFailed(t, "6 reloads and a refused one under load, to "+vip.String())
			if others != nil {
				others.NoneFailed(t, "6 reloads and a refused one under load, to "+other.String())
			}
		})
	}
}

// apply applies the change from prev to next, services by name, as the agent
// orders it: adds and updates, then removals.
func apply(t *testing.T, p *Plane, prev, next map[string]*plan.Service) {
	t.Helper()
	for name, s := range next {
		var err error
		if was, ok := prev[name]; ok {
			err = p.Update(was, s)
		} else {
			err = p.Add(s)
		}
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	for name, s := range prev {
		if _, ok := next[name]; !ok {
			if err := p.Remove(s); err != nil {
				t.Fatalf("remove %s: %v", name, err)
			}
		}
	}
}
