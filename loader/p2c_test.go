package loader

import (
	"bytes"
	"net"
	"net/netip"
	"testing"

	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/userspace/balance"
)

// p2cCandidates predicts a flow's two maglev_p2c candidates from the Go hash and
// table builder: its slot in the table of testSeed and in that of P2CSeed(testSeed).
func p2cCandidates(t *testing.T, s Service, f Flow) (first, second Backend) {
	t.Helper()
	k := flowKey(f)
	h := flowHash(&k, testSeed, s.SourceHash)
	var picks [2]Backend
	for i, seed := range []uint64{testSeed, balance.P2CSeed(testSeed)} {
		table := testTable(t, s, seed)
		picks[i] = s.Backends[table[h%uint32(len(table))]]
	}
	return picks[0], picks[1]
}

// p2cFlow finds a client port whose flow's candidates are backends first and second
// (by index; -1: any two different ones), starting the search at from.
func p2cFlow(t *testing.T, s Service, from uint16, first, second int) (uint16, Backend, Backend) {
	t.Helper()
	for sport := from; sport < from+5000; sport++ {
		a, b := p2cCandidates(t, s, Flow{Src: netip.AddrPortFrom(client4, sport), Dst: s.Key.VIP, Protocol: TCP})
		if a.Addr == b.Addr {
			continue
		}
		if first < 0 || a.Addr == s.Backends[first].Addr && b.Addr == s.Backends[second].Addr {
			return sport, a, b
		}
	}
	t.Fatalf("no client port from %d has candidates %d and %d", from, first, second)
	return 0, Backend{}, Backend{}
}

// setLoad sets backend_load of the backends at addrs.
func (p *Program) setLoad(t *testing.T, key ServiceKey, load map[netip.AddrPort]int64) {
	t.Helper()
	for addr, v := range load {
		if err := p.objs.BackendLoad.Put(p.services[key].slots[addr], v); err != nil {
			t.Fatal(err)
		}
	}
}

func (p *Program) load(t *testing.T, key ServiceKey, addr netip.AddrPort) int64 {
	t.Helper()
	var v int64
	if err := p.objs.BackendLoad.Lookup(p.services[key].slots[addr], &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestP2CFixtures holds maglev_p2c's choice to its rule, frame by frame: a SYN takes
// its second candidate only when the first has more than an eighth more active flows
// per weight; ties, loads within the margin, unknown loads and packets that are not
// SYNs take the first.
func TestP2CFixtures(t *testing.T) {
	p := loadT(t)
	equal := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, P2C: true, Backends: testBackends(3, false, 80)}
	weighted := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 81), TCP}, P2C: true, Backends: testBackends(3, false, 81)}
	weighted.Backends[0].Weight = 2
	for _, s := range []Service{equal, weighted} {
		if err := p.AddService(s); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name                  string
		svc                   Service
		firstIdx, secondIdx   int // candidates by backend index; -1: any two
		flags                 uint8
		firstLoad, secondLoad int64
		wantSecond            bool
	}{
		{"syn, loads equal", equal, -1, -1, packet.SYN, 0, 0, false},
		{"syn, first busier", equal, -1, -1, packet.SYN, 10, 0, true},
		{"syn, first busier within an eighth", equal, -1, -1, packet.SYN, 9, 8, false},
		{"syn, first busier past an eighth", equal, -1, -1, packet.SYN, 10, 8, true},
		{"syn, second busier", equal, -1, -1, packet.SYN, 0, 5, false},
		{"syn, first's load unknown", equal, -1, -1, packet.SYN, -1, 0, false},
		{"syn, second's load unknown", equal, -1, -1, packet.SYN, 10, -3, false},
		{"ack missing the connection table, first busier", equal, -1, -1, packet.ACK, 10, 0, false},
		{"rst missing the connection table, first busier", equal, -1, -1, packet.RST, 10, 0, false},
		// Backend 0 weighs 2: 10 flows on it are 5 per weight, less than 6 on a backend of weight 1.
		{"syn, heavier first holds more flows but less per weight", weighted, 0, 1, packet.SYN, 10, 6, false},
		{"syn, heavier first past an eighth per weight", weighted, 0, 1, packet.SYN, 14, 6, true},
		{"syn, lighter first against a heavier second", weighted, 1, 0, packet.SYN, 6, 10, true},
	}
	sport := uint16(20000)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var first, second Backend
			sport, first, second = p2cFlow(t, tt.svc, sport+1, tt.firstIdx, tt.secondIdx)
			p.setLoad(t, tt.svc.Key, map[netip.AddrPort]int64{first.Addr: tt.firstLoad, second.Addr: tt.secondLoad})
			in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(client4, sport),
				Dst: tt.svc.Key.VIP, TCPFlags: tt.flags}.Build()
			want := first
			if tt.wantSecond {
				want = second
			}
			before, err := p.Stats()
			if err != nil {
				t.Fatal(err)
			}
			action, out, err := p.Run(in)
			if err != nil {
				t.Fatal(err)
			}
			if action != XDPTX {
				t.Fatalf("action %s; want XDP_TX", action)
			}
			if wantOut := dsrOut(in, want.MAC); !bytes.Equal(out, wantOut) {
				t.Errorf("output frame\n got %x\nwant %x (to %s)", out, wantOut, want.Addr)
			}
			after, err := p.Stats()
			if err != nil {
				t.Fatal(err)
			}
			wantCount := uint64(0)
			if tt.wantSecond {
				wantCount = 1
			}
			if got := after.Reasons[ReasonFlowSecondChoice].Packets - before.Reasons[ReasonFlowSecondChoice].Packets; got != wantCount {
				t.Errorf("flow_second_choice went up by %d; want %d", got, wantCount)
			}
			ex, err := p.Explain(tt.svc.Key, netip.AddrPortFrom(client4, sport))
			if err != nil {
				t.Fatal(err)
			}
			if c := ex.P2C; c == nil || c.First != first.Addr || c.Second != second.Addr || c.FirstLoad != tt.firstLoad ||
				c.SecondLoad != tt.secondLoad {
				t.Errorf("explain: candidates %+v; want %s (%d) and %s (%d)", c, first.Addr, tt.firstLoad, second.Addr, tt.secondLoad)
			} else if tt.flags == packet.SYN && (ex.New != want.Addr || c.SecondWins != tt.wantSecond) {
				t.Errorf("explain: new %s, second wins %v; want %s, %v", ex.New, c.SecondWins, want.Addr, tt.wantSecond)
			}
		})
	}
}

