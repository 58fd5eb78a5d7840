package loader

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/weir-lb/weir/bpf"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/balance"
)

// TestPreview: the table LookupTable predicts is the one the program holds (read
// back by Table), and Flows counts each backend's established flows, as the
// program's own forwarding decisions say, for both families; then, through the
// steps of a slow start (a backend added at a tenth of its weight, rebuilt up to all
// of it), no established flow moves and each step's table is the predicted one.
func TestPreview(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("v6=%v", v6), func(t *testing.T) {
			p := loadT(t)
			vip, client := vip4, client4
			if v6 {
				vip, client = vip6, client6
			}
			all := testBackends(4, v6, 80)
			svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip, 80), TCP}, Backends: all[:3]}
			if err := p.AddService(svc); err != nil {
				t.Fatal(err)
			}
			checkTable := func(s Service) {
				t.Helper()
				want, err := LookupTable(s, testSeed)
				if err != nil {
					t.Fatal(err)
				}
				got, err := p.Table(s.Key)
				if err != nil {
					t.Fatal(err)
				}
				if len(got) != len(want) || !slices.Equal(got, want) {
					t.Fatalf("table: the program's (%d entries) differs from LookupTable's (%d entries)", len(got), len(want))
				}
			}
			checkTable(svc)
			byMAC := map[string]netip.AddrPort{}
			for _, b := range all {
				byMAC[b.MAC.String()] = b.Addr
			}
			send := func(sport uint16, flags uint8) netip.AddrPort {
				t.Helper()
				in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(client, sport),
					Dst: netip.AddrPortFrom(vip, 80), TCPFlags: flags}.Build()
				action, out, err := p.Run(in)
				if err != nil || action != XDPTX {
					t.Fatalf("flow %d: action %s, err %v; want XDP_TX", sport, action, err)
				}
				return byMAC[net.HardwareAddr(out[0:6]).String()]
			}
			want := map[netip.AddrPort]uint64{}
			first := map[uint16]netip.AddrPort{}
			for port := uint16(20000); port < 20300; port++ {
				send(port, packet.SYN)
				first[port] = send(port, packet.ACK) // established: in the connection table
				want[first[port]]++
			}
			for port := uint16(40000); port < 40020; port++ {
				send(port, packet.SYN) // half-open: not counted
			}
			got, err := p.Flows(svc.Key)
			if err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(got.PerBackend) != fmt.Sprint(want) {
				t.Errorf("flows per backend: got %v; want %v", got.PerBackend, want)
			}
			// Each flow's hash indexes the table to the backend it holds.
			table, _ := p.Table(svc.Key)
			onHash := map[netip.AddrPort]uint64{}
			for _, h := range got.Hashes {
				onHash[table[h%uint32(len(table))]]++
			}
			if fmt.Sprint(onHash) != fmt.Sprint(want) {
				t.Errorf("the flows' hashes index the table to %v; want %v", onHash, want)
			}

			// Slow start of backend 3, in the planner's ramp steps (a tenth to all).
			for _, ramp := range []uint32{balance.RampFull / 10, balance.RampFull * 4 / 10, balance.RampFull * 7 / 10, 0} {
				step := svc
				step.Backends = slices.Clone(all)
				step.Backends[3].Ramp = ramp
				if err := p.UpdateService(step); err != nil {
					t.Fatal(err)
				}
				checkTable(step)
				for port, was := range first {
					if got := send(port, packet.ACK); got != was {
						t.Fatalf("step ramp %d: established flow %d moved from %s to %s", ramp, port, was, got)
					}
				}
			}
			if got, _ := p.Flows(svc.Key); fmt.Sprint(got.PerBackend) != fmt.Sprint(want) {
				t.Errorf("flows per backend after the steps: got %v; want %v", got.PerBackend, want)
			}
		})
	}
}

// TestDownMovesOwnEntries: a backend of 100 going down changes, in the program's
// table, only the entries it held (a rebuild of Maglev's fill would move about half
// as many again of the others'), and coming back restores the table entry for entry.
func TestDownMovesOwnEntries(t *testing.T) {
	p := loadT(t)
	all := testBackends(100, false, 80)
	svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: all}
	if err := p.AddService(svc); err != nil {
		t.Fatal(err)
	}
	before, err := p.Table(svc.Key)
	if err != nil {
		t.Fatal(err)
	}
	gone := all[37].Addr
	if err := p.SetBackendUsable(svc.Key, gone, false); err != nil {
		t.Fatal(err)
	}
	after, err := p.Table(svc.Key)
	if err != nil {
		t.Fatal(err)
	}
	moved := 0
	for i := range before {
		if before[i] == after[i] {
			continue
		}
		if before[i] != gone {
			t.Fatalf("entry %d of %s, which stayed up, moved to %s", i, before[i], after[i])
		}
		moved++
	}
	if share := len(before) / len(all); moved < share*9/10 {
		t.Errorf("%d entries moved; want the down backend's, about %d", moved, share)
	}
	if err := p.SetBackendUsable(svc.Key, gone, true); err != nil {
		t.Fatal(err)
	}
	if back, _ := p.Table(svc.Key); !slices.Equal(back, before) {
		t.Errorf("%s back up: the table differs from the one before it went down; want identical", gone)
	}
	// Its whole state in one change, as the agent writes a slow-start step.
	if err := p.SetBackendState(svc.Key, gone, true, false, 1, balance.RampFull/10); err != nil {
		t.Fatal(err)
	}
	ramped := svc
	ramped.Backends = slices.Clone(all)
	ramped.Backends[37].Ramp = balance.RampFull / 10
	want, err := LookupTable(ramped, testSeed)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := p.Table(svc.Key); !slices.Equal(got, want) {
		t.Errorf("after SetBackendState with a ramp: the program's table differs from LookupTable's")
	}
}

