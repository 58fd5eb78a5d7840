package httpplane_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"golang.org/x/net/websocket"
	"io"
	"math"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/userspace/agent"
	"github.com/weir-lb/weir/userspace/agent/api"
)

// clientConn is one raw HTTP/1.1 client connection, so the test knows exactly how
// many the service holds and which of them the server closes.
type clientConn struct {
	c  net.Conn
	br *bufio.Reader
}

func dialClient(t *testing.T, port int) *clientConn {
	t.Helper()
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &clientConn{c: c, br: bufio.NewReader(c)}
}

func (cc *clientConn) send(key string) error {
	_, err := fmt.Fprintf(cc.c, "GET / HTTP/1.1\r\nHost: web\r\nX-Key: %s\r\n\r\n", key)
	return err
}

// answer reads one answer within d and returns the backend that gave it.
func (cc *clientConn) answer(d time.Duration) (string, error) {
	cc.c.SetReadDeadline(time.Now().Add(d))
	resp, err := http.ReadResponse(cc.br, nil)
	if err != nil {
		return "", err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("status %d", resp.StatusCode)
	}
	return resp.Header.Get("X-Backend"), nil
}

// owners is the backend each of n keys' requests goes to now.
func owners(t *testing.T, port, n int) []string {
	t.Helper()
	tr := &http.Transport{MaxIdleConnsPerHost: 4}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	out := make([]string, n)
	for k := range out {
		req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/", port), nil)
		req.Header.Set("X-Key", fmt.Sprintf("key-%d", k))
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		out[k] = resp.Header.Get("X-Backend")
	}
	return out
}

// httpPlan plans the agent's config file, as weir plan without -c does.
func httpPlan(t *testing.T, a *agent.Agent, maxMove *float64) api.ServicePlan {
	t.Helper()
	p, err := a.Plan(context.Background(), nil, "", maxMove)
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	if len(p.Services) != 1 {
		t.Fatalf("plan: %+v; want one service", p)
	}
	var table strings.Builder
	p.WriteTable(&table)
	t.Logf("weir plan:\n%s", table.String())
	return p.Services[0]
}

type answer struct {
	backend string
	err     error
}

