package httplb

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/weir-lb/weir/userspace/balance"
)

// The frame engine serves HTTP/2 clients frame by frame: one goroutine reads a
// client connection's frames, another each upstream connection's, and a
// request's HEADERS and DATA frames are re-encoded onto a backend's connection
// as they arrive, its answer's frames back onto the client's. No goroutine is
// started per request and no frame crosses a channel; what would wait for flow
// control waits in the stream, bounded by the window weir gave its sender.
// Framing and HPACK are x/net/http2's (Framer, hpack); the engine only moves
// frames and keeps the two sides' flow-control windows.
//
// Flow control: weir gives each client and each backend connection recvConnWin
// and each stream recvStreamWin. A DATA frame's connection credit goes back when
// it arrives, its stream credit only once it has been written to the other side
// (or dropped with its stream): so a sender never has more than recvStreamWin
// per stream in weir, and a stream that cannot move on (its reader not reading)
// holds up only itself, never the connection the other streams share.

const (
	// frameReadBuf is the read buffer of a connection that cannot be read
	// through frameReader's pooled buffer (TLS clients, backends): the framer
	// reads a frame's header and payload separately, so without it every
	// frame costs two read(2)s; with it a batch of small frames costs one.
	// Larger payloads bypass it.
	frameReadBuf = 4 << 10
	// maxRefused bounds how often a stream the backend refused goes again.
	maxRefused    = 3
	recvStreamWin = 256 << 10
	recvConnWin   = 4 << 20
	// Credit is returned in batches: one WINDOW_UPDATE per this much.
	creditBatch = 64 << 10
	// maxClientStreams is the concurrent streams a client may open
	// (SETTINGS_MAX_CONCURRENT_STREAMS), as net/http's server allows.
	maxClientStreams = 250
)

// fsess is one client connection served by the frame engine. Its mutex guards
// the connection's and its streams' state and its framer's writes.
type fsess struct {
	s      *Service
	conn   *coalescingConn
	fr     *http2.Framer
	br     *blockReader
	client string // the client's address, without the port
	tls    bool   // the client came over TLS
	remote string // with it, for the access log

	mu      sync.Mutex
	enc     *hpack.Encoder
	encBuf  bytes.Buffer
	streams map[uint32]*fstream
	maxID   uint32 // the highest stream ID the client opened
	// cutShort holds the last streams closed before the client had sent the
	// request's end, by weir's RST_STREAM or by the client's own (see
	// noteCutShort).
	cutShort closedStreams
	away     bool // GOAWAY sent: no new streams
	closed   bool
	sendWin  int64 // the client's connection window for our DATA
	initWin  int64 // the client's SETTINGS_INITIAL_WINDOW_SIZE
	maxFrame uint32
	credit   int64 // connection credit owed to the client
	recvWin  int64 // the client's connection window for its DATA
	// resets counts the streams the client reset before their answer in the
	// second from resetsFrom.
	resets     int
	resetsFrom time.Time
	idle       *time.Timer
	done       chan struct{} // closed when the session's reader exits
}

// fstream is one request. The client session's mutex guards it.
type fstream struct {
	sess *fsess
	id   uint32
	live *live

	method, path, authority string
	hdrs                    []hpack.HeaderField // to the backend, pseudo-headers first
	hashKey                 uint64              // in picker's configuration
	// picker's balancer picks the stream's backends: live's first, the
	// one in force for retries and tries moved off a backend retired
	// since its pick (repick).
	picker *live
	// What the client sent that hdrs lacks, for keyIn: its own fields
	// are hdrs[:nClient] (those weir adds follow), less X-Forwarded-For
	// (xff) and X-Forwarded-Proto (xfp) where live adds its own instead,
	// and less Host and the hop-by-hop fields (unsent), which no backend
	// gets.
	nClient   int
	xff, xfp  []string
	unsent    []hpack.HeaderField
	grpc      bool
	retryable bool
	start     time.Time

	reqEnded      bool                // the client's END_STREAM came
	resetByClient bool                // the client's RST_STREAM ended it
	reqEndSent    bool                // and went to the backend
	reqTr         []hpack.HeaderField // the request's trailers
	reqLeft       int64               // the body's bytes its content-length has yet to see; -1: none given
	recvWin       int64
	credit        int64 // stream credit owed to the client

	// The request's body frames not yet sent upstream; once sent, kept for a
	// retry while replay allows.
	reqQ     [][]byte
	resend   [][]byte // what a failed try sent, to go again first (credited already)
	replay   [][]byte
	replayN  int
	replayOK bool // every byte sent so far is in replay
	sentBody bool

	tries   int
	refused int // sent again because the backend refused the stream
	tried   []string
	// movedOff are the backends a try was moved off (repick): never
	// tried, they are picked again once configured again.
	movedOff []string
	// retryOn is the backend of the retry under way, counted in its
	// retries once the try comes to something (countRetry): a try moved
	// off it (repick) is not its.
	retryOn *backend
	fail    failure
	be      *backend
	lease   balance.Lease
	up      *upconn
	upID    uint32
	upSend  int64 // the backend's stream window for our DATA
	upOwed  int64 // stream credit owed to the backend
	upRecv  int64 // the backend's stream window for its DATA, as weir gave it
	tryT    time.Time
	tryTmr  *time.Timer
	// tryN numbers the tries whose timer was armed: a timer acts only on
	// the try it was armed for (one that fired as its try ended otherwise
	// finds the next under way).
	tryN    int
	allTmr  *time.Timer
	headerL time.Duration

	status    int                 // the answer's status, once final headers came
	held      []hpack.HeaderField // those headers while they wait for the first DATA (see respHeaders)
	respQ     [][]byte
	respEnd   bool                // END_STREAM with the last of respQ
	trailers  []hpack.HeaderField // to send after respQ
	cliSend   int64               // the client's stream window for our DATA
	own       bool                // the answer is weir's own (answer), counted already
	finished  bool
	upDone    bool // the backend's side of the stream is over
	respBytes int64
}

