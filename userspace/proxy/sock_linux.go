package proxy

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/userspace/tcpopt"
)

// This file opens the proxy's sockets with raw system calls: listeners, and the
// backend sockets' connects. Per connection that saves what the net package does for
// every socket and the proxy never uses: getsockname on both sockets, getpeername on
// the accepted one (accept4 returns the peer), a TCP_NODELAY setsockopt on the
// accepted one (it inherits TCP_NODELAY from the listener, which sets it once), the
// runtime poller's registration (fcntl, epoll_ctl, a finalizer; the event loop
// registers the sockets itself) and its deregistration at close, and the dialer's
// context, resolver and address plumbing.

// listener is a listening socket, non-blocking, served by one loop. Its
// descriptor may be duplicated for a service that takes the socket over
// (ListenFrom) from another goroutine than the loop's: mu orders that with
// close. The loop reads fd without it, as only the loop (or, before Serve,
// its owner) closes it.
type listener struct {
	mu sync.Mutex
	fd int // -1 once closed
	// bound: bound, but not listening yet (Service.Join), so it takes no
	// connection and belongs to no SO_REUSEPORT group; guarded by mu.
	bound bool
}

func (l *listener) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.fd >= 0 {
		unix.Close(l.fd)
		l.fd = -1
	}
}

// dup returns a new descriptor of the same listening socket, or -1 if l is
// closed, only bound (not joined yet: nothing is queued on it, and a service
// that took it over would take it for a listening one), or the descriptor
// could not be had.
func (l *listener) dup() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.fd < 0 || l.bound {
		return -1
	}
	fd, err := unix.FcntlInt(uintptr(l.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1
	}
	return fd
}

// tcpOpts are the TCP options one side's sockets get that the proxy does not
// always set: keepalive if ka is enabled, TCP_USER_TIMEOUT if userTimeout > 0.
type tcpOpts struct {
	ka          net.KeepAliveConfig
	userTimeout time.Duration
}

// set sets o's options on fd; an option that is off costs no system call.
func (o *tcpOpts) set(fd int) error {
	if o.ka.Enable {
		if err := tcpopt.SetKeepalive(fd, o.ka); err != nil {
			return err
		}
	}
	if o.userTimeout > 0 {
		return tcpopt.SetUserTimeout(fd, o.userTimeout)
	}
	return nil
}

// listen binds a non-blocking listening socket on ap with SO_REUSEPORT, as
// net.Listen("tcp", ...) would (SO_REUSEADDR; a wildcard IPv6 address also takes
// IPv4), and sets TCP_NODELAY and o: accepted sockets inherit them all (the
// kernel copies TCP_USER_TIMEOUT and the keepalive settings to the sockets it
// clones from a listener), so they cost no system call per connection.
func listen(ap netip.AddrPort, o tcpOpts) (*listener, error) {
	return bindListener(ap, o, false)
}

// bindListener is listen; with later, the socket is bound only, and
// startListening makes it listen.
func bindListener(ap netip.AddrPort, o tcpOpts, later bool) (*listener, error) {
	sa := sockaddrOf(ap)
	fd, err := unix.Socket(sa.family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socket: %w", err)
	}
	set := func(level, opt int, name string) error {
		if err := unix.SetsockoptInt(fd, level, opt, 1); err != nil {
			return fmt.Errorf("set %s: %w", name, err)
		}
		return nil
	}
	err = set(unix.SOL_SOCKET, unix.SO_REUSEADDR, "SO_REUSEADDR")
	if err == nil {
		err = set(unix.SOL_SOCKET, unix.SO_REUSEPORT, "SO_REUSEPORT")
	}
	if err == nil {
		err = set(unix.IPPROTO_TCP, unix.TCP_NODELAY, "TCP_NODELAY")
	}
	if err == nil {
		err = o.set(fd)
	}
	if err == nil && sa.family == unix.AF_INET6 && ap.Addr().IsUnspecified() {
		if err = unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0); err != nil {
			err = fmt.Errorf("clear IPV6_V6ONLY: %w", err)
		}
	}
	if err == nil {
		if err = bindRaw(fd, &sa); err != nil {
			err = fmt.Errorf("bind: %w", err)
		}
	}
	if err == nil && !later {
		err = startListening(fd)
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &listener{fd: fd, bound: later}, nil
}

// startListening makes the bound socket fd listen.
func startListening(fd int) error {
	// The kernel caps the backlog at net.core.somaxconn.
	if err := unix.Listen(fd, 65535); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	return nil
}

// adopt readies a listening socket taken over from another server (ListenFrom)
// as listen makes its own: non-blocking (the other server's may be a Go
// listener, which is too), TCP_NODELAY, and o (retune).
func adopt(fd int, o tcpOpts) error {
	if err := unix.SetNonblock(fd, true); err != nil {
		return fmt.Errorf("set non-blocking: %w", err)
	}
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1); err != nil {
		return fmt.Errorf("set TCP_NODELAY: %w", err)
	}
	return retune(fd, o)
}

