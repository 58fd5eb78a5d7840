package loader

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// fallbackConns is how many keep-alive connections TestFallbackEndToEnd holds open.
const fallbackConns = 48

// fallbackNet is one topology of TestFallbackEndToEnd: where the balancer's links
// are, how a client connects, and the service with all its backends (the test
// starts with all but the last).
type fallbackNet struct {
	balancer *netns.NS
	links    []string
	dial     func(ctx context.Context) (net.Conn, error)
	service  Service
	nat      NATOptions                // tunnel mode's outer source
	names    map[string]netip.AddrPort // backend name (its answer) -> address
}

// dsrFallbackNet is the L2 topology with three backends behind a dsr service.
func dsrFallbackNet(t *testing.T) fallbackNet {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wfb"), Backends: 3})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := tp.ServeBackends(ctx); err != nil {
		t.Fatal(err)
	}
	n := fallbackNet{balancer: tp.Balancer.NS, links: []string{tp.Balancer.Link}, names: map[string]netip.AddrPort{},
		service: Service{Key: ServiceKey{netip.AddrPortFrom(tp.VIP4, 80), TCP}, Forwarding: ForwardDSR}}
	for _, b := range tp.Backends {
		a := netip.AddrPortFrom(b.IP4, 80)
		n.service.Backends = append(n.service.Backends, Backend{Addr: a, MAC: b.MAC, Weight: 1, Usable: true})
		n.names[b.Name] = a
	}
	n.dial = func(ctx context.Context) (net.Conn, error) {
		return tp.DialTCP(ctx, netip.AddrPortFrom(tp.VIP4, 80), 0)
	}
	return n
}

// tunnelFallbackNet is the routed topology with three decapsulating backends
// behind a tunnel service.
func tunnelFallbackNet(t *testing.T) fallbackNet {
	tp := topo.NewRoutedT(t, 3)
	n := fallbackNet{balancer: tp.Balancer.NS, links: []string{tp.Balancer.Link, tp.BalancerUp.Link}, names: map[string]netip.AddrPort{},
		service: Service{Key: ServiceKey{netip.AddrPortFrom(tp.VIP4, 80), TCP}, Forwarding: ForwardTunnel},
		nat:     NATOptions{Addr4: tp.BalancerUp.IP4, Addr6: tp.BalancerUp.IP6}}
	for i, b := range tp.Backends {
		name := fmt.Sprintf("backend-%d", i)
		serveBackend(t, b, name)
		d, err := LoadDecap([]netip.Addr{b.IP4, b.IP6})
		xdptest.Check(t, err)
		t.Cleanup(func() { d.Close() })
		xdptest.Check(t, b.NS.Do(func() error { _, err := d.Attach(b.Link, ModeNative); return err }))
		a := netip.AddrPortFrom(b.IP4, 80)
		n.service.Backends = append(n.service.Backends, Backend{Addr: a, Weight: 1, Usable: true})
		n.names[name] = a
	}
	n.dial = func(ctx context.Context) (net.Conn, error) {
		return tp.Client.NS.DialWith(ctx, &net.Dialer{Timeout: 3 * time.Second}, "tcp", netip.AddrPortFrom(tp.VIP4, 80).String())
	}
	return n
}

// askConn is one HTTP/1.1 keep-alive connection: each answer names the backend
// that holds its flow.
type askConn struct {
	c  net.Conn
	br *bufio.Reader
}

func (k *askConn) ask() (string, error) {
	k.c.SetDeadline(time.Now().Add(3 * time.Second))
	return topo.Ask(k.c, k.br)
}

