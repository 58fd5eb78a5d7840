//go:build linux

package httplb

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/textproto"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

// FuzzH1Requests sends arbitrary bytes to the HTTP/1.1 connection loop, over a
// real socket, with a real backend behind it that records every request it
// reads, and checks them against what the same bytes mean to Go's own request
// reader (the oracle below): the backend gets exactly the requests the client
// sent, in order, with their methods, targets, Host, end-to-end header fields
// and bodies, and nothing else (no request smuggled in by a body's framing, a
// header the writers pass on, or the loop's reading on after an answer); and
// the client's answers come in the same order, each the one the backend gave
// to its request. Many inputs are not requests at all: those must reach no
// backend and get a 4xx or 5xx or a closed connection.
//
//	go test -run '^$' -fuzz FuzzH1Requests -fuzztime 2m ./userspace/httplb/
func FuzzH1Requests(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /two?x=1 HTTP/1.1\r\nHost: b\r\nX-A: 1\r\nX-A: 2\r\n\r\n",
		"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhelloGET / HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: 1\r\n\r\nHEAD / HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
		"PUT / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi",
		"GET http://other/abs?q HTTP/1.1\r\nHost: a\r\nConnection: close, X-Drop\r\nX-Drop: 1\r\nX-Keep: 2\r\n\r\nGET /after-close HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET / HTTP/1.0\r\n\r\nGET /after HTTP/1.0\r\n\r\n",
		"OPTIONS * HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 10.0.0.1\r\n\r\nDELETE /x HTTP/1.1\r\nHost: a\r\nTe: trailers, deflate\r\nUpgrade: websocket\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nshort",
		"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: [fe80::1%25eth0]:80\r\n\r\n",
		"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: k\r\n\r\nGET /after HTTP/1.1\r\nHost: a\r\n\r\n",
		// Bodies that come whole with their head, which weir's own exchange
		// carries: a length with leading zeros, the same length twice, a
		// CRLF after a POST, a GET's body, an Idempotency-Key; a length
		// with a sign, two that differ; HTTP/1.0's Transfer-Encoding, which
		// the length overrides.
		"POST /z HTTP/1.1\r\nHost: a\r\nContent-Length: 005\r\n\r\nhelloPOST /y HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi\r\nGET /g HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nbody" +
			"DELETE /d HTTP/1.1\r\nHost: a\r\nIdempotency-Key: k\r\nContent-Length: 1\r\n\r\nx",
		"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\n1POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello",
		"PUT / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
		"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	rec := startRecorder(f)
	s := serveOn(f, Config{
		ReadHeaderTimeout: 2 * time.Second, MaxHeaderBytes: 8 << 10,
		XForwardedFor: true, XForwardedProto: true,
	}, []Backend{{Addr: rec.addr, Weight: 1, Usable: true}})
	addr := s.Addr().String()
	owed := 0 // see checkForwarded
	f.Fuzz(func(t *testing.T, in []byte) {
		want := clientRequests(in)
		rec.reset()
		answers := exchangeRaw(t, addr, in, answered(want))
		// Every request is through weir and read whole by the backend, so
		// none of this input's is taken for the next one's (but see owed).
		waitfor.Value(t, 5*time.Second, "weir and the backend done with every request", func() (any, bool) {
			sn := s.Snapshot()
			unread := rec.unread()
			return [3]int64{sn.Connections, sn.InFlight, unread}, sn.Connections == 0 && sn.InFlight == 0 && unread == 0
		})
		got := checkForwarded(t, in, want, rec.take(), rec.addr.String(), &owed)
		checkAnswers(t, in, want, got, answers)
	})
}

// wantReq is one request as Go's reader reads it from the client's bytes.
type wantReq struct {
	req      *http.Request
	body     []byte
	complete bool // the body was there whole
	forward  bool // a backend is to get it (CONNECT is answered by weir)
}

