package xdpplane

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"

	"github.com/weir-lb/weir/userspace/config"
)

// Preflight checks, without loading anything, what the host must offer the config's
// XDP services: the interfaces exist, and nat and tunnel services have the
// balancer's own address and the forwarding their next-hop lookups need. It
// returns one line per problem, in operator words with the fix, at the file
// named file; `weir validate` prints them. disabled is weir run's --no-xdp.
// refused are the problems for which the agent on this host refuses the file (a
// start stops, a reload is refused): a service XDP alone may serve that XDP
// cannot serve here (XDP disabled, none of the interfaces exists, or its mode's
// needs are not met), a VIP on the BGP speaker's port at the interface's
// address while XDP would take it. notes only decide where a service runs: one
// with data_plane auto is served by the proxy. The privileges XDP needs are the
// agent's, not those of the process that checks: one without them checks the
// file as the agent, which has them to serve with XDP, takes it, and says so
// in a note.
func Preflight(cfg *config.Config, file string, disabled bool) (refused, notes []string) {
	if len(cfg.Interfaces) == 0 {
		return nil, nil
	}
	x := &Plane{links: map[int]string{}, addrs: cfg.Addresses}
	if disabled {
		// XDP takes no packet: the speaker's port stays the speaker's, and
		// every service XDP may serve meets the same refusal or fallback.
		x.reason = reasonDisabled
		return x.serviceChecks(cfg, file, nil, nil)
	}
	if err := checkPrivileges(); err != nil {
		notes = append(notes, fmt.Sprintf("%s: checked as the agent takes the file with the privileges XDP needs, which this process lacks (%v)", file, err))
	}
	var missing []string
	for i, in := range cfg.Interfaces {
		iface, err := net.InterfaceByName(in.Name)
		if err != nil {
			e := fmt.Errorf("%s: %w: XDP cannot attach to it", in.Name, err)
			missing = append(missing, cfg.ErrorAt(file, fmt.Sprintf("interfaces[%d]", i), e).Error())
			continue
		}
		x.links[iface.Index] = in.Name
	}
	// The agent attaches XDP to the interfaces it finds and serves on those: only
	// when it finds none does XDP serve nothing here.
	if len(x.links) > 0 {
		for _, m := range missing {
			notes = append(notes, m+" (XDP serves on the others)")
		}
	} else {
		xdpOnly := slices.ContainsFunc(cfg.Services, func(s config.Service) bool { return s.Serving().Else == "" })
		for _, m := range missing {
			if xdpOnly {
				refused = append(refused, m+", so the services XDP alone may serve (data_plane xdp, udp) cannot start and the agent refuses the file here")
			} else {
				notes = append(notes, m+" (every service falls back to the proxy)")
			}
		}
		return refused, notes
	}
	if len(x.addrs) == 0 {
		x.addrs, _ = interfaceAddrs(context.Background(), cfg.Interfaces[0].Name, dadWait)
	}
	var clashes config.Errors
	if errors.As(speakerPortClashes(cfg, x.addrs, file), &clashes) {
		for _, e := range clashes {
			refused = append(refused, e.Error()+", so the agent refuses the file here")
		}
	}
	return x.serviceChecks(cfg, file, refused, notes)
}

// serviceChecks adds to refused and notes what keeps XDP from serving each
// service it may serve here: x.reason when XDP is disabled, else the mode's
// needs; each at the service's entry in the file at file.
func (x *Plane) serviceChecks(cfg *config.Config, file string, refused, notes []string) ([]string, []string) {
	for i := range cfg.Services {
		s := &cfg.Services[i]
		v := s.Serving()
		if !v.XDP {
			continue
		}
		err := x.available()
		if x.reason == "" {
			err = x.modeReady(s) // the program is not loaded here, only checked for
		}
		if err == nil {
			continue
		}
		// The path names the service: the message without its name.
		at := func(format string, arg any) string {
			return cfg.ErrorAt(file, fmt.Sprintf("services[%d]", i), fmt.Errorf(format, err, arg)).Error()
		}
		if v.Else == "" {
			refused = append(refused, at("%w, so it cannot start (%s) and the agent refuses the file here", v.Why))
		} else {
			notes = append(notes, at("%w, so it falls back to the %s (data_plane auto)", v.Else))
		}
	}
	return refused, notes
}
