//go:build linux

package health

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/waitfor"
)

// A backend moved to a service without checks while a check of its old
// service is in flight is up, and stays so: the old check's failure (here the
// third of fall 3) does not count, as after an address change. A service
// without checks would never check it again.
func TestMoveToUncheckedServiceDropsCheckInFlight(t *testing.T) {
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	var checks atomic.Int32
	c := &Checker{
		Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if checks.Add(1) <= 2 {
				// The first two checks fail at once: 2 of fall 3.
				return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
			}
			select {
			case started <- struct{}{}:
			default:
			}
			select {
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
		},
	}
	if err := c.SetService("active", Config{Check: Check{Interval: 50 * time.Millisecond, Timeout: 5 * time.Second, Initial: Up}}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetService("passive", Config{Check: Check{Kind: None}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: "192.0.2.1:80", Service: "active"}); err != nil {
		t.Fatal(err)
	}
	run(t, c)
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("no check started")
	}
	if err := c.Set(Backend{ID: "b", Addr: "192.0.2.1:80", Service: "passive"}); err != nil {
		t.Fatal(err)
	}
	if st, _ := c.Status("b"); st.State != Up || !st.Usable {
		t.Fatalf("right after the move to a service without checks: got %v (usable %t); want up", st.State, st.Usable)
	}
	close(release) // the old service's check now fails
	waitfor.Cond(time.Second, func() bool { st, _ := c.Status("b"); return st.State != Up })
	time.Sleep(300 * time.Millisecond) // several of the old interval: nothing brings it back
	st, _ := c.Status("b")
	t.Logf("after the in-flight check of the old service failed: state %v active %v usable %t reason %q, checks dialed %d",
		st.State, st.Active, st.Usable, st.Reason, checks.Load())
	if st.State != Up || !st.Usable {
		t.Errorf("backend in a service without active checks: got %v (usable %t, reason %q); want up", st.State, st.Usable, st.Reason)
	}
}