// clientRequests reads in as a keep-alive client's requests, the way the
// connection loop must: http.ReadRequest, net/http's server's checks
// (refused), a POST's trailing CRLF skipped, until the input ends, a request
// fails to read or to pass, asks to close, or leaves HTTP/1.1 (an h2c upgrade
// or an Expect the loop does not know end the exchange there).
func clientRequests(in []byte) []wantReq {
	var out []wantReq
	src := bytes.NewReader(in)
	br := bufio.NewReader(src)
	lastPOST := false
	for {
		if lastPOST {
			peek, _ := br.Peek(4)
			br.Discard(leadingCRLF(peek))
		}
		head := strings.ToLower(string(in[len(in)-src.Len()-br.Buffered():]))
		if n := headLen([]byte(head)); n > 0 {
			head = head[:n]
		}
		req, err := http.ReadRequest(br)
		if err != nil {
			return out
		}
		lastPOST = req.Method == http.MethodPost
		if refused(req) {
			return out
		}
		if isH2CUpgrade(req) {
			return out
		}
		if ex := req.Header["Expect"]; ex != nil && (len(ex) != 1 || !strings.EqualFold(ex[0], "100-continue")) {
			return out
		}
		body, berr := io.ReadAll(req.Body)
		w := wantReq{req: req, body: body, complete: berr == nil, forward: req.Method != http.MethodConnect}
		out = append(out, w)
		if !w.complete || req.Close {
			return out
		}
		// Framing a proxy in front may have read otherwise (RFC 9112 6.1, 6.3):
		// answered, then the connection closed; so is a chunked or HTTP/1.0
		// request whose head is longer than the loop's 4 KiB reader, which it
		// cannot look through.
		te, cl := strings.Contains(head, "\ntransfer-encoding:"), strings.Contains(head, "\ncontent-length:")
		unseen := len(head) > 4<<10 && (len(req.TransferEncoding) > 0 || !req.ProtoAtLeast(1, 1))
		if te && (cl || !req.ProtoAtLeast(1, 1)) || unseen {
			return out
		}
	}
}

// refused: a request a server must answer with an error and no backend may
// get (RFC 9112 3.2, RFC 9110 5.1 and 5.5, as net/http's server has them;
// http.ReadRequest refuses a second Host itself).
func refused(req *http.Request) bool {
	if req.ProtoMajor != 1 || req.Host == "" && req.ProtoAtLeast(1, 1) && req.Method != http.MethodConnect ||
		!httpguts.ValidHostHeader(req.Host) {
		return true
	}
	for k, vv := range req.Header {
		if !httpguts.ValidHeaderFieldName(k) || slices.ContainsFunc(vv, func(v string) bool { return !httpguts.ValidHeaderFieldValue(v) }) {
			return true
		}
	}
	return false
}

// exchangeRaw sends in on a new connection, reads an answer to each request
// of reqs, ends its side of the connection, and returns all the connection
// loop sent before it closed. The client keeps its side open until it has its
// answers: the loop takes a client that ends its side as gone, and breaks off
// a request still unanswered then.
func exchangeRaw(t *testing.T, addr string, in []byte, reqs []*http.Request) []byte {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		c.Write(in) // fails if weir closed first: its answer says why
	}()
	var got bytes.Buffer
	br := bufio.NewReader(io.TeeReader(c, &got))
	for _, req := range reqs {
		resp, err := readFinal(br, req)
		if err != nil {
			break // checkAnswers says what is missing
		}
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			break
		}
	}
	<-wrote
	c.(*net.TCPConn).CloseWrite()
	if _, err := io.Copy(io.Discard, br); err != nil && !errors.Is(err, net.ErrClosed) && !isReset(err) {
		t.Fatalf("reading the answers: %v (input %q)", err, in)
	}
	return got.Bytes()
}

// answered is the requests of want that get an answer before the connection
// ends: all but one whose body never came whole.
func answered(want []wantReq) []*http.Request {
	var out []*http.Request
	for _, w := range want {
		if w.complete {
			out = append(out, w.req)
		}
	}
	return out
}

