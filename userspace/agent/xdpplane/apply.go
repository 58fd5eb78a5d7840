package xdpplane

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/balance"
	"github.com/weir-lb/weir/userspace/config"
)

var zeroMAC = net.HardwareAddr{0, 0, 0, 0, 0, 0}

// Key is how the program tells a service apart.
func Key(s *config.Service) loader.ServiceKey {
	proto := loader.TCP
	if s.Protocol == config.UDP {
		proto = loader.UDP
	}
	return loader.ServiceKey{VIP: s.VIP, Protocol: proto}
}

func forwarding(mode config.Mode) loader.Forwarding {
	switch mode {
	case config.ModeDSR:
		return loader.ForwardDSR
	case config.ModeTunnel:
		return loader.ForwardTunnel
	}
	return loader.ForwardNAT
}

// spec is the loader's view of a desired service.
func spec(s *plan.Service) loader.Service {
	ls := loader.Service{Key: Key(&s.Config), Forwarding: forwarding(s.Config.Mode),
		SourceHash: s.Config.Hash == config.HashSource, TableSize: s.Config.TableSize,
		P2C: s.Config.Algorithm == config.AlgorithmMaglevP2C}
	if ls.TableSize == 0 {
		// Sized by the configured backends, as the file's table_size check
		// counts them, not by the leaving ones too: past 655 backends the size
		// follows the count (a ladder of sizes), and a leaver counted in at the
		// end of a step would change it again when it leaves, drain_timeout
		// after the reload, moving every slot.
		ls.TableSize = balance.MaglevSize(len(s.Backends))
	}
	mac := func(b *plan.Backend) net.HardwareAddr {
		if ls.Forwarding != loader.ForwardDSR {
			return nil
		}
		if b.MAC == nil {
			return zeroMAC // unusable until resolved
		}
		return b.MAC
	}
	for i := range s.Backends {
		b := &s.Backends[i]
		ls.Backends = append(ls.Backends, loader.Backend{Addr: b.Config.Addr, Weight: b.Weight, Usable: b.Usable,
			Draining: b.Drained, MAC: mac(b), Ramp: b.Ramp})
	}
	for i := range s.Leaving {
		l := &s.Leaving[i]
		ls.Backends = append(ls.Backends, loader.Backend{Addr: l.Config.Addr, Usable: l.Healthy, Draining: true, MAC: mac(l)})
	}
	return ls
}

func checkWeights(s *plan.Service) error {
	if s.WeightSum() == 0 {
		return fmt.Errorf("service %q: every backend has weight 0: give one a weight first", s.Name())
	}
	return nil
}

func (x *Plane) available() error {
	if x.prog == nil {
		return fmt.Errorf("XDP unavailable: %s", x.reason)
	}
	return nil
}

// Add puts a service in the program (unless all_down: pass keeps it out). After a
// restart the pinned program may hold it already: its entry is updated in place, so
// its established flows stay.
func (x *Plane) Add(s *plan.Service) error {
	if err := x.available(); err != nil {
		return err
	}
	if err := checkWeights(s); err != nil {
		return err
	}
	if !s.Installed {
		return nil
	}
	ls := spec(s)
	if err := x.prog.SetService(ls); err != nil {
		return fmt.Errorf("service %q: %w", s.Name(), err)
	}
	x.installed[ls.Key] = s.Name()
	return nil
}

// Update brings a service from prev to next: in place when its key stays (a mode
// change too), else a new entry. The old entry keeps serving its flows until a
// Remove of prev, which plan.Diff puts with the removals, after every write that
// may fail.
func (x *Plane) Update(prev, next *plan.Service) error {
	if err := x.available(); err != nil {
		return err
	}
	if err := checkWeights(next); err != nil {
		return err
	}
	ls := spec(next)
	switch {
	case !next.Installed:
		return x.remove(next.Name(), ls.Key)
	case x.installed[ls.Key] != next.Name():
		if err := x.prog.SetService(ls); err != nil {
			return fmt.Errorf("service %q: %w", next.Name(), err)
		}
		x.installed[ls.Key] = next.Name()
	default:
		if err := x.prog.UpdateService(ls); err != nil {
			return fmt.Errorf("service %q: %w", next.Name(), err)
		}
	}
	return nil
}

