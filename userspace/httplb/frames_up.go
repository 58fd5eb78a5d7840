package httplb

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// upPool is a backend's HTTP/2 connections for the frame engine: a request
// goes on the first connection with a free stream, and a new connection is
// dialled when none has one.
type upPool struct {
	s  *Service
	be *backend

	idleFor time.Duration // upIdleTimeout when the pool was made

	mu    sync.Mutex
	conns []*upconn
	// limit is the streams per connection the backend last allowed: what a new
	// connection is taken to allow until its SETTINGS come.
	limit int
}

// frames returns the backend's pool for the frame engine, made on first use.
func (b *backend) frames(s *Service) *upPool {
	if p := b.fpool.Load(); p != nil {
		return p
	}
	b.fpool.CompareAndSwap(nil, &upPool{s: s, be: b, idleFor: upIdleTimeout})
	return b.fpool.Load()
}

// upconn is one HTTP/2 connection to a backend. Its mutex guards its state,
// its framer's writes, and the upstream-side windows of its streams (upSend,
// upOwed); a stream's other state is its client session's.
type upconn struct {
	pool *upPool
	conn *coalescingConn
	fr   *http2.Framer
	br   *blockReader

	mu         sync.Mutex
	enc        *hpack.Encoder
	encBuf     bytes.Buffer
	ready      bool // connected; the preface is out
	waiting    []*fstream
	streams    map[uint32]*fstream
	nextID     uint32
	maxStreams int
	sendWin    int64
	initWin    int64
	maxFrame   uint32
	credit     int64
	recvWin    int64 // the backend's connection window for its DATA
	idle       *time.Timer
	idleSince  int64      // nanotime when the last stream ended
	blocked    []*fstream // waiting for the connection's window
	away       bool       // no new streams (GOAWAY, failure, pool closed)
	goneAway   bool       // weir has sent its GOAWAY: it sends no other
	dead       bool
	// recent is the streams closed last, and how: what the backend sends on
	// them after is answered by it (closedStreams.late).
	recent closedStreams
	// unreset is the streams the backend ended while weir's request was
	// still being sent (endedByPeer): weir sends no more of the request and
	// owes each one RST_STREAM (resetEndedLocked), unless the backend
	// resets it first. Until then each counts against the backend's
	// limit on streams (open).
	unreset map[uint32]struct{}
}

// open sends st's request over one of the pool's connections; st's session
// mutex is held. It reports false, and does nothing, when the backend is
// retired and no connection can take st: a retired backend's requests in
// flight finish on the connections it has, and it gets no new one.
func (p *upPool) open(st *fstream) bool {
	p.mu.Lock()
	var uc *upconn
	for _, c := range p.conns {
		c.mu.Lock()
		// A stream the backend ended before weir's request did counts
		// there until weir resets it (RFC 9113 5.1.2).
		free := !c.away && len(c.streams)+len(c.waiting)+len(c.unreset) < c.maxStreams
		c.mu.Unlock()
		if free {
			uc = c
			break
		}
	}
	if uc == nil {
		if p.be.retired.Load() {
			p.mu.Unlock()
			return false
		}
		if p.limit == 0 {
			p.limit = 100 // as net/http's transport assumes
		}
		uc = &upconn{pool: p, streams: map[uint32]*fstream{}, nextID: 1, maxStreams: p.limit, sendWin: 65535, initWin: 65535,
			maxFrame: defaultMaxFrame, recvWin: recvConnWin}
		uc.enc = hpack.NewEncoder(&uc.encBuf)
		p.conns = append(p.conns, uc)
		// Exits when the connection fails or closes.
		go uc.dial()
	}
	st.up, st.upID = uc, 0
	st.upDone = false
	// Still under the pool's lock, so fail (which drops uc from the pool
	// first) cannot come between the choice and the queueing.
	uc.mu.Lock()
	p.mu.Unlock()
	if !uc.ready {
		uc.waiting = append(uc.waiting, st)
		uc.mu.Unlock()
		return true
	}
	uc.mu.Unlock()
	uc.start(st)
	return true
}

