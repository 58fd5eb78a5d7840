package pktgen

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/packet"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// testPrefix names this package's namespaces.
const testPrefix = "wpg"

func TestMain(m *testing.M) {
	// Namespaces a crashed earlier run of this package left behind.
	topo.CleanupStale(testPrefix)
	os.Exit(m.Run())
}

var (
	genMAC  = net.HardwareAddr{0x02, 0x78, 0, 0, 9, 1}
	sinkMAC = net.HardwareAddr{0x02, 0x78, 0, 0, 9, 2}
	sink4   = netip.MustParseAddr("10.78.9.2")
	sink6   = netip.MustParseAddr("fd78:9::2")
)

// pair is two namespaces joined by one veth: gen (link "g0") and sink
// (link "s0", holding sink4 and sink6).
type pair struct {
	gen, sink *netns.NS
	genIndex  int
}

func newPair(t *testing.T) *pair {
	t.Helper()
	name := topo.UniqueName(testPrefix)
	p := &pair{}
	var err error
	p.gen, err = netns.New(name + "-gen")
	xdptest.Check(t, err)
	t.Cleanup(func() { p.gen.Close() })
	p.sink, err = netns.New(name + "-sink")
	xdptest.Check(t, err)
	t.Cleanup(func() { p.sink.Close() })

	err = p.gen.Do(func() error {
		// IPv6 off before the link exists, so g0 sends nothing of its own
		// (router solicitations, MLD) for the sink to count.
		for _, k := range []string{"all", "default"} {
			if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+k+"/disable_ipv6", []byte("1"), 0o644); err != nil {
				return err
			}
		}
		fd, err := unix.Open(p.sink.Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		veth := &netlink.Veth{
			LinkAttrs:        netlink.LinkAttrs{Name: "g0", HardwareAddr: genMAC},
			PeerName:         "s0",
			PeerHardwareAddr: sinkMAC,
			PeerNamespace:    netlink.NsFd(fd),
		}
		if err := netlink.LinkAdd(veth); err != nil {
			return err
		}
		l, err := netlink.LinkByName("g0")
		if err != nil {
			return err
		}
		p.genIndex = l.Attrs().Index
		return netlink.LinkSetUp(l)
	})
	xdptest.Check(t, err)
	err = p.sink.Do(func() error {
		for _, kv := range [][2]string{
			{"net/ipv4/conf/all/rp_filter", "0"},
			{"net/ipv4/conf/default/rp_filter", "0"},
			{"net/ipv6/conf/all/accept_dad", "0"},
			{"net/ipv6/conf/default/accept_dad", "0"},
		} {
			if err := os.WriteFile("/proc/sys/"+kv[0], []byte(kv[1]), 0o644); err != nil {
				return err
			}
		}
		l, err := netlink.LinkByName("s0")
		if err != nil {
			return err
		}
		for _, a := range []string{sink4.String() + "/24", sink6.String() + "/64"} {
			addr, _ := netlink.ParseAddr(a)
			addr.Flags = unix.IFA_F_NODAD
			if err := netlink.AddrAdd(l, addr); err != nil {
				return err
			}
		}
		return netlink.LinkSetUp(l)
	})
	xdptest.Check(t, err)
	return p
}

func newSink(t *testing.T, pass bool, ns *netns.NS, ifname string) *Sink {
	t.Helper()
	s, err := NewSink(pass)
	xdptest.Check(t, err)
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	})
	xdptest.Check(t, s.Attach(ns, ifname))
	return s
}

func newGenerator(t *testing.T, cfg Config) *Generator {
	t.Helper()
	g, err := New(cfg)
	xdptest.Check(t, err)
	t.Cleanup(func() { g.Close() })
	return g
}

