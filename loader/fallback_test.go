package loader

import (
	"bytes"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/balance"
)

// loadFleetNode loads a program as one node of a fleet: every node of a test loads
// the same options.
func loadFleetNode(t *testing.T, opts Options) *Program {
	t.Helper()
	p, err := Load(opts)
	xdptest.Check(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// TestPreviousTableFallback opens flows on one node (a), changes the service's
// table on both nodes by adding a backend, and sends the flows' next packets to the
// other node (b), which never saw them, as a router does when a node dies. With
// the fallback on, b sends every one to the backend it had (flow_fallback for
// those whose table entry moved), byte for byte, and keeps it there; with it off
// the moved ones go to the new backend. SYNs take the current table either way, and
// an expired generation is the same as none.
func TestPreviousTableFallback(t *testing.T) {
	for _, tc := range []struct {
		name   string
		window time.Duration
	}{
		{"on", time.Hour},
		{"off", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := Options{HashSeed: testSeed, ConntrackSize: 4096, PreviousTableWindow: tc.window}
			a, b := loadFleetNode(t, opts), loadFleetNode(t, opts)
			all := testBackends(4, false, 80)
			svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, TableSize: 251, Backends: all[:3]}
			grown := svc
			grown.Backends = all
			for _, p := range []*Program{a, b} {
				if err := p.AddService(svc); err != nil {
					t.Fatal(err)
				}
			}
			frame := func(sport uint16, flags uint8) []byte {
				return packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(client4, sport),
					Dst: netip.AddrPortFrom(vip4, 80), TCPFlags: flags}.Build()
			}
			send := func(p *Program, in []byte) []byte {
				t.Helper()
				action, out, err := p.Run(in)
				if err != nil || action != XDPTX {
					t.Fatalf("action %s, err %v; want XDP_TX", action, err)
				}
				return out
			}
			const flows = 300
			opened := make(map[uint16][]byte) // sport -> the backend's MAC
			for port := uint16(20000); port < 20000+flows; port++ {
				send(a, frame(port, packet.SYN))
				opened[port] = send(a, frame(port, packet.ACK))[0:6]
			}
			for _, p := range []*Program{a, b} {
				if err := p.UpdateService(grown); err != nil {
					t.Fatal(err)
				}
				// Applying the same configuration again is no new generation: it
				// must not push the previous one out.
				if err := p.UpdateService(grown); err != nil {
					t.Fatal(err)
				}
			}
			before, err := b.Stats()
			if err != nil {
				t.Fatal(err)
			}
			moved, kept := 0, 0
			for port, mac := range opened {
				now := wantBackend(t, grown, Flow{Src: netip.AddrPortFrom(client4, port), Dst: svc.Key.VIP, Protocol: TCP}).MAC
				in := frame(port, packet.ACK|packet.PSH)
				want := mac
				if tc.window == 0 {
					want = now
				}
				if !bytes.Equal(now, mac) {
					moved++
				}
				// Twice: the first packet is recorded half-open, the second establishes.
				for range 2 {
					if out := send(b, in); !bytes.Equal(out, dsrOut(in, want)) {
						t.Fatalf("flow %d on node b:\n got %x\nwant %x", port, out, dsrOut(in, want))
					}
				}
				if bytes.Equal(send(a, in)[0:6], mac) {
					kept++
				}
			}
			after, err := b.Stats()
			if err != nil {
				t.Fatal(err)
			}
			fallback := after.Reasons[ReasonFlowFallback].Packets - before.Reasons[ReasonFlowFallback].Packets
			established := after.Reasons[ReasonFlowEstablished].Packets - before.Reasons[ReasonFlowEstablished].Packets
			wantFallback := uint64(moved)
			if tc.window == 0 {
				wantFallback = 0
			}
			if moved == 0 || fallback != wantFallback || established != flows || kept != flows {
				t.Errorf("%d of %d flows' entries moved; flow_fallback %d, flow_established %d, kept on node a %d; want %d, %d, %d",
					moved, flows, fallback, established, kept, wantFallback, flows, flows)
			}

			// A SYN starts a new connection: the current table, fallback or not.
			for port := range opened {
				in := frame(port+flows, packet.SYN)
				now := wantBackend(t, grown, Flow{Src: netip.AddrPortFrom(client4, port+flows), Dst: svc.Key.VIP, Protocol: TCP}).MAC
				if out := send(b, in); !bytes.Equal(out[0:6], now) {
					t.Fatalf("syn %d went to %x; want the current table's %x", port+flows, out[0:6], now)
				}
			}

			// Past the window the previous generation is gone from the program.
			if err := b.ExpirePreviousTables(time.Now().Add(tc.window + time.Minute)); err != nil {
				t.Fatal(err)
			}
			if ti := b.Tables()[svc.Key]; ti.Previous != "" {
				t.Errorf("after expiry the previous generation %q is still addressable", ti.Previous)
			}
			var inner *ebpf.Map
			if err := b.objs.PrevLookupTables.Lookup(b.services[svc.Key].id, &inner); err == nil {
				inner.Close()
				t.Errorf("prev_lookup_tables still holds the service's previous table after expiry")
			}
		})
	}
}

