package health

import (
	"errors"
	"fmt"
	"time"
)

// Sentinel errors; compare with errors.Is.
var (
	ErrInvalidConfig  = errors.New("invalid config")
	ErrUnknownService = errors.New("unknown service")
	ErrInvalidBackend = errors.New("invalid backend")
	// ErrTimeout is wrapped by checks that ran out of time.
	ErrTimeout = errors.New("timeout")
	// ErrStatus is wrapped by HTTP checks answered with an unexpected status.
	ErrStatus = errors.New("unexpected http status")
	// ErrBody is wrapped by HTTP checks whose body lacks HTTPCheck.Body.
	ErrBody = errors.New("http body mismatch")
)

// State is a backend's health.
type State uint8

const (
	// Unknown: no verdict yet. Not usable unless the service panics.
	Unknown State = iota
	// Up: usable.
	Up
	// Down: the active checks failed Fall times in a row (or the initial state).
	Down
	// Ejected: the active checks agree it is up (or are off), but the data
	// planes reported Outlier.Consecutive failures in a row; it returns when the
	// ejection ends. Only the effective State of a Status or Change is ever
	// Ejected, never its Active verdict.
	Ejected
)

func (s State) String() string {
	switch s {
	case Unknown:
		return "unknown"
	case Up:
		return "up"
	case Down:
		return "down"
	case Ejected:
		return "ejected"
	}
	return fmt.Sprintf("State(%d)", uint8(s))
}

// MarshalText makes states read as words in JSON and logs.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Outcome is what a data plane saw of one connection to a backend.
type Outcome uint8

const (
	// Success: the connection was established (and, where the data plane can
	// tell, served). It resets the run of consecutive failures.
	Success Outcome = iota
	// ConnectFailure: the connect was refused or unreachable.
	ConnectFailure
	// Reset: the backend reset an established connection.
	Reset
	// Timeout: the connect or the first response took too long.
	Timeout
	// ServerError: the backend answered a request with a 5xx status (the http
	// data plane).
	ServerError
)

func (o Outcome) String() string {
	switch o {
	case Success:
		return "success"
	case ConnectFailure:
		return "connect failure"
	case Reset:
		return "reset"
	case Timeout:
		return "timeout"
	case ServerError:
		return "5xx"
	}
	return fmt.Sprintf("Outcome(%d)", uint8(o))
}

// Backend is one target to check.
type Backend struct {
	// ID names the backend; unique within a Checker. An agent that has one
	// address in two services names them apart, e.g. "web/10.0.0.5:80".
	ID string
	// Service is the name given to Checker.SetService.
	Service string
	// Addr is the "host:port" checks connect to: for NAT backends the service
	// address, for DSR and tunnel backends the backend's real address (never
	// the VIP). "" means ID.
	Addr string
	// Initial, if set, is this backend's state when it is first added, instead of
	// its service's check.initial (for a backend known to be down, or one added
	// to a running service that must not take traffic before its first checks).
	Initial *State
}

// Result is the outcome of one active check.
type Result struct {
	ID, Service, Addr string
	// Method is how the check was made: MethodSyn, or MethodConnect for
	// connect and HTTP checks.
	Method Method
	// Scheduled is when the check was due, Start when it began; the
	// difference is the scheduling lag.
	Scheduled, Start time.Time
	Duration         time.Duration
	// Err is nil for a passed check.
	Err error
}

// Lag is how late the check started.
func (r Result) Lag() time.Duration { return r.Start.Sub(r.Scheduled) }

// Status is everything known about one backend at one time.
type Status struct {
	ID, Service, Addr string
	// State is the effective state: Down if the active checks say so, else
	// Ejected if ejected, else the active verdict.
	State State
	// Active is the verdict of the active checks alone (Up when they are off).
	Active State
	// Usable is what the data planes should do with new flows: State is Up,
	// or the service is in panic.
	Usable bool
	// Panic reports that the service is below its panic threshold.
	Panic bool
	// Since is when State last changed; Reason says why.
	Since  time.Time
	Reason string
	// Passes and Fails count the current run of passed or failed checks.
	Passes, Fails int
	// Passed: an active check has passed since the backend was added, though
	// a failure may have ended that run since; a change of what the check
	// asks or where (as one that restarts Passes) forgets it.
	Passed bool
	// EjectedUntil is when the current ejection ends (zero if not ejected).
	// Ejections is the multiplier of the current or last ejection's length
	// (BaseEjection times it); it decays while the backend stays in service.
	EjectedUntil time.Time
	Ejections    int
	// Last is the most recent completed active check (zero before the first).
	Last Result
}

// Change is published when a backend is added, when its effective State or
// Usable changes, when its service enters or leaves panic mode, and once per
// backend when a subscription starts (From == To, Reason "current").
type Change struct {
	ID, Service string
	From, To    State
	Usable      bool
	Panic       bool
	Reason      string
	Time        time.Time
}

func (c Change) String() string {
	return fmt.Sprintf("%s %s: %v -> %v (usable %t): %s", c.Service, c.ID, c.From, c.To, c.Usable, c.Reason)
}
