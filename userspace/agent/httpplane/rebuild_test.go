package httpplane_test

import (
	"fmt"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/userspace/agent/httpplane"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// rebuildSetup runs an http plane with an HTTP/1.1 backend; service(name,
// idle) is a service of it on a loopback address of its own.
func rebuildSetup(t *testing.T) (p *httpplane.Plane, vip netip.AddrPort, service func(name string, idle time.Duration) *plan.Service) {
	bs := httpbackend.StartN(t, 1)
	p = httpplane.New(&health.Checker{}, slog.New(slog.DiscardHandler), nil)
	t.Cleanup(p.Close)
	vip = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(freePort(t)))
	service = func(name string, idle time.Duration) *plan.Service {
		return &plan.Service{
			Config: config.Service{Name: name, DataPlane: config.DataPlaneHTTP, Algorithm: config.AlgorithmLeastConn,
				DrainTimeout: 5 * time.Second, HTTP: config.HTTP{Listen: vip, ConnectTimeout: time.Second, IdleTimeout: idle}},
			Placement: plan.Placement{Plane: plan.HTTP}, Installed: true,
			Backends: []plan.Backend{{ID: plan.ID(name, bs[0].Addr), Config: config.Backend{Addr: bs[0].Addr, Weight: 1},
				Healthy: true, Usable: true, Weight: 1}},
		}
	}
	return p, vip, service
}

// request is one HTTP/1.1 request per connection, and the start of its answer.
var churnRequest, churnAnswer = []byte("GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n"), []byte("HTTP/1.1 200")

// TestRebuildUnderLoad: reloads that replace a service's server while
// clients keep opening connections, one request each, lose none of them: no
// client sees its connection reset. The new server takes the old one's
// listening socket over, after a change of a setting fixed while it listens
// (the idle timeout), and after a rename on the same address; a change
// aborted first leaves the old server serving.
func TestRebuildUnderLoad(t *testing.T) {
	for _, tc := range []struct {
		name string
		at   func(i int) (string, time.Duration) // the name and idle timeout after i reloads
	}{
		{"idle_timeout", func(i int) (string, time.Duration) { return "web", time.Minute + time.Duration(i)*time.Second }},
		{"rename", func(i int) (string, time.Duration) {
			if i == 0 {
				return "web", time.Minute
			}
			return fmt.Sprintf("web-%d", i), time.Minute
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, vip, service := rebuildSetup(t)
			if err := p.Add(service(tc.at(0))); err != nil {
				t.Fatalf("add: %v", err)
			}
			p.Commit()
			load := churn.Start(t, vip.String(), 16, churnRequest, churnAnswer)
			load.Each(t, 1, func(int) {
				if err := reload(p, service(tc.at(0)), service(tc.at(1))); err != nil {
					t.Fatalf("reload: %v", err)
				}
			})
			load.Each(t, 1, func(int) { p.Abort() })
			if _, ok := p.Get("web"); !ok {
				t.Fatal("after the abort: the service is not served")
			}
			load.Each(t, 10, func(i int) {
				if err := reload(p, service(tc.at(i)), service(tc.at(i+1))); err != nil {
					t.Fatalf("reload %d: %v", i, err)
				}
				p.Commit()
			})
			load.NoneFailed(t, "an aborted reload and 10 reloads under load")
		})
	}
}

// reload applies the change from prev to next as the agent does: a new name
// is added, then the old one removed.
func reload(p *httpplane.Plane, prev, next *plan.Service) error {
	if prev.Name() == next.Name() {
		return p.Update(prev, next)
	}
	if err := p.Add(next); err != nil {
		return err
	}
	return p.Remove(prev)
}
