package httpplane_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/websocket"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent"
)

// startH2load starts h2load in the background; wait returns its result.
func startH2load(t *testing.T, args ...string) (wait func() h2loadResult) {
	t.Helper()
	path, err := exec.LookPath("h2load")
	if err != nil {
		t.Fatalf("h2load not found (Debian nghttp2-client; make deps installs it): %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	var out strings.Builder
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		cmd.Wait()
	})
	return func() h2loadResult {
		t.Helper()
		if err := cmd.Wait(); err != nil {
			t.Fatalf("h2load: %v\n%s", err, out.String())
		}
		return parseH2load(t, out.String())
	}
}

func backendOf(t *testing.T, r *running, service, addr string) (health string, usable bool) {
	for _, b := range r.service(t, service).Backends {
		if b.Address == addr {
			return b.Health, b.Usable
		}
	}
	t.Fatalf("backend %s not in service %s", addr, service)
	return "", false
}

// TestBackendKilled: a backend dies under load (h2load, 2 connections × 50
// streams, idempotent GETs). The requests it held are retried on the others, so
// the client sees no error. With active checks it is marked down; with passive
// ejection alone (health: none) it is ejected after 3 failures in a row. Either
// way it serves again once it is back.
func TestBackendKilled(t *testing.T) {
	for _, c := range []struct {
		name, health, want string
	}{
		{"active", "{method: connect, interval: 200ms, rise: 1, fall: 2}", "down"},
		{"passive", "{type: none}", "ejected"},
	} {
		t.Run(c.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 3)
			port := freePort(t)
			r := startAgent(t, fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: round_robin, health: %s, passive: {consecutive: 3, base_ejection: 1s, max_ejection_percent: 50}, backends: %s}\n",
				port, c.health, backendList(bs)))
			for _, b := range bs {
				b.Delay.Store(int64(time.Millisecond)) // requests in flight on b when it dies
			}
			wait := startH2load(t, "-n", "20000", "-c", "2", "-m", "50", fmt.Sprintf("http://127.0.0.1:%d/", port))
			waitfor.Value(t, 20*time.Second, "load under way", func() (any, bool) { n := bs[1].Hits.Load(); return n, n > 1000 })
			bs[1].Kill()
			killedAt := bs[1].Hits.Load()
			waitfor.Value(t, 10*time.Second, "the killed backend "+c.want, func() (any, bool) {
				h, usable := backendOf(t, r, "web", bs[1].Addr.String())
				return h, h == c.want && !usable
			})
			res := wait()
			if res.succeeded != 20000 || res.ok2xx != 20000 {
				t.Fatalf("h2load: got %d succeeded, %d 2xx, %d failed; want all 20000 to succeed (idempotent: retried)\n%s", res.succeeded, res.ok2xx, res.failed, res.out)
			}
			var retries uint64
			for _, b := range r.service(t, "web").Backends {
				retries += b.Retries
			}
			t.Logf("killed after %d requests; %d retries", killedAt, retries)
			if err := bs[1].Restart(); err != nil {
				t.Fatal(err)
			}
			waitfor.Value(t, 10*time.Second, "the restarted backend usable", func() (any, bool) {
				h, usable := backendOf(t, r, "web", bs[1].Addr.String())
				return h, usable
			})
			before := bs[1].Hits.Load()
			res = h2load(t, "-n", "3000", "-c", "1", "-m", "30", fmt.Sprintf("http://127.0.0.1:%d/", port))
			if got := bs[1].Hits.Load() - before; res.succeeded != 3000 || got < 900 {
				t.Errorf("after recovery: %d succeeded, the backend got %d of 3000; want all, about 1000", res.succeeded, got)
			}
		})
	}
}

