package agent

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestStoppedServerStartedAnew: an http service whose server stopped on its
// own (its Serve returned with an error, as when its listener fails) is
// started anew by the agent, with no change to the config. While it cannot be
// (here its address is taken), status and metrics say that it serves
// nothing and why; once it is, they count the restart, and its per-backend
// counters go on from where they were. Before, the service served nothing
// until the next change that touched it, and status showed nothing wrong.
func TestStoppedServerStartedAnew(t *testing.T) {
	w := startTLSWeb(t, "web")
	a, vip := w.a, w.vip
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	get := func() error {
		resp, err := c.Get("https://" + vip + "/")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	if err := get(); err != nil {
		t.Fatal(err)
	}
	metric := func(name string) string {
		rec := httptest.NewRecorder()
		a.metrics.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		for line := range strings.Lines(rec.Body.String()) {
			if v, ok := strings.CutPrefix(line, name+`{service="web"} `); ok {
				return strings.TrimSpace(v)
			}
		}
		return "none"
	}

	// The server stops, and its address is taken until release, so that
	// starting it anew fails until then.
	release, early := stopHeld(t, a, "web", vip)
	waitfor.Value(t, 10*time.Second, "status: down because the address is in use; metrics: serving 0", func() (any, bool) {
		st, err := a.Status()
		if err != nil {
			return err, false
		}
		s := st.Services[0]
		serving := metric("weir_service_serving")
		return fmt.Sprintf("down %q, restarts %d, serving %s", s.Down, s.Restarts, serving),
			strings.Contains(s.Down, "address already in use") && s.Restarts == uint64(early) && serving == "0"
	})

	release()
	waitfor.Value(t, 15*time.Second, "a 200 with no change to the config", func() (any, bool) {
		err := get()
		return err, err == nil
	})
	st, err := a.Status()
	if err != nil {
		t.Fatal(err)
	}
	s := st.Services[0]
	if s.Down != "" || s.Restarts != uint64(early+1) {
		t.Errorf("status after the restart: down %q, restarts %d; want \"\", %d", s.Down, s.Restarts, early+1)
	}
	// Requests are counted as they end: the second may still be counting.
	waitfor.Value(t, 10*time.Second, "2 requests counted on the backend, the first server's too", func() (any, bool) {
		st, err := a.Status()
		if err != nil {
			return err, false
		}
		n := st.Services[0].Backends[0].Requests
		return n, n == 2
	})
	if got, got2 := metric("weir_service_restarts_total"), metric("weir_service_serving"); got != fmt.Sprint(early+1) || got2 != "1" {
		t.Errorf("metrics after the restart: restarts_total %s, serving %s; want %d, 1", got, got2, early+1)
	}
}

// TestRevivedCertificateKeptOnAbort: an http service started anew reads its
// certificate files as it starts; a later reload that is refused (here for
// another service, which cannot bind) leaves the service serving the
// certificate it had, not the one it had before it was started anew. Before,
// the restart was taken for the refused reload's change, whose undoing put
// the older certificate back.
func TestRevivedCertificateKeptOnAbort(t *testing.T) {
	w := startTLSWeb(t, "first")
	a, vip := w.a, w.vip
	served := func() string {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", vip, &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			return err.Error()
		}
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	if got := served(); got != "first" {
		t.Fatalf("certificate at start: got %q; want \"first\"", got)
	}

	httpbackend.WriteCert(t, w.cert, w.key, "renewed")
	lb, _ := a.http.Get("web")
	lb.Close() // its Serve returns with an error, as when its listener fails
	waitfor.Value(t, 15*time.Second, "the service started anew, with the renewed certificate", func() (any, bool) {
		got := served()
		return got, got == "renewed"
	})

	bad := w.cfg + fmt.Sprintf("- {name: b, vip: 192.0.2.77:80, data_plane: http, health: {type: none}, backends: [{address: %s}]}\n", w.backend.Addr)
	if err := os.WriteFile(w.path, []byte(bad), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload(context.Background()); err == nil {
		t.Fatal("reload with a service that cannot bind: got no error")
	}
	if got := served(); got != "renewed" {
		t.Errorf("certificate after a refused reload: got %q; want \"renewed\", as before it", got)
	}
}

// TestRestartKeepsCertificate: an http service whose server stopped on its
// own is started anew with the certificate it served when its files are gone
// (renewal tools replace them, an operator moves them), and the log says so;
// a reload is still refused while they do not load, naming the field. Before,
// the service stayed down until the files were back, though the certificate
// was in memory.
func TestRestartKeepsCertificate(t *testing.T) {
	w := startTLSWeb(t, "web")
	for _, f := range []string{w.cert, w.key} {
		if err := os.Remove(f); err != nil {
			t.Fatal(err)
		}
	}
	lb, _ := w.a.http.Get("web")
	lb.Close() // its Serve returns with an error, as when its listener fails
	waitfor.Value(t, 15*time.Second, "the service started anew, with the certificate it had", func() (any, bool) {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", w.vip, &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			return err, false
		}
		defer c.Close()
		cn := c.ConnectionState().PeerCertificates[0].Subject.CommonName
		return cn, cn == "web"
	})
	select {
	case <-w.certKept:
	case <-time.After(10 * time.Second):
		t.Error("no log line says that the certificate in memory is served")
	}
	st, err := w.a.Status()
	if err != nil {
		t.Fatal(err)
	}
	if s := st.Services[0]; s.Down != "" || s.Restarts != 1 {
		t.Errorf("status after the restart: down %q, restarts %d; want \"\", 1", s.Down, s.Restarts)
	}
	want := fmt.Sprintf("%s:4: services[0].http.tls: cert %s and key %s do not load: ", w.path, w.cert, w.key)
	if err := w.a.Reload(context.Background()); err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Errorf("reload with the files gone: got %v; want it refused as %q...", err, want)
	}
}

