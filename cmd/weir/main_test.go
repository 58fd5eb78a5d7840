package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

func TestValidate(t *testing.T) {
	for _, c := range []struct {
		name       string
		args       []string
		wantErr    bool
		wantStdout string
		wantStderr []string
	}{
		{"example", []string{"validate", "-c", "../../examples/weir.yaml"}, false,
			"../../examples/weir.yaml: valid, 3 services", nil},
		{"every error", []string{"validate", "-c", "../../userspace/config/testdata/bad.yaml"}, true, "",
			[]string{"bad.yaml:26: services[1].backends[3].weight: must be 0..65535, got 70000",
				`bad.yaml:20: services[1].protcol: unknown field; did you mean "protocol"?`,
				"bad.yaml: 15 errors"}},
		{"missing file", []string{"validate", "-c", "testdata/none.yaml"}, true, "", nil},
		{"no file", []string{"validate"}, true, "", nil},
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
			for _, w := range c.wantStderr {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("stderr: got\n%s\nwant a line containing %q", stderr.String(), w)
				}
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
		{[]string{"stop", "now"}, "usage: weir stop [--detach]"},
		{[]string{"decap"}, "usage: weir decap --interface IFACE"},
		{[]string{"decap", "--interface", "lo", "--mode", "fast"}, `attach mode "fast"`},
		{[]string{"decap", "--interface", "lo", "--addr", "not-an-ip"}, "not-an-ip"},
		{[]string{"explain", "-s", "/nonexistent/weir.sock", "web", "10.0.0.1:1"}, "is weir running?"},
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

// TestDecap attaches weir decap to a namespace's loopback, stops it as SIGTERM
// would, and checks that it reported its counters and detached.
func TestDecap(t *testing.T) {
	ns, err := netns.New(topo.UniqueName("wdc"))
	xdptest.Check(t, err)
	t.Cleanup(func() { ns.Close() })
	var stdout, stderr bytes.Buffer
	err = ns.Do(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		return run(ctx, []string{"decap", "--interface", "lo", "--mode", "generic", "--addr", "192.0.2.1", "--interval", "100ms"}, &stdout, &stderr)
	})
	xdptest.Check(t, err)
	for _, want := range []string{"attached to lo (generic) for tunnel packets to 192.0.2.1", "decapsulated 0 packets", "at exit:", "detached from lo"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout: got\n%s\nwant a line containing %q", stdout.String(), want)
		}
	}
}
