package httplb

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/websocket"

	"github.com/weir-lb/weir/internal/netpair"
	"github.com/weir-lb/weir/internal/ownnetns"
	"github.com/weir-lb/weir/internal/waitfor"
)

// wsBackend is a WebSocket echo server (x/net/websocket, a real
// implementation of RFC 6455) at /ws; it records the X-Forwarded-For its
// handshakes carried, and answers plain requests elsewhere.
func wsBackend(t *testing.T) (netip.AddrPort, *atomic.Value) {
	t.Helper()
	var xff atomic.Value
	xff.Store("")
	mux := http.NewServeMux()
	mux.Handle("/ws", websocket.Handler(func(ws *websocket.Conn) {
		xff.Store(ws.Request().Header.Get("X-Forwarded-For"))
		io.Copy(ws, ws)
	}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "plain") })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	// Exits when the server closes at cleanup.
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return netip.MustParseAddrPort(ln.Addr().String()), &xff
}

// TestUpgradeWebSocket: a WebSocket client (x/net/websocket) reaches a
// WebSocket backend through the plane, over cleartext and TLS, through both
// HTTP/1.1 engines: messages echo both ways, the tunnel counts as a request in
// flight on its backend while it lasts, and when the client closes nothing is
// left (goroutines, descriptors, leases).
func TestUpgradeWebSocket(t *testing.T) {
	eachH1Front(t, func(t *testing.T, cfg Config) {
		be, xff := wsBackend(t)
		cfg.XForwardedFor = true
		scheme := "ws"
		wcfg := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"http/1.1"}}
		if cfg.TLS != nil {
			scheme = "wss"
		}
		s := serveOn(t, cfg, []Backend{{Addr: be, Weight: 1, Usable: true}})
		// A plain request first: the service's goroutines and its pooled
		// upstream connection are then in the baseline.
		plain := &http.Client{Transport: &http.Transport{TLSClientConfig: wcfg, DisableKeepAlives: true}, Timeout: 10 * time.Second}
		url := strings.Replace(scheme, "ws", "http", 1) + "://" + s.Addr().String() + "/x"
		if resp, body := get(t, plain, url); resp.StatusCode != 200 || body != "plain" {
			t.Fatalf("plain request: %d %q", resp.StatusCode, body)
		}
		base := takeBaseline(t, s)

		ws, err := websocket.DialConfig(wsConfig(t, scheme, s.Addr().String(), wcfg))
		if err != nil {
			t.Fatalf("WebSocket handshake through the plane: %v", err)
		}
		for i := range 3 {
			msg := fmt.Sprintf("message %d", i)
			if err := websocket.Message.Send(ws, msg); err != nil {
				t.Fatal(err)
			}
			var got string
			ws.SetReadDeadline(time.Now().Add(5 * time.Second))
			if err := websocket.Message.Receive(ws, &got); err != nil || got != msg {
				t.Fatalf("echo %d: %q, %v; want %q", i, got, err, msg)
			}
		}
		if got := xff.Load().(string); got != "127.0.0.1" {
			t.Errorf("the backend's handshake carried X-Forwarded-For %q, want 127.0.0.1", got)
		}
		sn := s.Snapshot()
		if sn.InFlight != 1 || sn.Backends[0].InFlight != 1 {
			t.Errorf("with the tunnel open: %d requests in flight, %d on the backend; want 1 and 1", sn.InFlight, sn.Backends[0].InFlight)
		}
		ws.Close()
		waitfor.Value(t, 5*time.Second, "the tunnel gone: nothing in flight", func() (any, bool) {
			sn := s.Snapshot()
			return [2]int64{sn.InFlight, int64(sn.Backends[0].InFlight)}, sn.InFlight == 0 && sn.Backends[0].InFlight == 0
		})
		base.waitBack(t, s)
		if resp, body := get(t, plain, url); resp.StatusCode != 200 || body != "plain" {
			t.Errorf("plain request after the tunnel: %d %q", resp.StatusCode, body)
		}
	})
}

