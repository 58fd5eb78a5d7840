package health

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/topo"
)

// netNS is a network namespace made for one test. A goroutine locked to an OS
// thread that entered the namespace creates its sockets; the sockets are then
// used from any goroutine (as cloudflare/tubular's test helpers do). This is
// deliberately tiny and private to health's tests.
type netNS struct {
	name string
	ops  chan func()
}

// newNetNS creates a namespace with lo up and removes it when the test ends.
func newNetNS(t *testing.T) *netNS {
	t.Helper()
	if os.Geteuid() != 0 {
		requirePrivilege(t, "needs root to create a network namespace")
	}
	n := &netNS{name: topo.UniqueName("whc"), ops: make(chan func())}
	made := make(chan error, 1)
	up := make(chan error, 1)
	// Exits when the cleanup below closes n.ops. The thread stays locked, so
	// the runtime discards it rather than reuse a thread in a foreign namespace.
	go func() {
		runtime.LockOSThread()
		h, err := netns.NewNamed(n.name)
		if err != nil {
			os.Remove("/var/run/netns/" + n.name) // NewNamed may leave it behind
			made <- err
			return
		}
		h.Close()
		made <- nil
		up <- setLinkUp("lo")
		for op := range n.ops {
			op()
		}
	}()
	if err := <-made; err != nil {
		requirePrivilege(t, fmt.Sprintf("cannot create network namespace %s: %v", n.name, err))
	}
	t.Cleanup(func() {
		close(n.ops)
		if err := netns.DeleteNamed(n.name); err != nil {
			t.Errorf("delete namespace %s: %v", n.name, err)
		}
	})
	if err := <-up; err != nil {
		t.Fatalf("namespace %s: %v", n.name, err)
	}
	return n
}

// do runs fn on the namespace's thread.
func (n *netNS) do(fn func() error) error {
	done := make(chan error, 1)
	n.ops <- func() { done <- fn() }
	return <-done
}

func setLinkUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get %s flags: %w", name, err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}

// listen opens a TCP listener inside the namespace that accepts and closes
// every connection until the test ends.
func (n *netNS) listen(t *testing.T, addr string) net.Listener {
	t.Helper()
	var ln net.Listener
	if err := n.do(func() (err error) { ln, err = net.Listen("tcp", addr); return err }); err != nil {
		t.Fatalf("listen in %s: %v", n.name, err)
	}
	done := make(chan struct{})
	// Exits when the cleanup closes ln.
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return ln
}

// dial connects to an IP address inside the namespace. Only the socket is
// made on the namespace's thread; the connect waits in the caller's goroutine
// on the runtime's poller, so a black-holed connect blocks no other dial.
func (n *netNS) dial(ctx context.Context, network, address string) (net.Conn, error) {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return nil, fmt.Errorf("dial %s: want an IP address and port: %v", address, err)
	}
	family, sa := unix.AF_INET6, unix.Sockaddr(&unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()})
	if ap.Addr().Is4() {
		family, sa = unix.AF_INET, &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	var fd int
	if err := n.do(func() (err error) {
		fd, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		return err
	}); err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	err = unix.Connect(fd, sa)
	if err != nil && err != unix.EINPROGRESS {
		unix.Close(fd)
		return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError("connect", err)}
	}
	f := os.NewFile(uintptr(fd), "ns-tcp") // non-blocking, so on the poller
	defer f.Close()
	if dl, ok := ctx.Deadline(); ok {
		f.SetWriteDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { f.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var connErr error
	if err := rc.Write(func(fd uintptr) bool {
		v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		switch {
		case err != nil:
			connErr = err
		case v != 0:
			connErr = syscall.Errno(v)
		default:
			_, err := unix.Getpeername(int(fd))
			return err == nil // connected; else still in progress
		}
		return true
	}); err != nil {
		return nil, &net.OpError{Op: "dial", Net: network, Err: err}
	}
	if connErr != nil {
		return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError("connect", connErr)}
	}
	return net.FileConn(f)
}