// TestPlanPredictsReload: an http service (maglev by a header) with client
// connections open and requests held in flight on one backend. weir plan's
// prediction of removing that backend (its requests in flight drain, no client
// connection closes, the Maglev table's share of new requests moves) is what the
// reload does: the held requests finish on it, every connection serves on, and
// the share of 1,500 keys that change backend is the planned one. --max-move
// refuses the change and the running config stays. A change that needs a new
// listener is planned to close every client connection, and does.
func TestPlanPredictsReload(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	port := freePort(t)
	svc := func(drain string, bs ...*httpbackend.Backend) string {
		return fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: maglev, drain_timeout: %s, http: {hash_by: \"header:X-Key\"}, health: {type: none}, backends: %s}\n",
			port, drain, backendList(bs))
	}
	r := startAgent(t, svc("30s", bs...))
	ctx := context.Background()
	const keys = 1500
	before := owners(t, port, keys)

	// Requests held on b: every request it takes now waits 10s.
	bs[1].Delay.Store(int64(10 * time.Second))
	heldBefore := bs[1].Hits.Load()
	othersBefore := bs[0].Hits.Load() + bs[2].Hits.Load()
	const nConns = 24
	conns := make([]*clientConn, nConns)
	first := make(chan answer, nConns) // the first answer on each connection
	for i := range conns {
		conns[i] = dialClient(t, port)
		if err := conns[i].send(fmt.Sprintf("held-%d", i)); err != nil {
			t.Fatal(err)
		}
		// Exits with the connection's first answer, or its error (at the latest
		// when the read deadline passes).
		go func(cc *clientConn) {
			name, err := cc.answer(time.Minute)
			first <- answer{name, err}
		}(conns[i])
	}
	var held uint64
	waitfor.Value(t, 10*time.Second, "the requests on b held, the others answered", func() (any, bool) {
		held = uint64(bs[1].Hits.Load() - heldBefore)
		// Every request has reached a backend: one still on its way to b would
		// be neither held nor answered yet.
		others := uint64(bs[0].Hits.Load() + bs[2].Hits.Load() - othersBefore)
		st := r.service(t, "web")
		return fmt.Sprintf("held %d, answered by the others %d, in flight %d, connections %d", held, others, st.InFlight, st.Connections),
			held > 0 && held+others == nConns && st.InFlight == int64(held) && st.Connections == nConns
	})
	for range nConns - int(held) {
		if a := <-first; a.err != nil || a.backend == "b" {
			t.Fatalf("a request not held: %+v; want an answer from a or c", a)
		}
	}
	bs[1].Delay.Store(0) // the held requests keep their 10s

	r.writeConfig(t, svc("30s", bs[0], bs[2]))
	sp := httpPlan(t, r.a, nil)
	if sp.Change != api.ChangeUpdated || sp.NewDataPlane != "" || sp.Table == nil || sp.FlowKind != "http requests in flight" {
		t.Fatalf("plan: %+v; want updated in place, with tables", sp)
	}
	for _, f := range sp.Flows {
		want, fate := uint64(0), "stay"
		if f.Backend == bs[1].Addr.String() {
			want, fate = held, "drain"
		}
		if f.Flows != want || f.Fate != fate {
			t.Errorf("plan, backend %s: %d requests in flight, %s; want %d, %s", f.Backend, f.Flows, f.Fate, want, fate)
		}
	}
	if sp.Drained != held || sp.Reset != 0 || sp.Clients == nil || sp.Clients.Open != nConns || sp.Clients.Closed != 0 {
		t.Errorf("plan: drained %d, reset %d, clients %+v; want %d, 0, %d open and none closed", sp.Drained, sp.Reset, sp.Clients, held, nConns)
	}
	// Maglev moves b's third of the table, and a little more.
	if sp.Moved < 0.33 || sp.Moved > 0.40 {
		t.Errorf("plan: moved %.3f; want about a third", sp.Moved)
	}

	t.Run("max-move refuses", func(t *testing.T) {
		budget := 10.0
		if gated := httpPlan(t, r.a, &budget); 100*gated.Moved <= budget {
			t.Fatalf("plan --max-move 10: moved %.3f; want over", gated.Moved)
		}
		err := r.a.ReloadWithin(ctx, budget)
		if !errors.Is(err, agent.ErrOverBudget) || !strings.Contains(err.Error(), `service "web" would move`) {
			t.Fatalf("reload --max-move 10: %v; want it refused over the budget, naming web", err)
		}
		st := r.service(t, "web")
		if len(st.Backends) != 3 || st.InFlight != int64(held) || st.Connections != nConns {
			t.Errorf("after the refused reload: %d backends, %d in flight, %d connections; want the running 3, %d, %d",
				len(st.Backends), st.InFlight, st.Connections, held, nConns)
		}
		if again := httpPlan(t, r.a, nil); again.Table.Moved != sp.Table.Moved {
			t.Errorf("plan after the refused reload: %d slots move; want %d as before", again.Table.Moved, sp.Table.Moved)
		}
	})

	if st := r.service(t, "web"); st.InFlight != int64(held) {
		t.Fatalf("before the reload: %d requests in flight; want the %d held (the machine is too slow for this test's 10s)", st.InFlight, held)
	}
	if err := r.a.ReloadWithin(ctx, 40); err != nil {
		t.Fatalf("reload --max-move 40: %v", err)
	}
	t.Run("reload did as planned", func(t *testing.T) {
		// The held requests finish on b, as many as were planned drained.
		var drained uint64
		for range held {
			if a := <-first; a.err == nil && a.backend == "b" {
				drained++
			}
		}
		if drained != sp.Drained {
			t.Errorf("%d held requests answered by b after its removal; %d were planned drained", drained, sp.Drained)
		}
		// No connection was closed: each takes another request, never to b.
		for i, cc := range conns {
			if err := cc.send(fmt.Sprintf("again-%d", i)); err != nil {
				t.Fatalf("connection %d after the reload: %v; want it open (planned: none closed)", i, err)
			}
			if name, err := cc.answer(10 * time.Second); err != nil || name == "b" {
				t.Fatalf("connection %d after the reload: %q, %v; want it open (planned: none closed), not on b", i, name, err)
			}
		}
		after := owners(t, port, keys)
		moved := 0
		for k := range before {
			if before[k] != after[k] {
				moved++
			}
		}
		// 1,500 keys: the share moved is within ±0.04 of the table's (3.3 sd).
		got := float64(moved) / keys
		t.Logf("%d of %d keys changed backend (%.3f); the plan said %.3f", moved, keys, got, sp.Moved)
		if math.Abs(got-sp.Moved) > 0.04 {
			t.Errorf("%d of %d keys changed backend (%.3f); the plan said %.3f", moved, keys, got, sp.Moved)
		}
	})

	t.Run("a new listener closes every client connection", func(t *testing.T) {
		waitfor.Value(t, 10*time.Second, "only the test's connections open", func() (any, bool) {
			st := r.service(t, "web")
			return st.Connections, st.Connections == nConns
		})
		r.writeConfig(t, svc("5s", bs[0], bs[2]))
		sp := httpPlan(t, r.a, nil)
		if !strings.HasPrefix(sp.NewDataPlane, "a new listener on http") || sp.Clients == nil ||
			sp.Clients.Open != nConns || sp.Clients.Closed != nConns || sp.Moved != 0 {
			t.Fatalf("plan: new data plane %q, clients %+v, moved %v; want a new listener closing all %d, moving no new request",
				sp.NewDataPlane, sp.Clients, sp.Moved, nConns)
		}
		if err := r.a.Reload(ctx); err != nil {
			t.Fatal(err)
		}
		var closed uint64
		for _, cc := range conns {
			cc.c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := cc.br.ReadByte(); errors.Is(err, io.EOF) {
				closed++
			}
		}
		if closed != sp.Clients.Closed {
			t.Errorf("%d client connections closed by the new listener's reload; %d were planned", closed, sp.Clients.Closed)
		}
	})
}

