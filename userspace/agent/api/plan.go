package api

import (
	"fmt"
	"io"
	"strings"
)

// Plan is what `weir plan` shows: what a config change would move, computed by the
// running agent against what it serves, without applying anything.
type Plan struct {
	// Config is the file planned: the agent's own when the request sent none.
	Config   string        `json:"config"`
	Services []ServicePlan `json:"services"`
	// MaxMove is the budget asked for, in percent of a service's new flows (nil: none),
	// and OverBudget the services whose change moves more.
	MaxMove    *float64 `json:"max_move,omitempty"`
	OverBudget []string `json:"over_budget,omitempty"`
	// Refused says why a reload of the file would be refused although it is
	// valid: an http service's certificate and key do not load, or the XDP
	// program has no slots for the change at some point of it.
	Refused string `json:"refused,omitempty"`
}

// Service changes.
const (
	ChangeAdded     = "added"
	ChangeRemoved   = "removed"
	ChangeUpdated   = "updated"
	ChangeUnchanged = "unchanged"
)

// ServicePlan is one service's part of a plan.
type ServicePlan struct {
	Service string `json:"service"`
	Change  string `json:"change"` // added, removed, updated or unchanged
	// RenamedFrom is the service's name now, when the change renames an XDP
	// service and keeps its VIP and protocol: its entry in the program is updated
	// in place, so it is planned as an update.
	RenamedFrom string `json:"renamed_from,omitempty"`
	// DataPlane is where the service runs now and NextDataPlane where it would
	// (either "" when the service is added or removed).
	DataPlane     string `json:"data_plane,omitempty"`
	NextDataPlane string `json:"next_data_plane,omitempty"`
	// NewDataPlane says why the change needs a new data plane for the service (a
	// placement change, a new XDP entry or proxy listener); "" when it is updated in
	// place.
	NewDataPlane string `json:"new_data_plane,omitempty"`
	// Table compares the lookup tables (XDP services; maglev and source_hash on the
	// http plane): the one in use now and the one the change builds; nil when
	// neither side has a table.
	Table *TablePlan `json:"table,omitempty"`
	// Moved is the share (0..1) of the service's new flows (http: new requests)
	// that would go to another backend than today: from the lookup tables where
	// there are tables (XDP; maglev and source_hash on the http plane), else from
	// the backends' shares (of the weights where the algorithm honours them, else
	// equal): the least any choice by those shares must move. A removed service
	// moves all of them; an added one none. MaxMove gates on it.
	Moved float64 `json:"moved"`
	// TrafficMoved is the share of the service's established flows whose hash the next
	// table gives another backend than today's (XDP): the change measured on this
	// service's own traffic, where Moved counts every hash alike (they differ when
	// clients cluster, as with source hashing). nil without flows or tables.
	TrafficMoved *float64 `json:"traffic_moved,omitempty"`
	// Flows are the established flows (XDP: connection-table entries; proxy: open
	// connections; http: requests in flight) per backend and what the change does
	// to them.
	FlowKind string        `json:"flow_kind,omitempty"` // "xdp flows", "proxy connections" or "http requests in flight"
	Flows    []BackendPlan `json:"flows,omitempty"`
	// Reset and Drained sum Flows by fate. On the http plane nothing is reset: a
	// drained request finishes on its backend (removed, drained, weight 0, or the
	// service's old listener), within the request timeouts and, for an old
	// listener, the drain timeout; a tunnel (WebSocket) ends within the drain
	// timeout.
	Reset   uint64 `json:"reset"`
	Drained uint64 `json:"drained"`
	// DrainedTunnels are the http plane's drained tunnels, of Drained: they
	// are closed once the drain timeout is up, as they do not end by themselves.
	DrainedTunnels uint64 `json:"drained_tunnels,omitempty"`
	// Clients are the http plane's client connections (nil on the others).
	Clients *ClientPlan `json:"clients,omitempty"`
	// FlowsError says why the flows could not be read (the rest of the plan stands).
	FlowsError string `json:"flows_error,omitempty"`
}

// ClientPlan is what a change does to an http service's client connections. A
// client connection belongs to no backend (each request on it is balanced by
// itself), so only a new listener, a move to another plane or the service's
// removal closes them; a change applied in place closes none.
type ClientPlan struct {
	Open uint64 `json:"open"` // open now
	// Closed is how many the change closes, gracefully: HTTP/2 clients get GOAWAY
	// and finish their streams, HTTP/1.1 ones are closed once idle.
	Closed uint64 `json:"closed"`
}