// TestFingerprint checks that a table's fingerprint names backends by address, not
// by the node-local slots: nodes whose slots differ agree, a different hash seed
// or backend set does not, and the previous generation's is reported while the
// fallback may use it.
func TestFingerprint(t *testing.T) {
	opts := Options{HashSeed: testSeed, ConntrackSize: 4096, PreviousTableWindow: time.Hour}
	a := loadFleetNode(t, opts)
	b := loadFleetNode(t, opts)
	other := opts
	other.HashSeed++
	c := loadFleetNode(t, other)

	svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(3, false, 80)}
	// b's backend slots start elsewhere: another service takes the first ones.
	filler := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 81), TCP}, Backends: testBackends(5, false, 81)}
	if err := b.AddService(filler); err != nil {
		t.Fatal(err)
	}
	// And its backends come in another order.
	reversed := svc
	reversed.Backends = slices.Clone(svc.Backends)
	slices.Reverse(reversed.Backends)
	for p, s := range map[*Program]Service{a: svc, b: reversed, c: svc} {
		if err := p.AddService(s); err != nil {
			t.Fatal(err)
		}
	}
	if sa, sb := a.services[svc.Key].slots[svc.Backends[0].Addr], b.services[svc.Key].slots[svc.Backends[0].Addr]; sa == sb {
		t.Fatalf("both nodes put %s in slot %d; the test needs different slots", svc.Backends[0].Addr, sa)
	}
	fa, fb, fc := a.Tables()[svc.Key], b.Tables()[svc.Key], c.Tables()[svc.Key]
	if fa.Fingerprint == "" || fa.Fingerprint != fb.Fingerprint || fa.Size == 0 || fa.Size != fb.Size {
		t.Errorf("same configuration, different slots: fingerprints %+v and %+v; want equal and set", fa, fb)
	}
	if fc.Fingerprint == fa.Fingerprint {
		t.Errorf("another hash seed gives the same fingerprint %s", fc.Fingerprint)
	}
	if fa.Previous != "" {
		t.Errorf("a new service has previous generation %q; want none", fa.Previous)
	}

	first := fa.Fingerprint
	if err := a.SetBackendUsable(svc.Key, svc.Backends[1].Addr, false); err != nil {
		t.Fatal(err)
	}
	ti := a.Tables()[svc.Key]
	if ti.Fingerprint == first || ti.Previous != first || time.Since(ti.PreviousSince) > time.Minute {
		t.Errorf("after a change: %+v; want a new fingerprint, previous %s replaced just now", ti, first)
	}
	ex, err := a.Explain(svc.Key, netip.AddrPortFrom(client4, 1234))
	if err != nil {
		t.Fatal(err)
	}
	if ex.Fingerprint != ti.Fingerprint || !ex.Previous.IsValid() || !ex.New.IsValid() {
		t.Errorf("explain %+v; want fingerprint %s and both generations' picks", ex, ti.Fingerprint)
	}
	// The backend comes back: the table is the first one again, and the one in
	// between is no generation to fall back on.
	if err := a.SetBackendUsable(svc.Key, svc.Backends[1].Addr, true); err != nil {
		t.Fatal(err)
	}
	if ti := a.Tables()[svc.Key]; ti.Fingerprint != first || ti.Previous != "" {
		t.Errorf("after a flap: %+v; want fingerprint %s again and no previous generation", ti, first)
	}
	var inner *ebpf.Map
	if err := a.objs.PrevLookupTables.Lookup(a.services[svc.Key].id, &inner); err == nil {
		inner.Close()
		t.Errorf("prev_lookup_tables holds a table after a flap; want none")
	}
	// No backend usable: no table, no fingerprint.
	for _, be := range svc.Backends {
		if err := a.SetBackendUsable(svc.Key, be.Addr, false); err != nil {
			t.Fatal(err)
		}
	}
	if ti := a.Tables()[svc.Key]; ti.Fingerprint != "" || ti.Size != 0 {
		t.Errorf("no usable backend: %+v; want no fingerprint and size 0", ti)
	}
}