// start writes st's request headers (and what of its body the windows allow),
// taking st out of waiting if it was there (dial); st's session mutex is held.
func (uc *upconn) start(st *fstream) {
	uc.mu.Lock()
	if i := slices.Index(uc.waiting, st); i >= 0 {
		uc.waiting = slices.Delete(uc.waiting, i, i+1)
	}
	if uc.dead || uc.away {
		uc.mu.Unlock()
		st.upDone = true
		st.upstreamReset(http2.ErrCodeRefusedStream, nil, true)
		return
	}
	id := uc.nextID
	uc.nextID += 2
	uc.streams[id] = st
	st.upID = id
	st.upSend = int64(uc.initWin)
	st.upOwed = 0
	st.upRecv = recvStreamWin
	end := st.reqEnded && len(st.reqQ) == 0 && len(st.resend) == 0 && st.reqTr == nil
	st.reqEndSent = end
	err := writeHeaders(uc.fr, uc.enc, &uc.encBuf, uc.maxFrame, id, end, st.hdrs)
	uc.mu.Unlock()
	if err != nil {
		return // the reader fails the stream with the connection
	}
	if !end {
		uc.sendBody(st)
	}
}

// sendBody writes st's queued body as the windows allow: first what a failed
// try had sent (credited to the client then), then what came since; st's
// session mutex is held.
func (uc *upconn) sendBody(st *fstream) {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	if uc.streams[st.upID] != st {
		return
	}
	if !uc.sendQueue(st, &st.resend, false) || !uc.sendQueue(st, &st.reqQ, true) {
		return
	}
	if st.reqEnded && !st.reqEndSent {
		st.reqEndSent = true
		if st.reqTr != nil {
			writeHeaders(uc.fr, uc.enc, &uc.encBuf, uc.maxFrame, st.upID, true, st.reqTr)
		} else {
			uc.conn.queueData(st.upID, true, nil)
		}
	}
}

// sendQueue writes q's chunks as the windows allow, crediting the client for
// them if credit; it reports whether q went out whole. The request's END_STREAM
// goes with its last chunk.
func (uc *upconn) sendQueue(st *fstream, q *[][]byte, credit bool) bool {
	for len(*q) > 0 {
		b := (*q)[0]
		n := min(int64(len(b)), st.upSend, uc.sendWin, int64(uc.maxFrame))
		if n <= 0 || !uc.conn.room() {
			if (n > 0 || uc.sendWin <= 0) && slices.Index(uc.blocked, st) < 0 {
				// Woken by the connection's window or its socket.
				uc.blocked = append(uc.blocked, st)
			}
			return false
		}
		last := n == int64(len(b)) && len(*q) == 1 && credit && st.reqEnded && st.reqTr == nil
		uc.conn.queueData(st.upID, last, b[:n])
		st.upSend -= n
		uc.sendWin -= n
		st.sentBody = true
		if st.replayOK && st.replayN+int(n) <= replayLimit {
			st.replay = append(st.replay, bytes.Clone(b[:n])) // b may be the framer's buffer
			st.replayN += int(n)
		} else {
			st.replayOK = false
		}
		if n == int64(len(b)) {
			*q = (*q)[1:]
		} else {
			(*q)[0] = b[n:]
		}
		if credit {
			st.sess.oweStream(st, n)
		}
		if last {
			st.reqEndSent = true
		}
	}
	return true
}

// oweStream returns st's credit for n bytes of its answer that went to the
// client (the connection's went back when they came); st's session mutex is
// held.
func (uc *upconn) oweStream(st *fstream, n int64) {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	if uc.streams[st.upID] != st {
		return
	}
	grant(uc.fr, st.upID, &st.upOwed, &st.upRecv, n)
}

func (uc *upconn) oweLocked(n int64) { grant(uc.fr, 0, &uc.credit, &uc.recvWin, n) }

// resetStream closes a stream the backend has answered whole but whose
// request had not ended, unless it is closed already.
func (uc *upconn) resetStream(id uint32) {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	uc.resetEndedLocked(id, http2.ErrCodeCancel)
}

// resetEndedLocked sends the RST_STREAM weir owes a stream the backend ended
// while the request was being sent, once: not after the backend's reset or
// weir's own. mu is held.
func (uc *upconn) resetEndedLocked(id uint32, code http2.ErrCode) {
	if _, ok := uc.unreset[id]; !ok || uc.dead {
		return
	}
	delete(uc.unreset, id)
	uc.recent.weReset(id)
	uc.fr.WriteRSTStream(id, code)
}

