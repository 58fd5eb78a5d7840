package plan

import (
	"bytes"
	"fmt"
	"net/netip"
	"reflect"
)

// OpKind is what an operation does to a data plane.
type OpKind int

// Operations.
const (
	// Add starts serving Next.
	Add OpKind = iota
	// Update changes a service the plane serves from Prev to Next. The plane
	// decides what that takes (XDP: a new key is a new entry, and the old one
	// stays until a Remove of Prev; proxy: changed listener settings are a new
	// listener, the old one drains).
	Update
	// SetBackend changes one backend's usability, weight or drain and nothing else,
	// so XDP moves only that backend's share of the lookup table.
	SetBackend
	// Remove stops serving Prev. On XDP it also follows an Update that moved a
	// service to another VIP or protocol: Prev is then the old entry, which
	// leaves last.
	Remove
)

func (k OpKind) String() string {
	switch k {
	case Add:
		return "add"
	case Update:
		return "update"
	case SetBackend:
		return "set-backend"
	case Remove:
		return "remove"
	}
	return fmt.Sprintf("OpKind(%d)", int(k))
}

// Op is one operation on one data plane.
type Op struct {
	Kind    OpKind
	Plane   Plane
	Prev    *Service       // Update, SetBackend, Remove
	Next    *Service       // Add, Update, SetBackend
	Backend netip.AddrPort // SetBackend
}

// Service is the service the operation is about.
func (op Op) Service() string {
	if op.Next != nil {
		return op.Next.Name()
	}
	return op.Prev.Name()
}

func (op Op) String() string {
	s := fmt.Sprintf("%s %s %s", op.Plane, op.Kind, op.Service())
	if op.Kind == SetBackend {
		s += " " + op.Backend.String()
	}
	return s
}

// Diff returns the operations that take the planes from prev to next. Their order
// puts what is most likely to fail first and what cannot be taken back last: adds
// and updates on the proxy (they bind listeners), then on XDP, then removals. A
// service that changes plane is added to the new one before it leaves the old; an
// XDP service whose VIP or protocol changes gets its new entry in the update, and
// its old entry, with the flows on it, goes with the removals.
// Changes that only status shows (health state names, notes) give no operation.
func Diff(prev, next Desired) []Op {
	var proxyOps, xdpOps, removes []Op
	add := func(op Op) {
		if op.Plane != XDP { // the proxy and the http plane bind listeners
			proxyOps = append(proxyOps, op)
		} else {
			xdpOps = append(xdpOps, op)
		}
	}
	for i := range next.Services {
		n := &next.Services[i]
		p := prev.Service(n.Name())
		switch {
		case p == nil:
			add(Op{Kind: Add, Plane: n.Plane, Next: n})
		case p.Plane != n.Plane:
			add(Op{Kind: Add, Plane: n.Plane, Next: n})
			removes = append(removes, Op{Kind: Remove, Plane: p.Plane, Prev: p})
		default:
			if op, ok := change(p, n); ok {
				add(op)
			}
			if n.Plane == XDP && (p.Config.VIP != n.Config.VIP || p.Config.Protocol != n.Config.Protocol) {
				removes = append(removes, Op{Kind: Remove, Plane: XDP, Prev: p})
			}
		}
	}
	for i := range prev.Services {
		p := &prev.Services[i]
		if next.Service(p.Name()) == nil {
			removes = append(removes, Op{Kind: Remove, Plane: p.Plane, Prev: p})
		}
	}
	return append(append(proxyOps, xdpOps...), removes...)
}

// change is the operation that takes one service from p to n on the same plane.
func change(p, n *Service) (Op, bool) {
	update := Op{Kind: Update, Plane: n.Plane, Prev: p, Next: n}
	if !reflect.DeepEqual(p.Config, n.Config) || p.Installed != n.Installed ||
		len(p.Backends) != len(n.Backends) || !sameLeaving(p.Leaving, n.Leaving) {
		return update, true
	}
	changed := -1
	for i := range n.Backends {
		if !samePlaneView(&p.Backends[i], &n.Backends[i]) {
			if changed >= 0 {
				return update, true
			}
			changed = i
		}
	}
	if changed < 0 {
		return Op{}, false
	}
	return Op{Kind: SetBackend, Plane: n.Plane, Prev: p, Next: n, Backend: n.Backends[changed].Config.Addr}, true
}

// samePlaneView reports whether a data plane would see no difference between two
// states of a backend.
func samePlaneView(a, b *Backend) bool {
	return a.Config.Addr == b.Config.Addr && a.Usable == b.Usable && a.Weight == b.Weight && a.Ramp == b.Ramp &&
		a.Drained == b.Drained && bytes.Equal(a.MAC, b.MAC)
}

func sameLeaving(a, b []Backend) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !samePlaneView(&a[i], &b[i]) || a[i].Healthy != b[i].Healthy {
			return false
		}
	}
	return true
}
