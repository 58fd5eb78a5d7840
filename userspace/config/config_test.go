package config

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// The example shipped in the repository must stay valid, and mean what its comments say.
func TestExample(t *testing.T) {
	cfg, err := Load("../../examples/weir.yaml")
	if err != nil {
		t.Fatalf("examples/weir.yaml: %v", err)
	}
	if got, want := len(cfg.Services), 3; got != want {
		t.Fatalf("services: got %d; want %d", got, want)
	}
	web := cfg.Services[0]
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"web key", web.Key(), "tcp/10.77.100.1:80"},
		{"web mode", web.Mode, ModeDSR},
		{"web data plane", web.DataPlane, DataPlaneAuto},
		{"web6 key", cfg.Services[1].Key(), "tcp/[fd77:100::1]:80"},
		{"dns key", cfg.Services[2].Key(), "udp/10.77.100.1:53"},
		{"dns hash", cfg.Services[2].Hash, HashSource},
		{"dns check address", cfg.Services[2].Backends[0].CheckAddr.String(), "10.77.0.11:80"},
		{"interface", cfg.Interfaces[0].Name, "eth0"},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %q; want %q", c.name, c.got, c.want)
		}
	}
}

func TestDefaults(t *testing.T) {
	cfg, err := Parse([]byte("services:\n- name: a\n  vip: 192.0.2.1:443\n  backends: [{address: 192.0.2.10:443}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	s := cfg.Services[0]
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"admin.socket", cfg.Admin.Socket, DefaultAdminSocket},
		{"admin.listen", cfg.Admin.Listen, netip.AddrPort{}},
		{"metrics.listen", cfg.Metrics.Listen.String(), DefaultMetricsListen},
		{"log.format", cfg.Log.Format, LogText},
		{"log.level", cfg.Log.Level, slog.LevelInfo},
		// The program's own defaults apply to what the file leaves at 0.
		{"xdp.conntrack_size", cfg.XDP.ConntrackSize, uint32(0)},
		{"xdp.half_open_size", cfg.XDP.HalfOpenSize, uint32(0)},
		{"xdp.half_open_timeout", cfg.XDP.HalfOpenTimeout, time.Duration(0)},
		{"xdp.new_flow_rate", cfg.XDP.NewFlowRate, uint32(125000)},
		{"xdp.new_flow_burst", cfg.XDP.NewFlowBurst, uint32(0)},
		{"xdp.previous_table_window", cfg.XDP.PreviousTableWindow, time.Hour},
		{"xdp.pin_path", cfg.XDP.PinPath, DefaultPinPath},
		{"protocol", s.Protocol, TCP},
		{"data_plane", s.DataPlane, DataPlaneAuto},
		{"mode", s.Mode, ModeNAT},
		{"algorithm", s.Algorithm, AlgorithmMaglev},
		{"hash", s.Hash, HashFiveTuple},
		{"all_down", s.AllDown, AllDownDrop},
		{"drain_timeout", s.DrainTimeout, 30 * time.Second},
		{"health.type", s.Health.Type, CheckTCP},
		{"health.method", s.Health.Method, MethodAuto},
		{"health.interval", s.Health.Interval, 2 * time.Second},
		{"health.timeout", s.Health.Timeout, time.Second},
		{"health.rise", s.Health.Rise, 2},
		{"health.fall", s.Health.Fall, 3},
		{"health.jitter", s.Health.Jitter, 0.1},
		{"health.initial", s.Health.Initial, InitialUp},
		{"passive.consecutive", s.Passive.Consecutive, 5},
		{"passive.base_ejection", s.Passive.BaseEjection, 30 * time.Second},
		{"panic_threshold", s.PanicThreshold, 50},
		{"proxy.listen", s.Proxy.Listen, netip.MustParseAddrPort("192.0.2.1:443")},
		{"proxy.connect_timeout", s.Proxy.ConnectTimeout, 3 * time.Second},
		{"proxy.retries", s.Proxy.Retries, 1},
		{"proxy.sockmap", s.Proxy.SockMap, SockMapAuto},
		{"backends[0].weight", s.Backends[0].Weight, uint32(1)},
		{"backends[0].check_address", s.Backends[0].CheckAddr, netip.MustParseAddrPort("192.0.2.10:443")},
		{"backends[0].initial", s.Backends[0].Initial, InitialUp},
		{"backends[0].mac", s.Backends[0].MAC == nil, true},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %v; want %v", c.name, c.got, c.want)
		}
	}

	proxy, err := Parse([]byte("services:\n- {name: a, vip: 192.0.2.1:443, data_plane: proxy, backends: [{address: 192.0.2.10:443}]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got := proxy.Services[0].Algorithm; got != AlgorithmLeastConn {
		t.Errorf("proxy service algorithm: got %q; want %q", got, AlgorithmLeastConn)
	}

	// YAML 1.1 would read an unquoted on/off as a boolean; this parser keeps the word.
	for _, want := range []SockMap{SockMapOn, SockMapOff, SockMapAuto} {
		f := "services:\n- {name: a, vip: 192.0.2.1:443, data_plane: proxy, proxy: {sockmap: " + string(want) + "}, backends: [{address: 192.0.2.10:443}]}\n"
		cfg, err := Parse([]byte(f))
		if err != nil {
			t.Fatalf("sockmap: %s: %v", want, err)
		}
		if got := cfg.Services[0].Proxy.SockMap; got != want {
			t.Errorf("proxy.sockmap: got %q; want %q", got, want)
		}
	}
}

// Every error of a file is reported, in file order, each with its line and path.
func TestErrorsAll(t *testing.T) {
	_, err := Load("testdata/bad.yaml")
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("got %v; want an error wrapping ErrInvalid", err)
	}
	want, rerr := os.ReadFile("testdata/bad.want")
	if rerr != nil {
		t.Fatal(rerr)
	}
	if got := err.Error() + "\n"; got != string(want) {
		t.Errorf("errors:\n%s\nwant:\n%s", got, want)
	}
}

