package httplb

import "testing"

// The record answers by how a stream closed, and forgets the oldest once
// closedStreamsN more have closed since: a stream weir reset is then no longer
// told from one that closed otherwise.
func TestClosedStreamsLate(t *testing.T) {
	var c closedStreams
	c.note(1, resetByUs)
	c.note(3, resetByPeer)
	c.note(5, endedByPeer)
	c.note(7, endedBoth)
	for _, tc := range []struct {
		id   uint32
		want lateAnswer
	}{{1, lateIgnore}, {3, lateStreamClosed}, {5, lateStreamClosed}, {7, lateConnClosed}, {9, lateUnknown}} {
		if got := c.late(tc.id); got != tc.want {
			t.Errorf("late(%d) = %d; want %d", tc.id, got, tc.want)
		}
	}
	// The peer's reset after its END_STREAM closes weir's side too; late
	// frames are answered as before. Other entries stay as they were.
	c.peerReset(5)
	c.peerReset(1)
	if got := c.how(5); got != resetByPeer {
		t.Errorf("how(5) after the peer's reset = %d; want %d", got, resetByPeer)
	}
	if got := c.late(5); got != lateStreamClosed {
		t.Errorf("late(5) after the peer's reset = %d; want %d", got, lateStreamClosed)
	}
	if got := c.late(1); got != lateIgnore {
		t.Errorf("late(1) after a reset from the peer = %d; want %d", got, lateIgnore)
	}
	// One more than the ring holds: the first is forgotten, the second not.
	for i := range closedStreamsN - 3 {
		c.note(uint32(9+2*i), endedBoth)
	}
	if got := c.late(1); got != lateUnknown {
		t.Errorf("late(1) after %d more closed = %d; want %d (forgotten)", closedStreamsN, got, lateUnknown)
	}
	if got := c.late(3); got != lateStreamClosed {
		t.Errorf("late(3) = %d; want %d (still remembered)", got, lateStreamClosed)
	}
	if len(c.ring) != closedStreamsN {
		t.Errorf("the ring holds %d; want %d", len(c.ring), closedStreamsN)
	}
}
