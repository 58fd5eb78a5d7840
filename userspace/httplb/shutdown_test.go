package httplb

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/httpbackend"
	"github.com/weir-lb/weir/internal/waitfor"
)

// TestShutdownAnswersAccepted: a connection the service accepted before it
// began to shut down, whose request comes only after, is answered rather than
// closed unanswered: a client that connected while the service listened
// loses nothing, as when a replacement took the listening socket over and the
// old service stops.
func TestShutdownAnswersAccepted(t *testing.T) {
	bs := httpbackend.StartN(t, 1)
	sv := serveStoppable(t, Config{}, backendSet(bs))
	addr := sv.Addr().String()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if !waitfor.Cond(10*time.Second, func() bool { return sv.Snapshot().Accepted == 1 }) {
		t.Fatal("the connection was not accepted")
	}
	sv.stop()
	// The shutdown has begun once the listener is closed.
	if !waitfor.Cond(10*time.Second, func() bool {
		d, err := net.Dial("tcp", addr)
		if err == nil {
			d.Close()
		}
		return err != nil
	}) {
		t.Fatal("the listener was not closed")
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("read the answer: %v; want 200", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("got %d; want 200", resp.StatusCode)
	}
	<-sv.done
}
