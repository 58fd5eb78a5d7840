package httpplane_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent/httpplane"
	"github.com/weir-lb/weir/userspace/agent/plan"
)

// TestAbortedCertificateChange: a change that gives a TLS service new
// certificate files (a new server) and is aborted gives the service back the
// certificate it served, to new handshakes on its sockets once the aborted
// server has ended, while clients keep handshaking, none of them failing;
// applied again, the new one is served. A
// TLS service a change added and that was aborted is added again by a later
// change as a new one: its files read anew, refused while they do not load
// (nothing in memory to go on with), served once they do.
func TestAbortedCertificateChange(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	dir := t.TempDir()
	paths := func(name string) (string, string) {
		return filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	}
	tlsService := func(name, files string, port int) *plan.Service {
		crt, key := paths(files)
		return httpService(t, fmt.Sprintf("{name: %s, vip: 127.0.0.1:%d, data_plane: http, http: {tls: {cert: %s, key: %s}}, backends: [{address: %s}]}",
			name, port, crt, key, bs[0].Addr))
	}
	for _, cn := range []string{"first", "second", "api"} {
		crt, key := paths(cn)
		httpbackend.WriteCert(t, crt, key, cn)
	}
	p := httpplane.New(&health.Checker{}, slog.New(slog.DiscardHandler), nil)
	t.Cleanup(p.Close)
	web, api := freePort(t), freePort(t)
	if err := p.Add(tlsService("web", "first", web)); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	if got, err := served(web); err != nil || got != "first" {
		t.Fatalf("web serves %q, %v; want first", got, err)
	}

	// Clients handshake with web all along.
	var stop atomic.Bool
	var handshakes, failed atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	for range 4 {
		// Exits when stop is set, in the test's cleanup at the latest.
		wg.Go(func() {
			for !stop.Load() {
				cn, err := served(web)
				if err == nil && cn != "first" && cn != "second" {
					err = fmt.Errorf("certificate for %q", cn)
				}
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
					continue
				}
				handshakes.Add(1)
			}
		})
	}
	t.Cleanup(func() { stop.Store(true); wg.Wait() })
	progress := func(what string) {
		t.Helper()
		from := handshakes.Load()
		deadline := time.Now().Add(10 * time.Second)
		for handshakes.Load() < from+20 {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the clients made no progress", what)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	progress("before the change")
	old, _ := p.Get("web")
	// Each server hands out its own certificate, whichever accepted.
	ended := func(what string) {
		t.Helper()
		waitfor.Value(t, 10*time.Second, what+": the replaced server ended", func() (any, bool) {
			n := len(p.Draining("web"))
			return fmt.Sprintf("%d servers draining", n), n == 0
		})
	}
	if err := p.Update(tlsService("web", "first", web), tlsService("web", "second", web)); err != nil {
		t.Fatal(err)
	}
	progress("during the change")
	p.Abort()
	if now, _ := p.Get("web"); now != old {
		t.Fatal("after the abort: web's server is not the one it had")
	}
	ended("after the abort")
	for range 20 {
		if got, err := served(web); err != nil || got != "first" {
			t.Fatalf("web serves %q, %v after the abort; want first, the certificate it served", got, err)
		}
	}
	progress("after the abort")
	if err := p.Update(tlsService("web", "first", web), tlsService("web", "second", web)); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	ended("after the change")
	if got, err := served(web); err != nil || got != "second" {
		t.Fatalf("web serves %q, %v after the change; want second", got, err)
	}
	progress("after the change")
	stop.Store(true)
	wg.Wait()
	if n := failed.Load(); n > 0 {
		t.Errorf("%d handshakes with web failed (first: %v); want none", n, firstErr.Load())
	}

	// Added, aborted; its files then do not load.
	if err := p.Add(tlsService("api", "api", api)); err != nil {
		t.Fatal(err)
	}
	p.Abort()
	crt, key := paths("api")
	for _, f := range []string{crt, key} {
		if err := os.WriteFile(f, []byte("not pem\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var ce *httpplane.CertError
	if err := p.Add(tlsService("api", "api", api)); !errors.As(err, &ce) {
		t.Fatalf("adding api again while its files do not load: %v; want them named", err)
	}
	p.Abort()
	if _, ok := p.Get("api"); ok {
		t.Fatal("api is served though its files do not load")
	}
	httpbackend.WriteCert(t, crt, key, "api-renewed")
	if err := p.Add(tlsService("api", "api", api)); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	if got, err := served(api); err != nil || got != "api-renewed" {
		t.Errorf("api serves %q, %v; want api-renewed, its files read anew", got, err)
	}
}

// served returns the common name of the certificate the TLS server on
// 127.0.0.1:port hands out.
func served(port int) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return "", err
	}
	c := tls.Client(raw, &tls.Config{InsecureSkipVerify: true})
	defer c.Close()
	if err := c.HandshakeContext(ctx); err != nil {
		return "", err
	}
	return c.ConnectionState().PeerCertificates[0].Subject.CommonName, nil
}

// TestSwappedNamesKeepCertificates: two TLS services that swap their names,
// each address keeping its certificate files, hand out the certificate of
// the address a client connected to: the one a replaced server accepted
// before the change handshakes, as it drains, with the certificate that
// server started with, not the one its service's name has now (that of the
// other address, whose name the client did not ask for). Before, a
// service's servers all read one certificate by name, so the old server at
// web's address handed out api's; and the reload's reading of the files
// gave the old server the files its name has in the new config.
func TestSwappedNamesKeepCertificates(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	dir := t.TempDir()
	x, y := freePort(t), freePort(t)
	files := map[int][2]string{}
	for port, cn := range map[int]string{x: "x.example", y: "y.example"} {
		crt, key := filepath.Join(dir, cn+".crt"), filepath.Join(dir, cn+".key")
		httpbackend.WriteCert(t, crt, key, cn)
		files[port] = [2]string{crt, key}
	}
	at := func(name string, port int) *plan.Service {
		return httpService(t, fmt.Sprintf("{name: %s, vip: 127.0.0.1:%d, data_plane: http, http: {tls: {cert: %s, key: %s}}, backends: [{address: %s}]}",
			name, port, files[port][0], files[port][1], bs[0].Addr))
	}
	p := httpplane.New(&health.Checker{}, slog.New(slog.DiscardHandler), nil)
	t.Cleanup(p.Close)
	for name, port := range map[string]int{"web": x, "api": y} {
		if err := p.Add(at(name, port)); err != nil {
			t.Fatal(err)
		}
	}
	p.Commit()
	// Accepted by the old servers, which drain them once the change is
	// applied; the clients say hello only then.
	raws := map[int]net.Conn{}
	for name, port := range map[string]int{"web": x, "api": y} {
		raw, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { raw.Close() })
		raws[port] = raw
		lb, _ := p.Get(name)
		waitfor.Value(t, 10*time.Second, name+"'s connection accepted", func() (any, bool) {
			n := lb.Snapshot().Accepted
			return n, n == 1
		})
	}
	// As the agent applies a reload: the files read first, then the
	// operations.
	if err := p.ReadCertificates(plan.Desired{Services: []plan.Service{*at("web", y), *at("api", x)}}); err != nil {
		t.Fatal(err)
	}
	if err := p.Update(at("web", x), at("web", y)); err != nil {
		t.Fatal(err)
	}
	if err := p.Update(at("api", y), at("api", x)); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	for port, cn := range map[int]string{x: "x.example", y: "y.example"} {
		c := tls.Client(raws[port], &tls.Config{InsecureSkipVerify: true})
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if err := c.Handshake(); err != nil {
			t.Fatalf("handshake on 127.0.0.1:%d with the server that accepted it: %v", port, err)
		}
		if got := c.ConnectionState().PeerCertificates[0].Subject.CommonName; got != cn {
			t.Errorf("127.0.0.1:%d, accepted before the swap: certificate for %q; want %q", port, got, cn)
		}
		if got, err := served(port); err != nil || got != cn {
			t.Errorf("127.0.0.1:%d after the swap: certificate for %q, %v; want %q", port, got, err, cn)
		}
	}
}

// TestPlainKeepsNoCertificate: a TLS service that a change serves without TLS
// keeps no certificate; given TLS again by a later change, at the same paths,
// its files are read anew and the change is refused while they do not load,
// as for a new TLS service; a change to plain that is aborted leaves it, and
// a reload renews it in place. Before, the plane kept the certificate of the
// retired TLS server under the service's name for as long as the service
// lived, and the later change served it.
func TestPlainKeepsNoCertificate(t *testing.T) {
	w := newTLSWeb(t)
	p, port, crt, key, secure, plain := w.p, w.port, w.crt, w.key, w.secure, w.plain
	if err := p.Add(secure); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	if got, err := served(port); err != nil || got != "web" {
		t.Fatalf("web serves %q, %v; want web", got, err)
	}
	// Aborted, the change leaves the certificate, which a reload renews.
	if err := p.Update(secure, plain); err != nil {
		t.Fatal(err)
	}
	p.Abort()
	httpbackend.WriteCert(t, crt, key, "renewed")
	if err := p.ReadCertificates(plan.Desired{Services: []plan.Service{*secure}}); err != nil {
		t.Fatal(err)
	}
	if got, err := served(port); err != nil || got != "renewed" {
		t.Fatalf("after an aborted change to plain and a reload: web serves %q, %v; want renewed", got, err)
	}
	if err := p.Update(secure, plain); err != nil {
		t.Fatal(err)
	}
	p.Commit()
	for _, f := range []string{crt, key} {
		if err := os.WriteFile(f, []byte("not pem\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var ce *httpplane.CertError
	err := p.Update(plain, secure)
	if err == nil {
		p.Commit()
		got, herr := served(port)
		t.Fatalf("TLS again while its files do not load: applied, serving %q (%v); want the files named", got, herr)
	}
	p.Abort()
	if !errors.As(err, &ce) {
		t.Fatalf("TLS again while its files do not load: %v; want the files named", err)
	}
}
