// Package xdpplane is the agent's XDP data plane: it loads the program through the
// loader, attaches it, pins it (bpffs, one agent per pin directory by flock), runs
// the self-test that decides whether a service may be served by XDP, does all the
// agent's netlink neighbour work (dsr backends' MACs, the balancer's own addresses),
// and turns the planner's desired services into loader writes.
//
// The agent's reconcile loop owns a Plane: Add, Update, SetBackend, Remove and
// DropUnowned are called from that loop only. Loaded, Status, Stats and Explain read
// what never changes after Setup, or the loader (which is safe for concurrent use),
// so status and metrics may call them from any goroutine.
package xdpplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/config"
)

// Plane is the loaded XDP program and where it is attached.
type Plane struct {
	prog   *loader.Program // nil when XDP is unavailable
	reason string          // why it is unavailable, or how it is attached
	ifaces []api.InterfaceStatus
	links  map[int]string // ifindex -> name of attached interfaces
	addrs  []netip.Addr   // the balancer's own addresses

	hashSeed uint32
	scratch  scratchNS // where nat and tunnel self-tests run
	// selfProg is a second, never attached instance of the program, loaded with the
	// same settings, that the self-tests install their test services in: the live
	// program's maps, counters and neighbour entries stay untouched.
	selfProg *loader.Program

	pinPath string   // where the program is pinned; "" when it is not
	hadPins bool     // an earlier run's pinned program was adopted
	pinLock *os.File // flock on pinPath: one agent per pinned program
	// adoptedMACs are the dsr backend MACs the pinned program held, used while the
	// neighbour table has no answer so a restart never takes a backend out.
	adoptedMACs map[netip.Addr]net.HardwareAddr

	// installed are the services this run put in the program, and the name of the
	// service that owns each (loop only): a renamed service takes its key over
	// before the old name is removed.
	installed map[loader.ServiceKey]string
	// adopted are the services the pinned program held when this run adopted it,
	// until the agent's start succeeds (DropUnowned): the rollback of a failed
	// start leaves their entries, and the flows on them, in place.
	adopted map[loader.ServiceKey]bool
}

// natAddr is the balancer's own address of a family: nat's source and tunnel's
// outer source (zero if there is none).
func (x *Plane) natAddr(v6 bool) netip.Addr {
	for _, a := range x.addrs {
		if a.Is6() == v6 {
			return a
		}
	}
	return netip.Addr{}
}

// errInterfaceBusy: another program (another agent?) already holds the interface.
var errInterfaceBusy = errors.New("interface already has an XDP program")

// Setup loads the program and attaches it to every configured interface. It
// returns a plane without program, and the reason, when the host can't run XDP; it
// returns an error only for what must stop the agent (an interface that another
// XDP program holds). ctx done cuts short its wait for its own address to end
// duplicate address detection (see interfaceAddrs).
func Setup(ctx context.Context, cfg *config.Config, disabled bool) (*Plane, error) {
	x := &Plane{links: make(map[int]string), addrs: cfg.Addresses, hashSeed: cfg.XDP.HashSeed,
		installed: make(map[loader.ServiceKey]string)}
	if x.reason = unusable(cfg, disabled); x.reason != "" {
		return x, nil
	}
	if err := ensureBPFFS(cfg.XDP.PinPath); err != nil {
		// Without pins XDP still serves; only a restart would lose flows.
		x.reason = "not pinned, a restart drops XDP flows: " + err.Error()
	} else {
		lock, err := lockPinPath(cfg.XDP.PinPath)
		if err != nil {
			return nil, err
		}
		x.pinPath, x.pinLock = cfg.XDP.PinPath, lock
		entries, _ := os.ReadDir(x.pinPath)
		x.hadPins = len(entries) > 0
	}
	if len(x.addrs) == 0 {
		// Best effort: without an address of a family, nat and tunnel services of
		// that family fall back to the proxy and say why.
		x.addrs, _ = interfaceAddrs(ctx, cfg.Interfaces[0].Name, dadWait)
	}
	opts := LoaderOptions(cfg)
	opts.NAT.Addr4, opts.NAT.Addr6, opts.PinPath = x.natAddr(false), x.natAddr(true), x.pinPath
	prog, err := loader.Load(opts)
	if err != nil {
		if x.hadPins {
			// The pinned program is still attached and balancing: a proxy could
			// not see its traffic, so falling back would serve nothing.
			x.unlock()
			return nil, fmt.Errorf("adopt the XDP program pinned in %s: %w", x.pinPath, err)
		}
		x.unlock()
		x.reason = err.Error()
		return x, nil
	}
	x.adoptedMACs = make(map[netip.Addr]net.HardwareAddr)
	x.adopted = make(map[loader.ServiceKey]bool)
	for _, s := range prog.Services() {
		x.adopted[s.Key] = true
		for _, b := range s.Backends {
			if s.Forwarding == loader.ForwardDSR && len(b.MAC) == 6 && !bytes.Equal(b.MAC, zeroMAC) {
				x.adoptedMACs[b.Addr.Addr()] = b.MAC
			}
		}
	}
	for _, in := range cfg.Interfaces {
		st := api.InterfaceStatus{Name: in.Name, Requested: string(in.Attach)}
		mode, err := prog.Attach(in.Name, loader.Mode(in.Attach))
		if err != nil {
			if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.EEXIST) {
				x.prog = prog
				x.Stop(!x.hadPins)
				return nil, fmt.Errorf("attach xdp to %s: %w: is another weir agent running? (%w)", in.Name, errInterfaceBusy, err)
			}
			st.Error = err.Error()
		} else {
			st.Mode = string(mode)
			if iface, err := net.InterfaceByName(in.Name); err == nil {
				x.links[iface.Index] = in.Name
			}
		}
		x.ifaces = append(x.ifaces, st)
	}
	if len(x.links) == 0 {
		x.prog = prog
		x.Stop(!x.hadPins)
		x.prog = nil
		x.reason = "could not attach XDP to any interface"
		return x, nil
	}
	x.prog = prog
	return x, nil
}

