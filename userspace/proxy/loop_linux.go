package proxy

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/userspace/acceptlog"
)

// This file is the proxy's engine: one event loop per listener.
//
// A loop owns its listener and every connection accepted from it. It keeps its own
// edge-triggered epoll set, holding both sockets of each connection, and drives every
// step of a connection from it: accept, the backend's connect, both directions, the
// timeouts and the close. It waits in the runtime poller: the epoll descriptor itself
// is registered there (os.NewFile, once per loop), so the loop parks like any
// goroutine blocked on a socket and no thread is held while nothing happens. Per
// connection this costs no goroutine, no channel, no timer and no os.File: two
// epoll_ctl calls register the sockets, and closing them deregisters them.
//
// Bytes move adaptively: a direction starts with read(2)/write(2) through the loop's
// scratch buffer (small messages: one copy each way, no pipe), and switches to
// splice(2) through a pooled pipe once a read fills the buffer (bulk). A connection
// holds memory only while bytes wait for a full socket: the unsent rest of a read
// (a pooled buffer) or of a splice (its pipe).
//
// Timeouts are two ordered lists per loop, one for connects in progress (deadline =
// start + ConnectTimeout) and one for established connections by their last activity
// (idle deadline = last + IdleTimeout); each is in deadline order because every entry
// of a list has the same duration, so a timeout costs a list move, not a timer. The
// loop checks both heads after each batch of events, and when it parks it sets the
// epoll file's read deadline to the earlier head, rounded up to timerTick.
//
// A loop that has not run dry for yieldAfter, while another loop of the process has
// events waiting, parks briefly (yield): loops wait in the runtime poller, which
// looks for ready ones only when a goroutine parks, so a loop that never runs dry
// would keep the others' connections waiting for as long as it stays busy.

const (
	scratchSize  = 64 << 10 // read buffer; a read that fills it marks the direction bulk
	smallSplice  = 4 << 10  // a splice this small turns a bulk direction back to read/write
	maxEvents    = 32       // events taken per epoll_wait
	acceptBatch  = 8        // connections accepted before other work gets a turn
	spliceBudget = 2 << 20  // bytes one direction moves per turn before others get one
	timerTick    = 5 * time.Millisecond
)

// Values of the epoll event data's first word (Fd) that are not connection slots.
const (
	evListener = -1
	evWake     = -2
)

// epollFlags is what every connection socket is registered for.
const epollFlags = unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET

// bufPool holds buffers for the unsent rest of a read.
var bufPool = sync.Pool{New: func() any { b := make([]byte, scratchSize); return &b }}

// Package-level counters of the copy path (read/write), next to the splice
// counters, and of the connections whose first bytes were read before the dial.
var copiedBytes, earlyReads atomic.Uint64

type loop struct {
	s    *Service
	ln   *listener // nil once closed
	epfd int
	ep   *os.File // epfd registered with the runtime poller
	eprc syscall.RawConn
	wake int // eventfd: another goroutine has a command for the loop

	cmdMu  sync.Mutex
	cmds   []func()
	woken  bool // the eventfd has been written and not yet read
	exited bool // run has returned: do refuses commands

	conns []*conn // by slot; a slot's conn is reused by the next connection
	free  []int32 // free slots

	connecting tlist // connects in progress, by deadline
	idle       tlist // established connections, by last activity
	again      []connRef
	flushing   []connRef // redirected connections at EOF, waiting for the kernel to forward the rest; lingering ones (linger)
	flushAt    int64     // when to check them next
	flushDelay int64
	scratch    []byte
	events     []unix.EpollEvent

	now           int64 // monotonic ns, read once per batch
	armed         int64 // deadline set on ep; 0 none, -1 unknown
	acceptMore    bool  // the listener may hold more connections
	acceptRetryAt int64 // after an accept error, accept again at this time; 0 = now
	backoff       time.Duration
	acceptLog     acceptlog.Log // logs the errors backed off on
	paused        atomic.Bool   // waiting for a MaxConns slot
	quit          bool
	resumed       int64 // monotonic ns when the loop last came back from parking or yielding

	// poll is the callback wait hands the runtime poller, made once: a closure
	// made per wait escapes, with the variables it sets, and those allocations
	// (a few MB a second under load) were the only ones left in the loop, paying
	// for a collection a second. Its inputs and results live here.
	poll       func(fd uintptr) bool
	pollBusy   bool
	pollN      int
	pollErr    error
	pollParked bool
}

