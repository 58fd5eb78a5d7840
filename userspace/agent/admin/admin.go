// Package admin is the agent's admin API: HTTP+JSON served on a unix socket (and
// an optional loopback TCP address), and the Client the CLI talks to it with. The
// server knows the agent only through the Agent interface it declares; both ends
// speak the values of userspace/agent/api.
package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/config"
)

// Agent is what the admin API asks of the agent.
type Agent interface {
	Status() (api.Status, error)
	Reload(ctx context.Context) error
	ReloadWithin(ctx context.Context, maxMove float64) error
	Plan(ctx context.Context, data []byte, name string, maxMove *float64) (api.Plan, error)
	SetDrain(ctx context.Context, service, backend string, drain bool) error
	SetWeight(ctx context.Context, service, backend string, weight uint32) error
	Explain(ctx context.Context, service, client string) (api.Explanation, error)
	Stop(detach bool) error
	SetNodeDrain(ctx context.Context, drain bool) error
}

// The admin API, HTTP+JSON:
//
//	GET  /v1/status                                      Status
//	POST /v1/reload                                      {"ok":true} or 422 {"errors":[...]};
//	                                                     body {"max_move": PCT} gates it
//	                                                     (400 for a PCT outside 0..100)
//	POST /v1/plan                                        Plan of {"config": YAML, "name": N,
//	                                                     "max_move": PCT} (no config: the agent's file)
//	POST /v1/services/{service}/backends/{addr}/drain    {"drain": true|false}
//	POST /v1/services/{service}/backends/{addr}/weight   {"weight": N}
//	GET  /v1/services/{service}/explain?client=IP:PORT   Explanation
//	POST /v1/stop                                        {"detach": true|false}: stop the agent
//	POST /v1/node/drain                                  {"drain": true|false}: withdraw the node's BGP routes, or announce again
//	GET  /metrics                                        Prometheus exposition
//
// Errors are {"error": "..."} (or {"errors": [...]} for a rejected reload) with a
// 4xx or 5xx status.
func Handler(a Agent, metrics http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, r *http.Request) {
		st, err := a.Status()
		if err != nil {
			writeErr(w, http.StatusServiceUnavailable, err)
			return
		}
		writeJSON(w, http.StatusOK, st)
	})
	mux.HandleFunc("POST /v1/reload", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			MaxMove *float64 `json:"max_move"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil && !errors.Is(err, io.EOF) {
			writeErr(w, http.StatusBadRequest, errors.New(`body must be empty or {"max_move": PCT}`))
			return
		}
		var err error
		if req.MaxMove != nil {
			err = a.ReloadWithin(r.Context(), *req.MaxMove)
		} else {
			err = a.Reload(r.Context())
		}
		if err != nil {
			refused(w, err)
			return
		}
		writeJSON(w, http.StatusOK, map[string]bool{"ok": true})
	})
	mux.HandleFunc("POST /v1/plan", func(w http.ResponseWriter, r *http.Request) {
		var req planRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil && !errors.Is(err, io.EOF) {
			writeErr(w, http.StatusBadRequest, errors.New(`body must be {"config": YAML, "name": NAME, "max_move": PCT}, each optional`))
			return
		}
		var data []byte
		if req.Config != nil {
			data = []byte(*req.Config)
		}
		p, err := a.Plan(r.Context(), data, req.Name, req.MaxMove)
		if err != nil {
			refused(w, err)
			return
		}
		writeJSON(w, http.StatusOK, p)
	})
	mux.HandleFunc("POST /v1/services/{service}/backends/{addr}/drain", func(w http.ResponseWriter, r *http.Request) {
		if drain, ok := drainBody(w, r); ok {
			answer(w, a.SetDrain(r.Context(), r.PathValue("service"), r.PathValue("addr"), drain))
		}
	})
	mux.HandleFunc("POST /v1/services/{service}/backends/{addr}/weight", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Weight *int64 `json:"weight"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Weight == nil {
			writeErr(w, http.StatusBadRequest, errors.New(`body must be {"weight": N}`))
			return
		}
		if *req.Weight < 0 || *req.Weight > config.MaxWeight {
			writeErr(w, http.StatusBadRequest, fmt.Errorf("weight must be 0..%d, got %d", config.MaxWeight, *req.Weight))
			return
		}
		answer(w, a.SetWeight(r.Context(), r.PathValue("service"), r.PathValue("addr"), uint32(*req.Weight)))
	})
	mux.HandleFunc("GET /v1/services/{service}/explain", func(w http.ResponseWriter, r *http.Request) {
		ex, err := a.Explain(r.Context(), r.PathValue("service"), r.URL.Query().Get("client"))
		if err != nil {
			answer(w, err)
			return
		}
		writeJSON(w, http.StatusOK, ex)
	})
	mux.HandleFunc("POST /v1/stop", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Detach bool `json:"detach"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil && !errors.Is(err, io.EOF) {
			writeErr(w, http.StatusBadRequest, errors.New(`body must be {"detach": true} or {"detach": false}`))
			return
		}
		answer(w, a.Stop(req.Detach))
	})
	mux.HandleFunc("POST /v1/node/drain", func(w http.ResponseWriter, r *http.Request) {
		if drain, ok := drainBody(w, r); ok {
			answer(w, a.SetNodeDrain(r.Context(), drain))
		}
	})
	mux.Handle("GET /metrics", metrics)
	return mux
}

// drainBody reads {"drain": true|false}, or answers 400 and returns false.
func drainBody(w http.ResponseWriter, r *http.Request) (drain, ok bool) {
	var req struct {
		Drain *bool `json:"drain"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Drain == nil {
		writeErr(w, http.StatusBadRequest, errors.New(`body must be {"drain": true} or {"drain": false}`))
		return false, false
	}
	return *req.Drain, true
}

