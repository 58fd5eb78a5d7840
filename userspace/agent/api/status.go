// Package api is the admin API's vocabulary: the status, explanation and error
// values the agent serves and the CLI reads, with the table `weir status` prints.
// It holds data only; the agent fills it in, userspace/agent/admin carries it.
package api

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/weir-lb/weir/userspace/config"
)

// Status is what `weir status` shows; the admin API serves it as JSON.
type Status struct {
	Config     string            `json:"config"`
	Started    time.Time         `json:"started"`
	XDP        XDPStatus         `json:"xdp"`
	Services   []ServiceStatus   `json:"services"`
	Reloads    []ReloadStatus    `json:"reloads,omitempty"`
	XDPReasons map[string]uint64 `json:"xdp_packets_by_reason,omitempty"`
	// HealthUnapplied: health verdicts the data planes refused, which the
	// agent tries again; nil while the planes run every verdict.
	HealthUnapplied *UnappliedHealth `json:"health_unapplied,omitempty"`
	// BGP is the node's BGP speaker; nil when the config has none.
	BGP *BGPStatus `json:"bgp,omitempty"`
}

// UnappliedHealth is health verdicts the data planes refused to take: until a
// later try takes them, the planes (and the backends' health and usable in
// status) are as before them.
type UnappliedHealth struct {
	Since     time.Time `json:"since"`
	Attempts  int       `json:"attempts"`
	LastError string    `json:"last_error"`
	NextTry   time.Time `json:"next_try"`
}

// XDPStatus says whether XDP is loaded and where.
type XDPStatus struct {
	Loaded     bool              `json:"loaded"`
	Reason     string            `json:"reason,omitempty"` // why not, or a warning
	Interfaces []InterfaceStatus `json:"interfaces,omitempty"`
	// Pinned: the program and maps are pinned at PinPath, so a restart (or a crash)
	// keeps XDP flows; DetachOnStop says whether stopping removes them anyway.
	Pinned       bool   `json:"pinned"`
	PinPath      string `json:"pin_path,omitempty"`
	Adopted      bool   `json:"adopted,omitempty"` // taken over from the previous run
	DetachOnStop bool   `json:"detach_on_stop"`
	// NextHopError is the last failure to set up the neighbour entries of nat and
	// tunnel backends' next hops: such backends still work, but their first packets
	// wait for the kernel's own resolution.
	NextHopError string `json:"next_hop_error,omitempty"`
	// NATPorts is the source port range nat flows take, as the program was built.
	NATPorts [2]uint16 `json:"nat_ports,omitempty"`
	// ConntrackSize and HalfOpenSize are the flow tables' capacities as loaded.
	ConntrackSize uint32 `json:"conntrack_size,omitempty"`
	HalfOpenSize  uint32 `json:"half_open_size,omitempty"`
	// PreviousTableWindow is how long a replaced lookup table stays addressable by
	// the fallback ("0s": no fallback).
	PreviousTableWindow string `json:"previous_table_window,omitempty"`
}

// TableStatus is an XDP service's lookup table. Nodes showing the same Fingerprint
// for a service give every new flow of it the same backend.
type TableStatus struct {
	// Fingerprint identifies the table by its backends' addresses, the hash seed
	// and hashing; "" when no backend takes new flows (no table).
	Fingerprint string `json:"fingerprint"`
	Size        uint32 `json:"size"`
	// Previous is the fingerprint of the table this one replaced while the
	// fallback may still use it, replaced PreviousAgeSeconds ago.
	Previous           string  `json:"previous,omitempty"`
	PreviousAgeSeconds float64 `json:"previous_age_seconds,omitempty"`
}

// InterfaceStatus is one configured interface.
type InterfaceStatus struct {
	Name      string `json:"name"`
	Requested string `json:"requested"`
	Mode      string `json:"mode,omitempty"` // native or generic once attached
	Error     string `json:"error,omitempty"`
}

// ReloadStatus is one reload's outcome.
type ReloadStatus struct {
	Time   time.Time `json:"time"`
	OK     bool      `json:"ok"`
	Errors []string  `json:"errors,omitempty"`
}

