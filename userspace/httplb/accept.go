package httplb

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/userspace/acceptlog"
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

// takeOver returns a listener of its own on the listening socket under ln (see
// ListenFrom), or nil if there is none (ln closed). net.FileListener's
// accepted connections get Go's default keepalive (15s idle, 15s interval, 9
// probes): where ka differs, its values are set on each one, the only cost a
// socket taken over adds per connection (a setsockopt a field that differs).
func takeOver(ln net.Listener, ka net.KeepAliveConfig) net.Listener {
	if kl, ok := ln.(*keepaliveListener); ok {
		ln = kl.TCPListener
	}
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		return nil
	}
	f, err := tl.File() // a new descriptor; fails once tl is closed
	if err != nil {
		return nil
	}
	defer f.Close()
	fl, err := net.FileListener(f)
	if err != nil {
		return nil
	}
	kl := &keepaliveListener{TCPListener: fl.(*net.TCPListener)}
	if !ka.Enable {
		return kl.TCPListener // as a listener of its own: Go's default
	}
	secs := func(d time.Duration) int { return int((d + time.Second - 1) / time.Second) }
	for _, o := range []struct{ opt, v, def int }{
		{unix.TCP_KEEPIDLE, secs(ka.Idle), 15},
		{unix.TCP_KEEPINTVL, secs(ka.Interval), 15},
		{unix.TCP_KEEPCNT, ka.Count, 9},
	} {
		if o.v > 0 && o.v != o.def {
			kl.opts = append(kl.opts, [2]int{o.opt, o.v})
		}
	}
	if len(kl.opts) == 0 {
		return kl.TCPListener
	}
	return kl
}

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
