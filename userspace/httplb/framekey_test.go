package httplb

import (
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/weir-lb/weir/userspace/balance"
)

// TestFramesRetryKeyHashesHost: a request over HTTP/2 whose retry a reload
// gave a configuration that hashes by Host picks the backend its :authority
// maps to, as a request sent after the reload does. (The key was once looked
// for among the regular fields, where HTTP/2 has no Host: it hashed the
// client's address instead.)
func TestFramesRetryKeyHashesHost(t *testing.T) {
	named := func(name string) Backend {
		b, _ := h2cBackend(t, 0, func(w http.ResponseWriter, r *http.Request) { w.Header().Set("X-B", name) })
		return b
	}
	bs := []Backend{named("a"), named("b"), named("c")}
	hashed := Config{Algorithm: balance.Maglev, Hash: HashHeader, HashName: "host", Retries: 1, RetryBudget: 1}
	// A host the hash sends to another backend than the client's address.
	probe := serveOn(t, hashed, bs)
	byAddr := h2Answer(t, probe.Addr().String(), "")
	host, want := "", ""
	for i := 0; i < 64 && host == ""; i++ {
		h := fmt.Sprintf("h%d.example", i)
		if got := h2Answer(t, probe.Addr().String(), h); got != byAddr {
			host, want = h, got
		}
	}
	if host == "" {
		t.Fatalf("every host went to %s, as the probe's own address does", byAddr)
	}

	g := newGate(t)
	var refusing Backend
	refusing.Addr = rawH2Backend(t, func(_ net.Conn, fr *http2.Framer) {
		readBackendFrames(fr, func(f *http2.HeadersFrame) {
			g.came <- refusing.Addr
			<-g.held
			fr.WriteRSTStream(f.StreamID, http2.ErrCodeRefusedStream)
		}, func(string) bool { return true })
	})
	refusing.Weight, refusing.Usable = 1, true
	sv := serveStoppable(t, Config{Algorithm: balance.RoundRobin, Retries: 1, RetryBudget: 1}, []Backend{refusing})
	got := make(chan string, 1)
	// Exits once the request is answered or its read fails (the deadline).
	go func() { got <- h2Answer(t, sv.Addr().String(), host) }()
	g.wait(t)
	cfg := sv.cfg
	cfg.Algorithm, cfg.Hash, cfg.HashName = hashed.Algorithm, hashed.Hash, hashed.HashName
	if err := sv.Reconfigure(cfg, bs); err != nil {
		t.Fatal(err)
	}
	g.open()
	if a := <-got; a != want {
		t.Errorf("the retry with host %q went to %q; want %q, where the hash sends it", host, a, want)
	}
	if a := h2Answer(t, sv.Addr().String(), host); a != want {
		t.Errorf("a request with host %q after the reload went to %q; want %q, as on the probe", host, a, want)
	}
}

// h2Answer sends GET / to addr over HTTP/2 by prior knowledge, with host as
// its :authority if set (addr if not), and returns the answer's X-B (which
// backend answered), or what came instead.
func h2Answer(t *testing.T, addr, host string) string {
	conn, fr := h2Conn(t, addr)
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	authority := addr
	if host != "" {
		authority = host
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: h2Get(authority), EndHeaders: true, EndStream: true}); err != nil {
		return "write: " + err.Error()
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return "read: " + err.Error()
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
			}
		case *http2.MetaHeadersFrame:
			if f.StreamID == 1 {
				if b := f.PseudoValue("status"); b != "200" {
					return "status " + b
				}
				for _, hf := range f.RegularFields() {
					if hf.Name == "x-b" {
						return hf.Value
					}
				}
				return "no x-b"
			}
		case *http2.RSTStreamFrame:
			return "RST_STREAM " + f.ErrCode.String()
		case *http2.GoAwayFrame:
			return "GOAWAY " + f.ErrCode.String()
		}
	}
}

// TestHashKeyAllocs: a request's hash key by a header, named in any case,
// allocates nothing on either protocol: the name is worked out once per
// configuration, not compared, canonicalised or lowered per request.
func TestHashKeyAllocs(t *testing.T) {
	for _, name := range []string{"Host", "host", "x-request-id", "X-Request-ID"} {
		cfg := Config{Algorithm: balance.Maglev, Hash: HashHeader, HashName: name}
		l := &live{cfg: cfg, hash: newHashBy(&cfg)}
		r := &http.Request{Host: "a.example", Header: http.Header{"X-Request-Id": {"42"}}, RemoteAddr: "192.0.2.1:1234"}
		if n := testing.AllocsPerRun(100, func() { l.hashKey(r) }); n != 0 {
			t.Errorf("header:%s, HTTP/1.1: got %v allocations per request; want 0", name, n)
		}
		st := &fstream{authority: "a.example"}
		regular := []hpack.HeaderField{{Name: "x-request-id", Value: "42"}}
		if n := testing.AllocsPerRun(100, func() { st.key(&l.hash, regular, nil) }); n != 0 {
			t.Errorf("header:%s, HTTP/2: got %v allocations per request; want 0", name, n)
		}
	}
}
