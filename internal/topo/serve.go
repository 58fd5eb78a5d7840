package topo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ErrClosed is returned by a closed Topology's methods.
var ErrClosed = errors.New("topology closed")

// ServeBackends starts, on every backend, an HTTP server on port 80 (all
// addresses, both families, so the VIPs are served for DSR) whose body is
// the backend's name ("backend-0", ...) and whose X-Backend header says the
// same, and a UDP server on port 53 that answers any datagram with that
// name. It returns once every socket is listening. The servers stop when ctx
// ends or Close is called; Close waits for them.
//
// The UDP sockets are bound to each address (VIPs and the backend's own)
// rather than the wildcard, so a reply leaves from the address the request
// was sent to, as DSR needs.
func (t *Topology) ServeBackends(ctx context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("topology %s: serve backends: %w", t.Name, ErrClosed)
	}
	if t.serving {
		return fmt.Errorf("topology %s: serve backends: already serving", t.Name)
	}

	var closers []io.Closer
	var servers []*http.Server
	var lns []net.Listener
	var pcs []net.PacketConn
	var pcOwner []int
	fail := func(err error) error {
		for _, c := range closers {
			c.Close()
		}
		return fmt.Errorf("topology %s: serve backends: %w", t.Name, err)
	}
	for i, h := range t.Backends {
		ln, err := h.NS.Listen("tcp", ":"+strconv.Itoa(HTTPPort))
		if err != nil {
			return fail(err)
		}
		closers = append(closers, ln)
		lns = append(lns, ln)
		servers = append(servers, t.httpServer(i, h.Name))

		for _, ip := range []netip.Addr{t.VIP4, t.VIP6, h.IP4, h.IP6} {
			pc, err := h.NS.ListenPacket("udp", netip.AddrPortFrom(ip, UDPPort).String())
			if err != nil {
				return fail(err)
			}
			closers = append(closers, pc)
			pcs = append(pcs, pc)
			pcOwner = append(pcOwner, i)
		}
	}

	t.serving = true
	for i, srv := range servers {
		t.servers.Add(1)
		// Exits when the listener is closed by srv.Close below.
		go func() {
			defer t.servers.Done()
			srv.Serve(lns[i])
		}()
	}
	for i, pc := range pcs {
		t.servers.Add(1)
		// Exits when pc is closed below.
		go func() {
			defer t.servers.Done()
			t.serveUDP(pcOwner[i], pc)
		}()
	}
	t.servers.Add(1)
	// Exits when ctx ends or Close is called, after closing every server.
	go func() {
		defer t.servers.Done()
		select {
		case <-ctx.Done():
		case <-t.stop:
		}
		for _, srv := range servers {
			srv.Close()
		}
		for _, pc := range pcs {
			pc.Close()
		}
		t.mu.Lock()
		t.serving = false
		t.mu.Unlock()
	}()
	return nil
}

func (t *Topology) httpServer(i int, name string) *http.Server {
	return &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			t.servedHTTP[i].Add(1)
			w.Header().Set("X-Backend", name)
			w.Header().Set("Content-Type", "text/plain")
			io.WriteString(w, name)
		}),
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       10 * time.Second,
	}
}

// serveUDP answers every datagram on pc with backend i's name until pc is
// closed.
func (t *Topology) serveUDP(i int, pc net.PacketConn) {
	name := []byte(t.Backends[i].Name)
	buf := make([]byte, 2048)
	for {
		_, from, err := pc.ReadFrom(buf)
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// Errors such as ICMP-induced ECONNREFUSED concern one
			// peer; keep serving.
			continue
		}
		t.servedUDP[i].Add(1)
		pc.WriteTo(name, from)
	}
}

// Served returns how many requests backend i has answered, HTTP and UDP.
func (t *Topology) Served(i int) uint64 { return t.ServedHTTP(i) + t.ServedUDP(i) }

// ServedHTTP returns how many HTTP requests backend i has answered.
func (t *Topology) ServedHTTP(i int) uint64 { return t.servedHTTP[i].Load() }

// ServedUDP returns how many UDP datagrams backend i has answered.
func (t *Topology) ServedUDP(i int) uint64 { return t.servedUDP[i].Load() }

// ServedAll returns Served for every backend.
func (t *Topology) ServedAll() []uint64 {
	out := make([]uint64, len(t.Backends))
	for i := range out {
		out[i] = t.Served(i)
	}
	return out
}

