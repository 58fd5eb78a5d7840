package xdpplane

import (
	"fmt"
	"maps"
	"net/netip"
	"time"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/agent/plan"
)

// Fits reports whether the program has the service and backend slots that ops
// take, at every point of their order, before any of them is written. The
// program holds a new backend's slot before it frees a replaced one's, a
// service's new entry (another VIP or protocol; a renamed service takes its old
// name's entry over) is added before its old one leaves, and backends a reload removed keep their slots while they drain:
// so a change between two files that each fit may not. One that does not is
// refused whole, naming the service where the slots run out, rather than
// failing half-applied and rolled back (which would replace the lookup tables
// it touched twice, and their previous-table fallback with them).
//
// It follows the decisions of Add, Update, SetBackend and Remove (apply.go).
func (x *Plane) Fits(running plan.Desired, ops []plan.Op) error {
	if x == nil || x.prog == nil {
		return nil
	}
	capa := x.prog.Capacity()
	// What the program holds is read, and x.installed copied, at the first
	// operation that may take or free a slot: most changes (a health check's,
	// a drain's) change one backend's state only, and copying every service's
	// backends for each of them would cost the loop a millisecond and megabytes
	// at 16,384 backends.
	var held map[loader.ServiceKey]map[netip.AddrPort]bool
	backends := 0
	installed := x.installed
	load := func() {
		if held != nil {
			return
		}
		held = make(map[loader.ServiceKey]map[netip.AddrPort]bool)
		for _, s := range x.prog.Services() {
			held[s.Key] = addrSet(s)
			backends += len(s.Backends)
		}
		installed = maps.Clone(x.installed)
	}
	put := func(s *plan.Service) error {
		load()
		ls := spec(s)
		cur, ok := held[ls.Key]
		if !ok && len(held) >= int(capa.Services) {
			if len(x.adopted) > 0 {
				services, _ := x.droppedHeld(held, ops)
				return capacityError(s.Name(), "the XDP program has %d service slots, all held at this point of the start%s: %w",
					capa.Services, startNote(services, "service"), loader.ErrCapacity)
			}
			return capacityError(s.Name(), "the XDP program has %d service slots, all held at this point of the change (a service's entry at a new VIP or protocol is added before the old one is removed): remove services in one reload and add the others in the next: %w",
				capa.Services, loader.ErrCapacity)
		}
		fresh := 0
		for _, b := range ls.Backends {
			if !cur[b.Addr] {
				fresh++
			}
		}
		if backends+fresh > int(capa.Backends) {
			if len(x.adopted) > 0 {
				_, slots := x.droppedHeld(held, ops)
				return capacityError(s.Name(), "the XDP program has %d backend slots, and this start needs %d at once: %d held, %d more for this service's new backends%s: %w",
					capa.Backends, backends+fresh, backends, fresh, startNote(slots, "backend"), loader.ErrCapacity)
			}
			return capacityError(s.Name(), "the XDP program has %d backend slots, and this change needs %d at once: %d held, %d more for this service's new backends, taken before the backends it replaces free theirs (which they keep while they drain)%s: %w",
				capa.Backends, backends+fresh, backends, fresh, leavingNote(running), loader.ErrCapacity)
		}
		next := addrSet(ls)
		backends += len(next) - len(cur)
		held[ls.Key], installed[ls.Key] = next, s.Name()
		return nil
	}
	remove := func(name string, key loader.ServiceKey) {
		if installed[key] != name {
			return
		}
		load()
		if !x.adopted[key] {
			backends -= len(held[key])
			delete(held, key)
		}
		delete(installed, key)
	}
	for _, op := range ops {
		if op.Plane != plan.XDP {
			continue
		}
		var err error
		switch op.Kind {
		case plan.Add:
			if op.Next.Installed {
				err = put(op.Next)
			}
		case plan.Update, plan.SetBackend:
			n := op.Next
			key := Key(&n.Config)
			switch {
			case op.Kind == plan.SetBackend && n.Installed && installed[key] == n.Name() &&
				n.Backend(op.Backend) != nil && op.Prev.Backend(op.Backend) != nil:
				// One backend's state: no slot taken or freed.
			case !n.Installed:
				remove(n.Name(), key)
			default:
				err = put(n)
			}
		case plan.Remove:
			remove(op.Prev.Name(), Key(&op.Prev.Config))
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// droppedHeld counts the services, and their backend slots, that the program
// held when this run adopted it and that no operation of this start (ops)
// takes over: they keep their slots until the start succeeds (DropUnowned), so
// that a failed start leaves them serving.
func (x *Plane) droppedHeld(held map[loader.ServiceKey]map[netip.AddrPort]bool, ops []plan.Op) (services, slots int) {
	taken := map[loader.ServiceKey]bool{}
	for _, op := range ops {
		if op.Plane == plan.XDP && op.Next != nil && op.Next.Installed {
			taken[Key(&op.Next.Config)] = true
		}
	}
	for key := range x.adopted {
		if !taken[key] {
			services++
			slots += len(held[key])
		}
	}
	return services, slots
}

// startNote says that n slots of a kind are held by the pinned program's
// services a start's file drops, if any, and a start's ways through.
func startNote(n int, kind string) string {
	note := ""
	if n > 0 {
		note = fmt.Sprintf("; %d of the held %s slots are held by services of the pinned program that this file drops, which keep them until the start succeeds so that a failed start leaves them serving", n, kind)
	}
	return note + ": start with the file the program was loaded with and reload to this one (removing in one reload and adding in the next), or detach the program first (weir stop --detach), which ends its flows"
}

// CapacityError is a change the XDP program has no slots for, at the named
// service: Fits' error.
type CapacityError struct {
	Service string
	Err     error
}

func (e *CapacityError) Error() string { return fmt.Sprintf("service %q: %v", e.Service, e.Err) }

func (e *CapacityError) Unwrap() error { return e.Err }

func capacityError(service, format string, args ...any) error {
	return &CapacityError{Service: service, Err: fmt.Errorf(format, args...)}
}

func addrSet(s loader.Service) map[netip.AddrPort]bool {
	set := make(map[netip.AddrPort]bool, len(s.Backends))
	for _, b := range s.Backends {
		set[b.Addr] = true
	}
	return set
}

// leavingNote says how many backend slots the backends that earlier changes
// removed hold while they drain, and until when.
func leavingNote(running plan.Desired) string {
	n, until := 0, time.Time{}
	for _, s := range running.Services {
		if s.Plane != plan.XDP || !s.Installed {
			continue
		}
		for _, l := range s.Leaving {
			n++
			if l.Until.After(until) {
				until = l.Until
			}
		}
	}
	if n == 0 {
		return "; remove backends in one reload and add the others in the next, once the removed ones have drained (drain_timeout)"
	}
	return fmt.Sprintf("; %d of the held slots are backends an earlier change removed, draining until %s (drain_timeout): reload again after that, or remove backends in one reload and add the others in the next once they have drained",
		n, until.UTC().Format(time.RFC3339))
}