// TestFingerprintGolden pins the fingerprint of one table: nodes running different
// weir versions must agree on it, so a change to what it covers is a new version
// of its prefix, and this value changes on purpose only.
func TestFingerprintGolden(t *testing.T) {
	s := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, TableSize: 31, Backends: testBackends(3, false, 80)}
	members := make([]balance.Backend, len(s.Backends))
	for i, b := range s.Backends {
		members[i] = balance.Backend{ID: b.Addr.String(), Weight: b.Weight, Usable: true}
	}
	entries, err := balance.BuildMaglev(members, s.TableSize, testSeed)
	if err != nil {
		t.Fatal(err)
	}
	addrs := make([]netip.AddrPort, len(entries))
	for i, e := range entries {
		addrs[i] = s.Backends[e].Addr
	}
	got, ids := fingerprint(testSeed, false, addrs)
	if want := "d5bf3d9c09a4f9d3"; got != want || len(ids) != 3 {
		t.Errorf("fingerprint %s of %v; want %s of the 3 backends", got, ids, want)
	}
	if other, _ := fingerprint(testSeed, true, addrs); other == got {
		t.Errorf("source-only hashing gives the same fingerprint %s", got)
	}
}

// TestPinnedRestartKeepsTables: a program loaded over pinned maps adopts the
// services' lookup tables, current and previous, so the same configuration set
// again swaps nothing, the fallback goes on across the restart and status shows the
// fingerprints it showed before.
func TestPinnedRestartKeepsTables(t *testing.T) {
	for _, p2c := range []bool{false, true} {
		t.Run(fmt.Sprintf("maglev_p2c=%t", p2c), func(t *testing.T) { pinnedRestartKeepsTables(t, p2c) })
	}
}

func pinnedRestartKeepsTables(t *testing.T, p2c bool) {
	opts := Options{HashSeed: testSeed, ConntrackSize: 4096, PreviousTableWindow: time.Hour,
		PinPath: filepath.Join(xdptest.BPFFS(t), "weir")}
	all := testBackends(4, false, 80)
	first := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, TableSize: 251, Backends: all[:3], P2C: p2c}
	grown := first
	grown.Backends = all
	p1, err := Load(opts)
	xdptest.Check(t, err)
	for _, s := range []Service{first, grown} {
		if err := p1.SetService(s); err != nil {
			t.Fatal(err)
		}
	}
	before := p1.Tables()[first.Key]
	if err := p1.Release(); err != nil {
		t.Fatal(err)
	}

	p2, err := Load(opts)
	xdptest.Check(t, err)
	t.Cleanup(func() { p2.Close() })
	adopted := p2.Tables()[first.Key]
	if adopted.Fingerprint != before.Fingerprint || adopted.Previous != before.Previous || adopted.Previous == "" {
		t.Errorf("adopted tables %+v; before the restart %+v", adopted, before)
	}
	if err := p2.SetService(grown); err != nil {
		t.Fatal(err)
	}
	if got := p2.Tables()[first.Key]; got.Fingerprint != before.Fingerprint || got.Previous != before.Previous {
		t.Errorf("after setting the same configuration again: %+v; want %+v", got, before)
	}
	// A flow the previous table gives another backend than the current one: the
	// fallback still sends it there.
	for port := uint16(20000); port < 21000; port++ {
		f := Flow{Src: netip.AddrPortFrom(client4, port), Dst: first.Key.VIP, Protocol: TCP}
		was, now := wantBackend(t, first, f), wantBackend(t, grown, f)
		if was.Addr == now.Addr {
			continue
		}
		in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: f.Src, Dst: f.Dst, TCPFlags: packet.ACK}.Build()
		action, out, err := p2.Run(in)
		if err != nil || action != XDPTX || !bytes.Equal(out, dsrOut(in, was.MAC)) {
			t.Fatalf("flow %d after the restart: %s, %v, %x; want XDP_TX to %s", port, action, err, out, was.Addr)
		}
		return
	}
	t.Fatal("no flow of 1000 moved with the change: the test proves nothing")
}

