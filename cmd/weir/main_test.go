package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/heavy"
	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/waitfor"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/userspace/agent/admin"
)

func TestValidate(t *testing.T) {
	for _, c := range []struct {
		name       string
		args       []string
		wantErr    bool
		wantStdout string
		wantStderr []string
		notStdout  []string
	}{
		// The example's eth0 and udp service: the file alone, on any host.
		{"example", []string{"validate", "-c", "../../examples/weir.yaml", "--file-only"}, false,
			"../../examples/weir.yaml: valid, 3 services", nil, nil},
		{"every error", []string{"validate", "-c", "../../userspace/config/testdata/bad.yaml"}, true, "",
			[]string{"bad.yaml:26: services[1].backends[3].weight: must be 0..65535, got 70000",
				`bad.yaml:20: services[1].protcol: unknown field; did you mean "protocol"?`,
				"bad.yaml: 15 errors"}, nil},
		{"missing file", []string{"validate", "-c", "testdata/none.yaml"}, true, "", nil, nil},
		{"no file", []string{"validate"}, true, "", nil, nil},
		// Only services XDP may serve have an XDP mode.
		{"planes", []string{"validate", "testdata/planes.yaml"}, false,
			"  api  tcp/10.0.0.1:80  data plane http, least_conn, 1 backends\n" +
				"  app  tcp/10.0.0.1:81  data plane proxy (auto: XDP does not serve least_conn), least_conn, 1 backends\n" +
				"  web  tcp/10.0.0.1:82  data plane auto, xdp mode dsr, maglev, 1 backends\n", nil,
			[]string{"http, xdp mode", "least_conn), xdp mode"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), c.args, &stdout, &stderr)
			if (err != nil) != c.wantErr {
				t.Fatalf("got error %v; want error %t", err, c.wantErr)
			}
			if c.name == "missing file" && !strings.Contains(err.Error(), "no such file") {
				t.Errorf("got %v; want it to say the file does not exist", err)
			}
			if c.wantStderr != nil && !errors.Is(err, errReported) {
				t.Errorf("got %v; want errReported", err)
			}
			if !strings.Contains(stdout.String(), c.wantStdout) {
				t.Errorf("stdout: got %q; want it to contain %q", stdout.String(), c.wantStdout)
			}
			for _, w := range c.notStdout {
				if strings.Contains(stdout.String(), w) {
					t.Errorf("stdout: got\n%s\nwant nothing with %q", stdout.String(), w)
				}
			}
			for _, w := range c.wantStderr {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("stderr: got\n%s\nwant a line containing %q", stderr.String(), w)
				}
			}
		})
	}
}

// TestValidateCertificates: weir validate reads an http service's certificate and
// key as a reload does: relative paths from the file's directory (this test runs
// in the package's), and a pair that does not load is an error naming the field
// and its line, as every other error of the file does.
func TestValidateCertificates(t *testing.T) {
	dir := t.TempDir()
	httpbackend.WriteCert(t, filepath.Join(dir, "web.crt"), filepath.Join(dir, "web.key"), "web")
	if err := os.WriteFile(filepath.Join(dir, "bad.key"), []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, key string
		want      string // in stderr; "" for valid
	}{
		{"relative paths", "web.key", ""},
		{"a key that does not load", "bad.key", "services[0].http.tls: cert " + filepath.Join(dir, "web.crt") + " and key " + filepath.Join(dir, "bad.key") + " do not load"},
		{"a missing key", "none.key", "services[0].http.tls: cert " + filepath.Join(dir, "web.crt") + " and key " + filepath.Join(dir, "none.key") + " do not load"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(dir, "weir.yaml")
			data := "services:\n- name: web\n  vip: 127.0.0.1:8443\n  data_plane: http\n  http:\n    tls: {cert: web.crt, key: " + c.key + "}\n  backends: [{address: 127.0.0.1:80}]\n"
			if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
				t.Fatal(err)
			}
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), []string{"validate", p}, &stdout, &stderr)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("got %v, stderr %q; want valid", err, stderr.String())
			case c.want == "":
			case err == nil:
				t.Fatalf("got valid, stdout %q; want an error containing %q", stdout.String(), c.want)
			case !strings.Contains(stderr.String(), p+":6: "+c.want):
				t.Fatalf("stderr %q; want %q", stderr.String(), p+":6: "+c.want)
			}
		})
	}
}

