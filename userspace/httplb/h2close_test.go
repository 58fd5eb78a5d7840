package httplb

import (
	"net"
	"net/http"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// TestIdleBackendCloseSendsGoAway: weir's HTTP/2 connections to a backend end
// with GOAWAY NO_ERROR when weir closes them idle, as it does when the service
// stops or a reload removes the backend (RFC 9113 6.8), not with a bare FIN:
// those of HTTP/1.1 clients' requests (Go's HTTP/2 transport) and those of
// HTTP/2 clients' (the frame engine).
func TestIdleBackendCloseSendsGoAway(t *testing.T) {
	for _, c := range []struct {
		name   string
		client *http.Client
		close  func(sv *served) error
	}{
		{"HTTP/1.1 client/stop", h1Client(), stop},
		{"HTTP/1.1 client/reload without the backend", h1Client(), removeBackends},
		{"HTTP/2 client/stop", h2cClient(), stop},
		{"HTTP/2 client/reload without the backend", h2cClient(), removeBackends},
	} {
		t.Run(c.name, func(t *testing.T) {
			last := make(chan string, 1)
			be := rawH2Backend(t, func(conn net.Conn, fr *http2.Framer) {
				for {
					f, err := fr.ReadFrame()
					if err != nil {
						last <- "read: " + err.Error()
						return
					}
					switch f := f.(type) {
					case *http2.SettingsFrame:
						if !f.IsAck() {
							fr.WriteSettingsAck()
						}
					case *http2.HeadersFrame:
						fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: statusBlock("200"), EndHeaders: true})
						fr.WriteData(f.StreamID, true, []byte("ok"))
					case *http2.GoAwayFrame:
						last <- "GOAWAY " + f.ErrCode.String()
						return
					}
				}
			})
			sv := serveStoppable(t, Config{Upstream: UpstreamH2C}, []Backend{{Addr: be, Weight: 1, Usable: true}})
			resp, body := get(t, c.client, "http://"+sv.Addr().String()+"/")
			if resp.StatusCode != http.StatusOK || body != "ok" {
				t.Fatalf("GET: %s %q; want 200 ok", resp.Status, body)
			}
			if err := c.close(sv); err != nil {
				t.Fatal(err)
			}
			select {
			case g := <-last:
				if g != "GOAWAY NO_ERROR" {
					t.Errorf("the backend's connection ended with %s; want GOAWAY NO_ERROR", g)
				}
			case <-time.After(15 * time.Second):
				t.Error("the backend's connection still open 15s after weir closed it")
			}
		})
	}
}

func stop(sv *served) error {
	sv.stop()
	<-sv.done
	return nil
}

func removeBackends(sv *served) error { return sv.SetBackends(nil) }
