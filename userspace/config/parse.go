package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// ErrInvalid is wrapped by every error Parse and Load return for a file that is
// readable but wrong; test with errors.Is.
var ErrInvalid = errors.New("invalid config")

// FieldError is one problem, at one place in the file.
type FieldError struct {
	File string // "" for Parse
	Line int    // 0 when unknown
	Path string // services[1].backends[3].weight; "" for the whole file
	Msg  string
	Err  error // what Msg says, when it came from elsewhere (a certificate's load, the XDP program's slots); nil otherwise
}

// Unwrap is the error the message came from, so errors.Is sees through the
// file and line (loader.ErrCapacity, fs.ErrNotExist).
func (e *FieldError) Unwrap() error { return e.Err }

func (e *FieldError) Error() string {
	var b strings.Builder
	switch {
	case e.File != "" && e.Line > 0:
		fmt.Fprintf(&b, "%s:%d: ", e.File, e.Line)
	case e.File != "":
		b.WriteString(e.File + ": ")
	case e.Line > 0:
		fmt.Fprintf(&b, "line %d: ", e.Line)
	}
	if e.Path != "" {
		b.WriteString(e.Path + ": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Errors is every problem found in a file, in file order. It wraps ErrInvalid.
type Errors []*FieldError

func (es Errors) Error() string {
	lines := make([]string, len(es))
	for i, e := range es {
		lines[i] = e.Error()
	}
	return strings.Join(lines, "\n")
}

// Is makes errors.Is(err, ErrInvalid) true.
func (es Errors) Is(target error) bool { return target == ErrInvalid }

// Load reads and parses the file at path. A file that cannot be read is returned
// as the os error (wrapped); a file that can be read but is wrong as Errors naming
// the file.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	return ParseFile(data, path)
}

// LoadXDP reads the file at path as Load does, but parses and validates only
// its interfaces and xdp sections, for `weir stop --detach` with no agent
// running: removing the pinned program takes nothing else, and a file the
// program was loaded from may fail a newer release's validation elsewhere
// (or have been edited since). Errors in those two sections are reported as
// Load reports them. Of the Config only Interfaces and XDP are the file's;
// the rest holds defaults and no services.
func LoadXDP(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	return parseFile(data, path, xdpSections)
}

// xdpSections are the top-level keys the XDP program's load-time settings
// come from.
var xdpSections = []string{"interfaces", "xdp"}

// ParseFile parses data as the contents of the file at path, as Load does once
// it has read them: errors name path, and a relative path in the file (an
// http.tls certificate or key) is taken from path's directory, as nginx and
// HAProxy take theirs from a base directory, so the file means the same
// whatever the working directory of whoever reads it: `weir validate`, `weir
// plan` and the agent's reloads alike.
func ParseFile(data []byte, path string) (*Config, error) {
	return parseFile(data, path, nil)
}

// parseFile is ParseFile of only the top-level keys in sections (nil: all).
func parseFile(data []byte, path string, sections []string) (*Config, error) {
	dir, err := filepath.Abs(filepath.Dir(path))
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	cfg, err := parseIn(data, dir, sections)
	var es Errors
	if errors.As(err, &es) {
		for _, e := range es {
			e.File = path
		}
	}
	return cfg, err
}

// AdminSocket reads only admin.socket from the file at path, for a client
// that must reach the agent although the file fails validation elsewhere (it
// was edited since the agent loaded it): the default when the file names
// none. An error when the file cannot be read, is not YAML, or names no
// absolute path.
func AdminSocket(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read config: %w", err)
	}
	var f struct {
		Admin struct {
			Socket string `yaml:"socket"`
		} `yaml:"admin"`
	}
	if err := yaml.Unmarshal(data, &f); err != nil {
		return "", fmt.Errorf("%s: admin.socket: %w", path, err)
	}
	switch s := f.Admin.Socket; {
	case s == "":
		return DefaultAdminSocket, nil
	case !strings.HasPrefix(s, "/"):
		return "", fmt.Errorf("%s: admin.socket: must be an absolute path, got %q", path, s)
	default:
		return s, nil
	}
}

// Parse parses one file's contents, fills in defaults, validates them and resolves
// them into the model. With no file to take them from, relative paths in it are
// taken from the working directory (ParseFile: from the file's).
func Parse(data []byte) (*Config, error) {
	return parseIn(data, "", nil)
}

// parseIn parses data, taking relative paths from dir ("": the working
// directory), and only its top-level keys in sections (nil: all).
func parseIn(data []byte, dir string, sections []string) (cfg *Config, err error) {
	// A panic here would take the agent down with it on a reload, and a file is
	// refused rather than that: the running config stays in force.
	defer func() {
		if r := recover(); r != nil {
			cfg, err = nil, Errors{{Msg: fmt.Sprintf("%s: %v", parserBug, r)}}
		}
	}()
	return parse(data, dir, sections)
}

// parserBug begins the error of a file the parser failed on (a panic): a bug in
// weir, not in the file.
const parserBug = "weir's config parser failed on this file (a bug in weir; please report it)"

func parse(data []byte, dir string, sections []string) (*Config, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil && err != io.EOF {
		return nil, Errors{syntaxError(data, err)}
	}
	if doc.Kind == 0 || len(doc.Content) == 0 || len(bytes.TrimSpace(data)) == 0 || isNull(doc.Content[0]) {
		return nil, Errors{{Msg: "the file is empty: a config needs at least a services list"}}
	}
	// One document: what follows a "---" would otherwise be ignored, unread.
	// Empty ones after it are let be.
	for {
		var more yaml.Node
		err := dec.Decode(&more)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, Errors{syntaxError(data, err)}
		}
		if len(more.Content) > 0 && !isNull(more.Content[0]) {
			return nil, Errors{{Line: more.Content[0].Line, Msg: "a second YAML document: a config is one document (no \"---\" after its start)"}}
		}
	}
	root := doc.Content[0]
	if sections != nil {
		root = only(root, sections)
	}
	p := &parser{lines: make(map[string]int), atLine: make(map[int]string), values: make(map[int][]valueAt), fractional: make(map[*yaml.Node]bool)}
	p.index(root, "", false)
	p.checkFields(root, reflect.TypeFor[file](), "", false)

	var cfg file
	if err := root.Decode(&cfg); err != nil {
		var te *yaml.TypeError
		if !errors.As(err, &te) {
			return nil, append(p.errs, &FieldError{Msg: err.Error()})
		}
		for _, msg := range te.Errors {
			p.typeError(msg)
		}
	}
	p.errs = uniqueErrors(p.errs) // a value reached through several aliases is reported once per alias
	decodeErrs := len(p.errs)
	cfg.defaults()
	for _, e := range cfg.validate(dir) {
		// A field that did not decode is already reported; its zero value would only
		// add noise.
		if !p.reported(e.Path, decodeErrs) {
			e.Line = p.lineOf(e.Path)
			p.errs = append(p.errs, e)
		}
	}
	if len(p.errs) > 0 {
		sort.SliceStable(p.errs, func(i, j int) bool { return p.errs[i].Line < p.errs[j].Line })
		return nil, p.errs
	}
	resolved := cfg.resolve()
	resolved.lines = p.lines
	return resolved, nil
}

