package metrics

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weir-lb/weir/userspace/agent/api"
)

// TestDocumented: every metric the agent exports is in the metrics list of
// docs/operating.md with its labels, every metric a docs table names (a table
// whose header is "| metric | labels |") is exported with the labels it names,
// and every other the docs name is exported, so an operator's alert written
// from the docs matches a series.
func TestDocumented(t *testing.T) {
	m := New(func() (api.Status, error) { return api.Status{}, nil })
	exported := map[string][]string{}
	ch := make(chan *prometheus.Desc)
	go func() { // exits once every collector has described itself
		for _, c := range m.collectors() {
			c.Describe(ch)
		}
		close(ch)
	}()
	desc := regexp.MustCompile(`^Desc\{fqName: "([^"]+)", .*variableLabels: \{([^}]*)\}\}$`)
	for d := range ch {
		sm := desc.FindStringSubmatch(d.String())
		if sm == nil {
			t.Fatalf("cannot read the name and labels of %s", d)
		}
		exported[sm[1]] = labelList(sm[2])
	}
	if len(exported) == 0 {
		t.Fatal("no metric described")
	}

	files, err := filepath.Glob("../../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{} // in operating.md's list
	for _, f := range append([]string{"../../../README.md"}, files...) {
		for _, row := range metricRows(t, f) {
			for _, name := range row.names {
				if filepath.Base(f) == "operating.md" {
					listed[name] = true
				}
				labels, ok := exported[name]
				if !ok {
					t.Errorf("%s:%d: %s is not exported", filepath.Base(f), row.line, name)
					continue
				}
				if !slices.Equal(labels, row.labels) {
					t.Errorf("%s:%d: %s's labels: got %q in the docs; want %q", filepath.Base(f), row.line, name, row.labels, labels)
				}
			}
		}
	}
	if len(listed) == 0 {
		t.Fatal("found no metrics list in operating.md")
	}
	// And every metric the prose names, a histogram's series too.
	for _, f := range append([]string{"../../../README.md"}, files...) {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range regexp.MustCompile(`\bweir_[a-z0-9_]*[a-z0-9]`).FindAllString(string(data), -1) {
			_, ok := exported[name]
			for _, series := range []string{"_bucket", "_sum", "_count"} {
				_, histogram := exported[strings.TrimSuffix(name, series)]
				ok = ok || histogram
			}
			if !ok {
				t.Errorf("%s names %s, which is not exported", filepath.Base(f), name)
			}
		}
	}
	for name := range exported {
		if !listed[name] {
			t.Errorf("%s is exported but not in operating.md's metrics list", name)
		}
	}
}

// metricRow is one row of a docs table of metrics: the metrics it names, which
// share its labels.
type metricRow struct {
	line   int
	names  []string
	labels []string
}

// metricRows reads the rows of every table in the markdown file whose header
// is "| metric | labels | ...".
func metricRows(t *testing.T, path string) []metricRow {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rows []metricRow
	name := regexp.MustCompile("`(weir_[a-z0-9_]+)`")
	in := false
	for i, l := range strings.Split(string(data), "\n") {
		cells := strings.Split(l, "|")
		switch {
		case len(cells) >= 4 && strings.TrimSpace(cells[1]) == "metric" && strings.TrimSpace(cells[2]) == "labels":
			in = true
		case !in || strings.HasPrefix(l, "|---"):
		case !strings.HasPrefix(l, "|") || len(cells) < 4:
			in = false
		default:
			r := metricRow{line: i + 1, labels: labelList(cells[2])}
			for _, sm := range name.FindAllStringSubmatch(cells[1], -1) {
				r.names = append(r.names, sm[1])
			}
			if len(r.names) == 0 {
				t.Errorf("%s:%d: a row of a metrics table names no metric: %s", filepath.Base(path), i+1, l)
			}
			rows = append(rows, r)
		}
	}
	return rows
}

// labelList reads "service, result (ok, fail)" as [result service]: label names,
// comma-separated, each perhaps followed by its values in brackets; sorted.
func labelList(s string) []string {
	s = regexp.MustCompile(`\([^)]*\)`).ReplaceAllString(s, "")
	var labels []string
	for _, l := range strings.Split(s, ",") {
		if l = strings.TrimSpace(l); l != "" {
			labels = append(labels, l)
		}
	}
	slices.Sort(labels)
	return labels
}