// checkForwarded: the backend got the forwarded requests of want, in order,
// each as the client sent it; a request whose body never came whole may have
// gone with part of it, or not at all. It returns the records that are this
// input's.
//
// A request whose body broke off can reach the backend after the client has
// seen its answer and closed: http.Transport (which carries requests with a
// body) may still be writing it when RoundTrip has returned. owed counts such
// requests of earlier inputs that have not come yet; a record with a broken
// body that is not this input's must be one of them.
func checkForwarded(t *testing.T, in []byte, want []wantReq, got []recorded, backend string, owed *int) []recorded {
	t.Helper()
	var fw []wantReq
	for _, w := range want {
		if w.forward {
			fw = append(fw, w)
		}
	}
	incomplete := len(fw) > 0 && !fw[len(fw)-1].complete
	mine := -1
	if incomplete {
		for i := len(got) - 1; i >= 0; i-- {
			if got[i].broken && sameRequest(fw[len(fw)-1], got[i], backend) == "" {
				mine = i
				break
			}
		}
	}
	var own []recorded
	late := 0
	for i, g := range got {
		switch {
		case i == mine:
		case g.broken:
			late++
		default:
			own = append(own, g)
		}
	}
	if late > *owed {
		t.Fatalf("the backend got %d requests with a broken body that no input sent\ninput %q\ngot %s", late-*owed, in, describe(got))
	}
	*owed -= late
	switch {
	case mine >= 0:
		own = append(own, got[mine])
	case incomplete:
		fw = fw[:len(fw)-1] // its head may not have gone before the body failed, or may go later
		*owed++
	}
	if len(own) != len(fw) {
		t.Fatalf("the backend got %d requests, want %d\ninput %q\ngot %s", len(own), len(fw), in, describe(got))
	}
	for i, g := range own {
		if why := sameRequest(fw[i], g, backend); why != "" {
			t.Fatalf("request %d: %s\ninput %q\ngot %s", i, why, in, describe(got))
		}
	}
	return own
}

// sameRequest says how g differs from what w must be at the backend.
func sameRequest(w wantReq, g recorded, backend string) string {
	r := w.req
	if g.err != "" {
		return "the backend could not read it: " + g.err
	}
	if g.method != r.Method {
		return fmt.Sprintf("method %q, want %q", g.method, r.Method)
	}
	if wantURI := originForm(r); g.uri != wantURI {
		return fmt.Sprintf("target %q, want %q", g.uri, wantURI)
	}
	wantHost, err := httpguts.PunycodeHostPort(r.Host)
	if err != nil {
		wantHost = ""
	}
	if wantHost = withoutZone(wantHost); wantHost == "" {
		wantHost = backend // a request without one (HTTP/1.0) gets the backend's, as http.Request.Write gives it
	}
	if g.host != wantHost {
		return fmt.Sprintf("Host %q, want %q", g.host, wantHost)
	}
	if w.complete && !bytes.Equal(g.body, w.body) {
		return fmt.Sprintf("body %q, want %q", g.body, w.body)
	}
	if !w.complete && (!g.broken || !bytes.HasPrefix(w.body, g.body)) {
		return fmt.Sprintf("body %q (broken off: %v), want a part of %q, broken off", g.body, g.broken, w.body)
	}
	if w.complete && g.broken {
		return "its body broke off"
	}
	// An upgrade (RFC 9110 7.8: HTTP/1.1, Connection naming upgrade, no body;
	// h2c is weir's own) goes on with both fields, for the backend to switch.
	up := r.Header["Upgrade"]
	upgrade := r.ProtoAtLeast(1, 1) && len(up) > 0 && httpguts.HeaderValuesContainsToken(r.Header["Connection"], "upgrade") &&
		!httpguts.HeaderValuesContainsToken(up, "h2c") && r.ContentLength == 0 && len(r.TransferEncoding) == 0
	if upgrade && (!slices.Equal(g.header["Connection"], []string{"Upgrade"}) || !slices.Equal(g.header["Upgrade"], up)) {
		return fmt.Sprintf("an upgrade to %q came with Connection %q and Upgrade %q", up, g.header["Connection"], g.header["Upgrade"])
	}
	want := endToEnd(r.Header)
	for k, vv := range want {
		if !slices.Equal(g.header[k], vv) {
			return fmt.Sprintf("header %s: %q, want %q", k, g.header[k], vv)
		}
	}
	for k, vv := range g.header {
		if _, ok := want[k]; ok {
			continue
		}
		switch k {
		case "X-Forwarded-For":
			prior := strings.Join(r.Header["X-Forwarded-For"], ", ")
			if wantXFF := strings.TrimPrefix(prior+", 127.0.0.1", ", "); len(vv) != 1 || vv[0] != wantXFF {
				return fmt.Sprintf("X-Forwarded-For %q, want %q", vv, wantXFF)
			}
		case "X-Forwarded-Proto":
			if len(vv) != 1 || vv[0] != "http" {
				return fmt.Sprintf("X-Forwarded-Proto %q, want http", vv)
			}
		case "Te":
			if len(vv) != 1 || vv[0] != "trailers" || !strings.Contains(strings.ToLower(strings.Join(r.Header["Te"], ",")), "trailers") {
				return fmt.Sprintf("Te %q from the client's %q", vv, r.Header["Te"])
			}
		case "Content-Length": // the writers' own framing, checked by the body
		case "Connection", "Upgrade":
			if !upgrade {
				return fmt.Sprintf("header %s: %q, which the client did not send", k, vv)
			}
		default:
			return fmt.Sprintf("header %s: %q, which the client did not send", k, vv)
		}
	}
	return ""
}

