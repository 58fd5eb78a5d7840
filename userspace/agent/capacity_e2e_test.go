package agent_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/config"
)

// fullConfig is a file at the XDP program's backend capacity: 16 dsr services of
// 1,024 backends each (MACs given, no health checks, small tables, so the agent
// starts quickly; removed backends drain for an hour, so one a reload removes
// still holds its slot at the next reload however slow the machine). weight
// sets the weight of s00's first backend; span, if not nil, gives the backends
// of some services: numbers from..to-1 (default 0..1023).
func fullConfig(link, socket string, weight int, span map[int][2]int) string {
	const perService = config.MaxXDPBackends / 16
	var b strings.Builder
	fmt.Fprintf(&b, "interfaces: [{name: %s}]\nadmin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n", link, socket)
	for i := range 16 {
		fmt.Fprintf(&b, "  - {name: s%02d, vip: \"10.77.100.%d:80\", data_plane: xdp, mode: dsr, table_size: 1031, drain_timeout: 1h, health: {type: none}, backends: [", i, i+1)
		r, ok := span[i]
		if !ok {
			r = [2]int{0, perService}
		}
		for j := r[0]; j < r[1]; j++ {
			w := 1
			if i == 0 && j == 0 {
				w = weight
			}
			if j > r[0] {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "{address: \"10.200.%d.%d:80\", mac: \"02:00:00:00:%02x:%02x\", weight: %d}", j/200, j%200+1, j>>8, j&0xff, w)
		}
		b.WriteString("]}\n")
	}
	return b.String()
}

// TestReloadAtCapacityRefusedWhole: with every backend slot of the XDP program
// held, a reload that replaces a backend needs one more slot (the new backend's
// is taken before the replaced one, which drains, frees its own). It is refused
// before anything is written, naming the slots that ran out, the service and the
// way through (before, it failed half-way on 'all 16384 backend slots in use',
// after writing s00's new table, then rolled back); the running services keep
// their tables and previous-table fallbacks as they were, and an http service
// the certificate it served, though its files were renewed (before, the
// reload had read them, and the renewed certificate was served). While a
// backend an earlier reload removed drains, the error says so. weir plan says
// beforehand that the reload would be refused, and why.
func TestReloadAtCapacityRefusedWhole(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("cap"), Backends: 1})
	dir := t.TempDir()
	cfgPath, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	certPath, keyPath := filepath.Join(dir, "web.crt"), filepath.Join(dir, "web.key")
	httpbackend.WriteCert(t, certPath, keyPath, "first")
	web, withWeb := netip.AddrPortFrom(tp.Balancer.IP4, 8443), false
	write := func(weight int, span map[int][2]int) {
		t.Helper()
		text := fullConfig(tp.Balancer.Link, socket, weight, span)
		if withWeb {
			text += fmt.Sprintf("  - {name: web, vip: %q, data_plane: http, http: {tls: {cert: %s, key: %s}}, health: {type: none}, backends: [{address: \"%s:80\"}]}\n",
				web, certPath, keyPath, tp.Backends[0].IP4)
		}
		if err := os.WriteFile(cfgPath, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// served is the name the certificate web hands out gives.
	served := func() string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		raw, err := tp.DialTCP(ctx, web, 0)
		if err != nil {
			t.Fatal(err)
		}
		c := tls.Client(raw, &tls.Config{InsecureSkipVerify: true})
		defer c.Close()
		if err := c.HandshakeContext(ctx); err != nil {
			t.Fatal(err)
		}
		return c.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	write(1, nil)
	if _, err := config.Load(cfgPath); err != nil {
		t.Fatalf("the full config: %v", err)
	}
	p := startAgent(t, tp, cfgPath, socket, false)
	before := xdpStatus(t, p.client)
	tables := func(st api.Status) map[string]api.TableStatus {
		out := map[string]api.TableStatus{}
		for _, s := range st.Services {
			if s.Table != nil {
				out[s.Name] = *s.Table
			}
		}
		return out
	}
	if n := len(tables(before)); n != 16 {
		t.Fatalf("%d services with a table; want 16", n)
	}
	// web, served by the http plane, holds no slot.
	withWeb = true
	write(1, nil)
	if err := p.client.Reload(context.Background()); err != nil {
		t.Fatalf("reload adding an http service: %v", err)
	}
	if cn := served(); cn != "first" {
		t.Fatalf("web serves the certificate for %q; want first", cn)
	}
	httpbackend.WriteCert(t, certPath, keyPath, "second")

	// s15's backend 0 replaced by 1024.
	write(2, map[int][2]int{15: {1, 1025}})
	pl, err := p.client.Plan(context.Background(), nil, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	// s15 is on line 20 (the file's fourth line is services:).
	if want := cfgPath + `:20: services[15]: the XDP program has 16384 backend slots, and this change needs 16385 at once`; !strings.HasPrefix(pl.Refused, want) {
		t.Errorf("plan: refused %q; want it to begin %q", pl.Refused, want)
	}
	err = p.client.Reload(context.Background())
	if err == nil {
		t.Fatal("reload needing one backend slot more than the program has: got no error; want it refused")
	}
	for _, want := range []string{cfgPath + `:20: services[15]: the XDP program`, "16384 backend slots", "16385 at once", "drain"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("reload error: got %q; want it to say %q", err, want)
		}
	}
	after, err := p.client.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	got, want := tables(after), tables(before)
	for name := range want {
		// The age of a previous table grows; what it is must not change.
		g, w := got[name], want[name]
		g.PreviousAgeSeconds, w.PreviousAgeSeconds = 0, 0
		if !reflect.DeepEqual(g, w) {
			t.Errorf("service %s: table %+v after the refused reload; want it untouched, %+v", name, g, w)
		}
	}
	if cn := served(); cn != "first" {
		t.Errorf("web serves the certificate for %q after the refused reload; want the one it served, first", cn)
	}

	// Removing s15's backend 0 takes no slot: it keeps its own while it drains,
	// so adding a backend to s14 then is refused, saying so.
	write(1, map[int][2]int{15: {1, 1024}})
	if err := p.client.Reload(context.Background()); err != nil {
		t.Fatalf("reload that only removes a backend: %v", err)
	}
	write(1, map[int][2]int{15: {1, 1024}, 14: {0, 1025}})
	err = p.client.Reload(context.Background())
	if want := "1 of the held slots are backends an earlier change removed, draining until"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("reload adding a backend while a removed one drains: got %v; want it refused, saying %q", err, want)
	}
}