func TestErrors(t *testing.T) {
	const svc = "services:\n- name: a\n  vip: 10.0.0.1:80\n"
	const be = "  backends: [{address: 10.0.0.11:80}]\n"
	for _, c := range []struct {
		name, yaml, want string
	}{
		{"empty", "", "the file is empty"},
		{"syntax", "services: [\n", "line 1: invalid YAML: did not find expected node content"},
		{"unknown top-level", "servces: []\n", `line 1: servces: unknown field; did you mean "services"?`},
		{"unknown far", "bogus_thing: 1\nservices: []\n", "line 1: bogus_thing: unknown field; known fields here: addresses, admin"},
		{"list for string", svc + "  protocol: [tcp]\n" + be, "line 4: services[0].protocol: must be a string, got a list"},
		{"weight out of range", svc + "  backends: [{address: 10.0.0.11:80, weight: 70000}]\n", "services[0].backends[0].weight: must be 0..65535, got 70000"},
		{"negative weight", svc + "  backends: [{address: 10.0.0.11:80, weight: -1}]\n", "services[0].backends[0].weight: must be 0..65535, got -1"},
		{"backend initial", svc + "  backends: [{address: 10.0.0.11:80, initial: sideways}]\n", `services[0].backends[0].initial: must be up, down or unknown, got "sideways"`},
		{"backend initial down", svc + "  backends: [{address: 10.0.0.11:80, initial: down}]\n", ""},
		{"all weights zero", svc + "  backends: [{address: 10.0.0.11:80, weight: 0}]\n", "services[0].backends: every weight is 0"},
		{"no backends", svc, "services[0].backends: missing"},
		{"vip without port", "services:\n- {name: a, vip: 10.0.0.1, backends: [{address: 10.0.0.11:80}]}\n", `services[0].vip: must be address:port`},
		{"vip multicast", "services:\n- {name: a, vip: '224.0.0.1:80', backends: [{address: 10.0.0.11:80}]}\n", "services[0].vip: must be a unicast address"},
		{"4in6 backend", svc + "  backends: [{address: '[::ffff:10.0.0.11]:80'}]\n", "write IPv4 addresses in dotted form"},
		{"nat family", "interfaces: [{name: eth0}]\n" + svc + "  backends: [{address: '[fd00::1]:80'}]\n", "services[0].backends[0].address: nat mode keeps the VIP's family (IPv4)"},
		{"dsr any family", "interfaces: [{name: eth0}]\n" + svc + "  mode: dsr\n  backends: [{address: '[fd00::1]:80'}]\n", ""},
		{"proxy any family", svc + "  data_plane: proxy\n  backends: [{address: '[fd00::1]:80'}]\n", ""},
		// XDP's needs bind only services XDP may serve, also when interfaces are listed.
		{"http any family", "interfaces: [{name: eth0}]\n" + svc + "  data_plane: http\n  backends: [{address: '[fd00::1]:80'}]\n", ""},
		{"proxy algorithm any family", "interfaces: [{name: eth0}]\n" + svc + "  algorithm: least_conn\n  backends: [{address: '[fd00::1]:80'}]\n", ""},
		{"http any port", "interfaces: [{name: eth0}]\n" + svc + "  data_plane: http\n  mode: dsr\n  backends: [{address: 10.0.0.11:8080}]\n", ""},
		{"tunnel port", "interfaces: [{name: eth0}]\n" + svc + "  mode: tunnel\n  backends: [{address: 10.0.0.11:8080}]\n",
			"services[0].backends[0].address: tunnel mode cannot change the port: the backend must listen on the VIP's port 80, got 8080"},
		{"tunnel any family", "interfaces: [{name: eth0}]\n" + svc + "  mode: tunnel\n  backends: [{address: '[fd00::1]:80'}]\n", ""},
		{"unknown algorithm", svc + "  algorithm: fastest\n" + be, `services[0].algorithm: must be round_robin, random, least_conn, weighted_least_conn, weighted, p2c, ewma, least_time, source_hash, maglev or maglev_p2c, got "fastest"`},
		{"proxy algorithm on xdp", "interfaces: [{name: eth0}]\n" + svc + "  data_plane: xdp\n  algorithm: ewma\n" + be, "services[0].algorithm: ewma needs the proxy data plane"},
		{"proxy algorithm on auto", svc + "  algorithm: ewma\n" + be, ""},
		{"xdp without interfaces", svc + "  data_plane: xdp\n" + be, "services[0].data_plane: xdp needs at least one entry in interfaces"},
		{"udp on proxy", svc + "  protocol: udp\n  data_plane: proxy\n" + be, "the proxy serves tcp only"},
		{"udp with proxy algorithm", "interfaces: [{name: eth0}]\n" + svc + "  protocol: udp\n  algorithm: p2c\n" + be, "p2c is a proxy algorithm and the proxy serves tcp only"},
		{"udp without interfaces", svc + "  protocol: udp\n" + be, "services[0].protocol: udp is served by XDP only"},
		{"hash on proxy algorithm", svc + "  algorithm: round_robin\n  hash: source\n" + be, "services[0].hash: only maglev, maglev_p2c and source_hash hash"},
		{"source_hash with 5tuple", svc + "  algorithm: source_hash\n  hash: 5tuple\n" + be, "source_hash always hashes the source address"},
		{"pass on proxy", svc + "  data_plane: proxy\n  all_down: pass\n" + be, "services[0].all_down: pass hands packets"},
		{"pass with a proxy algorithm", svc + "  algorithm: least_conn\n  all_down: pass\n" + be, "services[0].all_down: pass hands packets"},
		{"pass with maglev", "interfaces: [{name: eth0}]\n" + svc + "  all_down: pass\n" + be, ""},
		{"table size not prime", svc + "  table_size: 1000\n" + be, "services[0].table_size: must be a prime"},
		{"table size too large", svc + "  table_size: 4194319\n" + be, "services[0].table_size: must be a prime from the number of backends (1) to 4194301, got 4194319"},
		{"table size largest", svc + "  table_size: 4194301\n" + be, ""},
		{"maglev_p2c", "interfaces: [{name: eth0}]\n" + svc + "  algorithm: maglev_p2c\n" + be, ""},
		{"maglev_p2c on udp", "interfaces: [{name: eth0}]\n" + svc + "  protocol: udp\n  algorithm: maglev_p2c\n" + be, ""},
		{"maglev_p2c with source hash", "interfaces: [{name: eth0}]\n" + svc + "  algorithm: maglev_p2c\n  hash: source\n" + be, "services[0].hash: maglev_p2c may send one client's flows to either of two backends"},
		{"http fields on tcp", svc + "  health: {path: /x}\n" + be, "services[0].health.path: only http checks use it"},
		// The check's request is written as the file says: a control character makes it one no server takes.
		{"http path with a tab", svc + "  health: {type: http, path: \"/a\\tb\"}\n" + be, `services[0].health.path: must start with / and hold no spaces or control characters, got "/a\tb"`},
		{"http path with DEL", svc + "  health: {type: http, path: \"/a\\x7f\"}\n" + be, `services[0].health.path: must start with /`},
		{"http host with a tab", svc + "  health: {type: http, host: \"a\\tb\"}\n" + be, `services[0].health.host: must be a host name, got "a\tb"`},
		{"http path with a query", svc + "  health: {type: http, path: \"/healthz?full=1\", host: \"api.example:8080\"}\n" + be, ""},
		{"bad status", svc + "  health: {type: http, expect_status: ['600']}\n" + be, "services[0].health.expect_status[0]: must be a status code"},
		{"jitter", svc + "  health: {jitter: 0.9}\n" + be, "services[0].health.jitter: must be 0..0.5, got 0.9"},
		{"method", svc + "  health: {method: icmp}\n" + be, `services[0].health.method: must be auto, syn or connect, got "icmp"`},
		{"syn on http", svc + "  health: {type: http, method: syn}\n" + be, "services[0].health.method: syn applies to tcp checks only, and type is http"},
		{"syn on tcp", svc + "  health: {method: syn}\n" + be, ""},
		{"connect on http", svc + "  health: {type: http, method: connect}\n" + be, ""},
		// A setting that must be positive, written 0, is an error rather than silently its default.
		{"zero interval", svc + "  health: {interval: 0s}\n" + be, "line 4: services[0].health.interval: must be at least 100ms (checking more often only loads the backends and the checker), got 0s"},
		{"zero check timeout", svc + "  health: {timeout: 0s}\n" + be, "line 4: services[0].health.timeout: must be at least 10ms (a shorter one fails healthy backends whenever the host is busy), got 0s"},
		// Health checks have floors, and a check ends before the next one of its backend starts.
		{"interval below the floor", svc + "  health:\n    interval: 10ms\n" + be, "line 5: services[0].health.interval: must be at least 100ms"},
		{"interval at the floor", svc + "  health: {interval: 100ms}\n" + be, ""},
		{"timeout below the floor", svc + "  health:\n    timeout: 1ms\n" + be, "line 5: services[0].health.timeout: must be at least 10ms"},
		{"negative timeout", svc + "  health: {timeout: -1s}\n" + be, "services[0].health.timeout: must be at least 10ms"},
		{"timeout over the interval", svc + "  health:\n    interval: 1s\n    timeout: 2s\n" + be, "line 6: services[0].health.timeout: must be at most interval (1s), so a check ends before the next one of its backend starts, got 2s"},
		{"timeout equal to the interval", svc + "  health: {interval: 1s, timeout: 1s}\n" + be, ""},
		// The flow tables are reserved whole at load: bounded both ways.
		{"conntrack_size too large", "xdp:\n  conntrack_size: 16777217\nservices: []\n", "line 2: xdp.conntrack_size: must be 1024..16777216 flows"},
		{"conntrack_size largest", "xdp: {conntrack_size: 16777216}\nservices: []\n", ""},
		{"conntrack_size too small", "xdp: {conntrack_size: 1000}\nservices: []\n", "xdp.conntrack_size: must be 1024..16777216 flows"},
		{"half_open_size too large", "xdp:\n  half_open_size: 4294967295\nservices: []\n", "line 2: xdp.half_open_size: must be 1024..16777216 flows"},
		{"half_open_size smallest", "xdp: {half_open_size: 1024}\nservices: []\n", ""},
		// fe80::/10 means something only on one link, named by a zone, which no field takes.
		{"link-local VIP", "services:\n- {name: a, vip: '[fe80::1]:80', backends: [{address: '[fd00::11]:80'}]}\n", "line 2: services[0].vip: fe80::1 is an IPv6 link-local address, which means something only with a zone"},
		{"link-local backend", svc + "  data_plane: proxy\n  backends: [{address: '[fe80::11]:80'}]\n", "services[0].backends[0].address: fe80::11 is an IPv6 link-local address"},
		{"link-local proxy listen", svc + "  proxy: {listen: '[fe80::1%eth0]:80'}\n" + be, "services[0].proxy.listen: must be an address without a zone"},
		{"link-local address", "addresses: ['fe80::7']\nservices: []\n", "line 1: addresses[0]: fe80::7 is an IPv6 link-local address"},
		{"IPv4 link-local VIP", "services:\n- {name: a, vip: '169.254.0.1:80', backends: [{address: 10.0.0.11:80}]}\n", ""},
		{"unique-local VIP", "services:\n- {name: a, vip: '[fd00::1]:80', backends: [{address: '[fd00::11]:80'}]}\n", ""},
		// Every enum is spelt one way, in lower case, with a hint for another case.
		{"protocol in upper case", svc + "  protocol: TCP\n" + be, `line 4: services[0].protocol: must be tcp or udp, got "TCP" (values are lower case: write tcp)`},
		{"mode in upper case", svc + "  mode: DSR\n" + be, `line 4: services[0].mode: must be nat, dsr or tunnel, got "DSR" (values are lower case: write dsr)`},
		{"check type in mixed case", svc + "  health: {type: Http}\n" + be, `services[0].health.type: must be tcp, http or none, got "Http" (values are lower case: write http)`},
		{"log level in upper case", "log: {level: INFO}\nservices: []\n", `log.level: must be debug, info, warn or error, got "INFO" (values are lower case: write info)`},
		{"zero base ejection", svc + "  passive: {base_ejection: 0s}\n" + be, "line 4: services[0].passive.base_ejection: must be positive, got 0s"},
		{"zero max ejection", svc + "  passive: {max_ejection: 0s}\n" + be, "line 4: services[0].passive.max_ejection: must be at least base_ejection (30s), got 0s"},
		{"zero max ejection percent", svc + "  passive: {max_ejection_percent: 0}\n" + be, "line 4: services[0].passive.max_ejection_percent: must be 1..100 (one backend may always be ejected), got 0"},
		{"zero proxy idle timeout", svc + "  proxy: {idle_timeout: 0s}\n" + be, "line 4: services[0].proxy.idle_timeout: must be positive, got 0s"},
		{"zero proxy connect timeout", svc + "  proxy: {connect_timeout: 0s}\n" + be, "line 4: services[0].proxy.connect_timeout: must be positive, got 0s"},
		{"zero http idle timeout", svc + "  data_plane: http\n  http: {idle_timeout: 0s}\n" + be, "line 5: services[0].http.idle_timeout: must be positive, got 0s"},
		{"zero http connect timeout", svc + "  data_plane: http\n  http: {connect_timeout: 0s}\n" + be, "line 5: services[0].http.connect_timeout: must be positive, got 0s"},
		{"zero http header timeout", svc + "  data_plane: http\n  http: {read_header_timeout: 0s}\n" + be, "line 5: services[0].http.read_header_timeout: must be positive, got 0s"},
		{"zero http header bytes", svc + "  data_plane: http\n  http: {max_header_bytes: 0}\n" + be, "line 5: services[0].http.max_header_bytes: must be 1024..16777216, got 0"},
		{"zero http timeouts that mean none", svc + "  data_plane: http\n  http: {try_timeout: 0s, timeout: 0s}\n" + be, ""},
		// A service that is its own backend sends every connection round to itself.
		{"backend is the VIP", svc + "  data_plane: proxy\n  backends: [{address: 10.0.0.1:80}]\n", "line 5: services[0].backends[0].address: 10.0.0.1:80 is this service's own VIP"},
		{"backend is the proxy listen", svc + "  data_plane: proxy\n  proxy: {listen: 127.0.0.1:8080}\n  backends: [{address: 127.0.0.1:8080}]\n", "line 6: services[0].backends[0].address: 127.0.0.1:8080 is this service's own proxy.listen"},
		{"backend is the http listen", svc + "  data_plane: http\n  http: {listen: 127.0.0.1:8080}\n  backends: [{address: 127.0.0.1:8080}]\n", "line 6: services[0].backends[0].address: 127.0.0.1:8080 is this service's own http.listen"},
		{"backend is another service's VIP", "services:\n- {name: a, vip: 10.0.0.1:80, data_plane: proxy, backends: [{address: 10.0.0.2:80}]}\n- {name: b, vip: 10.0.0.2:80, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n", ""},
		{"ejection order", svc + "  passive: {base_ejection: 1m, max_ejection: 10s}\n" + be, "services[0].passive.max_ejection: must be at least base_ejection (1m0s), got 10s"},
		{"panic", svc + "  panic_threshold: 101\n" + be, "services[0].panic_threshold: must be 0..100"},
		{"proxy protocol", svc + "  proxy: {proxy_protocol: 3}\n" + be, "services[0].proxy.proxy_protocol: must be 0 (off), 1 or 2, got 3"},
		{"sockmap", svc + "  proxy: {sockmap: always}\n" + be, "services[0].proxy.sockmap: must be auto, on or off, got \"always\""},
		{"mac", svc + "  mode: dsr\n  backends: [{address: 10.0.0.11:80, mac: zz}]\n", `services[0].backends[0].mac: must be a 6-byte Ethernet address`},
		{"bad name", "services:\n- {name: 'a b', vip: 10.0.0.1:80, backends: [{address: 10.0.0.11:80}]}\n", `services[0].name: must be 1-64 letters`},
		{"duplicate interface", "interfaces: [{name: eth0}, {name: eth0}]\nservices: []\n", `interfaces[1].name: "eth0" is already listed as interfaces[0]`},
		{"metrics", "metrics: {listen: localhost}\nservices: []\n", `metrics.listen: must be address:port ([address]:port for IPv6), got "localhost"`},
		{"metrics in brackets", "metrics: {listen: \"[127.0.0.1]:9470\"}\nservices: []\n", `line 1: metrics.listen: must be address:port`},
		{"metrics port sign", "metrics: {listen: \"127.0.0.1:+9470\"}\nservices: []\n", `line 1: metrics.listen: must be address:port`},
		{"metrics public in brackets", "metrics: {listen: \"[127.0.0.1]:9470\", public: true}\nservices: []\n", `line 1: metrics.listen: must be address:port`},
		{"jitter NaN", svc + "  health: {jitter: .nan}\n" + be, "services[0].health.jitter: must be 0..0.5, got NaN"},
		{"retry_budget NaN", svc + "  data_plane: http\n  http: {retry_budget: .nan}\n" + be, "services[0].http.retry_budget: must be 0..1"},
		{"weight fraction", svc + "  backends: [{address: 10.0.0.11:80, weight: 2.5}]\n", "line 4: services[0].backends[0].weight: must be a whole number, got 2.5"},
		{"proxy_protocol fraction", svc + "  proxy: {proxy_protocol: 1.9}\n" + be, "services[0].proxy.proxy_protocol: must be a whole number, got 1.9"},
		{"hash_seed fraction", "xdp: {hash_seed: 1.9}\nservices: []\n", "line 1: xdp.hash_seed: must be a whole number, got 1.9"},
		{"rise fraction", svc + "  health:\n    rise: 0.5\n" + be, "line 5: services[0].health.rise: must be a whole number, got 0.5"},
		{"whole float", svc + "  backends: [{address: 10.0.0.11:80, weight: 2.0}]\n", "services[0].backends[0].weight: must be a whole number, got 2.0"},
		{"duration fraction", svc + "  drain_timeout: 1.5\n" + be, `line 4: services[0].drain_timeout: must be a duration such as 500ms, 2s or 1m, got "1.5"`},
		{"proxy listen on an earlier listen", "services:\n- {name: a, vip: 10.0.0.1:443, data_plane: proxy, proxy: {listen: 127.0.0.1:8080}, backends: [{address: 10.0.0.11:80}]}\n- {name: b, vip: 127.0.0.1:8080, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n",
			`line 3: services[1].vip: 127.0.0.1:8080 is already the proxy address of services[0] ("a"), and this service listens on its VIP: set proxy.listen`},
		{"proxy listen on a later listen", "services:\n- {name: b, vip: 127.0.0.1:8080, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n- {name: a, vip: 10.0.0.1:443, data_plane: proxy, proxy: {listen: 127.0.0.1:8080}, backends: [{address: 10.0.0.11:80}]}\n",
			`services[1].proxy.listen: 127.0.0.1:8080 is already the proxy address of services[0] ("b")`},
		{"http listen on a proxy VIP", "services:\n- {name: a, vip: 127.0.0.1:8080, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n- {name: b, vip: 10.0.0.2:80, data_plane: http, http: {listen: 127.0.0.1:8080}, backends: [{address: 10.0.0.11:80}]}\n",
			`services[1].http.listen: 127.0.0.1:8080 is already the proxy address of services[0] ("a")`},
		// XDP takes every tcp packet to an xdp service's VIP, so a listener there gets none.
		{"proxy listen on an xdp VIP", "interfaces: [{name: eth0}]\nservices:\n- {name: a, vip: 10.0.0.1:80, data_plane: xdp, backends: [{address: 10.0.0.11:80}]}\n- {name: b, vip: 10.0.0.2:80, data_plane: proxy, proxy: {listen: 10.0.0.1:80}, backends: [{address: 10.0.0.11:80}]}\n",
			`line 4: services[1].proxy.listen: 10.0.0.1:80 is already the VIP (served by XDP) of services[0] ("a")`},
		{"http listen on an xdp VIP", "interfaces: [{name: eth0}]\nservices:\n- {name: a, vip: 10.0.0.1:80, data_plane: xdp, backends: [{address: 10.0.0.11:80}]}\n- {name: b, vip: 10.0.0.2:80, data_plane: http, http: {listen: 10.0.0.1:80}, backends: [{address: 10.0.0.11:80}]}\n",
			`line 4: services[1].http.listen: 10.0.0.1:80 is already the VIP (served by XDP) of services[0] ("a")`},
		{"xdp VIP on a proxy listen", "interfaces: [{name: eth0}]\nservices:\n- {name: b, vip: 10.0.0.2:80, data_plane: proxy, proxy: {listen: 10.0.0.1:80}, backends: [{address: 10.0.0.11:80}]}\n- {name: a, vip: 10.0.0.1:80, data_plane: xdp, backends: [{address: 10.0.0.11:80}]}\n",
			`line 4: services[1].vip: 10.0.0.1:80 is already the proxy address of services[0] ("b"), and XDP would take every tcp packet to it`},
		{"xdp VIP on the metrics address", "interfaces: [{name: eth0}]\nmetrics: {listen: \"10.0.0.1:9470\", public: true}\nservices:\n- {name: a, vip: 10.0.0.1:9470, data_plane: xdp, backends: [{address: 10.0.0.11:80}]}\n",
			"line 4: services[0].vip: 10.0.0.1:9470 is also metrics.listen, where the agent listens itself, and XDP would take every tcp packet to it"},
		{"xdp VIP on the default metrics address", "interfaces: [{name: lo}]\nservices:\n- {name: a, vip: 127.0.0.1:9470, data_plane: xdp, backends: [{address: 10.0.0.11:80}]}\n",
			"line 3: services[0].vip: 127.0.0.1:9470 is also the default metrics.listen, where the agent listens itself, and XDP would take every tcp packet to it"},
		// Listening on every address, metrics still gets the packets to the others.
		{"xdp VIP on the public metrics wildcard", "interfaces: [{name: eth0}]\nmetrics: {listen: \"[::]:9470\", public: true}\nservices:\n- {name: a, vip: 10.0.0.1:9470, data_plane: xdp, backends: [{address: 10.0.0.11:80}]}\n", ""},
		{"udp xdp VIP and a tcp listen", "interfaces: [{name: eth0}]\nservices:\n- {name: a, vip: 10.0.0.1:80, protocol: udp, data_plane: xdp, backends: [{address: 10.0.0.11:80}]}\n- {name: b, vip: 10.0.0.2:80, data_plane: proxy, proxy: {listen: 10.0.0.1:80}, backends: [{address: 10.0.0.11:80}]}\n", ""},
		// The admin and metrics listeners bind without SO_REUSEPORT: nothing else can bind their address.
		{"admin on the metrics address", "admin: {listen: 127.0.0.1:9470}\nservices: []\n", "line 1: admin.listen: 127.0.0.1:9470 is also the default metrics.listen"},
		{"a proxy on the metrics address", "services:\n- {name: a, vip: 127.0.0.1:9470, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n",
			"line 2: services[0].vip: 127.0.0.1:9470 is also the default metrics.listen"},
		{"a proxy listen on the admin address", "admin: {listen: 127.0.0.1:9471}\nservices:\n- {name: a, vip: 10.0.0.1:80, data_plane: proxy, proxy: {listen: 127.0.0.1:9471}, backends: [{address: 10.0.0.11:80}]}\n",
			"line 3: services[0].proxy.listen: 127.0.0.1:9471 is also admin.listen"},
		{"http on the public metrics wildcard", "metrics: {listen: \"[::]:9470\", public: true}\nservices:\n- {name: a, vip: 10.0.0.1:9470, data_plane: http, backends: [{address: 10.0.0.11:80}]}\n",
			"line 3: services[0].vip: 10.0.0.1:9470 is also metrics.listen ([::]:9470)"},
		{"metrics off, a proxy on its port", "metrics: {listen: \"off\"}\nservices:\n- {name: a, vip: 127.0.0.1:9470, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n", ""},
		// Go listens on both families for 0.0.0.0.
		{"metrics on IPv4's wildcard, a proxy on IPv6", "metrics: {listen: 0.0.0.0:9470, public: true}\nservices:\n- {name: a, vip: \"[fd00::1]:9470\", data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n",
			"line 3: services[0].vip: [fd00::1]:9470 is also metrics.listen (0.0.0.0:9470)"},
		{"metrics and a proxy on other ports", "services:\n- {name: a, vip: 127.0.0.1:9471, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n", ""},
		{"same VIP, one error", "services:\n- {name: a, vip: 127.0.0.1:8080, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n- {name: b, vip: 127.0.0.1:8080, data_plane: proxy, backends: [{address: 10.0.0.11:80}]}\n",
			`line 3: services[1].vip: tcp 127.0.0.1:8080 is already served by services[0] ("a"): one VIP, port and protocol per service`},
		{"second document", svc + be + "---\nbogus: 1\n", "line 6: a second YAML document"},
		{"trailing document marker", svc + be + "---\n", ""},
		{"document after an empty one", svc + be + "---\n---\nbogus: 1\n", "line 7: a second YAML document"},
		{"document end", svc + be + "...\n", ""},
		{"null file", "~\n", "the file is empty"},
		{"type error in a flow mapping", "xdp: {hash_seed: -1}\nservices: []\n", "line 1: xdp.hash_seed: must be a whole number ≥ 0"},
		{"type error in a flow list", svc + "  backends: [{address: 10.0.0.11:80, weight: x}]\n", `line 4: services[0].backends[0].weight: must be a whole number, got the string "x"`},
		{"type error at an item's first key", svc + "  backends:\n  - weight: x\n    address: 10.0.0.11:80\n", `line 5: services[0].backends[0].weight: must be a whole number, got the string "x"`},
		{"type error in a long value", svc + "  backends: [{address: 10.0.0.11:80, weight: abcdefghijkl}]\n", `line 4: services[0].backends[0].weight: must be a whole number, got the string "abcdefg..."`},
		{"merge key", "services:\n- &s\n  name: a\n  vip: 10.0.0.1:80\n" + be + "- <<: *s\n  name: b\n  vip: 10.0.0.2:80\n", ""},
		{"merge key list", "services:\n- &s\n  name: a\n  vip: 10.0.0.1:80\n  drain_timeout: 5s\n" + be + "- &h\n  name: c\n  vip: 10.0.0.3:80\n  health: {rise: 3}\n" + be + "- <<: [*s, *h]\n  name: b\n  vip: 10.0.0.2:80\n", ""},
		{"unknown field through a merge", "services:\n- &s\n  name: a\n  vip: 10.0.0.1:80\n  bogus: 1\n" + be + "- <<: *s\n  name: b\n  vip: 10.0.0.2:80\n", "line 5: services[0].bogus: unknown field"},
		{"metrics off", "metrics: {listen: \"off\"}\nservices: []\n", ""},
		{"metrics to the network", "metrics: {listen: 0.0.0.0:9470}\nservices: []\n", "metrics.listen: 0.0.0.0 is not a loopback address, so every metric would be served to the network: set metrics.public: true"},
		{"metrics public", "metrics: {listen: 0.0.0.0:9470, public: true}\nservices: []\n", ""},
		{"NUL byte", "services: []\n\x00\n", "line 2: invalid YAML: control characters are not allowed"},
		{"indentation", "services:\n- name: a\n  vip: 10.0.0.1:80\n  backends:\n  - address: 10.0.0.2:80\n   weight: 2\n", "line 6: invalid YAML"},
		{"log level", "log: {level: loud}\nservices: []\n", `log.level: must be debug, info, warn or error, got "loud"`},
		{"duration type", svc + "  drain_timeout: 5\n" + be, `line 4: services[0].drain_timeout: must be a duration such as 500ms, 2s or 1m, got "5"`},
		{"half-open timeout", "xdp: {half_open_timeout: 1ms}\nservices: []\n", "xdp.half_open_timeout: must be 100ms..10m, got 1ms"},
		{"new-flow rate", "xdp: {new_flow_rate: 2000000000}\nservices: []\n", "xdp.new_flow_rate: must be 0 (no limit) ..1000000000"},
		{"new-flow rate off", "xdp: {new_flow_rate: 0}\nservices: []\n", ""},
		{"previous table window", "xdp: {previous_table_window: -1s}\nservices: []\n", "xdp.previous_table_window: must be 0 (no fallback) ..24h, got -1s"},
		{"previous table window type", "xdp:\n  previous_table_window: 10\nservices: []\n", "line 2: xdp.previous_table_window: must be a duration"},
		{"http plane", svc + "  data_plane: http\n" + be, ""},
		{"http section on proxy", svc + "  data_plane: proxy\n  http: {retries: 1}\n" + be, "line 5: services[0].http: only data_plane http uses it, and data_plane is proxy"},
		{"http udp", svc + "  protocol: udp\n  data_plane: http\n" + be, "the http data plane serves tcp only"},
		{"http hash", svc + "  data_plane: http\n  algorithm: maglev\n  hash: source\n" + be, "services[0].hash: the http data plane hashes by http.hash_by"},
		{"http hash_by", svc + "  data_plane: http\n  algorithm: maglev\n  http: {hash_by: 'header:X-User'}\n" + be, ""},
		{"http hash_by kind", svc + "  data_plane: http\n  algorithm: maglev\n  http:\n    hash_by: path\n" + be, `line 7: services[0].http.hash_by: must be source, header or cookie, got "path"`},
		{"http hash_by name", svc + "  data_plane: http\n  algorithm: maglev\n  http: {hash_by: 'cookie:'}\n" + be, `services[0].http.hash_by: write cookie:NAME with a cookie name, got "cookie:"`},
		{"http hash_by algorithm", svc + "  data_plane: http\n  http: {hash_by: 'header:X'}\n" + be, "services[0].http.hash_by: only maglev, maglev_p2c and source_hash hash, and algorithm is least_conn"},
		{"http least_time", svc + "  data_plane: http\n  algorithm: least_time\n  http: {least_time: last_byte}\n" + be, ""},
		{"http least_time algorithm", svc + "  data_plane: http\n  http: {least_time: last_byte}\n" + be, "services[0].http.least_time: only algorithm least_time uses it"},
		{"http tls half", svc + "  data_plane: http\n  http: {tls: {cert: /c.pem}}\n" + be, "services[0].http.tls: name both cert and key"},
		{"http upstream", svc + "  data_plane: http\n  http: {upstream: h3}\n" + be, `services[0].http.upstream: must be auto, http1 or h2c, got "h3"`},
		{"http h2 engine", svc + "  data_plane: http\n  http: {h2_engine: nghttp2}\n" + be, `services[0].http.h2_engine: must be frames or net_http, got "nghttp2"`},
		{"http h1 engine", svc + "  data_plane: http\n  http: {h1_engine: frames}\n" + be, `services[0].http.h1_engine: must be loop or net_http, got "frames"`},
		{"http retries", svc + "  data_plane: http\n  http: {retries: 11, retry_budget: 2}\n" + be, "services[0].http.retries: must be 0..10, got 11"},
		{"http retry_grpc", svc + "  data_plane: http\n  http: {retry_grpc: ['Svc.Method']}\n" + be, `services[0].http.retry_grpc[0]: must be /package.Service/Method`},
		{"http header bytes", svc + "  data_plane: http\n  http: {max_header_bytes: 10}\n" + be, "services[0].http.max_header_bytes: must be 1024..16777216, got 10"},
		{"http listen twice", "services:\n- {name: a, vip: 10.0.0.1:80, data_plane: http, http: {listen: 127.0.0.1:8080}, backends: [{address: 10.0.0.11:80}]}\n- {name: b, vip: 10.0.0.2:80, data_plane: http, http: {listen: 127.0.0.1:8080}, backends: [{address: 10.0.0.11:80}]}\n", "services[1].http.listen: 127.0.0.1:8080 is already the listen address of services[0]"},
		{"duplicate key", "services: []\nservices: []\n", `line 2: services: already set at line 1`},
		// TCP keepalive: the kernel takes whole seconds, and at most tcp(7)'s limits.
		{"keepalive", svc + "  proxy:\n    tcp_keepalive:\n      client: {idle: 1s, interval: 1s, count: 127}\n      backend: {}\n" + be, ""},
		{"keepalive zero idle", svc + "  proxy:\n    tcp_keepalive:\n      client:\n        idle: 0s\n" + be, "line 7: services[0].proxy.tcp_keepalive.client.idle: must be whole seconds, 1s..32767s (the kernel's limits), got 0s"},
		{"keepalive fraction", svc + "  proxy:\n    tcp_keepalive:\n      backend:\n        interval: 1500ms\n" + be, "line 7: services[0].proxy.tcp_keepalive.backend.interval: must be whole seconds, 1s..32767s (the kernel's limits), got 1.5s"},
		{"keepalive idle too long", svc + "  proxy: {tcp_keepalive: {client: {idle: 10h}}}\n" + be, "line 4: services[0].proxy.tcp_keepalive.client.idle: must be whole seconds, 1s..32767s (the kernel's limits), got 10h0m0s"},
		{"keepalive count zero", svc + "  proxy:\n    tcp_keepalive:\n      client:\n        count: 0\n" + be, "line 7: services[0].proxy.tcp_keepalive.client.count: must be 1..127 (probes unanswered before the connection ends), got 0"},
		{"keepalive count too high", svc + "  data_plane: http\n  http:\n    tcp_keepalive:\n      backend: {count: 128}\n" + be, "line 7: services[0].http.tcp_keepalive.backend.count: must be 1..127"},
		{"keepalive negative interval", svc + "  data_plane: http\n  http: {tcp_keepalive: {client: {interval: -1s}}}\n" + be, "line 5: services[0].http.tcp_keepalive.client.interval: must be whole seconds, 1s..32767s (the kernel's limits), got -1s"},
		{"keepalive side misspelt", svc + "  proxy: {tcp_keepalive: {server: {}}}\n" + be, "services[0].proxy.tcp_keepalive.server: unknown field"},
		// TCP_USER_TIMEOUT: the kernel takes milliseconds.
		{"user timeout", svc + "  proxy:\n    tcp_user_timeout: {client: 30s, backend: 1ms}\n" + be, ""},
		{"user timeout zero", svc + "  proxy:\n    tcp_user_timeout:\n      client: 0s\n" + be, "line 6: services[0].proxy.tcp_user_timeout.client: must be whole milliseconds, 1ms..24h, got 0s"},
		{"user timeout fraction", svc + "  data_plane: http\n  http:\n    tcp_user_timeout:\n      backend: 1500us\n" + be, "line 7: services[0].http.tcp_user_timeout.backend: must be whole milliseconds, 1ms..24h, got 1.5ms"},
		{"user timeout too long", svc + "  proxy: {tcp_user_timeout: {backend: 25h}}\n" + be, "line 4: services[0].proxy.tcp_user_timeout.backend: must be whole milliseconds, 1ms..24h, got 25h0m0s"},
		{"user timeout negative", svc + "  data_plane: http\n  http: {tcp_user_timeout: {client: -1s}}\n" + be, "line 5: services[0].http.tcp_user_timeout.client: must be whole milliseconds, 1ms..24h, got -1s"},
		{"user timeout side misspelt", svc + "  proxy: {tcp_user_timeout: {server: 1s}}\n" + be, "services[0].proxy.tcp_user_timeout.server: unknown field"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse([]byte(c.yaml))
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("got error %v; want none", err)
			case c.want == "":
			case err == nil:
				t.Fatalf("got no error; want one containing %q", c.want)
			case !strings.Contains(err.Error(), c.want):
				t.Fatalf("got error\n%v\nwant one containing %q", err, c.want)
			case !errors.Is(err, ErrInvalid):
				t.Fatalf("got %v; want it to wrap ErrInvalid", err)
			}
		})
	}
}