// only is the mapping root without the config's other sections: they are not
// read, so they cannot fail. A key that is no section of a config (a misspelled
// one) is kept, to be refused as Load would: left out, a misspelled xdp would
// pass for none. A merge key ("<<: *base") is followed: what it merges in is cut
// the same way, so its sections are read as Load reads them and its others are
// not. A root that is not a mapping is returned whole, to be refused as it would
// be anyway. The file's nodes are copied where cut, never changed.
func only(root *yaml.Node, sections []string) *yaml.Node {
	c := &cutter{sections: sections, fields: yamlFields(reflect.TypeFor[file]()), cut: map[*yaml.Node]*yaml.Node{}}
	return c.mapping(root)
}

// cutter cuts mappings to sections. Each mapping is cut once (cut), however many
// merges name it, so aliases of aliases cost no more than the file's own nodes;
// a mapping that merges itself, which yaml's decoder refuses, is left as it is
// rather than followed forever (cut to nil while it is being cut).
type cutter struct {
	sections []string
	fields   map[string]reflect.StructField
	cut      map[*yaml.Node]*yaml.Node
}

func (c *cutter) mapping(n *yaml.Node) *yaml.Node {
	if n.Kind != yaml.MappingNode {
		return n
	}
	if part, ok := c.cut[n]; ok {
		if part == nil {
			return n
		}
		return part
	}
	c.cut[n] = nil
	part := *n
	part.Content = nil
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		switch _, section := c.fields[k.Value]; {
		case isMerge(k):
			v = c.merged(v)
		case section && !slices.Contains(c.sections, k.Value):
			continue
		}
		part.Content = append(part.Content, k, v)
	}
	c.cut[n] = &part
	return &part
}