// cancel resets st's stream on the backend; st's session mutex is held. A
// stream the backend has ended while weir's request was still being sent is
// reset too: weir sends no more of the request, and the backend would keep
// the stream open, counting against its stream limit (RFC 9113 5.1.2).
func (uc *upconn) cancel(st *fstream) {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	if i := slices.Index(uc.waiting, st); i >= 0 {
		uc.waiting = append(uc.waiting[:i], uc.waiting[i+1:]...)
		return
	}
	switch {
	case st.upID == 0:
	case uc.streams[st.upID] == st:
		delete(uc.streams, st.upID)
		uc.recent.note(st.upID, resetByUs)
		uc.fr.WriteRSTStream(st.upID, http2.ErrCodeCancel)
		uc.idleCheckLocked()
	default:
		uc.resetEndedLocked(st.upID, http2.ErrCodeCancel)
	}
}

// forget drops st, whose answer the backend has sent whole.
func (uc *upconn) forget(st *fstream) {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	if st.upID != 0 && uc.streams[st.upID] == st {
		delete(uc.streams, st.upID)
		uc.idleCheckLocked()
	}
}

// idleCheckLocked closes a connection that may take no more streams once its
// last has ended. A retired backend's take none: closeIdle closes those idle
// when it is retired, and the others close here as their last stream ends,
// also one made since (for a request that picked the backend just before);
// a backend configured again first keeps them.
func (uc *upconn) idleCheckLocked() {
	if len(uc.streams) > 0 || len(uc.waiting) > 0 || uc.conn == nil || uc.dead {
		return
	}
	if uc.pool.be.retired.Load() {
		uc.away = true
	}
	if uc.away {
		uc.closeIdleLocked()
		return
	}
	// A clock read, not a timer reset, each time the connection goes idle: one
	// timer per connection checks (idleExpired).
	uc.idleSince = nanotime()
	if uc.idle == nil {
		uc.idle = time.AfterFunc(uc.pool.idleFor, uc.idleExpired)
	}
}

// upIdleTimeout closes a backend connection that carried no stream this long,
// as http.Transport's IdleConnTimeout does (a variable for the tests).
var upIdleTimeout = 90 * time.Second

func (uc *upconn) idleExpired() {
	uc.pool.mu.Lock() // the pool's lock comes first
	uc.mu.Lock()
	idle := len(uc.streams) == 0 && len(uc.waiting) == 0 && !uc.away
	if left := uc.pool.idleFor - time.Duration(nanotime()-uc.idleSince); idle && left > 0 {
		idle = false
		uc.idle.Reset(left)
	} else if !idle && !uc.away {
		uc.idle.Reset(uc.pool.idleFor)
	}
	if idle {
		uc.away = true
		if i := slices.Index(uc.pool.conns, uc); i >= 0 {
			uc.pool.conns = append(uc.pool.conns[:i], uc.pool.conns[i+1:]...)
		}
		uc.closeIdleLocked()
	}
	uc.mu.Unlock()
	uc.pool.mu.Unlock()
}

// closeIdleLocked closes a connection with no stream left, GOAWAY NO_ERROR
// first (RFC 9113 6.8: the backend sees an orderly end, not a bare FIN); the
// socket sends what was queued before it closes. mu is held.
func (uc *upconn) closeIdleLocked() {
	uc.goAwayLocked(http2.ErrCodeNo, nil)
	uc.conn.Close()
}

// goAwayLocked sends GOAWAY unless weir has sent one already: a connection
// ended for the backend's protocol error, then idle once a client cancels
// its last stream, tells the backend why once, not a second time with
// NO_ERROR. mu is held.
func (uc *upconn) goAwayLocked(code http2.ErrCode, debug []byte) {
	if uc.goneAway {
		return
	}
	uc.goneAway = true
	uc.fr.WriteGoAway(0, code, debug)
}