// TestErrorPlaces: each error is at the value that is wrong, also when an anchor
// shares it, and none is reported about what follows from it.
func TestErrorPlaces(t *testing.T) {
	const be = "  backends: [{address: 10.0.0.11:80}]\n"
	for _, c := range []struct {
		name, yaml    string
		want, wantNot []string
	}{
		{
			name: "type error in an anchor",
			yaml: "services:\n- name: a\n  vip: 10.0.0.1:80\n  health: &h {rise: x}\n" + be +
				"- name: b\n  vip: 10.0.0.2:80\n  health: *h\n" + be +
				"- name: c\n  vip: 10.0.0.3:80\n  backends: [{address: 0.0.0.0:80}]\n",
			// once, at the anchor; and the third service's own error is not lost
			want:    []string{`line 4: services[0].health.rise: must be a whole number, got the string "x"`, "line 12: services[2].backends[0].address"},
			wantNot: []string{"services[1]", "line 4: services:"},
		},
		{
			name:    "a weight that did not decode",
			yaml:    "services:\n- name: a\n  vip: 10.0.0.1:80\n  backends:\n  - weight: x\n    address: 10.0.0.11:80\n",
			want:    []string{"line 5: services[0].backends[0].weight"},
			wantNot: []string{"every weight is 0"},
		},
		{
			name:    "a fraction for a duration",
			yaml:    "services:\n- name: a\n  vip: 10.0.0.1:80\n  drain_timeout: 1.5\n" + be,
			want:    []string{"line 4: services[0].drain_timeout: must be a duration"},
			wantNot: []string{"whole number"},
		},
		{
			name: "an anchor's type error, another between its aliases",
			yaml: "services:\n- name: a\n  vip: 10.0.0.1:80\n  health: &h {rise: x}\n" + be +
				"- name: b\n  vip: 10.0.0.2:80\n  panic_threshold: y\n  health: *h\n" + be +
				"- name: c\n  vip: 10.0.0.3:80\n  health: *h\n" + be,
			want: []string{`line 4: services[0].health.rise: must be a whole number, got the string "x"`, "line 8: services[1].panic_threshold"},
		},
		// yaml's decoder drops a list item it cannot decode (a duplicate key, a
		// string for a mapping, an empty item), which moved every later item up one
		// place: their errors named the wrong item and line, or were lost.
		{
			name: "a duplicate key in a service",
			yaml: "services:\n- name: a\n  name: a2\n  vip: 10.0.0.1:80\n" + be +
				"- name: b\n  vip: 10.0.0.2:80\n  backends:\n  - address: 10.0.0.3:80\n    weight: 70000\n",
			want:    []string{`line 3: services[0].name: already set at line 2`, "line 10: services[1].backends[0].weight: must be 0..65535"},
			wantNot: []string{"services[0].backends[0].weight"},
		},
		{
			name:    "a duplicate key in a backend",
			yaml:    "services:\n- name: a\n  vip: 10.0.0.1:80\n  backends:\n  - address: 10.0.0.2:80\n    address: 10.0.0.3:80\n",
			want:    []string{`line 6: services[0].backends[0].address: already set at line 5`},
			wantNot: []string{"backends: missing"},
		},
		{
			name:    "a string for a backend",
			yaml:    "services:\n- name: a\n  vip: 10.0.0.1:80\n  backends:\n  - 10.0.0.2:80\n  - address: 10.0.0.3:80\n    weight: 70000\n",
			want:    []string{`line 5: services[0].backends[0]: must be a mapping, got the string "10.0.0.2:80"`, "line 7: services[0].backends[1].weight: must be 0..65535"},
			wantNot: []string{"services[0].backends[0].address"},
		},
		{
			name:    "a string for a service",
			yaml:    "services:\n- web\n- name: b\n  vip: 10.0.0.1:80\n  backends:\n  - address: 10.0.0.3:80\n    weight: 70000\n",
			want:    []string{`line 2: services[0]: must be a mapping, got the string "web"`, "line 7: services[1].backends[0].weight: must be 0..65535"},
			wantNot: []string{"services[0].name"},
		},
		{
			name:    "an empty backend",
			yaml:    "services:\n- name: a\n  vip: 10.0.0.1:80\n  backends:\n  -\n  - address: 10.0.0.3:80\n    weight: 70000\n",
			want:    []string{"line 5: services[0].backends[0].address: missing", "line 7: services[0].backends[1].weight: must be 0..65535"},
			wantNot: []string{"backends: missing"},
		},
		{
			name: "a list among addresses",
			yaml: "addresses:\n- [10.0.0.1]\n- 10.0.0.300\nservices: []\n",
			want: []string{"line 2: addresses[0]: must be a string, got a list", `line 3: addresses[1]: must be an IP address, got "10.0.0.300"`},
		},
		{
			name:    "a backend address without a port",
			yaml:    "services:\n- name: a\n  vip: 10.0.0.1:80\n  backends:\n  - address: 10.0.0.2\n  - weight: 2\n",
			want:    []string{`line 5: services[0].backends[0].address: must be address:port`, "line 6: services[0].backends[1].address: missing"},
			wantNot: []string{"check_address"}, // the file names none: it is the address
		},
		{
			name: "a bad check address",
			yaml: "services:\n- name: a\n  vip: 10.0.0.1:80\n  backends:\n  - address: 10.0.0.2:80\n    check_address: 10.0.0.2\n",
			want: []string{`line 6: services[0].backends[0].check_address: must be address:port`},
		},
		{
			name:    "a misspelt check type",
			yaml:    "services:\n- name: a\n  vip: 10.0.0.1:80\n  health: {type: htp}\n" + be,
			want:    []string{`line 4: services[0].health.type: must be tcp, http or none, got "htp"`},
			wantNot: []string{"health.path"}, // the file names no path
		},
		{
			name: "a misspelt check type and a bad path",
			yaml: "services:\n- name: a\n  vip: 10.0.0.1:80\n  health:\n    type: htp\n    path: x\n" + be,
			want: []string{"line 5: services[0].health.type", `line 6: services[0].health.path: must start with /`},
		},
		{
			name:    "a negative interval",
			yaml:    "services:\n- name: a\n  vip: 10.0.0.1:80\n  health:\n    interval: -1s\n" + be,
			want:    []string{"line 5: services[0].health.interval"},
			wantNot: []string{"health.timeout"},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse([]byte(c.yaml))
			if err == nil {
				t.Fatalf("got no error; want %q", c.want)
			}
			for _, w := range c.want {
				if strings.Count(err.Error(), w) != 1 {
					t.Errorf("got\n%v\nwant %q once", err, w)
				}
			}
			for _, w := range c.wantNot {
				if strings.Contains(err.Error(), w) {
					t.Errorf("got\n%v\nwant nothing with %q", err, w)
				}
			}
		})
	}
}