// tlsWeb is an agent serving one http service, web, over TLS with the
// certificate files cert and key, to one backend.
type tlsWeb struct {
	a                    *Agent
	backend              *httpbackend.Backend
	path, cfg, cert, key string // the config file and its text; the pair
	vip                  string
	certKept             chan struct{} // closed when the log says the certificate in memory is served
}

// startTLSWeb starts a tlsWeb whose certificate names cn.
func startTLSWeb(t *testing.T, cn string) tlsWeb {
	w := tlsWeb{backend: httpbackend.StartN(t, 1)[0], vip: freePort(t), certKept: make(chan struct{})}
	dir := t.TempDir()
	w.path, w.cert, w.key = filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "web.crt"), filepath.Join(dir, "web.key")
	httpbackend.WriteCert(t, w.cert, w.key, cn)
	w.cfg = fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n", filepath.Join(dir, "weir.sock")) +
		fmt.Sprintf("- {name: web, vip: %s, data_plane: http, http: {tls: {cert: %s, key: %s}}, health: {type: none}, backends: [{address: %s}]}\n",
			w.vip, w.cert, w.key, w.backend.Addr)
	if err := os.WriteFile(w.path, []byte(w.cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	w.a = runAgentLogged(t, w.path, slog.New(onMessage{"http plane: certificate files do not load; serving the certificate last read from them",
		sync.OnceFunc(func() { close(w.certKept) })}))
	return w
}

// TestDownServiceTakesBackendChange: a change to the backends of a service
// whose server stopped and cannot be started anew for now (here its address
// is taken) is applied: it is no change to what the server
// binds, so it is no reason for it to fail, and the server started anew
// later serves with it. Before, the change failed, and so did every later
// change that carried it (a health change, a drain) until the server served.
func TestDownServiceTakesBackendChange(t *testing.T) {
	w := startTLSWeb(t, "web")
	release, _ := stopHeld(t, w.a, "web", w.vip)
	waitfor.Value(t, 10*time.Second, "status: down because the address is in use", func() (any, bool) {
		st, err := w.a.Status()
		if err != nil {
			return err, false
		}
		return st.Services[0].Down, strings.Contains(st.Services[0].Down, "address already in use")
	})
	if err := w.a.SetDrain(context.Background(), "web", w.backend.Addr.String(), true); err != nil {
		t.Fatalf("drain a backend of the service that is down: %v; want it drained", err)
	}
	st, err := w.a.Status()
	if err != nil {
		t.Fatal(err)
	}
	if s := st.Services[0]; !s.Backends[0].Drained || s.Down == "" {
		t.Errorf("after the drain: backend drained %v, service down %q; want drained, still down", s.Backends[0].Drained, s.Down)
	}
	release()
	waitfor.Value(t, 15*time.Second, "the service started anew", func() (any, bool) {
		st, err := w.a.Status()
		if err != nil {
			return err, false
		}
		return st.Services[0].Down, st.Services[0].Down == ""
	})
	if err := w.a.SetDrain(context.Background(), "web", w.backend.Addr.String(), false); err != nil {
		t.Errorf("end the drain once the service serves: %v", err)
	}
}

// stopHeld stops the named http service's server, as when its listener fails,
// and binds its address without SO_REUSEPORT, so that starting it anew fails
// (address in use) until release is called. A server the agent started anew
// before the address was bound is stopped again: early says how many were.
func stopHeld(t *testing.T, a *Agent, name, addr string) (release func(), early int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		lb, ok := a.http.Get(name)
		if !ok {
			t.Fatalf("service %s not served", name)
		}
		lb.Close() // its Serve returns with an error
		if ln, err := net.Listen("tcp", addr); err == nil {
			release = sync.OnceFunc(func() { ln.Close() })
			t.Cleanup(release)
			return release, early
		}
		// Started anew before the bind: stop that server in turn.
		for next, _ := a.http.Get(name); next == lb; next, _ = a.http.Get(name) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: could not bind its address %s while its server was stopped", name, addr)
			}
			time.Sleep(5 * time.Millisecond)
		}
		early++
	}
}