// sendUpgrade connects to addr and asks to switch to proto, with ahead sent
// right behind the request; it returns the connection and the answer.
func sendUpgrade(t *testing.T, addr, proto, ahead string) (*net.TCPConn, *bufio.Reader, *http.Response) {
	t.Helper()
	conn, br := rawConn(t, addr)
	io.WriteString(conn, "GET /t HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: "+proto+"\r\n\r\n"+ahead)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("answer to an upgrade to %s: %v", proto, err)
	}
	return conn.(*net.TCPConn), br, resp
}

// mustSwitch is sendUpgrade for an upgrade that must be accepted.
func mustSwitch(t *testing.T, addr, proto, ahead string) (*net.TCPConn, *bufio.Reader, *http.Response) {
	t.Helper()
	conn, br, resp := sendUpgrade(t, addr, proto, ahead)
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade to %s answered %s", proto, resp.Status)
	}
	return conn, br, resp
}

// switchingBackend answers an upgrade to proto with 100 Continue, then 101
// and hello right behind it, then reads the client's bytes to their end and answers "got:" and them
// before it closes. Any other request (or an upgrade to another protocol)
// gets answer, as it is.
func switchingBackend(t *testing.T, proto, hello, answer string) netip.AddrPort {
	return rawBackend(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.Header.Get("Upgrade") != proto || !strings.EqualFold(req.Header.Get("Connection"), "upgrade") {
			io.WriteString(c, answer)
			return
		}
		// An interim answer first, which the plane must not take for the switch.
		io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: "+proto+"\r\nX-B: 1\r\n\r\n"+hello)
		got, _ := io.ReadAll(br)
		io.WriteString(c, "got:"+string(got))
	})
}

// TestUpgradeRaw: the tunnel's edges, on a protocol of the test's own through
// both HTTP/1.1 engines. Bytes the client sends right behind its request and
// bytes the backend sends right behind its 101 both arrive; the client's
// half-close reaches the backend, whose answer after it still comes back; a
// backend that declines answers the client as any answer; one that switches
// to a protocol the client did not ask for gets a 502.
func TestUpgradeRaw(t *testing.T) {
	const declined = "HTTP/1.1 426 Upgrade Required\r\nContent-Length: 4\r\nConnection: close\r\n\r\nnope"
	for _, engine := range h1Engines {
		t.Run(engine+"/half-close and bytes ahead", func(t *testing.T) {
			be := switchingBackend(t, "echo", "hello", declined)
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			conn, br, resp := mustSwitch(t, s.Addr().String(), "echo", "early,")
			if resp.Header.Get("Upgrade") != "echo" || resp.Header.Get("X-B") != "1" || !strings.EqualFold(resp.Header.Get("Connection"), "upgrade") {
				t.Errorf("101's header: %v", resp.Header)
			}
			hello := make([]byte, 5)
			if _, err := io.ReadFull(br, hello); err != nil || string(hello) != "hello" {
				t.Fatalf("the backend's bytes behind its 101: %q, %v", hello, err)
			}
			io.WriteString(conn, "late")
			conn.CloseWrite()
			rest, err := io.ReadAll(br)
			if err != nil || string(rest) != "got:early,late" {
				t.Errorf("after the client's half-close: %q, %v; want %q and EOF", rest, err, "got:early,late")
			}
			waitNoClients(t, s)
		})
		t.Run(engine+"/first backend refuses: the next one takes it", func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			dead := netip.MustParseAddrPort(ln.Addr().String())
			ln.Close() // nothing listens there now: connections are refused
			be := switchingBackend(t, "echo", "", declined)
			s := serveOn(t, Config{NetHTTP1: engine == "net_http", Algorithm: "round_robin", Retries: 1},
				[]Backend{{Addr: dead, Weight: 1, Usable: true}, {Addr: be, Weight: 1, Usable: true}})
			for i := range 2 { // one of the two picks starts at the dead backend
				conn, br, _ := mustSwitch(t, s.Addr().String(), "echo", "x")
				conn.CloseWrite()
				if rest, err := io.ReadAll(br); err != nil || string(rest) != "got:x" {
					t.Errorf("upgrade %d: %q, %v", i, rest, err)
				}
			}
		})
		t.Run(engine+"/declined", func(t *testing.T) {
			be := switchingBackend(t, "echo", "", declined)
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			_, _, resp := sendUpgrade(t, s.Addr().String(), "other", "")
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusUpgradeRequired || string(body) != "nope" {
				t.Errorf("a declined upgrade: %d %q; want the backend's 426 %q", resp.StatusCode, body, "nope")
			}
		})
		t.Run(engine+"/switched to another protocol", func(t *testing.T) {
			be := rawBackend(t, func(c net.Conn) {
				if _, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
					io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: other\r\n\r\n")
				}
			})
			s := serveOn(t, Config{NetHTTP1: engine == "net_http"}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			if _, _, resp := sendUpgrade(t, s.Addr().String(), "echo", ""); resp.StatusCode != http.StatusBadGateway {
				t.Errorf("a switch to a protocol not asked for: %s; want 502", resp.Status)
			}
		})
	}
}