// TestMergeKey: a service built with YAML's merge key has the merged settings, and
// its own keys win over them.
func TestMergeKey(t *testing.T) {
	cfg, err := Parse([]byte("services:\n- &s\n  name: a\n  vip: 10.0.0.1:80\n  drain_timeout: 5s\n  health: {rise: 3}\n" +
		"  backends: [{address: 10.0.0.11:80}]\n- <<: *s\n  name: b\n  vip: 10.0.0.2:80\n  drain_timeout: 7s\n"))
	if err != nil {
		t.Fatal(err)
	}
	b := cfg.Services[1]
	if b.Name != "b" || b.DrainTimeout != 7*time.Second || b.Health.Rise != 3 || len(b.Backends) != 1 {
		t.Errorf("merged service: name %q, drain_timeout %v, rise %d, %d backends; want b, 7s, 3, 1", b.Name, b.DrainTimeout, b.Health.Rise, len(b.Backends))
	}
}

func TestLoadMissing(t *testing.T) {
	_, err := Load("testdata/does-not-exist.yaml")
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("got %v; want an error wrapping os.ErrNotExist", err)
	}
}

// What the file says, resolved: explicit values win over defaults, 0 where 0 means
// off stays 0, and addresses and MACs arrive parsed.
func TestResolve(t *testing.T) {
	cfg, err := Parse([]byte(`xdp: {new_flow_rate: 0, conntrack_size: 4096, previous_table_window: 0s}
admin: {listen: 127.0.0.1:9999}
metrics: {listen: "off"}
log: {format: json, level: debug}
addresses: [192.0.2.7, 2001:db8::7]
services:
- name: a
  vip: 192.0.2.1:80
  mode: dsr
  algorithm: source_hash
  drain_timeout: 0s
  panic_threshold: 0
  health: {jitter: 0, initial: down, type: http, expect_status: ["200", "300-302"]}
  passive: {consecutive: 0}
  backends:
  - {address: 192.0.2.10:80, weight: 7, mac: "02:00:00:00:00:0a", initial: unknown, check_address: 192.0.2.10:81}
  - {address: 192.0.2.11:80}
`))
	if err != nil {
		t.Fatal(err)
	}
	s := cfg.Services[0]
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"xdp.new_flow_rate", cfg.XDP.NewFlowRate, uint32(0)},
		{"xdp.previous_table_window", cfg.XDP.PreviousTableWindow, time.Duration(0)},
		{"xdp.conntrack_size", cfg.XDP.ConntrackSize, uint32(4096)},
		{"admin.listen", cfg.Admin.Listen, netip.MustParseAddrPort("127.0.0.1:9999")},
		{"metrics.listen", cfg.Metrics.Listen.IsValid(), false},
		{"log.format", cfg.Log.Format, LogJSON},
		{"log.level", cfg.Log.Level, slog.LevelDebug},
		{"addresses", fmt.Sprint(cfg.Addresses), "[192.0.2.7 2001:db8::7]"},
		{"hash", s.Hash, HashSource},
		{"drain_timeout", s.DrainTimeout, time.Duration(0)},
		{"panic_threshold", s.PanicThreshold, 0},
		{"health.jitter", s.Health.Jitter, 0.0},
		{"health.expect_status", fmt.Sprint(s.Health.ExpectStatus), "[{200 200} {300 302}]"},
		{"passive.consecutive", s.Passive.Consecutive, 0},
		{"backends[0].weight", s.Backends[0].Weight, uint32(7)},
		{"backends[0].mac", s.Backends[0].MAC.String(), "02:00:00:00:00:0a"},
		{"backends[0].initial", s.Backends[0].Initial, InitialUnknown},
		{"backends[0].check_address", s.Backends[0].CheckAddr.Port(), uint16(81)},
		{"backends[1].initial", s.Backends[1].Initial, InitialDown},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %v; want %v", c.name, c.got, c.want)
		}
	}
}

