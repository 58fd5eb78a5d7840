package agent

import (
	"testing"

	"github.com/weir-lb/weir/health"
)

func TestInitialState(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want *health.State
	}{
		{"", nil},
		{"up", ptr(health.Up)},
		{"down", ptr(health.Down)},
		{"unknown", ptr(health.Unknown)},
	} {
		got := initialState(tc.in)
		if (got == nil) != (tc.want == nil) || got != nil && *got != *tc.want {
			t.Errorf("initialState(%q): got %v; want %v", tc.in, got, tc.want)
		}
	}
}

func ptr(s health.State) *health.State { return &s }
