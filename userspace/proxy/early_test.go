package proxy

import (
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"
)

// TestEarlyBytesGoWithTheDial: a client whose bytes are in before the proxy accepts
// it (here held in the backlog while the service is at MaxConns) has them read
// before the backend is dialed (on the copy path; the kernel-forwarding run of the
// tests leaves them in the socket), and they reach the backend intact and first.
func TestEarlyBytesGoWithTheDial(t *testing.T) {
	b := startBackend(t, "b", netip.AddrPort{}, echo)
	s := startProxy(t, Config{Backends: []Backend{{Addr: b.addr()}}, MaxConns: 1})
	holder := dial(t, s)
	if err := roundTrip(holder, "holding the only slot\n"); err != nil {
		t.Fatal(err)
	}
	before := earlyReads.Load()
	waiting := dial(t, s)
	msg := "sent before the proxy accepted\n"
	if _, err := waiting.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	holder.Close()
	waiting.SetReadDeadline(time.Now().Add(5 * time.Second))
	if line, err := readLine(waiting); err != nil || line+"\n" != msg {
		t.Fatalf("echo of the early bytes: %q, %v; want %q", line, err, msg)
	}
	if err := roundTrip(waiting, "and then more\n"); err != nil {
		t.Fatalf("after the early bytes: %v", err)
	}
	if testRedirector == nil && earlyReads.Load() == before {
		t.Error("the waiting client's bytes were not read before the dial")
	}
}

// TestServerSpeaksFirst: a client that sends nothing gets the backend's greeting
// at once. The dial holds the handshake's last ACK back only when it has the
// client's bytes to send with it; held back with nothing to send, the ACK would
// wait for the kernel's 200 ms delayed-ACK timer, and so would the greeting.
func TestServerSpeaksFirst(t *testing.T) {
	b := startBackend(t, "greeter", netip.AddrPort{}, hello)
	s := startProxy(t, Config{Backends: []Backend{{Addr: b.addr()}}})
	var took []time.Duration
	for range 5 {
		start := time.Now()
		c, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		name, err := readLine(c)
		took = append(took, time.Since(start))
		c.Close()
		if err != nil || name != "greeter" {
			t.Fatalf("greeting: %q, %v", name, err)
		}
	}
	slices.Sort(took)
	// The median of five, against the 200 ms a held-back ACK costs every one of
	// them: a busy machine may stall one or two, not the middle one.
	if med := took[2]; med >= 150*time.Millisecond {
		t.Errorf("greetings took %v; the median %v is the delayed-ACK timer's", took, med)
	}
}