// originForm is the target a backend gets for r: its path and query as the
// client wrote them, whatever form it used; rebuilt from the parsed URL where
// there is no such path (absolute form without one, or one starting "//").
func originForm(r *http.Request) string {
	t := r.RequestURI
	pathEnd := strings.IndexByte(t, '?')
	if pathEnd < 0 {
		pathEnd = len(t)
	}
	if i := strings.Index(t[:pathEnd], "://"); i > 0 && !strings.HasPrefix(t, "/") {
		if slash := strings.IndexByte(t[i+3:pathEnd], '/'); slash >= 0 {
			t = t[i+3+slash:]
		} else {
			t = ""
		}
	}
	if strings.HasPrefix(t, "/") && !strings.HasPrefix(t, "//") {
		return t
	}
	o := url.URL{Path: r.URL.Path, RawPath: r.URL.RawPath, RawQuery: r.URL.RawQuery, ForceQuery: r.URL.ForceQuery}
	return o.RequestURI()
}

// endToEnd is the part of a client's header a backend must get as it is: less
// the hop-by-hop fields and those Connection names, Host and the framing
// (sent as the request line's and body's own), and the fields the proxy adds to.
func endToEnd(h http.Header) http.Header {
	out := http.Header{}
	for k, vv := range h {
		switch k {
		case "Host", "Content-Length", "X-Forwarded-For", "X-Forwarded-Proto", "Te":
			continue
		}
		if hopByHop(k) || !httpguts.ValidHeaderFieldName(k) {
			continue
		}
		if k == "User-Agent" {
			if vv[0] == "" {
				continue
			}
			vv = vv[:1]
		}
		out[k] = vv
	}
	removeConnectionHeaders(out, h)
	return out
}

// checkAnswers: the client got one answer per request, in order; a forwarded
// request's is the backend's (X-Seq says which request it answered), another's
// an error status. After the last request the loop closes.
func checkAnswers(t *testing.T, in []byte, want []wantReq, got []recorded, answers []byte) {
	t.Helper()
	br := bufio.NewReader(bytes.NewReader(answers))
	gi := 0
	for i, w := range want {
		if !w.complete {
			return // a 502, a 400 or nothing: the request broke off
		}
		resp, err := readFinal(br, w.req)
		if err != nil {
			t.Fatalf("answer %d: %v\ninput %q\nanswers %q", i, err, in, answers)
		}
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("answer %d's body: %v\ninput %q\nanswers %q", i, err, in, answers)
		}
		if !w.forward {
			if resp.StatusCode < 400 {
				t.Fatalf("answer %d: %s to a request no backend may get\ninput %q\nanswers %q", i, resp.Status, in, answers)
			}
			continue
		}
		seq := strconv.Itoa(got[gi].seq)
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Seq") != seq ||
			(w.req.Method != http.MethodHead && string(body) != "#"+seq) {
			t.Fatalf("answer %d: %s X-Seq %q body %q, want the backend's answer to request %s\ninput %q\nanswers %q",
				i, resp.Status, resp.Header.Get("X-Seq"), body, seq, in, answers)
		}
		gi++
	}
	if rest, _ := io.ReadAll(br); len(want) > 0 && want[len(want)-1].complete && len(rest) > 0 {
		// After the last request the client sent, only a 400 for what followed
		// it (bytes that were not a request) may come.
		resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(rest)), nil)
		if err != nil || resp.StatusCode < 400 {
			t.Fatalf("after the last answer: %q\ninput %q", rest, in)
		}
	}
}