// SetBackend writes one backend's usability, drain, weight and ramp in one change of
// the program, which moves only that backend's share of the lookup table.
func (x *Plane) SetBackend(prev, next *plan.Service, addr netip.AddrPort) error {
	if err := x.available(); err != nil {
		return err
	}
	if err := checkWeights(next); err != nil {
		return err
	}
	key := Key(&next.Config)
	b, pb := next.Backend(addr), prev.Backend(addr)
	if !next.Installed || x.installed[key] != next.Name() || b == nil || pb == nil {
		return x.Update(prev, next)
	}
	if b.Usable == pb.Usable && b.Drained == pb.Drained && b.Weight == pb.Weight && b.Ramp == pb.Ramp {
		return nil
	}
	if err := x.prog.SetBackendState(key, addr, b.Usable, b.Drained, b.Weight, b.Ramp); err != nil {
		return fmt.Errorf("service %q: backend %s: %w", next.Name(), addr, err)
	}
	return nil
}

// Remove takes a service out of the program; removing one it does not hold is no
// error, so a rollback may repeat it.
func (x *Plane) Remove(s *plan.Service) error {
	if x.prog == nil {
		return nil
	}
	return x.remove(s.Name(), Key(&s.Config))
}

func (x *Plane) remove(name string, key loader.ServiceKey) error {
	if x.installed[key] != name {
		return nil // not there, or a renamed service took the key over
	}
	if x.adopted[key] {
		// The rollback of a start that failed: the pinned program served this
		// entry before, and goes on serving it.
		delete(x.installed, key)
		return nil
	}
	if err := x.prog.DeleteService(key); err != nil {
		return fmt.Errorf("service %q: remove from xdp: %w", name, err)
	}
	delete(x.installed, key)
	return nil
}

// Loaded reports whether the program is loaded and attached.
func (x *Plane) Loaded() bool { return x.prog != nil }

// Reason says why XDP is unavailable, or warns of how it runs.
func (x *Plane) Reason() string { return x.reason }

// Interfaces are the configured interfaces and how each is attached.
func (x *Plane) Interfaces() []api.InterfaceStatus { return x.ifaces }

// PinPath is where the program is pinned, "" when it is not.
func (x *Plane) PinPath() string { return x.pinPath }

// Adopted reports whether an earlier run's pinned program was taken over.
func (x *Plane) Adopted() bool { return x.hadPins }

// Status describes the plane for `weir status`, with the loaded program's own
// settings read back and its last next-hop failure.
func (x *Plane) Status(detachOnStop bool) api.XDPStatus {
	st := api.XDPStatus{Loaded: x.prog != nil, Reason: x.reason, Interfaces: x.ifaces,
		Pinned: x.prog != nil && x.pinPath != "", PinPath: x.pinPath, Adopted: x.hadPins, DetachOnStop: detachOnStop}
	if x.prog == nil {
		return st
	}
	if err := x.prog.NextHopError(); err != nil {
		st.NextHopError = err.Error()
	}
	st.NATPorts[0], st.NATPorts[1] = x.prog.NATPortRange()
	st.ConntrackSize, st.HalfOpenSize = x.prog.Sizes()
	st.PreviousTableWindow = x.prog.PreviousTableWindow().String()
	return st
}

// Tables returns every installed service's lookup-table fingerprints (none without
// a program).
func (x *Plane) Tables() map[loader.ServiceKey]loader.TableInfo {
	if x.prog == nil {
		return nil
	}
	return x.prog.Tables()
}

// ExpirePreviousTables ends the fallback of lookup tables replaced longer ago than
// the window (loader.Options.PreviousTableWindow).
func (x *Plane) ExpirePreviousTables(now time.Time) error {
	if x.prog == nil {
		return nil
	}
	return x.prog.ExpirePreviousTables(now)
}