// TestServerErrorEjected: a backend answering 503 is ejected by passive health
// (its answers count as failures) while its checks (tcp) still pass; clients of
// idempotent requests get the other backends' answers (retried).
func TestServerErrorEjected(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	bs[0].Status.Store(http.StatusServiceUnavailable)
	port := freePort(t)
	r := startAgent(t, fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: round_robin, health: {method: connect}, passive: {consecutive: 5, max_ejection_percent: 50}, backends: %s}\n",
		port, backendList(bs)))
	res := h2load(t, "-n", "2000", "-c", "1", "-m", "10", fmt.Sprintf("http://127.0.0.1:%d/", port))
	if res.ok2xx != 2000 {
		t.Errorf("h2load: got %d 2xx of 2000; want all (503s are retried elsewhere)\n%s", res.ok2xx, res.out)
	}
	h, usable := backendOf(t, r, "web", bs[0].Addr.String())
	if usable || h != "ejected" {
		t.Errorf("the 503 backend: health %s, usable %t; want ejected", h, usable)
	}
	if n := bs[0].Hits.Load(); n > 50 {
		t.Errorf("the 503 backend got %d requests; want ejection after about 5", n)
	}
}

// TestNoBackend: with every backend down, requests get 503 naming the reason.
func TestNoBackend(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	port := freePort(t)
	startAgent(t, fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, health: {method: connect}, backends: [{address: %s, drain: true}]}\n",
		port, bs[0].Addr))
	code, body := get(t, http.DefaultClient, fmt.Sprintf("http://127.0.0.1:%d/", port))
	if code != http.StatusServiceUnavailable || !strings.Contains(body, `service "web": no usable backend`) {
		t.Errorf("got %d %q; want 503 naming the service and the reason", code, body)
	}
}

// TestReloadInPlace: reloads that change the algorithm and the retries while
// h2load runs are applied to the running service: client connections stay
// open, no request is lost.
func TestReloadInPlace(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	port := freePort(t)
	svc := "  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: %s, health: {method: connect}, http: {retries: %d}, backends: %s}\n"
	r := startAgent(t, fmt.Sprintf(svc, port, "round_robin", 2, backendList(bs)))
	for _, b := range bs {
		b.Delay.Store(int64(time.Millisecond))
	}
	wait := startH2load(t, "-n", "20000", "-c", "4", "-m", "25", fmt.Sprintf("http://127.0.0.1:%d/", port))
	waitfor.Value(t, 20*time.Second, "load under way", func() (any, bool) { n := bs[0].Hits.Load(); return n, n > 1000 })
	for i, algo := range []string{"ewma", "least_conn", "p2c"} {
		r.writeConfig(t, fmt.Sprintf(svc, port, algo, 3+i, backendList(bs)))
		if err := r.a.Reload(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := r.service(t, "web").Algorithm; got != algo {
			t.Fatalf("after reload: algorithm %s; want %s", got, algo)
		}
	}
	res := wait()
	if res.succeeded != 20000 || res.ok2xx != 20000 {
		t.Fatalf("h2load across 3 reloads: got %d succeeded, %d 2xx, %d failed; want all 20000\n%s", res.succeeded, res.ok2xx, res.failed, res.out)
	}
	if got := r.service(t, "web").Accepted; got != 4 {
		t.Errorf("connections accepted: %d; want h2load's 4, kept across the reloads", got)
	}
}

// TestStartCertificateNamesLine: an agent that cannot start because a service's
// certificate and key do not load says so as weir validate and a refused reload
// do: the file, the line and the field.
func TestStartCertificateNamesLine(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	dir := t.TempDir()
	r := &running{config: filepath.Join(dir, "weir.yaml"), metrics: "off"}
	missing, keyPath := filepath.Join(dir, "missing.crt"), filepath.Join(dir, "tls.key")
	httpbackend.WriteCert(t, filepath.Join(dir, "tls.crt"), keyPath, "first")
	r.writeConfig(t, fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, http: {tls: {cert: %s, key: %s}}, health: {type: none}, backends: %s}\n",
		freePort(t), missing, keyPath, backendList(bs)))
	a := agent.New(agent.Options{ConfigPath: r.config, NoXDP: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	err := a.Run(ctx)
	want := fmt.Sprintf("%s:4: services[0].http.tls: cert %s and key %s do not load: open %s: ", r.config, missing, keyPath, missing)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("start with a certificate that does not load: got %v; want it to say %q...", err, want)
	}
}