// serveFrames serves one client connection whose preface has been read, until
// it closes; arrived is called once the session is known to a shutdown (or
// refused by it).
func (s *Service) serveFrames(c *coalescingConn, overTLS bool, arrived func()) {
	defer s.stats.conns.Add(-1) // counted by the split listener
	ss := &fsess{s: s, conn: c, tls: overTLS, streams: map[uint32]*fstream{}, sendWin: 65535, initWin: 65535, maxFrame: defaultMaxFrame, recvWin: recvConnWin,
		remote: c.RemoteAddr().String(), done: make(chan struct{})}
	ss.client, _, _ = net.SplitHostPort(ss.remote)
	ss.fr = http2.NewFramer(queueWriter{c}, frameReader(c))
	// weir advertises no SETTINGS_MAX_FRAME_SIZE, so the client may send no
	// more than the default; the framer would otherwise take (and keep a
	// buffer of) frames up to 16 MiB.
	ss.fr.SetMaxReadFrameSize(defaultMaxFrame)
	c.onDrain = ss.drained
	ss.br = newBlockReader(ss.fr, uint32(s.cfg.MaxHeaderBytes))
	ss.br.partial = ss.headerDeadline
	ss.enc = hpack.NewEncoder(&ss.encBuf)
	ok := s.registerSession(ss)
	arrived()
	if !ok {
		c.Close()
		return
	}
	defer func() {
		s.fmu.Lock()
		delete(s.fsessions, ss)
		s.fmu.Unlock()
	}()
	ss.mu.Lock()
	ss.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: maxClientStreams},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: recvStreamWin},
		http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: uint32(s.cfg.MaxHeaderBytes)})
	ss.fr.WriteWindowUpdate(0, recvConnWin-65535)
	ss.idle = time.AfterFunc(s.cfg.IdleTimeout, ss.idleExpired)
	ss.mu.Unlock()
	err := ss.readSafely()
	c.clientFailed(err) // its reads go around c on a socket (frameReader)
	ss.mu.Lock()
	ss.closeLocked(err)
	ss.mu.Unlock()
	close(ss.done)
}

// frameReader is what a client connection's framer reads: on a socket, a
// buffer held only while it has bytes the framer has not taken, so an idle
// connection holds none; over TLS (which cannot be waited on without reading)
// a buffer of its own.
func frameReader(c *coalescingConn) io.Reader {
	if r := newPoolBufReader(c.Conn, &bufPool); r.pr.raw() {
		return r
	}
	return bufio.NewReaderSize(c, frameReadBuf)
}

// read is the session's reader: it runs until the connection fails or closes.
func (ss *fsess) read() error {
	for {
		f, hb, err := ss.br.read()
		if err != nil {
			if se, ok := err.(http2.StreamError); ok {
				ss.mu.Lock()
				err = ss.streamError(se, hb)
				ss.mu.Unlock()
				if err != nil {
					return err
				}
				continue
			}
			code := http2.ErrCodeProtocol
			switch ce, ok := err.(http2.ConnectionError); {
			case ok:
				code = http2.ErrCode(ce)
			case err == http2.ErrFrameTooLarge:
				code = http2.ErrCodeFrameSize
			default:
				return err // the connection failed or closed
			}
			ss.mu.Lock()
			ss.fr.WriteGoAway(ss.maxID, code, nil)
			ss.mu.Unlock()
			return err
		}
		if err := ss.handleFrame(f, hb); err != nil {
			return err
		}
	}
}

// headerDeadline bounds a header block's CONTINUATION frames by the header
// timeout, as HTTP/1.1 bounds a request's head: a client that sends part of a
// block and stalls (slowloris) holds no connection for longer, even one with
// other streams open, which keep the idle timeout from running.
func (ss *fsess) headerDeadline(on bool) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return // the GOAWAY's linger sets the deadline now
	}
	if on {
		ss.conn.SetReadDeadline(time.Now().Add(ss.s.cfg.ReadHeaderTimeout))
	} else {
		ss.conn.SetReadDeadline(time.Time{})
	}
}

// streamError resets the stream of a frame or header block the client got
// wrong; mu is held. A malformed header block opens its stream all the same
// (RFC 9113 5.1.1), so it is held to the rules of any HEADERS and uses up its
// stream ID.
func (ss *fsess) streamError(se http2.StreamError, hb *hblock) error {
	if se.Cause == errPriorityLength {
		// The stream's reset, open or closed. PRIORITY may come on an idle
		// stream, where no RST_STREAM may go: dropped there, as it changes
		// nothing weir keeps.
		if ss.streams[se.StreamID] == nil && ss.idleStream(se.StreamID) {
			return nil
		}
		return ss.refuse(ss.streams[se.StreamID], se.StreamID, se.Code)
	}
	if hb == nil && ss.idleStream(se.StreamID) {
		// The framer's stream error (a WINDOW_UPDATE of 0) on a stream the
		// client never opened: a frame there is a connection error before
		// it is anything else (RFC 9113 5.1), and no RST_STREAM may go on
		// an idle stream.
		return ss.protocolError("WINDOW_UPDATE of 0 on an idle stream")
	}
	if hb != nil && ss.streams[hb.id] == nil {
		if hb.id%2 == 0 {
			return ss.protocolError("HEADERS on a stream the client cannot open")
		}
		if hb.id <= ss.maxID {
			return ss.closedHeaders(hb.id) // see headers
		}
		ss.maxID = hb.id
		if !hb.end {
			ss.noteCutShort(hb.id, false)
		}
	}
	return ss.refuse(ss.streams[se.StreamID], se.StreamID, se.Code)
}

// noteCutShort remembers a stream closed before the client sent its
// request's end: closed by weir, frames still under way on it are ignored
// (the client may have sent them before it saw weir's RST_STREAM); closed by
// the client's own RST_STREAM, DATA or HEADERS on it is a stream error
// STREAM_CLOSED (closedStreams.late). A stream whose request had ended is
// noted only once weir resets it (closedStreams.weReset; frames after are
// dropped): until then DATA on it is a stream error STREAM_CLOSED (RFC 9113
// 6.1) and HEADERS a connection error.
func (ss *fsess) noteCutShort(id uint32, byClient bool) {
	how := resetByUs
	if byClient {
		how = resetByPeer
	}
	ss.cutShort.note(id, how)
}

// idleStream: a stream the client has not opened, nor could have: above the
// highest it opened, or even-numbered (weir pushes nothing). A frame other
// than HEADERS or PRIORITY on it is a connection error (RFC 9113 5.1).
func (ss *fsess) idleStream(id uint32) bool {
	return id > ss.maxID || id%2 == 0
}

// closedHeaders takes a header block on a closed stream (an odd ID at or below
// the highest the client opened, not open); mu is held. Its block is decoded
// already, so HPACK's state holds whatever the answer.
func (ss *fsess) closedHeaders(id uint32) error {
	switch ss.cutShort.late(id) {
	case lateIgnore:
		return nil // trailers sent before the client saw weir's RST_STREAM
	case lateStreamClosed:
		return ss.refuse(nil, id, http2.ErrCodeStreamClosed)
	}
	return ss.protocolError("HEADERS on a stream the client cannot open")
}

// refuse resets a stream for the client's fault; mu is held. These resets
// count with the client's own: a client that opens streams weir must reset
// (a WINDOW_UPDATE of 0, DATA past the window) costs each backend a request
// as cheaply as one that resets them itself. st may be nil (no such stream).
func (ss *fsess) refuse(st *fstream, id uint32, code http2.ErrCode) error {
	if st != nil {
		st.reset(code)
	} else {
		ss.fr.WriteRSTStream(id, code)
		ss.cutShort.weReset(id)
	}
	if ss.tooManyResets() {
		return ss.calm()
	}
	return nil
}