// ServiceStatus is one service.
type ServiceStatus struct {
	Name      string `json:"name"`
	Key       string `json:"key"`
	DataPlane string `json:"data_plane"`
	Why       string `json:"why"`
	Mode      string `json:"mode,omitempty"`
	Algorithm string `json:"algorithm"`
	// HealthMethod is how tcp checks are made now: syn or connect, with the
	// reason when syn was wanted but is not possible; empty for other checks.
	HealthMethod string `json:"health_method,omitempty"`
	AllDown      bool   `json:"all_down"`
	Note         string `json:"note,omitempty"`
	Packets      uint64 `json:"packets"`
	Bytes        uint64 `json:"bytes"`
	// XDP nat only: flows open now (opened and not yet seen to close).
	ActiveFlows uint64 `json:"active_flows"`
	// Proxy only.
	Connections int64  `json:"active_connections"`
	Accepted    uint64 `json:"accepted_connections"`
	// Proxy and the http plane: Down says why the service serves nothing now
	// (its server stopped on its own and the agent is starting it anew; empty
	// while it serves), Restarts how many servers the agent started anew so.
	Down     string `json:"down,omitempty"`
	Restarts uint64 `json:"restarts,omitempty"`
	// Proxy and the http plane: accept errors waited out (no file
	// descriptor or socket memory left).
	AcceptErrors uint64 `json:"accept_errors,omitempty"`
	// The proxy only: client connections the kernel gave up on, the client
	// having stopped acknowledging (TCP keepalive or user timeout).
	ClientTimeouts uint64 `json:"client_timeouts,omitempty"`
	// The http plane only: requests in flight now, and answered.
	InFlight int64           `json:"inflight_requests,omitempty"`
	Tunnels  int64           `json:"tunnels,omitempty"` // of InFlight, WebSocket and other upgrades
	Requests uint64          `json:"requests,omitempty"`
	Backends []BackendStatus `json:"backends"`
	// XDP only, while the service is installed.
	Table *TableStatus `json:"table,omitempty"`
}

// BackendStatus is one backend.
type BackendStatus struct {
	Address string `json:"address"`
	Health  string `json:"health"`
	// Usable: the data plane may give it new flows (health, then all_down, and for
	// dsr a known MAC); Reason says why not, or why it is usable although down.
	Usable       bool   `json:"usable"`
	Reason       string `json:"reason,omitempty"`
	Weight       uint32 `json:"weight"`
	ConfigWeight uint32 `json:"config_weight"`
	Drained      bool   `json:"drained"`
	Override     bool   `json:"runtime_override,omitempty"` // a runtime weight or drain
	// WeightOverride: Weight was set at runtime (ConfigWeight is the file's);
	// DrainOverride: Drained was.
	WeightOverride bool   `json:"weight_override,omitempty"`
	DrainOverride  bool   `json:"drain_override,omitempty"`
	MAC            string `json:"mac,omitempty"`
	MACError       string `json:"mac_error,omitempty"`
	Packets        uint64 `json:"packets"`
	Bytes          uint64 `json:"bytes"`
	ActiveFlows    uint64 `json:"active_flows"` // XDP nat only
	Connections    int64  `json:"active_connections"`
	Connects       uint64 `json:"connects"`
	LastCheck      string `json:"last_check,omitempty"`
	LastCheckAgo   string `json:"last_check_ago,omitempty"`
	// The http plane only: requests in flight (of them, tunnels: WebSocket and
	// other upgrades), answered (by status class, "1xx" to "5xx", "none" for no
	// answer), retries sent to it, and the latency estimate the algorithm picks
	// by (ewma, least_time; empty for the others).
	InFlight int               `json:"inflight_requests,omitempty"`
	Tunnels  int               `json:"tunnels,omitempty"`
	Requests uint64            `json:"requests,omitempty"`
	Classes  map[string]uint64 `json:"status_classes,omitempty"`
	Retries  uint64            `json:"retries,omitempty"`
	Latency  string            `json:"latency_estimate,omitempty"`
	// SlowStart says where the backend's slow start is: "40% of its weight, 3s to
	// go" ("" when it is not ramping).
	SlowStart string `json:"slow_start,omitempty"`
}

// AllChecked reports whether st has services and every backend of them has been
// checked once, so callers that wait for an agent do not race its first verdicts.
func (st Status) AllChecked() bool {
	for _, s := range st.Services {
		for _, b := range s.Backends {
			if b.LastCheck == "" {
				return false
			}
		}
	}
	return len(st.Services) > 0
}

