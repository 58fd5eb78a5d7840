package httpplane_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/httpplane"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// stopLog closes stopped when the plane logs that a service's server
// stopped serving.
type stopLog struct {
	slog.Handler
	once    *sync.Once
	stopped chan struct{}
}

func (h stopLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "http plane stopped" {
		h.once.Do(func() { close(h.stopped) })
	}
	return nil
}

func (h stopLog) Enabled(context.Context, slog.Level) bool { return true }

func (h stopLog) WithAttrs([]slog.Attr) slog.Handler { return h }

// TestServeDiedStartedAgain: a service whose server stopped serving on its
// own (its Serve returned, the listener failed) is started anew by the next
// change to it. Before, the change was pushed to the stopped server, which
// refused it (httplb.ErrStopped): every later change to the service failed,
// and the service never served again.
func TestServeDiedStartedAgain(t *testing.T) {
	bs := httpbackend.StartN(t, 2)
	port := freePort(t)
	service := func(b *httpbackend.Backend) *plan.Service {
		t.Helper()
		return httpService(t, fmt.Sprintf("{name: web, vip: 127.0.0.1:%d, data_plane: http, backends: [{address: %s}]}", port, b.Addr))
	}
	log := stopLog{Handler: slog.DiscardHandler, once: new(sync.Once), stopped: make(chan struct{})}
	p := httpplane.New(&health.Checker{}, slog.New(log), nil)
	t.Cleanup(p.Close)
	a, b := service(bs[0]), service(bs[1])
	if err := p.Add(a); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	lb, _ := p.Get("web")
	lb.Close() // its Serve returns with an error, as when its listener fails
	select {
	case <-log.stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("the service's Serve did not return after Close")
	}
	if err := p.Update(a, b); err != nil {
		t.Fatalf("a change to a service whose server stopped: %v; want it started again", err)
	}
	p.Commit()
	c := &http.Client{Timeout: 5 * time.Second}
	t.Cleanup(c.CloseIdleConnections)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	waitfor.Value(t, 10*time.Second, "a 200 from the new backend", func() (any, bool) {
		resp, err := c.Get(url)
		if err != nil {
			return err, false
		}
		resp.Body.Close()
		return fmt.Sprintf("%d, %d hits on the new backend", resp.StatusCode, bs[1].Hits.Load()), resp.StatusCode == http.StatusOK && bs[1].Hits.Load() > 0
	})
}

// TestAbortedServiceFinishesHandshake: a TLS service that a change added and
// then aborted drains the connections its server accepted meanwhile, and one
// whose client sends its ClientHello after the abort is handed the
// certificate the server started with. Before, the abort put back "no
// certificate" where the server reads its own, and the handshake dereferenced
// nil: the agent crashed.
func TestAbortedServiceFinishesHandshake(t *testing.T) {
	w := newTLSWeb(t)
	p, port := w.p, w.port
	if err := p.Add(w.secure); err != nil {
		t.Fatal(err)
	}
	lb, _ := p.Get("web")
	raw, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	// Accepted before the abort, so the server that drains holds it.
	waitfor.Value(t, 10*time.Second, "the connection accepted", func() (any, bool) {
		n := lb.Snapshot().Accepted
		return n, n == 1
	})
	p.Abort()
	c := tls.Client(raw, &tls.Config{InsecureSkipVerify: true})
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := c.Handshake(); err != nil {
		t.Fatalf("handshake with the aborted service's server: %v; want its certificate", err)
	}
	if cn := c.ConnectionState().PeerCertificates[0].Subject.CommonName; cn != "web" {
		t.Errorf("certificate for %q; want web", cn)
	}
}

// tlsWeb is a plane that serves nothing yet, and the service web at a free
// port of 127.0.0.1, to one backend, over TLS (secure) with a certificate for
// "web" at crt and key, or without (plain).
type tlsWeb struct {
	p             *httpplane.Plane
	secure, plain *plan.Service
	crt, key      string
	port          int
}

func newTLSWeb(t *testing.T) tlsWeb {
	t.Helper()
	bs := httpbackend.StartN(t, 1)
	dir := t.TempDir()
	w := tlsWeb{crt: filepath.Join(dir, "web.crt"), key: filepath.Join(dir, "web.key"), port: freePort(t)}
	httpbackend.WriteCert(t, w.crt, w.key, "web")
	w.secure = httpService(t, fmt.Sprintf("{name: web, vip: 127.0.0.1:%d, data_plane: http, http: {tls: {cert: %s, key: %s}}, backends: [{address: %s}]}",
		w.port, w.crt, w.key, bs[0].Addr))
	w.plain = httpService(t, fmt.Sprintf("{name: web, vip: 127.0.0.1:%d, data_plane: http, backends: [{address: %s}]}", w.port, bs[0].Addr))
	w.p = httpplane.New(&health.Checker{}, slog.New(slog.DiscardHandler), nil)
	t.Cleanup(w.p.Close)
	return w
}

// httpService is the service the config line svc gives, as the plan hands it
// to the plane: served by the http plane, every backend usable.
func httpService(t *testing.T, svc string) *plan.Service {
	t.Helper()
	cfg, err := config.Parse([]byte("services:\n- " + svc + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	s := &plan.Service{Config: cfg.Services[0], Placement: plan.Placement{Plane: plan.HTTP}, Installed: true}
	for _, bc := range cfg.Services[0].Backends {
		s.Backends = append(s.Backends, plan.Backend{Config: bc, Usable: true, Healthy: true, Weight: 1})
	}
	return s
}