// merged cuts what a merge key's value merges in (see mergedMappings): a
// mapping, an alias of one, or a list of them. An alias stays an alias (of the
// cut mapping), so yaml's decoder counts it against its bound on aliasing as it
// does for Load.
func (c *cutter) merged(v *yaml.Node) *yaml.Node {
	switch {
	case v.Kind == yaml.AliasNode && v.Alias != nil:
		alias := *v
		alias.Alias = c.merged(v.Alias)
		return &alias
	case v.Kind != yaml.SequenceNode:
		return c.mapping(v)
	}
	list := *v
	list.Content = make([]*yaml.Node, len(v.Content))
	for i, m := range v.Content {
		list.Content[i] = c.merged(m)
	}
	return &list
}

// uniqueErrors drops repeats of an error, keeping the first of each.
func uniqueErrors(es Errors) Errors {
	seen := make(map[FieldError]bool, len(es))
	return slices.DeleteFunc(es, func(e *FieldError) bool {
		if seen[*e] {
			return true
		}
		seen[*e] = true
		return false
	})
}

var lineRE = regexp.MustCompile(`^(?:yaml: )?line (\d+): (.*)$`)

func syntaxError(data []byte, err error) *FieldError {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	e := &FieldError{Msg: "invalid YAML: " + msg}
	if m := lineRE.FindStringSubmatch(msg); m != nil {
		e.Line, _ = strconv.Atoi(m[1])
		e.Msg = "invalid YAML: " + m[2]
	}
	// yaml names the line where the enclosing block began, not the line that broke
	// it (a mis-indented key 17 lines into a service is reported at the service):
	// the first line whose prefix of the file no longer parses is the wrong one.
	if l := firstBadLine(data); l > 0 && (e.Line == 0 || l > e.Line) {
		e.Line = l
	}
	return e
}

// firstBadLine is the first line n such that lines 1..n do not parse, 0 if none.
// Each try parses a prefix of the file, so trying every prefix costs time
// quadratic in the file's length: 25 s for a file of 4,900 lines, spent on the
// agent's loop when it reloads. Files longer than linearScanMax lines are bisected
// instead (a prefix that parses below, one that does not above): a few dozen
// parses. Both find the same line unless a flow collection or quoted string
// spanning lines comes before the error (a prefix that ends inside one does not
// parse either); the scan then names that line, the bisection that line or the
// error's. Files over bisectMax lines are not searched (yaml's own line stands):
// each of a bisection's parses would take tens of milliseconds there.
func firstBadLine(data []byte) int {
	if bytes.HasPrefix(data, []byte{0xfe, 0xff}) || bytes.HasPrefix(data, []byte{0xff, 0xfe}) {
		return 0 // UTF-16: its lines are not split at a byte '\n' (yaml's own line stands)
	}
	lines := bytes.SplitAfter(data, []byte("\n"))
	if len(lines) > bisectMax {
		return 0
	}
	parses := func(n int) bool {
		var v yaml.Node
		return yaml.Unmarshal(bytes.Join(lines[:n], nil), &v) == nil
	}
	if len(lines) <= linearScanMax {
		for n := 1; n <= len(lines); n++ {
			if !parses(n) {
				return n
			}
		}
		return 0
	}
	if parses(len(lines)) {
		return 0
	}
	good, bad := 0, len(lines) // lines 1..good parse, 1..bad do not
	for bad-good > 1 {
		mid := good + (bad-good)/2
		if parses(mid) {
			good = mid
		} else {
			bad = mid
		}
	}
	return bad
}