// TestFlowsNAT: nat flows are counted once established, and no longer once they are
// closing: after an RST, or a FIN each way. A FIN one way half-closes a flow, which
// the other side may go on using, so it still counts.
func TestFlowsNAT(t *testing.T) {
	nt := newNATTopology(t, ModeGeneric)
	web := nt.web[false]
	run := func(in packet.Frame) []byte {
		t.Helper()
		var action Action
		var out []byte
		err := nt.Balancer.NS.Do(func() error {
			var err error
			action, out, err = nt.prog.RunOn(in.Build(), nt.Balancer.Index)
			return err
		})
		if err != nil || action != XDPTX {
			t.Fatalf("%v: action %s, err %v; want XDP_TX", in.Src, action, err)
		}
		return out
	}
	// send sends the client's packet; it returns the backend it went to and the nat
	// port it went from.
	send := func(sport uint16, flags uint8) (netip.AddrPort, uint16) {
		t.Helper()
		out := run(packet.Frame{SrcMAC: nt.Client.MAC, DstMAC: nt.Balancer.MAC, Src: netip.AddrPortFrom(nt.Client.IP4, sport),
			Dst: web.Key.VIP, TCPFlags: flags})
		dst := netip.AddrFrom4([4]byte(out[14+16 : 14+20]))
		return netip.AddrPortFrom(dst, web.Key.VIP.Port()), binary.BigEndian.Uint16(out[14+20:])
	}
	// reply sends the backend's packet to the nat port.
	reply := func(from netip.AddrPort, natPort uint16, flags uint8) {
		t.Helper()
		var mac net.HardwareAddr
		for _, b := range nt.Backends {
			if b.IP4 == from.Addr() {
				mac = b.MAC
			}
		}
		run(packet.Frame{SrcMAC: mac, DstMAC: nt.Balancer.MAC, Src: from,
			Dst: netip.AddrPortFrom(nt.Balancer.IP4, natPort), TCPFlags: flags})
	}
	want := map[netip.AddrPort]uint64{}
	for port := uint16(30000); port < 30060; port++ {
		send(port, packet.SYN)
		b, natPort := send(port, packet.ACK)
		switch port % 5 {
		case 0: // the client's RST
			send(port, packet.RST|packet.ACK)
		case 1: // the client's FIN, then the backend's
			send(port, packet.FIN|packet.ACK)
			reply(b, natPort, packet.FIN|packet.ACK)
		case 2: // the backend's FIN, then the client's
			reply(b, natPort, packet.FIN|packet.ACK)
			send(port, packet.FIN|packet.ACK)
		case 3: // the client's FIN alone: half-closed
			send(port, packet.FIN|packet.ACK)
			want[b]++
		default:
			want[b]++
		}
	}
	got, err := nt.prog.Flows(web.Key)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got.PerBackend) != fmt.Sprint(want) {
		t.Errorf("flows per backend: got %v; want %v (24 established, 12 of them half-closed; 36 closed not counted)", got.PerBackend, want)
	}
}

// BenchmarkFlows: what weir plan's read of a busy service costs per entry of the
// connection table (40,000 dsr flows of one service among 40,000 of another), against
// reading the same table entry by entry with Map.Iterate (two system calls an entry)
// in the same run: Flows reads it in batches.
func BenchmarkFlows(b *testing.B) {
	p, err := Load(Options{HashSeed: testSeed, ConntrackSize: 262144})
	xdptest.Check(b, err)
	b.Cleanup(func() { p.Close() })
	svc := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, Backends: testBackends(4, false, 80)}
	other := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 81), TCP}, Backends: testBackends(4, false, 81)}
	for _, s := range []Service{svc, other} {
		if err := p.AddService(s); err != nil {
			b.Fatal(err)
		}
	}
	fp := p.flowPairs()[lbConntrack]
	const n = 40_000
	for i := range 2 * n {
		port := uint16(80 + i%2)
		k := flowKey(Flow{Src: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 16), byte(i >> 8)}), uint16(i)),
			Dst: netip.AddrPortFrom(vip4, port), Protocol: TCP})
		st := p.services[svc.Key]
		if port == 81 {
			st = p.services[other.Key]
		}
		if err := putPair(fp, k, bpf.WeirLbFlow{BackendId: st.slots[netip.AddrPortFrom(svc.Backends[i%4].Addr.Addr(), port)]}); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("iterate", func(b *testing.B) {
		for b.Loop() {
			var k bpf.WeirFlowKey4
			var v bpf.WeirLbFlow
			it := fp.v4.Iterate()
			for it.Next(&k, &v) {
			}
			if err := it.Err(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/(2*n), "ns/entry")
	})
	b.Run("flows", func(b *testing.B) {
		for b.Loop() {
			fs, err := p.Flows(svc.Key)
			if err != nil || len(fs.Hashes) != n {
				b.Fatalf("flows: %d hashes, %v; want %d", len(fs.Hashes), err, n)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/(2*n), "ns/entry")
	})
}
