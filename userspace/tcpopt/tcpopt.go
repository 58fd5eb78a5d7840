// Package tcpopt sets the TCP options the data planes give their sockets
// beyond what Go's net package sets: keepalive with every field, and
// TCP_USER_TIMEOUT. Linux only.
package tcpopt

import (
	"fmt"
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// SetKeepalive turns TCP keepalive on for fd: after ka.Idle with nothing
// received, a probe every ka.Interval, and after ka.Count unanswered probes
// the connection fails (ETIMEDOUT). The kernel takes whole seconds: a
// duration is rounded up to one. A field that is zero or negative keeps
// what fd has (a new socket: the kernel's net.ipv4.tcp_keepalive_time,
// _intvl, _probes). ka.Enable is not read.
func SetKeepalive(fd int, ka net.KeepAliveConfig) error {
	for _, o := range []struct {
		level, opt int
		name       string
		v          int
	}{
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, "SO_KEEPALIVE", 1},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, "TCP_KEEPIDLE", Secs(ka.Idle)},
		{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, "TCP_KEEPINTVL", Secs(ka.Interval)},
		{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, "TCP_KEEPCNT", ka.Count},
	} {
		if o.v <= 0 {
			continue
		}
		if err := unix.SetsockoptInt(fd, o.level, o.opt, o.v); err != nil {
			return fmt.Errorf("set %s: %w", o.name, err)
		}
	}
	return nil
}

// Fill returns ka with def's value for each of Idle, Interval and Count that
// ka leaves zero or negative.
func Fill(ka, def net.KeepAliveConfig) net.KeepAliveConfig {
	if ka.Idle <= 0 {
		ka.Idle = def.Idle
	}
	if ka.Interval <= 0 {
		ka.Interval = def.Interval
	}
	if ka.Count <= 0 {
		ka.Count = def.Count
	}
	return ka
}

// Secs is d in whole seconds, rounded up, as the kernel takes keepalive times.
func Secs(d time.Duration) int { return int((d + time.Second - 1) / time.Second) }

// SetUserTimeout sets TCP_USER_TIMEOUT on fd (tcp(7)): once bytes it sent
// have waited d to be acknowledged, or, with keepalive on, its probes have
// gone unanswered for d, the connection fails (ETIMEDOUT) instead of
// retransmitting for net.ipv4.tcp_retries2; a connect whose handshake is not
// answered for d fails too. The kernel takes milliseconds: d is rounded up
// to one; 0 turns it off.
func SetUserTimeout(fd int, d time.Duration) error {
	ms := int((d + time.Millisecond - 1) / time.Millisecond)
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, ms); err != nil {
		return fmt.Errorf("set TCP_USER_TIMEOUT: %w", err)
	}
	return nil
}
