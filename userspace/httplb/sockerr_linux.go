package httplb

import (
	"net"
	"os"
	"syscall"
)

// sockFailure is op's error on c, from the poller (err) or the system call
// (errno) of a read or write made through c's RawConn, wrapped as net.Conn's
// methods wrap theirs, so callers' checks (timeouts, net.ErrClosed) see what
// they would see from the connection itself; nil if neither failed.
func sockFailure(c net.Conn, op string, err error, errno syscall.Errno) error {
	switch {
	case err != nil:
		if oe, ok := err.(*net.OpError); ok { // the raw connection's own ("raw-read")
			err = oe.Err
		}
	case errno != 0:
		err = os.NewSyscallError(op, errno)
	default:
		return nil
	}
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}
