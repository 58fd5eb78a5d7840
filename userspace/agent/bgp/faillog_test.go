package bgp

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// lineLog is a slog handler that keeps every line, for tests that count them.
type lineLog struct {
	mu    sync.Mutex
	lines []slog.Record
}

func (h *lineLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *lineLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *lineLog) WithGroup(string) slog.Handler            { return h }

func (h *lineLog) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lines = append(h.lines, r.Clone())
	return nil
}

// of is the lines whose message begins with prefix.
func (h *lineLog) of(prefix string) []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []slog.Record
	for _, r := range h.lines {
		if strings.HasPrefix(r.Message, prefix) {
			out = append(out, r)
		}
	}
	return out
}

// attr is the value of r's attribute key, as text ("" if r has none).
func attr(r slog.Record, key string) string {
	var v string
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value.String()
			return false
		}
		return true
	})
	return v
}

// TestFailureLog: a day of retries every 5 s refused with one error logs a line
// a minute, each saying how many it left out; another error is logged at once;
// the recovery once, at info, with the count of every failure.
func TestFailureLog(t *testing.T) {
	h := &lineLog{}
	log := slog.New(h)
	var f failureLog
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	now := start
	refused := errors.New("announce 10.80.100.1/32: refused")
	const day = 17280 // retries of one day, every 5 s
	for range day {
		f.failed(log, now, refused, retryMax)
		now = now.Add(retryMax)
	}
	lines := h.of("bgp: apply routes")
	if len(lines) != 1440 {
		t.Fatalf("a day of one refusal every 5s: got %d lines; want 1440, one a minute", len(lines))
	}
	if lines[0].Level != slog.LevelError || attr(lines[0], "repeats_suppressed") != "" {
		t.Errorf("first line: got %s %q %q; want error level and nothing suppressed yet", lines[0].Level, lines[0].Message, attr(lines[0], "repeats_suppressed"))
	}
	for _, r := range lines[1:] {
		if r.Level != slog.LevelError || r.Message != "bgp: apply routes: still failing" || attr(r, "repeats_suppressed") != "11" {
			t.Fatalf("repeat line: got %s %q, %s suppressed; want error, still failing, 11 suppressed", r.Level, r.Message, attr(r, "repeats_suppressed"))
		}
	}

	f.failed(log, now, errors.New("announce 10.80.100.1/32: other"), retryMax)
	lines = h.of("bgp: apply routes")
	if last := lines[len(lines)-1]; len(lines) != 1441 || attr(last, "err") != "announce 10.80.100.1/32: other" || attr(last, "attempts") != "17281" {
		t.Errorf("a new error: got %d lines, the last %q %v; want it logged at once, attempt 17281", len(lines), last.Message, attr(last, "err"))
	}
	f.failed(log, now.Add(time.Second), errors.New("announce 10.80.100.1/32: other"), retryMax)
	now = now.Add(2 * time.Second)
	f.ok(log, now)
	f.ok(log, now.Add(time.Second))
	rec := h.of("bgp: route changes applied again")
	if len(rec) != 1 || rec[0].Level != slog.LevelInfo || attr(rec[0], "failed_attempts") != "17282" || attr(rec[0], "repeats_suppressed") != "1" ||
		attr(rec[0], "failing_for") != now.Sub(start).String() {
		t.Fatalf("recovery: got %d lines, %+v; want one at info: 17282 failed attempts over %s, 1 suppressed", len(rec), rec, now.Sub(start))
	}
	if n := len(h.of("bgp: apply routes")); n != 1441 {
		t.Errorf("%d failure lines in all; want 1441: the repeat after the new error left out", n)
	}
}

// loggedSpeaker is a flakySpeaker whose lines are kept.
func loggedSpeaker(t *testing.T) (*Speaker, *lineLog, *flakyRIB) {
	h := &lineLog{}
	s, _, flaky := flakySpeaker(t, h)
	return s, h, flaky
}

