package pktbench

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/bench/pktgen"

	"github.com/weir-lb/weir/internal/xdptest"
)

// TestProbes checks that latency probes get through weir nat and nftables
// DNAT to the echo server and back, with no load: every probe in a short
// window completes.
func TestProbes(t *testing.T) {
	l, err := NewLine()
	xdptest.Check(t, err)
	t.Cleanup(func() { l.Close() })
	echo, err := startEcho(l.Sink, netip.AddrPortFrom(ProbeBackend, ProbePort), -1)
	if err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	for _, b := range []Balancer{WeirNATNative, NftDNAT} {
		t.Run(b.Name, func(t *testing.T) {
			if b.Group == "kernel" && !nftAvailable() {
				t.Skip("nft not found (install nftables): skipping the nftables probe")
			}
			teardown, err := b.Setup(l)
			xdptest.Check(t, err)
			defer func() {
				if err := teardown(); err != nil {
					t.Error(err)
				}
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			res, err := runProber(ctx, l.Gen, netip.AddrPortFrom(VIP4, ProbePort), -1)
			if err != nil {
				t.Fatal(err)
			}
			if len(res.rtt) < 10 || len(res.fails) > 0 {
				t.Errorf("probes: got %d completed, %d failed; want >= 10 completed, none failed", len(res.rtt), len(res.fails))
			}
			t.Logf("%d probes, p50 %.0f µs, p99 %.0f µs", len(res.rtt), percentile(res.rtt, 0.5), percentile(res.rtt, 0.99))
		})
	}
}

// TestTrafgenConfig checks that trafgen's configuration holds one packet per
// flow, each the bytes weir's generator sends for that flow.
func TestTrafgenConfig(t *testing.T) {
	cfg := pktgen.Config{SrcMAC: GenMAC, DstMAC: LBInMAC, Dst4: netipPort(VIP4), Flows: 3}
	lines := strings.Split(strings.TrimSpace(string(trafgenConfig(cfg, pktgen.Packet{}))), "\n")
	if len(lines) != 3 {
		t.Fatalf("got %d packets; want 3", len(lines))
	}
	for f, line := range lines {
		want := cfg.Frame(pktgen.Packet{}, f)
		if n := strings.Count(line, "0x"); n != len(want) {
			t.Errorf("packet %d: got %d bytes; want %d", f, n, len(want))
		}
		if !strings.HasPrefix(line, "{0x02,0x78,") || !strings.Contains(line, fmt.Sprintf("0x%02x,0x%02x,0x%02x,0x%02x", want[26], want[27], want[28], want[29])) {
			t.Errorf("packet %d: %s; want the bytes of flow %d's frame", f, line, f)
		}
	}
}

// TestTrafgenSmoke sends briefly from trafgen through the XDP_TX floor. The
// benchmark, not CI, installs trafgen: without it the test is skipped.
func TestTrafgenSmoke(t *testing.T) {
	if !TrafgenAvailable() {
		t.Skip("trafgen not found (netsniff-ng; `make bench-pkt` installs it): skipping the second generator's smoke test")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	opts := Options{Runs: 1, Duration: 200 * time.Millisecond, Warmup: 100 * time.Millisecond}
	res, err := Run(ctx, []Case{{Balancer: FloorNative, Flows: 100, Generator: Trafgen}}, opts)
	xdptest.Check(t, err)
	if s := res[0].Samples[0]; s.Offered == 0 || s.Forwarded == 0 {
		t.Errorf("trafgen through the floor: offered %.0f, forwarded %.0f frames/s; want both > 0", s.Offered, s.Forwarded)
	}
}
