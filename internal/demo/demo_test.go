package demo

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/loader"
)

// TestDemoDSR is the end-to-end test of the XDP data plane in dsr mode: real
// namespaces, veth, a bridge, the real program attached natively or generically,
// real HTTP over new TCP connections and real UDP.
func TestDemoDSR(t *testing.T) {
	for _, mode := range []loader.Mode{loader.ModeNative, loader.ModeGeneric} {
		t.Run(string(mode), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			var out bytes.Buffer
			rep, err := Run(ctx, Options{Mode: mode, Out: &out})
			t.Log("\n" + out.String())
			if err != nil {
				xdptest.Check(t, err)
			}
			if rep.Mode != mode {
				t.Fatalf("attached in %s mode; want %s", rep.Mode, mode)
			}
			if len(rep.Rounds) != 5 {
				t.Fatalf("%d rounds; want 5", len(rep.Rounds))
			}
			for _, r := range rep.Rounds {
				if len(r.Failures) > 0 {
					t.Errorf("%s: %d of %d failed, first: %v", r.Title, len(r.Failures), r.Sent, r.Failures[0])
				}
				for _, b := range rep.Backends {
					// Every packet the backend saw from the client came through the
					// program: a TCP request takes at least 3 packets (SYN, ACK+data,
					// FIN), a UDP query exactly 1.
					got, answered := r.XDP[b].Packets, uint64(r.Answers[b])
					if got < answered || got > 12*answered {
						t.Errorf("%s: %s answered %d, program sent it %d packets; want between 1 and 12 per answer", r.Title, b, answered, got)
					}
				}
			}
			// Fair share over three equal backends, dsr and nat: each within ±30 % of a third.
			for _, r := range []Round{rep.Rounds[0], rep.Rounds[3]} {
				for _, b := range rep.Backends {
					share := float64(r.Answers[b]) / float64(r.Sent)
					if share < 0.7/3 || share > 1.3/3 {
						t.Errorf("%s: %s answered %.1f%% of new connections; want %.1f%%..%.1f%%", r.Title, b, 100*share, 70.0/3, 130.0/3)
					}
				}
			}
			last := rep.Rounds[4]
			if n := last.Answers[rep.Backends[0]]; n != 0 {
				t.Errorf("unusable %s answered %d new connections; want 0", rep.Backends[0], n)
			}
			if last.XDP[rep.Backends[0]].Packets != 0 {
				t.Errorf("the program sent %d packets to the unusable backend; want 0", last.XDP[rep.Backends[0]].Packets)
			}
			if left, _ := netns.List(NamePrefix); len(left) != 0 {
				t.Errorf("namespaces left behind: %v", left)
			}
		})
	}
}