// waitCount polls the sink until it has counted want frames or a second
// has passed, and returns the last count.
func waitCount(t *testing.T, s *Sink, want uint64) Counter {
	t.Helper()
	deadline := time.Now().Add(time.Second)
	for {
		c, err := s.Count()
		if err != nil {
			t.Fatal(err)
		}
		if c.Packets >= want || time.Now().After(deadline) {
			return c
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSendCounts sends a fixed number of frames of each kind through a real
// veth into a native-mode sink: what the generator says it sent, the sink
// counts, frame for frame and byte for byte.
func TestSendCounts(t *testing.T) {
	for _, tc := range []struct {
		name string
		mix  []Packet
	}{
		{"v4 tcp ack", []Packet{{}}},
		{"v6 tcp syn", []Packet{{IPv6: true, SYN: true}}},
		{"mix v4 udp 128B + v6 tcp", []Packet{{UDP: true, Size: 128, Weight: 3}, {IPv6: true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t)
			sink := newSink(t, false, p.sink, "s0")
			g := newGenerator(t, Config{
				SrcMAC: genMAC, DstMAC: sinkMAC,
				Dst4: netip.AddrPortFrom(sink4, 80), Dst6: netip.AddrPortFrom(sink6, 80),
				Flows: 1000, Mix: tc.mix,
			})
			const n = 20_000
			if err := g.Send(p.gen, p.genIndex, n); err != nil {
				t.Fatal(err)
			}
			sent, err := g.Sent()
			if err != nil {
				t.Fatal(err)
			}
			var wantBytes uint64
			sched := schedule(g.Config().Mix)
			for i := range n {
				wantBytes += uint64(g.Config().Mix[sched[i%scheduleLen]].FrameSize() - fcs)
			}
			if sent.Packets != n || sent.Bytes != wantBytes {
				t.Errorf("generator sent %d frames, %d bytes; want %d, %d", sent.Packets, sent.Bytes, n, wantBytes)
			}
			got := waitCount(t, sink, n)
			if got != sent {
				t.Errorf("sink counted %d frames, %d bytes; want %d, %d", got.Packets, got.Bytes, sent.Packets, sent.Bytes)
			}
		})
	}
}

// TestSendInterrupted: a signal that ends Send's call midway (here SIGURG,
// the Go runtime's own preemption signal, to every thread of the process over
// and over) does not change how many frames it sends: the rest go in another
// call, so the sink counts exactly n.
func TestSendInterrupted(t *testing.T) {
	p := newPair(t)
	sink := newSink(t, false, p.sink, "s0")
	g := newGenerator(t, Config{SrcMAC: genMAC, DstMAC: sinkMAC,
		Dst4: netip.AddrPortFrom(sink4, 80), Dst6: netip.AddrPortFrom(sink6, 80), Flows: 1000})
	const n = 300_000
	stop := make(chan struct{})
	var signalled atomic.Int64
	done := make(chan struct{})
	// Signals every thread, then waits for frames to be sent before it
	// signals again: a call's setup takes milliseconds, and signals faster
	// than that would end every call before its first frame. Exits when stop
	// is closed.
	go func() {
		defer close(done)
		var last uint64
		for {
			tasks, _ := os.ReadDir("/proc/self/task")
			for _, task := range tasks {
				if tid, err := strconv.Atoi(task.Name()); err == nil && unix.Tgkill(unix.Getpid(), tid, unix.SIGURG) == nil {
					signalled.Add(1)
				}
			}
			for {
				select {
				case <-stop:
					return
				case <-time.After(time.Millisecond):
				}
				if c, err := g.Sent(); err == nil && c.Packets > last {
					last = c.Packets
					break
				}
			}
		}
	}()
	err := g.Send(p.gen, p.genIndex, n)
	close(stop)
	<-done
	if err != nil {
		t.Fatal(err)
	}
	sent, err := g.Sent()
	if err != nil {
		t.Fatal(err)
	}
	if sent.Packets != n {
		t.Errorf("generator sent %d frames; want %d", sent.Packets, n)
	}
	if got := waitCount(t, sink, n); got.Packets != n {
		t.Errorf("sink counted %d frames; want %d", got.Packets, n)
	}
	t.Logf("%d signals sent while it ran", signalled.Load())
}

// TestFramesReachSockets passes the generator's UDP frames to the kernel
// stack, which drops any with a bad IP or UDP checksum: every frame must
// reach the sockets, from every flow's source address.
func TestFramesReachSockets(t *testing.T) {
	p := newPair(t)
	sink := newSink(t, true, p.sink, "s0")
	const flows, port = 50, 9999
	g := newGenerator(t, Config{
		SrcMAC: genMAC, DstMAC: sinkMAC,
		Dst4: netip.AddrPortFrom(sink4, port), Dst6: netip.AddrPortFrom(sink6, port),
		Flows: flows, Mix: []Packet{{UDP: true}, {UDP: true, IPv6: true, Size: 200}},
	})
	var conns []net.PacketConn
	for _, a := range []netip.Addr{sink4, sink6} {
		c, err := p.sink.ListenPacket("udp", netip.AddrPortFrom(a, port).String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		// Room for every frame: a datagram built from an XDP frame holds a
		// whole page of receive buffer.
		raw, _ := c.(*net.UDPConn).SyscallConn()
		raw.Control(func(fd uintptr) {
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20)
		})
		conns = append(conns, c)
	}
	const n = 400 // 200 of each family, 4 per flow
	if err := g.Send(p.gen, p.genIndex, n); err != nil {
		t.Fatal(err)
	}
	if c := waitCount(t, sink, n); c.Packets != n {
		t.Fatalf("sink counted %d frames; want %d", c.Packets, n)
	}

	// The frames are what the kernel accepts if no UDP checksum error is counted
	// and every flow's datagrams reach the sockets. UDP may still drop a datagram
	// under memory pressure on a loaded machine, so delivery is held to 90 %, and
	// each flow to at least one.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	for i, c := range conns {
		sources := map[netip.Addr]int{}
		buf := make([]byte, 2048)
		wantLen := g.Config().Mix[i].FrameSize() - fcs - 14 - 8 - 20
		if i == 1 {
			wantLen -= 20
		}
		for range n / 2 {
			deadline, _ := ctx.Deadline()
			c.SetReadDeadline(deadline)
			m, from, err := c.ReadFrom(buf)
			if err != nil {
				break
			}
			if m != wantLen {
				t.Errorf("datagram of %d bytes; want %d", m, wantLen)
			}
			sources[from.(*net.UDPAddr).AddrPort().Addr().Unmap()]++
		}
		if got := sum(sources); got < n/2*9/10 {
			t.Errorf("%s: got %d datagrams; want at least %d of %d", c.LocalAddr(), got, n/2*9/10, n/2)
		}
		base := Src4
		if i == 1 {
			base = Src6
		}
		for f := range flows {
			if src := flowAddr(base, f); sources[src] == 0 {
				t.Errorf("%s: no datagram from %s; want its %d", c.LocalAddr(), src, n/2/flows)
			}
		}
	}
	for _, counter := range []string{"Udp: InCsumErrors", "Udp6InCsumErrors"} {
		if v := snmpCounter(t, p.sink, counter); v != 0 {
			t.Errorf("sink namespace counted %d %s; want 0: the frames' checksums are wrong", v, counter)
		}
	}
}

// snmpCounter reads one counter of /proc/net/snmp ("Udp: InCsumErrors") or
// /proc/net/snmp6 ("Udp6InCsumErrors") in ns.
func snmpCounter(t *testing.T, ns *netns.NS, name string) int64 {
	t.Helper()
	var v int64 = -1
	err := ns.Do(func() error {
		file, field := "/proc/thread-self/net/snmp6", name
		if i := strings.Index(name, ": "); i >= 0 {
			file, field = "/proc/thread-self/net/snmp", name[i+2:]
		}
		b, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		lines := strings.Split(string(b), "\n")
		for i, line := range lines {
			f := strings.Fields(line)
			if len(f) == 2 && f[0] == field {
				v, err = strconv.ParseInt(f[1], 10, 64)
				return err
			}
			// snmp pairs a header line of names with a line of values.
			if prefix := strings.SplitN(name, ": ", 2)[0] + ":"; len(f) > 1 && f[0] == prefix && i+1 < len(lines) {
				vals := strings.Fields(lines[i+1])
				for j, n := range f {
					if n == field && j < len(vals) {
						v, err = strconv.ParseInt(vals[j], 10, 64)
						return err
					}
				}
			}
		}
		return fmt.Errorf("%s: no counter %s", file, name)
	})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func sum(m map[netip.Addr]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestRunStops runs flat out until the context ends and checks that Run
// returns promptly (the signal ends the kernel's loop) and frames arrived.
func TestRunStops(t *testing.T) {
	p := newPair(t)
	sink := newSink(t, false, p.sink, "s0")
	g := newGenerator(t, Config{
		SrcMAC: genMAC, DstMAC: sinkMAC,
		Dst4: netip.AddrPortFrom(sink4, 80), Flows: 4096,
	})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := g.Run(ctx, p.gen, p.genIndex, []int{0}); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Run took %v after a 300ms context; want it to stop within a second or so", d)
	}
	sent, err := g.Sent()
	if err != nil {
		t.Fatal(err)
	}
	got := waitCount(t, sink, sent.Packets)
	if sent.Packets == 0 || got.Packets == 0 {
		t.Fatalf("sent %d, sink counted %d; want both > 0", sent.Packets, got.Packets)
	}
	t.Logf("sent %d frames in %v (%.2f Mpps), sink counted %d", sent.Packets, time.Since(start), float64(sent.Packets)/time.Since(start).Seconds()/1e6, got.Packets)
}

// TestFrames runs the generator through BPF_PROG_RUN without live frames and
// compares each output frame byte for byte with Config.Frame: template,
// flow order, source addresses, checksums, lengths.
func TestFrames(t *testing.T) {
	cfg := Config{
		SrcMAC: genMAC, DstMAC: sinkMAC,
		Dst4: netip.AddrPortFrom(sink4, 80), Dst6: netip.AddrPortFrom(sink6, 443),
		Flows: MaxFlows,
		Mix: []Packet{
			{}, {SYN: true, Size: 70}, {UDP: true, Size: 100}, {IPv6: true},
			{IPv6: true, UDP: true, Size: 81}, {IPv6: true, SYN: true, Size: 300},
			{SYN: true, Dst: netip.AddrPortFrom(sink4.Next(), 9000)},
			{SYN: true, SrcPort: 40007},
		},
	}
	// A kind's own Dst replaces Dst4 in its frames (IPv4 destination at
	// 30..33, TCP destination port at 36..37).
	if f := cfg.Frame(cfg.Mix[6], 0); netip.AddrFrom4([4]byte(f[30:34])) != sink4.Next() || f[36] != 9000>>8 || f[37] != 9000&0xff {
		t.Fatalf("frame of a kind with Dst %s: destination %x; want that address and port", cfg.Mix[6].Dst, f[30:38])
	}
	// A kind's own SrcPort replaces SrcPort (TCP source port at 34..35).
	if f := cfg.Frame(cfg.Mix[7], 0); f[34] != 40007>>8 || f[35] != 40007&0xff {
		t.Fatalf("frame of a kind with SrcPort %d: source port %x; want %x", cfg.Mix[7].SrcPort, f[34:36], []byte{40007 >> 8, 40007 & 0xff})
	}
	g := newGenerator(t, cfg)
	cfg = g.Config()
	// The flow cursor is per CPU: stay on one.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	restore, err := pin(0)
	if err != nil {
		t.Fatal(err)
	}
	defer restore()

	sched := schedule(cfg.Mix)
	var zero GeneratorGenState
	for _, start := range []uint32{0, 1, 65535, 65536, 65537, MaxFlows - 3} {
		// Start at flow start, frame count 0 (schedule slot 0).
		st := make([]GeneratorGenState, ebpfPossibleCPUs(t))
		for i := range st {
			st[i] = zero
			for k := range st[i].Flow {
				st[i].Flow[k] = start
			}
		}
		var next [MaxTemplates]int // flow of each kind's next frame
		if err := g.objs.State.Put(uint32(0), st); err != nil {
			t.Fatal(err)
		}
		for n := range 2 * len(cfg.Mix) {
			k := sched[n%scheduleLen]
			f := (int(start) + next[k]) % MaxFlows
			next[k]++
			p := cfg.Mix[k]
			want := cfg.Frame(p, f)
			ret, out, err := g.objs.Generate.Test(g.input)
			if err != nil {
				t.Fatal(err)
			}
			if ret != 3 { // XDP_TX
				t.Fatalf("frame %d: verdict %d; want XDP_TX (3)", n, ret)
			}
			if !bytes.Equal(out, want) {
				t.Errorf("frame %d (%s, flow %d):\n got %x\nwant %x", n, p, f, out, want)
			}
		}
	}
}

func ebpfPossibleCPUs(t *testing.T) int {
	n, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestProbeSink checks that a probe sink passes IPv4 TCP frames from or to
// its port uncounted and counts and drops everything else.
func TestProbeSink(t *testing.T) {
	s, err := NewProbeSink(8080)
	xdptest.Check(t, err)
	defer s.Close()
	mac := net.HardwareAddr{2, 0, 0, 0, 0, 1}
	frame := func(proto uint8, src, dst uint16, v6 bool) []byte {
		a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
		if v6 {
			a, b = netip.MustParseAddr("fd00::1"), netip.MustParseAddr("fd00::2")
		}
		return packet.Frame{SrcMAC: mac, DstMAC: mac, Src: netip.AddrPortFrom(a, src), Dst: netip.AddrPortFrom(b, dst), Proto: proto, TCPFlags: packet.ACK}.Build()
	}
	for _, tc := range []struct {
		name  string
		frame []byte
		want  uint32
	}{
		{"tcp to the port", frame(packet.ProtoTCP, 40000, 8080, false), 2},     // XDP_PASS
		{"tcp from the port", frame(packet.ProtoTCP, 8080, 40000, false), 2},   // XDP_PASS
		{"tcp to another port", frame(packet.ProtoTCP, 40000, 80, false), 1},   // XDP_DROP
		{"udp to the port", frame(packet.ProtoUDP, 40000, 8080, false), 1},     // XDP_DROP
		{"ipv6 tcp to the port", frame(packet.ProtoTCP, 40000, 8080, true), 1}, // XDP_DROP
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, err := s.Count()
			if err != nil {
				t.Fatal(err)
			}
			got, err := s.objs.Sink.Run(&ebpf.RunOptions{Data: tc.frame})
			xdptest.Check(t, err)
			if got != tc.want {
				t.Errorf("verdict: got %d; want %d", got, tc.want)
			}
			after, err := s.Count()
			if err != nil {
				t.Fatal(err)
			}
			wantCount := uint64(0) // passed frames are not counted
			if tc.want == 1 {
				wantCount = 1
			}
			if counted := after.Sub(before).Packets; counted != wantCount {
				t.Errorf("counted %d frames; want %d", counted, wantCount)
			}
		})
	}
}