// TestResolveHTTP: an http service's section resolves with its defaults, what
// the file says wins, and hash_by arrives split; no hash is set for its maglev.
func TestResolveHTTP(t *testing.T) {
	cfg, err := Parse([]byte(`services:
- name: a
  vip: 192.0.2.1:80
  data_plane: http
  backends: [{address: 192.0.2.10:80}]
- name: c
  vip: 192.0.2.1:82
  data_plane: http
  algorithm: maglev
  http: {hash_by: "header:x-USER"}
  backends: [{address: 192.0.2.10:80}]
- name: b
  vip: 192.0.2.1:81
  data_plane: http
  algorithm: maglev
  http: {listen: 127.0.0.1:8081, hash_by: "cookie:sid", retries: 0, x_forwarded_for: false, forwarded: true, retry_grpc: ["*"], upstream: h2c, try_timeout: 1s, h2_engine: net_http, h1_engine: net_http}
  backends: [{address: 192.0.2.10:80}]
`))
	if err != nil {
		t.Fatal(err)
	}
	a, b := cfg.Services[0].HTTP, cfg.Services[2].HTTP
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"a.algorithm", cfg.Services[0].Algorithm, AlgorithmLeastConn},
		{"a.listen", a.Listen, netip.MustParseAddrPort("192.0.2.1:80")},
		{"a.upstream", a.Upstream, UpstreamAuto},
		{"a.h2_engine", a.H2Engine, H2EngineFrames},
		{"a.h1_engine", a.H1Engine, H1EngineLoop},
		{"a.least_time", a.LeastTime, LeastTimeHeader},
		{"a.hash_by", a.HashBy, HashBy{Kind: HashBySource}},
		{"a.retries", a.Retries, DefaultHTTPRetries},
		{"a.retry_budget", a.RetryBudget, DefaultRetryBudget},
		{"a.x_forwarded_for", a.XForwardedFor, true},
		{"a.x_forwarded_proto", a.XForwardedProto, true},
		{"a.max_header_bytes", a.MaxHeaderBytes, DefaultMaxHeaderBytes},
		{"a.read_header_timeout", a.ReadHeaderTimeout, DefaultHeaderTimeout},
		{"a.connect_timeout", a.ConnectTimeout, DefaultConnectTimeout},
		// A field name in any case is one key; a cookie's name keeps its case.
		{"c.hash_by", cfg.Services[1].HTTP.HashBy, HashBy{Kind: HashByHeader, Name: "X-User"}},
		{"b.hash", cfg.Services[2].Hash, HashKey("")},
		{"b.listen", b.Listen, netip.MustParseAddrPort("127.0.0.1:8081")},
		{"b.hash_by", b.HashBy, HashBy{Kind: HashByCookie, Name: "sid"}},
		{"b.retries", b.Retries, 0},
		{"b.x_forwarded_for", b.XForwardedFor, false},
		{"b.forwarded", b.Forwarded, true},
		{"b.retry_grpc", fmt.Sprint(b.RetryGRPC), "[*]"},
		{"b.upstream", b.Upstream, UpstreamH2C},
		{"b.h2_engine", b.H2Engine, H2EngineNetHTTP},
		{"b.h1_engine", b.H1Engine, H1EngineNetHTTP},
		{"b.try_timeout", b.TryTimeout, time.Second},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %v; want %v", c.name, c.got, c.want)
		}
	}
}

