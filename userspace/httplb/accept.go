package httplb

import (
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/userspace/acceptlog"
	"github.com/weir-lb/weir/userspace/tcpopt"
)

// patientListener waits out the accept errors that pass (no file descriptor
// or memory left: EMFILE, ENFILE, ENOBUFS, ENOMEM), backing off from 5 ms to
// 1 s and logging them as the proxy does (acceptlog), so that whichever
// engine reads it (the connection splitter or net/http's server) sees only a
// closed or failed listener. One goroutine accepts.
type patientListener struct {
	net.Listener
	log  *slog.Logger
	alog acceptlog.Log
	errs *atomic.Uint64 // counts the errors waited out
	done chan struct{}  // closed by Close: a wait ends
	once sync.Once
}

func newPatientListener(ln net.Listener, s *Service) *patientListener {
	return &patientListener{Listener: ln, log: s.log.With("service", s.cfg.Name), errs: &s.stats.acceptErrors,
		done: make(chan struct{})}
}

func (l *patientListener) Accept() (net.Conn, error) {
	var wait time.Duration
	for {
		c, err := l.Listener.Accept()
		if err == nil {
			l.alog.OK(l.log, time.Now)
		}
		if err == nil || !passes(err) {
			return c, err
		}
		wait = min(max(2*wait, 5*time.Millisecond), time.Second)
		l.errs.Add(1)
		l.alog.Failed(l.log, time.Now(), err, wait)
		select {
		case <-time.After(wait):
		case <-l.done:
			return nil, net.ErrClosed
		}
	}
}

// passes reports whether an accept error is one of load, which goes away:
// what net/http's server backs off on (Temporary: EMFILE, ENFILE) and, as
// the proxy, no memory for a socket (ENOBUFS, ENOMEM).
func passes(err error) bool {
	if ne, ok := err.(net.Error); ok && ne.Temporary() { //nolint:staticcheck // Temporary is what net/http's server backs off on
		return true
	}
	return errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

// Close closes the listener and ends a wait; it may be called more than once.
func (l *patientListener) Close() error {
	var err error
	l.once.Do(func() {
		err = l.Listener.Close()
		close(l.done)
	})
	return err
}

// Sockets is a running server whose listening sockets a new one may take
// over (ListenFrom).
type Sockets interface {
	// ListenFDs returns new descriptors (close-on-exec) of the listening
	// sockets the server holds open, if it listens on addr as configured;
	// the caller owns them.
	ListenFDs(addr netip.AddrPort) []int
}

// ListenFDs returns new descriptors of the service's listening sockets that
// are still open, if it listens on addr (see Sockets). A nil service has
// none.
func (s *Service) ListenFDs(addr netip.AddrPort) []int {
	if s == nil || s.cfg.Listen != addr {
		return nil
	}
	var fds []int
	for _, tl := range s.socks {
		rc, err := tl.SyscallConn()
		if err != nil {
			continue
		}
		// Not called once tl is closed.
		rc.Control(func(fd uintptr) {
			if nfd, err := unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0); err == nil {
				fds = append(fds, nfd)
			}
		})
	}
	return fds
}