// readFinal reads the answer to req, past any 1xx (100 Continue).
func readFinal(br *bufio.Reader, req *http.Request) (*http.Response, error) {
	for {
		resp, err := http.ReadResponse(br, req)
		if err != nil || resp.StatusCode >= 200 {
			return resp, err
		}
	}
}

// recorder is a backend that reads requests with Go's reader, keeps them, and
// answers each with its sequence number (X-Seq and the body "#n").
type recorder struct {
	addr  netip.AddrPort
	busy  atomic.Int32 // requests being read or answered
	mu    sync.Mutex
	got   []recorded
	seq   int
	conns map[*net.TCPConn]bool
}

type recorded struct {
	seq               int
	method, uri, host string
	header            http.Header
	body              []byte
	broken            bool   // the body ended early
	err               string // not a request
	at                time.Time
}

func describe(rs []recorded) string {
	var b strings.Builder
	for _, r := range rs {
		fmt.Fprintf(&b, "\n  %s #%d %s %q Host %q %v body %q broken %v err %q", r.at.Format("05.000000"), r.seq, r.method, r.uri, r.host, r.header, r.body, r.broken, r.err)
	}
	return b.String()
}

func startRecorder(tb testing.TB) *recorder {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	r := &recorder{addr: ln.Addr().(*net.TCPAddr).AddrPort(), conns: map[*net.TCPConn]bool{}}
	var conns sync.WaitGroup
	tb.Cleanup(func() {
		ln.Close()
		conns.Wait()
	})
	conns.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Go(func() { r.serve(c) })
		}
	})
	return r
}

func (r *recorder) serve(c net.Conn) {
	tc := c.(*net.TCPConn)
	r.mu.Lock()
	r.conns[tc] = true
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.conns, tc)
		r.mu.Unlock()
		c.Close()
	}()
	br := bufio.NewReader(c)
	for {
		if _, err := br.Peek(1); err != nil {
			return
		}
		r.busy.Add(1)
		ok := r.one(c, br)
		r.busy.Add(-1)
		if !ok {
			return
		}
	}
}

// one reads and answers a request; false: the connection is done.
func (r *recorder) one(c net.Conn, br *bufio.Reader) bool {
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	req, err := http.ReadRequest(br)
	if err != nil {
		if !errors.Is(err, io.EOF) && !isReset(err) {
			r.add(recorded{err: err.Error()})
		}
		return false
	}
	body, berr := io.ReadAll(req.Body)
	seq := r.add(recorded{method: req.Method, uri: req.RequestURI, host: req.Host, header: req.Header, body: body, broken: berr != nil})
	if berr != nil {
		return false
	}
	b := "#" + strconv.Itoa(seq)
	head := fmt.Sprintf("HTTP/1.1 200 OK\r\nX-Seq: %d\r\nContent-Length: %d\r\n\r\n", seq, len(b))
	if req.Method != http.MethodHead {
		head += b
	}
	_, err = c.Write([]byte(head))
	return err == nil
}

func (r *recorder) add(rc recorded) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq++
	rc.seq = r.seq
	rc.at = time.Now()
	r.got = append(r.got, rc)
	return rc.seq
}

// unread is the requests being read or answered and the bytes waiting in the
// backend's sockets that no reader has taken yet.
func (r *recorder) unread() int64 {
	n := int64(r.busy.Load())
	r.mu.Lock()
	defer r.mu.Unlock()
	for c := range r.conns {
		if rc, err := c.SyscallConn(); err == nil {
			rc.Control(func(fd uintptr) {
				if q, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil {
					n += int64(q)
				}
			})
		}
	}
	return n
}