// linearScanMax is the longest file firstBadLine tries prefix by prefix, and
// bisectMax the longest it bisects (about 15 parses of up to 20,000 lines: under a
// second).
const (
	linearScanMax = 300
	bisectMax     = 20_000
)

// parser maps between places in the YAML tree (paths) and lines, and collects errors.
type parser struct {
	lines  map[string]int    // path -> line of its key or item
	atLine map[int]string    // line -> the path of what starts there (common prefix if several), aliases aside
	values map[int][]valueAt // line -> the values on it, by path (through aliases too)
	failed []string          // paths whose values did not decode: errors about them, or about what holds them, would only add noise
	// fractional: the fractions found in integer fields, each reported once
	fractional map[*yaml.Node]bool
	errs       Errors

	aliased int          // nodes visited through aliases, against maxAliasedNodes
	open    []*yaml.Node // the anchored nodes being walked through an alias, outermost first
}

// maxAliasedNodes bounds the nodes index and checkFields visit through aliases. A
// file's own nodes are visited once each, but an alias of a list of aliases of
// lists of ... expands a few lines into billions of nodes ("billion laughs"), which
// a walk that follows aliases would take minutes and gigabytes over. Past the bound
// the walks stop following aliases: an error under one is reported at the alias, and
// yaml's decoder refuses the file for its excessive aliasing. A config's own anchors
// (a health block or backend defaults shared by every service) stay far below it.
const maxAliasedNodes = 200_000

// follow resolves an alias, and counts the visit of a node reached through one.
// ok false: n is not to be walked, as the bound is reached or the alias names a
// node it is inside of (an anchor whose value holds an alias of itself: yaml parses
// it, its decoder refuses it, and a walk would go round forever, its path growing).
// Once the walk of n is done, the caller calls leave if it is set.
func (p *parser) follow(n *yaml.Node, viaAlias bool) (_ *yaml.Node, _ bool, leave func(), ok bool) {
	if n.Kind == yaml.AliasNode && n.Alias != nil {
		if slices.Contains(p.open, n.Alias) {
			return n, viaAlias, nil, false
		}
		p.open = append(p.open, n.Alias)
		leave = p.leaveAlias
		n, viaAlias = n.Alias, true
	}
	if viaAlias {
		if p.aliased >= maxAliasedNodes {
			if leave != nil {
				leave()
			}
			return n, viaAlias, nil, false
		}
		p.aliased++
	}
	return n, viaAlias, leave, true
}

func (p *parser) leaveAlias() { p.open = p.open[:len(p.open)-1] }

// index records the line of every path under n; viaAlias: n was reached through an
// alias.
func (p *parser) index(n *yaml.Node, path string, viaAlias bool) {
	n, viaAlias, leave, ok := p.follow(n, viaAlias)
	if !ok {
		return
	}
	if leave != nil {
		defer leave()
	}
	if path != "" {
		p.values[n.Line] = append(p.values[n.Line], valueAt{path: path, tag: n.ShortTag(), value: n.Value, viaAlias: viaAlias})
	}
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if isMerge(k) {
				continue // below, so that the mapping's own keys claim their lines first
			}
			sub := join(path, k.Value)
			p.mark(sub, k.Line, viaAlias)
			p.index(v, sub, viaAlias)
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			if isMerge(n.Content[i]) {
				for _, m := range mergedMappings(n.Content[i+1]) {
					p.index(m, path, viaAlias)
				}
			}
		}
	case yaml.SequenceNode:
		for i, item := range n.Content {
			sub := fmt.Sprintf("%s[%d]", path, i)
			p.mark(sub, item.Line, viaAlias)
			p.index(item, sub, viaAlias)
		}
	}
}

