package metrics

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/weir-lb/weir/userspace/agent/api"
)

// TestBGPRoutes: a route the speaker announces and one whose change GoBGP refused
// each have their series.
func TestBGPRoutes(t *testing.T) {
	st := api.Status{BGP: &api.BGPStatus{
		Announced: []api.RouteStatus{{Prefix: "10.80.100.1/32"}},
		Pending: []api.PendingRoute{{Prefix: "10.80.100.1/32", Want: api.RouteWithdraw, Attempts: 2, LastError: "refused"},
			{Prefix: "10.80.100.2/32", Want: api.RouteAnnounce, Attempts: 1, LastError: "refused"}}}}
	b := scrape(t, New(func() (api.Status, error) { return st, nil }))
	for _, want := range []string{
		`weir_bgp_route_announced{prefix="10.80.100.1/32"} 1`,
		`weir_bgp_route_pending{prefix="10.80.100.1/32",want="withdraw"} 1`,
		`weir_bgp_route_pending{prefix="10.80.100.2/32",want="announce"} 1`,
	} {
		if !strings.Contains(b, want) {
			t.Errorf("metrics lack %q:\n%s", want, b)
		}
	}
}

// TestServiceServing: proxy and http services have their serving gauge,
// restarts, accept errors and client timeouts; XDP services have none of
// them.
func TestServiceServing(t *testing.T) {
	st := api.Status{Services: []api.ServiceStatus{
		{Name: "web", DataPlane: api.PlaneHTTP, Down: "listen: address in use", Restarts: 2, AcceptErrors: 7, ClientTimeouts: 5},
		{Name: "tcp", DataPlane: api.PlaneProxy, AcceptErrors: 3, ClientTimeouts: 4},
		{Name: "fast", DataPlane: api.PlaneXDP},
	}}
	b := scrape(t, New(func() (api.Status, error) { return st, nil }))
	for _, want := range []string{
		`weir_service_serving{service="web"} 0`,
		`weir_service_restarts_total{service="web"} 2`,
		`weir_service_accept_errors_total{service="web"} 7`,
		`weir_service_client_timeouts_total{service="web"} 5`,
		`weir_service_serving{service="tcp"} 1`,
		`weir_service_restarts_total{service="tcp"} 0`,
		`weir_service_accept_errors_total{service="tcp"} 3`,
		`weir_service_client_timeouts_total{service="tcp"} 4`,
	} {
		if !strings.Contains(b, want) {
			t.Errorf("metrics lack %q:\n%s", want, b)
		}
	}
	for _, unwanted := range []string{`weir_service_serving{service="fast"}`, `weir_service_accept_errors_total{service="fast"}`,
		`weir_service_client_timeouts_total{service="fast"}`} {
		if strings.Contains(b, unwanted) {
			t.Errorf("metrics have %q for an XDP service; want none", unwanted)
		}
	}
}

// TestHealthUnapplied: the gauge is 1 while status has health verdicts the
// data planes refused, 0 otherwise.
func TestHealthUnapplied(t *testing.T) {
	for _, c := range []struct {
		unapplied *api.UnappliedHealth
		want      string
	}{{nil, "weir_health_unapplied 0"}, {&api.UnappliedHealth{Attempts: 2, LastError: "refused"}, "weir_health_unapplied 1"}} {
		b := scrape(t, New(func() (api.Status, error) { return api.Status{HealthUnapplied: c.unapplied}, nil }))
		if !strings.Contains(b, c.want+"\n") {
			t.Errorf("unapplied %+v: metrics lack %q:\n%s", c.unapplied, c.want, b)
		}
	}
}

// scrape returns m's exposition, read over HTTP.
func scrape(t *testing.T, m *Metrics) string {
	t.Helper()
	srv := httptest.NewServer(m.Handler())
	t.Cleanup(srv.Close)
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