func (r *recorder) reset() {
	r.mu.Lock()
	r.got = nil
	r.mu.Unlock()
}

func (r *recorder) take() []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// FuzzH1Answers answers a client's request with arbitrary bytes from a real
// backend and checks what the client gets against what the same bytes mean to
// Go's own answer reader: an answer it cannot read is a 502; one it can is
// passed on with the same status, end-to-end header fields and body (1xx
// answers before it left out); one whose body breaks off never reaches the
// client as a whole answer. The first byte of the input picks the request
// (odd: a HEAD; else with bit 1 set a POST whose short body comes with its
// head, which weir's own exchange carries as it does the GET), the rest is the
// backend's answer, after which it ends its side of the connection.
//
//	go test -run '^$' -fuzz FuzzH1Answers -fuzztime 2m ./userspace/httplb/
func FuzzH1Answers(f *testing.F) {
	for _, s := range []string{
		"\x00HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\nX-A: 2\r\n\r\nok",
		"\x01HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"\x00HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n2\r\nok\r\n0\r\nX-T: 1\r\n\r\n",
		"\x00HTTP/1.1 404 Not Found\r\nConnection: close, X-Drop\r\nX-Drop: 1\r\nX-Keep: 1\r\n\r\nuntil the end",
		"\x00HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
		"\x00HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
		"\x00HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil",
		"\x00HTTP/1.0 200 OK\r\n\r\nold",
		"\x00not an answer\r\n\r\n",
		"\x00HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
		"\x02HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
		"\x02HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 413 Content Too Large\r\nConnection: close, X-Drop\r\nX-Drop: 1\r\n\r\nno",
		"\x02HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil",
	} {
		f.Add([]byte(s))
	}
	var answer atomic.Pointer[[]byte]
	// finsOut counts the backend's connections whose end weir's kernel has
	// yet to acknowledge: an input waits for none before the next, whose
	// request would otherwise find the last one's connection in the pool
	// still open, go out on it just as the end comes, and get a 502 (a POST
	// is not sent again) for an answer the backend never had the request for.
	var finsOut atomic.Int32
	be := rawBackend(f, func(c net.Conn) {
		br := bufio.NewReader(c)
		if _, ok := nextRequest(br); !ok {
			return
		}
		finsOut.Add(1)
		c.Write(*answer.Load())
		c.(*net.TCPConn).CloseWrite()
		awaitFINAcked(c.(*net.TCPConn), time.Now().Add(5*time.Second))
		finsOut.Add(-1)
		io.Copy(io.Discard, br) // until weir closes its side
	})
	s := serveOn(f, Config{ReadHeaderTimeout: 2 * time.Second, MaxHeaderBytes: 8 << 10}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	addr := s.Addr().String()
	var prev []byte // the input before, for a failure that depends on it
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		defer func() {
			if t.Failed() {
				t.Logf("the input before: %q", prev)
			}
			prev = in
		}()
		method, raw := http.MethodGet, in[1:]
		head := "\r\n" // the head's end, and the body
		switch {
		case in[0]&1 == 1:
			method = http.MethodHead
		case in[0]&2 == 2:
			method, head = http.MethodPost, "Content-Length: 7\r\n\r\n{\"a\":1}"
		}
		answer.Store(&raw)
		req := &http.Request{Method: method}
		want, wantBody, wantErr := backendAnswer(raw, req)
		got := exchangeRaw(t, addr, []byte(method+" / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n"+head), []*http.Request{req})
		waitfor.Value(t, 5*time.Second, "no request in flight", func() (any, bool) {
			sn := s.Snapshot()
			return sn, sn.Connections == 0 && sn.InFlight == 0 && finsOut.Load() == 0
		})
		resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(got)), req)
		if err != nil {
			if want != nil && wantErr != nil {
				return // the body broke off before the answer's head went out, or with it
			}
			t.Fatalf("the client could not read its answer: %v\nbackend sent %q\nclient got %q", err, raw, got)
		}
		body, berr := io.ReadAll(resp.Body)
		switch {
		case want == nil:
			if resp.StatusCode != http.StatusBadGateway {
				t.Fatalf("%s for an answer Go cannot read (%v); want 502\nbackend sent %q\nclient got %q", resp.Status, wantErr, raw, got)
			}
		case wantErr != nil:
			if berr == nil {
				t.Fatalf("a whole answer (%s, body %q) for one whose body broke off (%v)\nbackend sent %q\nclient got %q", resp.Status, body, wantErr, raw, got)
			}
		default:
			if berr != nil || resp.StatusCode != want.StatusCode || !bytes.Equal(body, wantBody) {
				t.Fatalf("%s body %q (%v); want %d body %q\nbackend sent %q\nclient got %q", resp.Status, body, berr, want.StatusCode, wantBody, raw, got)
			}
			if why := sameAnswerHeader(want.Header, resp.Header); why != "" {
				t.Fatalf("%s\nbackend sent %q\nclient got %q", why, raw, got)
			}
		}
	})
}

