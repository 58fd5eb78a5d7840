package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/weir-lb/weir/internal/sockfd"
)

// TestUserTimeoutSockets checks with getsockopt, on both of the proxy's sockets
// of a proxied connection, that the configured TCP_USER_TIMEOUT is what the
// kernel holds: the client's set on the listener and inherited by the
// accepted socket (the kernel copies it to the sockets it clones), the
// backend's set on the dialed one, rounded up to milliseconds; and that
// without it neither socket has one.
func TestUserTimeoutSockets(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		client, backend       time.Duration
		wantClient, wantBackd time.Duration
		ip                    string // the listener's and the backend's; "" 127.0.0.1
	}{
		{"off", 0, 0, 0, 0, ""},
		{"on", 30 * time.Second, 2500 * time.Microsecond, 30 * time.Second, 3 * time.Millisecond, ""},
		{"on, IPv6", 1234 * time.Millisecond, 5 * time.Second, 1234 * time.Millisecond, 5 * time.Second, "::1"},
		{"client only", 7 * time.Second, 0, 7 * time.Second, 0, ""},
		{"backend only", 0, 9 * time.Second, 0, 9 * time.Second, "::1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, backend := proxiedSockets(t, tc.ip, Config{ClientUserTimeout: tc.client, BackendUserTimeout: tc.backend})
			if got, err := sockfd.UserTimeoutOf(client); err != nil || got != tc.wantClient {
				t.Errorf("client side: got %v, %v; want %v", got, err, tc.wantClient)
			}
			if got, err := sockfd.UserTimeoutOf(backend); err != nil || got != tc.wantBackd {
				t.Errorf("backend side: got %v, %v; want %v", got, err, tc.wantBackd)
			}
		})
	}
}

// TestListenFromUserTimeout: a service that takes listening sockets over sets
// its client user timeout on them, turning it off where the old service had
// one, and Reclaim gives the old service's back once the new one is given up.
func TestListenFromUserTimeout(t *testing.T) {
	for _, tc := range []struct {
		name     string
		old, new time.Duration
	}{{"set to off", 5 * time.Second, 0}, {"off to set", 0, 1500 * time.Millisecond}, {"set to another", time.Second, time.Minute}} {
		t.Run(tc.name, func(t *testing.T) {
			takeOverAndReclaim(t, func(cfg *Config, old bool) {
				cfg.ClientUserTimeout = tc.new
				if old {
					cfg.ClientUserTimeout = tc.old
				}
			}, func(fd int, old bool) error {
				got, err := sockfd.UserTimeoutOf(fd)
				want := tc.new
				if old {
					want = tc.old
				}
				if err != nil || got != want {
					return fmt.Errorf("the listening socket's user timeout got %v, %v; want %v", got, err, want)
				}
				return nil
			})
		})
	}
}

// TestUserTimeoutVanishedClient: bytes the proxy sends to a client whose host
// vanished without a FIN or a reset (its link goes down) stay unacknowledged;
// with a client user timeout the connection ends about that long after, where
// keepalive would not probe (there are bytes in flight) and the kernel
// retransmits for net.ipv4.tcp_retries2. Without it, the connection stays.
func TestUserTimeoutVanishedClient(t *testing.T) {
	for _, how := range []string{"open", "half-closed", "answered"} {
		t.Run(how, func(t *testing.T) {
			vanishedClient(t, func(cfg *Config) { cfg.ClientUserTimeout = time.Second }, true, how)
		})
	}
}

// TestUserTimeoutVanishedBackend: bytes the proxy sends to a backend whose
// host vanished (nftables drops every packet to and from its port) stay
// unacknowledged; with a backend user timeout the connection ends about that
// long after: the client gets a reset, the slot is freed, and the backend is
// blamed for a reset (Resets, the Observer), as keepalive's failure is. A
// service without it still holds its connection a second after that.
//
// In a network namespace of its own, for its nftables rules.
func TestUserTimeoutVanishedBackend(t *testing.T) {
	if !inOwnNetns(t, nil) {
		return
	}
	vanishedBackend(t, func(cfg *Config) { cfg.BackendUserTimeout = time.Second }, true)
}
