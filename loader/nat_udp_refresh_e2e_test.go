package loader

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"
)

// TestNATRepliesKeepUDPFlow: a UDP client sends twice (its second datagram
// establishes the flow) and then only listens while the backend streams to it for
// longer than the UDP idle timeout. The backend's datagrams keep the flow alive, so
// the client's next datagram still comes from the same nat port, the stream's.
// (Kept alive only by its client's packets, the flow expired under the stream; the
// next datagram started a new flow from a new port, and the backend saw another
// client.)
func TestNATRepliesKeepUDPFlow(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("v6=%v", v6), func(t *testing.T) { natRepliesKeepUDPFlow(t, v6) })
	}
}

func natRepliesKeepUDPFlow(t *testing.T, v6 bool) {
	const (
		// The backend's packets refresh the flow once a second at most: the idle
		// timeout leaves room for that.
		idle   = 1500 * time.Millisecond
		stream = idle * 7 / 3 // how long the backend streams before the client speaks again
		every  = 100 * time.Millisecond
	)
	tp, _, vip := newOneBackendNAT(t, "wur", v6, UDP, NATOptions{UDPIdle: idle})
	pc, err := tp.Backends[0].NS.ListenPacket("udp", fmt.Sprintf(":%d", echoPort))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	// The backend's view: the source of the client's second datagram and of its third.
	sources := make(chan net.Addr, 2)
	// Exits after the client's third datagram, or when pc is closed at cleanup.
	go func() {
		buf := make([]byte, 64)
		var from net.Addr
		for range 2 {
			var err error
			if _, from, err = pc.ReadFrom(buf); err != nil {
				return
			}
		}
		sources <- from
		// Stream to the client until it speaks again. The streamer has its own
		// copy of the address: the read below sets from again.
		to := from
		stop := make(chan struct{})
		go func() { // exits when stop is closed or a write fails
			tick := time.NewTicker(every)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				if _, err := pc.WriteTo([]byte("stream"), to); err != nil {
					return
				}
			}
		}()
		defer close(stop)
		// Its own err: the test's goroutine sets the outer one meanwhile.
		if _, again, err := pc.ReadFrom(buf); err == nil {
			sources <- again
		}
	}()
	c, err := tp.DialUDP(context.Background(), vip, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, msg := range []string{"hello", "start"} {
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
	}
	first := recvSource(t, sources)
	got := 0
	buf := make([]byte, 64)
	for end := time.Now().Add(stream); time.Now().Before(end); {
		c.SetReadDeadline(end)
		if _, err := c.Read(buf); err == nil {
			got++
		}
	}
	if want := int(stream/every) / 2; got < want {
		t.Fatalf("the client got %d datagrams of the stream in %v; want at least %d", got, stream, want)
	}
	if _, err := c.Write([]byte("again")); err != nil {
		t.Fatal(err)
	}
	if second := recvSource(t, sources); second.String() != first.String() {
		t.Errorf("after %v of the stream (the UDP idle timeout is %v): the client's next datagram came from %v; want %v, the flow the stream kept alive",
			stream, idle, second, first)
	}
}

// recvSource waits up to 5 s for the backend to report a datagram's source.
func recvSource(t *testing.T, sources <-chan net.Addr) net.Addr {
	t.Helper()
	select {
	case a := <-sources:
		return a
	case <-time.After(5 * time.Second):
		t.Fatal("the backend got no datagram in 5 s")
		return nil
	}
}
