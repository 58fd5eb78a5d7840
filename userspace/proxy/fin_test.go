package proxy

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// sendWithFIN writes b and half-closes c so that the bytes and the FIN leave in
// one segment (MSG_MORE holds the bytes until the shutdown).
func sendWithFIN(c *net.TCPConn, b []byte) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := raw.Write(func(fd uintptr) bool {
		_, serr = unix.SendmsgN(int(fd), b, nil, nil, unix.MSG_MORE)
		return serr != unix.EAGAIN
	}); err != nil {
		return err
	}
	if serr != nil {
		return serr
	}
	return c.CloseWrite()
}

// segmentsIn is how many TCP segments c has received (tcpi_segs_in), the
// handshake's included.
func segmentsIn(t *testing.T, c *net.TCPConn) uint32 {
	t.Helper()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var info *unix.TCPInfo
	var ierr error
	raw.Control(func(fd uintptr) { info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) })
	if ierr != nil {
		t.Fatal(ierr)
	}
	return info.Segs_in
}

// TestLastBytesCarryTheFIN: when the backend's last bytes and its FIN reach the
// proxy together, the client gets them in one segment too, as it would from the
// backend directly: the segment is the handshake's SYN-ACK and one more. When the
// backend closes only after the client has its bytes, the FIN is a segment of its
// own (the control: it shows the count sees the difference).
func TestLastBytesCarryTheFIN(t *testing.T) {
	msg := []byte("the whole answer\n")
	for _, tc := range []struct {
		name     string
		together bool
		want     uint32
	}{
		{"bytes and FIN together", true, 2},
		{"FIN after the client has the bytes", false, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := make(chan struct{})
			b := startBackend(t, "b", netip.AddrPort{}, func(_ string, c *net.TCPConn) {
				if tc.together {
					if err := sendWithFIN(c, msg); err != nil {
						t.Errorf("backend: %v", err)
					}
					return
				}
				c.Write(msg)
				select {
				case <-got:
				case <-time.After(5 * time.Second):
				}
				c.CloseWrite()
			})
			s := startProxy(t, Config{Backends: []Backend{{Addr: b.addr()}}})
			c := dial(t, s)
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			buf := make([]byte, len(msg))
			if _, err := io.ReadFull(c, buf); err != nil || string(buf) != string(msg) {
				t.Fatalf("answer: %q, %v; want %q", buf, err, msg)
			}
			close(got)
			if rest, err := io.ReadAll(c); err != nil || len(rest) != 0 {
				t.Fatalf("after the answer: %q, %v; want EOF", rest, err)
			}
			if testRedirector != nil {
				return // the kernel moves the bytes: its segments are not the proxy's doing
			}
			if n := segmentsIn(t, c); n != tc.want {
				t.Errorf("the client received %d segments; want %d (SYN-ACK, then the answer %s)", n, tc.want,
					map[bool]string{true: "with the FIN", false: "and the FIN"}[tc.together])
			}
		})
	}
}