// reasonDisabled is why XDP serves nothing with --no-xdp (Setup, Preflight).
const reasonDisabled = "XDP disabled (--no-xdp)"

// unusable says why XDP cannot serve cfg on this host before anything is
// loaded: disabled (--no-xdp), no interfaces, or a process without the
// privileges; "" if nothing says so yet.
func unusable(cfg *config.Config, disabled bool) string {
	switch {
	case disabled:
		return reasonDisabled
	case len(cfg.Interfaces) == 0:
		return "no interfaces configured"
	}
	if err := checkPrivileges(); err != nil {
		return err.Error()
	}
	return ""
}

// Stop releases the program: with detach (or without pins) it is detached and its
// pins removed; otherwise it stays attached and balancing, pinned for the next run.
func (x *Plane) Stop(detach bool) error {
	if x == nil {
		return nil
	}
	defer x.unlock()
	if x.prog == nil {
		return nil
	}
	x.scratch.close()
	if x.selfProg != nil {
		x.selfProg.Close()
		x.selfProg = nil
	}
	if detach || x.pinPath == "" {
		return x.prog.Close()
	}
	return x.prog.Release()
}

// selfTestProgram loads the self-tests' own instance of the program on first use.
func (x *Plane) selfTestProgram() (*loader.Program, error) {
	if x.selfProg == nil {
		p, err := loader.Load(loader.Options{HashSeed: x.hashSeed, ConntrackSize: 1024,
			NAT: loader.NATOptions{Addr4: x.natAddr(false), Addr6: x.natAddr(true)}})
		if err != nil {
			return nil, fmt.Errorf("load the self-test instance: %w", err)
		}
		x.selfProg = p
	}
	return x.selfProg, nil
}

func (x *Plane) unlock() {
	if x.pinLock != nil {
		x.pinLock.Close()
		x.pinLock = nil
	}
}

// lockPinPath takes an exclusive flock on the pin directory, held while the agent
// runs (the kernel drops it when the process dies, even by SIGKILL): a second agent
// with the same pin path would otherwise adopt the first one's program and links.
func lockPinPath(dir string) (*os.File, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("lock pin path %s: %w", dir, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("pin path %s: %w: another weir agent runs with this xdp.pin_path; stop it first", dir, errInterfaceBusy)
		}
		return nil, fmt.Errorf("lock pin path %s: %w", dir, err)
	}
	return f, nil
}

// DropUnowned is called once the agent's start has succeeded. It removes the
// services the program holds that this run did not put there: after a restart,
// services the pinned program still had that the config no longer serves through
// XDP (or self-test services a killed agent left). From then on removing a
// service the pinned program held deletes its entry.
func (x *Plane) DropUnowned(log *slog.Logger) {
	x.adopted = nil
	if x.prog == nil {
		return
	}
	for _, s := range x.prog.Services() {
		if _, ok := x.installed[s.Key]; ok {
			continue
		}
		if err := x.prog.DeleteService(s.Key); err != nil {
			log.Error("remove a service the pinned program had", "key", s.Key.String(), "err", err)
			continue
		}
		log.Info("removed a service the pinned program had and the config does not serve with XDP", "key", s.Key.String())
	}
}

