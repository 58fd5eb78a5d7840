package loader

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestNATHalfClose: a client sends its request and half-closes, and the backend
// answers after longer than the closing timeout. The client must get the whole
// answer and a clean end: a FIN one way half-closes a nat flow, it does not start
// the short timeout. (With the FIN taken for a close, the flow expired while the
// backend thought; the client's ACK of the answer then went out from a new port, the
// backend reset that, and the reset reached the client.) A FIN each way still
// does: the flow is no longer counted.
func TestNATHalfClose(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("v6=%v", v6), func(t *testing.T) { natHalfClose(t, v6) })
	}
}

func natHalfClose(t *testing.T, v6 bool) {
	const (
		closing = time.Second
		think   = closing * 5 / 2 // the backend's wait between the request's end and its answer
	)
	tp, p, vip := newOneBackendNAT(t, "whc", v6, TCP, NATOptions{TCPClosing: closing})
	ln, err := tp.Backends[0].NS.Listen("tcp", fmt.Sprintf(":%d", echoPort))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	served := make(chan error, 1)
	// Exits after one connection, or when the listener is closed at cleanup.
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer c.Close()
		req, err := io.ReadAll(c) // to the client's FIN
		if err != nil {
			served <- fmt.Errorf("backend: read the request: %w", err)
			return
		}
		time.Sleep(think)
		_, err = c.Write(append([]byte("answer to "), req...))
		served <- err
	}()
	c, err := tp.DialTCP(context.Background(), vip, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(think + 10*time.Second))
	if _, err := c.Write([]byte("the request")); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "answer to the request" {
		t.Fatalf("after %v: read %q, %v; want %q and a clean end", time.Since(sent).Round(time.Millisecond), got, err, "answer to the request")
	}
	if err := <-served; err != nil {
		t.Fatal(err)
	}
	if d := time.Since(sent); d < think {
		t.Fatalf("the answer came %v after the half-close; want the backend's %v think first", d, think)
	}
	// Both FINs have passed: the flow is closed and no longer counted.
	key := ServiceKey{vip, TCP}
	waitfor.Value(t, 5*time.Second, fmt.Sprintf("no flow of %v counted after a FIN each way", key), func() (any, bool) {
		f, err := p.Flows(key)
		if err != nil {
			t.Fatal(err)
		}
		return f.PerBackend, len(f.PerBackend) == 0
	})
}

// newOneBackendNAT is a topology with one backend behind a nat service of proto on
// echoPort (IPv6 if v6), the balancer attached natively with nat options (its
// addresses filled in). It returns the service's VIP:port.
func newOneBackendNAT(t *testing.T, name string, v6 bool, proto Protocol, nat NATOptions) (*topo.Topology, *Program, netip.AddrPort) {
	t.Helper()
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName(name), Backends: 1})
	nat.Addr4, nat.Addr6 = tp.Balancer.IP4, tp.Balancer.IP6
	p := attachBalancer(t, tp, ModeNative, Options{HashSeed: 7, NAT: nat})
	vip, ip := netip.AddrPortFrom(tp.VIP4, echoPort), tp.Backends[0].IP4
	if v6 {
		vip, ip = netip.AddrPortFrom(tp.VIP6, echoPort), tp.Backends[0].IP6
	}
	svc := Service{Key: ServiceKey{vip, proto}, Forwarding: ForwardNAT,
		Backends: []Backend{{Addr: netip.AddrPortFrom(ip, echoPort), Weight: 1, Usable: true}}}
	if err := p.AddService(svc); err != nil {
		t.Fatal(err)
	}
	return tp, p, vip
}