// TestRunBadInput: weir run with a config it cannot use stops at once with an error
// naming the problem, before touching any data plane.
func TestRunBadInput(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := dir + "/" + name
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	socket := dir + "/weir.sock"
	head := "admin: {socket: " + socket + "}\nmetrics: {listen: \"off\"}\n"
	for _, c := range []struct {
		name, file, want string
	}{
		{"missing file", dir + "/none.yaml", "no such file"},
		{"unreadable file", dir, "is a directory"},
		{"invalid yaml", write("bad.yaml", head+"services: [\n"), "bad.yaml"},
		{"unknown field", write("unknown.yaml", head+"services:\n  - name: a\n    vip: 10.0.0.1:80\n    protcol: tcp\n    backends: [{address: 10.0.0.2:80}]\n"),
			`services[0].protcol: unknown field; did you mean "protocol"?`},
		{"impossible value", write("weight.yaml", head+"services:\n  - name: a\n    vip: 10.0.0.1:80\n    backends: [{address: 10.0.0.2:80, weight: 70000}]\n"),
			"services[0].backends[0].weight: must be 0..65535, got 70000"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err := run(ctx, []string{"run", "-c", c.file}, &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v; want an error containing %q", err, c.want)
			}
			if _, serr := os.Stat(socket); serr == nil {
				t.Errorf("admin socket %s exists after a failed start; want nothing created", socket)
			}
		})
	}
}

// TestUsageErrors: commands given the wrong arguments say how to call them.
func TestUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"explain", "web"}, "usage: weir explain SERVICE CLIENT_IP:PORT"},
		{[]string{"drain", "web"}, "drain: 1 argument, want 2: usage: weir drain SERVICE BACKEND"},
		{[]string{"weight", "web"}, "weight: 1 argument, want 3: usage: weir weight SERVICE BACKEND N"},
		{[]string{"stop", "now"}, "usage: weir stop [--detach]"},
		{[]string{"decap"}, "usage: weir decap --interface IFACE"},
		{[]string{"decap", "--interface", "lo", "--mode", "fast"}, `attach mode "fast"`},
		{[]string{"decap", "--interface", "lo", "--addr", "not-an-ip"}, "not-an-ip"},
		{[]string{"decap", "--interface", "lo", "--from", "10.0.0.0/33"}, "10.0.0.0/33"},
		{[]string{"decap", "--interface", "lo", "--from", "::ffff:10.0.0.0/104"}, "give an IPv4-mapped prefix as IPv4"},
		{[]string{"explain", "-s", "/nonexistent/weir.sock", "web", "10.0.0.1:1"}, "is weir running?"},
		{[]string{"node"}, "weir node drain [--wait]"},
		{[]string{"node", "stop"}, "node: want drain or undrain"},
		{[]string{"node", "drain", "-s", "/nonexistent/weir.sock"}, "is weir running?"},
		{[]string{"demo", "fleet", "--streams", "0"}, "--streams must be 1..150"},
		{[]string{"run", "-c", "/nonexistent/weir.yaml"}, "run: read config: open /nonexistent/weir.yaml"},
		{[]string{"validate", "-c", "a.yaml", "b.yaml"}, `the file is "b.yaml" or -c "a.yaml", not both`},
		{[]string{"validate", "--config=a.yaml", "b.yaml"}, "not both"},
		// NaN is no percentage (and JSON cannot carry it to the agent).
		{[]string{"reload", "--max-move", "NaN", "-s", "/nonexistent/weir.sock"}, `invalid value "NaN" for flag -max-move: must be a percentage 0..100`},
		{[]string{"plan", "--max-move", "nan", "-s", "/nonexistent/weir.sock"}, `invalid value "nan" for flag -max-move: must be a percentage 0..100`},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), c.args, &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error()+stderr.String(), c.want) {
				t.Errorf("got %v (stderr %q); want an error containing %q", err, stderr.String(), c.want)
			}
		})
	}
}

// TestDecapTooManySources: more --from prefixes than the program holds are
// refused, naming the flag and the limit.
func TestDecapTooManySources(t *testing.T) {
	args := []string{"decap", "--interface", "lo", "--addr", "192.0.2.1"}
	for i := range 65 {
		args = append(args, "--from", fmt.Sprintf("198.51.100.%d", i))
	}
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), args, &stdout, &stderr)
	if want := "decap: --from: decap sources: 65 prefixes, at most 64"; err == nil || err.Error() != want {
		t.Errorf("got %v; want %q", err, want)
	}
}

// decapPrefix names TestDecap's namespace: a prefix of its own, not the demo
// tests' (testPrefix), whose kept and killed demos' namespaces the first
// UniqueName of a prefix in a process removes as a dead run's.
const decapPrefix = "wdx"