// dropSYN installs an nftables rule in the namespace that drops TCP SYNs to
// port on output, so connects to it hang as if the backend were black-holed.
// It speaks nf_tables netlink directly, since the nft command may be missing.
func (n *netNS) dropSYN(t *testing.T, port uint16) {
	t.Helper()
	drop := nftExpr("immediate", nlAttr(1 /* DREG */, nlBE32(nftRegVerdict)),
		nlNest(2 /* DATA */, nlNest(2 /* NFTA_DATA_VERDICT */, nlAttr(1 /* CODE */, nlBE32(nfDrop)))))
	if err := n.do(func() error { return nftSYNRule(false, port, drop) }); err != nil {
		requirePrivilege(t, fmt.Sprintf("cannot install an nftables drop rule in %s: %v", n.name, err))
	}
}

// rejectSYN installs an nftables rule in the namespace that answers TCP SYNs
// to port with an ICMP (v6: ICMPv6) destination unreachable of the given
// code, as a firewall's reject does, instead of letting them through.
func (n *netNS) rejectSYN(t *testing.T, v6 bool, port uint16, code byte) {
	t.Helper()
	reject := nftExpr("reject", nlAttr(1 /* NFTA_REJECT_TYPE */, nlBE32(0 /* NFT_REJECT_ICMP_UNREACH */)),
		nlAttr(2 /* NFTA_REJECT_ICMP_CODE */, []byte{code}))
	if err := n.do(func() error { return nftSYNRule(v6, port, reject) }); err != nil {
		requirePrivilege(t, fmt.Sprintf("cannot install an nftables reject rule in %s: %v", n.name, err))
	}
}

// nf_tables netlink constants (linux/netfilter/nf_tables.h, nfnetlink.h).
const (
	nfnlSubsysNFTables = 10
	nfnlMsgBatchBegin  = 0x10
	nfnlMsgBatchEnd    = 0x11
	nftMsgNewTable     = 0
	nftMsgNewChain     = 3
	nftMsgNewRule      = 6
	nfprotoIPv4        = 2
	nfprotoIPv6        = 10
	nlaFNested         = 1 << 15
	nfInetLocalOut     = 3
	nfAccept           = 1
	nfDrop             = 0
	nftRegVerdict      = 0
	nftReg1            = 1
	nftPayloadNetwork  = 1
	nftPayloadTranspo  = 2
	nftCmpEq           = 0
)

func nlAttr(typ uint16, data []byte) []byte {
	b := make([]byte, (4+len(data)+3)&^3)
	binary.NativeEndian.PutUint16(b[0:], uint16(4+len(data)))
	binary.NativeEndian.PutUint16(b[2:], typ)
	copy(b[4:], data)
	return b
}

func nlNest(typ uint16, parts ...[]byte) []byte {
	var data []byte
	for _, p := range parts {
		data = append(data, p...)
	}
	return nlAttr(typ|nlaFNested, data)
}

func nlStr(s string) []byte { return append([]byte(s), 0) }

func nlBE32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

func nlMsg(family byte, typ, flags uint16, seq uint32, payload []byte) []byte {
	b := make([]byte, 16, 20+len(payload))
	binary.NativeEndian.PutUint32(b[0:], uint32(20+len(payload)))
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint16(b[6:], flags)
	binary.NativeEndian.PutUint32(b[8:], seq)
	if typ == nfnlMsgBatchBegin || typ == nfnlMsgBatchEnd {
		family = unix.AF_UNSPEC
	}
	b = append(b, family, 0)                                 // nfgenmsg: family, version
	b = binary.BigEndian.AppendUint16(b, nfnlSubsysNFTables) // res_id
	return append(b, payload...)
}

func nftExpr(name string, data ...[]byte) []byte {
	return nlNest(1 /* NFTA_LIST_ELEM */, nlAttr(1 /* NFTA_EXPR_NAME */, nlStr(name)), nlNest(2 /* NFTA_EXPR_DATA */, data...))
}

func nftPayload(base, offset, length uint32) []byte {
	return nftExpr("payload",
		nlAttr(1 /* DREG */, nlBE32(nftReg1)), nlAttr(2 /* BASE */, nlBE32(base)),
		nlAttr(3 /* OFFSET */, nlBE32(offset)), nlAttr(4 /* LEN */, nlBE32(length)))
}

