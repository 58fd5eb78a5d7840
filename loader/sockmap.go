package loader

import (
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bpf"
)

// SockMap is the proxy's in-kernel forwarding (bpf/sockmap.c): a socket map whose
// stream verdict program sends the bytes each socket receives out of its peer. The
// proxy pairs a connection's two sockets once the backend is connected; closing a
// socket takes it out of the map (the kernel does that), so there is no unpairing.
// Safe for concurrent use.
type SockMap struct {
	mu     sync.RWMutex
	objs   bpf.SockmapObjects
	closed bool
}

// LoadSockMap loads the program and its maps and attaches the program to the map.
// On a kernel or host without sockmap support it returns an error; the proxy then
// forwards in user space.
func LoadSockMap() (*SockMap, error) { return loadSockMap(nil) }

// loadSockMap is LoadSockMap with the program's spec changed by edit first (tests
// shrink the maps).
func loadSockMap(edit func(*ebpf.CollectionSpec)) (*SockMap, error) {
	m := &SockMap{}
	spec, err := bpf.LoadSockmap()
	if err != nil {
		return nil, fmt.Errorf("load sockmap spec: %w", err)
	}
	if edit != nil {
		edit(spec)
	}
	if err := spec.LoadAndAssign(&m.objs, nil); err != nil {
		if errors.Is(err, unix.EPERM) {
			return nil, fmt.Errorf("load sockmap program: %w (run as root, or grant CAP_BPF and CAP_NET_ADMIN)", err)
		}
		return nil, fmt.Errorf("load sockmap program: %w", err)
	}
	err = link.RawAttachProgram(link.RawAttachProgramOptions{
		Target:  m.objs.SplicePeers.FD(),
		Program: m.objs.SpliceVerdict,
		Attach:  ebpf.AttachSkSKBStreamVerdict,
	})
	if err != nil {
		m.objs.Close()
		return nil, fmt.Errorf("attach sockmap stream verdict: %w", err)
	}
	return m, nil
}

// PairError is Pair's error. Lost reports that the client's socket was in the map
// for a moment and some of its bytes reached it there, so they can be neither
// forwarded nor read: the caller must reset the connection rather than copy it.
type PairError struct {
	Err  error
	lost bool
}

func (e *PairError) Error() string { return e.Err.Error() }
func (e *PairError) Unwrap() error { return e.Err }
func (e *PairError) Lost() bool    { return e.lost }

// Pair starts forwarding between the two sockets of one connection (descriptors of
// TCP sockets): each one's bytes go out of the other. The kernel takes only
// established sockets, so a client that has already sent its FIN (or a backend) is
// refused, and the caller copies that connection itself.
//
// The client's socket goes in first: a client that half-closed early is refused
// before anything is in the map. Until the backend's socket is in, the client's
// bytes find no peer and go to the proxy, which then forwards that direction itself
// (splice_socks). If the backend's socket is refused, the client's leaves the map
// again. Bytes already queued on a socket are forwarded when the kernel next runs the
// socket's data-ready path; the caller kicks it (SO_RCVLOWAT).
//
// It returns the sockets' cookies (client's, backend's), which Forget takes once
// both are closed.
func (m *SockMap) Pair(client, server int) ([2]uint64, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.closed {
		return [2]uint64{}, fmt.Errorf("sockmap: %w", net.ErrClosed)
	}
	cc, err := unix.GetsockoptUint64(client, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		return [2]uint64{}, fmt.Errorf("sockmap: client socket cookie: %w", err)
	}
	sc, err := unix.GetsockoptUint64(server, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		return [2]uint64{}, fmt.Errorf("sockmap: backend socket cookie: %w", err)
	}
	if err := m.objs.SplicePeers.Update(sc, uint64(client), ebpf.UpdateAny); err != nil {
		return [2]uint64{}, &PairError{Err: fmt.Errorf("sockmap: add client socket: %w", err)}
	}
	if err := m.objs.SplicePeers.Update(cc, uint64(server), ebpf.UpdateAny); err != nil {
		// A socket in the map without its peer can't be read (Linux 6.18): take the
		// client's out, and find out whether bytes reached it meanwhile. Any entry
		// of the client's says so: the program makes one only for bytes it saw,
		// and with no peer those go where they can't be read. The passed mark is
		// not waited for: the program writes the entry first and marks it after,
		// and a look between the two would take lost bytes for none.
		derr := m.objs.SplicePeers.Delete(sc)
		var st bpf.SockmapSpliceSock
		lost := derr != nil || m.objs.SpliceSocks.Lookup(cc, &st) == nil
		if lost {
			m.objs.SpliceSocks.Delete(cc)
		}
		return [2]uint64{}, &PairError{Err: fmt.Errorf("sockmap: add backend socket: %w", errors.Join(err, derr)), lost: lost}
	}
	return [2]uint64{cc, sc}, nil
}

// Forget drops what the map holds of a pair's sockets, by the cookies Pair returned,
// and returns when the kernel first saw bytes of each (CLOCK_MONOTONIC, ns; 0 if it
// saw none). The caller calls it after it has closed both sockets: until then bytes
// that reach one run the program, which would make its entry anew, and nothing
// would delete it. A closed socket has left splice_peers, so the program no longer
// runs for it, and a cookie is never reused.
func (m *SockMap) Forget(cookies [2]uint64) ([2]int64, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	var first [2]int64
	if m.closed {
		return first, nil
	}
	var errs [2]error
	for i, c := range cookies {
		var st bpf.SockmapSpliceSock
		err := m.objs.SpliceSocks.LookupAndDelete(c, &st)
		switch {
		case err == nil:
			first[i] = int64(st.FirstNs)
		case !errors.Is(err, ebpf.ErrKeyNotExist):
			errs[i] = fmt.Errorf("sockmap: forget socket: %w", err)
		}
	}
	return first, errors.Join(errs[:]...)
}

// Close detaches the program and releases the maps. Sockets still paired go on
// receiving as plain sockets. It is idempotent.
func (m *SockMap) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	err := link.RawDetachProgram(link.RawDetachProgramOptions{
		Target:  m.objs.SplicePeers.FD(),
		Program: m.objs.SpliceVerdict,
		Attach:  ebpf.AttachSkSKBStreamVerdict,
	})
	if err != nil {
		err = fmt.Errorf("detach sockmap stream verdict: %w", err)
	}
	return errors.Join(err, m.objs.Close())
}
