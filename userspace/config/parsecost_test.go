package config

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
)

// TestAliasExpansionBounded: a short file whose aliases expand to millions of
// nodes, or without end, is refused without Parse walking the expansion. Before the bound, the typed
// file below (a service aliased 3,000 times, each with 3,000 aliased backends:
// 9 million nodes from 6,000 lines) took Parse seconds and gigabytes, and at
// 20,000 × 20,000 (220 KB) more than 4 GB in a minute; an agent reloading such a
// file would have been killed for its memory. The measure is the bytes Parse
// allocates, which do not depend on the machine's speed.
func TestAliasExpansionBounded(t *testing.T) {
	laughs := func(depth int) string {
		var b strings.Builder
		b.WriteString(`a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]` + "\n")
		for i := 1; i < depth; i++ {
			refs := strings.Repeat(fmt.Sprintf("*a%d, ", i-1), 8) + fmt.Sprintf("*a%d", i-1)
			fmt.Fprintf(&b, "a%d: &a%d [%s]\n", i, i, refs)
		}
		b.WriteString("services: []\n")
		return b.String()
	}
	typed := func(services, backends int) string {
		var b strings.Builder
		b.WriteString("services:\n  - &s\n    name: web\n    vip: 192.0.2.1:80\n")
		b.WriteString(`    backends: [&b {address: "10.0.0.1:80"}` + strings.Repeat(", *b", backends-1) + "]\n")
		b.WriteString(strings.Repeat("  - *s\n", services-1))
		return b.String()
	}
	for _, c := range []struct {
		name, file string
		want       string // in the error
	}{
		// Under keys weir does not know: reported as such, the aliases not expanded.
		{"billion laughs, 9^7 nodes", laughs(7), "unknown field"},
		// Under services: yaml's decoder refuses it.
		{"services × backends, 3000 × 3000", typed(3000, 3000), "excessive aliasing"},
		// An anchor whose value holds an alias of itself: a walk following aliases
		// never ended (the agent's reload would have hung, its stack growing).
		{"an anchor holding itself", "services:\n  - &a {name: web, vip: \"192.0.2.1:80\", backends: [{address: \"10.0.0.1:80\"}, *a]}\n", "unknown field"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			cfg, err := Parse([]byte(c.file))
			runtime.ReadMemStats(&after)
			if cfg != nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, %.200v; want no config and an error with %q", cfg, err, c.want)
			}
			const limit = 256 << 20
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > limit {
				t.Errorf("Parse allocated %d MB for a %d-byte file; want at most %d MB: it walked the aliases' expansion",
					alloc>>20, len(c.file), limit>>20)
			}
		})
	}
}

// TestAliasesStillIndexed: a config's own anchors (shared backend settings) still
// have their errors reported at a line.
func TestAliasesStillIndexed(t *testing.T) {
	file := `services:
  - name: web
    vip: 192.0.2.1:80
    backends:
      - &b
        address: 10.0.0.1:80
        weight: -3
      - *b
`
	_, err := Parse([]byte(file))
	var es Errors
	if !errors.As(err, &es) {
		t.Fatalf("got %v; want Errors", err)
	}
	for _, e := range es {
		if strings.Contains(e.Path, "weight") && e.Line == 7 {
			return
		}
	}
	t.Fatalf("got %v; want the weight's error at line 7", err)
}

// TestSyntaxErrorInLongFile: a syntax error at the end of a long file (4,900 lines:
// 1,600 backends) is still named at its line, and finding it does not parse every
// prefix of the file (which allocated gigabytes and took 25 s, on the agent's loop
// when it reloads). The measure is the bytes Parse allocates.
func TestSyntaxErrorInLongFile(t *testing.T) {
	var b strings.Builder
	b.WriteString("services:\n  - name: web\n    vip: 192.0.2.1:80\n    backends:\n")
	for i := range 1600 {
		fmt.Fprintf(&b, "      - address: 10.0.%d.%d:80\n        weight: 2\n        # backend %d\n", i/250, i%250+1, i)
	}
	b.WriteString("    health: {type: tcp\n  oops: [\n")
	want := strings.Count(b.String(), "\n") - 1 // the unclosed health mapping
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := Parse([]byte(b.String()))
	runtime.ReadMemStats(&after)
	var es Errors
	if !errors.As(err, &es) || len(es) != 1 || es[0].Line != want {
		t.Fatalf("got %v; want one error at line %d", err, want)
	}
	const limit = 512 << 20
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > limit {
		t.Errorf("Parse allocated %d MB; want at most %d MB: it parsed every prefix of the file", alloc>>20, limit>>20)
	}
}