// retune sets o on a listening socket taken over from another service, whose
// settings may have been others: unlike listen, it turns keepalive and the user
// timeout off when o does not set them, and gives a keepalive field o leaves
// zero the kernel's default back.
func retune(fd int, o tcpOpts) error {
	// 0 is the kernel's default: no user timeout.
	if err := tcpopt.SetUserTimeout(fd, o.userTimeout); err != nil {
		return err
	}
	ka := o.ka
	on := 0
	if ka.Enable {
		on = 1
		def, err := keepaliveDefaults()
		if err != nil {
			return err
		}
		if err := tcpopt.SetKeepalive(fd, tcpopt.Fill(ka, def)); err != nil {
			return err
		}
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE, on); err != nil {
		return fmt.Errorf("set SO_KEEPALIVE: %w", err)
	}
	return nil
}

// keepaliveDefaults returns the kernel's keepalive settings of a new socket
// (net.ipv4.tcp_keepalive_time, _intvl, _probes of this network namespace).
func keepaliveDefaults() (net.KeepAliveConfig, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return net.KeepAliveConfig{}, fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	var v [3]int
	for i, opt := range []int{unix.TCP_KEEPIDLE, unix.TCP_KEEPINTVL, unix.TCP_KEEPCNT} {
		if v[i], err = unix.GetsockoptInt(fd, unix.IPPROTO_TCP, opt); err != nil {
			return net.KeepAliveConfig{}, fmt.Errorf("read the keepalive defaults: %w", err)
		}
	}
	return net.KeepAliveConfig{Enable: true, Idle: time.Duration(v[0]) * time.Second,
		Interval: time.Duration(v[1]) * time.Second, Count: v[2]}, nil
}

// startDial opens a non-blocking socket to sa and starts its connect. The connect
// completes (or fails) later, reported by the event loop's epoll set; a connect that
// fails at once is returned as an error. With data (bytes wait to be sent as soon
// as it is connected) the handshake's last ACK is held back to go with them
// (TCP_QUICKACK off before the connect: the kernel then delays that ACK for up to
// 200 ms, so only a caller with bytes in hand may ask). o's options are set on
// the socket; one that is off costs no system call.
func startDial(sa *rawSockaddr, data bool, o *tcpOpts) (int, error) {
	fd, err := unix.Socket(sa.family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, &localError{fmt.Errorf("socket: %w", err)}
	}
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1); err != nil {
		unix.Close(fd)
		return -1, &localError{fmt.Errorf("set TCP_NODELAY: %w", err)}
	}
	if err := o.set(fd); err != nil {
		unix.Close(fd)
		return -1, &localError{err}
	}
	if data {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_QUICKACK, 0); err != nil {
			unix.Close(fd)
			return -1, &localError{fmt.Errorf("clear TCP_QUICKACK: %w", err)}
		}
	}
	err = connectRaw(fd, sa)
	for err == unix.EINTR {
		err = connectRaw(fd, sa)
	}
	if err != nil && err != unix.EINPROGRESS {
		// Not local even when the host has no port or source address left for
		// it (EADDRNOTAVAIL): that is per destination, and another backend
		// may still be reached.
		unix.Close(fd)
		return -1, fmt.Errorf("connect: %w", err)
	}
	return fd, nil
}

// errSelfConnect is a dial that the kernel connected to itself.
var errSelfConnect = fmt.Errorf("connect: %w (the socket was connected to itself: nothing listens there)", unix.ECONNREFUSED)

// localPorts is the kernel's range of local ports for connect(2)
// (net.ipv4.ip_local_port_range, which IPv6 uses too), read once; if it can't
// be read, every port.
var localPorts = sync.OnceValues(func() (lo, hi int) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if _, err = fmt.Sscan(string(b), &lo, &hi); err == nil && lo <= hi {
			return lo, hi
		}
	}
	return 1, 65535
})

// selfConnectRisk reports whether a dial of a backend on this port may end up
// connected to itself. A dial whose source port the kernel picks equal to its
// destination port, on an address of this host that nothing listens on there,
// meets itself in TCP's simultaneous open and connects: the backend is down, and
// the dial must say so. Only a port in the range the kernel picks source ports
// from can be met that way, so the check (a getsockname per connection) is
// made for those alone. The range is read once, when the first backend is
// made: ports that a range widened later adds are not checked.
func selfConnectRisk(port uint16) bool {
	lo, hi := localPorts()
	return int(port) >= lo && int(port) <= hi
}

// selfConnected reports whether the connected socket fd is connected to itself,
// self being its peer's address (backend.self).
func selfConnected(fd int, self netip.AddrPort) bool {
	la, err := getsocknameRaw(fd)
	return err == nil && la == self
}

// localError is a dial that failed on this host before it reached for the
// backend (no descriptor or memory for a socket, no room in the epoll set): it
// counts against no backend's health, and another backend would fare no
// better.
type localError struct{ err error }

func (e *localError) Error() string { return e.err.Error() }
func (e *localError) Unwrap() error { return e.err }

// setLinger0 makes the close of fd send a reset instead of a FIN.
func setLinger0(fd int) {
	unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
}

func sockaddrOf(ap netip.AddrPort) rawSockaddr {
	var zoneID uint32
	if z := ap.Addr().Zone(); z != "" {
		if ifi, err := net.InterfaceByName(z); err == nil {
			zoneID = uint32(ifi.Index)
		}
	}
	return newRawSockaddr(ap, zoneID)
}