// calm ends a connection that resets (or has weir reset) too many streams.
func (ss *fsess) calm() error {
	// Streams opened and reset at once cost each backend a request and the
	// client nothing ("rapid reset", CVE-2023-44487).
	ss.fr.WriteGoAway(ss.maxID, http2.ErrCodeEnhanceYourCalm, []byte("too many streams reset"))
	return fmt.Errorf("http2: more than %d streams a second reset before their answer", maxResetsPerSecond)
}

// handleFrame acts on a frame or a header block under mu, released however
// the handling ends (see readSafely).
func (ss *fsess) handleFrame(f http2.Frame, hb *hblock) error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if hb != nil {
		return ss.headers(hb)
	}
	return ss.handle(f)
}

// goAwayLinger bounds how long a session that sent GOAWAY and has no stream
// left reads on after its FIN, waiting for the client to close (maybeCloseLocked).
const goAwayLinger = time.Second

// defaultMaxFrame is the largest frame payload a peer may send before it
// says otherwise (SETTINGS_MAX_FRAME_SIZE, RFC 9113 6.5.2).
const defaultMaxFrame = 16384

// maxWindow is the largest flow-control window HTTP/2 allows (RFC 9113 6.9.1).
const maxWindow = 1<<31 - 1

// enginePanics counts the frame engine's connections ended by a panic (the
// tests hold it at 0).
var enginePanics atomic.Int64

// readSafely is read, with a panic in the engine ending this connection, as
// net/http's server ends a request whose handler panicked, not the agent.
func (ss *fsess) readSafely() (err error) {
	defer func() {
		if r := recover(); r != nil {
			enginePanics.Add(1)
			ss.s.log.Error("http2 connection ended by an internal error", "client", ss.remote, "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("internal error: %v", r)
		}
	}()
	return ss.read()
}

func (ss *fsess) protocolError(msg string) error {
	ss.fr.WriteGoAway(ss.maxID, http2.ErrCodeProtocol, []byte(msg))
	return fmt.Errorf("http2 protocol error: %s", msg)
}

// handle acts on one frame from the client; mu is held.
func (ss *fsess) handle(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.DataFrame:
		return ss.data(f)
	case *http2.WindowUpdateFrame:
		if f.StreamID == 0 {
			ss.sendWin += int64(f.Increment)
			if ss.sendWin > maxWindow {
				ss.fr.WriteGoAway(ss.maxID, http2.ErrCodeFlowControl, nil)
				return fmt.Errorf("http2: the client's connection window overflowed")
			}
			for _, st := range ss.streams {
				st.flushResp()
			}
			return nil
		}
		st := ss.streams[f.StreamID]
		if st == nil {
			if ss.idleStream(f.StreamID) {
				return ss.protocolError("WINDOW_UPDATE on an idle stream")
			}
			// A closed stream's: it may have been sent before the client
			// saw the stream's end (RFC 9113 5.1).
			return nil
		}
		st.cliSend += int64(f.Increment)
		if st.cliSend > maxWindow {
			return ss.refuse(st, st.id, http2.ErrCodeFlowControl)
		}
		st.flushResp()
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		var err error
		f.ForeachSetting(func(s http2.Setting) error {
			if e := s.Valid(); e != nil {
				err = e
				return e
			}
			switch s.ID {
			case http2.SettingInitialWindowSize:
				d := int64(s.Val) - ss.initWin
				ss.initWin = int64(s.Val)
				for _, st := range ss.streams {
					st.cliSend += d
					if st.cliSend > maxWindow {
						// RFC 9113 6.9.2: a connection error.
						err = http2.ConnectionError(http2.ErrCodeFlowControl)
						return err
					}
				}
			case http2.SettingMaxFrameSize:
				ss.maxFrame = s.Val
			case http2.SettingHeaderTableSize:
				ss.enc.SetMaxDynamicTableSizeLimit(s.Val)
			}
			return nil
		})
		if err != nil {
			code := http2.ErrCodeProtocol
			if ce, ok := err.(http2.ConnectionError); ok {
				code = http2.ErrCode(ce)
			}
			ss.fr.WriteGoAway(ss.maxID, code, nil)
			return err
		}
		ss.fr.WriteSettingsAck()
		for _, st := range ss.streams {
			st.flushResp()
		}
	case *http2.PingFrame:
		if !f.IsAck() {
			ss.fr.WritePing(true, f.Data)
		}
	case *http2.RSTStreamFrame:
		st := ss.streams[f.StreamID]
		if st == nil {
			if ss.idleStream(f.StreamID) {
				return ss.protocolError("RST_STREAM on an idle stream")
			}
			return nil // a closed stream's; never answered with a reset (RFC 9113 5.4.2)
		}
		unanswered := !st.answered()
		st.resetByClient = true
		st.clientGone()
		if unanswered && ss.tooManyResets() {
			return ss.calm()
		}
	case *http2.PriorityFrame:
		// Priorities are not acted on (RFC 9113 5.3.2), but a stream that
		// depends on itself is an error all the same (RFC 9113 5.3.1):
		// the open stream's reset, or, on a stream not open, where no
		// RST_STREAM may go, the connection's.
		if f.StreamDep == f.StreamID {
			if st := ss.streams[f.StreamID]; st != nil {
				return ss.refuse(st, st.id, http2.ErrCodeProtocol)
			}
			return ss.protocolError("PRIORITY: a stream depends on itself")
		}
	case *http2.GoAwayFrame:
		// The client opens no more streams; those open finish.
		ss.away = true
		ss.maybeCloseLocked()
	case *http2.PushPromiseFrame:
		return ss.protocolError("PUSH_PROMISE from a client")
	}
	// Other PRIORITY, PRIORITY_UPDATE and unknown frames are ignored.
	return nil
}

// connectionSpecific lists the headers HTTP/2 forbids (RFC 9113 8.2.2).
func connectionSpecific(name string) bool {
	switch name {
	case "connection", "proxy-connection", "keep-alive", "transfer-encoding", "upgrade":
		return true
	}
	return false
}

// hopOnly lists the headers HTTP/2 allows that belong to one hop all the same
// (hopByHop's others), which weir does not pass on. Trailer is passed: it
// announces the trailers weir passes too, and Go's server reads only the
// trailers it announced.
func hopOnly(name string) bool {
	return name == "proxy-authorization" || name == "proxy-authenticate"
}

