package proxy

import (
	"fmt"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// This file pools the pipes that bulk directions splice(2) through.
//
// Go's own splice path (TCPConn.ReadFrom) keeps one pipe pair per direction for as long
// as a copy is blocked waiting for the source: 2 pipes, 4 descriptors per connection on
// top of its 2 sockets. Here a bulk direction takes a pipe only once its source has
// bytes, and hands it back as soon as it is drained (see pump). An idle connection
// therefore costs its two sockets and nothing else.

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
