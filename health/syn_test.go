package health

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"
)

func TestBuildSYN(t *testing.T) {
	for _, tt := range []struct{ src, dst string }{
		{"10.0.0.1", "10.0.0.2"},
		{"fd00::1", "fd00::2"},
	} {
		src, dst := netip.MustParseAddr(tt.src), netip.MustParseAddr(tt.dst)
		seg := buildSYN(make([]byte, synLen), src, dst, 61000, 80, 0x01020304)
		got, ok := parseTCP(seg, src)
		if !ok || got.sport != 61000 || got.dport != 80 || got.seq != 0x01020304 || got.flags != tcpSYN {
			t.Errorf("%s: parsed back: got %+v; want 61000 -> 80, seq 0x01020304, SYN", tt.dst, got)
		}
		// A segment with its checksum in place sums to zero.
		if sum := tcpChecksum(src, dst, seg); sum != 0 {
			t.Errorf("%s: checksum over the segment: got %#04x; want 0", tt.dst, sum)
		}
		if off := seg[12] >> 4 * 4; off != synLen || binary.BigEndian.Uint16(seg[22:]) != 1220 {
			t.Errorf("%s: data offset %d, MSS %d; want %d, 1220", tt.dst, off, binary.BigEndian.Uint16(seg[22:]), synLen)
		}
	}
}

func TestReservedPorts(t *testing.T) {
	tests := []struct {
		cur, want string
		changed   bool
	}{
		{"", "61000-64999", true},
		{"8080", "8080,61000-64999", true},
		{"61000-64999", "61000-64999", false},
		{"60000-62000,62001-65535", "60000-62000,62001-65535", false},
		{"61000-62000", "61000-62000,61000-64999", true},
	}
	for _, tt := range tests {
		got, changed, err := reservedPorts(tt.cur, 61000, 64999)
		if err != nil || got != tt.want || changed != tt.changed {
			t.Errorf("reservedPorts(%q): got %q, %t, %v; want %q, %t, nil", tt.cur, got, changed, err, tt.want, tt.changed)
		}
	}
	if _, _, err := reservedPorts("80-x", 1, 2); err == nil {
		t.Error("reservedPorts(80-x): got no error; want one")
	}
}

// TestSynFallsBackToConnect: a Checker that cannot open its raw sockets (here:
// an invalid port range) checks syn services by connect and says why.
func TestSynFallsBackToConnect(t *testing.T) {
	ln := newToggleListener(t, net.Listen)
	checked := make(chan Result, 1)
	c := &Checker{SynPorts: [2]uint16{5, 1}, OnCheck: func(r Result) {
		select {
		case checked <- r:
		default:
		}
	}}
	if err := c.SetService("web", Config{Check: Check{Method: MethodSyn, Interval: 10 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: ln.addr, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	run(t, c)
	r := <-checked
	if r.Err != nil || r.Method != MethodConnect {
		t.Errorf("check: got %v by %v; want a pass by connect", r.Err, r.Method)
	}
	m, err := c.Method("web")
	if m != MethodConnect || err == nil {
		t.Errorf("Method: got %v, %v; want connect and the reason", m, err)
	}
	t.Logf("Method: %v, %v", m, err)
}

// TestBuildIPv4: an IPv4 SYN as the raw socket sends it parses back as the
// receive path reads one, with DF set and a nonzero id.
func TestBuildIPv4(t *testing.T) {
	src, dst := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	b := make([]byte, ipv4Len+synLen)
	buildIPv4(b, src.As4(), dst.As4(), 7)
	buildSYN(b[ipv4Len:], src, dst, 61000, 80, 42)
	got, ok := parseIPv4TCP(b)
	if !ok || got.src != src || got.sport != 61000 || got.dport != 80 || got.seq != 42 || got.flags != tcpSYN {
		t.Errorf("parsed back: got %+v, %t; want from %v, 61000 -> 80, seq 42, SYN", got, ok, src)
	}
	if id, frag, d := binary.BigEndian.Uint16(b[4:]), binary.BigEndian.Uint16(b[6:]), netip.AddrFrom4([4]byte(b[16:20])); id != 7 || frag != 0x4000 || d != dst || b[8] == 0 {
		t.Errorf("header: id %d, flags/offset %#x, dst %v, ttl %d; want 7, DF, %v, nonzero", id, frag, d, b[8], dst)
	}
}