// headers opens a stream (or takes a stream's trailers).
func (ss *fsess) headers(f *hblock) error {
	id := f.id
	if st := ss.streams[id]; st != nil {
		// Trailers: they end the request.
		if !f.end || st.reqEnded {
			return ss.protocolError("HEADERS in the middle of a request")
		}
		if st.reqLeft > 0 {
			return ss.refuse(st, id, http2.ErrCodeProtocol) // a body shorter than its content-length
		}
		st.reqEnded = true
		var tr []hpack.HeaderField
		for _, hf := range f.regular() {
			if !connectionSpecific(hf.Name) && !hopOnly(hf.Name) {
				tr = append(tr, hf)
			}
		}
		st.reqTrailers(tr)
		return nil
	}
	if id%2 == 0 {
		return ss.protocolError("HEADERS on a stream the client cannot open")
	}
	if id <= ss.maxID {
		// Trailers sent while weir closed the stream (an answer before the
		// request's end, a malformed request) are ignored; see closedHeaders.
		return ss.closedHeaders(id)
	}
	ss.maxID = id
	if ss.away || ss.closed || len(ss.streams) >= maxClientStreams {
		ss.fr.WriteRSTStream(id, http2.ErrCodeRefusedStream)
		ss.noteCutShort(id, false) // its body and trailers may be on their way; frames after are dropped
		return nil
	}
	s := ss.s
	l := s.live.Load()
	st := &fstream{sess: ss, id: id, live: l, start: time.Now(), recvWin: recvStreamWin, cliSend: ss.initWin,
		reqEnded: f.end, reqLeft: -1}
	ss.streams[id] = st
	if len(ss.streams) == 1 {
		ss.idle.Stop()
	}
	s.stats.inflight.Add(1)
	if f.truncated {
		st.answer(http.StatusRequestHeaderFieldsTooLarge, grpcUnavailable, "request headers too large", false)
		return nil
	}
	st.method, st.path, st.authority = f.pseudo("method"), f.pseudo("path"), f.pseudo("authority")
	scheme := f.pseudo("scheme")
	if st.method == http.MethodConnect {
		st.answer(http.StatusMethodNotAllowed, grpcUnavailable, fmt.Sprintf("service %q: CONNECT is not proxied", s.cfg.Name), false)
		return nil
	}
	if st.method == "" || st.path == "" || scheme == "" || f.pseudo("status") != "" || f.pseudo("protocol") != "" {
		return ss.refuse(st, id, http2.ErrCodeProtocol)
	}
	regular := f.regular()
	st.hdrs = make([]hpack.HeaderField, 0, len(regular)+8)
	if st.authority == "" {
		for _, hf := range regular {
			if hf.Name == "host" {
				st.authority = hf.Value
			}
		}
	}
	st.hdrs = append(st.hdrs, hpack.HeaderField{Name: ":method", Value: st.method}, hpack.HeaderField{Name: ":scheme", Value: "http"},
		hpack.HeaderField{Name: ":authority", Value: st.authority}, hpack.HeaderField{Name: ":path", Value: st.path})
	var xff, cookies []string
	for _, hf := range regular {
		switch {
		case connectionSpecific(hf.Name):
			return ss.refuse(st, id, http2.ErrCodeProtocol)
		case hf.Name == "te":
			if hf.Value != "trailers" {
				return ss.refuse(st, id, http2.ErrCodeProtocol)
			}
		case hf.Name == "host", hopOnly(hf.Name):
			st.unsent = append(st.unsent, hf) // host is in :authority
			continue
		case hf.Name == "x-forwarded-for" && l.cfg.XForwardedFor:
			xff = append(xff, hf.Value)
			continue
		case hf.Name == "x-forwarded-proto" && l.cfg.XForwardedProto:
			st.xfp = append(st.xfp, hf.Value)
			continue
		case hf.Name == "content-type":
			st.grpc = strings.HasPrefix(hf.Value, "application/grpc")
		case hf.Name == "cookie":
			cookies = append(cookies, hf.Value)
		case hf.Name == "content-length":
			// A request whose DATA does not add up to its content-length is
			// malformed, and is not to be forwarded (RFC 9113 8.1.1).
			n, ok := parseLength(hf.Value)
			if !ok || st.reqLeft >= 0 && n != st.reqLeft {
				return ss.refuse(st, id, http2.ErrCodeProtocol)
			}
			if st.reqLeft >= 0 {
				continue // the same value again: once is enough
			}
			st.reqLeft = n
		}
		st.hdrs = append(st.hdrs, hf)
	}
	if f.end && st.reqLeft > 0 {
		return ss.refuse(st, id, http2.ErrCodeProtocol)
	}
	st.nClient, st.xff = len(st.hdrs), xff
	st.addForwarding(xff)
	st.hashKey, st.picker = st.key(&l.hash, regular, cookies), l
	st.retryable = idempotent(st.method) || l.grpcRetryableName(st.grpc, st.path)
	st.replayOK = st.retryable && l.cfg.Retries > 0
	l.budget.deposit()
	if l.cfg.Timeout > 0 {
		st.allTmr = time.AfterFunc(l.cfg.Timeout, func() { ss.timerFired(st, 0) })
	}
	st.nextTry()
	return nil
}

// addForwarding appends the forwarding headers the service adds.
func (st *fstream) addForwarding(xff []string) {
	cfg := &st.live.cfg
	client := st.sess.client
	proto := "http"
	if st.sess.tls {
		proto = "https"
	}
	if cfg.XForwardedFor {
		st.hdrs = append(st.hdrs, hpack.HeaderField{Name: "x-forwarded-for", Value: forwardedFor(xff, client)})
	}
	if cfg.XForwardedProto {
		st.hdrs = append(st.hdrs, hpack.HeaderField{Name: "x-forwarded-proto", Value: proto})
	}
	if cfg.Forwarded {
		st.hdrs = append(st.hdrs, hpack.HeaderField{Name: "forwarded", Value: forwardedElement(client, proto, st.authority)})
	}
}

// logPath is the request's path without its query, for the access log.
func (st *fstream) logPath() string {
	p, _, _ := strings.Cut(st.path, "?")
	return p
}

// key is the request's hash key by h, as hashKey computes it for net/http's
// requests.
func (st *fstream) key(h *hashBy, regular []hpack.HeaderField, cookies []string) uint64 {
	if !h.on {
		return 0
	}
	var v string
	switch {
	case h.host:
		// :authority, or the host field where the client sent none: the
		// Host an HTTP/1.1 client's request is hashed by.
		v = st.authority
	case h.kind == HashHeader:
		for _, hf := range regular {
			if hf.Name == h.lower {
				v = hf.Value
				break
			}
		}
	case h.kind == HashCookie:
		hd := http.Header{"Cookie": cookies}
		if c, err := (&http.Request{Header: hd}).Cookie(h.cookie); err == nil {
			v = c.Value
		}
	}
	if v == "" {
		v = st.sess.client
	}
	return fnv1a(v)
}