// TestReloadReadsCertificate: a reload reads the TLS certificate and key files
// again, so renewed files at the same paths are served from then on; a pair
// that does not load refuses the reload, naming the files, and so does a
// reload that fails elsewhere after reading them: the certificate served stays.
// weir plan, asked first, says the reload would be refused, in the same words.
func TestReloadReadsCertificate(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	port := freePort(t)
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	httpbackend.WriteCert(t, certPath, keyPath, "first")
	web := fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, http: {tls: {cert: %s, key: %s}}, health: {type: none}, backends: %s}\n",
		port, certPath, keyPath, backendList(bs))
	r := startAgent(t, web)
	served := func(when string, want string) {
		t.Helper()
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", fmt.Sprintf("127.0.0.1:%d", port), &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		defer c.Close()
		if got := c.ConnectionState().PeerCertificates[0].Subject.CommonName; got != want {
			t.Errorf("certificate %s: got %q; want %q", when, got, want)
		}
	}
	served("before the renewal", "first")
	httpbackend.WriteCert(t, certPath, keyPath, "renewed")
	if err := r.a.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	served("after the renewal and a reload", "renewed")

	if err := os.WriteFile(keyPath, []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	// As weir validate reports it: the file, the line and the field.
	refused := func(what, want string) {
		t.Helper()
		p, err := r.a.Plan(context.Background(), nil, "", nil)
		if err != nil || !strings.HasPrefix(p.Refused, want) {
			t.Errorf("plan %s: got refused %q, error %v; want refused as %q...", what, p.Refused, err, want)
		}
		if err := r.a.Reload(context.Background()); err == nil || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("reload %s: got %v; want it refused as %q...", what, err, want)
		}
	}
	refused("with a key file that does not load", fmt.Sprintf("%s:4: services[0].http.tls: cert %s and key %s do not load: ", r.config, certPath, keyPath))
	served("after a reload refused for the key", "renewed")

	// A service the reload adds reads its pair as it starts: the same report.
	missing := filepath.Join(dir, "missing.crt")
	r.writeConfig(t, web+fmt.Sprintf("  - {name: c, vip: 127.0.0.1:%d, data_plane: http, http: {tls: {cert: %s, key: %s}}, health: {type: none}, backends: %s}\n",
		freePort(t), missing, keyPath, backendList(bs)))
	httpbackend.WriteCert(t, certPath, keyPath, "renewed")
	refused("adding a service whose certificate does not load", fmt.Sprintf("%s:5: services[1].http.tls: cert %s and key %s do not load: open %s: ", r.config, missing, keyPath, missing))
	r.writeConfig(t, web)

	// b binds an address no interface holds: its add fails after the files
	// were read.
	httpbackend.WriteCert(t, certPath, keyPath, "third")
	r.writeConfig(t, web+fmt.Sprintf("  - {name: b, vip: 192.0.2.77:80, data_plane: http, health: {type: none}, backends: %s}\n", backendList(bs)))
	if err := r.a.Reload(context.Background()); err == nil {
		t.Error("reload with a service that cannot bind: got no error")
	}
	served("after a reload refused for another service", "renewed")
}

// TestReloadRelativeCertificate: relative certificate and key paths are the
// config file's directory's, not the agent's working directory's (this test
// runs in the package's), so a reload serves the pair beside the file.
func TestReloadRelativeCertificate(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	port := freePort(t)
	svc := "  - {name: web, vip: 127.0.0.1:%d, data_plane: http, %shealth: {type: none}, backends: %s}\n"
	r := startAgent(t, fmt.Sprintf(svc, port, "", backendList(bs)))
	dir := filepath.Dir(r.config)
	if err := os.Mkdir(filepath.Join(dir, "tls"), 0o700); err != nil {
		t.Fatal(err)
	}
	httpbackend.WriteCert(t, filepath.Join(dir, "tls", "web.crt"), filepath.Join(dir, "tls", "web.key"), "beside the config")
	r.writeConfig(t, fmt.Sprintf(svc, port, "http: {tls: {cert: tls/web.crt, key: tls/web.key}}, ", backendList(bs)))
	if err := r.a.Reload(context.Background()); err != nil {
		t.Fatalf("reload with relative certificate paths: %v", err)
	}
	waitfor.Value(t, 10*time.Second, "the certificate beside the config served", func() (any, bool) {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", fmt.Sprintf("127.0.0.1:%d", port), &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			return err, false
		}
		defer c.Close()
		cn := c.ConnectionState().PeerCertificates[0].Subject.CommonName
		return cn, cn == "beside the config"
	})
}

