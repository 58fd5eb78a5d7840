package api

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// BGPStatus is the node's BGP speaker: its sessions, what it announces, and the
// node's drain.
type BGPStatus struct {
	ASN      uint32 `json:"asn"`
	RouterID string `json:"router_id"`
	// Error is why the speaker is not running (then nothing is announced).
	Error string `json:"error,omitempty"`
	// Drained: `weir node drain` withdrew every route; DrainedSince is when, and
	// DrainUntil when the flows still reaching the node have had drain_timeout.
	Drained      bool            `json:"drained"`
	DrainedSince time.Time       `json:"drained_since,omitzero"`
	DrainUntil   time.Time       `json:"drain_until,omitzero"`
	Peers        []PeerStatus    `json:"peers"`
	Announced    []RouteStatus   `json:"announced"`
	Withheld     []WithheldRoute `json:"withheld,omitempty"`
	// Pending is the routes whose last change GoBGP refused: still to be
	// announced, or still announced though withdrawn. The speaker retries them.
	Pending []PendingRoute `json:"pending,omitempty"`
}

// PeerStatus is one BGP session.
type PeerStatus struct {
	Address string `json:"address"`
	ASN     uint32 `json:"asn"`
	// State is the session's FSM state: idle, connect, active, opensent,
	// openconfirm or established.
	State string `json:"state"`
	// Since is when the session was established (zero unless it is).
	Since  time.Time `json:"since,omitzero"`
	Uptime string    `json:"uptime,omitempty"`
	// HoldTime is what this side proposes; the session runs on the smaller of it
	// and the peer's.
	HoldTime uint64 `json:"hold_time_seconds,omitempty"`
	// LastError is why the session last went down, if it has.
	LastError string `json:"last_error,omitempty"`
}

// RouteStatus is one announced VIP route.
type RouteStatus struct {
	Prefix      string   `json:"prefix"`
	Services    []string `json:"services"`
	Communities []string `json:"communities,omitempty"`
	MED         uint32   `json:"med,omitempty"`
	LocalPref   uint32   `json:"local_pref,omitempty"`
}

// WithheldRoute is a VIP that is not announced, and why.
type WithheldRoute struct {
	Prefix string `json:"prefix"`
	Why    string `json:"why"`
}

// What a pending route is waiting for.
const (
	RouteAnnounce = "announce"
	RouteWithdraw = "withdraw"
)

// PendingRoute is a VIP route the speaker has not brought to the state the node
// wants: its announcement (or a change of its policy) or its withdrawal failed, and
// is tried again at NextTry.
type PendingRoute struct {
	Prefix    string    `json:"prefix"`
	Want      string    `json:"want"` // RouteAnnounce or RouteWithdraw
	Since     time.Time `json:"since"`
	Attempts  int       `json:"attempts"`
	LastError string    `json:"last_error"`
	NextTry   time.Time `json:"next_try,omitzero"`
}

// WriteTable writes the BGP part of `weir status`.
func (b *BGPStatus) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "bgp: AS %d, router id %s", b.ASN, b.RouterID)
	if b.Drained {
		fmt.Fprintf(w, "; node DRAINED since %s (every route withdrawn; flows still arriving are served until %s",
			b.DrainedSince.Format(time.RFC3339), b.DrainUntil.Format(time.RFC3339))
		if time.Now().After(b.DrainUntil) {
			fmt.Fprint(w, "; drain_timeout has passed: the node can be stopped")
		}
		fmt.Fprint(w, ")")
	}
	fmt.Fprintln(w)
	if b.Error != "" {
		fmt.Fprintf(w, "  NOT RUNNING, nothing is announced: %s\n", b.Error)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  peer\tasn\tstate\tuptime\thold\tlast error")
	for _, p := range b.Peers {
		hold := "-"
		if p.HoldTime > 0 {
			hold = fmt.Sprintf("%ds", p.HoldTime)
		}
		up := p.Uptime
		if up == "" {
			up = "-"
		}
		fmt.Fprintf(tw, "  %s\t%d\t%s\t%s\t%s\t%s\n", p.Address, p.ASN, p.State, up, hold, p.LastError)
	}
	tw.Flush()
	for _, r := range b.Announced {
		fmt.Fprintf(w, "  announced %s (%s)", r.Prefix, strings.Join(r.Services, ", "))
		if len(r.Communities) > 0 {
			fmt.Fprintf(w, " communities %s", strings.Join(r.Communities, " "))
		}
		if r.MED != 0 {
			fmt.Fprintf(w, " med %d", r.MED)
		}
		if r.LocalPref != 0 {
			fmt.Fprintf(w, " local_pref %d", r.LocalPref)
		}
		fmt.Fprintln(w)
	}
	for _, r := range b.Withheld {
		fmt.Fprintf(w, "  withdrawn %s: %s\n", r.Prefix, r.Why)
	}
	for _, r := range b.Pending {
		attempts := "attempts"
		if r.Attempts == 1 {
			attempts = "attempt"
		}
		fmt.Fprintf(w, "  PENDING %s %s (%d failed %s since %s", r.Want, r.Prefix, r.Attempts, attempts, r.Since.Format(time.RFC3339))
		if !r.NextTry.IsZero() {
			fmt.Fprintf(w, ", retrying in %s", max(0, time.Until(r.NextTry)).Round(time.Millisecond))
		}
		fmt.Fprintf(w, "): %s\n", r.LastError)
	}
}
