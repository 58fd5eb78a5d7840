//go:build linux

package httplb

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/waitfor"
)

// FuzzUpgradeAnswers has a backend answer an upgrade to "echo" with arbitrary
// bytes, then end its sending side, over real sockets. What Go's response
// reader makes of those bytes, interim answers skipped as the plane skips them,
// is the oracle: a 101 switching to echo must reach the client with the bytes
// behind it and then the backend's end; a 101 to anything else, or an answer
// Go cannot read, a 502; another final answer must not open a tunnel. Whatever
// comes, nothing is left in flight once the client has gone.
//
//	go test -run '^$' -fuzz FuzzUpgradeAnswers -fuzztime 2m ./userspace/httplb/
func FuzzUpgradeAnswers(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\nbehind",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nX-A: 1\r\n\r\n",
		"HTTP/1.1 101 Switching Protocols\r\nUpgrade: other\r\n\r\n",
		"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nUpgrade: echo\r\n\r\n",
		"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo, other\r\nContent-Length: 3\r\n\r\nabc",
		"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 4\r\n\r\nnope",
		"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok",
		"not an answer\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	var answer atomic.Pointer[[]byte]
	be := rawBackend(f, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		c.Write(*answer.Load())
		c.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, br) // until weir closes its side
	})
	s := serveOn(f, Config{}, []Backend{{Addr: be, Weight: 1, Usable: true}})
	addr := s.Addr().String()
	f.Fuzz(func(t *testing.T, raw []byte) {
		answer.Store(&raw)
		req := &http.Request{Method: http.MethodGet}
		want, rest, broken, wantErr := upgradeAnswer(raw, req)
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		io.WriteString(conn, "GET /t HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, req)
		if err != nil {
			if broken {
				return // a final answer whose body broke off: the client gets it broken, or nothing
			}
			t.Fatalf("the client could not read its answer: %v\nbackend sent %q", err, raw)
		}
		switched := wantErr == nil && want.StatusCode == http.StatusSwitchingProtocols
		switch {
		case switched && len(want.Header["Upgrade"]) == 1 && strings.EqualFold(strings.TrimSpace(want.Header["Upgrade"][0]), "echo"):
			// Protocol names are compared without case, as WebSocket's is (RFC 6455 4.1).
			if resp.StatusCode != http.StatusSwitchingProtocols || !strings.EqualFold(resp.Header.Get("Upgrade"), "echo") {
				t.Fatalf("%s, Upgrade %q for a switch to echo\nbackend sent %q", resp.Status, resp.Header["Upgrade"], raw)
			}
			conn.(*net.TCPConn).CloseWrite()
			got, err := io.ReadAll(br)
			if err != nil || !bytes.Equal(got, rest) {
				t.Fatalf("through the tunnel: %q, %v; want %q and EOF\nbackend sent %q", got, err, rest, raw)
			}
		case wantErr != nil || switched:
			if resp.StatusCode != http.StatusBadGateway {
				t.Fatalf("%s for an answer that is no switch to echo (%v); want 502\nbackend sent %q", resp.Status, wantErr, raw)
			}
		default:
			if resp.StatusCode == http.StatusSwitchingProtocols {
				t.Fatalf("a switch for a final answer %d\nbackend sent %q", want.StatusCode, raw)
			}
			io.Copy(io.Discard, resp.Body)
		}
		conn.Close()
		waitfor.Value(t, 5*time.Second, "nothing in flight", func() (any, bool) {
			sn := s.Snapshot()
			return [3]int64{sn.Connections, sn.InFlight, sn.Tunnels}, sn.Connections == 0 && sn.InFlight == 0 && sn.Tunnels == 0
		})
	})
}

// upgradeAnswer is what Go's response reader makes of a backend's bytes
// answering an upgrade, interim answers skipped as http.Transport skips them:
// for a 101 the bytes behind it, for another final answer whether its body
// broke off.
func upgradeAnswer(raw []byte, req *http.Request) (resp *http.Response, rest []byte, broken bool, err error) {
	br := bufio.NewReader(bytes.NewReader(raw))
	for {
		resp, err = http.ReadResponse(br, req)
		if err == nil && resp.StatusCode < 100 {
			err = errors.New("status under 100") // Go reads any three digits; no client may get it
		}
		if err != nil || resp.StatusCode < 100 || resp.StatusCode > 199 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
	}
	switch {
	case err != nil:
	case resp.StatusCode == http.StatusSwitchingProtocols:
		rest, _ = io.ReadAll(br)
	default:
		_, berr := io.ReadAll(resp.Body)
		broken = berr != nil
	}
	return resp, rest, broken, err
}