// HTTPClient returns a client whose connections are made from the client
// namespace, a new TCP connection for every request (so each request is a
// new flow for the balancer), with timeouts that fail a test rather than
// hang it. Addresses in URLs must be IP literals.
//
// The client is made once and shared; it is safe for concurrent use.
func (t *Topology) HTTPClient() *http.Client {
	t.httpOnce.Do(func() { t.httpClient = t.newHTTPClient() })
	return t.httpClient
}

func (t *Topology) newHTTPClient() *http.Client {
	d := &net.Dialer{Timeout: 3 * time.Second}
	return &http.Client{
		Transport: &http.Transport{
			Proxy: nil, // never the environment's proxy
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return t.Client.NS.DialWith(ctx, d, network, addr)
			},
			DisableKeepAlives:     true,
			ResponseHeaderTimeout: 5 * time.Second,
		},
		Timeout: 10 * time.Second,
	}
}

// URL returns http://<ip>/ (brackets for IPv6).
func URL(ip netip.Addr) string {
	return "http://" + netip.AddrPortFrom(ip, HTTPPort).String() + "/"
}

// Get fetches URL(ip) from the client namespace over a new connection and
// returns the body, i.e. the name of the backend that answered.
func (t *Topology) Get(ctx context.Context, ip netip.Addr) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, URL(ip), nil)
	if err != nil {
		return "", err
	}
	resp, err := t.HTTPClient().Do(req)
	if err != nil {
		return "", fmt.Errorf("get %s: %w", URL(ip), err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("get %s: read body: %w", URL(ip), err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("get %s: status %s", URL(ip), resp.Status)
	}
	return string(body), nil
}

// Ask sends one HTTP/1.1 request for / on a keep-alive connection to a VIP (br
// reads c) and returns the body: the name of the backend that holds the
// connection's flow. The caller sets c's deadline.
func Ask(c net.Conn, br *bufio.Reader) (string, error) {
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: vip\r\n\r\n"); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// DialTCP opens a new TCP connection from the client namespace to dst, from
// local port localPort (0: an ephemeral port), so a test can pick distinct
// or repeated 5-tuples. SO_REUSEADDR is set for a fixed port. Reusing a
// 4-tuple whose previous connection the client closed first meets that
// connection's TIME_WAIT: the client namespace has tcp_tw_reuse=1 and
// tcp_tw_reuse_delay=1ms, so it works a millisecond later; close with
// SetLinger(0) to have no TIME_WAIT at all.
func (t *Topology) DialTCP(ctx context.Context, dst netip.AddrPort, localPort uint16) (*net.TCPConn, error) {
	c, err := t.Client.NS.DialWith(ctx, dialer("tcp", dst, localPort), "tcp", dst.String())
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// DialUDP is DialTCP for a connected UDP socket.
func (t *Topology) DialUDP(ctx context.Context, dst netip.AddrPort, localPort uint16) (*net.UDPConn, error) {
	c, err := t.Client.NS.DialWith(ctx, dialer("udp", dst, localPort), "udp", dst.String())
	if err != nil {
		return nil, err
	}
	return c.(*net.UDPConn), nil
}

// dialer returns a dialer for network ("tcp" or "udp") to dst from
// localPort.
func dialer(network string, dst netip.AddrPort, localPort uint16) *net.Dialer {
	d := &net.Dialer{Timeout: 3 * time.Second}
	if localPort == 0 {
		return d
	}
	local := netip.IPv4Unspecified()
	if dst.Addr().Is6() {
		local = netip.IPv6Unspecified()
	}
	// LocalAddr's type must match the network.
	if network == "udp" {
		d.LocalAddr = net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, localPort))
	} else {
		d.LocalAddr = net.TCPAddrFromAddrPort(netip.AddrPortFrom(local, localPort))
	}
	d.Control = func(network, address string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
		})
		if err != nil {
			return err
		}
		return serr
	}
	return d
}

// AskUDP sends one datagram from the client namespace to dst (from
// localPort, 0 for ephemeral) and returns the reply, i.e. the name of the
// backend that answered.
func (t *Topology) AskUDP(ctx context.Context, dst netip.AddrPort, localPort uint16) (string, error) {
	c, err := t.DialUDP(ctx, dst, localPort)
	if err != nil {
		return "", err
	}
	defer c.Close()
	deadline := time.Now().Add(3 * time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	c.SetDeadline(deadline)
	if _, err := c.Write([]byte("who")); err != nil {
		return "", fmt.Errorf("udp %s: write: %w", dst, err)
	}
	buf := make([]byte, 256)
	n, err := c.Read(buf)
	if err != nil {
		return "", fmt.Errorf("udp %s: read: %w", dst, err)
	}
	return string(buf[:n]), nil
}
