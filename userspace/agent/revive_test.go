package agent

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestStoppedServerStartedAnew: an http service whose server stopped on its
// own (its Serve returned with an error, as when its listener fails) is
// started anew by the agent, with no change to the config. While it cannot be
// (here its certificate does not load), status and metrics say that it serves
// nothing and why; once it is, they count the restart, and its per-backend
// counters go on from where they were. Before, the service served nothing
// until the next change that touched it, and status showed nothing wrong.
func TestStoppedServerStartedAnew(t *testing.T) {
	w := startTLSWeb(t, "web")
	a, vip, certPath := w.a, w.vip, w.cert
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

	// The certificate goes, so that starting the server anew fails until it
	// is back; then the server stops.
	if err := os.Rename(certPath, certPath+".away"); err != nil {
		t.Fatal(err)
	}
	lb, _ := a.http.Get("web")
	lb.Close()
	waitfor.Value(t, 10*time.Second, "status: down because the certificate does not load; metrics: serving 0", func() (any, bool) {
		st, err := a.Status()
		if err != nil {
			return err, false
		}
		s := st.Services[0]
		serving := metric("weir_service_serving")
		return fmt.Sprintf("down %q, restarts %d, serving %s", s.Down, s.Restarts, serving),
			strings.Contains(s.Down, "do not load") && s.Restarts == 0 && serving == "0"
	})

	if err := os.Rename(certPath+".away", certPath); err != nil {
		t.Fatal(err)
	}
	waitfor.Value(t, 15*time.Second, "a 200 with no change to the config", func() (any, bool) {
		err := get()
		return err, err == nil
	})
	st, err := a.Status()
	if err != nil {
		t.Fatal(err)
	}
	s := st.Services[0]
	if s.Down != "" || s.Restarts != 1 {
		t.Errorf("status after the restart: down %q, restarts %d; want \"\", 1", s.Down, s.Restarts)
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
	if got, got2 := metric("weir_service_restarts_total"), metric("weir_service_serving"); got != "1" || got2 != "1" {
		t.Errorf("metrics after the restart: restarts_total %s, serving %s; want 1, 1", got, got2)
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

// tlsWeb is an agent serving one http service, web, over TLS with the
// certificate files cert and key, to one backend.
type tlsWeb struct {
	a                    *Agent
	backend              *httpbackend.Backend
	path, cfg, cert, key string // the config file and its text; the pair
	vip                  string
}

// startTLSWeb starts a tlsWeb whose certificate names cn.
func startTLSWeb(t *testing.T, cn string) tlsWeb {
	w := tlsWeb{backend: httpbackend.StartN(t, 1)[0], vip: freePort(t)}
	dir := t.TempDir()
	w.path, w.cert, w.key = filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "web.crt"), filepath.Join(dir, "web.key")
	httpbackend.WriteCert(t, w.cert, w.key, cn)
	w.cfg = fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n", filepath.Join(dir, "weir.sock")) +
		fmt.Sprintf("- {name: web, vip: %s, data_plane: http, http: {tls: {cert: %s, key: %s}}, health: {type: none}, backends: [{address: %s}]}\n",
			w.vip, w.cert, w.key, w.backend.Addr)
	if err := os.WriteFile(w.path, []byte(w.cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	w.a = runAgent(t, w.path)
	return w
}

// TestDownServiceTakesBackendChange: a change to the backends of a service
// whose server stopped and cannot be started anew for now (here its
// certificate does not load) is applied: it is no change to what the server
// binds, so it is no reason for it to fail, and the server started anew
// later serves with it. Before, the change failed, and so did every later
// change that carried it (a health change, a drain) until the server served.
func TestDownServiceTakesBackendChange(t *testing.T) {
	w := startTLSWeb(t, "web")
	if err := os.Rename(w.cert, w.cert+".away"); err != nil {
		t.Fatal(err)
	}
	lb, _ := w.a.http.Get("web")
	lb.Close() // its Serve returns with an error, as when its listener fails
	waitfor.Value(t, 10*time.Second, "status: down because the certificate does not load", func() (any, bool) {
		st, err := w.a.Status()
		if err != nil {
			return err, false
		}
		return st.Services[0].Down, strings.Contains(st.Services[0].Down, "do not load")
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
	if err := os.Rename(w.cert+".away", w.cert); err != nil {
		t.Fatal(err)
	}
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
