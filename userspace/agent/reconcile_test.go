package agent

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/internal/churn"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/agent/xdpplane"
	"github.com/weir-lb/weir/userspace/config"
)

// recordingPlane stands in for a data plane (XDP and the proxy need a kernel and
// sockets; this test is about the loop's rollback alone): it keeps the services it
// was given and fails the operation failOn names, after applying it, as a partial
// write would.
type recordingPlane struct {
	services map[string]plan.Service
	failOn   string // "add a", "update b", ...
}

func (p *recordingPlane) fail(kind plan.OpKind, name string) error {
	if p.failOn == fmt.Sprintf("%s %s", kind, name) {
		return errors.New("injected failure")
	}
	return nil
}

func (p *recordingPlane) Add(s *plan.Service) error {
	p.services[s.Name()] = *s
	return p.fail(plan.Add, s.Name())
}

func (p *recordingPlane) Update(_, next *plan.Service) error {
	p.services[next.Name()] = *next
	return p.fail(plan.Update, next.Name())
}

func (p *recordingPlane) SetBackend(_, next *plan.Service, _ netip.AddrPort) error {
	p.services[next.Name()] = *next
	return p.fail(plan.SetBackend, next.Name())
}

func (p *recordingPlane) Remove(s *plan.Service) error {
	delete(p.services, s.Name())
	return p.fail(plan.Remove, s.Name())
}

// TestReconcileRollsBack: whichever write fails, the planes end up running the
// previous desired state again, and the error is returned.
func TestReconcileRollsBack(t *testing.T) {
	svc := func(name string, plane plan.Plane, weights ...uint32) plan.Service {
		s := plan.Service{Config: config.Service{Name: name, VIP: netip.MustParseAddrPort("192.0.2.1:80")},
			Placement: plan.Placement{Plane: plane}, Installed: true}
		for i, w := range weights {
			addr := netip.AddrPortFrom(netip.MustParseAddr("192.0.2.10"), uint16(80+i))
			s.Config.Backends = append(s.Config.Backends, config.Backend{Addr: addr, Weight: w})
			s.Backends = append(s.Backends, plan.Backend{ID: plan.ID(name, addr), Config: s.Config.Backends[i], Weight: w, Usable: true})
		}
		return s
	}
	prev := plan.Desired{Services: []plan.Service{
		svc("web", plan.Proxy, 1, 1),
		svc("dns", plan.XDP, 1, 1),
		svc("old", plan.XDP, 1),
		svc("moves", plan.XDP, 1),
	}}
	overridden := svc("dns", plan.XDP, 1, 1)
	overridden.Backends = slices.Clone(overridden.Backends)
	overridden.Backends[1].Weight, overridden.Backends[1].Override = 5, true
	next := plan.Desired{Services: []plan.Service{
		svc("web", plan.Proxy, 2, 1, 1), // backend added: update
		overridden,                      // one weight at runtime: set-backend
		svc("new", plan.XDP, 1),         // added
		svc("moves", plan.Proxy, 1),     // to the proxy: add there, remove from XDP
	}}
	for _, failOn := range []string{"add moves", "update web", "set-backend dns", "add new", "remove old", "remove moves"} {
		t.Run(failOn, func(t *testing.T) {
			planes := map[plan.Plane]*recordingPlane{plan.XDP: {services: map[string]plan.Service{}}, plan.Proxy: {services: map[string]plan.Service{}}}
			for _, s := range prev.Services {
				planes[s.Plane].services[s.Name()] = s
			}
			a := &Agent{log: slog.New(slog.NewTextHandler(io.Discard, nil)), planes: map[plan.Plane]Plane{}}
			for k, p := range planes {
				a.planes[k] = p
			}
			planeOf := map[string]plan.Plane{"add moves": plan.Proxy, "update web": plan.Proxy, "remove moves": plan.XDP}
			pl, ok := planeOf[failOn]
			if !ok {
				pl = plan.XDP
			}
			planes[pl].failOn = failOn

			err := a.reconcile(prev, next)
			if err == nil {
				t.Fatal("reconcile: got no error; want the injected failure")
			}
			for kind, p := range planes {
				want := map[string]plan.Service{}
				for _, s := range prev.Services {
					if s.Plane == kind {
						want[s.Name()] = s
					}
				}
				if !reflect.DeepEqual(p.services, want) {
					t.Errorf("%s plane after the rollback: got %v; want %v", kind, slices.Sorted(maps.Keys(p.services)), slices.Sorted(maps.Keys(want)))
					for name, s := range p.services {
						if w, ok := want[name]; ok && !reflect.DeepEqual(s, w) {
							t.Errorf("%s plane, service %s: got %+v; want %+v", kind, name, s.Backends, w.Backends)
						}
					}
				}
			}
		})
	}
	t.Run("no failure", func(t *testing.T) {
		planes := map[plan.Plane]*recordingPlane{plan.XDP: {services: map[string]plan.Service{}}, plan.Proxy: {services: map[string]plan.Service{}}}
		for _, s := range prev.Services {
			planes[s.Plane].services[s.Name()] = s
		}
		a := &Agent{log: slog.New(slog.NewTextHandler(io.Discard, nil)), planes: map[plan.Plane]Plane{plan.XDP: planes[plan.XDP], plan.Proxy: planes[plan.Proxy]}}
		if err := a.reconcile(prev, next); err != nil {
			t.Fatal(err)
		}
		for kind, p := range planes {
			var got []string
			for _, name := range slices.Sorted(maps.Keys(p.services)) {
				got = append(got, name)
			}
			var want []string
			for _, s := range next.Services {
				if s.Plane == kind {
					want = append(want, s.Name())
				}
			}
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Errorf("%s plane: got %v; want %v", kind, got, want)
			}
		}
	})
}