// connRef names a connection in a slot, so a stale reference (the slot was reused)
// is recognised.
type connRef struct {
	c   *conn
	gen uint32
}

func newLoop(s *Service, ln *listener) (*loop, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	// Non-blocking, so os.NewFile registers it with the runtime poller.
	if err := unix.SetNonblock(epfd, true); err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("epoll: set non-blocking: %w", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	l := &loop{s: s, ln: ln, epfd: epfd, wake: wake, scratch: make([]byte, scratchSize),
		events: make([]unix.EpollEvent, maxEvents), armed: -1}
	l.poll = l.pollOnce
	l.ep = os.NewFile(uintptr(epfd), "epoll")
	if l.eprc, err = l.ep.SyscallConn(); err == nil {
		err = unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wake, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: evWake})
	}
	ln.mu.Lock()
	if err == nil && !ln.bound { // else Join adds it (watch) once it listens
		err = unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, ln.fd, &unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLET, Fd: evListener})
	}
	ln.mu.Unlock()
	if err != nil {
		l.ep.Close()
		unix.Close(wake)
		return nil, fmt.Errorf("event loop: %w", err)
	}
	return l, nil
}

// do runs f on the loop's goroutine, soon. It reports false if the loop has ended
// (f then never runs).
func (l *loop) do(f func()) bool {
	l.cmdMu.Lock()
	if l.exited {
		l.cmdMu.Unlock()
		return false
	}
	l.cmds = append(l.cmds, f)
	if !l.woken {
		// Under the lock: shutdown closes the eventfd only after taking it.
		one := [8]byte{1}
		writeRaw(l.wake, one[:])
		l.woken = true
	}
	l.cmdMu.Unlock()
	return true
}

func (l *loop) runCommands() {
	var b [8]byte
	readRaw(l.wake, b[:])
	l.cmdMu.Lock()
	cmds := l.cmds
	l.cmds = nil
	l.woken = false
	l.cmdMu.Unlock()
	for _, f := range cmds {
		f()
	}
}

// run serves until a command sets quit. On return every connection of the loop is
// closed, and so are its listener, epoll set and eventfd.
func (l *loop) run() error {
	defer l.shutdown()
	defer l.running()()
	l.resumed = monotonic()
	for !l.quit {
		n, err := l.wait()
		if err != nil {
			return err
		}
		l.now = monotonic()
		for i := range n {
			ev := &l.events[i]
			switch ev.Fd {
			case evListener:
				l.acceptMore = true
			case evWake:
				l.runCommands()
			default:
				c := l.conns[ev.Fd]
				if c.gen<<1 != uint32(ev.Pad)&^1 {
					continue // closed earlier in this batch
				}
				l.event(c, int(ev.Pad&1), ev.Events)
			}
		}
		if l.acceptMore && l.acceptRetryAt <= l.now && !l.paused.Load() {
			l.accept()
		}
		if len(l.again) > 0 {
			again := l.again
			l.again = nil
			for _, r := range again {
				if r.c.gen == r.gen && r.c.state == stateEstablished {
					l.pumpBoth(r.c)
				}
			}
		}
		l.recheck()
		l.expire()
		if l.now-l.resumed > int64(yieldAfter) && l.siblingsWaiting() {
			l.yield()
		}
	}
	return nil
}

// yieldAfter is how long a loop runs without parking before it lets the other
// loops with events have a turn.
const yieldAfter = 200 * time.Microsecond

// siblingsWaiting reports whether another running loop of the process has events
// waiting. (Yielding only when loops outnumber the Ps was measured and is not
// enough: with a P per loop, on CPUs shared with other processes, keep-alive p99
// stayed at 25-45 ms.)
func (l *loop) siblingsWaiting() bool {
	epfds := runningLoops.epfds.Load()
	if epfds == nil || len(*epfds) < 2 {
		return false
	}
	var fds [64]unix.PollFd
	n := 0
	for _, fd := range *epfds {
		if fd != l.epfd && n < len(fds) {
			fds[n] = unix.PollFd{Fd: int32(fd), Events: unix.POLLIN}
			n++
		}
	}
	r, _, e := unix.RawSyscall(unix.SYS_POLL, uintptr(unsafe.Pointer(&fds[0])), uintptr(n), 0)
	return e == 0 && r > 0
}

// runningLoops is the epoll sets of every loop running in the process, of every
// service: they all share the Ps.
var runningLoops struct {
	mu    sync.Mutex
	epfds atomic.Pointer[[]int] // replaced, never changed in place
}