// TestFallbackEndToEnd is a balancer node failing while a backend is added, on real
// XDP: node a's program carries 48 keep-alive HTTP connections; a backend is added
// on both nodes (the table changes); then a's program is detached and node b's,
// which never saw the connections, attached in its place, as a router moves a dead
// node's flows to another. With the previous-table fallback every connection goes
// on with its backend, and b counts flow_fallback once for each connection whose
// table entry moved to the new backend; without it those connections reach the new
// backend, which resets them. In dsr and in tunnel mode.
func TestFallbackEndToEnd(t *testing.T) {
	for _, mode := range []struct {
		name  string
		build func(*testing.T) fallbackNet
	}{
		{"dsr", dsrFallbackNet},
		{"tunnel", tunnelFallbackNet},
	} {
		for _, window := range []time.Duration{time.Hour, 0} {
			name := mode.name + "/fallback on"
			if window == 0 {
				name = mode.name + "/fallback off"
			}
			t.Run(name, func(t *testing.T) {
				fallbackEndToEnd(t, mode.build(t), window)
			})
		}
	}
}

func fallbackEndToEnd(t *testing.T, n fallbackNet, window time.Duration) {
	opts := Options{HashSeed: 11, ConntrackSize: 4096, PreviousTableWindow: window, NAT: n.nat}
	nodes := [2]*Program{}
	for i := range nodes {
		p, err := Load(opts)
		xdptest.Check(t, err)
		t.Cleanup(func() { p.Close() })
		nodes[i] = p
	}
	a, b := nodes[0], nodes[1]
	all := n.service
	first := all
	first.Backends = all.Backends[:len(all.Backends)-1]
	for _, p := range nodes {
		if err := p.AddService(first); err != nil {
			t.Fatal(err)
		}
	}
	attach := func(p *Program) {
		t.Helper()
		xdptest.Check(t, n.balancer.Do(func() error {
			for _, l := range n.links {
				if _, err := p.Attach(l, ModeNative); err != nil {
					return err
				}
			}
			return nil
		}))
	}
	attach(a)

	conns := make([]*askConn, fallbackConns)
	was := make([]string, len(conns))
	for i := range conns {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c, err := n.dial(ctx)
		cancel()
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i] = &askConn{c: c, br: bufio.NewReader(c)}
		if was[i], err = conns[i].ask(); err != nil {
			t.Fatalf("connection %d, first request: %v", i, err)
		}
	}
	for _, p := range nodes {
		if err := p.UpdateService(all); err != nil {
			t.Fatal(err)
		}
	}
	// Node a knows every connection: the change moves none of them.
	for i, c := range conns {
		if got, err := c.ask(); err != nil || got != was[i] {
			t.Fatalf("connection %d on node a after the change: %q, %v; want %s", i, got, err, was[i])
		}
	}

	// Node a dies; node b takes its traffic.
	xdptest.Check(t, n.balancer.Do(func() error {
		for _, l := range n.links {
			if err := a.Detach(l); err != nil {
				return err
			}
		}
		return nil
	}))
	attach(b)
	before, err := b.Stats()
	if err != nil {
		t.Fatal(err)
	}
	moved, survived := 0, 0
	for i, c := range conns {
		ex, err := b.Explain(all.Key, netip.MustParseAddrPort(c.c.LocalAddr().String()))
		if err != nil {
			t.Fatal(err)
		}
		if ex.New != n.names[was[i]] {
			moved++
		}
		got, err := c.ask()
		if err == nil && got == was[i] {
			survived++
		}
	}
	after, err := b.Stats()
	if err != nil {
		t.Fatal(err)
	}
	fallback := after.Reasons[ReasonFlowFallback].Packets - before.Reasons[ReasonFlowFallback].Packets
	t.Logf("%d connections, %d of them in table entries the new backend took: %d survived the node change, flow_fallback %d",
		len(conns), moved, survived, fallback)
	if moved == 0 {
		t.Fatal("no connection's table entry moved to the new backend: the test proves nothing")
	}
	wantSurvived, wantFallback := len(conns), uint64(moved)
	if window == 0 {
		wantSurvived, wantFallback = len(conns)-moved, 0
	}
	if survived != wantSurvived || fallback != wantFallback {
		t.Errorf("survived %d, flow_fallback %d; want %d and %d", survived, fallback, wantSurvived, wantFallback)
	}
}
