package httplb

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

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
