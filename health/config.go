package health

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"
)

// Defaults. The active-check ones follow HAProxy's (inter 2s, rise 2, fall 3);
// the passive ones follow Envoy's outlier detection (consecutive 5, base
// ejection 30s, max ejection 300s, max ejection 10 %, healthy panic threshold
// 50 %). Most are applied to zero-valued settings; DefaultJitter,
// DefaultConsecutive and DefaultPanicThreshold are not, since the zero value of
// those settings turns the feature off: a caller that wants them passes them.
const (
	DefaultInterval           = 2 * time.Second
	DefaultTimeout            = time.Second
	DefaultRise               = 2
	DefaultFall               = 3
	DefaultJitter             = 0.1
	DefaultPath               = "/"
	DefaultConsecutive        = 5
	DefaultBaseEjection       = 30 * time.Second
	DefaultMaxEjection        = 300 * time.Second
	DefaultMaxEjectionPercent = 10
	DefaultPanicThreshold     = 50
	// DefaultMaxBody is how much of an HTTP response body is searched for
	// HTTPCheck.Body; a health endpoint that hides its marker deeper is misconfigured.
	DefaultMaxBody = 64 << 10
	// DefaultMaxHeader bounds an HTTP check response's status line and header:
	// a backend that sends more fails the check.
	DefaultMaxHeader = 64 << 10
)

// Kind is the type of active check.
type Kind string

// The kinds of active check. The zero Kind is TCP.
const (
	TCP  Kind = "tcp"
	HTTP Kind = "http"
	// None turns active checks off: the backend is up unless passively ejected.
	None Kind = "none"
)

// Method is how a TCP check tests a backend.
type Method uint8

// The methods of a TCP check. HTTP checks always connect.
const (
	// MethodConnect opens a full TCP connection and closes it. The zero value.
	MethodConnect Method = iota
	// MethodSyn sends a crafted SYN from one raw socket the Checker shares
	// among all checks and takes a SYN-ACK for up and an RST or a timeout for
	// down; the checker's kernel resets the half-open connection. No socket,
	// file descriptor or goroutine per check, and the backend's application
	// never sees the check: like a connect, it tests the kernel's listening
	// socket. It needs CAP_NET_RAW; a Checker that cannot open its raw
	// sockets checks by connect instead (see Checker.Method).
	MethodSyn
)

func (m Method) String() string {
	switch m {
	case MethodConnect:
		return "connect"
	case MethodSyn:
		return "syn"
	}
	return fmt.Sprintf("Method(%d)", uint8(m))
}

// MarshalText makes methods read as words in JSON and logs.
func (m Method) MarshalText() ([]byte, error) { return []byte(m.String()), nil }

// Config is what a service says about the health of its backends.
type Config struct {
	Check   Check
	Outlier Outlier
	// PanicThreshold is a percentage: when fewer than this share of the
	// service's backends are up and not ejected, every backend of the service is
	// reported usable, as Envoy's healthy_panic_threshold does, because sending
	// traffic to possibly-bad backends beats overloading the few good ones or
	// dropping everything. 0 turns panic mode off, so a service whose
	// backends are all down has none usable. 0..100; DefaultPanicThreshold is
	// Envoy's choice.
	PanicThreshold int
}

// Check configures the active checks of a service's backends.
type Check struct {
	Kind Kind
	// Method is how TCP checks are made; HTTP checks connect, and reject
	// MethodSyn.
	Method Method
	// Interval between the starts of two checks of one backend. 0 means DefaultInterval.
	Interval time.Duration
	// Timeout bounds one whole check (connect, and for HTTP the response).
	// 0 means DefaultTimeout, or Interval if that is shorter.
	Timeout time.Duration
	// Rise is how many consecutive passed checks bring a down backend up, Fall
	// how many consecutive failed checks take an up backend down. 0 means
	// DefaultRise and DefaultFall.
	Rise, Fall int
	// Jitter spreads each interval uniformly over Interval*(1±Jitter) so that
	// thousands of checks that once fired together (after a stall, say) drift
	// apart again. 0 means no jitter. 0..0.5; DefaultJitter is a sensible choice.
	Jitter float64
	// Initial is the state of a newly added backend: Up (needs Fall failures to
	// go down), Down (needs Rise successes to go up) or Unknown (the zero value:
	// the first check decides, either way).
	Initial State
	// Source is the local address checks are sent from, for hosts with several;
	// the zero Addr lets the kernel choose. Ignored when Checker.Dial is set.
	Source netip.Addr
	HTTP   HTTPCheck
}

// HTTPCheck configures HTTP checks. The checker keeps one connection per
// backend open and sends each check as a request on it, so a check costs a
// request, not a handshake; a connection that fails (or that the server
// closed while idle) is replaced by a new one within the same check.
type HTTPCheck struct {
	// Path is the request target. "" means DefaultPath.
	Path string
	// Host is the Host header. "" means the host part of the check address.
	Host string
	// Status lists the accepted status codes. Empty means 200–399.
	Status []StatusRange
	// Body, when not empty, must occur in the first DefaultMaxBody bytes of
	// the response body.
	Body string
}

// StatusRange is an inclusive range of HTTP status codes.
type StatusRange struct{ Min, Max int }