func nftCmp(value []byte) []byte {
	return nftExpr("cmp", nlAttr(1 /* SREG */, nlBE32(nftReg1)), nlAttr(2 /* OP */, nlBE32(nftCmpEq)),
		nlNest(3 /* DATA */, nlAttr(1 /* NFTA_DATA_VALUE */, value)))
}

// nftSYNRule adds: table ip whc { chain out { type filter hook output
// priority 0; ip protocol tcp tcp dport PORT tcp flags & (syn|ack) == syn VERDICT } },
// where verdict is the rule's last expression; with v6, the same in table ip6
// whc, matching ip6 nexthdr tcp.
func nftSYNRule(v6 bool, port uint16, verdict []byte) error {
	family, protoOff := byte(nfprotoIPv4), uint32(9)
	if v6 {
		family, protoOff = nfprotoIPv6, 6
	}
	const table, chain = "whc", "out"
	req := uint16(unix.NLM_F_REQUEST | unix.NLM_F_ACK | unix.NLM_F_CREATE)
	mt := func(cmd uint16) uint16 { return nfnlSubsysNFTables<<8 | cmd }
	var batch []byte
	batch = append(batch, nlMsg(family, nfnlMsgBatchBegin, unix.NLM_F_REQUEST, 1, nil)...)
	batch = append(batch, nlMsg(family, mt(nftMsgNewTable), req, 2, nlAttr(1 /* NAME */, nlStr(table)))...)
	batch = append(batch, nlMsg(family, mt(nftMsgNewChain), req, 3, concat(
		nlAttr(1 /* TABLE */, nlStr(table)),
		nlAttr(3 /* NAME */, nlStr(chain)),
		nlNest(4 /* HOOK */, nlAttr(1 /* HOOKNUM */, nlBE32(nfInetLocalOut)), nlAttr(2 /* PRIORITY */, nlBE32(0))),
		nlAttr(5 /* POLICY */, nlBE32(nfAccept)),
		nlAttr(7 /* TYPE */, nlStr("filter")),
	))...)
	portBE := binary.BigEndian.AppendUint16(nil, port)
	batch = append(batch, nlMsg(family, mt(nftMsgNewRule), req|unix.NLM_F_APPEND, 4, concat(
		nlAttr(1 /* TABLE */, nlStr(table)),
		nlAttr(2 /* CHAIN */, nlStr(chain)),
		nlNest(4, /* EXPRESSIONS */
			nftPayload(nftPayloadNetwork, protoOff, 1), nftCmp([]byte{unix.IPPROTO_TCP}),
			nftPayload(nftPayloadTranspo, 2, 2), nftCmp(portBE),
			nftPayload(nftPayloadTranspo, 13, 1),
			nftExpr("bitwise",
				nlAttr(1 /* SREG */, nlBE32(nftReg1)), nlAttr(2 /* DREG */, nlBE32(nftReg1)),
				nlAttr(3 /* LEN */, nlBE32(1)),
				nlNest(4 /* MASK */, nlAttr(1, []byte{0x12})), nlNest(5 /* XOR */, nlAttr(1, []byte{0}))),
			nftCmp([]byte{0x02}),
			verdict,
		),
	))...)
	batch = append(batch, nlMsg(family, nfnlMsgBatchEnd, unix.NLM_F_REQUEST, 5, nil)...)

	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink socket: %w", err)
	}
	defer unix.Close(fd)
	tv := unix.NsecToTimeval(int64(2 * time.Second))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if err := unix.Sendto(fd, batch, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("netlink send: %w", err)
	}
	buf := make([]byte, 1<<16)
	for acks := 0; acks < 3; {
		m, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return fmt.Errorf("netlink receive: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:m])
		if err != nil {
			return fmt.Errorf("netlink parse: %w", err)
		}
		for _, msg := range msgs {
			if msg.Header.Type != unix.NLMSG_ERROR {
				continue
			}
			acks++
			if code := int32(binary.NativeEndian.Uint32(msg.Data)); code != 0 {
				return fmt.Errorf("nf_tables message %d: %w", msg.Header.Seq, syscall.Errno(-code))
			}
		}
	}
	return nil
}

func concat(parts ...[]byte) []byte {
	var b []byte
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}