// TestDecap attaches weir decap to a namespace's loopback, stops it as SIGTERM
// would, and checks that it reported its counters and detached.
func TestDecap(t *testing.T) {
	ns, err := netns.New(topo.UniqueName(decapPrefix))
	xdptest.Check(t, err)
	t.Cleanup(func() { ns.Close() })
	var stdout, stderr bytes.Buffer
	err = ns.Do(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		return run(ctx, []string{"decap", "--interface", "lo", "--mode", "generic", "--addr", "192.0.2.1", "--from", "198.51.100.7/24", "--from", "2001:db8::1", "--interval", "100ms"}, &stdout, &stderr)
	})
	xdptest.Check(t, err)
	for _, want := range []string{"attached to lo (generic) for tunnel packets to 192.0.2.1 from 198.51.100.0/24,2001:db8::1/128", "decapsulated 0 packets", "not from a balancer (dropped) 0", "at exit:", "detached from lo"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout: got\n%s\nwant a line containing %q", stdout.String(), want)
		}
	}
}

// TestDecapLeavesDemosNamespaces: TestDecap, run in a process of its own as
// go test runs it beside another checkout's demo tests, leaves alone a
// namespace named as a kept or killed test demo's (testPrefix, the pid of a
// demo process that has exited).
func TestDecapLeavesDemosNamespaces(t *testing.T) {
	heavy.Demo(t) // no demo test removes it meanwhile
	dead := 0
	for pid := 1 << 22; pid > 1 && dead == 0; pid-- {
		if syscall.Kill(pid, 0) == syscall.ESRCH {
			dead = pid
		}
	}
	id := strconv.FormatInt(int64(dead), 36)
	kept, err := netns.New(testPrefix + strings.Repeat("0", 5-len(id)) + id + "0-lb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kept.Close() })
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(exe, "-test.run", "^TestDecap$", "-test.count", "1").CombinedOutput(); err != nil {
		t.Fatalf("TestDecap: %v: %s", err, out)
	}
	if _, err := os.Stat(kept.Path()); err != nil {
		t.Errorf("%s, a test demo's, after TestDecap: %v; want it left", kept.Name(), err)
	}
}

// TestConventions: every command answers -h with its usage (arguments included)
// and exit status 0, refuses unknown flags and extra arguments with its usage, and
// takes flags after its arguments.
func TestConventions(t *testing.T) {
	commands := []struct {
		name, usage string
		extra       []string // arguments that are one too many
	}{
		{"run", "usage: weir run [flags]", []string{"x"}},
		{"validate", "usage: weir validate [FILE] [flags]", []string{"a", "b"}},
		{"status", "usage: weir status [flags]", []string{"extra"}},
		{"drain", "usage: weir drain SERVICE BACKEND [flags]", []string{"a", "b", "c"}},
		{"undrain", "usage: weir undrain SERVICE BACKEND [flags]", []string{"a", "b", "c"}},
		{"weight", "usage: weir weight SERVICE BACKEND N [flags]", []string{"a", "b", "1", "d"}},
		{"reload", "usage: weir reload [flags]", []string{"x"}},
		{"plan", "usage: weir plan [flags]", []string{"x"}},
		{"stop", "usage: weir stop [flags]", []string{"now"}},
		{"explain", "usage: weir explain SERVICE CLIENT_IP:PORT [flags]", []string{"a", "b", "c"}},
		{"decap", "usage: weir decap --interface IFACE [flags]", []string{"x"}},
		{"demo", "usage: weir demo [flags]", []string{"x"}},
		{"demo fleet", "usage: weir demo fleet [flags]", []string{"x"}},
		{"node drain", "usage: weir node drain [flags]", []string{"x"}},
		{"node undrain", "usage: weir node undrain [flags]", []string{"x"}},
		{"version", "usage: weir version", []string{"x"}},
	}
	for _, c := range commands {
		t.Run(c.name+" -h", func(t *testing.T) {
			for _, h := range []string{"-h", "--help"} {
				var stdout, stderr bytes.Buffer
				err := run(context.Background(), append(strings.Fields(c.name), h), &stdout, &stderr)
				if !errors.Is(err, flag.ErrHelp) {
					t.Errorf("%s %s: got %v; want flag.ErrHelp (exit 0)", c.name, h, err)
				}
				if !strings.HasPrefix(stdout.String(), c.usage) {
					t.Errorf("%s %s: stdout %q; want it to start with %q", c.name, h, stdout.String(), c.usage)
				}
			}
		})
		t.Run(c.name+" bad flag", func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), append(strings.Fields(c.name), "--no-such-flag"), &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error(), "flag provided but not defined: -no-such-flag") || !strings.Contains(err.Error(), "weir "+c.name+" -h") {
				t.Errorf("got %v; want the unknown flag named and a pointer to -h", err)
			}
		})
		t.Run(c.name+" extra arguments", func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), append(strings.Fields(c.name), c.extra...), &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error(), "unexpected argument") {
				t.Errorf("got %v; want unexpected argument", err)
			}
			if strings.Count(err.Error(), c.name+":") > 1 {
				t.Errorf("got %q; want the command's prefix once", err)
			}
		})
	}
	t.Run("flags after arguments", func(t *testing.T) {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), []string{"explain", "web", "10.0.0.1:1", "--json", "-s", "/nonexistent/weir.sock"}, &stdout, &stderr)
		if err == nil || !strings.Contains(err.Error(), "/nonexistent/weir.sock") {
			t.Errorf("got %v; want the flags after the arguments taken (the socket named)", err)
		}
	})
	t.Run("validate FILE and --config", func(t *testing.T) {
		for _, args := range [][]string{{"validate", "--file-only", "../../examples/weir.yaml"}, {"validate", "--file-only", "--config", "../../examples/weir.yaml"}, {"validate", "--file-only", "-c", "../../examples/weir.yaml"}} {
			var stdout, stderr bytes.Buffer
			if err := run(context.Background(), args, &stdout, &stderr); err != nil {
				t.Errorf("%v: %v", args, err)
			}
		}
	})
	t.Run("one error", func(t *testing.T) {
		p := t.TempDir() + "/one.yaml"
		os.WriteFile(p, []byte("services:\n- {name: a, vip: 10.0.0.1:80, backends: [{address: 10.0.0.2:80, weight: 70000}]}\n"), 0o644)
		var stdout, stderr bytes.Buffer
		run(context.Background(), []string{"validate", p}, &stdout, &stderr)
		if !strings.Contains(stderr.String(), ": 1 error\n") {
			t.Errorf("stderr %q; want \"1 error\"", stderr.String())
		}
	})
	for _, v := range []string{"version", "--version"} {
		t.Run(v, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if err := run(context.Background(), []string{v}, &stdout, &stderr); err != nil {
				t.Fatal(err)
			}
			for _, w := range []string{"weir ", "commit ", "built ", "bpf object sha256 "} {
				if !strings.Contains(stdout.String(), w) {
					t.Errorf("%s: %q lacks %q", v, stdout.String(), w)
				}
			}
			if len(strings.Fields(strings.SplitAfter(stdout.String(), "sha256 ")[1])[0]) != 64 {
				t.Errorf("%s: %q: want a 64-hex-digit object hash", v, stdout.String())
			}
		})
	}
}