// Interim answers (103 Early Hints) before the answer are read past, as RFC
// 9110 15.2 asks of a client and Go's own client does: the check judges the
// final answer.
func TestHTTPInterimAnswersSkipped(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload; as=style")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		fmt.Fprint(w, "ok")
	}))
	defer srv.Close()
	// Control: Go's client sees the final answer.
	resp, err := srv.Client().Get(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("control: http.Client got %d; want 200", resp.StatusCode)
	}
	u, _ := url.Parse(srv.URL)
	c := &Checker{}
	if err := c.SetService("web", Config{Check: Check{Kind: HTTP, Interval: 50 * time.Millisecond, Timeout: 500 * time.Millisecond, HTTP: HTTPCheck{Path: "/healthz", Body: "ok"}}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	sub := c.Subscribe()
	defer sub.Close()
	run(t, c)
	ch := waitChange(t, sub, "b", 5*time.Second, func(ch Change) bool { return ch.To != Unknown })
	st, _ := c.Status("b")
	t.Logf("first verdict: %v (reason %q, last check error %v)", ch.To, ch.Reason, st.Last.Err)
	if ch.To != Up {
		t.Errorf("backend answering 103 then 200 ok: got %v (%q); want up", ch.To, ch.Reason)
	}
}

// tunPeer is a TUN device in a test namespace whose far side the test plays:
// it answers SYNs to the ports in delay with a SYN-ACK after that delay and
// leaves every other SYN unanswered, so a test can put a round trip of its
// choice (or a black hole) between a syn check and its answer.
type tunPeer struct {
	f    *os.File
	mu   sync.Mutex
	syns map[uint16][]time.Time // arrival of SYNs by destination port
}

// newTunPeer makes device ht0 with 10.77.0.1/24 in ns; 10.77.0.2 is the peer.
func newTunPeer(t *testing.T, ns *netNS, delay map[uint16]time.Duration) *tunPeer {
	t.Helper()
	var fd int
	if err := ns.do(func() error {
		var err error
		fd, err = unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		ifr, err := unix.NewIfreq("ht0")
		if err != nil {
			return err
		}
		ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			return fmt.Errorf("TUNSETIFF: %w", err)
		}
		l, err := netlink.LinkByName("ht0")
		if err != nil {
			return err
		}
		addr, _ := netlink.ParseAddr("10.77.0.1/24")
		if err := netlink.AddrAdd(l, addr); err != nil {
			return err
		}
		return netlink.LinkSetUp(l)
	}); err != nil {
		t.Fatalf("tun in %s: %v", ns.name, err)
	}
	p := &tunPeer{f: os.NewFile(uintptr(fd), "tun"), syns: map[uint16][]time.Time{}}
	done := make(chan struct{})
	var timers sync.WaitGroup
	// Exits when the cleanup closes p.f.
	go func() {
		defer close(done)
		buf := make([]byte, 2048)
		for {
			n, err := p.f.Read(buf)
			if err != nil {
				return
			}
			pkt := buf[:n]
			if n < 40 || pkt[0]>>4 != 4 || pkt[9] != 6 {
				continue
			}
			ihl := int(pkt[0]&0xf) * 4
			tcp := pkt[ihl:]
			if len(tcp) < 20 || tcp[13] != tcpSYN {
				continue // the checker kernel's RSTs to our SYN-ACKs, and the like
			}
			src := netip.AddrFrom4([4]byte(pkt[12:16]))
			dst := netip.AddrFrom4([4]byte(pkt[16:20]))
			sport, dport := binary.BigEndian.Uint16(tcp[0:]), binary.BigEndian.Uint16(tcp[2:])
			seq := binary.BigEndian.Uint32(tcp[4:])
			p.mu.Lock()
			p.syns[dport] = append(p.syns[dport], time.Now())
			p.mu.Unlock()
			d, ok := delay[dport]
			if !ok {
				continue // a black hole
			}
			reply := make([]byte, ipv4Len+synLen)
			buildIPv4(reply, dst.As4(), src.As4(), 1)
			binary.BigEndian.PutUint16(reply[10:], ipv4Checksum(reply[:ipv4Len]))
			seg := buildSYN(reply[ipv4Len:], dst, src, dport, sport, 12345)
			seg[13] = tcpSYN | tcpACK
			binary.BigEndian.PutUint32(seg[8:], seq+1)
			binary.BigEndian.PutUint16(seg[16:], 0)
			binary.BigEndian.PutUint16(seg[16:], tcpChecksum(dst, src, seg))
			timers.Add(1)
			time.AfterFunc(d, func() { defer timers.Done(); p.f.Write(reply) })
		}
	}()
	// The reader ends first, so no reply timer starts while Wait waits.
	t.Cleanup(func() { p.f.Close(); <-done; timers.Wait() })
	return p
}

func ipv4Checksum(h []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(h); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(h[i:]))
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