// keyIn is the request's hash key in l, a configuration other than its own,
// found by key in the fields the client sent as the request keeps them: the
// headers it goes to the backend with, without those weir adds, with the
// forwarding headers weir replaced as the client sent them, and with Host and
// the hop-by-hop fields, which it sends on to no backend; so it is the key l
// would have given the request first. Where the key is the same in both
// configurations, the request's own is kept.
func (st *fstream) keyIn(l *live) uint64 {
	if l.hash == st.picker.hash {
		return st.hashKey
	}
	fields := st.hdrs[:st.nClient:st.nClient]
	for _, v := range st.xff {
		fields = append(fields, hpack.HeaderField{Name: "x-forwarded-for", Value: v})
	}
	for _, v := range st.xfp {
		fields = append(fields, hpack.HeaderField{Name: "x-forwarded-proto", Value: v})
	}
	fields = append(fields, st.unsent...)
	var cookies []string
	for _, hf := range fields {
		if hf.Name == "cookie" {
			cookies = append(cookies, hf.Value)
		}
	}
	return st.key(&l.hash, fields, cookies)
}

// data takes a DATA frame of the client's.
func (ss *fsess) data(f *http2.DataFrame) error {
	n := int64(f.Length)
	ss.recvWin -= n
	if ss.recvWin < 0 {
		ss.fr.WriteGoAway(ss.maxID, http2.ErrCodeFlowControl, nil)
		return fmt.Errorf("http2: the client overran its connection window")
	}
	ss.oweConn(n)
	st := ss.streams[f.StreamID]
	if st == nil || st.reqEnded || st.finished {
		if f.StreamID == 0 || ss.idleStream(f.StreamID) {
			return ss.protocolError("DATA on a stream not open")
		}
		if st == nil && ss.cutShort.late(f.StreamID) == lateIgnore {
			return nil // sent before the client saw weir's RST_STREAM
		}
		// DATA after the request's END_STREAM, or on a stream closed or
		// reset by the client (RFC 9113 6.1); its bytes have counted
		// against the connection's window above.
		return ss.refuse(st, f.StreamID, http2.ErrCodeStreamClosed)
	}
	st.recvWin -= n
	if st.recvWin < 0 {
		return ss.refuse(st, st.id, http2.ErrCodeFlowControl)
	}
	if st.reqLeft >= 0 {
		st.reqLeft -= int64(len(f.Data()))
		if st.reqLeft < 0 || st.reqLeft > 0 && f.StreamEnded() {
			return ss.refuse(st, st.id, http2.ErrCodeProtocol) // the body and its content-length disagree
		}
	}
	if st.own {
		// weir has answered; the body has nowhere to go, and no credit is
		// given for more of it.
		st.reqEnded = f.StreamEnded()
		return nil
	}
	// Padding is never forwarded: its credit is owed at once.
	if pad := n - int64(len(f.Data())); pad > 0 {
		ss.oweStream(st, pad)
	}
	if len(f.Data()) > 0 {
		st.reqQ = append(st.reqQ, f.Data())
	}
	if f.StreamEnded() {
		st.reqEnded = true
	}
	st.flushReq()
	keepUnsent(st.reqQ, len(f.Data()) > 0)
	return nil
}

// oweConn returns connection credit for n bytes the client sent, in batches.
func (ss *fsess) oweConn(n int64) { grant(ss.fr, 0, &ss.credit, &ss.recvWin, n) }

// oweStream returns st's credit for n bytes of its body that went on.
func (ss *fsess) oweStream(st *fstream, n int64) {
	if !st.reqEnded {
		grant(ss.fr, st.id, &st.credit, &st.recvWin, n)
	}
}

// grant adds n to the credit owed on stream id (0: the connection) and sends
// it once it reaches creditBatch, adding it to win (if not nil), the window
// the peer now has.
func grant(fr *http2.Framer, id uint32, owed, win *int64, n int64) {
	*owed += n
	if *owed < creditBatch {
		return
	}
	fr.WriteWindowUpdate(id, uint32(*owed))
	if win != nil {
		*win += *owed
	}
	*owed = 0
}

// writeHeaders encodes and writes a header block, in CONTINUATION frames past
// the peer's frame size. buf is the encoder's buffer.
func writeHeaders(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, maxFrame uint32, id uint32, end bool, fields []hpack.HeaderField) error {
	buf.Reset()
	for _, hf := range fields {
		enc.WriteField(hf)
	}
	block := buf.Bytes()
	first := block
	if uint32(len(first)) > maxFrame {
		first = block[:maxFrame]
	}
	rest := block[len(first):]
	err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: first, EndStream: end, EndHeaders: len(rest) == 0})
	for len(rest) > 0 && err == nil {
		chunk := rest
		if uint32(len(chunk)) > maxFrame {
			chunk = rest[:maxFrame]
		}
		rest = rest[len(chunk):]
		err = fr.WriteContinuation(id, len(rest) == 0, chunk)
	}
	return err
}

// reset resets the client's stream and ends it; mu is held.
func (st *fstream) reset(code http2.ErrCode) {
	if st.finished {
		return
	}
	st.sess.fr.WriteRSTStream(st.id, code)
	st.cancelUpstream()
	st.finish()
	if st.reqEnded {
		st.sess.cutShort.weReset(st.id) // finish noted it if not
	}
}

// clientGone ends a stream the client reset.
func (st *fstream) clientGone() {
	st.cancelUpstream()
	if st.answered() && st.be != nil {
		// Counted and logged as the net/http path does; not the backend's fault.
		be := st.be
		st.settle(errors.New("the client reset the stream"))
		st.live.observeTry(be, statusOutcome(st.status))
	}
	st.finish()
}

// brokenOff settles a try that failed after its answer's headers went to the
// client: counted with its status, logged with err, and an outcome o for the
// backend.
func (st *fstream) brokenOff(o Outcome, err error) {
	if st.tryTmr != nil {
		st.tryTmr.Stop()
	}
	be := st.be
	if be == nil {
		return
	}
	st.settle(err)
	st.live.observeTry(be, o)
	st.up, st.upID = nil, 0
}

// settle releases the lease of an answered try and counts and logs the
// request; err is why it ended short (nil: it did not).
func (st *fstream) settle(err error) {
	l := st.live
	s := st.sess.s
	lat := st.headerL
	if l.cfg.LastByte {
		lat = time.Since(st.tryT)
	}
	st.lease.Release(balance.Result{Latency: lat})
	be := st.be
	st.be = nil
	be.stats.count(st.status)
	s.stats.requests.Add(1)
	if l.cfg.Observer != nil {
		l.cfg.Observer.Request(be.addr, st.status, time.Since(st.start))
	}
	if l.cfg.AccessLog {
		s.log.Info("request", "method", st.method, "path", st.logPath(), "proto", "HTTP/2.0", "client", st.sess.remote,
			"backend", be.id, "status", st.status, "bytes", st.respBytes, "headers", st.headerL, "duration", time.Since(st.start), "err", err)
	}
}

