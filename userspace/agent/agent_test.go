package agent

import (
	"slices"
	"testing"

	"github.com/weir-lb/weir/userspace/balance"
	"github.com/weir-lb/weir/userspace/config"
)

// config spells the algorithms itself (it imports nothing of the project): the two
// lists must agree.
func TestAlgorithmsAgree(t *testing.T) {
	var got []string
	for _, a := range config.Algorithms() {
		got = append(got, string(a))
	}
	want := balance.Algorithms()
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("config.Algorithms(): got %v; want balance.Algorithms() %v", got, want)
	}
}