// awaitFINAcked polls c, whose writing side was shut, until its peer's kernel
// has acknowledged the FIN (the socket left ESTABLISHED and FIN_WAIT1), so a
// read or peek on the peer's side finds the end, or until deadline.
func awaitFINAcked(c *net.TCPConn, deadline time.Time) {
	rc, err := c.SyscallConn()
	if err != nil {
		return
	}
	for time.Now().Before(deadline) {
		var state uint8
		rc.Control(func(fd uintptr) {
			if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
				state = info.State
			}
		})
		if state != unix.BPF_TCP_ESTABLISHED && state != unix.BPF_TCP_FIN_WAIT1 {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// backendAnswer reads raw as weir's exchange must: 1xx answers skipped, then
// the answer and its body. nil: not an answer; bodyErr: the body broke off.
func backendAnswer(raw []byte, req *http.Request) (resp *http.Response, body []byte, err error) {
	src := bytes.NewReader(raw)
	br := bufio.NewReader(src)
	for {
		at := len(raw) - src.Len() - br.Buffered()
		resp, err = http.ReadResponse(br, req)
		switch {
		case err != nil:
		case resp.StatusCode < 100:
			err = errors.New("status under 100") // Go reads any three digits; no client may get it
		case resp.StatusCode == http.StatusSwitchingProtocols:
			err = errors.New("101 to a request without an upgrade")
		}
		if err != nil {
			return nil, nil, err
		}
		if resp.StatusCode >= 200 {
			// The fields a Connection field names are hop-by-hop, also when
			// it says close, which Go's reader drops it for, names and all;
			// weir finds them in a head that fits its 32 KiB reader.
			tp := textproto.NewReader(bufio.NewReader(bytes.NewReader(raw[at:])))
			tp.ReadLine()
			if h, herr := tp.ReadMIMEHeader(); herr == nil && headLen(raw[at:]) <= 32<<10 {
				for _, v := range h["Connection"] {
					for _, name := range strings.Split(v, ",") {
						resp.Header.Del(strings.TrimSpace(name))
					}
				}
			}
			break
		}
	}
	body, err = io.ReadAll(resp.Body)
	return resp, body, err
}

// sameAnswerHeader says how the client's answer header differs from the
// backend's: the end-to-end fields must be the same; the proxy may add Date
// (where the backend sent none), its own framing and Connection.
func sameAnswerHeader(be, client http.Header) string {
	want := endToEnd(be)
	delete(want, "Content-Length")
	for k, vv := range want {
		if !slices.Equal(client[k], vv) {
			return fmt.Sprintf("header %s: %q, want %q", k, client[k], vv)
		}
	}
	for k, vv := range client {
		if _, ok := want[k]; ok {
			continue
		}
		switch k {
		case "Content-Length", "Connection":
		case "Date":
			if be["Date"] != nil {
				return fmt.Sprintf("Date %q, the backend's was %q", vv, be["Date"])
			}
		default:
			return fmt.Sprintf("header %s: %q, which the backend did not send", k, vv)
		}
	}
	return ""
}