func answer(w http.ResponseWriter, err error) {
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, map[string]bool{"ok": true})
	case errors.Is(err, api.ErrNotFound):
		writeErr(w, http.StatusNotFound, err)
	case errors.Is(err, api.ErrBadRequest):
		writeErr(w, http.StatusBadRequest, err)
	case errors.Is(err, api.ErrNotRunning):
		writeErr(w, http.StatusServiceUnavailable, err)
	default:
		writeErr(w, http.StatusConflict, err)
	}
}

// refused answers a reload or plan the agent refused: 400 for a malformed request
// (a max_move that is no percentage), 503 while the agent is not running, else 422
// with the config's problems (or the change over budget) one a line.
func refused(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, api.ErrBadRequest):
		writeErr(w, http.StatusBadRequest, err)
	case errors.Is(err, api.ErrNotRunning):
		writeErr(w, http.StatusServiceUnavailable, err)
	default:
		writeJSON(w, http.StatusUnprocessableEntity, errorBody{Errors: ErrorLines(err)})
	}
}

// planRequest is POST /v1/plan's body.
type planRequest struct {
	Config  *string  `json:"config,omitempty"`
	Name    string   `json:"name,omitempty"`
	MaxMove *float64 `json:"max_move,omitempty"`
}

type errorBody struct {
	Error  string   `json:"error,omitempty"`
	Errors []string `json:"errors,omitempty"`
}

func writeErr(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, errorBody{Error: err.Error()})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// Client talks to a running agent's admin API over its unix socket.
type Client struct {
	socket string
	hc     *http.Client
}

// NewClient returns a client for the admin socket at path.
func NewClient(socket string) *Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
	}
	return &Client{socket: socket, hc: &http.Client{Transport: tr, Timeout: 30 * time.Second}}
}

// RequestError is an error the agent answered with.
type RequestError struct {
	Code   int
	Errors []string
}

func (e *RequestError) Error() string { return strings.Join(e.Errors, "\n") }

