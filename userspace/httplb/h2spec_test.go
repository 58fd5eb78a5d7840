package httplb

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/summerwind/h2spec/client"
	"github.com/summerwind/h2spec/config"
	"github.com/summerwind/h2spec/generic"
	"github.com/summerwind/h2spec/hpack"
	h2spechttp2 "github.com/summerwind/h2spec/http2"
	"github.com/summerwind/h2spec/spec"

	"github.com/weir-lb/weir/internal/httpbackend"
)

// TestH2Spec runs h2spec's conformance cases (its generic, RFC 7540 and
// HPACK groups, strict ones included) against the frame engine, over
// cleartext with prior knowledge and over TLS with ALPN. Every case must
// pass but one: on a cleartext port, which serves HTTP/1.1 too, bytes that
// are not the HTTP/2 preface are an HTTP/1.1 request, so "INVALID CONNECTION
// PREFACE" gets HTTP/1.1's 400 where h2spec wants the connection closed
// without a word (over TLS, where ALPN chose h2, it is closed).
func TestH2Spec(t *testing.T) {
	cert, err := tls.X509KeyPair(testCert, testKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name       string
		tls        *tls.Config
		mayFail    []string
		minPassing int
	}{
		{name: "cleartext", mayFail: []string{"http2/3.5/2"}, minPassing: 145},
		{name: "tls", tls: &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}, minPassing: 145},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := httpbackend.StartN(t, 2)
			s := serve(t, Config{TLS: tc.tls}, bs)
			addr := netip.MustParseAddrPort(s.Addr().String())
			// An answer of 64 bytes: one case skips itself for answers under 5.
			c := &config.Config{Host: addr.Addr().String(), Port: int(addr.Port()), Path: "/?size=64",
				Timeout: 2 * time.Second, MaxHeaderLen: 4000, Strict: true, TLS: tc.tls != nil, Insecure: true}
			passed, failed := 0, map[string]string{}
			for _, g := range []*spec.TestGroup{generic.Spec(), h2spechttp2.Spec(), hpack.Spec()} {
				runH2Spec(t, c, g, func(id string, r *spec.TestResult) {
					switch {
					case r.Failed:
						failed[id] = fmt.Sprintf("%s: %v", r.TestCase.Desc, r.Error)
					case !r.Skipped:
						passed++
					}
				})
			}
			for id, why := range failed {
				if !slices.Contains(tc.mayFail, id) {
					t.Errorf("h2spec %s failed: %s", id, why)
				}
			}
			t.Logf("%d h2spec cases passed, %d failed", passed, len(failed))
			if passed < tc.minPassing {
				t.Errorf("%d h2spec cases passed; want at least %d", passed, tc.minPassing)
			}
		})
	}
}

// runH2Spec runs the cases of g and its subgroups one by one, calling f with
// each one's ID (group/sequence, as h2spec's -h flag and report name it) and
// result. It does what h2spec's TestGroup.Test does, except that a case
// that cannot connect fails the test instead of exiting the process.
func runH2Spec(t *testing.T, c *config.Config, g *spec.TestGroup, f func(id string, r *spec.TestResult)) {
	for i, tc := range append(slices.Clone(g.Tests), g.StrictTests...) {
		id := fmt.Sprintf("%s/%d", g.ID(), i+1)
		if err := tc.Test(c, i+1); err != nil {
			t.Errorf("h2spec %s: %v", id, err)
			continue
		}
		if tc.Result != nil {
			f(id, tc.Result)
		}
	}
	for _, sub := range g.Groups {
		runH2Spec(t, c, sub, f)
	}
}

// TestH2SpecUpstream runs h2spec's client cases against the frame engine's side
// towards backends: h2spec plays the backend, each case on a listener of its
// own, and an h2c client's request through weir makes weir connect to it. All
// 57 must pass, among them a backend's DATA or HEADERS on a stream after its
// end: after a reset either side sent, a stream error STREAM_CLOSED (a reset
// weir sent would have its late frames ignored, but h2spec resets the stream
// itself there); after END_STREAM both ways, a connection error STREAM_CLOSED.
func TestH2SpecUpstream(t *testing.T) {
	c := &config.Config{Host: "127.0.0.1", Timeout: 2 * time.Second, MaxHeaderLen: 4000}
	passed := 0
	var run func(g *spec.ClientTestGroup)
	run = func(g *spec.ClientTestGroup) {
		for _, tc := range g.Tests {
			id := fmt.Sprintf("%s/%d", g.ID(), tc.Seq)
			switch err := upstreamCase(t, c, tc); {
			case err == nil:
				passed++
			case err == spec.ErrSkipped:
			default:
				t.Errorf("h2spec %s (%s) failed: %v", id, tc.Desc, err)
			}
		}
		for _, sub := range g.Groups {
			run(sub)
		}
	}
	run(client.Spec())
	t.Logf("%d h2spec client cases passed", passed)
	if passed < 57 {
		t.Errorf("%d h2spec client cases passed; want 57", passed)
	}
}

// upstreamCase runs one h2spec client case as weir's backend and returns its
// result.
func upstreamCase(t *testing.T, c *config.Config, tc *spec.ClientTestCase) error {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	result := make(chan error, 1)
	// Exits when the case has run, or when ln closes.
	go func() {
		raw, err := ln.Accept()
		if err != nil {
			result <- err
			return
		}
		defer raw.Close()
		conn, err := spec.Accept(c, raw)
		if err != nil {
			result <- err
			return
		}
		result <- tc.Run(c, conn)
	}()
	be := Backend{Addr: ln.Addr().(*net.TCPAddr).AddrPort(), Weight: 1, Usable: true}
	s := serveStoppable(t, Config{Upstream: UpstreamH2C, TryTimeout: 3 * time.Second}, []Backend{be})
	defer s.stop()
	hc := h2cClient()
	hc.Timeout = 5 * time.Second
	defer hc.CloseIdleConnections()
	var wg sync.WaitGroup
	defer wg.Wait()
	// Exits within the client's timeout.
	wg.Go(func() {
		if resp, err := hc.Get("http://" + s.Addr().String() + "/"); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	})
	select {
	case err := <-result:
		return err
	case <-time.After(10 * time.Second):
		return fmt.Errorf("no result in 10s")
	}
}