// TestBriefGenerations: tables that serve only briefly (slow-start steps one a
// second, a flap, changes pushed in a row) do not push out the previous
// generation, which holds the connections worth falling back to; a table that
// served longer does.
func TestBriefGenerations(t *testing.T) {
	p := loadFleetNode(t, Options{HashSeed: testSeed, ConntrackSize: 4096, PreviousTableWindow: time.Hour})
	all := testBackends(4, false, 80)
	first := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, TableSize: 251, Backends: all[:3]}
	if err := p.AddService(first); err != nil {
		t.Fatal(err)
	}
	before := p.Tables()[first.Key].Fingerprint
	// A new backend ramping up: its weight in steps, as slow start's table weights.
	steps := []uint32{10, 40, 70, 100}
	ramp := first
	ramp.Backends = slices.Clone(all)
	for i := range ramp.Backends {
		ramp.Backends[i].Weight = 100
	}
	var prints []string
	for _, w := range steps {
		ramp.Backends[3].Weight = w
		if err := p.SetService(ramp); err != nil {
			t.Fatal(err)
		}
		ti := p.Tables()[first.Key]
		prints = append(prints, ti.Fingerprint)
		if ti.Previous != before {
			t.Fatalf("at ramp weight %d the previous generation is %q; want the table before the ramp, %s", w, ti.Previous, before)
		}
	}
	// A connection opened before the ramp, in an entry the ramp gave the new backend:
	// the fallback still sends it to the backend it had.
	moved := false
	for port := uint16(20000); port < 21000 && !moved; port++ {
		f := Flow{Src: netip.AddrPortFrom(client4, port), Dst: first.Key.VIP, Protocol: TCP}
		was, now := wantBackend(t, first, f), wantBackend(t, ramp, f)
		if was.Addr == now.Addr {
			continue
		}
		moved = true
		in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: f.Src, Dst: f.Dst, TCPFlags: packet.ACK}.Build()
		if action, out, err := p.Run(in); err != nil || action != XDPTX || !bytes.Equal(out, dsrOut(in, was.MAC)) {
			t.Fatalf("flow %d after the ramp: %s, %v; want XDP_TX to %s, its backend before the ramp", port, action, err, was.Addr)
		}
	}
	if !moved {
		t.Fatal("no flow of 1000 moved with the ramp: the test proves nothing")
	}

	// Once the last table has served a while, the next change makes it the previous.
	p.mu.Lock()
	p.services[first.Key].tableSince = time.Now().Add(-2 * maxBriefGeneration)
	p.mu.Unlock()
	if err := p.SetBackendDraining(first.Key, all[0].Addr, true); err != nil {
		t.Fatal(err)
	}
	if ti := p.Tables()[first.Key]; ti.Previous != prints[len(prints)-1] {
		t.Errorf("after a table that served %v: previous %q; want it, %s", 2*maxBriefGeneration, ti.Previous, prints[len(prints)-1])
	}
}