// valueAt is a value node of the file: where it goes, and what yaml's decoder
// names it by in a type error.
type valueAt struct {
	path, tag, value string
	viaAlias         bool
}

// mark records that path starts at line. A line reached through an alias keeps the
// path of its anchor's own place: an anchor's line is under every path that uses
// it, and their common prefix (often just "services") names none of them.
func (p *parser) mark(path string, line int, viaAlias bool) {
	if _, ok := p.lines[path]; !ok {
		p.lines[path] = line
	}
	if viaAlias {
		return
	}
	if prev, ok := p.atLine[line]; ok {
		p.atLine[line] = commonPath(prev, path)
	} else {
		p.atLine[line] = path
	}
}

// isMerge reports whether k is YAML's merge key ("<<: *defaults").
func isMerge(k *yaml.Node) bool { return k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" }

// mergedMappings is what a merge key's value merges in: a mapping (or an alias of
// one) or a list of them.
func mergedMappings(v *yaml.Node) []*yaml.Node {
	if v.Kind == yaml.SequenceNode {
		return v.Content
	}
	return []*yaml.Node{v}
}

// onWhenNamed is a section that its key alone turns on, with the defaults of
// the fields it leaves out: yaml's decoder leaves a key written with no value
// nil, as if it were not there, and checkFields gives it an empty mapping.
type onWhenNamed interface{ onWhenNamed() }

// unaliased is the node n is an alias of, or n.
func unaliased(n *yaml.Node) *yaml.Node {
	if n.Kind == yaml.AliasNode && n.Alias != nil {
		return n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" }

// lineOf returns the line of path, or of its nearest ancestor the file has.
func (p *parser) lineOf(path string) int { return lineIn(p.lines, path) }

// lineIn returns the line of path in lines, or of its nearest ancestor there; 0
// for none.
func lineIn(lines map[string]int, path string) int {
	for path != "" {
		if l, ok := lines[path]; ok {
			return l
		}
		path = parent(path)
	}
	return 0
}

// reported reports whether one of the first n errors is about path or a parent of
// it, or path holds a value that did not decode (its zero stands in for it).
func (p *parser) reported(path string, n int) bool {
	under := func(path, parent string) bool {
		return path == parent || strings.HasPrefix(path, parent+".") || strings.HasPrefix(path, parent+"[")
	}
	for _, e := range p.errs[:n] {
		if under(path, e.Path) {
			return true
		}
	}
	for _, f := range p.failed {
		if under(f, path) {
			return true
		}
	}
	return false
}

var unmarshalRE = regexp.MustCompile("^cannot unmarshal !!(\\w+)(?: `(.*)`)? into (\\S+)$")

// typeError turns one of yaml's "line N: cannot unmarshal ..." messages into a
// FieldError at the path of the value it names: the value on that line with the
// message's tag and (for a scalar) text, or, failing that, what starts on the line.
func (p *parser) typeError(msg string) {
	e := &FieldError{Msg: msg}
	if m := lineRE.FindStringSubmatch(msg); m != nil {
		e.Line, _ = strconv.Atoi(m[1])
		e.Msg = m[2]
		e.Path = p.atLine[e.Line]
	}
	if m := unmarshalRE.FindStringSubmatch(e.Msg); m != nil {
		if path, ok := p.valuePath(e.Line, "!!"+m[1], m[2]); ok {
			e.Path = path
		}
		got := yamlKindWords(m[1])
		if m[1] != "seq" && m[1] != "map" {
			got += fmt.Sprintf(" %q", m[2])
		}
		e.Msg = fmt.Sprintf("must be %s, got %s", goTypeWords(m[3]), got)
	}
	p.errs = append(p.errs, e)
}

// valuePath finds the value a type error names: on line, tagged tag, and for a
// scalar reading text (which yaml cuts to its first 7 characters and "..." past
// 10). Every path holding it counts as failed (an anchor's value fails for each of
// its aliases); the one returned is the anchor's own, or the common prefix if the
// line has several such values.
func (p *parser) valuePath(line int, tag, text string) (string, bool) {
	matches := func(v valueAt) bool {
		switch {
		case v.tag != tag:
			return false
		case tag == "!!seq" || tag == "!!map":
			return true
		case len(text) == 10 && strings.HasSuffix(text, "...") && len(v.value) > 10:
			return strings.HasPrefix(v.value, text[:7])
		}
		return v.value == text
	}
	path, found := "", false
	for _, v := range p.values[line] {
		if !matches(v) {
			continue
		}
		p.failed = append(p.failed, v.path)
		switch {
		case v.viaAlias:
		case !found:
			path, found = v.path, true
		default:
			path = commonPath(path, v.path)
		}
	}
	return path, found
}

func goTypeWords(t string) string {
	switch {
	case strings.HasPrefix(t, "[]"):
		return "a list"
	case strings.HasPrefix(t, "map["), strings.HasPrefix(t, "config.file"):
		return "a mapping"
	case strings.HasPrefix(t, "config."): // the typed names: Protocol, Mode, ...
		return "a string"
	case t == "string":
		return "a string"
	case t == "bool":
		return "true or false"
	case strings.HasPrefix(t, "uint"):
		return "a whole number ≥ 0"
	case strings.HasPrefix(t, "int"):
		return "a whole number"
	case strings.HasPrefix(t, "float"):
		return "a number"
	}
	return "a " + t
}

func yamlKindWords(k string) string {
	switch k {
	case "str":
		return "the string"
	case "seq":
		return "a list"
	case "map":
		return "a mapping"
	case "int", "float":
		return "the number"
	case "bool":
		return "the boolean"
	}
	return k
}

// checkFields reports every mapping key that names no field of t, so a misspelt
// setting is an error rather than silently its default. (yaml's KnownFields stops at
// the first; this names them all, with the fields that would fit.)
func (p *parser) checkFields(n *yaml.Node, t reflect.Type, path string, viaAlias bool) {
	n, viaAlias, leave, ok := p.follow(n, viaAlias)
	if !ok {
		return
	}
	if leave != nil {
		defer leave()
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if reflect.PointerTo(t).Implements(reflect.TypeFor[yaml.Unmarshaler]()) {
		return // it reads its own node (a duration), and says what is wrong with it
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			return // a type error, reported by Decode
		}
		p.dropDuplicateKeys(n, path)
		fields := yamlFields(t)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if isMerge(k) {
				for _, m := range mergedMappings(v) {
					p.checkFields(m, t, path, viaAlias)
				}
				continue
			}
			sub := join(path, k.Value)
			f, ok := fields[k.Value]
			if !ok {
				p.errs = append(p.errs, &FieldError{Line: k.Line, Path: sub, Msg: unknownField(k.Value, fields)})
				continue
			}
			if isNull(unaliased(v)) && f.Type.Implements(reflect.TypeFor[onWhenNamed]()) {
				// Named with no value ("client:", or an alias of a null): on,
				// as {} is.
				n.Content[i+1] = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map", Line: v.Line, Column: v.Column}
				continue
			}
			p.checkFields(v, f.Type, sub, viaAlias)
		}
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			return
		}
		for i := range n.Content {
			sub := fmt.Sprintf("%s[%d]", path, i)
			p.keepItem(n, i, t.Elem(), sub)
			p.checkFields(n.Content[i], t.Elem(), sub, viaAlias)
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		// yaml's decoder cuts 2.5 to 2 for an integer field, silently.
		if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!float" {
			// Once per value, at the first path to it: an anchor's own.
			if !p.fractional[n] {
				p.errs = append(p.errs, &FieldError{Line: n.Line, Path: path, Msg: fmt.Sprintf("must be a whole number, got %s", n.Value)})
			}
			p.fractional[n] = true
			p.failed = append(p.failed, path)
		}
	}
}

// dropDuplicateKeys reports every key the mapping n repeats, at the repeat, and
// removes the repeat with its value. yaml's decoder refuses such a mapping
// whole, and a list then drops the item that holds it: every later item moved up
// one place, and its errors named the wrong item and line, or were lost.
func (p *parser) dropDuplicateKeys(n *yaml.Node, path string) {
	type key struct {
		kind  yaml.Kind
		value string
	}
	first := make(map[key]int) // key -> its line
	kept := n.Content[:0:0]
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := n.Content[i]
		if line, dup := first[key{k.Kind, k.Value}]; dup {
			p.errs = append(p.errs, &FieldError{Line: k.Line, Path: join(path, k.Value),
				Msg: fmt.Sprintf("already set at line %d; a key appears once in a mapping", line)})
			continue
		}
		first[key{k.Kind, k.Value}] = k.Line
		kept = append(kept, k, n.Content[i+1])
	}
	if len(kept) < len(n.Content) {
		n.Content = kept
	}
}