// FlowIdle is how long the program remembers an idle established TCP flow.
func (x *Plane) FlowIdle() time.Duration {
	if x.prog == nil {
		return loader.DefaultTCPIdle
	}
	return x.prog.NAT().TCPIdle
}

// Stats reads the program's counters; false when there is no program or the read
// failed.
func (x *Plane) Stats() (loader.Stats, bool) {
	if x.prog == nil {
		return loader.Stats{}, false
	}
	st, err := x.prog.Stats()
	return st, err == nil
}

// Explain says where the program sends client's flow to s.
func (x *Plane) Explain(s *plan.Service, client netip.AddrPort) (api.Explanation, error) {
	ex := api.Explanation{Service: s.Name(), Client: client.String()}
	if !s.Installed || x.prog == nil {
		return ex, nil // all_down: pass: the host's stack gets the packets
	}
	le, err := x.prog.Explain(Key(&s.Config), client)
	if err != nil {
		return api.Explanation{}, err
	}
	if le.New.IsValid() {
		ex.New = le.New.String()
	}
	if le.Previous.IsValid() {
		ex.Previous = le.Previous.String()
	}
	ex.Fingerprint = le.Fingerprint
	if c := le.P2C; c != nil {
		ex.P2C = &api.Candidates{First: c.First.String(), Second: c.Second.String(),
			FirstLoad: c.FirstLoad, SecondLoad: c.SecondLoad, SecondWins: c.SecondWins}
	}
	if le.Tracked.IsValid() {
		ex.Tracked, ex.TrackedUsable, ex.NATPort = le.Tracked.String(), le.TrackedUsable, le.NATPort
		ex.HalfOpen = le.HalfOpen
	}
	return ex, nil
}

// ResolveMAC looks a dsr backend's address up in the neighbour table (asking the
// kernel to resolve it when the table has no answer yet). While it has none, the
// MAC the adopted program used is kept, so a restart never takes a backend out.
func (x *Plane) ResolveMAC(ip netip.Addr) plan.MAC {
	if x.prog == nil {
		return plan.MAC{}
	}
	mac, err := resolveMAC(ip, x.links)
	if err != nil {
		if m, ok := x.adoptedMACs[ip]; ok {
			return plan.MAC{Addr: m}
		}
		return plan.MAC{Err: err.Error()}
	}
	return plan.MAC{Addr: mac}
}

// SpeakerPortClashes refuses cfg's tcp VIPs that XDP may serve at the node's
// own address on bgp.listen_port, where the file leaves addresses out and that
// address is the first interface's (config.Config.SpeakerPortClashes):
// validation checks only the addresses a file names. It is one address of each
// family, the one interfaceAddrs chooses, since XDP takes no other as its own
// (nat's and tunnel's source): another address of the interface is no more
// checked than a host address that a file's addresses leave out. The
// interface's address is read each time, so a reload or plan after it changed
// checks the one the speaker's peers reach now (the one read at Setup if it
// cannot be read). nil when XDP is not loaded, as it then takes no packet.
func (x *Plane) SpeakerPortClashes(cfg *config.Config, file string) error {
	if x == nil || x.prog == nil || len(cfg.Addresses) > 0 || len(cfg.Interfaces) == 0 {
		return nil
	}
	addrs, err := interfaceAddrs(context.Background(), cfg.Interfaces[0].Name, 0)
	if err != nil {
		addrs = x.addrs
	}
	return speakerPortClashes(cfg, addrs, file)
}

// speakerPortClashes is SpeakerPortClashes with the interface's addresses
// found (addrs, as Setup and Preflight find them).
func speakerPortClashes(cfg *config.Config, addrs []netip.Addr, file string) error {
	if len(cfg.Addresses) > 0 || len(cfg.Interfaces) == 0 {
		return nil
	}
	return cfg.SpeakerPortClashes(file, addrs, fmt.Sprintf("on %s, taken as addresses is left out", cfg.Interfaces[0].Name))
}
