package api

import "errors"

// Data planes as status reports them.
const (
	PlaneXDP   = "xdp"
	PlaneProxy = "proxy"
	PlaneHTTP  = "http"
)

// Errors the agent answers with; the admin API maps them to HTTP statuses and the
// client back, so errors.Is works on both ends.
var (
	// ErrNotRunning: the agent is not (or no longer) running.
	ErrNotRunning = errors.New("agent not running")
	// ErrNotFound: no such service or backend.
	ErrNotFound = errors.New("not found")
	// ErrBadRequest: a malformed argument.
	ErrBadRequest = errors.New("bad request")
)

// Explanation says where the XDP data plane sends a client's flow to a service.
type Explanation struct {
	Service string `json:"service"`
	Client  string `json:"client"`
	// New is the backend a new flow from the client would get now; "" if none is
	// in the lookup table (every backend down or drained).
	New string `json:"new"`
	// NoBackend says why New is "": each backend's reason.
	NoBackend string `json:"no_backend,omitempty"`
	// Tracked is the backend the connection table holds for this flow, if any, and
	// whether it may still carry it (if not, the flow's next packet is re-selected).
	Tracked       string `json:"tracked,omitempty"`
	TrackedUsable bool   `json:"tracked_usable,omitempty"`
	// HalfOpen: the flow has sent only its first packet so far; it moves to the
	// connection table with its client's next one.
	HalfOpen bool `json:"half_open,omitempty"`
	// NATPort is the flow's source port towards its backend (nat mode).
	NATPort uint16 `json:"nat_port,omitempty"`
	// Previous is the backend the previous lookup table gives, while the fallback
	// may use it: where a TCP packet of this flow that is not a SYN goes if no
	// flow table on this node knows the flow (it was opened on another node), as
	// long as that backend is usable.
	Previous string `json:"previous,omitempty"`
	// Fingerprint identifies the lookup table New comes from (TableStatus).
	Fingerprint string `json:"table_fingerprint,omitempty"`
	// P2C, for a maglev_p2c service, the two candidates New was chosen from.
	P2C *Candidates `json:"p2c,omitempty"`
}

// Candidates are a maglev_p2c flow's two candidates, the active flows this node
// counts on each (negative: unknown), and which one a new flow takes.
type Candidates struct {
	First      string `json:"first"`
	Second     string `json:"second"`
	FirstLoad  int64  `json:"first_load"`
	SecondLoad int64  `json:"second_load"`
	SecondWins bool   `json:"second_wins,omitempty"`
}