// TestValidateNamesHostPreconditions: in a namespace with forwarding off, weir
// validate says a nat service would fall back to the proxy, why, and the fix,
// and exits 0: the agent here takes the file. With data_plane xdp the service
// cannot start, so the agent here refuses the file: validate says so on stderr
// and exits 1, and with --file-only checks the file alone and exits 0.
func TestValidateNamesHostPreconditions(t *testing.T) {
	ns, err := netns.New(topo.UniqueName("wvh"))
	xdptest.Check(t, err)
	t.Cleanup(func() { ns.Close() })
	// A new namespace takes its IPv4 settings from the host's, where forwarding
	// may be on: off here, whatever the host says.
	if err := ns.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/conf/lo/forwarding", []byte("0"), 0o644)
	}); err != nil {
		t.Fatal(err)
	}
	validate := func(web string, args ...string) (out, errOut string, err error) {
		t.Helper()
		p := t.TempDir() + "/nat.yaml"
		// api is served by the http plane, whatever its algorithm: XDP's needs are not its.
		os.WriteFile(p, []byte("interfaces: [{name: lo}]\naddresses: [192.0.2.9]\nservices:\n- {name: web, vip: 192.0.2.1:80, "+web+"backends: [{address: 192.0.2.2:80}]}\n"+
			"- {name: api, vip: 192.0.2.1:81, data_plane: http, algorithm: maglev, backends: [{address: 192.0.2.2:81}]}\n"), 0o644)
		var stdout, stderr bytes.Buffer
		err = ns.Do(func() error {
			return run(context.Background(), append([]string{"validate", p}, args...), &stdout, &stderr)
		})
		return stdout.String(), stderr.String(), err
	}
	stdout, _, err := validate("")
	if err != nil {
		t.Fatal(err)
	}
	// Each line at the service's entry (web's is line 4).
	for _, w := range []string{"nat.yaml:4: services[0]: nat mode needs IPv4 forwarding", "sysctl -w net.ipv4.conf.lo.forwarding=1", "falls back to the proxy"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("stdout:\n%s\nwant it to contain %q", stdout, w)
		}
	}
	if strings.Contains(stdout, "services[1]") {
		t.Errorf("stdout:\n%s\nwant nothing about the http service api", stdout)
	}

	stdout, stderr, err := validate("data_plane: xdp, ")
	if !errors.Is(err, errReported) {
		t.Errorf("data_plane xdp: got %v; want exit 1 (errReported)", err)
	}
	for _, w := range []string{"nat.yaml:4: services[0]: nat mode needs IPv4 forwarding", "cannot start (data_plane xdp) and the agent refuses the file here",
		"nat.yaml: the file is valid, but the agent on this host refuses it: 1 problem (--file-only checks the file alone)"} {
		if !strings.Contains(stderr, w) {
			t.Errorf("data_plane xdp: stderr:\n%s\nwant it to contain %q", stderr, w)
		}
	}
	if strings.Contains(stdout, "this host") {
		t.Errorf("data_plane xdp: stdout:\n%s\nwant the refusal on stderr only", stdout)
	}
	// As weir run --no-xdp takes it: web runs on the proxy, whatever forwarding says.
	if stdout, stderr, err := validate("", "--no-xdp"); err != nil || stderr != "" || strings.Contains(stdout, "forwarding") ||
		!strings.Contains(stdout, "nat.yaml:4: services[0]: XDP unavailable: XDP disabled (--no-xdp), so it falls back to the proxy") {
		t.Errorf("--no-xdp: got %v, stdout:\n%s\nstderr:\n%s\nwant exit 0 and web on the proxy as XDP is disabled", err, stdout, stderr)
	}
	if stdout, stderr, err := validate("data_plane: xdp, ", "--file-only"); err != nil || stderr != "" || strings.Contains(stdout, "this host") || !strings.Contains(stdout, "valid, 2 services") {
		t.Errorf("--file-only: got %v, stdout:\n%s\nstderr:\n%s\nwant exit 0, the file valid and nothing about this host", err, stdout, stderr)
	}
}