// answer answers the client from weir itself (an error); a gRPC call gets
// grpcStatus.
func (st *fstream) answer(status int, grpcStatus, msg string, noBackend bool) {
	ss := st.sess
	s := ss.s
	if noBackend {
		s.stats.noBackend.Add(1)
	}
	var h []hpack.HeaderField
	if st.grpc {
		// As a gRPC server answers (trailers only; see plainError).
		h = []hpack.HeaderField{{Name: ":status", Value: strconv.Itoa(status)}, {Name: "content-type", Value: "application/grpc"},
			{Name: "grpc-status", Value: grpcStatus}, {Name: "grpc-message", Value: url.PathEscape(msg)}}
	} else {
		h = []hpack.HeaderField{{Name: ":status", Value: strconv.Itoa(status)},
			{Name: "content-type", Value: "text/plain; charset=utf-8"}, {Name: "x-content-type-options", Value: "nosniff"},
			{Name: "content-length", Value: strconv.Itoa(len(msg) + 1)}}
	}
	head := st.method == http.MethodHead || st.grpc // no body
	writeHeaders(ss.fr, ss.enc, &ss.encBuf, ss.maxFrame, st.id, head, h)
	st.status = status
	if st.live.cfg.AccessLog {
		s.log.Info("request", "method", st.method, "path", st.logPath(), "proto", "HTTP/2.0", "client", ss.remote,
			"status", status, "tries", st.tries, "duration", time.Since(st.start), "err", st.fail.err)
	}
	s.stats.requests.Add(1)
	st.own = true // counted here, and there is no backend to settle with
	if head {
		st.delivered()
		return
	}
	// The message goes as a backend's body does, within the client's windows:
	// past them, the client would fail the whole connection.
	st.held, st.trailers = nil, nil // nothing of a failed try's answer goes out
	st.respQ, st.respEnd = [][]byte{[]byte(msg + "\n")}, true
	st.flushResp()
}

// nextTry picks a backend and sends the request, or answers the client when no
// try is left; mu is held.
func (st *fstream) nextTry() {
	l := st.live
	if st.tries > 0 && (st.tries > l.cfg.Retries || !st.fail.retry || !st.replayable() || !l.budget.withdraw()) {
		st.answerFailure()
		return
	}
	if st.tries > 0 {
		st.inForce()
	}
	st.pick()
}

// inForce has the configuration in force pick the stream's backends from
// now on: the request's own balancer, replaced by a reload that changed the
// algorithm, may know no other backend, or still offer one removed or down
// since. It is given the key its configuration makes (keyIn), which hashes
// what the request's may not.
func (st *fstream) inForce() {
	if l := st.sess.s.live.Load(); l != st.picker {
		st.hashKey, st.picker = st.keyIn(l), l
	}
}

// repick sends the request to another backend as the same try: the one
// picked got no stream, nothing counts against it, and it is not picked
// again while it is retired or gone (movedOff); mu is held.
func (st *fstream) repick() {
	st.tries--
	st.inForce()
	st.pick()
}

// pick sends the request, as its next try, to a backend picker's balancer
// picks for hashKey that it has not been tried on; mu is held.
func (st *fstream) pick() {
	l := st.live
	s := st.sess.s
	var lease balance.Lease
	var err error
	if len(st.tried) == 0 && st.movedOff == nil {
		lease, err = st.picker.bal.Pick(st.hashKey, nil)
	} else {
		lease, err = st.picker.bal.Pick(st.hashKey, s.excluded("", st.tried, st.movedOff))
	}
	if err != nil {
		if st.tries == 0 {
			st.answer(http.StatusServiceUnavailable, grpcUnavailable, fmt.Sprintf("service %q: no usable backend: every backend is down, drained or ejected", s.cfg.Name), true)
			return
		}
		st.answerFailure()
		return
	}
	st.tries++
	be := s.backend(lease.Backend())
	if be == nil {
		// Removed between the pick and now, or offered by a balancer a
		// reload replaced.
		st.movedOff = append(st.movedOff, lease.Backend())
		lease.Release(balance.Result{})
		st.repick()
		return
	}
	st.tried = append(st.tried, be.id)
	st.be, st.lease = be, lease
	st.requeueBody()
	st.tryT = time.Now()
	st.status = 0
	if l.cfg.TryTimeout > 0 {
		st.tryN++
		n := st.tryN
		st.tryTmr = time.AfterFunc(l.cfg.TryTimeout, func() { st.sess.timerFired(st, n) })
	}
	if st.tries > 1 {
		st.retryOn = be
	}
	st.open()
}

// countRetry counts the retry under way, if it is one, in its backend's
// retries, once.
func (st *fstream) countRetry() {
	if st.retryOn != nil {
		st.retryOn.stats.retries.Add(1)
		st.retryOn = nil
	}
}

// open sends the try to st.be, on a connection of its pool; mu is held. A
// retired backend gets no new connection: when none of its own can take the
// stream, the try goes to another backend instead, not counted (the request
// never left weir), and open reports false. That one is picked by the
// balancer in force (inForce).
func (st *fstream) open() bool {
	if st.be.frames(st.sess.s).open(st) {
		return true
	}
	if st.tryTmr != nil {
		st.tryTmr.Stop()
	}
	st.lease.Release(balance.Result{})
	st.tried = st.tried[:len(st.tried)-1] // st.be's, the last
	st.movedOff = append(st.movedOff, st.be.id)
	st.be, st.retryOn = nil, nil
	st.repick()
	return false
}

// requeueBody has what the last try sent go again before what it had not.
func (st *fstream) requeueBody() {
	if len(st.replay) > 0 {
		st.resend, st.replay, st.replayN = st.replay, nil, 0
	}
	st.sentBody = false
	st.reqEndSent = false
}

// replayable reports whether the request can be sent again: no body sent, or
// all that was sent kept.
func (st *fstream) replayable() bool {
	return !st.sentBody || st.replayOK
}

func (st *fstream) answerFailure() {
	f := st.fail
	if f.status == 0 {
		f.status = http.StatusBadGateway
	}
	st.answer(f.status, f.grpcStatus(), fmt.Sprintf("service %q: %d tries failed, the last: %v", st.sess.s.cfg.Name, len(st.tried), f.err), false)
}

// timerFired is the timeout of try number n (tryN), or of the request (n 0).
func (ss *fsess) timerFired(st *fstream, n int) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if st.finished {
		return
	}
	try := n != 0
	if try && (n != st.tryN || st.status != 0 || st.up == nil && st.be == nil) {
		return // answered in time, or its try ended before the timer could stop
	}
	st.countRetry()
	if st.answered() {
		// The whole request's time ran out mid-answer.
		st.cancelUpstream()
		st.brokenOff(Timeout, context.DeadlineExceeded)
		st.reset(http2.ErrCodeCancel)
		return
	}
	st.cancelUpstream()
	st.lease.Release(balance.Result{Failed: true, Latency: time.Since(st.tryT)})
	st.live.observeTry(st.be, Timeout)
	st.be.stats.count(0)
	st.be = nil
	st.fail = failure{retry: try && st.retryable, status: http.StatusGatewayTimeout, err: errTryTimeout, deadline: true}
	if !try {
		st.fail.err = context.DeadlineExceeded
		st.answerFailure()
		return
	}
	st.nextTry()
}

