package loader

import (
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/weir-lb/weir/internal/netns"
	"github.com/weir-lb/weir/internal/topo"
	"github.com/weir-lb/weir/internal/xdptest"
)

// TestAttachModes attaches to real interfaces in a namespace: a veth in each mode,
// and a bridge, which has no native XDP, so native must fail with a clear error,
// leave nothing attached, and auto must fall back to generic.
func TestAttachModes(t *testing.T) {
	ns, err := netns.New(topo.UniqueName("wat"))
	xdptest.Check(t, err)
	t.Cleanup(func() { ns.Close() })
	err = ns.Do(func() error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "wa0"}, PeerName: "wa1"}); err != nil {
			return err
		}
		if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "wabr"}}); err != nil {
			return err
		}
		for _, name := range []string{"wa0", "wa1", "wabr"} {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
		}
		return nil
	})
	xdptest.Check(t, err)

	for _, tc := range []struct {
		ifname   string
		mode     Mode
		wantMode Mode
		wantErr  string
	}{
		{"wa0", ModeNative, ModeNative, ""},
		{"wa0", ModeGeneric, ModeGeneric, ""},
		{"wa0", ModeAuto, ModeNative, ""},
		{"wabr", ModeAuto, ModeGeneric, ""},
		{"wabr", ModeNative, "", "use generic or auto"},
		{"nosuch0", ModeAuto, "", "check the interface name"},
	} {
		t.Run(tc.ifname+"/"+string(tc.mode), func(t *testing.T) {
			p := loadT(t)
			var got Mode
			err := ns.Do(func() error {
				var err error
				got, err = p.Attach(tc.ifname, tc.mode)
				return err
			})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.Contains(err.Error(), tc.ifname) {
					t.Fatalf("got %v; want an error naming %s and saying %q", err, tc.ifname, tc.wantErr)
				}
				if n := len(p.Attachments()); n != 0 {
					t.Errorf("%d attachments after a failed attach; want 0", n)
				}
				return
			}
			xdptest.Check(t, err)
			if got != tc.wantMode {
				t.Errorf("got mode %s; want %s", got, tc.wantMode)
			}
			if err := ns.Do(func() error { return p.Detach(tc.ifname) }); err != nil {
				t.Error(err)
			}
			if err := p.Detach(tc.ifname); err == nil {
				t.Errorf("second detach: %v; want an error", err)
			}
		})
	}
}