// With every syn source port held (here 1 port and a black-holed backend), a
// due check waits for a port; its timeout then runs from when its SYN can go,
// not from before the wait: a backend 80 ms away with a 150 ms timeout passes
// every check.
func TestSynTimeoutStartsWhenPortFree(t *testing.T) {
	ns := newNetNS(t)
	const (
		goodPort, holePort = 80, 81
		rtt                = 80 * time.Millisecond
		timeout            = 150 * time.Millisecond
	)
	peer := newTunPeer(t, ns, map[uint16]time.Duration{goodPort: rtt})
	var (
		mu      sync.Mutex
		results = map[string][]Result{}
	)
	c := &Checker{SynPorts: [2]uint16{62400, 62400}, OnCheck: func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		results[r.ID] = append(results[r.ID], r)
	}}
	// The black hole's service has a longer timeout, so it holds the port
	// most of the time.
	for svc, to := range map[string]time.Duration{"good": timeout, "hole": 300 * time.Millisecond} {
		if err := c.SetService(svc, Config{Check: Check{Method: MethodSyn, Interval: 400 * time.Millisecond, Timeout: to, Jitter: 0.5}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Set(Backend{ID: "good", Addr: fmt.Sprintf("10.77.0.2:%d", goodPort), Service: "good"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "hole", Addr: fmt.Sprintf("10.77.0.2:%d", holePort), Service: "hole"}); err != nil {
		t.Fatal(err)
	}
	stop := ns.start(t, c)
	time.Sleep(6 * time.Second)
	stop()

	mu.Lock()
	defer mu.Unlock()
	peer.mu.Lock()
	defer peer.mu.Unlock()
	var failed []Result
	for _, r := range results["good"] {
		if r.Err != nil {
			failed = append(failed, r)
		}
	}
	for _, r := range failed {
		// When did its SYN reach the peer? The first one after its Start.
		sent := time.Time{}
		for _, at := range peer.syns[goodPort] {
			if !at.Before(r.Start) {
				sent = at
				break
			}
		}
		t.Logf("good: %v; start %s, SYN on the wire %v after start, check ended %v after start",
			r.Err, r.Start.Format("15:04:05.000"), sent.Sub(r.Start).Round(time.Millisecond), r.Duration.Round(time.Millisecond))
	}
	t.Logf("good: %d checks, %d failed; hole: %d checks; SYNs seen: good %d, hole %d",
		len(results["good"]), len(failed), len(results["hole"]), len(peer.syns[goodPort]), len(peer.syns[holePort]))
	if len(results["good"]) < 8 {
		t.Fatalf("good: %d checks in 6 s; want at least 8", len(results["good"]))
	}
	// A check or two may be late on a loaded machine (the race detector's
	// slowdown, say); the wait eating the timeout failed most of them.
	if len(failed)*10 > len(results["good"]) {
		t.Errorf("good (answers every SYN after %v, timeout %v): %d of %d checks failed; want at most a tenth", rtt, timeout, len(failed), len(results["good"]))
	}
}

// While every in-flight slot is held by HTTP checks of backends that never
// answer, syn checks (which hold no slot) still go out on time and are
// judged by their answers: the scheduler does not block on a slot.
func TestSynChecksGoOnWhileSlotsAreFull(t *testing.T) {
	ns := newNetNS(t)
	// The syn-checked backend answers every SYN 20 ms later (a backend in
	// the next rack), far within its 100 ms timeout.
	newTunPeer(t, ns, map[uint16]time.Duration{80: 20 * time.Millisecond})
	good := "10.77.0.2:80"
	silent := silentServer(t)

	var (
		mu      sync.Mutex
		results = map[string][]Result{}
	)
	c := &Checker{MaxInFlight: 2, SynPorts: [2]uint16{62500, 62509}, OnCheck: func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		results[r.Service] = append(results[r.Service], r)
	}}
	if err := c.SetService("syn", Config{Check: Check{Method: MethodSyn, Interval: 50 * time.Millisecond, Timeout: 100 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetService("http", Config{Check: Check{Kind: HTTP, Interval: 200 * time.Millisecond, Timeout: 150 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "good", Addr: good, Service: "syn"}); err != nil {
		t.Fatal(err)
	}
	for i := range 6 {
		if err := c.Set(Backend{ID: fmt.Sprint("silent", i), Addr: silent, Service: "http"}); err != nil {
			t.Fatal(err)
		}
	}
	stop := ns.start(t, c)
	time.Sleep(3 * time.Second)
	stop()
	mu.Lock()
	defer mu.Unlock()
	var failed []Result
	for _, r := range results["syn"] {
		if r.Err != nil {
			failed = append(failed, r)
		}
	}
	for i, r := range results["syn"] {
		if i < 12 {
			t.Logf("syn check %d: %v after %v (lag %v)", i, r.Err, r.Duration.Round(time.Millisecond), r.Lag().Round(time.Millisecond))
		}
	}
	for i, r := range failed {
		if i < 5 {
			t.Logf("good: %v after %v (lag %v)", r.Err, r.Duration.Round(time.Millisecond), r.Lag().Round(time.Millisecond))
		}
	}
	t.Logf("syn backend: %d checks, %d failed; http checks: %d", len(results["syn"]), len(failed), len(results["http"]))
	if len(results["syn"]) < 5 {
		t.Fatalf("syn backend: %d checks in 3 s; want at least 5", len(results["syn"]))
	}
	// As above: a late check or two on a loaded machine, not most of them.
	if len(failed)*10 > len(results["syn"]) {
		t.Errorf("syn-checked backend that answers within 20ms: %d of %d checks failed; want at most a tenth", len(failed), len(results["syn"]))
	}
}

// While every in-flight slot is held by HTTP checks that run to their
// timeout, an ejection still ends on time.
func TestEjectionEndsWhileSlotsAreFull(t *testing.T) {
	silent := silentServer(t)

	c := &Checker{MaxInFlight: 1}
	if err := c.SetService("http", Config{Check: Check{Kind: HTTP, Interval: 1500 * time.Millisecond, Timeout: 1500 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := c.Set(Backend{ID: fmt.Sprint("silent", i), Addr: silent, Service: "http"}); err != nil {
			t.Fatal(err)
		}
	}
	const base = 100 * time.Millisecond
	if err := c.SetService("passive", Config{Check: Check{Kind: None}, Outlier: Outlier{Consecutive: 1, BaseEjection: base, MaxEjectionPercent: 100}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "p", Addr: "192.0.2.9:80", Service: "passive"}); err != nil {
		t.Fatal(err)
	}
	run(t, c)
	time.Sleep(2 * time.Second) // the HTTP checks now hold the slot, and Run waits for it
	var worst time.Duration
	for range 2 {
		c.Observe("p", ConnectFailure)
		st, _ := c.Status("p")
		if st.State != Ejected {
			t.Fatalf("after a failure: got %v; want ejected", st.State)
		}
		ejected := time.Now()
		waitfor.Cond(5*time.Second, func() bool { st, _ := c.Status("p"); return st.State == Up })
		d := time.Since(ejected)
		t.Logf("ejected for %v (configured %v, EjectedUntil was %v after the ejection)", d.Round(time.Millisecond), base, st.EjectedUntil.Sub(ejected).Round(time.Millisecond))
		worst = max(worst, d)
		time.Sleep(300 * time.Millisecond) // decay the multiplier back to 1
	}
	if worst > base+250*time.Millisecond {
		t.Errorf("a %v ejection lasted up to %v; want about %v", base, worst.Round(time.Millisecond), base)
	}
}

// A backend moved from an HTTP-checked service to one without checks gives
// up its kept-alive connection and its MaxKept slot.
func TestMoveToUncheckedServiceClosesKeptConn(t *testing.T) {
	var open atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "ok") }))
	srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			open.Add(1)
		case http.StateClosed, http.StateHijacked:
			open.Add(-1)
		}
	}
	srv.Start()
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	c := &Checker{}
	if err := c.SetService("http", Config{Check: Check{Kind: HTTP, Interval: 20 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetService("off", Config{Check: Check{Kind: None}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "http"}); err != nil {
		t.Fatal(err)
	}
	run(t, c)
	waitfor.Value(t, 5*time.Second, "a kept connection", func() (any, bool) {
		c.mu.RLock()
		defer c.mu.RUnlock()
		return c.kept, c.kept == 1 && c.backends["b"].keep != nil
	})
	if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "off"}); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(time.Second, func() bool { return open.Load() == 0 })
	c.mu.RLock()
	kept, keep := c.kept, c.backends["b"].keep != nil
	c.mu.RUnlock()
	t.Logf("after the move to a service without checks: connections open at the server %d, checker's kept slots %d, idle conn held %t", open.Load(), kept, keep)
	if open.Load() != 0 || kept != 0 {
		t.Errorf("after the move: got %d connections open, %d slots taken; want 0, 0", open.Load(), kept)
	}
}

// idle408Server answers each request on a connection with 200 "ok" and, when
// the connection then stays idle for idle, sends an unsolicited
// "408 Request Timeout" with Connection: close and closes it, as Google's GFE
// does (golang/go#32310) and as MDN describes for "some servers".
func idle408Server(t *testing.T, idle time.Duration) string {
	// Each connection's handler ends with its connection, which the server
	// closes after idle at most.
	return serveTCP(t, func(conn net.Conn) {
		buf := make([]byte, 0, 4096)
		tmp := make([]byte, 4096)
		for {
			conn.SetReadDeadline(time.Now().Add(idle))
			n, err := conn.Read(tmp)
			if err != nil {
				if ne, ok := err.(net.Error); ok && ne.Timeout() && len(buf) == 0 {
					io.WriteString(conn, "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
				}
				return
			}
			buf = append(buf, tmp[:n]...)
			for {
				i := bytes.Index(buf, []byte("\r\n\r\n"))
				if i < 0 {
					break
				}
				buf = buf[i+4:]
				io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			}
		}
	})
}

// A server that closes an idle kept connection with a 408 of its own (as
// Google's front ends do) does not fail the check that finds it: the 408 is
// taken for the close it is, and the request goes again on a new connection
// within the same check (docs/health.md: an idle timeout on the server never
// fails a check).
func TestHTTPIdle408RetriedOnNewConnection(t *testing.T) {
	addr := idle408Server(t, 50*time.Millisecond)
	// Control: Go's client, two requests 400 ms apart on one pooled
	// connection. Go's transport takes a 408 on an idle connection for its
	// close only if its read loop sees it before the next request goes out;
	// on a loaded machine it may not, so a 408 here gets two more tries.
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	for i := range 2 {
		status := 0
		for try := 0; try < 3 && status != 200; try++ {
			resp, err := client.Get("http://" + addr + "/")
			if err != nil {
				t.Fatalf("control request %d: %v", i, err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			status = resp.StatusCode
		}
		if status != 200 {
			t.Fatalf("control request %d: got %d; want 200", i, status)
		}
		time.Sleep(400 * time.Millisecond)
	}
	var (
		mu      sync.Mutex
		results []Result
	)
	c := &Checker{OnCheck: func(r Result) { mu.Lock(); results = append(results, r); mu.Unlock() }}
	if err := c.SetService("web", Config{Check: Check{Kind: HTTP, Interval: 150 * time.Millisecond, Timeout: 100 * time.Millisecond, Initial: Down}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: addr, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	run(t, c)
	waitfor.Value(t, 5*time.Second, "8 checks", func() (any, bool) {
		mu.Lock()
		defer mu.Unlock()
		return len(results), len(results) >= 8
	})
	mu.Lock()
	defer mu.Unlock()
	failed := 0
	for i, r := range results {
		t.Logf("check %d: %v", i, r.Err)
		if r.Err != nil {
			failed++
		}
	}
	st, _ := c.Status("b")
	t.Logf("state %v (%q)", st.State, st.Reason)
	if failed > 0 || st.State != Up {
		t.Errorf("backend answering every request with 200 (rise 2): %d of %d checks failed, state %v; want 0 failed, up", failed, len(results), st.State)
	}
}

// silentServer accepts connections and never answers: each HTTP check of it
// holds its in-flight slot until its timeout. It returns its address.
func silentServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var held sync.WaitGroup
	held.Add(1)
	// Exits when the cleanup closes ln.
	go func() {
		defer held.Done()
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() { ln.Close(); held.Wait() })
	return ln.Addr().String()
}

type closeRecorder struct {
	net.Conn
	closed atomic.Bool
}

func (c *closeRecorder) Close() error { c.closed.Store(true); return c.Conn.Close() }

// A kept connection whose server answers 408 without Connection: close is
// closed when the check goes again on a new one, not left to the collector.
func TestHTTP408KeptConnClosed(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var accepted atomic.Int32
	// Exits when ln closes; each connection's goroutine with its connection.
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			n := accepted.Add(1)
			go func() {
				defer conn.Close()
				buf := make([]byte, 0, 4096)
				tmp := make([]byte, 4096)
				reqs := 0
				for {
					m, err := conn.Read(tmp)
					if err != nil {
						return
					}
					buf = append(buf, tmp[:m]...)
					for {
						i := bytes.Index(buf, []byte("\r\n\r\n"))
						if i < 0 {
							break
						}
						buf = buf[i+4:]
						reqs++
						if n == 1 && reqs == 2 {
							// The first connection's second request: a 408 with no
							// Connection: close (the server then keeps the socket).
							io.WriteString(conn, "HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
							continue
						}
						io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
					}
				}
			}()
		}
	}()
	var mu sync.Mutex
	var conns []*closeRecorder
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		r := &closeRecorder{Conn: c}
		mu.Lock()
		conns = append(conns, r)
		mu.Unlock()
		return r, nil
	}
	cfg, err := Config{Check: Check{Kind: HTTP, Interval: time.Second, Timeout: time.Second}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	p := probe{checkRun: checkRun{addr: ln.Addr().String()}, cfg: cfg.Check, dial: dial}
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := p.runHTTP(ctx)
		cancel()
		if err != nil {
			t.Fatalf("check %d: %v", i, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(conns) != 2 {
		t.Fatalf("dialled %d connections; want 2", len(conns))
	}
	kept := p.keep != nil && p.keep.conn == net.Conn(conns[1])
	t.Logf("first connection closed: %v; second kept: %v", conns[0].closed.Load(), kept)
	if !conns[0].closed.Load() {
		t.Errorf("the connection that answered 408 was neither closed nor kept")
	}
}

// Past maxInterim interim answers, or after a 101, the check fails and its
// connection is not kept: the answer that may follow is unread, and the next
// check would take it for its own.
func TestHTTPInterimPastLimitNotKept(t *testing.T) {
	for _, tc := range []struct {
		name, head string
	}{
		{"six 103s", strings.Repeat("HTTP/1.1 103 Early Hints\r\n\r\n", maxInterim+1)},
		{"101", "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			// Exits when ln closes; the connection's goroutine with it.
			go func() {
				for {
					conn, err := ln.Accept()
					if err != nil {
						return
					}
					go func() {
						defer conn.Close()
						buf := make([]byte, 4096)
						if _, err := conn.Read(buf); err != nil {
							return
						}
						io.WriteString(conn, tc.head)
						// The answer comes later, so the checker has read
						// all there was when it decides on the connection.
						time.Sleep(100 * time.Millisecond)
						io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
						conn.Read(buf) // until the checker closes
					}()
				}
			}()
			cfg, err := Config{Check: Check{Kind: HTTP, Interval: time.Second, Timeout: time.Second}}.withDefaults()
			if err != nil {
				t.Fatal(err)
			}
			p := probe{checkRun: checkRun{addr: ln.Addr().String()}, cfg: cfg.Check, dial: (&net.Dialer{}).DialContext}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			err = p.runHTTP(ctx)
			if !errors.Is(err, ErrStatus) {
				t.Errorf("check: %v; want a status error", err)
			}
			if p.keep != nil {
				p.keep.conn.Close()
				t.Errorf("the connection was kept with an answer unread")
			}
		})
	}
}

// TestSourceChangeClosesKeptConn: changing a service's check.source closes its
// backends' kept-alive HTTP check connections, so the next checks come from the
// new source rather than on the connection opened from the old one.
func TestSourceChangeClosesKeptConn(t *testing.T) {
	var mu sync.Mutex
	from := map[string]int{} // requests by the client's address
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ap, err := netip.ParseAddrPort(r.RemoteAddr)
		if err == nil {
			mu.Lock()
			from[ap.Addr().String()]++
			mu.Unlock()
		}
		fmt.Fprint(w, "ok")
	}))
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	count := func(addr string) int {
		mu.Lock()
		defer mu.Unlock()
		return from[addr]
	}
	cfg := func(src string) Config {
		return Config{Check: Check{Kind: HTTP, Interval: 20 * time.Millisecond, Timeout: time.Second,
			Source: netip.MustParseAddr(src)}}
	}
	c := &Checker{}
	if err := c.SetService("web", cfg("127.0.0.1")); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(Backend{ID: "b", Addr: u.Host, Service: "web"}); err != nil {
		t.Fatal(err)
	}
	run(t, c)
	waitfor.Value(t, 5*time.Second, "3 checks from 127.0.0.1", func() (any, bool) {
		n := count("127.0.0.1")
		return n, n >= 3
	})
	if err := c.SetService("web", cfg("127.0.0.2")); err != nil {
		t.Fatal(err)
	}
	waitfor.Value(t, 5*time.Second, "a check from 127.0.0.2", func() (any, bool) {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprint(from), from["127.0.0.2"] >= 1
	})
	// One check in flight at a time: once one came from the new source, none
	// comes from the old.
	old := count("127.0.0.1")
	waitfor.Value(t, 5*time.Second, "3 more checks from 127.0.0.2", func() (any, bool) {
		n := count("127.0.0.2")
		return n, n >= 4
	})
	if n := count("127.0.0.1"); n != old {
		t.Errorf("checks from 127.0.0.1 after the first from 127.0.0.2: got %d; want 0", n-old)
	}
}
