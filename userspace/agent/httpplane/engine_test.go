package httpplane

import (
	"testing"

	"github.com/weir-lb/weir/userspace/config"
)

// TestH2EngineSetting: http.h2_engine reaches the plane (net_http: net/http's
// HTTP/2 path), and changing it needs a new listener.
func TestH2EngineSetting(t *testing.T) {
	parse := func(engine string) *config.Service {
		t.Helper()
		http := ""
		if engine != "" {
			http = "  http: {h2_engine: " + engine + "}\n"
		}
		cfg, err := config.Parse([]byte("services:\n- name: a\n  vip: 127.0.0.1:8080\n  data_plane: http\n" + http +
			"  backends: [{address: 127.0.0.1:9000}]\n"))
		if err != nil {
			t.Fatal(err)
		}
		return &cfg.Services[0]
	}
	def, frames, nethttp := parse(""), parse("frames"), parse("net_http")
	for _, c := range []struct {
		name      string
		got, want bool
	}{
		{"default: the frame engine", lbConfig(def, nil, nil).NetHTTP2, false},
		{"frames", lbConfig(frames, nil, nil).NetHTTP2, false},
		{"net_http", lbConfig(nethttp, nil, nil).NetHTTP2, true},
		{"frames to net_http rebuilds", rebuilt(frames, nethttp), true},
		{"default to frames does not", rebuilt(def, frames), false},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %v; want %v", c.name, c.got, c.want)
		}
	}
}