// running adds the loop's epoll set to runningLoops until the returned func is
// called, which must be before the set is closed.
func (l *loop) running() func() {
	edit := func(f func([]int) []int) {
		runningLoops.mu.Lock()
		defer runningLoops.mu.Unlock()
		var cur []int
		if p := runningLoops.epfds.Load(); p != nil {
			cur = *p
		}
		next := f(slices.Clone(cur))
		runningLoops.epfds.Store(&next)
	}
	edit(func(fds []int) []int { return append(fds, l.epfd) })
	return func() {
		edit(func(fds []int) []int { return slices.DeleteFunc(fds, func(fd int) bool { return fd == l.epfd }) })
	}
}

// yield parks the loop briefly on a timer, so the scheduler polls the network and
// runs the sibling loops that have events (runtime.Gosched would put this loop
// straight back: the run queue is looked at before the poller).
func (l *loop) yield() {
	time.Sleep(20 * time.Microsecond)
	l.resumed = monotonic()
}

// wait returns the next batch of events, parking in the runtime poller while there
// are none and no work is pending. It returns 0 events when a timer is due.
func (l *loop) wait() (int, error) {
	l.arm()
	l.pollBusy = len(l.again) > 0 || (l.acceptMore && l.acceptRetryAt <= l.now && !l.paused.Load())
	l.pollN, l.pollErr, l.pollParked = 0, nil, false
	err := l.eprc.Read(l.poll)
	n, werr := l.pollN, l.pollErr
	if l.pollParked {
		l.resumed = monotonic()
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		l.armed = -1 // an expired deadline fails every wait until it is set again
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("event loop: wait: %w", err)
	}
	if werr != nil {
		return 0, fmt.Errorf("event loop: epoll_wait: %w", werr)
	}
	return n, nil
}

// pollOnce is l.poll: one epoll_wait that does not block; it reports false (park in
// the runtime poller until the epoll file is readable) when it found nothing and no
// work is pending.
func (l *loop) pollOnce(fd uintptr) bool {
	n, err := epollWaitRaw(int(fd), l.events)
	if err == unix.EINTR {
		l.pollN, l.pollErr = 0, nil
		return true
	}
	l.pollN, l.pollErr = n, err
	done := n > 0 || err != nil || l.pollBusy
	l.pollParked = l.pollParked || !done
	return done
}

// arm sets the epoll file's read deadline to the next timeout, if it changed.
func (l *loop) arm() {
	var next int64
	if c := l.connecting.head; c != nil {
		next = c.deadline
	}
	if c := l.idle.head; c != nil {
		if d := c.last + int64(l.s.cfg.IdleTimeout); next == 0 || d < next {
			next = d
		}
	}
	// A paused loop accepts nothing until a slot frees, which wakes it: a
	// back-off's time, past by then, would wake it at once, over and over.
	if l.acceptMore && l.acceptRetryAt > 0 && !l.paused.Load() && (next == 0 || l.acceptRetryAt < next) {
		next = l.acceptRetryAt
	}
	if next != 0 {
		tick := int64(timerTick)
		next = (next + tick - 1) / tick * tick
	}
	if len(l.flushing) > 0 && (next == 0 || l.flushAt < next) {
		next = l.flushAt // not rounded: a FIN waits for it
	}
	if next == l.armed {
		return
	}
	l.armed = next
	if next == 0 {
		l.ep.SetReadDeadline(time.Time{})
		return
	}
	l.ep.SetReadDeadline(epoch.Add(time.Duration(next)))
}

// expire handles the connect and idle timeouts that are due.
func (l *loop) expire() {
	now := monotonic()
	for c := l.connecting.head; c != nil && c.deadline <= now; c = l.connecting.head {
		l.connectFailed(c, fmt.Errorf("connect: %w", os.ErrDeadlineExceeded))
	}
	if d := int64(l.s.cfg.IdleTimeout); d > 0 {
		for c := l.idle.head; c != nil && c.last+d <= now; c = l.idle.head {
			if c.redirected && !c.h[up].discard && l.kernelActive(c) {
				c.last = now
				l.idle.remove(c)
				l.idle.push(c)
				continue
			}
			if c.h[up].discard {
				// Lingering: the backend's stream was whole, and it has gone.
				l.close(c, OutcomeSuccess)
				continue
			}
			l.close(c, OutcomeIdleTimeout)
		}
	}
}