// TestRenewalReachesNewestServer: certificate files renewed at the same paths
// are served at once after `weir reload` by the server the service has now:
// one that a reload with new paths started, and one started anew after its
// server stopped on its own. Each server holds a certificate of its own; the
// reload renews that of the newest.
func TestRenewalReachesNewestServer(t *testing.T) {
	w := startTLSWeb(t, "first")
	served := func() string {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", w.vip, &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			return err.Error()
		}
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	dir := filepath.Dir(w.cert)
	cert, key := filepath.Join(dir, "next.crt"), filepath.Join(dir, "next.key")
	cfg := strings.NewReplacer(w.cert, cert, w.key, key).Replace(w.cfg)
	if err := os.WriteFile(w.path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	// newServer: the reload starts a server in place of the one serving. The
	// one it replaced is told to stop as the reload returns, and until its
	// accept has ended it may still take a connection from the socket the two
	// share (with its certificate); a renewal in place is served at once.
	renew := func(cn, when string, newServer bool) {
		t.Helper()
		httpbackend.WriteCert(t, cert, key, cn)
		if err := w.a.Reload(context.Background()); err != nil {
			t.Fatalf("%s: reload: %v", when, err)
		}
		if newServer {
			waitfor.Value(t, 5*time.Second, when+": certificate "+cn, func() (any, bool) {
				got := served()
				return got, got == cn
			})
			return
		}
		if got := served(); got != cn {
			t.Errorf("%s: certificate after the reload: got %q; want %q", when, got, cn)
		}
	}
	renew("second", "new paths", true)
	renew("renewed", "renewed at the new paths", false)

	lb, _ := w.a.http.Get("web")
	lb.Close() // its Serve returns with an error, as when its listener fails
	waitfor.Value(t, 15*time.Second, "the service started anew", func() (any, bool) {
		st, err := w.a.Status()
		if err != nil {
			return err, false
		}
		s := st.Services[0]
		return fmt.Sprintf("down %q, restarts %d", s.Down, s.Restarts), s.Down == "" && s.Restarts == 1
	})
	renew("third", "started anew", false)
}
