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
	srv := httptest.NewServer(New(func() (api.Status, error) { return st, nil }).Handler())
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
	for _, want := range []string{
		`weir_bgp_route_announced{prefix="10.80.100.1/32"} 1`,
		`weir_bgp_route_pending{prefix="10.80.100.1/32",want="withdraw"} 1`,
		`weir_bgp_route_pending{prefix="10.80.100.2/32",want="announce"} 1`,
	} {
		if !strings.Contains(string(b), want) {
			t.Errorf("metrics lack %q:\n%s", want, b)
		}
	}
}
