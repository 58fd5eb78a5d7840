package config

import (
	"errors"
	"os"
	"strings"
	"testing"
	"unicode/utf16"
)

// FuzzParse: whatever the file holds, Parse returns a config or errors, never
// both, never neither, and never panics (nor turns a panic into an error); every error wraps ErrInvalid, says
// something, and names a line inside the file (or none), in file order.
// `go test -fuzz FuzzParse ./userspace/config/` explores further; go test runs the
// seeds.
func FuzzParse(f *testing.F) {
	for _, path := range []string{"../../examples/weir.yaml", "testdata/bad.yaml"} {
		data, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	for _, s := range []string{
		"",
		"services: []\n",
		"services:\n  - name: a\n    vip: 192.0.2.1:80\n    backends: [{address: 10.0.0.1:80}]\n",
		"services:\n  - &s {name: a, vip: '192.0.2.1:80', backends: [&b {address: '10.0.0.1:80'}, *b]}\n  - *s\n",
		"services: {a: 1}\n",
		"services:\n  - name: a\n    vip: [1, 2]\n    health: {type: http, path: 3}\n",
		"services:\n- name: a\n  vip: 192.0.2.1:80\n  backends:\n   - address: 10.0.0.1:80\n  weight: 2\n",
		"a: &a [x]\nb: [*a, *a]\nservices: *a\n",
		"services: !!binary AAAA\n",
		"%YAML 1.1\n---\nservices: []\n...\n---\nservices: []\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := Parse(data)
		if (cfg == nil) == (err == nil) {
			t.Fatalf("got config %v and error %v; want exactly one", cfg != nil, err)
		}
		if err == nil {
			return
		}
		if !errors.Is(err, ErrInvalid) {
			t.Fatalf("error %v does not wrap ErrInvalid", err)
		}
		var es Errors
		if !errors.As(err, &es) || len(es) == 0 {
			t.Fatalf("error %v: want Errors, at least one", err)
		}
		lines := yamlLines(data)
		for i, e := range es {
			if e.Msg == "" {
				t.Errorf("error %d (%+v) says nothing", i, e)
			}
			if strings.HasPrefix(e.Msg, parserBug) {
				t.Errorf("the parser panicked: %v", e)
			}
			if e.Line < 0 || e.Line > lines {
				t.Errorf("error %d (%v) at line %d; the file has %d", i, e, e.Line, lines)
			}
			if i > 0 && e.Line < es[i-1].Line {
				t.Errorf("errors out of file order: line %d after %d", e.Line, es[i-1].Line)
			}
		}
	})
}

// yamlLines is how many lines YAML sees in data: its breaks are LF, CRLF, a lone
// CR, NEL, LS and PS, in UTF-8, or in UTF-16 after a byte order mark.
func yamlLines(data []byte) int {
	text := string(data)
	if len(data) >= 2 && (data[0] == 0xfe && data[1] == 0xff || data[0] == 0xff && data[1] == 0xfe) {
		units := make([]uint16, (len(data)-2)/2)
		for i := range units {
			hi, lo := data[2+2*i], data[3+2*i]
			if data[0] == 0xff {
				hi, lo = lo, hi
			}
			units[i] = uint16(hi)<<8 | uint16(lo)
		}
		text = string(utf16.Decode(units))
	}
	n := 1
	for i, r := range text {
		switch r {
		case '\n', '\u0085', '\u2028', '\u2029':
			n++
		case '\r':
			if !strings.HasPrefix(text[i+1:], "\n") {
				n++
			}
		}
	}
	return n
}
