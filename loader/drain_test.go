package loader

import (
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/weir-lb/weir/internal/packet"
)

// TestDrainWeightExplain checks the per-backend controls: a drained backend keeps its
// flows and gets no new ones (even when every backend is drained), a weight change
// moves new flows only, and Explain reports both tables.
func TestDrainWeightExplain(t *testing.T) {
	p := loadT(t)
	svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(3, false, 80)}
	if err := p.AddService(svc); err != nil {
		t.Fatal(err)
	}
	send := func(sport uint16, flags uint8) (Action, string) {
		t.Helper()
		in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(client4, sport),
			Dst: svc.Key.VIP, TCPFlags: flags}.Build()
		a, out, err := p.Run(in)
		if err != nil {
			t.Fatal(err)
		}
		return a, net.HardwareAddr(out[0:6]).String()
	}
	first := map[uint16]string{}
	for port := uint16(5000); port < 5300; port++ {
		_, first[port] = send(port, packet.SYN)
	}

	// Explain agrees with what the program did.
	for _, port := range []uint16{5000, 5123} {
		ex, err := p.Explain(svc.Key, netip.AddrPortFrom(client4, port))
		if err != nil {
			t.Fatal(err)
		}
		want := wantBackend(t, svc, Flow{Src: netip.AddrPortFrom(client4, port), Dst: svc.Key.VIP, Protocol: TCP})
		if ex.New != want.Addr || ex.Tracked != want.Addr || !ex.TrackedUsable {
			t.Errorf("explain port %d: %+v; want new and tracked %s", port, ex, want.Addr)
		}
	}
	if _, err := p.Explain(ServiceKey{netip.AddrPortFrom(vip4, 1), TCP}, netip.AddrPortFrom(client4, 1)); !errors.Is(err, ErrNoService) {
		t.Errorf("explain of a missing service: %v; want ErrNoService", err)
	}

	drained := svc.Backends[0]
	if err := p.SetBackendDraining(svc.Key, drained.Addr, true); err != nil {
		t.Fatal(err)
	}
	for port, was := range first {
		if _, got := send(port, packet.ACK); got != was {
			t.Fatalf("flow %d moved from %s to %s when a backend was drained; want it to stay", port, was, got)
		}
	}
	for port := uint16(6000); port < 6300; port++ {
		if _, got := send(port, packet.SYN); got == drained.MAC.String() {
			t.Fatalf("new flow %d went to the drained backend", port)
		}
	}
	// Drain the others too: new flows have nowhere to go, established ones continue.
	for _, b := range svc.Backends[1:] {
		if err := p.SetBackendDraining(svc.Key, b.Addr, true); err != nil {
			t.Fatal(err)
		}
	}
	if a, _ := send(7000, packet.SYN); a != XDPDrop {
		t.Errorf("new flow with every backend drained: %s; want XDP_DROP", a)
	}
	if a, got := send(5000, packet.ACK); a != XDPTX || got != first[5000] {
		t.Errorf("established flow with every backend drained: %s to %s; want XDP_TX to %s", a, got, first[5000])
	}
	for _, b := range svc.Backends {
		if err := p.SetBackendDraining(svc.Key, b.Addr, false); err != nil {
			t.Fatal(err)
		}
	}

	// Triple one backend's weight: its share of new flows grows, nobody's flows move.
	heavy := svc.Backends[2]
	if err := p.SetBackendWeight(svc.Key, heavy.Addr, 3); err != nil {
		t.Fatal(err)
	}
	n := 0
	for port := uint16(8000); port < 9000; port++ {
		if _, got := send(port, packet.SYN); got == heavy.MAC.String() {
			n++
		}
	}
	if share := float64(n) / 1000; share < 0.5 || share > 0.7 {
		t.Errorf("backend of weight 3 among 1+1+3 got %.1f%% of new flows; want about 60%%", 100*share)
	}
	for port, was := range first {
		if _, got := send(port, packet.ACK); got != was {
			t.Fatalf("flow %d moved from %s to %s on a weight change; want it to stay", port, was, got)
		}
	}
	if err := p.SetBackendWeight(svc.Key, heavy.Addr, 70000); !errors.Is(err, ErrInvalidService) {
		t.Errorf("weight 70000: %v; want ErrInvalidService", err)
	}
	if err := p.SetBackendWeight(svc.Key, netip.MustParseAddrPort("10.1.1.1:80"), 1); !errors.Is(err, ErrNoBackend) {
		t.Errorf("weight of an unknown backend: %v; want ErrNoBackend", err)
	}
}