// TestUpgradeIdleAndShutdown: a tunnel that moves no byte either way for the
// idle timeout closes, one that moves bytes one way only does not; a service
// that shuts down closes its tunnels once the drain time is up and returns.
func TestUpgradeIdleAndShutdown(t *testing.T) {
	const idle = 600 * time.Millisecond
	ticks := make(chan int, 1)
	be := rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: "+req.Header.Get("Upgrade")+"\r\n\r\n")
		if req.Header.Get("Upgrade") == "ticker" {
			// One byte every idle/6, for 1.5 idle timeouts: the tunnel moves
			// bytes one way only and must stay up.
			for i := range 9 {
				time.Sleep(idle / 6)
				if _, err := c.Write([]byte{'0' + byte(i)}); err != nil {
					ticks <- i
					return
				}
			}
			ticks <- 9
		}
		io.Copy(io.Discard, br) // until the plane closes the connection
	})
	for _, engine := range h1Engines {
		t.Run(engine, func(t *testing.T) {
			// A header timeout shorter than the tunnels: the request's deadline
			// must not outlive the switch.
			sv := serveStoppable(t, Config{NetHTTP1: engine == "net_http", IdleTimeout: idle, ReadHeaderTimeout: idle / 2, DrainTimeout: 200 * time.Millisecond},
				[]Backend{{Addr: be, Weight: 1, Usable: true}})
			// Silent: closed after about the idle timeout.
			_, br, _ := mustSwitch(t, sv.Addr().String(), "silent", "")
			start := time.Now()
			if n, err := io.Copy(io.Discard, br); n != 0 || err != nil {
				t.Errorf("silent tunnel: read %d bytes, %v; want EOF", n, err)
			}
			// The plane's idle time runs from when it sent the 101, which a
			// loaded machine can have the client read a few milliseconds later
			// (a CI run of mine: closed 596.6 ms after the client had it).
			if d := time.Since(start); d < idle*9/10 || d > 10*idle {
				t.Errorf("silent tunnel closed after %v; want about %v", d, idle)
			}
			// Bytes one way only: up for all nine.
			_, br, _ = mustSwitch(t, sv.Addr().String(), "ticker", "")
			got, _ := io.ReadAll(br)
			if string(got) != "012345678" {
				t.Errorf("one-way tunnel delivered %q before it closed; want all of 012345678", got)
			}
			if i := <-ticks; i != 9 {
				t.Errorf("the one-way tunnel closed after %d of 9 bytes", i)
			}
			// Shutdown with a tunnel open: closed when the drain time is up.
			conn, br, _ := mustSwitch(t, sv.Addr().String(), "held", "")
			conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			go func() {
				// Keeps the tunnel busy, so only the shutdown can end it.
				for range 50 {
					if _, err := conn.Write([]byte("x")); err != nil {
						return
					}
					time.Sleep(idle / 4)
				}
			}()
			start = time.Now()
			sv.stop()
			select {
			case <-sv.done:
			case <-time.After(5 * time.Second):
				t.Fatal("Serve did not return with a tunnel open")
			}
			if _, err := io.Copy(io.Discard, br); err != nil && !isTimeout(err) {
				t.Logf("tunnel at shutdown: %v", err)
			}
			if d := time.Since(start); d > 4*time.Second {
				t.Errorf("the tunnel outlived the shutdown by %v", d)
			}
		})
	}
}

