package health

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"
)

func TestConfigDefaults(t *testing.T) {
	got, err := Config{}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	c, o := got.Check, got.Outlier
	checks := []struct {
		name      string
		got, want any
	}{
		{"kind", c.Kind, TCP},
		{"interval", c.Interval, 2 * time.Second},
		{"timeout", c.Timeout, time.Second},
		{"rise", c.Rise, 2},
		{"fall", c.Fall, 3},
		{"jitter: off", c.Jitter, 0.0},
		{"initial", c.Initial, Unknown},
		{"http path", c.HTTP.Path, "/"},
		{"http status", c.HTTP.Status[0], StatusRange{200, 399}},
		{"consecutive: passive off", o.Consecutive, 0},
		{"base ejection", o.BaseEjection, 30 * time.Second},
		{"max ejection", o.MaxEjection, 300 * time.Second},
		{"max ejection percent", o.MaxEjectionPercent, 10},
		{"panic threshold: off", got.PanicThreshold, 0},
	}
	for _, ch := range checks {
		if ch.got != ch.want {
			t.Errorf("%s: got %v; want %v", ch.name, ch.got, ch.want)
		}
	}
	short, _ := Config{Check: Check{Interval: 300 * time.Millisecond}}.withDefaults()
	if short.Check.Timeout != 300*time.Millisecond {
		t.Errorf("short interval: got timeout %v; want 300ms", short.Check.Timeout)
	}
	// The settings whose zero value means off keep what they are given.
	set, err := Config{Check: Check{Jitter: DefaultJitter}, Outlier: Outlier{Consecutive: DefaultConsecutive},
		PanicThreshold: DefaultPanicThreshold}.withDefaults()
	if err != nil || set.Check.Jitter != 0.1 || set.Outlier.Consecutive != 5 || set.PanicThreshold != 50 {
		t.Errorf("explicit settings: got jitter %g, consecutive %d, panic threshold %d, %v; want 0.1, 5, 50",
			set.Check.Jitter, set.Outlier.Consecutive, set.PanicThreshold, err)
	}
}

func TestConfigErrorsNameTheField(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"kind", Config{Check: Check{Kind: "icmp"}}, `check.kind: must be tcp, http or none, got "icmp"`},
		{"method", Config{Check: Check{Method: 7}}, `check.method: must be connect or syn, got Method(7)`},
		{"method syn for http", Config{Check: Check{Kind: HTTP, Method: MethodSyn}}, `check.method: syn applies to tcp checks only, got kind http`},
		{"interval", Config{Check: Check{Interval: -time.Second}}, "check.interval: must be positive, got -1s"},
		{"rise", Config{Check: Check{Rise: -1}}, "check.rise: must be at least 1, got -1"},
		{"jitter", Config{Check: Check{Jitter: 0.9}}, "check.jitter: must be 0..0.5, got 0.9"},
		{"negative jitter", Config{Check: Check{Jitter: -1}}, "check.jitter: must be 0..0.5, got -1"},
		{"consecutive", Config{Outlier: Outlier{Consecutive: -1}}, "outlier.consecutive: must be at least 0 (0: off), got -1"},
		{"initial", Config{Check: Check{Initial: Ejected}}, "check.initial: must be up, down or unknown, got ejected"},
		{"source zone", Config{Check: Check{Source: netip.MustParseAddr("fe80::1%eth0")}}, "check.source: must be an address without zone"},
		{"path", Config{Check: Check{HTTP: HTTPCheck{Path: "healthz"}}}, `check.http.path: must start with /, got "healthz"`},
		{"header injection", Config{Check: Check{HTTP: HTTPCheck{Host: "a\r\nX: y"}}}, "check.http: path and host must not contain"},
		{"status", Config{Check: Check{HTTP: HTTPCheck{Status: []StatusRange{{200, 299}, {500, 400}}}}}, "check.http.status[1]: must be a range within 100..599, got 500-400"},
		{"max ejection", Config{Outlier: Outlier{BaseEjection: time.Minute, MaxEjection: time.Second}}, "outlier.max_ejection: must be at least base_ejection (1m0s), got 1s"},
		{"percent", Config{Outlier: Outlier{MaxEjectionPercent: 101}}, "outlier.max_ejection_percent: must be 0..100, got 101"},
		{"panic", Config{PanicThreshold: 150}, "panic_threshold: must be 0..100 (0: off), got 150"},
		{"negative panic", Config{PanicThreshold: -1}, "panic_threshold: must be 0..100 (0: off), got -1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c Checker
			err := c.SetService("web", tt.cfg)
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("got %v; want an error wrapping ErrInvalidConfig", err)
			}
			if !strings.HasPrefix(err.Error(), `set service "web": `) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("got %q; want set service \"web\": ...%s...", err, tt.want)
			}
		})
	}
}

func TestSetBackendErrors(t *testing.T) {
	var c Checker
	if err := c.SetService("web", Config{}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		b    Backend
		want error
	}{
		{"unknown service", Backend{ID: "10.0.0.5:80", Service: "api"}, ErrUnknownService},
		{"no id", Backend{Service: "web"}, ErrInvalidBackend},
		{"no port", Backend{ID: "10.0.0.5", Service: "web"}, ErrInvalidBackend},
	}
	for _, tt := range tests {
		if err := c.Set(tt.b); !errors.Is(err, tt.want) {
			t.Errorf("%s: got %v; want an error wrapping %v", tt.name, err, tt.want)
		}
	}
}
