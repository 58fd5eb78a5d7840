package xdpplane

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/weir-lb/weir/internal/xdptest"
	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/config"
)

// TestSelfTest runs the self-test of every mode, family and protocol against the
// real program: it must pass (the golden packets match what the program does), it
// must run in its own instance of the program (the live one's maps stay untouched),
// and nothing of the test services may stay behind in that instance.
func TestSelfTest(t *testing.T) {
	own4, own6 := netip.MustParseAddr("198.51.100.7"), netip.MustParseAddr("2001:db8:5::7")
	prog, err := loader.Load(loader.Options{HashSeed: 42, NAT: loader.NATOptions{Addr4: own4, Addr6: own6}})
	xdptest.Check(t, err)
	x := &Plane{prog: prog, addrs: []netip.Addr{own4, own6}, hashSeed: 42, links: map[int]string{}}
	t.Cleanup(func() { x.Stop(true) })
	for _, mode := range []config.Mode{config.ModeDSR, config.ModeNAT, config.ModeTunnel} {
		for _, vip := range []string{"10.1.2.3:80", "[fd00::1]:443"} {
			for _, proto := range []config.Protocol{config.TCP, config.UDP} {
				for _, hash := range []config.HashKey{config.HashFiveTuple, config.HashSource} {
					name := fmt.Sprintf("%s/%s/%s/%s", mode, proto, vip, hash)
					t.Run(name, func(t *testing.T) {
						s := &config.Service{Name: "t", Mode: mode, Protocol: proto, Hash: hash, VIP: netip.MustParseAddrPort(vip)}
						backends := []string{"10.9.9.9:80"}
						if s.VIP.Addr().Is6() {
							backends = []string{"[fd00::9]:80"}
						}
						if mode == config.ModeTunnel {
							backends = []string{"10.9.9.9:80", "[fd00::9]:80"} // both outer families
						}
						for _, b := range backends {
							s.Backends = append(s.Backends, config.Backend{Addr: netip.MustParseAddrPort(b)})
						}
						if err := x.selfTest(s); err != nil {
							t.Fatalf("self-test: %v", err)
						}
					})
				}
			}
		}
	}
	if x.selfProg == nil {
		t.Fatal("the self-tests ran without their own instance of the program")
	}
	if x.selfProg == prog {
		t.Fatal("the self-tests ran in the live program")
	}
	if svcs := x.selfProg.Services(); len(svcs) != 0 {
		t.Errorf("test services left installed in the self-test instance: %v", svcs)
	}
	if svcs := prog.Services(); len(svcs) != 0 {
		t.Errorf("the live program got services from the self-tests: %v", svcs)
	}

	t.Run("nat without an own address", func(t *testing.T) {
		y := &Plane{prog: prog, addrs: []netip.Addr{own4}, links: map[int]string{}}
		s := &config.Service{Name: "t", Mode: config.ModeNAT, Protocol: config.TCP, VIP: netip.MustParseAddrPort("[fd00::1]:80")}
		if err := y.modeReady(s); err == nil {
			t.Error("nat IPv6 service with only an IPv4 own address: got no error; want one")
		}
	})
}
