package httpplane_test

import (
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

// TestRebuildUnderLoad: reloads that replace a service's server (its idle
// timeout is fixed while it listens) while clients keep opening connections,
// one request each, lose none of them: no client sees its connection reset.
func TestRebuildUnderLoad(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	p := httpplane.New(&health.Checker{}, slog.New(slog.DiscardHandler), nil)
	t.Cleanup(p.Close)
	vip := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(freePort(t)))
	service := func(idle time.Duration) *plan.Service {
		return &plan.Service{
			Config: config.Service{Name: "web", DataPlane: config.DataPlaneHTTP, Algorithm: config.AlgorithmLeastConn,
				DrainTimeout: 5 * time.Second, HTTP: config.HTTP{Listen: vip, ConnectTimeout: time.Second, IdleTimeout: idle}},
			Placement: plan.Placement{Plane: plan.HTTP}, Installed: true,
			Backends: []plan.Backend{{ID: plan.ID("web", bs[0].Addr), Config: config.Backend{Addr: bs[0].Addr, Weight: 1},
				Healthy: true, Usable: true, Weight: 1}},
		}
	}
	prev := service(time.Minute)
	if err := p.Add(prev); err != nil {
		t.Fatalf("add: %v", err)
	}
	req := []byte("GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
	load := churn.Start(t, vip.String(), 16, req, []byte("HTTP/1.1 200"))
	load.Each(t, 10, func(i int) {
		next := service(time.Minute + time.Duration(i+1)*time.Second)
		if err := p.Update(prev, next); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		p.Commit()
		prev = next
	})
	load.NoneFailed(t, "10 reloads under load")
}
