package httplb

import (
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// TestFailConnWaitEnds: a side of a failConn that waits for the other's
// operation under way (its own failed on a socket the kernel closed, and the
// other may yet hear ETIMEDOUT) goes on when that operation ends well too: a
// read that found bytes, such as those of an answer a backend sent before
// it reset the connection. Otherwise the waiting side, http.Transport's
// writer or reader, would wait for ever.
func TestFailConnWaitEnds(t *testing.T) {
	cc, peer := tcpPair(t)
	fc := newFailConn(cc.Conn) // the plain loopback connection

	read := make(chan error, 1)
	// Exits when the peer's byte comes, or when the cleanup closes c.
	go func() {
		_, err := fc.Read(make([]byte, 1))
		read <- err
	}()
	busy := func() bool {
		fc.mu.Lock()
		defer fc.mu.Unlock()
		return fc.busy[0]
	}
	if !waitfor.Cond(10*time.Second, busy) {
		t.Fatal("the read never began")
	}
	// The waiter takes over the lock the test takes here; cond.Wait lets it
	// go, so the test can take it again once the waiter waits.
	fc.mu.Lock()
	waited := make(chan struct{})
	// Exits when the read has ended, or by the cleanup's broadcast.
	go func() {
		fc.await(0)
		fc.mu.Unlock()
		close(waited)
	}()
	t.Cleanup(func() {
		fc.mu.Lock()
		fc.busy[0] = false
		fc.cond.Broadcast()
		fc.mu.Unlock()
		<-waited
	})
	waiting := func() bool {
		if !fc.mu.TryLock() {
			return false
		}
		fc.mu.Unlock()
		return true
	}
	if !waitfor.Cond(10*time.Second, waiting) {
		t.Fatal("the waiter never waited")
	}

	if _, err := peer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-read:
		if err != nil {
			t.Fatalf("read: got %v; want the peer's byte", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the read did not end")
	}
	select {
	case <-waited:
	case <-time.After(10 * time.Second):
		t.Fatal("the side waiting for the read still waits after it ended")
	}
}
