package loader

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/topo"
)

// TestDecapSourcesEndToEnd: a backend whose decapsulator takes tunnel packets only
// from the balancer's own addresses answers clients through the balancer in both
// families; one that takes them only from elsewhere drops the balancer's packets
// (counted foreign), and the clients get no answer until any source is allowed
// again.
func TestDecapSourcesEndToEnd(t *testing.T) {
	tp := topo.NewRoutedT(t, 1)
	p, decaps := tunnelRig(t, tp, ModeGeneric, 3)
	d := decaps[0]
	for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
		if err := p.AddService(tunnelService(vip, 80, tp.Backends)); err != nil {
			t.Fatal(err)
		}
	}
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return tp.Client.NS.DialWith(ctx, &net.Dialer{}, network, addr)
		},
		DisableKeepAlives: true,
	}}
	get := func(vip netip.Addr, timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+netip.AddrPortFrom(vip, 80).String()+"/", nil)
		if err != nil {
			return err
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, err = io.ReadAll(resp.Body)
		return err
	}
	// answered asks until one answer comes, within a deadline a loaded machine meets.
	answered := func(t *testing.T, vip netip.Addr) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for {
			err := get(vip, 2*time.Second)
			if err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: no answer: %v", vip, err)
			}
			time.Sleep(50 * time.Millisecond) // between tries, for an error that comes at once
		}
	}

	t.Run("from-the-balancer", func(t *testing.T) {
		if err := d.SetSources([]netip.Prefix{netip.PrefixFrom(tp.BalancerUp.IP4, 32), netip.PrefixFrom(tp.BalancerUp.IP6, 128)}); err != nil {
			t.Fatal(err)
		}
		for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
			answered(t, vip)
		}
	})
	t.Run("from-elsewhere", func(t *testing.T) {
		if err := d.SetSources([]netip.Prefix{netip.PrefixFrom(tp.Client.IP4, 32), netip.PrefixFrom(tp.Client.IP6, 128)}); err != nil {
			t.Fatal(err)
		}
		before, err := d.Stats()
		if err != nil {
			t.Fatal(err)
		}
		for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
			if err := get(vip, 2*time.Second); err == nil {
				t.Errorf("%s: answered through a decapsulator that takes no tunnel packets from the balancer", vip)
			}
		}
		after, err := d.Stats()
		if err != nil {
			t.Fatal(err)
		}
		if after.Foreign.Packets == before.Foreign.Packets {
			t.Errorf("counted no tunnel packets foreign; want the balancer's SYNs")
		}
	})
	t.Run("any-again", func(t *testing.T) {
		if err := d.SetSources(nil); err != nil {
			t.Fatal(err)
		}
		for _, vip := range []netip.Addr{tp.VIP4, tp.VIP6} {
			answered(t, vip)
		}
	})
}