// TestGOAWAYOnRebuild: a reload that needs a new listener (a server setting
// changed) while a client has requests in flight on one HTTP/2 connection: the
// old server sends GOAWAY and finishes the streams it took, the new one (same
// port, SO_REUSEPORT) takes the client's next connection, and no request fails.
func TestGOAWAYOnRebuild(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	port := freePort(t)
	svc := "  - {name: web, vip: 127.0.0.1:%d, data_plane: http, health: {method: connect}, http: {read_header_timeout: %ds}, backends: %s}\n"
	r := startAgent(t, fmt.Sprintf(svc, port, 10, backendList(bs)))
	for _, b := range bs {
		b.Delay.Store(int64(5 * time.Millisecond))
	}
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	client := &http.Client{Transport: &http.Transport{Protocols: &p}, Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var ok, failed atomic.Int64
	errs := make(chan error, 1)
	for range 20 {
		wg.Go(func() {
			for ctx.Err() == nil {
				resp, err := client.Get(url)
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 {
						err = fmt.Errorf("status %s", resp.Status)
					}
				}
				if err != nil {
					failed.Add(1)
					select {
					case errs <- err:
					default:
					}
					continue
				}
				ok.Add(1)
			}
		})
	}
	waitfor.Value(t, 10*time.Second, "load under way", func() (any, bool) { n := ok.Load(); return n, n > 200 })
	r.writeConfig(t, fmt.Sprintf(svc, port, 11, backendList(bs)))
	if err := r.a.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The new server answers once the client has moved to it.
	waitfor.Value(t, 10*time.Second, "a connection to the new server", func() (any, bool) {
		n := r.service(t, "web").Accepted
		return n, n > 0
	})
	at := ok.Load()
	waitfor.Value(t, 10*time.Second, "requests through the new server", func() (any, bool) { n := ok.Load() - at; return n, n > 200 })
	stop()
	wg.Wait()
	if n := failed.Load(); n > 0 {
		t.Errorf("%d requests failed across the rebuild (first: %v); want none (%d succeeded)", n, <-errs, ok.Load())
	}
}

// TestMetrics: the http plane's requests are counted per backend and status
// class, and timed, in the agent's Prometheus exposition; the byte and backend
// connection counters, which the plane does not keep, are left out rather than
// shown as zeros.
func TestMetrics(t *testing.T) {
	bs := httpbackend.StartN(t, 2)
	bs[1].Status.Store(http.StatusInternalServerError)
	port, mport := freePort(t), freePort(t)
	startAgent(t, fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: round_robin, health: {method: connect}, passive: {consecutive: 0}, backends: %s}\n",
		port, backendList(bs)), fmt.Sprintf("127.0.0.1:%d", mport))
	for range 10 {
		get(t, http.DefaultClient, fmt.Sprintf("http://127.0.0.1:%d/x", port)) // b's 500s are answered as they are: only 502, 503 and 504 are retried
	}
	_, body := get(t, http.DefaultClient, fmt.Sprintf("http://127.0.0.1:%d/metrics", mport))
	for _, want := range []string{
		fmt.Sprintf(`weir_http_requests_total{backend="%s",class="2xx",service="web"}`, bs[0].Addr),
		fmt.Sprintf(`weir_http_requests_total{backend="%s",class="5xx",service="web"}`, bs[1].Addr),
		fmt.Sprintf(`weir_http_request_duration_seconds_count{backend="%s",service="web"}`, bs[0].Addr),
		`weir_service_connections_total{service="web"}`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	for _, unkept := range []string{"weir_service_bytes_total{", "weir_backend_bytes_total{", "weir_backend_connections_active{", "weir_backend_connects_total{"} {
		if strings.Contains(body, unkept) {
			t.Errorf("metrics have %s...; want none for an http service, which keeps no such counter", unkept)
		}
	}
}

