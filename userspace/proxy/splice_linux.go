package proxy

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// This file moves bytes with splice(2) through pooled pipes.
//
// Go's own splice path (TCPConn.ReadFrom) keeps one pipe pair per direction for as long
// as a copy is blocked waiting for the source: 2 pipes, 4 descriptors per connection on
// top of its 2 sockets. Here a direction waits for readability through the runtime
// poller without a pipe (RawConn.Read with a callback that reports EAGAIN), takes a pipe
// only once the source has bytes, and hands it back as soon as it is drained. An idle
// connection therefore costs its two sockets and nothing else.

const (
	// pipeSize is the capacity asked of each pipe (F_SETPIPE_SZ); a bigger pipe moves
	// more per splice call on bulk transfers. Go's net package uses the same size.
	pipeSize = 1 << 20
	// maxIdlePipes bounds the pool; pipes beyond it are closed when handed back.
	maxIdlePipes = 64
	spliceFlags  = unix.SPLICE_F_MOVE | unix.SPLICE_F_NONBLOCK
)

// pipe is one pipe pair; r and w are its read and write ends.
type pipe struct{ r, w int }

// pipePool keeps empty pipes for reuse. It is shared by every Service in the process.
type pipePool struct {
	mu   sync.Mutex
	free []*pipe
}

var pipes pipePool

// Package-level counters of the splice path, read by tests and Stats.
var (
	spliceCalls atomic.Uint64 // splice(2) calls that moved bytes (either half)
	splicedIn   atomic.Uint64 // bytes moved socket -> pipe
	pipesOpen   atomic.Int64  // pipes currently open (pooled or in use)
)

func (pp *pipePool) get() (*pipe, error) {
	pp.mu.Lock()
	if n := len(pp.free); n > 0 {
		p := pp.free[n-1]
		pp.free = pp.free[:n-1]
		pp.mu.Unlock()
		return p, nil
	}
	pp.mu.Unlock()
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, fmt.Errorf("pipe2: %w", err)
	}
	// Best effort: a smaller pipe still works, only with more calls per megabyte.
	_, _ = unix.FcntlInt(uintptr(fds[0]), unix.F_SETPIPE_SZ, pipeSize)
	pipesOpen.Add(1)
	return &pipe{r: fds[0], w: fds[1]}, nil
}

// put hands back an empty pipe.
func (pp *pipePool) put(p *pipe) {
	pp.mu.Lock()
	if len(pp.free) < maxIdlePipes {
		pp.free = append(pp.free, p)
		pp.mu.Unlock()
		return
	}
	pp.mu.Unlock()
	p.close()
}

// close releases a pipe that may still hold bytes (an aborted transfer).
func (p *pipe) close() {
	unix.Close(p.r)
	unix.Close(p.w)
	pipesOpen.Add(-1)
}

// errSourceClosed marks an error met reading the source (as opposed to writing dst),
// so the caller can tell which peer failed.
type copyError struct {
	read bool // the error came from the source side
	err  error
}

func (e *copyError) Error() string {
	if e.read {
		return "read: " + e.err.Error()
	}
	return "write: " + e.err.Error()
}

func (e *copyError) Unwrap() error { return e.err }

// spliceCopy moves bytes from src to dst until src reaches EOF (returning a nil error)
// or either side fails. progress is called after each chunk written, with its size.
// It neither closes nor half-closes anything: the caller does. An error from the
// poller (the socket was closed under it) is reported as net.ErrClosed.
func spliceCopy(dst, src syscall.RawConn, progress func(n int)) (int64, error) {
	var total int64
	for {
		var (
			p    *pipe
			n    int
			serr error
			perr error
		)
		err := src.Read(func(fd uintptr) bool {
			if p == nil {
				if p, perr = pipes.get(); perr != nil {
					return true
				}
			}
			for {
				n, serr = spliceRaw(int(fd), p.w, pipeSize, spliceFlags)
				if serr != unix.EINTR {
					break
				}
			}
			if serr == unix.EAGAIN {
				// Nothing to read: hand the pipe back before parking, so a waiting
				// connection holds no pipe.
				pipes.put(p)
				p = nil
				return false
			}
			return true
		})
		if perr != nil {
			return total, &copyError{read: true, err: perr}
		}
		if err != nil {
			err = net.ErrClosed
		} else {
			err = serr
		}
		if err != nil {
			if p != nil {
				pipes.put(p) // nothing was spliced into it
			}
			return total, &copyError{read: true, err: err}
		}
		if n == 0 {
			pipes.put(p)
			return total, nil // EOF
		}
		spliceCalls.Add(1)
		splicedIn.Add(uint64(n))
		for rem := n; rem > 0; {
			var m int
			var werr error
			err := dst.Write(func(fd uintptr) bool {
				for {
					m, werr = spliceOut(p.r, int(fd), rem, spliceFlags)
					if werr != unix.EINTR {
						break
					}
				}
				return werr != unix.EAGAIN
			})
			if err != nil {
				err = net.ErrClosed
			} else {
				err = werr
			}
			if err != nil {
				p.close() // it may still hold bytes
				return total, &copyError{err: err}
			}
			if m == 0 {
				p.close()
				return total, &copyError{err: errors.New("splice wrote 0 bytes")}
			}
			spliceCalls.Add(1)
			rem -= m
			total += int64(m)
			progress(m)
		}
		pipes.put(p)
	}
}
