package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestDocumentedFlags: every `weir COMMAND ... --flag` in README.md, docs/ and
// weir's own usage names a command and a flag that `weir COMMAND -h` lists, and
// every flag a command has is in docs/operating.md's CLI table and in the usage,
// so an operator can type what the docs show and find what the commands take.
func TestDocumentedFlags(t *testing.T) {
	help := map[string]string{} // a command's -h
	flags := func(cmd string) string {
		if h, ok := help[cmd]; ok {
			return h
		}
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), append(strings.Fields(cmd), "-h"), &stdout, &stderr)
		if !errors.Is(err, flag.ErrHelp) {
			stdout.Reset() // not a command
		}
		help[cmd] = stdout.String()
		return help[cmd]
	}
	files, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	sources := map[string]string{"weir's usage": usage}
	for _, f := range append([]string{"../../README.md"}, files...) {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		sources[filepath.Base(f)] = string(data)
	}
	n := 0
	for src, text := range sources {
		for _, c := range commandLines(text, src == "weir's usage") {
			if c.cmd == "demo hold" || c.cmd == "CMD" || c.cmd == "COMMAND" {
				continue // the kept demo's backends' process, which is no operator's; a placeholder
			}
			for _, cmd := range strings.Split(c.cmd, "|") { // weir drain|undrain
				h := flags(cmd)
				if h == "" {
					t.Errorf("%s:%d: weir %s is no command", src, c.line, cmd)
					continue
				}
				for _, f := range c.flags {
					n++
					if !hasFlag(h, f) {
						t.Errorf("%s:%d: weir %s has no flag %s; weir %s -h:\n%s", src, c.line, cmd, f, cmd, h)
					}
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("found no documented flags")
	}

	// Every command's own flags, in operating.md's CLI table row of the command
	// and in the usage. -c/--config and -s are described once, below both.
	table := map[string][]string{}
	for _, c := range commandLines(sources["operating.md"], false) {
		if c.tableRow {
			table[c.cmd] = append(table[c.cmd], c.flags...)
		}
	}
	inUsage := map[string][]string{}
	for _, c := range commandLines(usage, true) {
		inUsage[c.cmd] = append(inUsage[c.cmd], c.flags...)
	}
	for cmd, h := range help {
		for _, sm := range regexp.MustCompile(`(?m)^  -([a-z-]+)`).FindAllStringSubmatch(h, -1) {
			f := "--" + sm[1]
			if f == "--c" || f == "--config" || f == "--s" {
				continue
			}
			if !slices.Contains(table[cmd], f) {
				t.Errorf("operating.md's CLI table: weir %s lacks %s", cmd, f)
			}
			if !slices.Contains(inUsage[cmd], f) {
				t.Errorf("weir's usage: weir %s lacks %s", cmd, f)
			}
		}
	}
}

// commandLine is a weir command line shown in the docs: the command ("node
// drain") and the flags it is given, as --name.
type commandLine struct {
	line     int
	cmd      string
	flags    []string
	tableRow bool // the first cell of a table row
}

// commandLines finds every command line in markdown text (code spans and code
// block lines that begin with "weir COMMAND", perhaps after a prompt "$ ",
// sudo, environment variables or a directory: `./weir demo`,
// `WEIR_DEMO_NAME=abc weir demo`), or in weir's usage its lines that do.
func commandLines(text string, usage bool) []commandLine {
	span := regexp.MustCompile("`([^`]*)`")
	lead := regexp.MustCompile(`^(?:\$ |sudo |[A-Z][A-Z0-9_]*=\S* )*(?:\./|bin/)?`)
	var out []commandLine
	fenced := false
	for i, l := range strings.Split(text, "\n") {
		t := strings.TrimSpace(l)
		if strings.HasPrefix(t, "```") {
			fenced = !fenced
			continue
		}
		var shown []string
		if fenced || usage {
			t, _, _ = strings.Cut(t, " #") // a comment
			t, _, _ = strings.Cut(t, "  ") // the usage's explanation
			if t = lead.ReplaceAllString(t, ""); strings.HasPrefix(t, "weir ") {
				shown = append(shown, t)
			}
		} else {
			for _, sm := range span.FindAllStringSubmatch(l, -1) {
				if s := lead.ReplaceAllString(sm[1], ""); strings.HasPrefix(s, "weir ") {
					shown = append(shown, s)
				}
			}
		}
		for j, s := range shown {
			c := commandLine{line: i + 1, tableRow: j == 0 && strings.HasPrefix(l, "| `weir ")}
			words := strings.Fields(s)[1:]
			for k, w := range words {
				if w == "&&" || w == "|" || w == ";" || w == "weir" {
					break
				}
				switch {
				case k == 0:
					c.cmd = w
				case k == 1 && (c.cmd == "node" || c.cmd == "demo") && !strings.HasPrefix(w, "-") && !strings.HasPrefix(w, "["):
					c.cmd += " " + w
				}
				if f := regexp.MustCompile(`^\[?(--?[a-z][a-z-]*)`).FindStringSubmatch(w); f != nil {
					c.flags = append(c.flags, "--"+strings.TrimLeft(f[1], "-"))
				}
			}
			out = append(out, c)
		}
	}
	return out
}

// hasFlag says whether a command's -h lists the flag (--name).
func hasFlag(help, f string) bool {
	return regexp.MustCompile(`(?m)^  -` + regexp.QuoteMeta(strings.TrimLeft(f, "-")) + `\b`).MatchString(help)
}
