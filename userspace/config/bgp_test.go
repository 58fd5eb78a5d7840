package config

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"
)

const bgpBase = `bgp:
  asn: 65001
  router_id: 10.80.0.1
  peers:
  - {address: 10.80.0.254, asn: 65000%s}
services:
- name: web
  vip: 10.80.100.1:80
  bgp: {communities: ["65000:100", "65000:7"], med: 20}
  backends: [{address: 10.80.0.11:80}]
`

func TestBGPResolved(t *testing.T) {
	cfg, err := Parse([]byte(strings.Replace(bgpBase, "%s", ", hold_time: 3s, password: s3cret, multihop: 4", 1)))
	if err != nil {
		t.Fatal(err)
	}
	want := BGP{ASN: 65001, RouterID: netip.MustParseAddr("10.80.0.1"), DrainTimeout: DefaultBGPDrainTime,
		Peers: []Peer{{Address: netip.MustParseAddr("10.80.0.254"), ASN: 65000, Port: 179, Password: "s3cret",
			HoldTime: 3 * time.Second, Keepalive: time.Second, Multihop: 4}}}
	if !reflect.DeepEqual(cfg.BGP, want) {
		t.Errorf("bgp: got %+v; want %+v", cfg.BGP, want)
	}
	wantA := Announce{Enabled: true, Communities: []uint32{65000<<16 | 100, 65000<<16 | 7}, MED: 20}
	if got := cfg.Services[0].BGP; !reflect.DeepEqual(got, wantA) {
		t.Errorf("services[0].bgp: got %+v; want %+v", got, wantA)
	}
	cfg, err = Parse([]byte(strings.Replace(bgpBase, "%s", "", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if p := cfg.BGP.Peers[0]; p.HoldTime != DefaultHoldTime || p.Keepalive != 30*time.Second {
		t.Errorf("default timers: got hold %v keepalive %v; want 90s and 30s", p.HoldTime, p.Keepalive)
	}
	// Without a bgp section nothing is announced, whatever the service says.
	cfg, err = Parse([]byte("services:\n- name: a\n  vip: 192.0.2.1:443\n  backends: [{address: 192.0.2.10:443}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.BGP.ASN != 0 || cfg.Services[0].BGP.Enabled {
		t.Errorf("no bgp section: got %+v, service %+v; want both zero", cfg.BGP, cfg.Services[0].BGP)
	}
}

func TestBGPErrors(t *testing.T) {
	for _, c := range []struct {
		name, file, want string
	}{
		{"no asn", "bgp: {router_id: 10.0.0.1, peers: [{address: 10.0.0.2, asn: 1}]}\n", "line 1: bgp.asn: missing"},
		{"v6 router id", "bgp: {asn: 1, router_id: 'fd00::1', peers: [{address: 10.0.0.2, asn: 1}]}\n", "bgp.router_id: must be an IPv4 address"},
		// An IPv6 router ID is refused for being IPv6, whatever kind: the fix is an
		// IPv4 address, not another IPv6 one.
		{"link-local router id", "bgp: {asn: 1, router_id: 'fe80::1', peers: [{address: 10.0.0.2, asn: 1}]}\n", "line 1: bgp.router_id: must be an IPv4 address (BGP identifiers are 32 bits), got fe80::1"},
		{"no peers", "bgp: {asn: 1, router_id: 10.0.0.1}\n", "bgp.peers: missing"},
		// A BGP identifier is never 0 (RFC 6286); routes and sessions need an address to go to.
		{"zero router id", "bgp: {asn: 1, router_id: 0.0.0.0, peers: [{address: 10.0.0.2, asn: 1}]}\n", "line 1: bgp.router_id: must not be 0.0.0.0"},
		{"unspecified peer", "bgp: {asn: 1, router_id: 10.0.0.1, peers: [{address: 0.0.0.0, asn: 1}]}\n", "line 1: bgp.peers[0].address: must be a unicast address, got 0.0.0.0"},
		{"multicast peer", "bgp: {asn: 1, router_id: 10.0.0.1, peers: [{address: 'ff02::5', asn: 1}]}\n", "line 1: bgp.peers[0].address: must be a unicast address, got ff02::5"},
		{"link-local peer", "bgp: {asn: 1, router_id: 10.0.0.1, peers: [{address: 'fe80::2', asn: 1}]}\n", "line 1: bgp.peers[0].address: fe80::2 is an IPv6 link-local address"},
		{"link-local next hop", "bgp: {asn: 1, router_id: 10.0.0.1, next_hop: ['fe80::1'], peers: [{address: 10.0.0.2, asn: 1}]}\n", "line 1: bgp.next_hop[0]: fe80::1 is an IPv6 link-local address"},
		{"unspecified next hop", "bgp: {asn: 1, router_id: 10.0.0.1, next_hop: ['::'], peers: [{address: 10.0.0.2, asn: 1}]}\n", "line 1: bgp.next_hop[0]: must be a unicast address, got ::"},
		{"short hold", "bgp:\n  asn: 1\n  router_id: 10.0.0.1\n  peers:\n  - {address: 10.0.0.2, asn: 2, hold_time: 2s}\n", "line 5: bgp.peers[0].hold_time: must be 3s..65535s"},
		{"hold 0", "bgp:\n  asn: 1\n  router_id: 10.0.0.1\n  peers:\n  - {address: 10.0.0.2, asn: 2, hold_time: 0s}\n", "line 5: bgp.peers[0].hold_time: must be 3s..65535s: weir's BGP speaker cannot propose 0"},
		{"keepalive over hold", "bgp:\n  asn: 1\n  router_id: 10.0.0.1\n  peers:\n  - {address: 10.0.0.2, asn: 2, hold_time: 3s, keepalive: 3s}\n", "bgp.peers[0].keepalive: must be whole seconds, at least 1s and below hold_time (3s)"},
		{"duplicate peer", "bgp:\n  asn: 1\n  router_id: 10.0.0.1\n  peers:\n  - {address: 10.0.0.2, asn: 2}\n  - {address: 10.0.0.2, asn: 3}\n", "line 6: bgp.peers[1].address: 10.0.0.2 is already bgp.peers[0]"},
		{"bad port", "bgp:\n  asn: 1\n  router_id: 10.0.0.1\n  peers: [{address: 10.0.0.2, asn: 2, port: 70000}]\n", "bgp.peers[0].port: must be 1..65535, got 70000"},
		{"bad listen port", "bgp: {asn: 1, router_id: 10.0.0.1, listen_port: -1, peers: [{address: 10.0.0.2, asn: 2}]}\n", "bgp.listen_port: must be 0"},
		{"two v4 next hops", "bgp: {asn: 1, router_id: 10.0.0.1, next_hop: [10.0.0.1, 10.0.0.3], peers: [{address: 10.0.0.2, asn: 2}]}\n", "bgp.next_hop[1]: one next hop per address family"},
		{"bad multihop", "bgp: {asn: 1, router_id: 10.0.0.1, peers: [{address: 10.0.0.2, asn: 2, multihop: 300}]}\n", "bgp.peers[0].multihop: must be 0"},
		{"unknown field", "bgp: {asn: 1, router_id: 10.0.0.1, peer: [{address: 10.0.0.2, asn: 2}]}\n", "bgp.peer: unknown field; did you mean \"peers\"?"},
		{"bad community", "bgp: {asn: 1, router_id: 10.0.0.1, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- name: a\n  vip: 10.1.0.1:80\n  bgp: {communities: [65000:70000]}\n  backends: [{address: 10.1.0.2:80}]\n",
			"line 5: services[0].bgp.communities[0]: must be ASN:value"},
		{"v6 vip without v6 next hop", "bgp: {asn: 1, router_id: 10.0.0.1, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- name: a\n  vip: '[fd00::1]:80'\n  backends: [{address: '[fd00::2]:80'}]\n",
			"services[0].bgp: the IPv6 VIP fd00::1 has no next hop to be announced with"},
		{"shared vip, two policies", "bgp: {asn: 1, router_id: 10.0.0.1, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- name: a\n  vip: 10.1.0.1:80\n  bgp: {med: 1}\n  backends: [{address: 10.1.0.2:80}]\n- name: b\n  vip: 10.1.0.1:443\n  bgp: {med: 2}\n  backends: [{address: 10.1.0.2:443}]\n",
			"services[1].bgp: services[0] announces the same address 10.1.0.1 with another policy"},
		// The speaker listens on listen_port at every address, without SO_REUSEPORT:
		// no other listener of the agent can bind that port.
		{"listen_port on a proxy VIP", "bgp: {asn: 1, router_id: 10.0.0.1, listen_port: 179, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- name: a\n  vip: 10.1.0.1:179\n  data_plane: proxy\n  backends: [{address: 10.1.0.2:80}]\n",
			"line 4: services[0].vip: 10.1.0.1:179 is also bgp.listen_port ([::]:179), where the agent listens itself"},
		{"listen_port on a proxy listen", "bgp: {asn: 1, router_id: 10.0.0.1, listen_port: 1179, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- name: a\n  vip: 10.1.0.1:80\n  proxy:\n    listen: 127.0.0.1:1179\n  backends: [{address: 10.1.0.2:80}]\n",
			"line 6: services[0].proxy.listen: 127.0.0.1:1179 is also bgp.listen_port ([::]:1179)"},
		{"listen_port on an http listen", "bgp: {asn: 1, router_id: 10.0.0.1, listen_port: 1179, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- name: a\n  vip: '[fd00::1]:1179'\n  data_plane: http\n  backends: [{address: '[fd00::2]:80'}]\n",
			"services[0].vip: [fd00::1]:1179 is also bgp.listen_port ([::]:1179)"},
		{"listen_port on metrics.listen", "metrics: {listen: 127.0.0.1:1179}\nbgp: {asn: 1, router_id: 10.0.0.1, listen_port: 1179, peers: [{address: 10.0.0.2, asn: 2}]}\n",
			"line 1: metrics.listen: 127.0.0.1:1179 is also bgp.listen_port ([::]:1179)"},
		// Left out, metrics.listen is 127.0.0.1:9470: the clash is the written field's.
		{"listen_port on the default metrics.listen", "bgp:\n  asn: 1\n  router_id: 10.0.0.1\n  listen_port: 9470\n  peers: [{address: 10.0.0.2, asn: 2}]\n",
			"line 4: bgp.listen_port: [::]:9470 is also the default metrics.listen (127.0.0.1:9470): set metrics.listen to another address (or off)"},
		{"listen_port on admin.listen", "admin: {listen: 127.0.0.1:1179}\nbgp: {asn: 1, router_id: 10.0.0.1, listen_port: 1179, peers: [{address: 10.0.0.2, asn: 2}]}\n",
			"line 1: admin.listen: 127.0.0.1:1179 is also bgp.listen_port ([::]:1179)"},
		// XDP takes the tcp packets to an xdp VIP before the speaker's listener
		// could: at the node's own address, where peers dial the speaker, that is
		// every session.
		{"xdp VIP on the router id at listen_port", "interfaces: [{name: eth0}]\nbgp: {asn: 1, router_id: 10.0.0.1, listen_port: 179, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- name: a\n  vip: 10.0.0.1:179\n  backends: [{address: 10.1.0.2:179}]\n",
			"line 5: services[0].vip: 10.0.0.1:179 is the node's own address (bgp.router_id) at bgp.listen_port, where BGP peers reach the speaker"},
		{"xdp VIP on an own address at listen_port", "interfaces: [{name: eth0}]\naddresses: [10.0.0.9]\nbgp: {asn: 1, router_id: 10.0.0.1, listen_port: 1179, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- {name: a, vip: 10.0.0.9:1179, data_plane: xdp, mode: dsr, backends: [{address: 10.1.0.2:1179, mac: '02:00:00:00:00:01'}]}\n",
			"line 5: services[0].vip: 10.0.0.9:1179 is the node's own address (addresses[0])"},
		{"xdp VIP on the next hop at listen_port", "interfaces: [{name: eth0}]\nbgp: {asn: 1, router_id: 10.0.0.1, listen_port: 179, next_hop: ['fd00::7'], peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n- {name: a, vip: '[fd00::7]:179', backends: [{address: '[fd00::8]:179'}]}\n",
			"line 4: services[0].vip: [fd00::7]:179 is the node's own address (bgp.next_hop[0])"},
		{"policy without bgp", "services:\n- name: a\n  vip: 10.1.0.1:80\n  bgp: {med: 1}\n  backends: [{address: 10.1.0.2:80}]\n", "services[0].bgp: an announce policy needs the top-level bgp section"},
	} {
		t.Run(c.name, func(t *testing.T) {
			file := c.file
			if !strings.Contains(file, "services:") {
				file += "services:\n- name: a\n  vip: 10.1.0.1:80\n  backends: [{address: 10.1.0.2:80}]\n"
			}
			_, err := Parse([]byte(file))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v; want an error containing %q", err, c.want)
			}
		})
	}
}

// TestBGPListenPortOthers: what does not bind the speaker's port is let be: a
// listener on another port, an xdp service's VIP on it at an address that is
// not the node's own (peers do not dial it), a udp VIP at the node's own, and
// an xdp VIP there on another port.
func TestBGPListenPortOthers(t *testing.T) {
	_, err := Parse([]byte("interfaces: [{name: eth0}]\nbgp: {asn: 1, router_id: 10.0.0.1, listen_port: 179, peers: [{address: 10.0.0.2, asn: 2}]}\nservices:\n" +
		"- {name: a, vip: 10.1.0.1:179, data_plane: xdp, backends: [{address: 10.1.0.2:179}]}\n" +
		"- {name: u, vip: 10.0.0.1:179, protocol: udp, backends: [{address: 10.1.0.2:179}]}\n" +
		"- {name: p, vip: 10.0.0.1:80, data_plane: xdp, backends: [{address: 10.1.0.2:80}]}\n" +
		"- {name: b, vip: 10.1.0.1:80, data_plane: proxy, backends: [{address: 10.1.0.2:80}]}\n"))
	if err != nil {
		t.Fatalf("got %v; want no error", err)
	}
}

// TestSpeakerPortClashesAtHostAddresses: the host's own addresses the file
// leaves out refuse what validation refuses at one the file names, a tcp VIP
// that XDP may serve there on bgp.listen_port, in either family (the speaker
// listens on both), and nothing else: a udp VIP, another port or address, a
// VIP no XDP serves, a file without a listening speaker.
func TestSpeakerPortClashesAtHostAddresses(t *testing.T) {
	const bgp = "bgp: {asn: 1, router_id: 10.0.0.1, listen_port: 1179, peers: [{address: 10.0.0.2, asn: 2}]}\n"
	host := []netip.Addr{netip.MustParseAddr("192.0.2.5"), netip.MustParseAddr("2001:db8::5")}
	svc := func(vip, more string) string {
		port := vip[strings.LastIndex(vip, ":"):]
		return "services:\n- {name: a, vip: '" + vip + "', mode: dsr" + more + ", backends: [{address: '10.1.0.2" + port + "', mac: '02:00:00:00:00:01'}]}\n"
	}
	for _, c := range []struct {
		name, file, want string
	}{
		{"tcp xdp", bgp + svc("192.0.2.5:1179", ", data_plane: xdp"),
			"f.yaml:4: services[0].vip: 192.0.2.5:1179 is the node's own address (on eth0) at bgp.listen_port, where BGP peers reach the speaker"},
		{"tcp xdp, IPv6", strings.Replace(bgp, "listen_port", "next_hop: ['2001:db8::9'], listen_port", 1) + svc("[2001:db8::5]:1179", ", data_plane: xdp"),
			"f.yaml:4: services[0].vip: [2001:db8::5]:1179 is the node's own address (on eth0) at bgp.listen_port"},
		{"udp", bgp + svc("192.0.2.5:1179", ", data_plane: xdp, protocol: udp"), ""},
		{"another port", bgp + svc("192.0.2.5:80", ", data_plane: xdp"), ""},
		{"another address", bgp + svc("192.0.2.6:1179", ", data_plane: xdp"), ""},
		{"no listen_port", strings.Replace(bgp, "listen_port: 1179, ", "", 1) + svc("192.0.2.5:1179", ", data_plane: xdp"), ""},
		{"no bgp", svc("192.0.2.5:1179", ", data_plane: xdp"), ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, err := Parse([]byte("interfaces: [{name: eth0}]\n" + c.file))
			if err != nil {
				t.Fatal(err)
			}
			err = cfg.SpeakerPortClashes("f.yaml", host, "on eth0")
			switch {
			case c.want == "" && err != nil:
				t.Errorf("got %v; want none", err)
			case c.want != "" && (err == nil || !strings.HasPrefix(err.Error(), c.want) || strings.Contains(err.Error(), "\n")):
				t.Errorf("got %v; want one line beginning %q", err, c.want)
			}
		})
	}
}