// TestUpgradeH2CUpstream: with the upstream fixed to HTTP/2 cleartext, plain
// requests go to the backend over HTTP/2 while an upgrade goes over HTTP/1.1
// on a connection of its own (HTTP/2 has no Upgrade), to a backend that
// speaks both on one port, as Go's server does; a backend that speaks HTTP/2
// only cannot switch, and the client gets an error answer, not a tunnel.
func TestUpgradeH2CUpstream(t *testing.T) {
	ws := websocket.Handler(func(c *websocket.Conn) { io.Copy(c, c) })
	both, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/ws" {
			ws.ServeHTTP(w, r)
			return
		}
		io.WriteString(w, r.Proto)
	})
	h2only, _ := protoBackend(t, false, 0, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, r.Proto) })
	eachH1Front(t, func(t *testing.T, cfg Config) {
		cfg.Upstream = UpstreamH2C
		scheme := "ws"
		wcfg := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"http/1.1"}}
		if cfg.TLS != nil {
			scheme = "wss"
		}
		plain := &http.Client{Transport: &http.Transport{TLSClientConfig: wcfg, DisableKeepAlives: true}, Timeout: 10 * time.Second}
		httpScheme := strings.Replace(scheme, "ws", "http", 1)

		s := serveOn(t, cfg, []Backend{both})
		if resp, body := get(t, plain, httpScheme+"://"+s.Addr().String()+"/x"); resp.StatusCode != 200 || body != "HTTP/2.0" {
			t.Fatalf("plain request: %d %q; want it forwarded over HTTP/2", resp.StatusCode, body)
		}
		c, err := websocket.DialConfig(wsConfig(t, scheme, s.Addr().String(), wcfg))
		if err != nil {
			t.Fatalf("WebSocket handshake through the plane with an h2c upstream: %v", err)
		}
		if err := websocket.Message.Send(c, "over h2c's port"); err != nil {
			t.Fatal(err)
		}
		var got string
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if err := websocket.Message.Receive(c, &got); err != nil || got != "over h2c's port" {
			t.Fatalf("echo: %q, %v", got, err)
		}
		c.Close()
		waitNoClients(t, s)

		s2 := serveOn(t, cfg, []Backend{h2only})
		if resp, body := get(t, plain, httpScheme+"://"+s2.Addr().String()+"/x"); resp.StatusCode != 200 || body != "HTTP/2.0" {
			t.Fatalf("plain request to the HTTP/2-only backend: %d %q", resp.StatusCode, body)
		}
		if _, err := websocket.DialConfig(wsConfig(t, scheme, s2.Addr().String(), wcfg)); err == nil {
			t.Fatal("a WebSocket to a backend that speaks HTTP/2 only was switched")
		}
		if cfg.TLS == nil {
			conn, _, resp := sendUpgrade(t, s2.Addr().String(), "websocket", "")
			conn.Close()
			t.Logf("an upgrade to the HTTP/2-only backend: %s", resp.Status)
			if resp.StatusCode < 500 {
				t.Errorf("an upgrade to a backend that speaks HTTP/2 only was answered %s; want an error of the plane or the backend", resp.Status)
			}
		}
		waitNoClients(t, s2)
	})
}