// TestP2CCountsFlows follows one dsr flow's life in backend_load: counted when its
// client's second packet establishes it, uncounted once at its first FIN (not again
// at the RST after it), and a SYN sent again keeps the backend the first SYN got,
// whatever the loads say by then.
func TestP2CCountsFlows(t *testing.T) {
	p := loadT(t)
	s := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, P2C: true, Backends: testBackends(3, false, 80)}
	// A backend slot keeps its load across services: a new backend starts from 0.
	if err := p.setLoads([]int64{7, 7, 7, 7, 7, 7, 7, 7}); err != nil {
		t.Fatal(err)
	}
	if err := p.AddService(s); err != nil {
		t.Fatal(err)
	}
	for _, b := range s.Backends {
		if got := p.load(t, s.Key, b.Addr); got != 0 {
			t.Fatalf("new backend %s: load %d; want 0", b.Addr, got)
		}
	}
	sport, first, second := p2cFlow(t, s, 30000, -1, -1)
	send := func(flags uint8) net.HardwareAddr {
		t.Helper()
		in := packet.Frame{SrcMAC: clientMAC, DstMAC: lbMAC, Src: netip.AddrPortFrom(client4, sport), Dst: s.Key.VIP, TCPFlags: flags}.Build()
		action, out, err := p.Run(in)
		if err != nil || action != XDPTX {
			t.Fatalf("flags %#x: action %s, err %v; want XDP_TX", flags, action, err)
		}
		return net.HardwareAddr(out[0:6])
	}
	loads := func() [2]int64 { return [2]int64{p.load(t, s.Key, first.Addr), p.load(t, s.Key, second.Addr)} }
	steps := []struct {
		name      string
		flags     uint8
		setFirst  int64 // load of the first candidate before the step; -2 leaves it
		wantTo    Backend
		wantLoads [2]int64
	}{
		{"syn: second candidate, half-open, not counted", packet.SYN, 4, second, [2]int64{4, 0}},
		{"syn again with the loads reversed: same backend", packet.SYN, 0, second, [2]int64{0, 0}},
		{"ack establishes: counted", packet.ACK, -2, second, [2]int64{0, 1}},
		{"data", packet.ACK | packet.PSH, -2, second, [2]int64{0, 1}},
		{"fin: uncounted", packet.FIN | packet.ACK, -2, second, [2]int64{0, 0}},
		{"fin again: once only", packet.FIN | packet.ACK, -2, second, [2]int64{0, 0}},
		{"rst after the fin", packet.RST, -2, second, [2]int64{0, 0}},
	}
	for _, st := range steps {
		if st.setFirst != -2 {
			p.setLoad(t, s.Key, map[netip.AddrPort]int64{first.Addr: st.setFirst})
		}
		if got := send(st.flags).String(); got != st.wantTo.MAC.String() {
			t.Fatalf("%s: sent to %s; want %s (%s)", st.name, got, st.wantTo.MAC, st.wantTo.Addr)
		}
		if got := loads(); got != st.wantLoads {
			t.Fatalf("%s: loads (first, second) %v; want %v", st.name, got, st.wantLoads)
		}
	}

	// An established flow whose backend goes down is uncounted there when it is
	// re-selected.
	sport, first, _ = p2cFlow(t, s, sport+1, -1, -1)
	send(packet.SYN)
	send(packet.ACK)
	if got := p.load(t, s.Key, first.Addr); got != 1 {
		t.Fatalf("established on %s: load %d; want 1", first.Addr, got)
	}
	if err := p.SetBackendUsable(s.Key, first.Addr, false); err != nil {
		t.Fatal(err)
	}
	send(packet.ACK)
	if got := p.load(t, s.Key, first.Addr); got != 0 {
		t.Errorf("after its flow was re-selected, %s: load %d; want 0", first.Addr, got)
	}
}

// BenchmarkUpdateService measures one table change of a 1,000-backend service as the
// agent makes it (one backend's weight): build the table(s), write them into new
// inner maps, swap. The build alone is userspace/balance's BenchmarkBuildMaglev;
// the rest is the kernel's batch update, about 250 ns an entry.
func BenchmarkUpdateService(b *testing.B) {
	for _, p2c := range []bool{false, true} {
		b.Run(map[bool]string{false: "maglev/n=1000", true: "maglev_p2c/n=1000"}[p2c], func(b *testing.B) {
			p := loadT(b)
			s := Service{Key: ServiceKey{netip.AddrPortFrom(vip4, 80), TCP}, P2C: p2c}
			for i := range 1000 {
				s.Backends = append(s.Backends, Backend{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 78, byte(i >> 8), byte(i)}), 80),
					MAC: backendMAC(i), Weight: 1, Usable: true})
			}
			if err := p.AddService(s); err != nil {
				b.Fatal(err)
			}
			for i := 0; b.Loop(); i++ {
				s.Backends[0].Weight = uint32(1 + i%2)
				if err := p.UpdateService(s); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/op")
		})
	}
}