// TestDrainThroughAgent: weir drain takes a backend out of the http plane's
// choice while h2load runs: it finishes what it has and gets nothing new;
// undrained, it takes its share again.
func TestDrainThroughAgent(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	port := freePort(t)
	r := startAgent(t, fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: round_robin, health: {method: connect}, backends: %s}\n",
		port, backendList(bs)))
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	ctx := context.Background()
	if err := r.a.SetDrain(ctx, "web", bs[2].Addr.String(), true); err != nil {
		t.Fatal(err)
	}
	before := hits(bs)
	if res := h2load(t, "-n", "3000", "-c", "1", "-m", "30", url); res.succeeded != 3000 {
		t.Fatalf("h2load: %d of 3000 succeeded\n%s", res.succeeded, res.out)
	}
	if sh, _ := shares(bs, before); sh[2] != 0 {
		t.Errorf("drained backend: share %.3f; want 0", sh[2])
	}
	if err := r.a.SetDrain(ctx, "web", bs[2].Addr.String(), false); err != nil {
		t.Fatal(err)
	}
	before = hits(bs)
	h2load(t, "-n", "3000", "-c", "1", "-m", "30", url)
	if sh, _ := shares(bs, before); sh[2] < 0.3 {
		t.Errorf("undrained backend: share %.3f; want a third", sh[2])
	}
}

// TestWebSocketThroughAgent: a WebSocket client (x/net/websocket) reaches the
// backends' echo through a configured http service, and while its tunnel is
// open the agent's status and metrics count it; closed, it is gone from both.
func TestWebSocketThroughAgent(t *testing.T) {
	bs := httpbackend.StartN(t, 2)
	port, mport := freePort(t), freePort(t)
	r := startAgent(t, fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: least_conn, health: {method: connect}, backends: %s}\n",
		port, backendList(bs)), fmt.Sprintf("127.0.0.1:%d", mport))
	ws, err := websocket.Dial(fmt.Sprintf("ws://127.0.0.1:%d/ws", port), "", "http://127.0.0.1/")
	if err != nil {
		t.Fatalf("WebSocket handshake through the agent's http service: %v", err)
	}
	defer ws.Close()
	var got string
	ws.SetDeadline(time.Now().Add(5 * time.Second))
	if err := websocket.Message.Send(ws, "ping"); err != nil {
		t.Fatal(err)
	}
	if err := websocket.Message.Receive(ws, &got); err != nil || got != "ping" {
		t.Fatalf("echo: %q, %v", got, err)
	}
	st := r.service(t, "web")
	if st.Tunnels != 1 || st.InFlight != 1 {
		t.Errorf("status with a tunnel open: %d tunnels, %d in flight; want 1 and 1", st.Tunnels, st.InFlight)
	}
	var perBackend int
	for _, b := range st.Backends {
		if b.Tunnels != 0 && (b.Tunnels != 1 || b.InFlight != 1) {
			t.Errorf("status of backend %s: %d tunnels, %d in flight; want 1 and 1 or none", b.Address, b.Tunnels, b.InFlight)
		}
		perBackend += b.Tunnels
	}
	if perBackend != 1 {
		t.Errorf("the backends' statuses count %d tunnels; want 1", perBackend)
	}
	_, body := get(t, http.DefaultClient, fmt.Sprintf("http://127.0.0.1:%d/metrics", mport))
	for _, want := range []string{`weir_http_tunnels_open{service="web"} 1`, `weir_http_requests_in_flight{service="web"} 1`} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	ws.Close()
	waitfor.Value(t, 5*time.Second, "no tunnel in the status", func() (any, bool) {
		st := r.service(t, "web")
		return [2]int64{st.Tunnels, st.InFlight}, st.Tunnels == 0 && st.InFlight == 0
	})
}