// accept takes connections from the listener until it is empty, the batch is used,
// the service is at MaxConns, or an error makes it back off.
func (l *loop) accept() {
	s := l.s
	for range acceptBatch {
		if l.ln == nil {
			l.acceptMore = false
			return
		}
		if !s.takeSlot(l) {
			return // resumed by a released slot
		}
		fd, src, err := accept4Raw(l.ln.fd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		for err == unix.EINTR || err == unix.ECONNABORTED {
			fd, src, err = accept4Raw(l.ln.fd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		}
		if err != nil {
			s.releaseSlot()
			if err == unix.EAGAIN {
				l.acceptMore = false
				l.backoff = 0
				l.acceptRetryAt = 0
				l.acceptLog.OK(s.log, time.Now)
				return
			}
			// Out of descriptors or memory: back off and go on, as a listener must
			// not die of load.
			if l.backoff == 0 {
				l.backoff = 5 * time.Millisecond
			} else if l.backoff *= 2; l.backoff > time.Second {
				l.backoff = time.Second
			}
			l.acceptRetryAt = monotonic() + int64(l.backoff)
			s.stats.acceptErrors.Add(1)
			l.acceptLog.Failed(s.log, time.Now(), fmt.Errorf("accept4: %w", err), l.backoff)
			return
		}
		l.acceptRetryAt = 0
		l.acceptLog.OK(s.log, time.Now)
		l.newConn(fd, src)
	}
}

// watch adds the loop's listener, which has just begun to listen (Join), to
// its epoll set; nothing if it has stopped accepting.
func (l *loop) watch(ln *listener) {
	if l.ln != ln {
		return
	}
	if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, ln.fd, &unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLET, Fd: evListener}); err != nil {
		l.s.log.Warn("a listening socket serves no connection", "err", fmt.Errorf("epoll_ctl: %w", err))
		return
	}
	l.acceptMore = true
}

// stopAccepting closes the listener; connections already accepted go on. The
// socket lives on if a service that replaced this one took it over
// (ListenFrom): it leaves the epoll set first, so its next connections, the
// new service's, do not wake this loop.
func (l *loop) stopAccepting() {
	if l.ln != nil {
		epollCtlRaw(l.epfd, unix.EPOLL_CTL_DEL, l.ln.fd, &unix.EpollEvent{})
		l.ln.close()
		l.ln = nil
	}
	l.acceptMore = false
	l.paused.Store(false)
}

// kill closes the connections to b, established or still connecting (a dial the
// drain's deadline finds unfinished would otherwise outlive it), or every
// connection if b is nil, and returns how many.
func (l *loop) kill(b *backend) int {
	n := 0
	for _, c := range l.conns {
		if c.state == stateFree || (b != nil && c.b != b) {
			continue
		}
		c.killed = true
		l.close(c, OutcomeSuccess)
		n++
	}
	return n
}

// shutdown ends the loop: it closes what is left and refuses further commands (those
// already queued run, seeing no connection).
func (l *loop) shutdown() {
	l.kill(nil)
	l.stopAccepting()
	l.cmdMu.Lock()
	l.exited = true
	cmds := l.cmds
	l.cmds = nil
	l.cmdMu.Unlock()
	for _, f := range cmds {
		f()
	}
	l.ep.Close()
	unix.Close(l.wake)
}

// register adds a connection socket to the epoll set.
func (l *loop) register(c *conn, side int) error {
	ev := unix.EpollEvent{Events: epollFlags, Fd: c.slot, Pad: int32(c.gen<<1) | int32(side)}
	if err := epollCtlRaw(l.epfd, unix.EPOLL_CTL_ADD, c.fd[side], &ev); err != nil {
		return fmt.Errorf("epoll_ctl: %w", err)
	}
	return nil
}

// tlist is a doubly linked list of connections in deadline order.
type tlist struct{ head, tail *conn }

func (q *tlist) push(c *conn) {
	c.tq = q
	c.tprev, c.tnext = q.tail, nil
	if q.tail != nil {
		q.tail.tnext = c
	} else {
		q.head = c
	}
	q.tail = c
}

func (q *tlist) remove(c *conn) {
	if c.tprev != nil {
		c.tprev.tnext = c.tnext
	} else {
		q.head = c.tnext
	}
	if c.tnext != nil {
		c.tnext.tprev = c.tprev
	} else {
		q.tail = c.tprev
	}
	c.tprev, c.tnext, c.tq = nil, nil, nil
}