// TestSpeakerRetryLogs: a route change GoBGP keeps refusing is logged once while
// it is retried, again at once when the error changes, and its recovery at info.
func TestSpeakerRetryLogs(t *testing.T) {
	s, h, flaky := loggedSpeaker(t)
	flaky.failing.Store(true)
	v4, other := netip.MustParsePrefix("10.80.100.1/32"), netip.MustParsePrefix("10.80.100.2/32")

	s.Announce([]Route{{Prefix: v4, Services: []string{"web"}}}, nil)
	// Five refusals: 100, 200, 400 and 800 ms apart, all well within a minute.
	if !waitfor.Cond(20*time.Second, func() bool { return flaky.calls.Load() >= 5 }) {
		t.Fatalf("%d refused calls; want 5", flaky.calls.Load())
	}
	if lines := h.of("bgp: apply routes"); len(lines) != 1 || lines[0].Level != slog.LevelError {
		t.Fatalf("after %d refusals of one change: got %d failure lines; want 1 at error level", flaky.calls.Load(), len(lines))
	}

	s.Announce([]Route{{Prefix: v4, Services: []string{"web"}}, {Prefix: other, Services: []string{"api"}}}, nil)
	if !waitfor.Cond(10*time.Second, func() bool { return len(h.of("bgp: apply routes")) >= 2 }) {
		t.Fatal("a new error: not logged; want it logged at once")
	}
	if lines := h.of("bgp: apply routes"); len(lines) != 2 || !strings.Contains(attr(lines[1], "err"), other.String()) {
		t.Errorf("a new error: got %d failure lines (last %q); want 2, the last naming %s", len(lines), attr(lines[len(lines)-1], "err"), other)
	}

	flaky.failing.Store(false)
	if !waitfor.Cond(10*time.Second, func() bool { return len(h.of("bgp: route changes applied again")) == 1 }) {
		t.Fatal("recovery: not logged; want it logged once")
	}
	if r := h.of("bgp: route changes applied again")[0]; r.Level != slog.LevelInfo {
		t.Errorf("recovery: logged at %s; want info", r.Level)
	}
	if lines := h.of("bgp: apply routes"); len(lines) != 2 {
		t.Errorf("after the recovery: %d failure lines; want 2", len(lines))
	}
}

// TestSpeakerRetryLogsWithdrawals: withdrawals GoBGP keeps refusing, several at
// once, are one error however the announced routes are held, and are logged once
// while they are retried, not again each time the error lists them in another
// order.
func TestSpeakerRetryLogsWithdrawals(t *testing.T) {
	s, h, flaky := loggedSpeaker(t)
	var routes []Route
	for _, p := range []string{"10.80.100.1/32", "10.80.100.2/32", "10.80.100.3/32"} {
		routes = append(routes, Route{Prefix: netip.MustParsePrefix(p), Services: []string{"web"}})
	}
	s.Announce(routes, nil)
	if !waitfor.Cond(10*time.Second, func() bool { return len(h.of("bgp announce")) == len(routes) }) {
		t.Fatalf("announced %d of %d routes", len(h.of("bgp announce")), len(routes))
	}

	flaky.failing.Store(true)
	s.Announce(nil, nil)
	// Six attempts of three refused withdrawals, 100 to 1600 ms apart.
	if !waitfor.Cond(20*time.Second, func() bool { return flaky.calls.Load() >= 6*int32(len(routes)) }) {
		t.Fatalf("%d refused calls; want %d", flaky.calls.Load(), 6*len(routes))
	}
	if lines := h.of("bgp: apply routes"); len(lines) != 1 {
		for _, r := range lines {
			t.Logf("%s %s", r.Message, attr(r, "err"))
		}
		t.Fatalf("after %d refused withdrawals of the same routes: got %d failure lines; want 1", flaky.calls.Load(), len(lines))
	}
}