// Outlier configures passive ejection from the outcomes the data planes report.
type Outlier struct {
	// Consecutive failures (connect failure, reset, timeout) eject a backend.
	// 0 turns passive ejection off (Observe then ignores every outcome of the
	// service). DefaultConsecutive is Envoy's choice.
	Consecutive int
	// BaseEjection is how long the first ejection lasts; the n-th repeated
	// ejection lasts n times as long, up to MaxEjection. 0 means the defaults.
	BaseEjection, MaxEjection time.Duration
	// MaxEjectionPercent caps the share of the service's backends ejected at
	// once, so a bad day upstream (or a bug in the reporter) cannot eject
	// everyone. At least one backend can always be ejected, as in Envoy.
	// 0 means DefaultMaxEjectionPercent.
	MaxEjectionPercent int
}

// withDefaults returns cfg with every zero setting that has a default replaced
// by it and checks that the result makes sense; errors name the field.
func (cfg Config) withDefaults() (Config, error) {
	c := &cfg.Check
	if c.Kind == "" {
		c.Kind = TCP
	}
	if c.Interval == 0 {
		c.Interval = DefaultInterval
	}
	if c.Timeout == 0 {
		c.Timeout = min(DefaultTimeout, c.Interval)
	}
	if c.Rise == 0 {
		c.Rise = DefaultRise
	}
	if c.Fall == 0 {
		c.Fall = DefaultFall
	}
	if c.HTTP.Path == "" {
		c.HTTP.Path = DefaultPath
	}
	if len(c.HTTP.Status) == 0 {
		c.HTTP.Status = []StatusRange{{200, 399}}
	}
	o := &cfg.Outlier
	if o.BaseEjection == 0 {
		o.BaseEjection = DefaultBaseEjection
	}
	if o.MaxEjection == 0 {
		o.MaxEjection = max(DefaultMaxEjection, o.BaseEjection)
	}
	if o.MaxEjectionPercent == 0 {
		o.MaxEjectionPercent = DefaultMaxEjectionPercent
	}

	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s: %w", field, fmt.Sprintf(format, args...), ErrInvalidConfig))
	}
	switch c.Kind {
	case TCP, HTTP, None:
	default:
		bad("check.kind", "must be tcp, http or none, got %q", c.Kind)
	}
	switch {
	case c.Method > MethodSyn:
		bad("check.method", "must be connect or syn, got %v", c.Method)
	case c.Method == MethodSyn && c.Kind == HTTP:
		bad("check.method", "syn applies to tcp checks only, got kind %s", c.Kind)
	}
	if c.Interval < 0 {
		bad("check.interval", "must be positive, got %v", c.Interval)
	}
	if c.Timeout < 0 {
		bad("check.timeout", "must be positive, got %v", c.Timeout)
	}
	if c.Rise < 0 {
		bad("check.rise", "must be at least 1, got %d", c.Rise)
	}
	if c.Fall < 0 {
		bad("check.fall", "must be at least 1, got %d", c.Fall)
	}
	if c.Jitter < 0 || c.Jitter > 0.5 {
		bad("check.jitter", "must be 0..0.5, got %g", c.Jitter)
	}
	switch c.Initial {
	case Unknown, Up, Down:
	default:
		bad("check.initial", "must be up, down or unknown, got %v", c.Initial)
	}
	if c.Source.IsValid() && c.Source.Zone() != "" {
		bad("check.source", "must be an address without zone, got %v", c.Source)
	}
	if !strings.HasPrefix(c.HTTP.Path, "/") {
		bad("check.http.path", "must start with /, got %q", c.HTTP.Path)
	}
	if strings.ContainsAny(c.HTTP.Path+c.HTTP.Host, " \r\n") {
		bad("check.http", "path and host must not contain spaces or line breaks")
	}
	for i, r := range c.HTTP.Status {
		if r.Min < 100 || r.Max > 599 || r.Min > r.Max {
			bad(fmt.Sprintf("check.http.status[%d]", i), "must be a range within 100..599, got %d-%d", r.Min, r.Max)
		}
	}
	if o.Consecutive < 0 {
		bad("outlier.consecutive", "must be at least 0 (0: off), got %d", o.Consecutive)
	}
	if o.BaseEjection < 0 {
		bad("outlier.base_ejection", "must be positive, got %v", o.BaseEjection)
	}
	if o.MaxEjection < o.BaseEjection {
		bad("outlier.max_ejection", "must be at least base_ejection (%v), got %v", o.BaseEjection, o.MaxEjection)
	}
	if o.MaxEjectionPercent < 0 || o.MaxEjectionPercent > 100 {
		bad("outlier.max_ejection_percent", "must be 0..100, got %d", o.MaxEjectionPercent)
	}
	if cfg.PanicThreshold < 0 || cfg.PanicThreshold > 100 {
		bad("panic_threshold", "must be 0..100 (0: off), got %d", cfg.PanicThreshold)
	}
	return cfg, errors.Join(errs...)
}

// passive reports whether passive ejection is on.
func (o Outlier) passive() bool { return o.Consecutive > 0 }

func (r StatusRange) contains(code int) bool { return r.Min <= code && code <= r.Max }
