package acceptlog

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestLog: an episode of accept errors, one every second for 25 s, logs
// its first error, then a line every 10 s with the count since the last
// one, and its end once; the next episode starts again with a line.
func TestLog(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}}))
	var l Log
	t0 := time.Unix(1000, 0)
	emfile := errors.New("accept4: " + syscall.EMFILE.Error())
	at := func(s int) func() time.Time {
		return func() time.Time { return t0.Add(time.Duration(s) * time.Second) }
	}
	log = log.With("service", "web")
	l.OK(log, at(0))
	for i := range 26 {
		l.Failed(log, at(i)(), emfile, time.Second)
	}
	l.OK(log, at(26))
	l.OK(log, at(27))
	l.Failed(log, at(28)(), emfile, 5*time.Millisecond)
	want := []string{
		`level=WARN msg=accept service=web err="accept4: too many open files" errors=1 retry_in=1s`,
		`level=WARN msg=accept service=web err="accept4: too many open files" errors=10 retry_in=1s`,
		`level=WARN msg=accept service=web err="accept4: too many open files" errors=10 retry_in=1s`,
		`level=INFO msg="accepting again" service=web errors=26 after=26s`,
		`level=WARN msg=accept service=web err="accept4: too many open files" errors=1 retry_in=5ms`,
	}
	if got := strings.Split(strings.TrimSpace(buf.String()), "\n"); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("got lines\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
