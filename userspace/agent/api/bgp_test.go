package api

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// TestBGPWriteTable: sessions, announced, withdrawn and pending routes, and a drain each
// have their line in weir status.
func TestBGPWriteTable(t *testing.T) {
	since := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	st := Status{BGP: &BGPStatus{ASN: 65001, RouterID: "10.80.0.1", Drained: true, DrainedSince: since, DrainUntil: since.Add(30 * time.Second),
		Peers: []PeerStatus{{Address: "10.80.0.254", ASN: 65000, State: "established", Uptime: "2m10s", HoldTime: 9},
			{Address: "10.80.0.253", ASN: 65000, State: "active", LastError: "hold timer expired"}},
		Announced: []RouteStatus{{Prefix: "10.80.100.1/32", Services: []string{"web", "tls"}, Communities: []string{"65000:1"}, MED: 10}},
		Withheld:  []WithheldRoute{{Prefix: "fd80:100::1/128", Why: "web6: no backend usable and up"}},
		Pending: []PendingRoute{{Prefix: "fd80:100::1/128", Want: RouteWithdraw, Since: since, Attempts: 3,
			LastError: "server stopped", NextTry: time.Now().Add(time.Hour)},
			{Prefix: "10.80.100.2/32", Want: RouteAnnounce, Since: since, Attempts: 1, LastError: "refused"}}}}
	var b bytes.Buffer
	st.WriteTable(&b)
	out := b.String()
	for _, want := range []string{
		"bgp: AS 65001, router id 10.80.0.1; node DRAINED since 2026-01-02T03:04:05Z",
		"until 2026-01-02T03:04:35Z; drain_timeout has passed: the node can be stopped)",
		"10.80.0.254  65000  established  2m10s   9s    \n",
		"10.80.0.253  65000  active       -       -     hold timer expired\n",
		"  announced 10.80.100.1/32 (web, tls) communities 65000:1 med 10\n",
		"  withdrawn fd80:100::1/128: web6: no backend usable and up\n",
		"  PENDING withdraw fd80:100::1/128 (3 failed attempts since 2026-01-02T03:04:05Z, retrying in ",
		"): server stopped\n",
		"  PENDING announce 10.80.100.2/32 (1 failed attempt since 2026-01-02T03:04:05Z): refused\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}