// dial connects, then reads the backend's frames until the connection fails.
func (uc *upconn) dial() {
	s := uc.pool.s
	be := uc.pool.be
	d := s.dialer()
	c, err := d.DialContext(context.Background(), "tcp", be.id)
	if err != nil {
		uc.fail(&dialError{err})
		return
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	cc := newCoalescingConn(c, true)
	uc.mu.Lock()
	uc.conn = cc
	uc.fr = http2.NewFramer(queueWriter{cc}, bufio.NewReaderSize(cc, frameReadBuf))
	uc.fr.SetMaxReadFrameSize(defaultMaxFrame) // as the client's (see serveFrames)
	cc.onDrain = uc.drained
	uc.br = newBlockReader(uc.fr, uint32(max(s.cfg.MaxHeaderBytes, 64<<10)))
	cc.queue([]byte(http2.ClientPreface))
	uc.fr.WriteSettings(http2.Setting{ID: http2.SettingEnablePush, Val: 0},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: recvStreamWin},
		http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: uc.br.max})
	uc.fr.WriteWindowUpdate(0, recvConnWin-65535)
	uc.ready = true
	// Each stays in waiting until start takes it out, so the connection is
	// not idle (idleCheckLocked) before the streams it was dialled for are
	// under way: a retirement meanwhile would close it under them.
	waiting := slices.Clone(uc.waiting)
	uc.mu.Unlock()
	for _, st := range waiting {
		st.sess.mu.Lock()
		if st.up == uc && !st.finished {
			uc.start(st)
		}
		st.sess.mu.Unlock()
	}
	// With no stream (those it was dialled for cancelled meanwhile), it
	// closes now (away, or its backend retired) or when idle too long.
	uc.mu.Lock()
	uc.waiting = nil
	uc.idleCheckLocked()
	uc.mu.Unlock()
	err = uc.read()
	if werr := cc.writeErr(); errors.Is(werr, syscall.ETIMEDOUT) && !errors.Is(err, syscall.ETIMEDOUT) {
		// The writer, waiting on the socket beside the read (a body
		// uploading), heard of the user timeout first: the read saw
		// only the socket closed.
		err = werr
	}
	uc.fail(err)
}

