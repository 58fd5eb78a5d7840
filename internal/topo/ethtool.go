package topo

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ethtoolValue is struct ethtool_value from <linux/ethtool.h>.
type ethtoolValue struct {
	cmd  uint32
	data uint32
}

// ifreqData is struct ifreq with the ifr_data member of the union in use;
// x/sys/unix keeps its own such type private.
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [24 - unsafe.Sizeof(uintptr(0))]byte
}

// ethtool runs one get/set-value SIOCETHTOOL command on ifname in the calling
// thread's network namespace (the socket decides which namespace's device the
// name refers to), so call it from NS.Do.
func ethtool(ifname string, cmd, data uint32) (uint32, error) {
	if len(ifname) >= unix.IFNAMSIZ {
		return 0, fmt.Errorf("ethtool %s: name too long", ifname)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("ethtool %s: socket: %w", ifname, err)
	}
	defer unix.Close(fd)

	v := ethtoolValue{cmd: cmd, data: data}
	var ifr ifreqData
	copy(ifr.name[:], ifname)
	ifr.data = unsafe.Pointer(&v)
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
	runtime.KeepAlive(&ifr)
	runtime.KeepAlive(&v)
	if errno != 0 {
		return 0, fmt.Errorf("ethtool %s: ioctl cmd %#x: %w", ifname, cmd, errno)
	}
	return v.data, nil
}

// SetTxChecksum is `ethtool -K ifname tx on|off`, in the calling thread's namespace. Turning it off also turns
// off TSO, which depends on it, so the stack hands the device (and any XDP
// program behind it) complete packets with complete checksums.
func SetTxChecksum(ifname string, on bool) error {
	var data uint32
	if on {
		data = 1
	}
	_, err := ethtool(ifname, unix.ETHTOOL_STXCSUM, data)
	return err
}

// txChecksum reports whether tx checksum offload is on for ifname.
func txChecksum(ifname string) (bool, error) {
	v, err := ethtool(ifname, unix.ETHTOOL_GTXCSUM, 0)
	return v != 0, err
}

// SetGRO is `ethtool -K ifname gro on|off`, in the calling thread's namespace: frames
// reach a veth's stack without an XDP program on it only with GRO on.
func SetGRO(ifname string, on bool) error {
	var data uint32
	if on {
		data = 1
	}
	_, err := ethtool(ifname, unix.ETHTOOL_SGRO, data)
	return err
}
