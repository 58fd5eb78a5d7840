package httplb

import (
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/userspace/tcpopt"
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

// goKeepalive is the keepalive Go's net package gives a connection that asks
// for none, and a field of one that asks leaves zero: 15s idle, 15s
// interval, 9 probes.
var goKeepalive = net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 15 * time.Second, Count: 9}

// clientKeepalive is the keepalive of the client connections: cfg's, with
// Go's for what it leaves out, or all of Go's when it is off.
func (cfg *Config) clientKeepalive() net.KeepAliveConfig {
	ka := cfg.ClientKeepalive
	if !ka.Enable {
		return goKeepalive
	}
	return tcpopt.Fill(ka, goKeepalive)
}

// listenOpts sets the client options on a listening socket bound afresh,
// before it listens: SO_REUSEPORT, the client keepalive, and the user timeout
// if there is one. The ListenConfig has Go leave its accepted connections'
// keepalive alone (KeepAlive -1), so they keep what they inherit from the
// socket: no system call per connection for it.
func (cfg *Config) listenOpts(fd int) error {
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
		return fmt.Errorf("set SO_REUSEPORT: %w", err)
	}
	if err := tcpopt.SetKeepalive(fd, cfg.clientKeepalive()); err != nil {
		return err
	}
	if cfg.ClientUserTimeout > 0 {
		return tcpopt.SetUserTimeout(fd, cfg.ClientUserTimeout)
	}
	return nil
}

// retune sets the client options on a listening socket taken over from
// another service, whose settings may have been others: unlike listenOpts, it
// turns the user timeout off when there is none. The connections either
// service accepts from the socket inherit them (but a taken-over socket's own
// listener sets Go's keepalive on the connections it accepts; see takeOver).
func (cfg *Config) retune(fd int) error {
	if err := tcpopt.SetKeepalive(fd, cfg.clientKeepalive()); err != nil {
		return err
	}
	return tcpopt.SetUserTimeout(fd, cfg.ClientUserTimeout)
}

// Reclaim sets the service's client options on its listening sockets again,
// which a service that took them over (ListenFrom) and was given up may have
// changed. A socket already closed is left alone.
func (s *Service) Reclaim() error {
	var errs []error
	for _, tl := range s.socks {
		rc, err := tl.SyscallConn()
		if err != nil {
			continue // closed
		}
		// Not run once tl is closed; each socket is tried, whatever the others did.
		rc.Control(func(fd uintptr) { errs = append(errs, s.cfg.retune(int(fd))) })
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("service %q: listen %s: %w", s.cfg.Name, s.cfg.Listen, err)
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
			return control(c, func(fd int) error { return tcpopt.SetUserTimeout(fd, ut) })
		}
	}
	return d
}

// socketClosed reports whether c is a TCP socket the kernel has closed (state
// TCP_CLOSE: reset, timed out, or both sides' FINs done), on which reads and
// writes fail at once.
func socketClosed(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	var closed bool
	err = control(rc, func(fd int) error {
		info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		closed = err == nil && info.State == unix.BPF_TCP_CLOSE
		return err
	})
	return err == nil && closed
}