// TestPlanCountsTunnels: weir plan counts an http service's tunnels
// (WebSocket) apart from its other requests in flight, as they do not end by
// themselves: removing the backend that holds one plans it drained, and the
// reload closes it once the drain timeout is up, while a tunnel on the backend
// that stays lives on.
func TestPlanCountsTunnels(t *testing.T) {
	bs := httpbackend.StartN(t, 2)
	port := freePort(t)
	svc := func(bs ...*httpbackend.Backend) string {
		return fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: least_conn, drain_timeout: 1s, health: {type: none}, backends: %s}\n",
			port, backendList(bs))
	}
	r := startAgent(t, svc(bs...))
	// least_conn puts the second tunnel on the other backend.
	var wss []*websocket.Conn
	for range 2 {
		ws, err := websocket.Dial(fmt.Sprintf("ws://127.0.0.1:%d/ws", port), "", "http://127.0.0.1/")
		if err != nil {
			t.Fatalf("WebSocket handshake: %v", err)
		}
		t.Cleanup(func() { ws.Close() })
		echo(t, ws)
		wss = append(wss, ws)
	}
	sp := httpPlan(t, r.a, nil)
	for _, f := range sp.Flows {
		if f.Flows != 1 || f.Tunnels != 1 || f.Fate != "stay" {
			t.Errorf("plan of the running config, backend %s: %d in flight, %d tunnels, %s; want 1, 1, stay", f.Backend, f.Flows, f.Tunnels, f.Fate)
		}
	}

	r.writeConfig(t, svc(bs[0]))
	sp = httpPlan(t, r.a, nil)
	for _, f := range sp.Flows {
		want := "stay"
		if f.Backend == bs[1].Addr.String() {
			want = "drain"
		}
		if f.Flows != 1 || f.Tunnels != 1 || f.Fate != want {
			t.Errorf("plan without %s, backend %s: %d in flight, %d tunnels, %s; want 1, 1, %s", bs[1].Addr, f.Backend, f.Flows, f.Tunnels, f.Fate, want)
		}
	}
	if sp.Drained != 1 || sp.DrainedTunnels != 1 {
		t.Errorf("plan without %s: %d drained, %d of them tunnels; want 1 and 1", bs[1].Addr, sp.Drained, sp.DrainedTunnels)
	}
	var table strings.Builder
	(&api.Plan{Services: []api.ServicePlan{sp}}).WriteTable(&table)
	if !strings.Contains(table.String(), "of them 1 tunnels (WebSocket), closed when the drain timeout is up") {
		t.Errorf("weir plan's table does not name the drained tunnel:\n%s", table.String())
	}

	if err := r.a.Reload(context.Background()); err != nil {
		t.Fatalf("reload: %v", err)
	}
	// The backends echo alike, so the test cannot tell which tunnel is on the
	// removed one: one of the two must close, and only one.
	closed := make(chan int, 2)
	for i, ws := range wss {
		// Exits at the tunnel's end or its deadline.
		go func() {
			ws.SetReadDeadline(time.Now().Add(5 * time.Second))
			var got string
			if err := websocket.Message.Receive(ws, &got); err != nil && !isTimeout(err) {
				closed <- i
				return
			}
			closed <- -1
		}()
	}
	gone := 0
	for range 2 {
		if <-closed >= 0 {
			gone++
		}
	}
	if gone != 1 {
		t.Errorf("%d tunnels closed within 5 s of the reload (drain timeout 1s); want the 1 planned", gone)
	}
}

