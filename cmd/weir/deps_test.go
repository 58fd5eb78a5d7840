package main

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/weir-lb/weir"

// testOnly says why the package at path must not link into the weir binary, or ""
// if it may: package testing and its kin, and the project's test helpers.
// internal/topo itself may (the demo builds its topology with topo.New); it
// declares the TB its test helpers need instead of importing testing.
func testOnly(path string) string {
	switch {
	case path == "testing", strings.HasPrefix(path, "testing/"), path == "net/http/httptest":
		return "a standard library package for tests"
	case path == module+"/internal/xdptest", strings.HasPrefix(path, module+"/internal/xdptest/"):
		return "the test face of the skip-or-fail rule; non-test code uses internal/xdpenv"
	case strings.HasPrefix(path, module+"/internal/topo/"):
		return "a package under internal/topo"
	case strings.HasPrefix(path, module+"/") && strings.HasSuffix(path, "test"):
		return "a test helper package of the project"
	}
	return ""
}

// TestBinaryLinksNoTestCode: the shipped binary links no test-only code (DESIGN.md:
// test-only code never links into the shipped binary). It asks go list for every
// package ./cmd/weir depends on; go test puts its own GOROOT/bin first on PATH, so
// "go" is the toolchain running this test.
func TestBinaryLinksNoTestCode(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("find the go command: %v", err)
	}
	out, err := exec.Command(gobin, "list", "-deps", "-f", `{{.ImportPath}} {{join .Imports " "}}`, ".").Output()
	if err != nil {
		if ee, ok := errors.AsType[*exec.ExitError](err); ok {
			t.Fatalf("go list -deps .: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list -deps .: %v", err)
	}
	// One line per package, dependencies first: its path, then its imports.
	var deps []string
	importers := make(map[string][]string)
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		deps = append(deps, f[0])
		for _, imp := range f[1:] {
			importers[imp] = append(importers[imp], f[0])
		}
	}
	if len(deps) == 0 || deps[len(deps)-1] != module+"/cmd/weir" {
		t.Fatalf("go list -deps .: got %q; want a list ending with %s/cmd/weir", deps, module)
	}
	for _, p := range deps {
		if why := testOnly(p); why != "" {
			t.Errorf("./cmd/weir links %s (%s), imported by %s; want it absent", p, why, strings.Join(importers[p], ", "))
		}
	}
}
