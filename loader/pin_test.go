package loader

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/xdptest"
)

// TestPinnedRestart is the agent's restart without losing flows, at the loader's
// level: long-lived nat and dsr connections keep working while the process that
// loaded the program is gone (Release leaves program, link and maps pinned), and
// after a new Load adopts the pins and the configuration is set again.
func TestPinnedRestart(t *testing.T) {
	nt := newNATTopology(t, ModeNative)
	nt.prog.Close() // the topology's own program makes way for the pinned ones
	pinPath := filepath.Join(xdptest.BPFFS(t), "weir")
	opts := Options{HashSeed: 7, NAT: NATOptions{Addr4: nt.Balancer.IP4, Addr6: nt.Balancer.IP6}, PinPath: pinPath}

	natEcho := Service{Key: ServiceKey{netip.AddrPortFrom(nt.VIP4, echoPort), TCP}, Forwarding: ForwardNAT}
	dsrEcho := Service{Key: ServiceKey{netip.AddrPortFrom(nt.VIP6, echoPort), TCP}, Forwarding: ForwardDSR}
	for i, h := range nt.Backends {
		// backend-0 is the only one with an echo listener: give it the weight.
		w := uint32(0)
		if i == 0 {
			w = 1
		}
		natEcho.Backends = append(natEcho.Backends, Backend{Addr: netip.AddrPortFrom(h.IP4, echoPort), Weight: w, Usable: true})
		dsrEcho.Backends = append(dsrEcho.Backends, Backend{Addr: netip.AddrPortFrom(h.IP6, echoPort), MAC: h.MAC, Weight: w, Usable: true})
	}
	configure := func(p *Program) {
		t.Helper()
		err := nt.Balancer.NS.Do(func() error {
			_, err := p.Attach(nt.Balancer.Link, ModeNative)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range []Service{natEcho, dsrEcho} {
			if err := p.SetService(s); err != nil {
				t.Fatal(err)
			}
		}
	}

	p1, err := Load(opts)
	xdptest.Check(t, err)
	configure(p1)
	var conns []net.Conn
	for _, s := range []Service{natEcho, dsrEcho} {
		c, err := nt.Client.NS.DialWith(context.Background(), &net.Dialer{Timeout: 3 * time.Second}, "tcp", s.Key.VIP.String())
		if err != nil {
			p1.Close()
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns = append(conns, c)
	}
	echo := func(when string) {
		t.Helper()
		for i, c := range conns {
			msg := fmt.Sprintf("%s on connection %d", when, i)
			c.SetDeadline(time.Now().Add(3 * time.Second))
			if _, err := c.Write([]byte(msg)); err != nil {
				t.Fatalf("%s: write: %v", when, err)
			}
			buf := make([]byte, len(msg))
			if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
				t.Fatalf("%s: connection %d read %q, %v; want %q", when, i, buf, err, msg)
			}
		}
	}
	echo("before the restart")
	// Each service's one connection is counted on backend-0. Counts gone astray (as
	// after the LRU forgets flows, or an upgrade from maps without backend_load) are
	// set right by the next Load from the connection tables.
	be0 := map[ServiceKey]netip.AddrPort{natEcho.Key: natEcho.Backends[0].Addr, dsrEcho.Key: dsrEcho.Backends[0].Addr}
	for key, addr := range be0 {
		if got := p1.load(t, key, addr); got != 1 {
			t.Errorf("service %s: backend_load of %s %d with one connection open; want 1", key, addr, got)
		}
		p1.setLoad(t, key, map[netip.AddrPort]int64{addr: 42})
	}

	if err := p1.Release(); err != nil {
		t.Fatal(err)
	}
	echo("with no process holding the program")

	p2, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p2.Close() })
	adopted := map[ServiceKey]int{}
	for _, s := range p2.Services() {
		adopted[s.Key] = len(s.Backends)
	}
	if adopted[natEcho.Key] != 3 || adopted[dsrEcho.Key] != 3 {
		t.Fatalf("adopted %v; want both services with 3 backends", adopted)
	}
	for key, addr := range be0 {
		if got := p2.load(t, key, addr); got != 1 {
			t.Errorf("service %s after the restart: backend_load of %s %d; want 1, recounted from the connection table", key, addr, got)
		}
	}
	configure(p2)
	echo("after the restart")
	if got := p2.Attachments()[nt.Balancer.Link]; got != ModeNative {
		t.Errorf("adopted attachment mode %q; want native", got)
	}
	// New connections work too.
	c, err := nt.Client.NS.DialWith(context.Background(), &net.Dialer{Timeout: 3 * time.Second}, "tcp", natEcho.Key.VIP.String())
	if err != nil {
		t.Fatalf("new connection after the restart: %v", err)
	}
	c.Close()

	if err := p2.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pinPath); !os.IsNotExist(err) {
		entries, _ := os.ReadDir(pinPath)
		t.Errorf("pin path after Close: %v, %d entries; want it removed", err, len(entries))
	}
}