// tryFailed settles a try the backend broke off; retry says whether it may
// be tried elsewhere (the backend never processed it).
func (st *fstream) tryFailed(o Outcome, unprocessed bool) {
	st.countRetry()
	if st.tryTmr != nil {
		st.tryTmr.Stop()
	}
	st.up, st.upID = nil, 0
	st.dropAnswer()
	if st.be == nil {
		return
	}
	st.lease.Release(balance.Result{Failed: true, Latency: time.Since(st.tryT)})
	st.live.observeTry(st.be, o)
	st.be.stats.count(0)
	st.be = nil
	status := http.StatusBadGateway
	if o == Timeout {
		status = http.StatusGatewayTimeout
	}
	st.fail = failure{retry: st.retryable || unprocessed, dial: unprocessed, status: status, err: fmt.Errorf("backend: %s", o)}
}

// upstreamReset is the backend's RST_STREAM or its connection's failure.
func (st *fstream) upstreamReset(code http2.ErrCode, connErr error, unprocessed bool) {
	if st.finished {
		return
	}
	o := Reset
	if connErr != nil {
		if _, ok := connErr.(*dialError); ok {
			o = ConnectFailure
			unprocessed = true
		}
	}
	if code == http2.ErrCodeRefusedStream {
		unprocessed = true
	}
	if unprocessed && o == Reset && st.refused < maxRefused && (!st.sentBody || st.replayOK) && !st.answered() {
		// The backend did not take the stream (over its stream limit, or going
		// away): it goes again to the same backend, on another connection,
		// without counting as a try, as net/http's transport does.
		st.refused++
		st.dropAnswer()
		st.requeueBody()
		st.open()
		return
	}
	if st.answered() {
		// Mid-answer: the client must see it is incomplete.
		st.upDone = true
		err := connErr
		if err == nil {
			err = fmt.Errorf("backend reset the stream: %v", code)
		}
		st.brokenOff(o, err)
		st.reset(http2.ErrCodeInternal)
		return
	}
	if o == Reset && st.status == 0 && errors.Is(connErr, syscall.ETIMEDOUT) {
		// Before any answer, the backend stopped acknowledging
		// (TCP_USER_TIMEOUT, keepalive): a timeout, as an HTTP/1.1
		// connection's is (isTimeout), where a body broken off is a Reset
		// on either, its headers held back here (held) or not.
		o = Timeout
	}
	st.tryFailed(o, unprocessed)
	if connErr != nil {
		st.fail.err = connErr
	} else {
		st.fail.err = fmt.Errorf("backend reset the stream: %v", code)
	}
	st.nextTry()
}

// cancelUpstream resets the backend's stream, if there is one.
func (st *fstream) cancelUpstream() {
	if st.tryTmr != nil {
		st.tryTmr.Stop()
	}
	if st.up != nil {
		st.up.cancel(st) // ended by the backend, it may still need weir's reset
	}
	st.up, st.upID = nil, 0
	st.upDone = true
}

// finish ends a stream on the client's side; mu is held.
func (st *fstream) finish() {
	if st.finished {
		return
	}
	st.finished = true
	st.countRetry()
	ss := st.sess
	// Ended by the client or by a protocol error: the backend is not to blame
	// (every other end has released the lease already).
	st.lease.Release(balance.Result{})
	if st.allTmr != nil {
		st.allTmr.Stop()
	}
	if st.tryTmr != nil {
		st.tryTmr.Stop()
	}
	delete(ss.streams, st.id)
	if !st.reqEnded {
		ss.noteCutShort(st.id, st.resetByClient)
	}
	ss.s.stats.inflight.Add(-1)
	if st.up != nil && !st.reqEndSent && st.upID != 0 {
		// The backend answered whole (with trailers, perhaps) before the
		// request's end: its half of the stream closes here.
		st.up.resetStream(st.upID)
	}
	st.reqQ, st.resend, st.replay, st.respQ = nil, nil, nil, nil
	if len(ss.streams) == 0 {
		if ss.away {
			ss.maybeCloseLocked()
		} else if !ss.closed {
			ss.idle.Reset(ss.s.cfg.IdleTimeout)
		}
	}
}

// delivered settles a request whose answer went out whole.
func (st *fstream) delivered() {
	if !st.own && st.be != nil {
		be := st.be
		st.settle(nil)
		st.live.observeTry(be, statusOutcome(st.status))
	}
	if !st.reqEnded {
		// The answer is whole before the request: the client may stop sending
		// it (RFC 9113 8.1).
		st.sess.fr.WriteRSTStream(st.id, http2.ErrCodeNo)
	}
	st.finish()
}

// respHeaders takes the backend's response headers (or informational ones).
func (st *fstream) respHeaders(f *hblock) {
	fields := f.fields
	ss := st.sess
	if st.status != 0 {
		// Trailers.
		var tr []hpack.HeaderField
		for _, hf := range fields {
			if !strings.HasPrefix(hf.Name, ":") && !connectionSpecific(hf.Name) && !hopOnly(hf.Name) {
				tr = append(tr, hf)
			}
		}
		st.trailers = tr
		st.respEnd = true
		st.flushResp()
		return
	}
	st.countRetry()
	code, err := strconv.Atoi(f.pseudo("status"))
	if f.truncated {
		// Headers past the limit: passing on what fits would drop some
		// silently (a Set-Cookie, say).
		st.up.cancel(st)
		st.upstreamReset(0, errors.New("the backend's response headers are over the limit"), false)
		return
	}
	// Malformed (RFC 9113 8.1, 8.6): an interim answer that ends the stream,
	// which left the client's stream waiting for a final answer that could no
	// longer come, and 101, which HTTP/2 does not have.
	if err != nil || code < 100 || code > 999 || code < 200 && f.end || code == http.StatusSwitchingProtocols {
		st.up.cancel(st)
		st.upstreamReset(http2.ErrCodeProtocol, nil, false)
		return
	}
	out := make([]hpack.HeaderField, 0, len(fields))
	for _, hf := range fields {
		if !connectionSpecific(hf.Name) && !hopOnly(hf.Name) {
			out = append(out, hf)
		}
	}
	if code < 200 {
		writeHeaders(ss.fr, ss.enc, &ss.encBuf, ss.maxFrame, st.id, false, out)
		return
	}
	if st.tryTmr != nil {
		st.tryTmr.Stop()
	}
	st.headerL = time.Since(st.tryT)
	l := st.live
	// The answer's outcome is told when it has gone whole (delivered), or as
	// the failure that broke it off (brokenOff), never both: a Success told
	// at its headers would end the run of failures the health checker counts
	// towards an ejection, for a backend that breaks off every answer.
	if st.tries <= l.cfg.Retries && st.retryable && retryStatus(code) && st.replayable() {
		// Worth another backend: this answer is dropped.
		l.observeTry(st.be, statusOutcome(code))
		st.up.cancel(st)
		st.up, st.upID = nil, 0
		st.lease.Release(balance.Result{Latency: st.headerL})
		st.be.stats.count(code)
		st.be = nil
		st.fail = failure{retry: true, status: code, err: fmt.Errorf("backend answered %d", code)}
		st.nextTry()
		return
	}
	st.status = code
	if f.end {
		st.upDone = true
		st.up.forget(st)
	} else if st.tries <= l.cfg.Retries && st.retryable && st.replayable() && hasBodyLength(out) {
		// A body of known length (not a stream): its headers wait for its first
		// bytes, so a backend that dies between the two is still retried
		// elsewhere.
		st.held = out
		return
	}
	writeHeaders(ss.fr, ss.enc, &ss.encBuf, ss.maxFrame, st.id, f.end, out)
	if f.end {
		st.delivered()
	}
}

