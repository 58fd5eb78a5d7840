package proxy

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/ownnetns"
	"github.com/weir-lb/weir/internal/waitfor"
)

// inOwnNetns runs the calling test in a network namespace of its own
// (ownnetns.In), on this process's path (copy, or sockmap in the child of
// TestEveryTestOnSockmap, whose environment the child inherits).
func inOwnNetns(t *testing.T, sysctls map[string]string) bool {
	t.Helper()
	return ownnetns.In(t, sysctls)
}

// TestSelfConnectIsRefused: a dial of a backend on this host whose port nothing
// listens on, and which lies in the kernel's range of local ports, can be
// connected to itself (TCP's simultaneous open, when the kernel picks that very
// port as the dial's source): it is a failed dial, like the refusal it stands
// for. The proxy took it for a connection, counted a success for the dead
// backend, and served the client with its own bytes echoed back.
//
// The kernel does that now and then; to make it happen every time the test runs
// in a network namespace of its own whose local port range is one port, the
// backend's.
func TestSelfConnectIsRefused(t *testing.T) {
	// One local port, the backend's (nothing listens there).
	if !inOwnNetns(t, map[string]string{"net.ipv4.ip_local_port_range": "40000 40000"}) {
		return
	}
	dead := netip.MustParseAddrPort("127.0.0.1:40000")
	rec := &recorder{}
	s := startProxy(t, Config{Listen: netip.MustParseAddrPort("127.0.0.1:40001"), Backends: []Backend{{Addr: dead}},
		AcceptLoops: 1, Observer: rec})
	c := dial(t, s) // from port 40000, the only one
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write([]byte("hello"))
	if got, err := c.Read(make([]byte, 5)); err == nil {
		t.Errorf("the client read %d bytes; want its connection closed, the only backend being down", got)
	}
	waitfor.Value(t, 5*time.Second, "0 active connections", active(s, 0))
	b := s.Snapshot().Backends[0]
	if b.Connects != 0 || b.ConnectFailures != 1 {
		t.Errorf("backend: %d connects, %d connect failures; want 0 and 1", b.Connects, b.ConnectFailures)
	}
	if got, want := rec.list(), []string{dead.String() + " connect_failed"}; !slices.Equal(got, want) {
		t.Errorf("outcomes: got %q; want %q", got, want)
	}
}
