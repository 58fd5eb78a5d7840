package httplb

// What a peer sends on a stream after it closed means different things by how
// it closed (RFC 9113 5.1): frames on a stream weir reset may have been on
// their way before the peer saw the reset, while a peer that closed a stream
// itself has no excuse. closedStreams remembers the last streams a
// connection closed and how, and says what a late DATA or HEADERS on one
// calls for. A client session (frames.go) and a backend connection
// (frames_up.go) each keep one.

// closeHow is how a stream closed.
type closeHow uint8

const (
	// resetByUs: weir's RST_STREAM closed the stream while the peer's side
	// was open. The peer may have sent frames before it saw the reset: they
	// are dropped (RFC 9113 5.1, "closed").
	resetByUs closeHow = iota + 1
	// resetByPeer: the peer's RST_STREAM closed it. DATA or HEADERS after it
	// is a stream error STREAM_CLOSED (RFC 7540 5.1; RFC 9113 6.1 for DATA).
	resetByPeer
	// endedByPeer: the peer's END_STREAM ended its side while weir's was
	// still open ("half-closed (remote)"), which weir then closed with a
	// reset. DATA or HEADERS after the peer's END_STREAM is a stream error
	// STREAM_CLOSED (RFC 9113 5.1, "half-closed (remote)", and 6.1).
	endedByPeer
	// endedBoth: END_STREAM went both ways. A frame the peer sends after its
	// own END_STREAM cannot have been on its way before anything weir did:
	// a connection error STREAM_CLOSED (RFC 7540 5.1 requires it, RFC 9113
	// 5.1 allows it).
	endedBoth
)

// lateAnswer is what a DATA or HEADERS frame on a closed stream calls for.
type lateAnswer uint8

const (
	lateUnknown      lateAnswer = iota // not remembered: the side's own default
	lateIgnore                         // dropped (its DATA's bytes still count against the connection's window)
	lateStreamClosed                   // the stream reset with STREAM_CLOSED
	lateConnClosed                     // GOAWAY STREAM_CLOSED and the connection closed
)

// closedStreamsN bounds the streams remembered: as many as a client may have
// open. Past it the oldest is forgotten, and a frame on it gets the side's
// default.
const closedStreamsN = maxClientStreams

// closedStreams is a ring of the streams a connection closed last, and how.
// The zero value is ready; its ring is made on first use. It is not safe for
// concurrent use: its connection's mutex guards it.
type closedStreams struct {
	ring []closedStream
	next int
}

type closedStream struct {
	id  uint32
	how closeHow
}

// note remembers that stream id closed, and how. A stream is noted once, when
// it closes.
func (c *closedStreams) note(id uint32, how closeHow) {
	e := closedStream{id: id, how: how}
	if len(c.ring) < closedStreamsN {
		c.ring = append(c.ring, e)
		return
	}
	c.ring[c.next] = e
	c.next = (c.next + 1) % closedStreamsN
}

// peerReset records the peer's RST_STREAM on stream id, closed already: one
// the peer had ended while weir's side was open (endedByPeer) is now closed
// on both sides, and weir sends nothing more on it (RFC 9113 5.1). Late
// frames on it are answered as before.
func (c *closedStreams) peerReset(id uint32) {
	if e := c.find(id); e != nil && e.how == endedByPeer {
		e.how = resetByPeer
	}
}

// weReset records weir's RST_STREAM on stream id, closing it or closed
// already: weir sends no other on it, and frames that come on it after are
// dropped (RFC 9113 5.1).
func (c *closedStreams) weReset(id uint32) {
	if e := c.find(id); e != nil {
		e.how = resetByUs
		return
	}
	c.note(id, resetByUs)
}

// how reports how stream id closed; 0 if it is not remembered.
func (c *closedStreams) how(id uint32) closeHow {
	if e := c.find(id); e != nil {
		return e.how
	}
	return 0
}

// find returns stream id's entry, nil if it is not remembered. A stream is
// noted once, so the first entry with its ID is its only one.
func (c *closedStreams) find(id uint32) *closedStream {
	for i := range c.ring {
		if c.ring[i].id == id {
			return &c.ring[i]
		}
	}
	return nil
}

// late says what a DATA or HEADERS frame on closed stream id calls for.
// PRIORITY, WINDOW_UPDATE and RST_STREAM on a closed stream are dropped
// whatever the answer: they may follow weir's END_STREAM or reset (RFC 9113
// 5.1), and a reset is never answered with one (RFC 9113 5.4.2).
func (c *closedStreams) late(id uint32) lateAnswer {
	switch c.how(id) {
	case resetByUs:
		return lateIgnore
	case resetByPeer, endedByPeer:
		return lateStreamClosed
	case endedBoth:
		return lateConnClosed
	}
	return lateUnknown
}