// wsConfig is a WebSocket client's configuration for /ws at addr.
func wsConfig(t *testing.T, scheme, addr string, tc *tls.Config) *websocket.Config {
	t.Helper()
	wc, err := websocket.NewConfig(scheme+"://"+addr+"/ws", "http://127.0.0.1/")
	if err != nil {
		t.Fatal(err)
	}
	wc.TlsConfig = tc
	return wc
}

// TestUpgradeBackendDies: a backend that dies under one tunnel ends that
// tunnel only; another tunnel on another backend carries on.
func TestUpgradeBackendDies(t *testing.T) {
	kill := make(chan struct{})
	dying := rawBackend(t, func(c net.Conn) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		<-kill
		c.(*net.TCPConn).SetLinger(0) // a reset, as from a process that died
	})
	live := switchingBackend(t, "echo", "", "")
	s := serveOn(t, Config{Algorithm: "round_robin"}, []Backend{{Addr: dying, Weight: 1, Usable: true}, {Addr: live, Weight: 1, Usable: true}})
	var conns [2]*net.TCPConn
	var readers [2]*bufio.Reader
	for i := range conns {
		conns[i], readers[i], _ = mustSwitch(t, s.Addr().String(), "echo", "")
	}
	close(kill)
	// One of the two is on the dying backend: it ends; the other answers.
	var ended, alive int
	for i, c := range conns {
		c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if _, err := readers[i].ReadByte(); err == nil {
			t.Fatalf("tunnel %d: a byte from nowhere", i)
		} else if isTimeout(err) {
			alive++
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			io.WriteString(c, "still here")
			c.CloseWrite()
			if rest, err := io.ReadAll(readers[i]); err != nil || string(rest) != "got:still here" {
				t.Errorf("the other tunnel after the backend died: %q, %v", rest, err)
			}
		} else {
			ended++
		}
	}
	if ended != 1 || alive != 1 {
		t.Errorf("%d tunnels ended and %d lived on; want 1 and 1", ended, alive)
	}
	waitNoClients(t, s)
}

// TestUpgradeDrain: a drained (or weight-0) or removed backend's tunnels are
// closed drain_timeout after it began to drain, as the proxy closes a draining
// backend's connections; a backend that is only down keeps them, and so does
// one undrained before the time is up.
func TestUpgradeDrain(t *testing.T) {
	const drain = 300 * time.Millisecond
	for _, tc := range []struct {
		name   string
		change func(b Backend) []Backend // the backend set after the tunnel opened
		undo   bool                      // the change is undone after drain/3
		closed bool
	}{
		{"drained", func(b Backend) []Backend { b.Usable, b.Draining = false, true; return []Backend{b} }, false, true},
		{"removed", func(b Backend) []Backend { return nil }, false, true},
		{"down only", func(b Backend) []Backend { b.Usable = false; return []Backend{b} }, false, false},
		{"drained, then undrained in time", func(b Backend) []Backend { b.Usable, b.Draining = false, true; return []Backend{b} }, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := Backend{Addr: switchingBackend(t, "echo", "", ""), Weight: 1, Usable: true}
			s := serveOn(t, Config{DrainTimeout: drain}, []Backend{be})
			conn, br, _ := mustSwitch(t, s.Addr().String(), "echo", "")
			start := time.Now()
			if err := s.SetBackends(tc.change(be)); err != nil {
				t.Fatal(err)
			}
			if tc.undo {
				time.Sleep(drain / 3)
				if err := s.SetBackends([]Backend{be}); err != nil {
					t.Fatal(err)
				}
			}
			conn.SetReadDeadline(time.Now().Add(3 * drain))
			_, err := br.ReadByte()
			switch {
			case tc.closed && isTimeout(err):
				t.Errorf("the tunnel was still open %v after its backend began to drain (drain_timeout %v)", time.Since(start), drain)
			case tc.closed && time.Since(start) < drain:
				t.Errorf("the tunnel closed %v after its backend began to drain; want drain_timeout (%v) first", time.Since(start), drain)
			case !tc.closed && !isTimeout(err):
				t.Errorf("the tunnel ended (%v) after %v; want it kept", err, time.Since(start))
			}
			if !tc.closed {
				// Still a working tunnel.
				conn.SetReadDeadline(time.Now().Add(5 * time.Second))
				io.WriteString(conn, "x")
				conn.CloseWrite()
				if rest, err := io.ReadAll(br); err != nil || string(rest) != "got:x" {
					t.Errorf("the kept tunnel: %q, %v", rest, err)
				}
			}
		})
	}
}

