package proxy

import (
	"net/netip"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// This file issues the connection path's system calls with RawSyscall, without telling
// the Go scheduler that a system call is in progress.
//
// Every socket here is non-blocking, so none of these calls waits. But on loopback a
// splice or connect runs the receiver's TCP stack inline and can take tens of
// microseconds; with syscall.Syscall the scheduler's monitor thread (sysmon) then
// takes the P away from the thread in the call, hands it to another thread (a futex
// wake-up), and the first thread has to find a P again on return — the OS-thread
// hand-offs that dominated the proxy's profile. A raw call keeps its P: no hand-off.
// The cost is that the goroutine can't be preempted for the few microseconds a
// non-blocking call lasts. Big splices into a socket (bulk transfers: up to a whole
// pipe, which on loopback runs the receiver's stack for all of it) still go through
// syscall.Syscall6, so another thread may run Go code meanwhile: measured, doing them
// raw cost 10-20% of bulk throughput.

// rawSpliceMax is the largest splice into a socket issued raw.
const rawSpliceMax = 64 << 10

func errnoErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

// spliceRaw is splice(2) between two descriptors without offsets.
func spliceRaw(rfd, wfd, n int, flags int) (int, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_SPLICE, uintptr(rfd), 0, uintptr(wfd), 0, uintptr(n), uintptr(flags))
	return int(r), errnoErr(e)
}

// spliceOut is splice(2) from a pipe into a socket: raw up to rawSpliceMax bytes,
// through the scheduler above.
func spliceOut(rfd, wfd, n int, flags int) (int, error) {
	if n <= rawSpliceMax {
		return spliceRaw(rfd, wfd, n, flags)
	}
	r, _, e := unix.Syscall6(unix.SYS_SPLICE, uintptr(rfd), 0, uintptr(wfd), 0, uintptr(n), uintptr(flags))
	return int(r), errnoErr(e)
}

// shutdownRaw is shutdown(2).
func shutdownRaw(fd, how int) error {
	_, _, e := unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(fd), uintptr(how), 0)
	return errnoErr(e)
}

// readRaw is read(2).
func readRaw(fd int, b []byte) (int, error) {
	r, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	return int(r), errnoErr(e)
}

// closeRaw is close(2). Closing a loopback socket runs the peer's side of the FIN
// inline (~10 µs), long enough for sysmon to hand the P to another thread if the
// call went through the scheduler; measured, raw saves context switches per short
// connection (0.05-0.3 -> 0.03-0.06) and ~5 % of new connections/s. No socket here
// lingers, so close never blocks.
func closeRaw(fd int) {
	unix.RawSyscall(unix.SYS_CLOSE, uintptr(fd), 0, 0)
}

// epollWaitRaw is epoll_wait(2) with a zero timeout: it never blocks (the loop
// blocks in the runtime poller instead).
func epollWaitRaw(epfd int, evs []unix.EpollEvent) (int, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(epfd), uintptr(unsafe.Pointer(&evs[0])), uintptr(len(evs)), 0, 0, 0)
	return int(r), errnoErr(e)
}

// epollCtlRaw is epoll_ctl(2).
func epollCtlRaw(epfd, op, fd int, ev *unix.EpollEvent) error {
	_, _, e := unix.RawSyscall6(unix.SYS_EPOLL_CTL, uintptr(epfd), uintptr(op), uintptr(fd), uintptr(unsafe.Pointer(ev)), 0, 0)
	return errnoErr(e)
}

// bindRaw is bind(2).
func bindRaw(fd int, sa *rawSockaddr) error {
	_, _, e := unix.RawSyscall(unix.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(&sa.sa)), uintptr(sa.len))
	return errnoErr(e)
}

// writeRaw is write(2).
func writeRaw(fd int, b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	r, _, e := unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	return int(r), errnoErr(e)
}

// accept4Raw is accept4(2) returning the peer's address.
func accept4Raw(fd, flags int) (int, netip.AddrPort, error) {
	var rsa unix.RawSockaddrAny
	l := uint32(unix.SizeofSockaddrAny)
	r, _, e := unix.RawSyscall6(unix.SYS_ACCEPT4, uintptr(fd), uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&l)), uintptr(flags), 0, 0)
	if e != 0 {
		return -1, netip.AddrPort{}, e
	}
	return int(r), rawAddrPort(&rsa), nil
}

// getsocknameRaw is getsockname(2).
func getsocknameRaw(fd int) (netip.AddrPort, error) {
	var rsa unix.RawSockaddrAny
	l := uint32(unix.SizeofSockaddrAny)
	_, _, e := unix.RawSyscall(unix.SYS_GETSOCKNAME, uintptr(fd), uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&l)))
	if e != 0 {
		return netip.AddrPort{}, e
	}
	return rawAddrPort(&rsa), nil
}

func rawAddrPort(rsa *unix.RawSockaddrAny) netip.AddrPort {
	switch rsa.Addr.Family {
	case unix.AF_INET:
		in := (*unix.RawSockaddrInet4)(unsafe.Pointer(rsa))
		p := (*[2]byte)(unsafe.Pointer(&in.Port))
		return netip.AddrPortFrom(netip.AddrFrom4(in.Addr), uint16(p[0])<<8|uint16(p[1]))
	case unix.AF_INET6:
		in := (*unix.RawSockaddrInet6)(unsafe.Pointer(rsa))
		p := (*[2]byte)(unsafe.Pointer(&in.Port))
		return netip.AddrPortFrom(netip.AddrFrom16(in.Addr), uint16(p[0])<<8|uint16(p[1]))
	}
	return netip.AddrPort{}
}

// rawSockaddr is a socket address in the kernel's layout, built once per backend.
type rawSockaddr struct {
	family int
	sa     unix.RawSockaddrInet6 // big enough for either family
	len    uint32
}

func newRawSockaddr(ap netip.AddrPort, zoneID uint32) rawSockaddr {
	var r rawSockaddr
	a := ap.Addr()
	port := ap.Port()
	if a.Is4() || a.Is4In6() {
		r.family = unix.AF_INET
		in := (*unix.RawSockaddrInet4)(unsafe.Pointer(&r.sa))
		in.Family = unix.AF_INET
		p := (*[2]byte)(unsafe.Pointer(&in.Port))
		p[0], p[1] = byte(port>>8), byte(port)
		in.Addr = a.Unmap().As4()
		r.len = unix.SizeofSockaddrInet4
		return r
	}
	r.family = unix.AF_INET6
	r.sa.Family = unix.AF_INET6
	p := (*[2]byte)(unsafe.Pointer(&r.sa.Port))
	p[0], p[1] = byte(port>>8), byte(port)
	r.sa.Addr = a.As16()
	r.sa.Scope_id = zoneID
	r.len = unix.SizeofSockaddrInet6
	return r
}

// connectRaw is connect(2).
func connectRaw(fd int, sa *rawSockaddr) error {
	_, _, e := unix.RawSyscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa.sa)), uintptr(sa.len))
	return errnoErr(e)
}
