// Package sockfd finds this process's own sockets by their addresses and reads
// their options back, for tests that check what a data plane set on sockets no
// API hands out (the proxy's accepted and dialed ones).
package sockfd

import (
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Find returns the descriptor of this process whose TCP socket is connected from
// local (the zero AddrPort: any address) to peer; if several are, any of them.
// A descriptor is only borrowed: it stays its owner's, and may be closed by it
// at any time.
func Find(local, peer netip.AddrPort) (int, error) {
	fds, err := FindAll(local, peer)
	if err == nil && len(fds) == 0 {
		err = fmt.Errorf("find socket: none of this process is connected from %s to %s", local, peer)
	}
	if err != nil {
		return -1, err
	}
	return fds[0], nil
}

// FindAll is Find for every such socket.
func FindAll(local, peer netip.AddrPort) ([]int, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil, fmt.Errorf("find socket: %w", err)
	}
	var fds []int
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if la, err := unix.Getsockname(fd); err != nil || local.IsValid() && addrPort(la) != local {
			continue
		}
		if pa, err := unix.Getpeername(fd); err == nil && addrPort(pa) == peer {
			fds = append(fds, fd)
		}
	}
	return fds, nil
}

// Open returns how many descriptors this process has open, but for pipes: the
// proxy keeps those it splices through in a pool shared by every server, whose
// size follows the load, so a test that looks for descriptors a server leaves
// behind counts the rest.
func Open() (int, error) { return count(func(int) bool { return true }) }

// Standing is Open but for connected sockets too: what the process's servers
// hold whatever their load (listening sockets, epoll sets, eventfds), where
// the connections clients and pools leave open come and go.
func Standing() (int, error) {
	return count(func(fd int) bool {
		_, err := unix.Getpeername(fd)
		return err != nil
	})
}

// count returns how many descriptors this process has open, pipes aside,
// that keep says to count.
func count(keep func(fd int) bool) (int, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0, fmt.Errorf("count descriptors: %w", err)
	}
	n := 0
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		// A descriptor closed since the read has no link: not counted.
		if to, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && !strings.HasPrefix(to, "pipe:") && keep(fd) {
			n++
		}
	}
	return n, nil
}

// Listening returns this process's listening TCP sockets bound to ap: how
// many descriptors it holds of each, by the socket's name in /proc/self/fd
// (socket:[inode]), which tells a socket taken over from one bound anew.
func Listening(ap netip.AddrPort) (map[string]int, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil, fmt.Errorf("find listening sockets: %w", err)
	}
	out := map[string]int{}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		// A descriptor closed since the read is skipped, one reused is
		// taken for what it is now.
		if la, err := unix.Getsockname(fd); err != nil || addrPort(la) != ap {
			continue
		}
		if on, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || on != 1 {
			continue
		}
		if to, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil {
			out[to]++
		}
	}
	return out, nil
}

func addrPort(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port))
	}
	return netip.AddrPort{}
}

// Keepalive is what the kernel holds of a socket's TCP keepalive settings:
// SO_KEEPALIVE (0 or 1), TCP_KEEPIDLE and TCP_KEEPINTVL (seconds), TCP_KEEPCNT.
type Keepalive struct{ On, Idle, Interval, Count int }

// KeepaliveOf reads fd's keepalive settings with getsockopt.
func KeepaliveOf(fd int) (Keepalive, error) {
	var k Keepalive
	for _, o := range []struct {
		level, opt int
		v          *int
	}{
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, &k.On},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, &k.Idle},
		{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, &k.Interval},
		{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, &k.Count},
	} {
		v, err := unix.GetsockoptInt(fd, o.level, o.opt)
		if err != nil {
			return Keepalive{}, fmt.Errorf("getsockopt %d/%d on fd %d: %w", o.level, o.opt, fd, err)
		}
		*o.v = v
	}
	return k, nil
}

// KeepaliveBetween is KeepaliveOf the socket Find finds.
func KeepaliveBetween(local, peer netip.AddrPort) (Keepalive, error) {
	fd, err := Find(local, peer)
	if err != nil {
		return Keepalive{}, err
	}
	return KeepaliveOf(fd)
}

// UserTimeoutOf reads fd's TCP_USER_TIMEOUT with getsockopt; 0 is none.
func UserTimeoutOf(fd int) (time.Duration, error) {
	ms, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)
	if err != nil {
		return 0, fmt.Errorf("getsockopt TCP_USER_TIMEOUT on fd %d: %w", fd, err)
	}
	return time.Duration(ms) * time.Millisecond, nil
}

// UserTimeoutBetween is UserTimeoutOf the socket Find finds.
func UserTimeoutBetween(local, peer netip.AddrPort) (time.Duration, error) {
	fd, err := Find(local, peer)
	if err != nil {
		return 0, err
	}
	return UserTimeoutOf(fd)
}
