package admin

import (
	"context"
	"errors"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestClientGivenUp: a request the caller cancels (Ctrl-C in weir demo fleet, which
// asks the nodes' agents while it runs) fails with the cancellation and without
// the hint that no agent may be running, which is for a socket nobody answers on.
func TestClientGivenUp(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "weir.sock")
	l, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	arrived := make(chan struct{}, 1)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done() // an agent busy past the caller's patience
	})}
	served := make(chan struct{})
	go func() { defer close(served); srv.Serve(l) }() // exits when Close closes l
	t.Cleanup(func() {
		srv.Close()
		<-served
	})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { _, err := NewClient(sock).Status(ctx); errc <- err }() // exits when Status returns
	select {
	case <-arrived:
	case <-time.After(20 * time.Second):
		t.Fatal("the request did not reach the server within 20s")
	}
	cancel()
	err = <-errc
	if !errors.Is(err, context.Canceled) || strings.Contains(err.Error(), "is weir running") {
		t.Errorf("cancelled: got %v; want context.Canceled without the is-weir-running hint", err)
	}

	_, err = NewClient(filepath.Join(t.TempDir(), "none.sock")).Status(context.Background())
	if err == nil || !strings.Contains(err.Error(), "is weir running") {
		t.Errorf("no socket: got %v; want the is-weir-running hint", err)
	}
}