// TablePlan is the lookup-table part of a service's plan.
type TablePlan struct {
	Size     int        `json:"size"`      // entries of the table packets use now (0: none)
	NextSize int        `json:"next_size"` // entries of the one the change builds (0: none)
	Moved    int        `json:"moved"`     // entries of the next table whose owner changes
	Moves    []SlotMove `json:"moves,omitempty"`
}

// SlotMove is the part of the table that goes from one backend to another ("" : no
// backend, new flows refused).
type SlotMove struct {
	From  string  `json:"from"`
	To    string  `json:"to"`
	Slots int     `json:"slots"`
	Share float64 `json:"share"`
}

// BackendPlan is one backend's established flows and their fate: stay, drain or
// reset.
type BackendPlan struct {
	Backend string `json:"backend"`
	Flows   uint64 `json:"flows"`
	Tunnels uint64 `json:"tunnels,omitempty"` // of Flows, the http plane's tunnels (WebSocket)
	Fate    string `json:"fate"`
}

// WriteTable prints the plan for people.
func (p *Plan) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "plan for %s (nothing applied)\n", p.Config)
	for _, s := range p.Services {
		planes := s.NextDataPlane
		if s.DataPlane != "" && s.NextDataPlane != "" && s.DataPlane != s.NextDataPlane {
			planes = s.DataPlane + " -> " + s.NextDataPlane
		} else if planes == "" {
			planes = s.DataPlane
		}
		traffic := ""
		if s.TrafficMoved != nil {
			traffic = fmt.Sprintf(" (%s of today's flows' hashes)", percent(*s.TrafficMoved))
		}
		what := "flows"
		if s.DataPlane == PlaneHTTP || s.DataPlane == "" && s.NextDataPlane == PlaneHTTP {
			what = "requests"
		}
		change := s.Change
		if s.RenamedFrom != "" {
			change += " (renamed from " + s.RenamedFrom + ")"
		}
		fmt.Fprintf(w, "\nservice %s  %s  %s  new %s moved %s%s\n", s.Service, change, planes, what, percent(s.Moved), traffic)
		if s.NewDataPlane != "" {
			fmt.Fprintf(w, "  new data plane: %s\n", s.NewDataPlane)
		}
		if t := s.Table; t != nil {
			size := fmt.Sprint(t.NextSize)
			if t.Size != t.NextSize {
				size = fmt.Sprintf("%d -> %d", t.Size, t.NextSize)
			}
			fmt.Fprintf(w, "  lookup table: %d of %s slots change owner\n", t.Moved, size)
			for _, m := range t.Moves {
				fmt.Fprintf(w, "    %-24s -> %-24s %7d slots  %s\n", orNone(m.From), orNone(m.To), m.Slots, percent(m.Share))
			}
		}
		if s.FlowsError != "" {
			fmt.Fprintf(w, "  %s: unknown: %s\n", s.FlowKind, s.FlowsError)
		} else if s.FlowKind != "" {
			var total uint64
			for _, f := range s.Flows {
				total += f.Flows
			}
			if c := s.Clients; c != nil {
				fmt.Fprintf(w, "  http client connections: %d open, %d closed gracefully\n", c.Open, c.Closed)
				fmt.Fprintf(w, "  %s: %d, %d drained (they finish on their backend)\n", s.FlowKind, total, s.Drained)
				if s.DrainedTunnels > 0 {
					fmt.Fprintf(w, "    of them %d tunnels (WebSocket), closed when the drain timeout is up\n", s.DrainedTunnels)
				}
			} else {
				fmt.Fprintf(w, "  %s: %d established, %d reset, %d drained\n", s.FlowKind, total, s.Reset, s.Drained)
			}
			for _, f := range s.Flows {
				if f.Flows > 0 || f.Fate != "stay" {
					tunnels := ""
					if f.Tunnels > 0 {
						tunnels = fmt.Sprintf("  (%d tunnels)", f.Tunnels)
					}
					fmt.Fprintf(w, "    %-24s %7d  %s%s\n", f.Backend, f.Flows, f.Fate, tunnels)
				}
			}
		}
	}
	if p.Refused != "" {
		fmt.Fprintf(w, "\na reload would be refused: %s\n", p.Refused)
	}
	if p.MaxMove != nil {
		if len(p.OverBudget) > 0 {
			fmt.Fprintf(w, "\nover --max-move %g%%: %s\n", *p.MaxMove, strings.Join(p.OverBudget, ", "))
		} else {
			fmt.Fprintf(w, "\nwithin --max-move %g%%\n", *p.MaxMove)
		}
	}
}

func percent(f float64) string { return fmt.Sprintf("%.2f%%", 100*f) }

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}
