package agent

import (
	"net"
	"net/netip"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/userspace/config"
)

// TestListenersArePlainTCP: the admin API's and the metrics' TCP listeners are
// plain TCP, as the data planes' are, not the Multipath TCP that Go's
// net.Listen makes where the kernel has it.
func TestListenersArePlainTCP(t *testing.T) {
	cfg := &config.Config{
		Admin: config.Admin{
			Socket: filepath.Join(t.TempDir(), "weir.sock"),
			Listen: netip.MustParseAddrPort("127.0.0.1:0"),
		},
		Metrics: config.Metrics{Listen: netip.MustParseAddrPort("127.0.0.1:0")},
	}
	ls, err := listen(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ls.close)
	tcp := map[string]net.Listener{"admin.listen": ls.admin[len(ls.admin)-1], "metrics.listen": ls.metrics}
	for field, l := range tcp {
		rc, err := l.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var proto int
		var perr error
		if err := rc.Control(func(fd uintptr) { proto, perr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PROTOCOL) }); err != nil {
			t.Fatal(err)
		}
		if perr != nil {
			t.Fatalf("%s: getsockopt SO_PROTOCOL: %v", field, perr)
		}
		if proto != unix.IPPROTO_TCP {
			t.Errorf("%s: the listener's protocol: got %d; want %d (IPPROTO_TCP)", field, proto, unix.IPPROTO_TCP)
		}
	}
}