// runAgent runs an agent without XDP on the config at path until the test ends,
// and returns it once it takes events.
func runAgent(t *testing.T, path string) *Agent {
	t.Helper()
	return runAgentLogged(t, path, slog.New(slog.DiscardHandler))
}

// runAgentLogged is runAgent with the agent logging to log.
func runAgentLogged(t *testing.T, path string, log *slog.Logger) *Agent {
	t.Helper()
	a := New(Options{ConfigPath: path, NoXDP: true, Logger: log})
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	// Exits when ctx is cancelled at cleanup.
	go func() { runErr <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	for deadline := time.Now().Add(10 * time.Second); !a.running.Load(); time.Sleep(10 * time.Millisecond) {
		select {
		case err := <-runErr:
			t.Fatalf("Run: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("agent not running after 10s")
		}
	}
	return a
}

// echoBackend serves a line echo on loopback and returns its address.
func echoBackend(t *testing.T) string { return churn.Echo(t).String() }

// echoConn is a connection to an echo service through a proxy.
type echoConn struct {
	net.Conn
	br *bufio.Reader
}

func dialEcho(t *testing.T, addr string) *echoConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &echoConn{c, bufio.NewReader(c)}
}

// ask sends a line and waits for its echo.
func (c *echoConn) ask(line string) error {
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		return err
	}
	got, err := c.br.ReadString('\n')
	if err == nil && got != line+"\n" {
		err = fmt.Errorf("echo: got %q; want %q", got, line)
	}
	return err
}