// read handles the backend's frames until the connection fails.
func (uc *upconn) read() error {
	for {
		f, hb, err := uc.br.read()
		if hb != nil && err == nil {
			uc.mu.Lock()
			st := uc.lookupLocked(hb.id, hb.end)
			uc.mu.Unlock()
			if st == nil {
				if err := uc.notOpen(hb.id, "HEADERS"); err != nil {
					return err
				}
				continue
			}
			uc.withStream(st, func() { st.respHeaders(hb) })
			continue
		}
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				if st := uc.take(se.StreamID, resetByUs, se.Code); st != nil {
					uc.withStream(st, func() { st.upDone = true; st.upstreamReset(se.Code, nil, false) })
				} else if hb != nil {
					// A malformed header block on a stream not open: the
					// rules of any HEADERS there.
					if err := uc.notOpen(se.StreamID, "HEADERS"); err != nil {
						return err
					}
				} else if se.Cause == errPriorityLength {
					// On a closed stream, reset all the same; on one
					// never opened, where no RST_STREAM may go, dropped
					// as a sound PRIORITY there is.
					uc.mu.Lock()
					if !uc.idleLocked(se.StreamID) {
						uc.fr.WriteRSTStream(se.StreamID, se.Code)
					}
					uc.mu.Unlock()
				} else if uc.neverOpened(se.StreamID) {
					// The framer's stream error (a WINDOW_UPDATE of 0) on a
					// stream weir never opened: a frame there is a
					// connection error before it is anything else (RFC 9113
					// 5.1). On a closed stream it is dropped, as a valid
					// WINDOW_UPDATE there is.
					return uc.goAway(http2.ErrCodeProtocol, "the backend sent a WINDOW_UPDATE of 0 on a stream weir never opened")
				}
				continue
			}
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				return uc.goAway(http2.ErrCode(ce), "the backend broke the protocol")
			}
			if err == http2.ErrFrameTooLarge {
				return uc.goAway(http2.ErrCodeFrameSize, "the backend sent a frame larger than weir allows")
			}
			return err
		}
		switch f := f.(type) {
		case *http2.DataFrame:
			n := int64(f.Length)
			end := f.StreamEnded()
			uc.mu.Lock()
			uc.recvWin -= n
			overrun := uc.recvWin < 0
			uc.oweLocked(n) // the connection's credit goes back at once (see frames.go)
			st := uc.streams[f.StreamID]
			streamOverrun := false
			if st != nil {
				st.upRecv -= n
				streamOverrun = st.upRecv < 0
			}
			if streamOverrun {
				// Past the window weir gave: what it sent would queue
				// without bound for a client that reads slowly. The
				// stream is closed by weir's reset, END_STREAM or not:
				// the frame is an error, not the answer's end, and what
				// follows on the stream is ignored (RFC 9113 5.1).
				delete(uc.streams, f.StreamID)
				uc.recent.note(f.StreamID, resetByUs)
				uc.fr.WriteRSTStream(f.StreamID, http2.ErrCodeFlowControl)
				uc.idleCheckLocked()
			} else if end {
				uc.lookupLocked(f.StreamID, true)
			}
			uc.mu.Unlock()
			if overrun {
				return errors.New("the backend overran its connection window")
			}
			if st == nil {
				if err := uc.notOpen(f.StreamID, "DATA"); err != nil {
					return err
				}
				continue
			}
			if streamOverrun {
				uc.withStream(st, func() { st.upDone = true; st.upstreamReset(http2.ErrCodeFlowControl, nil, false) })
				continue
			}
			data := f.Data() // copied by respData if it must wait
			uc.withStream(st, func() {
				if st.status == 0 {
					// DATA before the final headers.
					uc.cancel(st)
					st.upstreamReset(http2.ErrCodeProtocol, nil, false)
					return
				}
				if pad := n - int64(len(data)); pad > 0 {
					uc.oweStream(st, pad)
				}
				if end {
					st.upDone = true
				}
				st.respData(data, end)
			})
		case *http2.WindowUpdateFrame:
			var wake []*fstream
			var overflow *fstream
			uc.mu.Lock()
			if f.StreamID == 0 {
				uc.sendWin += int64(f.Increment)
				if uc.sendWin > maxWindow {
					uc.mu.Unlock()
					return uc.goAway(http2.ErrCodeFlowControl, "the backend's connection window overflowed")
				}
				wake, uc.blocked = uc.blocked, nil
			} else if uc.idleLocked(f.StreamID) {
				uc.mu.Unlock()
				return uc.goAway(http2.ErrCodeProtocol, "the backend sent WINDOW_UPDATE on a stream weir never opened")
			} else if st := uc.streams[f.StreamID]; st != nil {
				st.upSend += int64(f.Increment)
				if st.upSend > maxWindow {
					overflow = st
				} else {
					wake = []*fstream{st}
				}
			}
			uc.mu.Unlock()
			if overflow != nil {
				uc.resetOverflow(overflow, f.StreamID)
			}
			for _, st := range wake {
				uc.withStream(st, st.flushReq)
			}
		case *http2.SettingsFrame:
			if f.IsAck() {
				continue
			}
			// A frame size or window out of range would have the writers
			// below loop on empty frames or overrun the backend's window.
			if err := f.ForeachSetting(func(s http2.Setting) error { return s.Valid() }); err != nil {
				code := http2.ErrCodeProtocol
				if ce, ok := err.(http2.ConnectionError); ok {
					code = http2.ErrCode(ce)
				}
				return uc.goAway(code, "the backend sent an invalid setting: "+err.Error())
			}
			uc.mu.Lock()
			var wake []*fstream
			limit := -1
			var overflow bool
			f.ForeachSetting(func(s http2.Setting) error {
				switch s.ID {
				case http2.SettingMaxConcurrentStreams:
					uc.maxStreams = int(s.Val)
					limit = int(s.Val)
				case http2.SettingInitialWindowSize:
					d := int64(s.Val) - uc.initWin
					uc.initWin = int64(s.Val)
					for _, st := range uc.streams {
						st.upSend += d
						overflow = overflow || st.upSend > maxWindow
						wake = append(wake, st)
					}
				case http2.SettingMaxFrameSize:
					uc.maxFrame = s.Val
				case http2.SettingHeaderTableSize:
					uc.enc.SetMaxDynamicTableSizeLimit(s.Val)
				}
				return nil
			})
			if overflow {
				uc.mu.Unlock()
				return uc.goAway(http2.ErrCodeFlowControl, "a stream's window overflowed with the backend's initial window size")
			}
			uc.fr.WriteSettingsAck()
			uc.mu.Unlock()
			if limit >= 0 {
				uc.pool.setLimit(limit) // not under uc.mu: the pool's lock comes first
			}
			for _, st := range wake {
				uc.withStream(st, st.flushReq)
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				uc.mu.Lock()
				uc.fr.WritePing(true, f.Data)
				uc.mu.Unlock()
			}
		case *http2.RSTStreamFrame:
			if uc.neverOpened(f.StreamID) {
				return uc.goAway(http2.ErrCodeProtocol, "the backend sent RST_STREAM on a stream weir never opened")
			}
			if st := uc.take(f.StreamID, resetByPeer, 0); st != nil {
				uc.withStream(st, func() { st.upDone = true; st.upstreamReset(f.ErrCode, nil, false) })
			} else {
				// After its END_STREAM (RFC 9113 8.1: NO_ERROR, to stop
				// the request's upload): weir's side is closed too.
				uc.mu.Lock()
				uc.recent.peerReset(f.StreamID)
				delete(uc.unreset, f.StreamID)
				uc.mu.Unlock()
			}
		case *http2.PushPromiseFrame:
			// weir's SETTINGS turned push off (RFC 9113 8.4), and a promise's
			// header block, left undecoded, would put the connection's HPACK
			// table out of step: later answers' fields decoded wrong, some
			// perhaps from other clients' answers.
			return uc.goAway(http2.ErrCodeProtocol, "the backend sent PUSH_PROMISE with push off")
		case *http2.GoAwayFrame:
			uc.pool.drop(uc)
			var unprocessed []*fstream
			uc.mu.Lock()
			uc.away = true
			for id, st := range uc.streams {
				if id > f.LastStreamID {
					delete(uc.streams, id)
					unprocessed = append(unprocessed, st)
				}
			}
			uc.idleCheckLocked()
			uc.mu.Unlock()
			for _, st := range unprocessed {
				uc.withStream(st, func() {
					st.upDone = true
					st.upstreamReset(http2.ErrCodeRefusedStream, nil, true)
				})
			}
		}
	}
}

