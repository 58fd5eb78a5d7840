package admin

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/weir-lb/weir/userspace/config"
)

// TestErrorLines: the API answers one line per problem, also when a refusal
// joins several (a reload changing two restart-only settings, two services
// that cannot be placed).
func TestErrorLines(t *testing.T) {
	_, cfgErr := config.Parse([]byte("log: {level: loud}\nservices: [{name: a}]\n"))
	for _, c := range []struct {
		name string
		err  error
		want []string
	}{
		{"one", errors.New("a: b"), []string{"a: b"}},
		{"config", cfgErr, []string{`line 1: log.level: must be debug, info, warn or error, got "loud"`,
			"line 2: services[0].vip: missing: write address:port ([address]:port for IPv6)",
			"line 2: services[0].backends: missing: a service needs at least one backend"}},
		{"joined", errors.Join(errors.New("xdp.hash_seed: changed"), errors.New("log.level: changed")),
			[]string{"xdp.hash_seed: changed", "log.level: changed"}},
		{"joined, nested", errors.Join(errors.New("a"), errors.Join(errors.New("b"), errors.New("c"))), []string{"a", "b", "c"}},
		{"wrapped", fmt.Errorf("reload: %w", errors.New("x")), []string{"reload: x"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := ErrorLines(c.err); !slices.Equal(got, c.want) {
				t.Errorf("got %q; want %q", got, c.want)
			}
		})
	}
}
