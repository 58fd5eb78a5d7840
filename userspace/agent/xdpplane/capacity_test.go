package xdpplane

import (
	"testing"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/balance"
	"github.com/weir-lb/weir/userspace/config"
)

// TestCapacityAgrees: config refuses a file past the XDP program's capacities
// with its own copy of them (it imports nothing of the project), which must be
// the program's.
func TestCapacityAgrees(t *testing.T) {
	c, err := loader.ReadCapacity()
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range []struct {
		name      string
		got, want int
	}{
		{"config.MaxXDPServices", config.MaxXDPServices, int(c.Services)},
		{"config.MaxXDPBackends", config.MaxXDPBackends, int(c.Backends)},
		{"config.MaxInterfaces", config.MaxInterfaces, int(c.Interfaces)},
	} {
		if x.got != x.want {
			t.Errorf("%s: got %d; want the program's %d", x.name, x.got, x.want)
		}
	}
	// Every count a service may have, and past the ladder's last step.
	for n := range 41944 + 2 {
		if got, want := config.DefaultTableSize(n), balance.MaglevSize(n); got != want {
			t.Fatalf("config.DefaultTableSize(%d): got %d; want the program's %d", n, got, want)
		}
	}
	// Every service's key and one address-only key per VIP address, at most one
	// per service: the services map never fills before the service slots.
	if int(c.ServiceKeys) < 2*config.MaxXDPServices {
		t.Errorf("services map: got %d entries; want at least %d (a key and an address key per service)", c.ServiceKeys, 2*config.MaxXDPServices)
	}
}