// TestResolveUserTimeout: a side of tcp_user_timeout that the file names has
// its value; a side it leaves out is 0 (off).
func TestResolveUserTimeout(t *testing.T) {
	cfg, err := Parse([]byte(`services:
- name: a
  vip: 192.0.2.1:80
  proxy: {tcp_user_timeout: {client: 30s, backend: 1500ms}}
  backends: [{address: 192.0.2.10:80}]
- name: b
  vip: 192.0.2.1:81
  data_plane: http
  http: {tcp_user_timeout: {backend: 2s}}
  backends: [{address: 192.0.2.10:80}]
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		got, want TCPUserTimeout
	}{
		{"a.proxy", cfg.Services[0].Proxy.TCPUserTimeout, TCPUserTimeout{Client: 30 * time.Second, Backend: 1500 * time.Millisecond}},
		{"b.proxy", cfg.Services[1].Proxy.TCPUserTimeout, TCPUserTimeout{}},
		{"b.http", cfg.Services[1].HTTP.TCPUserTimeout, TCPUserTimeout{Backend: 2 * time.Second}},
	} {
		if c.got != c.want {
			t.Errorf("%s.tcp_user_timeout: got %+v; want %+v", c.name, c.got, c.want)
		}
	}
}

// TestResolveKeepalive: a side of tcp_keepalive that the file names is on,
// with the defaults for what it leaves out, also when it names it with no
// value at all, or with an alias of no value; a side it leaves out is off.
func TestResolveKeepalive(t *testing.T) {
	cfg, err := Parse([]byte(`services:
- name: a
  vip: 192.0.2.1:80
  data_plane: proxy
  proxy: {tcp_keepalive: {client: {idle: 5s, interval: 2s, count: 3}}}
  backends: [{address: 192.0.2.10:80}]
- name: b
  vip: 192.0.2.1:81
  data_plane: http
  http: {tcp_keepalive: {backend: {}}}
  backends: [{address: 192.0.2.10:80}]
- name: c
  vip: 192.0.2.1:82
  backends: [{address: 192.0.2.10:80}]
- name: d
  vip: 192.0.2.1:83
  proxy:
    tcp_keepalive:
      client:
      backend: ~
  backends: [{address: 192.0.2.10:80}]
- name: e
  vip: 192.0.2.1:84
  proxy:
    tcp_keepalive:
      client: &none
      backend: *none
  backends: [{address: 192.0.2.10:80}]
`))
	if err != nil {
		t.Fatal(err)
	}
	def := Keepalive{Idle: DefaultKeepaliveIdle, Interval: DefaultKeepaliveInterval, Count: DefaultKeepaliveCount}
	for _, c := range []struct {
		name      string
		got, want TCPKeepalive
	}{
		{"a.proxy", cfg.Services[0].Proxy.TCPKeepalive, TCPKeepalive{Client: Keepalive{5 * time.Second, 2 * time.Second, 3}}},
		{"b.http", cfg.Services[1].HTTP.TCPKeepalive, TCPKeepalive{Backend: def}},
		{"c.proxy", cfg.Services[2].Proxy.TCPKeepalive, TCPKeepalive{}},
		{"d.proxy, sides named with no value", cfg.Services[3].Proxy.TCPKeepalive, TCPKeepalive{Client: def, Backend: def}},
		{"e.proxy, a side named by an alias of no value", cfg.Services[4].Proxy.TCPKeepalive, TCPKeepalive{Client: def, Backend: def}},
	} {
		if c.got != c.want {
			t.Errorf("%s.tcp_keepalive: got %+v; want %+v", c.name, c.got, c.want)
		}
	}
	if cfg.Services[2].Proxy.TCPKeepalive.Client.On() || !cfg.Services[0].Proxy.TCPKeepalive.Client.On() {
		t.Errorf("On: got %v and %v; want false and true", cfg.Services[2].Proxy.TCPKeepalive.Client.On(), cfg.Services[0].Proxy.TCPKeepalive.Client.On())
	}
}

// TestDocExamples: every YAML example in README.md and docs/ is a config this
// parser takes, so an operator can start from any of them; so is each with its
// settings left out in comments (`# keepalive: 3s`) written in.
func TestDocExamples(t *testing.T) {
	n := 0
	commented := regexp.MustCompile(`(?m)^(\s*)# ([a-z_]+: )`)
	for _, f := range docFiles(t) {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(data), "\n")
		for i := 0; i < len(lines); i++ {
			if strings.TrimSpace(lines[i]) != "```yaml" {
				continue
			}
			start := i + 1
			for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			}
			n++
			block := strings.Join(lines[start:i], "\n")
			if _, err := Parse([]byte(block)); err != nil {
				t.Errorf("%s: the example at line %d: %v", filepath.Base(f), start, err)
				continue
			}
			if all := commented.ReplaceAllString(block, "$1$2"); all != block {
				if _, err := Parse([]byte(all)); err != nil {
					t.Errorf("%s: the example at line %d with its commented settings written in: %v", filepath.Base(f), start, err)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("found no YAML examples")
	}
}

// TestDocLinks: every relative link in README.md and docs/ leads to a file of
// the repository, and every #anchor to a heading of the page it names (as
// GitHub makes anchors: lower case, punctuation dropped, spaces as hyphens, a
// repeated heading's anchor numbered).
func TestDocLinks(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	n := 0
	for _, f := range docFiles(t) {
		for _, l := range outsideCode(t, f) {
			for _, sm := range link.FindAllStringSubmatch(l.text, -1) {
				u := sm[1]
				if strings.Contains(u, "://") || strings.HasPrefix(u, "mailto:") {
					continue
				}
				n++
				path, anchor, _ := strings.Cut(u, "#")
				target := f
				if path != "" {
					target = filepath.Join(filepath.Dir(f), path)
				}
				if _, err := os.Stat(target); err != nil {
					t.Errorf("%s:%d: link %s: %v", filepath.Base(f), l.n, u, err)
					continue
				}
				if anchor == "" {
					continue
				}
				if !strings.HasSuffix(target, ".md") {
					t.Errorf("%s:%d: link %s: an anchor in a file that is not markdown", filepath.Base(f), l.n, u)
				} else if !slices.Contains(anchors(t, target), anchor) {
					t.Errorf("%s:%d: link %s: %s has no heading #%s", filepath.Base(f), l.n, u, target, anchor)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("found no relative links")
	}
}

// docFiles are the user docs: README.md and docs/*.md.
func docFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{"../../README.md"}, files...)
}

// docLine is a line of a markdown file, numbered from 1.
type docLine struct {
	n    int
	text string
}

// outsideCode returns the lines of the markdown file at path that are not in a
// fenced code block.
func outsideCode(t *testing.T, path string) []docLine {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []docLine
	fenced := false
	for i, l := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			fenced = !fenced
			continue
		}
		if !fenced {
			out = append(out, docLine{i + 1, l})
		}
	}
	return out
}

// anchors returns the anchors GitHub gives the headings of the markdown file
// at path.
func anchors(t *testing.T, path string) []string {
	t.Helper()
	heading := regexp.MustCompile(`^#{1,6}\s+(.*?)\s*$`)
	drop := regexp.MustCompile(`[^\p{L}\p{N}_\- ]`)
	var out []string
	seen := map[string]int{}
	for _, l := range outsideCode(t, path) {
		sm := heading.FindStringSubmatch(l.text)
		if sm == nil {
			continue
		}
		a := strings.ReplaceAll(drop.ReplaceAllString(strings.ToLower(sm[1]), ""), " ", "-")
		if k := seen[a]; k > 0 {
			out = append(out, fmt.Sprintf("%s-%d", a, k))
		} else {
			out = append(out, a)
		}
		seen[a]++
	}
	return out
}

// TestXDPCapacity: a file the XDP program cannot hold is refused at the service,
// backend or interface past its capacity, once, and only services XDP may serve
// count.
func TestXDPCapacity(t *testing.T) {
	// services writes n services of the given data plane, each with per backends,
	// from services[first] on, their addresses distinct.
	services := func(b *strings.Builder, first, n, per int, plane DataPlane) {
		for i := first; i < first+n; i++ {
			fmt.Fprintf(b, "- name: s%d\n  vip: 10.%d.%d.1:80\n  data_plane: %s\n  backends:\n", i, 100+i/256, i%256, plane)
			for j := range per {
				fmt.Fprintf(b, "  - address: 10.%d.%d.%d:80\n", j/65536, j/256%256, j%256)
			}
		}
	}
	const head = "interfaces: [{name: eth0}]\nservices:\n"
	for _, c := range []struct {
		name  string
		build func(b *strings.Builder)
		want  string // "" for none
	}{
		{"services at the capacity", func(b *strings.Builder) {
			b.WriteString(head)
			services(b, 0, MaxXDPServices, 1, DataPlaneAuto)
			services(b, MaxXDPServices, 1, 1, DataPlaneProxy) // not XDP's
		}, ""},
		{"a service past the capacity", func(b *strings.Builder) {
			b.WriteString(head)
			services(b, 0, MaxXDPServices+2, 1, DataPlaneXDP)
		}, fmt.Sprintf("line %d: services[1024]: the XDP program holds at most 1024 services, and this is service 1025", 3+1024*5)},
		{"services without interfaces", func(b *strings.Builder) {
			b.WriteString("services:\n")
			services(b, 0, MaxXDPServices+1, 1, DataPlaneAuto)
		}, ""},
		{"backends at the capacity", func(b *strings.Builder) {
			b.WriteString(head)
			services(b, 0, 2, MaxXDPBackends/2, DataPlaneAuto)
		}, ""},
		{"a backend past the capacity", func(b *strings.Builder) {
			b.WriteString(head)
			services(b, 0, 1, MaxXDPBackends-1, DataPlaneAuto)
			services(b, 1, 1, 3, DataPlaneXDP)
		}, fmt.Sprintf("line %d: services[1].backends[1]: the XDP program holds at most 16384 backends over all its services", 3+4+MaxXDPBackends-1+4+1)},
		{"default tables at the capacity", func(b *strings.Builder) {
			b.WriteString(head)
			for i := range MaxXDPServices {
				fmt.Fprintf(b, "- {name: s%d, vip: 10.%d.%d.1:80, algorithm: maglev_p2c, backends: [{address: 10.0.0.1:80}]}\n", i, 100+i/256, i%256)
			}
		}, ""},
		{"default tables of the most backends", func(b *strings.Builder) {
			// One service at the end of each step of default sizes up to 16,384
			// backends in all, the most entries default sizes reach: about half
			// the bound.
			b.WriteString(head)
			sizes := []int{10487, 2622, 1312, 656 + MaxXDPBackends - 16097}
			for i := range MaxXDPServices {
				fmt.Fprintf(b, "- name: s%d\n  vip: 10.%d.%d.1:80\n  algorithm: maglev_p2c\n  backends:\n", i, 100+i/256, i%256)
				per := 1
				if i < len(sizes) {
					per = sizes[i]
				}
				for j := range per {
					fmt.Fprintf(b, "  - address: 10.%d.%d.%d:80\n", j/65536, j/256%256, j%256)
				}
			}
		}, ""},
		{"tables past the bound", func(b *strings.Builder) {
			b.WriteString(head)
			for i := range MaxTableEntries/MaxTableSize + 1 {
				fmt.Fprintf(b, "- name: s%d\n  vip: 10.%d.%d.1:80\n  table_size: %d\n  backends: [{address: 10.0.0.1:80}]\n", i, 100+i/256, i%256, MaxTableSize)
			}
		}, fmt.Sprintf("line %d: services[64].table_size: the XDP program holds at most 268435456 lookup table entries over all its services", 3+64*4+2)},
		{"default tables past the bound", func(b *strings.Builder) {
			b.WriteString(head)
			for i := range MaxTableEntries / MaxTableSize {
				fmt.Fprintf(b, "- {name: s%d, vip: 10.%d.%d.1:80, table_size: %d, backends: [{address: 10.0.0.1:80}]}\n", i, 100+i/256, i%256, MaxTableSize)
			}
			b.WriteString("- {name: t, vip: 10.99.0.1:80, algorithm: maglev_p2c, backends: [{address: 10.0.0.1:80}]}\n")
		}, "line 67: services[64]: the XDP program holds at most 268435456 lookup table entries over all its services"},
		{"interfaces past the capacity", func(b *strings.Builder) {
			b.WriteString("interfaces:\n")
			for i := range MaxInterfaces + 1 {
				fmt.Fprintf(b, "- name: eth%d\n", i)
			}
			b.WriteString("services: []\n")
		}, "line 66: interfaces[64]: the XDP program attaches to at most 64 interfaces, and 65 are listed"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var b strings.Builder
			c.build(&b)
			_, err := Parse([]byte(b.String()))
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("got %v; want no error", err)
			case c.want == "":
			case err == nil:
				t.Fatalf("got no error; want %q", c.want)
			case strings.Count(err.Error(), "the XDP program") != 1 || !strings.Contains(err.Error(), c.want):
				t.Fatalf("got\n%v\nwant %q, and one capacity error", err, c.want)
			}
		})
	}
}

// TestTLSPathsFromTheFile: a relative certificate or key path is the file's
// directory's, whatever the working directory; an absolute one stays.
func TestTLSPathsFromTheFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "weir.yaml")
	data := "services:\n- name: a\n  vip: 10.0.0.1:443\n  data_plane: http\n  http: {tls: {cert: certs/a.pem, key: /etc/weir/a.key}}\n  backends: [{address: 10.0.0.11:80}]\n"
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	h := cfg.Services[0].HTTP
	if want := filepath.Join(dir, "certs", "a.pem"); h.TLSCert != want {
		t.Errorf("cert: got %q; want %q", h.TLSCert, want)
	}
	if want := "/etc/weir/a.key"; h.TLSKey != want {
		t.Errorf("key: got %q; want %q", h.TLSKey, want)
	}
	// The same file named by a relative path means the same files.
	t.Chdir(dir)
	cfg, err = Load("weir.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := cfg.Services[0].HTTP.TLSCert, filepath.Join(dir, "certs", "a.pem"); got != want {
		t.Errorf("cert, the file named weir.yaml: got %q; want %q", got, want)
	}
}

