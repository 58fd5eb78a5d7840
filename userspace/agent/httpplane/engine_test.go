package httpplane

import (
	"testing"

	"github.com/weir-lb/weir/userspace/config"
)

// TestEngineSettings: http.h2_engine and http.h1_engine reach the plane
// (net_http: net/http's server for those clients), and changing either needs a
// new listener.
func TestEngineSettings(t *testing.T) {
	parse := func(settings string) *config.Service {
		t.Helper()
		http := ""
		if settings != "" {
			http = "  http: {" + settings + "}\n"
		}
		cfg, err := config.Parse([]byte("services:\n- name: a\n  vip: 127.0.0.1:8080\n  data_plane: http\n" + http +
			"  backends: [{address: 127.0.0.1:9000}]\n"))
		if err != nil {
			t.Fatal(err)
		}
		return &cfg.Services[0]
	}
	def := parse("")
	frames, h2NetHTTP := parse("h2_engine: frames"), parse("h2_engine: net_http")
	loop, h1NetHTTP := parse("h1_engine: loop"), parse("h1_engine: net_http")
	for _, c := range []struct {
		name      string
		got, want bool
	}{
		{"default: the frame engine", lbConfig(def, nil, nil).NetHTTP2, false},
		{"frames", lbConfig(frames, nil, nil).NetHTTP2, false},
		{"h2 net_http", lbConfig(h2NetHTTP, nil, nil).NetHTTP2, true},
		{"frames to net_http rebuilds", rebuilt(frames, h2NetHTTP), true},
		{"default to frames does not", rebuilt(def, frames), false},
		{"default: the connection loop", lbConfig(def, nil, nil).NetHTTP1, false},
		{"loop", lbConfig(loop, nil, nil).NetHTTP1, false},
		{"h1 net_http", lbConfig(h1NetHTTP, nil, nil).NetHTTP1, true},
		{"h1 net_http leaves HTTP/2 on frames", lbConfig(h1NetHTTP, nil, nil).NetHTTP2, false},
		{"loop to net_http rebuilds", rebuilt(loop, h1NetHTTP), true},
		{"default to loop does not", rebuilt(def, loop), false},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %v; want %v", c.name, c.got, c.want)
		}
	}
}