// takeOver returns a listener on the listening socket fd, which it owns (see
// ListenFrom), with cfg's client options set on the socket (retune), and the
// socket's own listener under it; nil if fd is no TCP listening socket or the
// options cannot be set. Unlike one bound afresh, net.FileListener's listener
// sets Go's default keepalive (15s idle, 15s interval, 9 probes) on every
// connection it accepts, four setsockopt calls that override what the
// connection inherited: where cfg's differs, its values are set on each one
// too (a setsockopt a field that differs).
func takeOver(fd int, cfg *Config) (*net.TCPListener, net.Listener) {
	if cfg.retune(fd) != nil {
		unix.Close(fd)
		return nil, nil
	}
	f := os.NewFile(uintptr(fd), "listener")
	fl, err := net.FileListener(f) // a descriptor of its own
	f.Close()
	if err != nil {
		return nil, nil
	}
	tl, ok := fl.(*net.TCPListener)
	if !ok {
		fl.Close()
		return nil, nil
	}
	kl := &keepaliveListener{TCPListener: tl}
	ka := cfg.clientKeepalive()
	for _, o := range []struct{ opt, v, def int }{
		{unix.TCP_KEEPIDLE, tcpopt.Secs(ka.Idle), tcpopt.Secs(goKeepalive.Idle)},
		{unix.TCP_KEEPINTVL, tcpopt.Secs(ka.Interval), tcpopt.Secs(goKeepalive.Interval)},
		{unix.TCP_KEEPCNT, ka.Count, goKeepalive.Count},
	} {
		if o.v != o.def {
			kl.opts = append(kl.opts, [2]int{o.opt, o.v})
		}
	}
	if len(kl.opts) == 0 {
		return tl, tl
	}
	return tl, kl
}

// mergedListener accepts from several listening sockets of one address (a
// proxy's, taken over), one goroutine each, started by the first Accept.
// Close closes the sockets; a connection a goroutine accepted by then is
// still handed to Accept, which returns net.ErrClosed once every goroutine
// has ended: the caller (the split listener, net/http's server) accepts until
// an error, and serves what it accepted, so nothing the sockets' queues held
// is dropped.
type mergedListener struct {
	lns      []net.Listener
	accepted chan acceptResult
	start    sync.Once
	wg       sync.WaitGroup
	ended    chan struct{} // closed when every goroutine has ended
	closed   atomic.Bool
	// failed is closed once Accept was handed an error that does not pass:
	// its caller accepts no more, and a connection still to be handed is
	// closed.
	failed     chan struct{}
	failedOnce sync.Once
}

type acceptResult struct {
	c   net.Conn
	err error
}

func newMergedListener(lns []net.Listener) *mergedListener {
	return &mergedListener{lns: lns, accepted: make(chan acceptResult), ended: make(chan struct{}), failed: make(chan struct{})}
}

// accept hands what ln accepts to Accept: connections, and errors (Accept's
// caller, patientListener, waits those that pass out); it ends at an error
// that does not pass (and so do the others), quietly once Close has closed
// ln.
func (m *mergedListener) accept(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil && m.closed.Load() {
			return
		}
		select {
		case m.accepted <- acceptResult{c, err}:
		case <-m.failed:
			if c != nil {
				c.Close()
			}
			return
		}
		if err != nil && !passes(err) {
			m.failedOnce.Do(func() { close(m.failed) })
			return
		}
	}
}

func (m *mergedListener) Accept() (net.Conn, error) {
	m.start.Do(func() {
		for _, ln := range m.lns {
			// Exits when ln fails for good, or is closed (Close).
			m.wg.Go(func() { m.accept(ln) })
		}
		// Exits when the goroutines above have.
		go func() {
			m.wg.Wait()
			close(m.ended)
		}()
	})
	select {
	case r := <-m.accepted:
		return r.c, r.err
	case <-m.ended:
		return nil, net.ErrClosed
	}
}

// Close closes every socket; it may be called more than once.
func (m *mergedListener) Close() error {
	if m.closed.Swap(true) {
		return nil
	}
	var errs []error
	for _, ln := range m.lns {
		errs = append(errs, ln.Close())
	}
	return errors.Join(errs...)
}

func (m *mergedListener) Addr() net.Addr { return m.lns[0].Addr() }

// keepaliveListener sets TCP options (level IPPROTO_TCP, option and value) on
// every connection it accepts.
type keepaliveListener struct {
	*net.TCPListener
	opts [][2]int
}

func (l *keepaliveListener) Accept() (net.Conn, error) {
	c, err := l.AcceptTCP()
	if err != nil {
		return nil, err
	}
	if rc, err := c.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) {
			for _, o := range l.opts {
				unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, o[0], o[1])
			}
		})
	}
	return c, nil
}