// TestLine: a parsed Config tells where a setting is written, or the setting
// that encloses it, so problems found after parsing name their line too.
func TestLine(t *testing.T) {
	cfg, err := Parse([]byte("services:\n- name: a\n  vip: 10.0.0.1:443\n  data_plane: http\n  http:\n    tls: {cert: a.pem, key: a.key}\n  backends: [{address: 10.0.0.11:80}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]int{
		"services[0].http.tls":         6,
		"services[0].http.tls.cert":    6,
		"services[0].vip":              3,
		"services[0].health.interval":  2, // not written: the service's line
		"metrics.listen":               0, // nothing of it written
		"services[0].backends[0].port": 7,
	} {
		if got := cfg.Line(path); got != want {
			t.Errorf("Line(%q): got %d; want %d", path, got, want)
		}
	}
}

// TestLoadXDP: LoadXDP reads the interfaces and xdp sections of a file that
// fails validation elsewhere, and refuses those sections on their own errors,
// named and placed as Load names and places them.
func TestLoadXDP(t *testing.T) {
	const head = "interfaces:\n  - name: eth1\n    attach: generic\nxdp:\n  hash_seed: 7\n  conntrack_size: 65536\n  pin_path: /sys/fs/bpf/weir-test\n"
	const badServices = "services:\n  - name: web\n    vip: 192.0.2.1:80\n    algorithm: Maglev\n    backends:\n      - address: 10.0.0.1:80\n"
	dir := t.TempDir()
	write := func(name, body string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}

	path := write("services.yaml", head+"log: {level: loud}\n"+badServices)
	if _, err := Load(path); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Load: got %v; want the file invalid", err)
	}
	cfg, err := LoadXDP(path)
	if err != nil {
		t.Fatalf("LoadXDP: %v", err)
	}
	want := XDP{HashSeed: 7, ConntrackSize: 65536, NewFlowRate: DefaultNewFlowRate,
		PreviousTableWindow: DefaultPreviousTableWindow, PinPath: "/sys/fs/bpf/weir-test"}
	if cfg.XDP != want {
		t.Errorf("xdp: got %+v; want %+v", cfg.XDP, want)
	}
	if want := []Interface{{Name: "eth1", Attach: AttachGeneric}}; fmt.Sprint(cfg.Interfaces) != fmt.Sprint(want) {
		t.Errorf("interfaces: got %+v; want %+v", cfg.Interfaces, want)
	}

	path = write("xdp.yaml", strings.Replace(head, "65536", "12", 1)+"  pin_pth: /x\n"+badServices)
	_, err = LoadXDP(path)
	var es Errors
	if !errors.As(err, &es) || len(es) != 2 {
		t.Fatalf("LoadXDP with bad xdp settings: got %v; want 2 errors", err)
	}
	for i, want := range []string{path + ":6: xdp.conntrack_size: must be", path + `:8: xdp.pin_pth: unknown field; did you mean "pin_path"?`} {
		if !strings.HasPrefix(es[i].Error(), want) {
			t.Errorf("error %d: got %q; want it to begin %q", i, es[i].Error(), want)
		}
	}
}

