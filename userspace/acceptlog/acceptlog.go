// Package acceptlog logs the accept errors a listener waits out (no file
// descriptor or memory left) without a line per wait: the first error of an
// episode, then at most one line per Interval with the errors counted since
// the last line, and one line when accepts succeed again. The proxy and the
// http plane log their listeners' errors with it.
package acceptlog

import (
	"log/slog"
	"time"
)

// Interval is the least time between two lines about one listener's errors.
const Interval = 10 * time.Second

// Log is one listener's. Its zero value is ready; it is used by one goroutine
// at a time (the one that accepts).
type Log struct {
	start   time.Time // of the episode; zero: accepts succeed
	line    time.Time // of the last line
	unsaid  uint64    // errors since the last line
	episode uint64    // errors since the episode began
}

// Failed counts an accept error; the listener tries again after retryIn. It
// logs the first of an episode, and then one line per Interval at most.
func (l *Log) Failed(log *slog.Logger, now time.Time, err error, retryIn time.Duration) {
	l.unsaid++
	l.episode++
	if l.start.IsZero() {
		l.start = now
	} else if now.Sub(l.line) < Interval {
		return
	}
	log.Warn("accept", "err", err, "errors", l.unsaid, "retry_in", retryIn)
	l.line, l.unsaid = now, 0
}

// OK notes that the listener accepts again (or found nothing to accept): the
// first after an episode logs its end. Otherwise it costs a comparison.
func (l *Log) OK(log *slog.Logger, now func() time.Time) {
	if l.start.IsZero() {
		return
	}
	log.Info("accepting again", "errors", l.episode, "after", now().Sub(l.start).Round(time.Millisecond))
	*l = Log{}
}
