package fleet

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/weir-lb/weir/internal/netns"
)

// Servers are the backends' stream servers: each accepts on StreamPort (the VIPs
// are on the backends' lo), writes its name and a newline, then echoes what it
// reads until the client half-closes.
type Servers struct {
	mu   sync.Mutex
	ls   map[string]net.Listener
	wg   sync.WaitGroup
	conn map[net.Conn]struct{}
}

// NewServers returns no servers yet.
func NewServers() *Servers {
	return &Servers{ls: map[string]net.Listener{}, conn: map[net.Conn]struct{}{}}
}

// Serve starts the server name in ns.
func (s *Servers) Serve(ns *netns.NS, name string) error {
	l, err := ns.Listen("tcp", fmt.Sprintf(":%d", StreamPort))
	if err != nil {
		return fmt.Errorf("stream server %s: %w", name, err)
	}
	s.mu.Lock()
	s.ls[name] = l
	s.mu.Unlock()
	// Exits when l is closed (Kill or Close).
	s.wg.Go(func() { s.accept(l, name) })
	return nil
}

func (s *Servers) accept(l net.Listener, name string) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conn[c] = struct{}{}
		s.mu.Unlock()
		// Exits when the client half-closes or the connection breaks.
		s.wg.Go(func() {
			defer func() {
				s.mu.Lock()
				delete(s.conn, c)
				s.mu.Unlock()
				c.Close()
			}()
			echo(c, name)
		})
	}
}

func echo(c net.Conn, name string) {
	if _, err := io.WriteString(c, name+"\n"); err != nil {
		return
	}
	io.Copy(c, c)
	if tc, ok := c.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
}

// Kill stops server name accepting (its open streams go on), so its backend fails
// its health checks.
func (s *Servers) Kill(name string) {
	s.mu.Lock()
	l := s.ls[name]
	delete(s.ls, name)
	s.mu.Unlock()
	if l != nil {
		l.Close()
	}
}