// TestLoadXDPMisspelledSection: a top-level key that is no section of a config
// is refused by LoadXDP as Load refuses it, not left out: a misspelled xdp
// section would otherwise be read as none, and the program at the default pin
// path, with the default table sizes, taken for the file's.
func TestLoadXDPMisspelledSection(t *testing.T) {
	path := filepath.Join(t.TempDir(), "weir.yaml")
	body := "interfaces:\n  - name: eth1\nxpd:\n  conntrack_size: 65536\n  pin_path: /sys/fs/bpf/weir-other\n" +
		"services:\n  - name: web\n    vip: 192.0.2.1:80\n    algorithm: Maglev\n    backends:\n      - address: 10.0.0.1:80\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadXDP(path)
	if err == nil {
		t.Fatalf("LoadXDP: got pin path %s, conntrack size %d; want the misspelled xdp section refused", cfg.XDP.PinPath, cfg.XDP.ConntrackSize)
	}
	var es Errors
	if want := path + `:3: xpd: unknown field; did you mean "xdp"?`; !errors.As(err, &es) || len(es) != 1 || es[0].Error() != want {
		t.Errorf("LoadXDP: got %v; want the one error %q", err, want)
	}
}

// TestLoadXDPMergeKey: LoadXDP follows a top-level merge key as Load does: the
// interfaces and xdp sections it merges in are read (a key of the file's own
// wins over a merged one), and the other sections it merges in are not, so
// their errors do not stop it.
func TestLoadXDPMergeKey(t *testing.T) {
	path := filepath.Join(t.TempDir(), "weir.yaml")
	body := "<<:\n" +
		"  - &base\n" +
		"    xdp: {pin_path: /sys/fs/bpf/weir-merged, conntrack_size: 65536}\n" +
		"    interfaces: [{name: eth1, attach: generic}]\n" +
		"    services:\n" +
		"      - {name: web, vip: 192.0.2.1:80, algorithm: Maglev, backends: [{address: 10.0.0.1:80}]}\n" +
		"  - {log: {level: loud}}\n" +
		"xdp: {pin_path: /sys/fs/bpf/weir-own, hash_seed: 9}\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Load: got %v; want the merged services refused", err)
	}
	cfg, err := LoadXDP(path)
	if err != nil {
		t.Fatalf("LoadXDP: %v", err)
	}
	want := XDP{HashSeed: 9, NewFlowRate: DefaultNewFlowRate, PreviousTableWindow: DefaultPreviousTableWindow, PinPath: "/sys/fs/bpf/weir-own"}
	if cfg.XDP != want {
		t.Errorf("xdp: got %+v; want the file's own %+v", cfg.XDP, want)
	}
	if want := []Interface{{Name: "eth1", Attach: AttachGeneric}}; fmt.Sprint(cfg.Interfaces) != fmt.Sprint(want) {
		t.Errorf("interfaces: got %+v; want the merged %+v", cfg.Interfaces, want)
	}

	// The merged sections' own errors are reported, at their lines.
	body = "<<: {interfaces: [{name: eth1, attach: fast}]}\nservices: []\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = LoadXDP(path)
	var es Errors
	if want := path + `:1: interfaces[0].attach: must be native, generic or auto, got "fast"`; !errors.As(err, &es) || len(es) != 1 || es[0].Error() != want {
		t.Errorf("LoadXDP of a bad merged interface: got %v; want the one error %q", err, want)
	}
}

// TestLoadXDPMergeExpansion: merges of merges of the same mappings, each level
// naming the one below twice, are refused by LoadXDP as by Load, for their
// aliasing, at once: LoadXDP cuts each mapping once and keeps the aliases for
// yaml's decoder to count (40 levels are 2^40 mappings followed one by one).
func TestLoadXDPMergeExpansion(t *testing.T) {
	var b strings.Builder
	b.WriteString("<<:\n  - &m0 {xdp: {hash_seed: 3}}\n")
	for i := 1; i <= 40; i++ {
		fmt.Fprintf(&b, "  - &m%d {<<: [*m%d, *m%d]}\n", i, i-1, i-1)
	}
	b.WriteString("interfaces: [{name: eth1}]\n")
	path := filepath.Join(t.TempDir(), "weir.yaml")
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	// Exits when LoadXDP returns.
	go func() {
		_, err := LoadXDP(path)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "excessive aliasing") {
			t.Errorf("LoadXDP: got %v; want the file refused for its aliasing", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("LoadXDP of 40 levels of doubling merges: no answer within 30s")
	}
}

// TestTLSPairErrorWraps: a certificate pair that does not load is reported at
// its file, line and field, and still wraps the load's error, so errors.Is
// finds the cause (here a missing file).
func TestTLSPairErrorWraps(t *testing.T) {
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "web.crt"), filepath.Join(dir, "web.key")
	cfg, err := Parse(fmt.Appendf(nil, "services:\n- {name: web, vip: 127.0.0.1:443, data_plane: http, http: {tls: {cert: %s, key: %s}}, backends: [{address: 127.0.0.1:80}]}\n", cert, key))
	if err != nil {
		t.Fatal(err)
	}
	_, loadErr := os.ReadFile(cert)
	fe := cfg.TLSPairError("f.yaml", "web", loadErr)
	if want := "f.yaml:2: services[0].http.tls: cert " + cert + " and key " + key + " do not load: "; !strings.HasPrefix(fe.Error(), want) {
		t.Errorf("got %q; want it to begin %q", fe, want)
	}
	if !errors.Is(fe, os.ErrNotExist) {
		t.Errorf("errors.Is(%q, os.ErrNotExist) = false; want true", fe)
	}
}

// TestServing: which planes may serve a service, the one rule the agent's
// placement and weir validate's host check read.
func TestServing(t *testing.T) {
	for _, tc := range []struct {
		dp    DataPlane
		algo  Algorithm
		proto Protocol
		want  Serving
	}{
		{DataPlaneAuto, AlgorithmMaglev, TCP, Serving{XDP: true, Else: DataPlaneProxy}},
		{DataPlaneAuto, AlgorithmLeastConn, TCP, Serving{Else: DataPlaneProxy}},
		{DataPlaneAuto, AlgorithmSourceHash, UDP, Serving{XDP: true, Why: "udp is served by XDP only"}},
		{DataPlaneXDP, AlgorithmMaglev, TCP, Serving{XDP: true, Why: "data_plane xdp"}},
		{DataPlaneXDP, AlgorithmMaglevP2C, UDP, Serving{XDP: true, Why: "data_plane xdp"}},
		{DataPlaneProxy, AlgorithmMaglev, TCP, Serving{Else: DataPlaneProxy}},
		{DataPlaneHTTP, AlgorithmMaglev, TCP, Serving{Else: DataPlaneHTTP}},
	} {
		s := Service{DataPlane: tc.dp, Algorithm: tc.algo, Protocol: tc.proto}
		if got := s.Serving(); got != tc.want {
			t.Errorf("%s %s %s: got %+v; want %+v", tc.dp, tc.algo, tc.proto, got, tc.want)
		}
	}
}

// TestDocFields: every field of the config file is in a table of the docs
// ("| field | default | meaning |": the configuration reference, http.md's,
// fleet.md's), itself or within a part documented whole (`addresses[]`; a
// summary row such as `bgp.*` documents no field: fleet.md's table does), and
// every field such a table names is one the file takes.
func TestDocFields(t *testing.T) {
	fields := map[string]bool{} // path: whether it is a leaf, with no fields of its own
	var walk func(prefix string, typ reflect.Type)
	walk = func(prefix string, typ reflect.Type) {
		for typ.Kind() == reflect.Pointer || typ.Kind() == reflect.Slice {
			if typ.Kind() == reflect.Slice {
				prefix += "[]"
			}
			typ = typ.Elem()
		}
		if typ.Kind() != reflect.Struct {
			return
		}
		for f := range typ.Fields() {
			name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if name == "" || name == "-" {
				continue
			}
			path := strings.TrimPrefix(prefix+"."+name, ".")
			fields[path] = true
			fields[strings.TrimSuffix(prefix, "[]")] = false
			walk(path, f.Type)
		}
	}
	walk("", reflect.TypeFor[file]())
	delete(fields, "")

	span := regexp.MustCompile("`([^`]+)`")
	documented := map[string]bool{}
	n := 0
	for _, f := range docFiles(t) {
		in := false
		for _, l := range outsideCode(t, f) {
			cells := strings.Split(l.text, "|")
			switch {
			case len(cells) >= 4 && strings.TrimSpace(cells[1]) == "field" && strings.TrimSpace(cells[2]) == "default":
				in = true
			case !in || strings.HasPrefix(l.text, "|---"):
			case !strings.HasPrefix(l.text, "|") || len(cells) < 4:
				in = false
			default:
				// `a.b` / `c`, `a.b`, `.c`: c is a sibling of b.
				var full string
				for i, sm := range span.FindAllStringSubmatch(cells[1], -1) {
					name := sm[1]
					if i == 0 {
						if name[0] >= 'A' && name[0] <= 'Z' {
							break // a Go struct's field (proxy.md), not the file's
						}
						if strings.HasPrefix(name, "http.") && filepath.Base(f) == "http.md" {
							name = "services[]." + name
						}
						full = name
					} else {
						full = full[:strings.LastIndex(full, ".")+1] + strings.TrimPrefix(name, ".")
					}
					n++
					whole := strings.TrimSuffix(strings.TrimSuffix(full, ".*"), "[]") // addresses[]: the list
					// A part's summary row (`bgp.*`) names the page whose
					// table has its fields; it documents none of them.
					if !strings.HasSuffix(full, ".*") {
						documented[whole] = true
					}
					if _, ok := fields[whole]; !ok {
						t.Errorf("%s:%d: %s is no field of the config file", filepath.Base(f), l.n, full)
					}
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("found no table of fields")
	}
	for f, leaf := range fields {
		if !leaf {
			continue // a part, whose own fields are checked
		}
		covered := false
		for p := f; p != "" && !covered; {
			covered = documented[p]
			i := strings.LastIndex(p, ".")
			if i < 0 {
				break
			}
			p = p[:i]
		}
		if !covered {
			t.Errorf("%s is in no table of fields in the docs", f)
		}
	}
}