// goAway tells the backend the connection ends for a protocol error of its own
// and returns the error that ends the reader.
func (uc *upconn) goAway(code http2.ErrCode, why string) error {
	uc.mu.Lock()
	uc.goAwayLocked(code, []byte(why))
	uc.mu.Unlock()
	return fmt.Errorf("http2: %s (%v)", why, code)
}

// resetOverflow resets a stream whose window the backend pushed past the
// limit (a stream error, RFC 9113 6.9.1): the request fails, the connection
// goes on.
func (uc *upconn) resetOverflow(st *fstream, id uint32) {
	if uc.take(id, resetByUs, http2.ErrCodeFlowControl) == nil {
		return
	}
	uc.withStream(st, func() { st.upDone = true; st.upstreamReset(http2.ErrCodeFlowControl, nil, false) })
}

// drained resumes the requests that waited for the backend's socket.
func (uc *upconn) drained() {
	uc.mu.Lock()
	wake := uc.blocked
	uc.blocked = nil
	uc.mu.Unlock()
	for _, st := range wake {
		uc.withStream(st, st.flushReq)
	}
}

// withStream runs fn under st's session mutex if st is still this connection's
// stream; it reports whether fn ran.
func (uc *upconn) withStream(st *fstream, fn func()) bool {
	st.sess.mu.Lock()
	defer st.sess.mu.Unlock()
	if st.up != uc || st.finished {
		return false
	}
	fn()
	return true
}

// idleLocked reports whether stream id is one weir never opened on this
// connection ("idle", RFC 9113 5.1: weir opens the odd ones in order, and a
// server opens none, push being off): a frame other than PRIORITY on it is a
// connection error. Streams weir opened and has since closed are not idle:
// their late frames are answered by how they closed (notOpen).
func (uc *upconn) idleLocked(id uint32) bool {
	return id != 0 && (id%2 == 0 || id >= uc.nextID)
}

// neverOpened is idleLocked for a caller that does not hold mu.
func (uc *upconn) neverOpened(id uint32) bool {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	return uc.idleLocked(id)
}