// dropAnswer forgets what a try had of its answer (held headers, queued
// bytes), for the next try.
func (st *fstream) dropAnswer() {
	st.status, st.held, st.respQ, st.respEnd, st.trailers = 0, nil, nil, false, nil
}

// answered reports whether the answer's headers went to the client.
func (st *fstream) answered() bool { return st.status != 0 && st.held == nil }

// statusOutcome is the outcome of an answer with status code for passive health.
func statusOutcome(code int) Outcome {
	if code >= 500 {
		return ServerError
	}
	return Success
}

// parseLength parses a content-length: digits only (no sign, no space).
func parseLength(v string) (int64, bool) {
	if v == "" || len(v) > 18 {
		return 0, false
	}
	var n int64
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

// hasBodyLength reports whether response headers announce a body of known,
// non-zero length.
func hasBodyLength(h []hpack.HeaderField) bool {
	for _, hf := range h {
		if hf.Name == "content-length" {
			n, err := strconv.ParseInt(hf.Value, 10, 64)
			return err == nil && n > 0
		}
	}
	return false
}

// respData sends a DATA frame of the backend's to the client, or queues what
// the windows do not let through yet. p is the framer's buffer.
func (st *fstream) respData(p []byte, end bool) {
	if len(p) > 0 {
		st.respQ = append(st.respQ, p)
	}
	if end {
		st.respEnd = true
	}
	st.flushResp()
	keepUnsent(st.respQ, len(p) > 0)
}

// keepUnsent copies what is left of a frame's data that was queued last (q's
// last element, if it was appended): the framer reuses its buffer for the next
// frame. The frames queued before it were copied when they were left over.
func keepUnsent(q [][]byte, appended bool) {
	if appended && len(q) > 0 {
		q[len(q)-1] = bytes.Clone(q[len(q)-1])
	}
}

// flushResp sends what of the answer the client's windows allow; mu is held.
func (st *fstream) flushResp() {
	ss := st.sess
	if st.finished || st.status == 0 {
		return
	}
	if st.held != nil {
		if len(st.respQ) == 0 && !st.respEnd {
			return
		}
		writeHeaders(ss.fr, ss.enc, &ss.encBuf, ss.maxFrame, st.id, false, st.held)
		st.held = nil
	}
	for len(st.respQ) > 0 {
		b := st.respQ[0]
		n := min(int64(len(b)), st.cliSend, ss.sendWin, int64(ss.maxFrame))
		if n <= 0 || !ss.conn.room() {
			// The client's window is shut or its socket is not taking what was
			// written: the rest waits, and the backend's credit with it.
			return
		}
		last := n == int64(len(b)) && len(st.respQ) == 1 && st.respEnd && st.trailers == nil
		ss.conn.queueData(st.id, last, b[:n])
		st.cliSend -= n
		ss.sendWin -= n
		st.respBytes += n
		if n == int64(len(b)) {
			st.respQ = st.respQ[1:]
		} else {
			st.respQ[0] = b[n:]
		}
		if st.up != nil {
			st.up.oweStream(st, n)
		}
		if last {
			st.delivered()
			return
		}
	}
	if st.respEnd {
		if st.trailers != nil {
			writeHeaders(ss.fr, ss.enc, &ss.encBuf, ss.maxFrame, st.id, true, st.trailers)
		} else {
			ss.conn.queueData(st.id, true, nil)
		}
		st.delivered()
	}
}

// flushReq sends the request's queued body upstream as the backend's windows
// allow; mu is held.
func (st *fstream) flushReq() {
	if st.up == nil || st.upID == 0 || st.finished {
		return
	}
	st.up.sendBody(st)
}

// reqTrailers forwards the request's trailers after its body.
func (st *fstream) reqTrailers(tr []hpack.HeaderField) {
	st.reqTr = tr
	st.flushReq()
}

// maxResetsPerSecond bounds the streams a client may reset before their
// answer, per connection and second; past it the connection is closed.
const maxResetsPerSecond = 1000

func (ss *fsess) tooManyResets() bool {
	now := time.Now()
	if now.Sub(ss.resetsFrom) > time.Second {
		ss.resets, ss.resetsFrom = 0, now
	}
	ss.resets++
	return ss.resets > maxResetsPerSecond
}

// drained resumes the answers that waited for the client's socket.
func (ss *fsess) drained() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for _, st := range ss.streams {
		st.flushResp()
	}
}

// idleExpired closes a session that had no stream for the idle timeout.
func (ss *fsess) idleExpired() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if len(ss.streams) == 0 && !ss.closed {
		ss.goAwayLocked(http2.ErrCodeNo)
	}
}

// goAway tells the client to open no more streams; the session closes once
// those open have finished.
func (ss *fsess) goAway(code http2.ErrCode) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.goAwayLocked(code)
}

func (ss *fsess) goAwayLocked(code http2.ErrCode) {
	if ss.closed {
		return
	}
	if !ss.away {
		ss.away = true
		ss.fr.WriteGoAway(ss.maxID, code, nil)
	}
	ss.maybeCloseLocked()
}

func (ss *fsess) maybeCloseLocked() {
	if ss.away && len(ss.streams) == 0 && !ss.closed {
		ss.closed = true
		ss.idle.Stop()
		// Not under mu, which a backend connection's reader may be waiting
		// for: CloseWrite waits (up to drainWait) for the GOAWAY to go out.
		// The reader then reads on (refusing any new stream) until the client
		// closes too or goAwayLinger passes: a socket closed with the client's
		// late frames unread answers them with a reset, and a client whose
		// write fails on it (Go's does) fails every request it has in flight
		// on that connection, even those the GOAWAY told it to send again.
		// Exits once the connection is closed.
		go func() {
			ss.conn.CloseWrite()
			ss.conn.SetReadDeadline(time.Now().Add(goAwayLinger))
			<-ss.done
			ss.conn.Close()
		}()
	}
}

// closeLocked ends every stream of a session whose connection is gone.
func (ss *fsess) closeLocked(err error) {
	for _, st := range ss.streams {
		st.clientGone()
	}
	if !ss.closed {
		ss.closed = true
		ss.idle.Stop()
		ss.conn.Close()
	}
}
