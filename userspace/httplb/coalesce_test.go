package httplb

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// tcpPair is a real loopback TCP connection: the client end wrapped, the
// server end raw.
func tcpPair(t testing.TB) (*coalescingConn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return newCoalescingConn(c, true), s
}

func TestCoalescingConn(t *testing.T) {
	for _, c := range []struct {
		name             string
		writers, records int
		size             int
	}{
		{"one writer", 1, 2000, 100},
		{"eight writers", 8, 500, 100},
		{"records past the limit", 4, 20, coalesceLimit / 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			cc, peer := tcpPair(t)
			got := make(chan []byte, 1)
			// Exits at EOF, when cc is closed below.
			go func() {
				b, _ := io.ReadAll(peer)
				got <- b
			}()
			var wg sync.WaitGroup
			for w := range c.writers {
				wg.Go(func() {
					for i := range c.records {
						// One Write per record, as a framer writes a frame: a
						// record must come out whole and in its writer's order.
						rec := fmt.Appendf(nil, "%d:%d:", w, i)
						rec = append(rec, bytes.Repeat([]byte{'a' + byte(w)}, c.size)...)
						rec = append(rec, '\n')
						if _, err := cc.Write(rec); err != nil {
							t.Error(err)
							return
						}
					}
				})
			}
			wg.Wait()
			if err := cc.Close(); err != nil {
				t.Fatal(err)
			}
			next := make([]int, c.writers)
			for line := range bytes.Lines(<-got) {
				var w, i int
				if _, err := fmt.Sscanf(string(line), "%d:%d:", &w, &i); err != nil || w >= c.writers {
					t.Fatalf("record %.40q: not one a writer wrote", line)
				}
				if i != next[w] || len(line) != len(fmt.Sprintf("%d:%d:", w, i))+c.size+1 {
					t.Fatalf("writer %d: record %d (%d bytes) where %d was due", w, i, len(line), next[w])
				}
				next[w]++
			}
			for w, n := range next {
				if n != c.records {
					t.Errorf("writer %d: %d records arrived; want %d (Close must send what is queued)", w, n, c.records)
				}
			}
		})
	}
}

// A peer that reads nothing: Writes stop at the limit (back-pressure), Close
// returns at once and the socket closes within about drainWait.
func TestCoalescingConnPeerNotReading(t *testing.T) {
	cc, peer := tcpPair(t)
	blocked := make(chan struct{})
	// Exits when Close fails its write.
	go func() {
		defer close(blocked)
		rec := make([]byte, 64<<10)
		for {
			if _, err := cc.Write(rec); err != nil {
				return
			}
		}
	}()
	select {
	case <-blocked:
		t.Fatal("Write failed before the peer's window and the queue were full")
	case <-time.After(300 * time.Millisecond):
	}
	cc.mu.Lock()
	queued := len(cc.buf)
	cc.mu.Unlock()
	if queued > coalesceLimit {
		t.Errorf("%d bytes queued; want at most %d", queued, coalesceLimit)
	}
	start := time.Now()
	cc.Close()
	if d := time.Since(start); d > drainWait+time.Second {
		t.Errorf("Close took %v; want about %v", d, drainWait)
	}
	select {
	case <-blocked:
	case <-time.After(5 * time.Second):
		t.Fatal("the writer still blocked after Close")
	}
	// Whether the queue went out or its write timed out, the socket closes.
	peer.SetReadDeadline(time.Now().Add(drainWait + 5*time.Second))
	if _, err := io.Copy(io.Discard, peer); isTimeout(err) {
		t.Errorf("the socket is still open %v after Close: %v", drainWait+5*time.Second, err)
	}
}

// A served connection queues its writes only once its first read shows the
// HTTP/2 preface, in as short a read as net/http makes.
func TestCoalescingConnSniff(t *testing.T) {
	for _, c := range []struct {
		name  string
		send  string
		read  int
		async bool
	}{
		{"h2 preface, net/http's first short read", http2.ClientPreface, len("PRI * HTTP/2.0"), true},
		{"h2 preface whole", http2.ClientPreface, 4096, true},
		{"HTTP/1.1", "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 4096, false},
		{"a method that starts like it", "PUT / HTTP/1.1\r\nHost: x\r\n\r\n", 4096, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			client, raw := tcpPair(t)
			served := newCoalescingConn(raw, false)
			if _, err := client.Write([]byte(c.send)); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadAtLeast(served, make([]byte, c.read), min(c.read, len(c.send))); err != nil {
				t.Fatal(err)
			}
			served.mu.Lock()
			async := served.async
			served.mu.Unlock()
			if async != c.async {
				t.Errorf("queues writes: %v; want %v", async, c.async)
			}
		})
	}
}