// Close stops every server and its streams.
func (s *Servers) Close() {
	s.mu.Lock()
	for n, l := range s.ls {
		l.Close()
		delete(s.ls, n)
	}
	for c := range s.conn {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// StreamOptions shape a batch of streams.
type StreamOptions struct {
	Streams  int           // how many, spread over the client's source addresses
	Chunks   int           // chunks each stream sends (and gets back)
	Chunk    int           // bytes per chunk
	Interval time.Duration // between a stream's chunks
	// Timeout bounds each stream from its dial to its end.
	Timeout time.Duration
}

// Stream is one stream's outcome.
type Stream struct {
	Local   netip.AddrPort // the client's end
	Backend string         // the backend that answered
	Sent    int            // bytes sent and echoed back intact
	Err     error          // nil: every byte came back, in order, unchanged
}

// Streams are a batch running; Wait returns their outcomes.
type Streams struct {
	out  []Stream
	wg   sync.WaitGroup
	up   sync.WaitGroup // each stream's dial and name line
	half chan struct{}  // closed once every stream is past half its chunks
	mu   sync.Mutex
	past int
}

// StartStreams dials o.Streams streams to dst from the client and lets them run:
// each sends o.Chunks chunks of its own pseudo-random bytes, o.Interval apart,
// reads them back and compares every byte. It returns once every stream has
// dialled and read its backend's name (or failed to).
func (f *Fleet) StartStreams(ctx context.Context, dst netip.AddrPort, o StreamOptions) *Streams {
	ss := &Streams{out: make([]Stream, o.Streams), half: make(chan struct{})}
	if o.Streams == 0 {
		close(ss.half)
	}
	for k := range o.Streams {
		src := f.T.ClientAddrs[k%len(f.T.ClientAddrs)]
		ss.wg.Add(1)
		ss.up.Add(1)
		// Exits when the stream ends (or its timeout does).
		go func() {
			defer ss.wg.Done()
			st := f.stream(ctx, src, dst, uint64(k), o, ss)
			ss.mu.Lock() // Locals reads ss.out while streams run
			ss.out[k] = st
			ss.mu.Unlock()
		}()
	}
	ss.up.Wait()
	return ss
}

func (ss *Streams) halfway() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.past++
	if ss.past == len(ss.out) {
		close(ss.half)
	}
}

// Halfway is closed once every stream has sent half its chunks (or ended).
func (ss *Streams) Halfway() <-chan struct{} { return ss.half }

// Locals are the streams' client ends, in order (zero for one that did not dial).
func (ss *Streams) Locals() []netip.AddrPort {
	out := make([]netip.AddrPort, len(ss.out))
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for i, s := range ss.out {
		out[i] = s.Local
	}
	return out
}

// Wait waits for every stream and returns their outcomes.
func (ss *Streams) Wait() []Stream {
	ss.wg.Wait()
	return ss.out
}

func (f *Fleet) stream(ctx context.Context, src netip.Addr, dst netip.AddrPort, seed uint64, o StreamOptions, ss *Streams) (st Stream) {
	var up, half sync.Once
	markUp := func() { up.Do(ss.up.Done) }
	markHalf := func() { half.Do(ss.halfway) }
	defer markUp()
	defer markHalf()
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}}
	c, err := f.T.Client.NS.DialWith(ctx, d, "tcp", dst.String())
	if err != nil {
		st.Err = fmt.Errorf("dial %s from %s: %w", dst, src, err)
		return st
	}
	defer c.Close()
	// Exits when ctx ends or the stream does: a stream past its timeout is cut.
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	tc := c.(*net.TCPConn)
	st.Local = netip.MustParseAddrPort(c.LocalAddr().String())
	ss.mu.Lock()
	ss.out[seed].Local = st.Local
	ss.mu.Unlock()
	rd := bufio.NewReader(c)
	name, err := rd.ReadString('\n')
	if err != nil {
		st.Err = fmt.Errorf("stream %s: read the backend's name: %w", st.Local, err)
		return st
	}
	st.Backend = strings.TrimSpace(name)
	markUp()

	want := make([]byte, o.Chunks*o.Chunk)
	r := rand.New(rand.NewPCG(seed, 0x77656972))
	for i := range want {
		want[i] = byte(r.Uint32())
	}
	werr := make(chan error, 1)
	// Exits after the last chunk (or a failed write).
	go func() {
		t := time.NewTicker(o.Interval)
		defer t.Stop()
		for i := range o.Chunks {
			if _, err := c.Write(want[i*o.Chunk : (i+1)*o.Chunk]); err != nil {
				werr <- err
				return
			}
			if i == o.Chunks/2 {
				markHalf()
			}
			if i < o.Chunks-1 {
				select {
				case <-t.C:
				case <-ctx.Done():
					werr <- ctx.Err()
					return
				}
			}
		}
		werr <- tc.CloseWrite()
	}()
	got := make([]byte, 0, len(want))
	buf := make([]byte, 64<<10)
	for {
		n, err := rd.Read(buf)
		got = append(got, buf[:n]...)
		if err == io.EOF {
			break
		}
		if err != nil {
			st.Err = fmt.Errorf("stream %s via %s: read after %d of %d bytes: %w", st.Local, st.Backend, len(got), len(want), err)
			break
		}
	}
	if e := <-werr; e != nil && st.Err == nil {
		st.Err = fmt.Errorf("stream %s via %s: write: %w", st.Local, st.Backend, e)
	}
	st.Sent = len(got)
	switch {
	case st.Err != nil:
	case len(got) != len(want):
		st.Err = fmt.Errorf("stream %s via %s: got %d bytes back, want %d", st.Local, st.Backend, len(got), len(want))
	case !bytes.Equal(got, want):
		i := 0
		for got[i] == want[i] {
			i++
		}
		st.Err = fmt.Errorf("stream %s via %s: byte %d differs", st.Local, st.Backend, i)
	}
	return st
}

// Failed counts the streams that did not come back intact.
func Failed(out []Stream) (n int, first error) {
	for _, s := range out {
		if s.Err != nil {
			if first == nil {
				first = s.Err
			}
			n++
		}
	}
	return n, first
}

// Owners asks every running node's agent which of locals it tracks for service
// (weir explain), and returns the node index per stream (-1: none).
func (f *Fleet) Owners(ctx context.Context, service string, locals []netip.AddrPort) ([]int, error) {
	out := make([]int, len(locals))
	for k, l := range locals {
		out[k] = -1
		if !l.IsValid() {
			continue
		}
		for i, n := range f.Nodes {
			if n.cmd == nil {
				continue
			}
			ex, err := n.Client.Explain(ctx, service, l.String())
			if err != nil {
				return nil, fmt.Errorf("node %d: explain %s: %w", i, l, err)
			}
			if ex.Tracked != "" {
				out[k] = i
				break
			}
		}
	}
	return out, nil
}
