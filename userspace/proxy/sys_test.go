package proxy

import (
	"net/netip"

	"golang.org/x/sys/unix"
)

// listenBacklog0 opens a listening socket on 127.0.0.1 with a backlog of 0.
func listenBacklog0() (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.Listen(fd, 0); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func closeFD(fd int) { unix.Close(fd) }

func sockName(fd int) netip.AddrPort {
	sa, _ := unix.Getsockname(fd)
	in := sa.(*unix.SockaddrInet4)
	return netip.AddrPortFrom(netip.AddrFrom4(in.Addr), uint16(in.Port))
}