// TestValidateOneMissingInterface: of a file's two interfaces one does not
// exist in the balancer's namespace. The agent attaches XDP to the other and
// serves its data_plane xdp service there, so weir validate in that namespace
// names the missing interface on stdout and exits 0; with neither interface
// there the service cannot start, and it exits 1.
func TestValidateOneMissingInterface(t *testing.T) {
	tp := topo.NewT(t, topo.Config{Name: topo.UniqueName("wvm"), Backends: 1})
	pinPath := filepath.Join(xdptest.BPFFS(t), "weir")
	dir := t.TempDir()
	file, socket := filepath.Join(dir, "weir.yaml"), filepath.Join(dir, "weir.sock")
	const missing = "wvmnosuch0"
	write := func(links string) {
		t.Helper()
		body := strings.Replace(fmt.Sprintf(stopConfig, links, pinPath, tp.Balancer.IP4, socket, tp.VIP4, tp.Backends[0].IP4),
			"    mode: dsr\n", "    mode: dsr\n    data_plane: xdp\n", 1)
		if err := os.WriteFile(file, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	validate := func() (string, string, error) {
		var stdout, stderr bytes.Buffer
		err := tp.Balancer.NS.Do(func() error {
			return run(context.Background(), []string{"validate", file}, &stdout, &stderr)
		})
		return stdout.String(), stderr.String(), err
	}

	write(missing)
	// Each at its entry's line.
	if _, stderr, err := validate(); !errors.Is(err, errReported) || !strings.Contains(stderr, file+":2: interfaces[0]: "+missing) {
		t.Errorf("no interface there: got %v, stderr:\n%s\nwant exit 1 naming %s at %s:2", err, stderr, missing, file)
	}

	write(tp.Balancer.Link + "\n  - name: " + missing)
	stdout, stderr, err := validate()
	if err != nil || stderr != "" || !strings.Contains(stdout, file+":3: interfaces[1]: "+missing) {
		t.Fatalf("one interface of two there: got %v, stdout:\n%s\nstderr:\n%s\nwant exit 0, %s named on stdout at %s:3", err, stdout, stderr, missing, file)
	}
	// The agent takes the file: the service runs on XDP, on the interface there.
	agent := startAgent(t, tp.Balancer.NS.Name(), file)
	client := admin.NewClient(socket)
	if !waitfor.Cond(30*time.Second, func() bool {
		st, err := client.Status(context.Background())
		return err == nil && len(st.Services) == 1 && st.Services[0].DataPlane == "xdp"
	}) {
		select {
		case <-agent.done:
			t.Fatalf("the agent refused the file weir validate passed: %v", agent.err)
		default:
			t.Fatal("the agent did not serve web with XDP within 30s")
		}
	}
}

// TestValidateEndsOnInterrupt: weir validate, reading a config that does not
// come (a pipe held open), ends at Ctrl-C as a command that watches no
// context must: by the signal's default action. It runs main in a copy of the
// test binary, since that action ends the process.
func TestValidateEndsOnInterrupt(t *testing.T) {
	if os.Getenv("WEIR_TEST_VALIDATE_MAIN") == "1" {
		os.Args = []string{"weir", "validate", "/dev/stdin"}
		main()
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^TestValidateEndsOnInterrupt$")
	cmd.Env = append(os.Environ(), "WEIR_TEST_VALIDATE_MAIN=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close() })
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	// Exits when the process does; the cleanup kills it if the test gives up.
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill() })
	// Interrupt once it reads: it has opened /dev/stdin, a descriptor of its
	// own on the pipe beside its standard input.
	fds := fmt.Sprintf("/proc/%d/fd/", cmd.Process.Pid)
	waitfor.Value(t, 10*time.Second, "weir validate reading its config from the pipe", func() (any, bool) {
		pipe, err := os.Readlink(fds + "0")
		if err != nil {
			return err, false
		}
		links, _ := filepath.Glob(fds + "*")
		var got []string
		for _, l := range links {
			if target, err := os.Readlink(l); err == nil && target == pipe && filepath.Base(l) != "0" {
				got = append(got, l)
			}
		}
		return got, len(got) > 0
	})
	cmd.Process.Signal(os.Interrupt)
	select {
	case err := <-exited:
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			t.Fatalf("weir validate after SIGINT: %v; want it ended by the signal", err)
		}
		if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGINT {
			t.Errorf("weir validate after SIGINT: %v; want it ended by the signal", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("weir validate was still reading 5 s after SIGINT")
	}
}

// TestClientsReachTheAgentPastAnInvalidFile: a config file edited since the
// agent loaded it, and now invalid elsewhere, still names the socket the
// clients ask the agent on: status and reload reach for it (and, with no
// agent there, say so) instead of stopping at the file's errors.
func TestClientsReachTheAgentPastAnInvalidFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "weir.yaml")
	bad := "admin:\n  socket: /nonexistent/weir-test.sock\nservices:\n  - name: web\n    vip: 192.0.2.1:80\n    backends:\n      - address: 10.0.0.1:80\n        weight: -1\n"
	if err := os.WriteFile(file, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"status", "reload", "plan"} {
		t.Run(cmd, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), []string{cmd, "-c", file}, &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error()+stderr.String(), "/nonexistent/weir-test.sock") {
				t.Errorf("got %v (stderr %q); want it to have tried /nonexistent/weir-test.sock", err, stderr.String())
			}
		})
	}
}

// TestDemoHelp: weir demo -h points to the fleet demo and names the variable
// that moves it, weir demo down -h the one it reads, and weir demo fleet -h names
// everything the fleet demo runs besides weir: BIRD for the router's BGP and nft for
// its per-next-hop counters (fleet.Start fails without either).
func TestDemoHelp(t *testing.T) {
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"demo", "-h"}, []string{"weir demo fleet", "WEIR_DEMO_NAME=NAME"}},
		{[]string{"demo", "down", "-h"}, []string{"WEIR_DEMO_NAME"}},
		{[]string{"demo", "fleet", "-h"}, []string{"bird2", "nftables"}},
	} {
		var stdout, stderr bytes.Buffer
		if err := run(context.Background(), c.args, &stdout, &stderr); !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("weir %s: got %v; want flag.ErrHelp", strings.Join(c.args, " "), err)
		}
		for _, w := range c.want {
			if !strings.Contains(stdout.String(), w) {
				t.Errorf("weir %s: got %q; want it to name %q", strings.Join(c.args, " "), stdout.String(), w)
			}
		}
	}
}