// TestTunnelSilentBeforeSwitch: an upgrade whose backend took the request
// and then went silent (nftables drops every packet to and from its port)
// before it answered has its connection fail by keepalive, with ETIMEDOUT,
// while weir waits for the switch. That try timed out, as a request's on a
// pooled connection does (TestUserTimeoutPooledIsFailedTry): a timeout for
// passive health, the upgrade retried on the other backend where a retry is
// allowed, else answered 504.
//
// In a network namespace of its own, for its nftables rules.
func TestTunnelSilentBeforeSwitch(t *testing.T) {
	if !ownnetns.In(t, nil) {
		return
	}
	for _, retries := range []int{0, 1} {
		t.Run(fmt.Sprint("retries ", retries), func(t *testing.T) {
			came := make(chan struct{}, 2)
			stop := make(chan struct{})
			silent := Backend{Weight: 1, Usable: true, Addr: rawBackend(t, func(c net.Conn) {
				if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
					return
				}
				came <- struct{}{}
				<-stop
			})}
			t.Cleanup(func() { close(stop) })
			bs := []Backend{silent}
			if retries > 0 {
				other, _, _ := releasedBackend(t)
				bs = append(bs, Backend{Addr: other, Weight: 1, Usable: true})
			}
			rec := &outcomeLog{}
			s := serveOn(t, Config{Algorithm: "round_robin", Retries: retries, RetryBudget: 1, Observer: rec, BackendUserTimeout: time.Second,
				BackendKeepalive: net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second, Count: 1}}, bs)
			type answer struct {
				status int
				err    error
			}
			// Round robin sends one of two upgrades to the silent backend.
			for i := range 2 {
				c, err := net.Dial("tcp", s.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				c.SetDeadline(time.Now().Add(20 * time.Second))
				io.WriteString(c, "GET /now HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: hold\r\n\r\n")
				answers := make(chan answer, 1)
				// Exits when the answer is read, or by the deadline.
				go func() {
					resp, err := http.ReadResponse(bufio.NewReader(c), nil)
					if err != nil {
						answers <- answer{err: err}
						return
					}
					answers <- answer{status: resp.StatusCode}
				}()
				select {
				case a := <-answers:
					if a.err != nil || a.status != http.StatusSwitchingProtocols {
						t.Fatalf("upgrade %d: got %d, %v; want 101 from the other backend", i, a.status, a.err)
					}
					c.Close()
					continue
				case <-came:
				}
				netpair.DropPort(t, silent.Addr.Port())
				want := http.StatusGatewayTimeout
				if retries > 0 {
					want = http.StatusSwitchingProtocols // from the other backend
				}
				if a := <-answers; a.err != nil || a.status != want {
					t.Errorf("got %d, %v; want %d", a.status, a.err, want)
				}
				if got := rec.of(silent.Addr); len(got) != 1 || got[0] != Timeout {
					t.Errorf("the silent backend's tries: got %v; want [%v]", got, Timeout)
				}
				return
			}
			t.Fatal("neither of two upgrades went to the silent backend")
		})
	}
}
