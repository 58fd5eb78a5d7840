package httpplane

import (
	"testing"

	"github.com/weir-lb/weir/userspace/httplb"
)

// TestMergeCounters: a service's counters are the sum over its servers (one
// that drains after a change, the one that replaced it), its client
// timeouts and accept errors among them.
func TestMergeCounters(t *testing.T) {
	dst := httplb.Snapshot{Connections: 1, Accepted: 2, Requests: 3, NoBackend: 4, AcceptErrors: 5, ClientTimeouts: 6}
	merge(&dst, httplb.Snapshot{Connections: 10, Accepted: 20, Requests: 30, NoBackend: 40, AcceptErrors: 50, ClientTimeouts: 60}, false)
	want := httplb.Snapshot{Connections: 11, Accepted: 22, Requests: 33, NoBackend: 44, AcceptErrors: 55, ClientTimeouts: 66}
	if dst.Connections != want.Connections || dst.Accepted != want.Accepted || dst.Requests != want.Requests ||
		dst.NoBackend != want.NoBackend || dst.AcceptErrors != want.AcceptErrors || dst.ClientTimeouts != want.ClientTimeouts {
		t.Errorf("got %+v; want %+v", dst, want)
	}
}