// echo has ws's backend echo a message.
func echo(t *testing.T, ws *websocket.Conn) {
	t.Helper()
	ws.SetDeadline(time.Now().Add(5 * time.Second))
	if err := websocket.Message.Send(ws, "ping"); err != nil {
		t.Fatal(err)
	}
	var got string
	if err := websocket.Message.Receive(ws, &got); err != nil || got != "ping" {
		t.Fatalf("echo: %q, %v", got, err)
	}
	ws.SetDeadline(time.Time{})
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestPlanHashByChange: an http maglev service that keeps its three backends but
// hashes by a cookie instead of a header sends each new request to a backend
// independent of the one it had: weir plan says two thirds of new requests move,
// and a reload with a smaller budget is refused.
func TestPlanHashByChange(t *testing.T) {
	bs := httpbackend.StartN(t, 3)
	port := freePort(t)
	svc := func(hashBy string) string {
		return fmt.Sprintf("  - {name: web, vip: 127.0.0.1:%d, data_plane: http, algorithm: maglev, http: {hash_by: %q}, health: {type: none}, backends: %s}\n",
			port, hashBy, backendList(bs))
	}
	r := startAgent(t, svc("header:X-Key"))
	if sp := httpPlan(t, r.a, nil); sp.Moved != 0 {
		t.Errorf("plan of the running config: moved %.3f; want 0", sp.Moved)
	}
	r.writeConfig(t, svc("cookie:k"))
	if sp := httpPlan(t, r.a, nil); math.Abs(sp.Moved-2.0/3) > 1e-9 {
		t.Errorf("plan with hash_by cookie:k: moved %.3f; want 0.667", sp.Moved)
	}
	budget := 10.0
	if err := r.a.ReloadWithin(context.Background(), budget); err == nil {
		t.Errorf("reload to hash_by cookie:k within %g%%: got no error; want it refused over budget", budget)
	}
}
