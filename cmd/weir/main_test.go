package main

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
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