// keepItem makes item i of the list seq one yaml's decoder keeps in its place, as
// a value of type t: the decoder drops an item it cannot decode (a string where a
// mapping belongs, an empty item), which would move every later one up a place.
// A wrong item is reported here and decoded as t's zero value; an empty one
// decodes as an empty mapping or string, whose missing fields validation names.
func (p *parser) keepItem(seq *yaml.Node, i int, t reflect.Type, path string) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	item := seq.Content[i]
	n := item
	if n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	var want yaml.Kind
	switch {
	case reflect.PointerTo(t).Implements(reflect.TypeFor[yaml.Unmarshaler]()):
		return // it reads its own node
	case t.Kind() == reflect.Struct:
		want = yaml.MappingNode
	case t.Kind() == reflect.String:
		want = yaml.ScalarNode
	default:
		return
	}
	empty := &yaml.Node{Kind: want, Tag: "!!map", Line: item.Line, Column: item.Column}
	if want == yaml.ScalarNode {
		empty.Tag = "!!str"
	}
	switch {
	case n.Kind == want && !isNull(n):
		return
	case isNull(n):
		seq.Content[i] = empty
		return
	}
	got := yamlKindWords(strings.TrimPrefix(n.ShortTag(), "!!"))
	if n.Kind == yaml.ScalarNode {
		v := n.Value
		if len(v) > 40 {
			v = v[:37] + "..."
		}
		got += fmt.Sprintf(" %q", v)
	}
	p.errs = append(p.errs, &FieldError{Line: item.Line, Path: path, Msg: fmt.Sprintf("must be %s, got %s", goTypeWords(t.String()), got)})
	p.failed = append(p.failed, path)
	seq.Content[i] = empty
}

func yamlFields(t reflect.Type) map[string]reflect.StructField {
	out := make(map[string]reflect.StructField)
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "-" || !f.IsExported() {
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		out[name] = f
	}
	return out
}

func unknownField(name string, fields map[string]reflect.StructField) string {
	names := make([]string, 0, len(fields))
	best, bestD := "", 3
	for n := range fields {
		names = append(names, n)
		if d := distance(name, n); d < bestD {
			best, bestD = n, d
		}
	}
	if best != "" {
		return fmt.Sprintf("unknown field; did you mean %q?", best)
	}
	sort.Strings(names)
	return "unknown field; known fields here: " + strings.Join(names, ", ")
}

// distance is the Levenshtein distance of a and b.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// parent strips the last element of a path: a.b[2].c -> a.b[2] -> a.b -> a -> "".
func parent(path string) string {
	i := strings.LastIndexAny(path, ".[")
	if i < 0 {
		return ""
	}
	return path[:i]
}

func commonPath(a, b string) string {
	for a != b {
		if len(a) > len(b) {
			a = parent(a)
		} else {
			b = parent(b)
		}
	}
	return a
}