// WriteTable writes st as the readable table `weir status` prints.
func (st Status) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "config %s, running since %s\n", st.Config, st.Started.Format(time.RFC3339))
	if st.XDP.Loaded {
		var ifs []string
		for _, i := range st.XDP.Interfaces {
			if i.Error != "" {
				ifs = append(ifs, fmt.Sprintf("%s (not attached: %s)", i.Name, i.Error))
			} else {
				ifs = append(ifs, fmt.Sprintf("%s (%s)", i.Name, i.Mode))
			}
		}
		switch {
		case !st.XDP.Pinned:
			fmt.Fprintf(w, "xdp: attached to %s; not pinned (%s): stopping weir detaches it and drops its flows\n", strings.Join(ifs, ", "), st.XDP.Reason)
		case st.XDP.DetachOnStop:
			fmt.Fprintf(w, "xdp: attached to %s; pinned at %s; stopping weir detaches it (xdp.detach_on_stop), a crash keeps it\n", strings.Join(ifs, ", "), st.XDP.PinPath)
		default:
			fmt.Fprintf(w, "xdp: attached to %s; pinned at %s: it keeps balancing while weir is stopped or restarting (weir stop --detach removes it)\n", strings.Join(ifs, ", "), st.XDP.PinPath)
		}
		if st.XDP.Adopted {
			fmt.Fprintln(w, "xdp: adopted from the previous run with its established flows")
		}
		if st.XDP.NextHopError != "" {
			fmt.Fprintf(w, "xdp: next hops not kept resolved (first packets wait for the kernel): %s\n", st.XDP.NextHopError)
		}
	} else {
		fmt.Fprintf(w, "xdp: not loaded: %s\n", st.XDP.Reason)
	}
	if n := len(st.Reloads); n > 0 {
		r := st.Reloads[n-1]
		if r.OK {
			fmt.Fprintf(w, "last reload: %s, applied\n", r.Time.Format(time.RFC3339))
		} else {
			fmt.Fprintf(w, "last reload: %s, REJECTED (the previous config stays in force):\n", r.Time.Format(time.RFC3339))
			for _, e := range r.Errors {
				fmt.Fprintf(w, "  %s\n", e)
			}
		}
	}
	if u := st.HealthUnapplied; u != nil {
		fmt.Fprintf(w, "health: verdicts NOT APPLIED since %s (the backends below are as before them), %d tries, next at %s: %s\n",
			u.Since.Format(time.RFC3339), u.Attempts, u.NextTry.Format(time.RFC3339), u.LastError)
	}
	if st.BGP != nil {
		st.BGP.WriteTable(w)
	}
	for _, s := range st.Services {
		fmt.Fprintf(w, "\nservice %s  %s  data plane %s (%s)  algorithm %s", s.Name, s.Key, s.DataPlane, s.Why, s.Algorithm)
		if s.HealthMethod != "" {
			fmt.Fprintf(w, "  tcp checks %s", s.HealthMethod)
		}
		fmt.Fprintln(w)
		if s.Note != "" {
			fmt.Fprintf(w, "  %s\n", s.Note)
		}
		if s.Down != "" {
			fmt.Fprintf(w, "  NOT SERVING, starting anew (restarts %d): %s\n", s.Restarts, s.Down)
		} else if s.Restarts > 0 {
			fmt.Fprintf(w, "  started anew %d times after its server stopped on its own\n", s.Restarts)
		}
		if s.AcceptErrors > 0 {
			fmt.Fprintf(w, "  %d accept errors waited out (no file descriptor or socket memory left)\n", s.AcceptErrors)
		}
		if s.ClientTimeouts > 0 {
			fmt.Fprintf(w, "  %d client connections timed out (the client stopped acknowledging: TCP keepalive or user timeout)\n", s.ClientTimeouts)
		}
		if t := s.Table; t != nil {
			fp := t.Fingerprint
			if fp == "" {
				fp = "none (no backend takes new flows)"
			}
			fmt.Fprintf(w, "  lookup table %s, %d entries", fp, t.Size)
			if t.Previous != "" {
				fmt.Fprintf(w, "; previous %s, replaced %s ago", t.Previous, (time.Duration(t.PreviousAgeSeconds) * time.Second).String())
			}
			fmt.Fprintln(w)
		}
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		switch {
		case s.DataPlane == PlaneXDP && s.Mode == string(config.ModeDSR):
			fmt.Fprintf(w, "  %s mode: %d packets, %d bytes\n", s.Mode, s.Packets, s.Bytes)
			fmt.Fprintln(tw, "  backend\thealth\tusable\tweight\tdrained\tmac\tpackets\tbytes\tlast check")
		case s.DataPlane == PlaneXDP:
			fmt.Fprintf(w, "  %s mode: %d packets, %d bytes", s.Mode, s.Packets, s.Bytes)
			if s.Mode == string(config.ModeNAT) {
				fmt.Fprintf(w, ", %d active flows", s.ActiveFlows)
			}
			fmt.Fprintln(w)
			fmt.Fprintln(tw, "  backend\thealth\tusable\tweight\tdrained\tflows\tpackets\tbytes\tlast check")
		case s.DataPlane == PlaneHTTP:
			fmt.Fprintf(w, "  %d connections, %d accepted, %d requests in flight", s.Connections, s.Accepted, s.InFlight)
			if s.Tunnels > 0 {
				fmt.Fprintf(w, " (%d of them tunnels)", s.Tunnels)
			}
			fmt.Fprintf(w, ", %d answered\n", s.Requests)
			fmt.Fprintln(tw, "  backend\thealth\tusable\tweight\tdrained\tin flight\trequests\t5xx\tlatency\tlast check")
		default:
			fmt.Fprintf(w, "  %d active connections, %d accepted, %d bytes\n", s.Connections, s.Accepted, s.Bytes)
			fmt.Fprintln(tw, "  backend\thealth\tusable\tweight\tdrained\tactive\tconnects\tbytes\tlast check")
		}
		for _, b := range s.Backends {
			weight := fmt.Sprint(b.Weight)
			if b.WeightOverride {
				weight += fmt.Sprintf(" (runtime; file %d)", b.ConfigWeight)
			}
			drained := fmt.Sprint(b.Drained)
			if b.DrainOverride {
				drained += " (runtime)"
			}
			check := b.LastCheck
			if b.LastCheckAgo != "" {
				check += " (" + b.LastCheckAgo + " ago)"
			}
			switch {
			case s.DataPlane == PlaneXDP && s.Mode == string(config.ModeDSR):
				mac := b.MAC
				if mac == "" {
					mac = "unknown"
				}
				fmt.Fprintf(tw, "  %s\t%s\t%t\t%s\t%s\t%s\t%d\t%d\t%s\n", b.Address, b.Health, b.Usable, weight, drained, mac, b.Packets, b.Bytes, check)
			case s.DataPlane == PlaneXDP:
				flows := "-" // dsr and tunnel see one direction only: no flow ends to count
				if s.Mode == string(config.ModeNAT) {
					flows = fmt.Sprint(b.ActiveFlows)
				}
				fmt.Fprintf(tw, "  %s\t%s\t%t\t%s\t%s\t%s\t%d\t%d\t%s\n", b.Address, b.Health, b.Usable, weight, drained, flows, b.Packets, b.Bytes, check)
			case s.DataPlane == PlaneHTTP:
				latency := b.Latency
				if latency == "" {
					latency = "-"
				}
				fmt.Fprintf(tw, "  %s\t%s\t%t\t%s\t%s\t%d\t%d\t%d\t%s\t%s\n", b.Address, b.Health, b.Usable, weight, drained, b.InFlight, b.Requests, b.Classes["5xx"], latency, check)
			default:
				fmt.Fprintf(tw, "  %s\t%s\t%t\t%s\t%s\t%d\t%d\t%d\t%s\n", b.Address, b.Health, b.Usable, weight, drained, b.Connections, b.Connects, b.Bytes, check)
			}
		}
		tw.Flush()
		for _, b := range s.Backends {
			if b.Reason != "" {
				fmt.Fprintf(w, "  %s: %s\n", b.Address, b.Reason)
			}
			if b.SlowStart != "" {
				fmt.Fprintf(w, "  %s: slow start: %s\n", b.Address, b.SlowStart)
			}
		}
	}
}
