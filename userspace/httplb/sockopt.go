package httplb

import (
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// This file sets the TCP options of the service's sockets that net's
// ListenConfig and Dialer have no field for: the listening socket's, which
// accepted sockets inherit (the kernel copies them to the sockets it clones
// from a listener), and the dialed sockets'.

// control runs f on c's descriptor and returns the error of either.
func control(c syscall.RawConn, f func(fd int) error) error {
	var ferr error
	err := c.Control(func(fd uintptr) { ferr = f(int(fd)) })
	return errors.Join(err, ferr)
}

// setUserTimeout sets TCP_USER_TIMEOUT on fd (tcp(7)): once bytes it sent have
// waited d to be acknowledged, or, with keepalive on, its probes have gone
// unanswered for d, the connection fails (ETIMEDOUT) instead of retransmitting
// for net.ipv4.tcp_retries2. The kernel takes milliseconds: d is rounded up to
// one; 0 turns it off.
func setUserTimeout(fd int, d time.Duration) error {
	ms := int((d + time.Millisecond - 1) / time.Millisecond)
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, ms); err != nil {
		return fmt.Errorf("set TCP_USER_TIMEOUT: %w", err)
	}
	return nil
}

// listenOpts sets the client options on a listening socket bound afresh:
// SO_REUSEPORT, and the user timeout if there is one.
func (cfg *Config) listenOpts(fd int) error {
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
		return fmt.Errorf("set SO_REUSEPORT: %w", err)
	}
	if cfg.ClientUserTimeout > 0 {
		return setUserTimeout(fd, cfg.ClientUserTimeout)
	}
	return nil
}

// retune sets the client options on a listening socket taken over from
// another service, whose settings may have been others: unlike listenOpts, it
// turns the user timeout off when there is none.
func (cfg *Config) retune(fd int) error {
	return setUserTimeout(fd, cfg.ClientUserTimeout)
}

// Reclaim sets the service's client options on its listening sockets again,
// which a service that took them over (ListenFrom) and was given up may have
// changed. A socket already closed is left alone.
func (s *Service) Reclaim() error {
	for _, tl := range s.socks {
		rc, err := tl.SyscallConn()
		if err != nil {
			continue // closed
		}
		var rerr error
		if err := rc.Control(func(fd uintptr) { rerr = s.cfg.retune(int(fd)) }); err != nil {
			continue // closed
		}
		if rerr != nil {
			return fmt.Errorf("service %q: listen %s: %w", s.cfg.Name, s.cfg.Listen, rerr)
		}
	}
	return nil
}

// dialer is the dialer of the connections to backends: ConnectTimeout, the
// backend keepalive, and the backend user timeout if there is one (no system
// call if not).
func (s *Service) dialer() net.Dialer {
	d := net.Dialer{Timeout: s.cfg.ConnectTimeout, KeepAliveConfig: s.cfg.BackendKeepalive}
	if ut := s.cfg.BackendUserTimeout; ut > 0 {
		d.Control = func(_, _ string, c syscall.RawConn) error {
			return control(c, func(fd int) error { return setUserTimeout(fd, ut) })
		}
	}
	return d
}