// CanServe says whether the XDP plane can serve a service, and if not why.
func (x *Plane) CanServe(s *config.Service) error {
	if err := x.available(); err != nil {
		return err
	}
	switch {
	case !s.Algorithm.XDP():
		return fmt.Errorf("algorithm %s needs the proxy (XDP serves maglev, maglev_p2c and source_hash)", s.Algorithm)
	}
	if err := x.modeReady(s); err != nil {
		return err
	}
	if err := x.selfTest(s); err != nil {
		return fmt.Errorf("self-test failed: %w", err)
	}
	return nil
}

// modeReady checks what a forwarding mode needs of the host: nat and tunnel send
// from the balancer's own address of the family they send in, and their next-hop
// lookups (bpf_fib_lookup) answer only where the kernel would forward: IPv4
// forwarding on the interface the packets arrive on, IPv6 forwarding for the host.
func (x *Plane) modeReady(s *config.Service) error {
	var families []bool // IPv6?
	switch s.Mode {
	case config.ModeDSR:
		return nil
	case config.ModeNAT:
		families = []bool{s.VIP.Addr().Is6()}
	case config.ModeTunnel:
		seen := map[bool]bool{}
		for _, b := range s.Backends {
			if !seen[b.Addr.Addr().Is6()] {
				seen[b.Addr.Addr().Is6()] = true
				families = append(families, b.Addr.Addr().Is6())
			}
		}
	}
	for _, v6 := range families {
		name, sysctl := "IPv4", "net/ipv4/conf/%s/forwarding"
		if v6 {
			name, sysctl = "IPv6", "net/ipv6/conf/all/forwarding"
		}
		if !x.natAddr(v6).IsValid() {
			return fmt.Errorf("%s mode needs the balancer's own %s address: list one in addresses (none found on the first interface either)", s.Mode, name)
		}
		for _, ifname := range x.links {
			path := sysctl
			if !v6 {
				path = fmt.Sprintf(sysctl, ifname)
			}
			b, err := os.ReadFile("/proc/sys/" + path)
			if err != nil {
				return fmt.Errorf("%s mode: read %s: %w", s.Mode, path, err)
			}
			if strings.TrimSpace(string(b)) != "1" {
				key := strings.ReplaceAll(path, "/", ".")
				return fmt.Errorf("%s mode needs %s forwarding (the program's next-hop lookup answers only where the kernel would forward): %s is 0; set it with sysctl -w %s=1", s.Mode, name, key, key)
			}
		}
	}
	return nil
}

// RemovePinned removes the XDP program a stopped agent left attached and pinned for
// cfg: it adopts the pins as a restarted agent would, then detaches the program from
// cfg's interfaces and removes the pins, which drops every XDP flow. It refuses
// while an agent runs with the same pin path (use the admin API's stop instead).
func RemovePinned(cfg *config.Config) error {
	dir := cfg.XDP.PinPath
	if entries, err := os.ReadDir(dir); err != nil || len(entries) == 0 {
		return fmt.Errorf("remove pinned xdp program: nothing pinned in %s", dir)
	}
	lock, err := lockPinPath(dir)
	if err != nil {
		return fmt.Errorf("remove pinned xdp program: %w", err)
	}
	defer lock.Close()
	opts := LoaderOptions(cfg)
	opts.PinPath = dir
	prog, err := loader.Load(opts)
	if err != nil {
		return fmt.Errorf("remove pinned xdp program: %w", err)
	}
	var errs []error
	for _, in := range cfg.Interfaces {
		// Attach adopts the pinned link (or attaches anew where none was left); Close
		// detaches them all.
		if _, err := prog.Attach(in.Name, loader.Mode(in.Attach)); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, prog.Close())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("remove pinned xdp program: %w", err)
	}
	return nil
}

// LoaderOptions are the XDP program's load-time settings from cfg: the table sizes
// must be the same at every load that adopts the pinned maps.
func LoaderOptions(cfg *config.Config) loader.Options {
	return loader.Options{
		HashSeed:      cfg.XDP.HashSeed,
		ConntrackSize: cfg.XDP.ConntrackSize,
		HalfOpenSize:  cfg.XDP.HalfOpenSize,
		NewFlowRate:   cfg.XDP.NewFlowRate,
		NewFlowBurst:  cfg.XDP.NewFlowBurst,
		NAT:           loader.NATOptions{HalfOpen: cfg.XDP.HalfOpenTimeout},

		PreviousTableWindow: cfg.XDP.PreviousTableWindow,
	}
}