// TestReloadKeepsProxyConnections: a reload that gives a proxy service a new
// listener (a proxy setting changed) and then fails on another service is
// refused, and the service keeps the listener it had: its counters, and its
// established connection past the drain timeout. When such a reload succeeds,
// status and weir plan go on counting the connection the old listener serves
// as it drains.
func TestReloadKeepsProxyConnections(t *testing.T) {
	backend, vip := echoBackend(t), freePort(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "weir.yaml")
	head := fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n", filepath.Join(dir, "weir.sock"))
	svcA := func(connectTimeout string) string {
		return fmt.Sprintf("- name: a\n  vip: %s\n  data_plane: proxy\n  drain_timeout: 1s\n  proxy: {connect_timeout: %s}\n  health: {type: none}\n  backends:\n  - {address: %s}\n", vip, connectTimeout, backend)
	}
	// b binds an address no interface holds: its add fails after a's update.
	svcB := fmt.Sprintf("- name: b\n  vip: 192.0.2.77:80\n  data_plane: proxy\n  health: {type: none}\n  backends:\n  - {address: %s}\n", backend)
	if err := os.WriteFile(path, []byte(head+svcA("1s")), 0o644); err != nil {
		t.Fatal(err)
	}
	a := runAgent(t, path)
	c := dialEcho(t, vip)
	if err := c.ask("before"); err != nil {
		t.Fatal(err)
	}
	before, _ := a.Status()

	if err := os.WriteFile(path, []byte(head+svcA("2s")+svcB), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload(context.Background()); err == nil {
		t.Fatal("reload: got no error; want b's bind to fail")
	}
	after, _ := a.Status()
	if got, want := after.Services[0].Accepted, before.Services[0].Accepted; got != want {
		t.Errorf("service a's accepted connections after a refused reload: got %d; want %d", got, want)
	}
	time.Sleep(1500 * time.Millisecond) // past a's drain_timeout
	if err := c.ask("after"); err != nil {
		t.Errorf("a's connection after a refused reload: %v; want it served", err)
	}

	if err := os.WriteFile(path, []byte(head+svcA("2s")), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	st, _ := a.Status()
	pl, err := a.Plan(context.Background(), nil, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, planned := st.Services[0].Connections, pl.Services[0].Flows[0].Flows; got != 1 || planned != 1 {
		t.Errorf("a's connections while its old listener drains: status %d, weir plan %d; want 1", got, planned)
	}
	if err := c.ask("drained"); err != nil {
		t.Errorf("a's connection on the old listener: %v; want it served until drain_timeout", err)
	}
}

// TestMaxMoveOutOfRange: a budget that is no percentage is a bad request, for a
// reload and a plan alike, and the admin API answers it with 400, not as a change
// over budget (422).
func TestMaxMoveOutOfRange(t *testing.T) {
	dir, path := oneProxyService(t)
	a := runAgent(t, path)
	ctx := context.Background()
	client := admin.NewClient(filepath.Join(dir, "weir.sock"))
	for _, pct := range []float64{-5, 100.5} {
		if err := a.ReloadWithin(ctx, pct); !errors.Is(err, ErrBadRequest) {
			t.Errorf("reload with max_move %g: got %v; want a bad request", pct, err)
		}
		if _, err := a.Plan(ctx, nil, "", &pct); !errors.Is(err, ErrBadRequest) {
			t.Errorf("plan with max_move %g: got %v; want a bad request", pct, err)
		}
		var re *admin.RequestError
		if err := client.ReloadWithin(ctx, pct); !errors.As(err, &re) || re.Code != http.StatusBadRequest {
			t.Errorf("POST /v1/reload with max_move %g: got %v; want status 400", pct, err)
		}
		if _, err := client.Plan(ctx, nil, "", &pct); !errors.As(err, &re) || re.Code != http.StatusBadRequest {
			t.Errorf("POST /v1/plan with max_move %g: got %v; want status 400", pct, err)
		}
	}
	if err := a.ReloadWithin(ctx, 0); err != nil {
		t.Errorf("reload of the same config with max_move 0: %v; want it applied", err)
	}
}

// TestPlanHashKeyChange: a proxy maglev service whose hash key changes (5tuple to
// source) keeps its backends, yet every new connection is hashed anew: weir plan
// says about half of two backends' new flows move, as two independent picks
// would, and a reload with a smaller budget is refused. A plan that keeps the key
// moves nothing.
func TestPlanHashKeyChange(t *testing.T) {
	b1, b2, vip := echoBackend(t), echoBackend(t), freePort(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "weir.yaml")
	cfg := func(hash string) []byte {
		return []byte(fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n"+
			"- name: a\n  vip: %s\n  data_plane: proxy\n  algorithm: maglev\n  hash: %s\n  health: {type: none}\n"+
			"  backends:\n  - {address: %s}\n  - {address: %s}\n", filepath.Join(dir, "weir.sock"), vip, hash, b1, b2))
	}
	if err := os.WriteFile(path, cfg("5tuple"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := runAgent(t, path)
	ctx := context.Background()
	for _, tc := range []struct {
		hash string
		want float64
	}{{"5tuple", 0}, {"source", 0.5}} {
		pl, err := a.Plan(ctx, cfg(tc.hash), "next.yaml", nil)
		if err != nil {
			t.Fatalf("plan with hash %s: %v", tc.hash, err)
		}
		if got := pl.Services[0].Moved; math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("plan with hash %s: moved %.3f; want %.3f", tc.hash, got, tc.want)
		}
	}
	if err := os.WriteFile(path, cfg("source"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.ReloadWithin(ctx, 10); err == nil {
		t.Error("reload to hash source within 10%: got no error; want it refused over budget")
	}
}

// TestRunningOnceStatusShowsServices: once Status shows the running config, the
// agent takes requests. The check runs as the agent logs "weir running", right
// after its first snapshot: a Stop there used to find it not yet running, as a
// Plan or Reload did in the same window.
func TestRunningOnceStatusShowsServices(t *testing.T) {
	_, path := oneProxyService(t)
	var a *Agent
	checked := make(chan error, 1)
	onRunning := func() {
		st, err := a.Status()
		if err != nil || len(st.Services) != 1 {
			checked <- fmt.Errorf("status as the agent logs running: %d services, %v; want 1", len(st.Services), err)
			return
		}
		checked <- a.Stop(false)
	}
	a = New(Options{ConfigPath: path, NoXDP: true, Logger: slog.New(onMessage{"weir running", onRunning})})
	runErr := make(chan error, 1)
	// Exits when the Stop above ends it, or at the deadline below.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go func() { runErr <- a.Run(ctx) }()
	if err := <-checked; err != nil {
		t.Errorf("stop once status shows the services: %v; want it stopped", err)
		cancel()
	}
	if err := <-runErr; err != nil {
		t.Errorf("Run: %v", err)
	}
}

// onMessage is a log handler that runs do when a record with message msg is
// logged, and discards every record.
type onMessage struct {
	msg string
	do  func()
}

func (h onMessage) Enabled(context.Context, slog.Level) bool { return true }
func (h onMessage) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		h.do()
	}
	return nil
}
func (h onMessage) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h onMessage) WithGroup(string) slog.Handler      { return h }

// oneProxyService writes a config with one proxy service to an echo backend, and
// returns its directory (which holds the admin socket) and path.
func oneProxyService(t *testing.T) (dir, path string) {
	t.Helper()
	dir = t.TempDir()
	path = filepath.Join(dir, "weir.yaml")
	cfg := fmt.Sprintf("admin: {socket: %s}\nmetrics: {listen: \"off\"}\nservices:\n", filepath.Join(dir, "weir.sock")) +
		fmt.Sprintf("- name: a\n  vip: %s\n  data_plane: proxy\n  health: {type: none}\n  backends:\n  - {address: %s}\n", freePort(t), echoBackend(t))
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir, path
}

// TestHealthRetriedAfterFailedApply: a verdict the planes refused to take is
// applied on a later tick, once they take it, though the checker does not
// send it again (it sends a verdict only when it changes). Meanwhile the
// published state says so, with the tries and the error, for status and
// metrics; a lasting failure is logged once. A plane that fails
// on demand cannot be made from a real one: recordingPlane stands in.
func TestHealthRetriedAfterFailedApply(t *testing.T) {
	var logs bytes.Buffer
	a, st, proxy := webOnRecordingPlane(t, &logs)
	down := st.running.Services[0].Backends[1]
	usable := func() bool {
		s := proxy.services["web"]
		return s.Backend(down.Config.Addr).Usable
	}
	if !usable() {
		t.Fatal("the backend is not usable before its verdict")
	}

	proxy.failOn = "set-backend web"
	a.onHealth(st, health.Change{ID: down.ID, Service: "web", From: health.Up, To: health.Down, Reason: "test"})
	if !usable() || !st.running.Services[0].Backend(down.Config.Addr).Usable {
		t.Fatal("the refused verdict was not rolled back")
	}
	// Still failing: tried again a second later, then two seconds after
	// that, not before; the lasting failure is logged by the loop once.
	now := time.Now()
	tries := func() int { return strings.Count(logs.String(), `msg="roll back to the running state"`) }
	for _, c := range []struct {
		after time.Duration
		tries int
	}{{0, 1}, {1100 * time.Millisecond, 2}, {2 * time.Second, 2}, {3200 * time.Millisecond, 3}} {
		a.tick(st, now.Add(c.after))
		if got := tries(); got != c.tries {
			t.Fatalf("%v after the verdict: %d tries; want %d:\n%s", c.after, got, c.tries, logs.String())
		}
	}
	if n := strings.Count(logs.String(), "level=ERROR msg=\"apply health"); n != 1 {
		t.Errorf("the failure logged %d times by the loop; want once:\n%s", n, logs.String())
	}
	if !usable() {
		t.Fatal("the plane took the verdict while it failed")
	}
	a.publish(st)
	if u := a.snap.Load().unapplied; u == nil || u.Attempts != 3 || !strings.HasPrefix(u.LastError, "injected failure") ||
		!u.NextTry.Equal(now.Add(7200*time.Millisecond)) || now.Sub(u.Since).Abs() > time.Second {
		t.Errorf("published unapplied verdicts: got %+v; want 3 attempts since the verdict, the plane's error, the next at 7.2s", u)
	}

	proxy.failOn = ""
	a.tick(st, now.Add(7500*time.Millisecond))
	if usable() {
		t.Fatal("the refused verdict was not applied on the tick after the plane recovered")
	}
	if st.running.Services[0].Backend(down.Config.Addr).Usable {
		t.Error("the loop's running state does not have the verdict")
	}
	a.publish(st)
	if u := a.snap.Load().unapplied; u != nil {
		t.Errorf("published unapplied verdicts once applied: got %+v; want none", u)
	}
}

// TestHealthUnappliedEndsWithTheVerdict: a refused verdict that a later one
// undoes (the backend came back before the planes took its failure) leaves
// nothing to apply: status and metrics stop saying verdicts wait at once,
// not at the next try, up to a minute later, while the planes still refuse.
func TestHealthUnappliedEndsWithTheVerdict(t *testing.T) {
	a, st, proxy := webOnRecordingPlane(t, io.Discard)
	b := st.running.Services[0].Backends[1]
	proxy.failOn = "set-backend web"
	a.onHealth(st, health.Change{ID: b.ID, Service: "web", From: health.Up, To: health.Down, Reason: "test"})
	a.publish(st)
	if a.snap.Load().unapplied == nil {
		t.Fatal("the refused verdict is not published as unapplied")
	}
	a.onHealth(st, health.Change{ID: b.ID, Service: "web", From: health.Down, To: health.Up, Usable: true, Reason: "test"})
	a.publish(st)
	if u := a.snap.Load().unapplied; u != nil {
		t.Errorf("published unapplied verdicts once a later one undid the refused one: got %+v; want none", u)
	}
	if s := proxy.services["web"]; !s.Backend(b.Config.Addr).Usable {
		t.Error("the plane does not have the backend usable")
	}
}

// webOnRecordingPlane returns an agent, logging to logs, whose loop state runs
// a proxy service web of two backends on a recordingPlane, which can be made
// to refuse changes.
func webOnRecordingPlane(t *testing.T, logs io.Writer) (*Agent, *state, *recordingPlane) {
	t.Helper()
	cfg, err := config.Parse([]byte("services:\n" +
		"- {name: web, vip: 10.0.0.1:80, backends: [{address: 10.0.0.2:80}, {address: 10.0.0.3:80}]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	proxy := &recordingPlane{services: map[string]plan.Service{}}
	a := &Agent{log: slog.New(slog.NewTextHandler(logs, nil)), planes: map[plan.Plane]Plane{plan.Proxy: proxy}, xdp: &xdpplane.Plane{}}
	st := newState(cfg)
	st.placement["web"] = plan.Placement{Plane: plan.Proxy}
	if err := a.converge(st, time.Now()); err != nil {
		t.Fatal(err)
	}
	return a, st, proxy
}
