package proxy

import (
	"bytes"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// netnsEnv set to a test's name marks the child process inOwnNetns starts for it,
// which runs in a network namespace of its own.
const netnsEnv = "WEIR_PROXY_TEST_NETNS"

// inOwnNetns runs the calling test again in a child process in a network
// namespace of its own (loopback up, and the sysctls given, which are the
// namespace's own), on this process's path (copy, or sockmap in the child of
// TestEveryTestOnSockmap), and reports false: the caller returns, the child's
// result being the test's. In the child it reports true: the caller goes on
// with the test.
func inOwnNetns(t *testing.T, sysctls map[string]string) bool {
	t.Helper()
	if os.Getenv(netnsEnv) == t.Name() {
		if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
			t.Fatalf("ip link set lo up: %v: %s", err, out)
		}
		for k, v := range sysctls {
			if err := os.WriteFile("/proc/sys/"+strings.ReplaceAll(k, ".", "/"), []byte(v), 0); err != nil {
				t.Fatal(err)
			}
		}
		return true
	}
	cmd := exec.Command(os.Args[0], "-test.count=1", "-test.v", "-test.run=^"+t.Name()+"$")
	cmd.Env = append(os.Environ(), netnsEnv+"="+t.Name())
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil || !strings.Contains(out.String(), "--- PASS: "+t.Name()) {
		t.Fatalf("in a network namespace of its own: %v\n%s", err, out.String())
	}
	if testing.Verbose() {
		t.Logf("child:\n%s", out.String())
	}
	return false
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