func (c *Client) do(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = strings.NewReader(string(b))
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://weir"+path, rd)
	if err != nil {
		return err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			// The caller gave up (an interrupt, its deadline): not a sign that no
			// agent answers here.
			return fmt.Errorf("admin socket %s: %w", c.socket, err)
		}
		return fmt.Errorf("admin socket %s: %w (is weir running? is this the socket of its config?)", c.socket, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("admin socket %s: %w", c.socket, err)
	}
	if resp.StatusCode != http.StatusOK {
		var eb errorBody
		json.Unmarshal(data, &eb)
		re := &RequestError{Code: resp.StatusCode, Errors: eb.Errors}
		if eb.Error != "" {
			re.Errors = append(re.Errors, eb.Error)
		}
		if len(re.Errors) == 0 {
			re.Errors = []string{resp.Status}
		}
		return re
	}
	if out != nil {
		return json.Unmarshal(data, out)
	}
	return nil
}

// Status fetches the agent's status.
func (c *Client) Status(ctx context.Context) (api.Status, error) {
	var st api.Status
	err := c.do(ctx, http.MethodGet, "/v1/status", nil, &st)
	return st, err
}

// Reload asks the agent to reload its config file.
func (c *Client) Reload(ctx context.Context) error {
	return c.do(ctx, http.MethodPost, "/v1/reload", nil, nil)
}

// ReloadWithin asks the agent to reload its config file unless the change would
// move more than maxMove percent of a service's new flows.
func (c *Client) ReloadWithin(ctx context.Context, maxMove float64) error {
	return c.do(ctx, http.MethodPost, "/v1/reload", map[string]float64{"max_move": maxMove}, nil)
}

// Plan asks what applying a config would change: data is the file's contents (nil:
// the agent's own file), name what to call it; maxMove (nil: none) is checked
// against each service's moved share.
func (c *Client) Plan(ctx context.Context, data []byte, name string, maxMove *float64) (api.Plan, error) {
	req := planRequest{Name: name, MaxMove: maxMove}
	if data != nil {
		s := string(data)
		req.Config = &s
	}
	var p api.Plan
	err := c.do(ctx, http.MethodPost, "/v1/plan", req, &p)
	return p, err
}

// Drain drains a backend, or ends its drain.
func (c *Client) Drain(ctx context.Context, service, backend string, drain bool) error {
	return c.do(ctx, http.MethodPost, backendPath(service, backend, "drain"), map[string]bool{"drain": drain}, nil)
}

// Weight sets a backend's weight.
func (c *Client) Weight(ctx context.Context, service, backend string, weight int64) error {
	return c.do(ctx, http.MethodPost, backendPath(service, backend, "weight"), map[string]int64{"weight": weight}, nil)
}

// Explain asks where a client's flow to an XDP service goes.
func (c *Client) Explain(ctx context.Context, service, client string) (api.Explanation, error) {
	var ex api.Explanation
	err := c.do(ctx, http.MethodGet, "/v1/services/"+url.PathEscape(service)+"/explain?client="+url.QueryEscape(client), nil, &ex)
	return ex, err
}

// Stop asks the agent to stop; with detach it removes its XDP program too.
func (c *Client) Stop(ctx context.Context, detach bool) error {
	return c.do(ctx, http.MethodPost, "/v1/stop", map[string]bool{"detach": detach}, nil)
}

// NodeDrain withdraws the node's BGP routes (drain) or announces them again.
func (c *Client) NodeDrain(ctx context.Context, drain bool) error {
	return c.do(ctx, http.MethodPost, "/v1/node/drain", map[string]bool{"drain": drain}, nil)
}

// Metrics fetches the Prometheus exposition text.
func (c *Client) Metrics(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://weir/metrics", nil)
	if err != nil {
		return "", err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return "", fmt.Errorf("admin socket %s: %w", c.socket, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func backendPath(service, backend, op string) string {
	return "/v1/services/" + url.PathEscape(service) + "/backends/" + url.PathEscape(backend) + "/" + op
}

// ErrorLines is an error as the lines the API answers with: one per config problem
// for a rejected file, one per error of a join (errors.Join).
func ErrorLines(err error) []string {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []string
		for _, e := range j.Unwrap() {
			out = append(out, ErrorLines(e)...)
		}
		return out
	}
	var es config.Errors
	if errors.As(err, &es) {
		out := make([]string, len(es))
		for i, e := range es {
			out[i] = e.Error()
		}
		return out
	}
	return []string{err.Error()}
}
