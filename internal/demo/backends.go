package demo

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/weir-lb/weir/internal/netns"
)

// backend is one backend host as the demo serves it.
type backend struct {
	Name string     `json:"name"`
	NS   string     `json:"ns"`
	IP4  netip.Addr `json:"ip4"`
	IP6  netip.Addr `json:"ip6"`
}

// servers are the backends' HTTP (port 80) and UDP (port 53) servers. Each answers
// with its backend's name; a backend's HTTP server can be killed and revived.
type servers struct {
	mu   sync.Mutex
	http map[string]*http.Server
	pcs  []net.PacketConn
	ns   map[string]*netns.NS
	vips []netip.Addr
	wg   sync.WaitGroup
}

func newServers() *servers {
	return &servers{http: map[string]*http.Server{}, ns: map[string]*netns.NS{}}
}

// serve starts b's servers in ns: HTTP on every address, UDP bound to each of the
// VIPs and b's own addresses so a reply leaves from the address asked (dsr).
func (s *servers) serve(ns *netns.NS, b backend, vips []netip.Addr) error {
	s.mu.Lock()
	s.ns[b.Name], s.vips = ns, vips
	s.mu.Unlock()
	if err := s.serveHTTP(b.Name); err != nil {
		return err
	}
	for _, ip := range append(append([]netip.Addr{}, vips...), b.IP4, b.IP6) {
		pc, err := ns.ListenPacket("udp", netip.AddrPortFrom(ip, udpPort).String())
		if err != nil {
			return fmt.Errorf("%s: %w", b.Name, err)
		}
		s.mu.Lock()
		s.pcs = append(s.pcs, pc)
		s.mu.Unlock()
		name := []byte(b.Name)
		s.wg.Add(1)
		// Exits when pc is closed by close.
		go func() {
			defer s.wg.Done()
			buf := make([]byte, 512)
			for {
				_, from, err := pc.ReadFrom(buf)
				if errors.Is(err, net.ErrClosed) {
					return
				}
				if err == nil {
					pc.WriteTo(name, from)
				}
			}
		}()
	}
	return nil
}

// serveHTTP starts (or restarts) name's HTTP server.
func (s *servers) serveHTTP(name string) error {
	s.mu.Lock()
	ns := s.ns[name]
	s.mu.Unlock()
	ln, err := ns.Listen("tcp", fmt.Sprintf(":%d", httpPort))
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		io.WriteString(w, name)
	}), ReadHeaderTimeout: 5 * time.Second, IdleTimeout: 30 * time.Second}
	s.mu.Lock()
	s.http[name] = srv
	s.mu.Unlock()
	s.wg.Add(1)
	// Exits when srv is closed by kill or close.
	go func() { defer s.wg.Done(); srv.Serve(ln) }()
	return nil
}

// kill closes name's HTTP listener and connections, as a crashed server would.
func (s *servers) kill(name string) {
	s.mu.Lock()
	srv := s.http[name]
	delete(s.http, name)
	s.mu.Unlock()
	if srv != nil {
		srv.Close()
	}
}

// close stops every server and waits for them.
func (s *servers) close() {
	s.mu.Lock()
	for _, srv := range s.http {
		srv.Close()
	}
	clear(s.http)
	for _, pc := range s.pcs {
		pc.Close()
	}
	s.pcs = nil
	s.mu.Unlock()
	s.wg.Wait()
}