// notOpen answers the backend's DATA or HEADERS (frame) on stream id, which
// is not open. On a stream weir never opened: a connection error
// PROTOCOL_ERROR. On one that closed: what recent says of how it closed, and
// nothing for a stream recent has forgotten (how it closed is not known, and
// frames may follow weir's reset). It returns the error that ends the reader,
// if any.
func (uc *upconn) notOpen(id uint32, frame string) error {
	uc.mu.Lock()
	idle := uc.idleLocked(id)
	late := uc.recent.late(id)
	if !idle && late == lateStreamClosed {
		delete(uc.unreset, id) // this reset is the one owed
		uc.recent.weReset(id)
		uc.fr.WriteRSTStream(id, http2.ErrCodeStreamClosed)
	}
	uc.mu.Unlock()
	switch {
	case idle:
		return uc.goAway(http2.ErrCodeProtocol, "the backend sent "+frame+" on a stream weir never opened")
	case late == lateConnClosed:
		// Its other streams fail as on a connection that broke: those the
		// backend has not answered are tried again where they may be.
		return uc.goAway(http2.ErrCodeStreamClosed, "the backend sent "+frame+" on a stream after both sides ended it")
	}
	return nil
}

// lookupLocked returns stream id's fstream; ended: the backend's side is over,
// and the stream is dropped.
func (uc *upconn) lookupLocked(id uint32, ended bool) *fstream {
	st := uc.streams[id]
	if st != nil && ended {
		delete(uc.streams, id)
		how := endedByPeer
		if st.reqEndSent {
			how = endedBoth
		} else {
			if uc.unreset == nil {
				uc.unreset = map[uint32]struct{}{}
			}
			uc.unreset[id] = struct{}{}
		}
		uc.recent.note(id, how)
		uc.idleCheckLocked()
	}
	return st
}

// take drops stream id, closed as how (resetByUs: weir resets it with code),
// and returns its fstream. The connection, its last stream gone, closes or
// gets its idle timer as when a stream ends any other way (idleCheckLocked),
// after weir's reset.
func (uc *upconn) take(id uint32, how closeHow, code http2.ErrCode) *fstream {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	st := uc.streams[id]
	if st != nil {
		delete(uc.streams, id)
		uc.recent.note(id, how)
		if how == resetByUs {
			uc.fr.WriteRSTStream(id, code)
		}
		uc.idleCheckLocked()
	}
	return st
}

// fail ends the connection and the streams on it: those the backend never saw
// may be retried anywhere.
func (uc *upconn) fail(err error) {
	uc.pool.drop(uc)
	uc.mu.Lock()
	uc.dead = true
	uc.away = true
	if uc.idle != nil {
		uc.idle.Stop()
	}
	var sts []*fstream
	for _, st := range uc.streams {
		sts = append(sts, st)
	}
	unseen := uc.waiting
	uc.streams, uc.waiting = map[uint32]*fstream{}, nil
	if uc.conn != nil {
		uc.conn.Close()
	}
	uc.mu.Unlock()
	if err == nil {
		err = errors.New("connection closed")
	}
	cerr := err
	if _, ok := err.(*dialError); !ok {
		cerr = fmt.Errorf("backend connection: %w", err)
	}
	derr := err
	if _, ok := err.(*dialError); !ok {
		derr = &dialError{err}
	}
	for _, st := range unseen {
		uc.withStream(st, func() { st.upDone = true; st.upstreamReset(0, derr, true) })
	}
	for _, st := range sts {
		uc.withStream(st, func() { st.upDone = true; st.upstreamReset(0, cerr, false) })
	}
}

func (p *upPool) setLimit(n int) {
	p.mu.Lock()
	p.limit = max(n, 1)
	p.mu.Unlock()
}

// drop takes uc out of the pool: it gets no new streams.
func (p *upPool) drop(uc *upconn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if i := slices.Index(p.conns, uc); i >= 0 {
		p.conns = append(p.conns[:i], p.conns[i+1:]...)
	}
}

// closeIdle closes the idle connections of a retired backend's pool; the
// others close as their last stream ends (idleCheckLocked), unless the
// backend is configured again first: then they stay, and take its requests.
func (p *upPool) closeIdle() {
	p.mu.Lock()
	conns := slices.Clone(p.conns)
	p.mu.Unlock()
	for _, uc := range conns {
		uc.mu.Lock()
		uc.idleCheckLocked()
		uc.mu.Unlock()
	}
}
