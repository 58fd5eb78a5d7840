package bgp

import (
	"context"
	"log/slog"
	"net/netip"

	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
)

// notifyHandler stands between GoBGP and the speaker's logger: it passes on the
// records at level or above (GoBGP's LoggerOption takes a level but leaves the
// filtering to the logger), and hands each NOTIFICATION GoBGP logs that it sent
// or received to note, with the peer it names (GoBGP's "Key" attribute). GoBGP
// v4 refuses an OPEN on its outgoing connection (a wrong peer AS, say) without a
// peer state change, so its log is the only place that says why a session never
// comes up.
type notifyHandler struct {
	slog.Handler
	level slog.Leveler
	peer  netip.Addr // the "Key" attribute WithAttrs gave it
	note  func(peer netip.Addr, what string)
}

func (h *notifyHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelInfo || h.Handler.Enabled(ctx, l)
}

func (h *notifyHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "sent notification" || r.Message == "received notification" {
		peer, code, subcode := h.peer, -1, -1
		r.Attrs(func(a slog.Attr) bool {
			switch a.Key {
			case "Key":
				if p, err := netip.ParseAddr(a.Value.String()); err == nil {
					peer = p
				}
			case "Code":
				code = int(a.Value.Int64())
			case "Subcode":
				subcode = int(a.Value.Int64())
			}
			return true
		})
		if peer.IsValid() && code >= 0 && subcode >= 0 {
			h.note(peer.Unmap(), r.Message+": "+bgp.NewNotificationErrorCode(uint8(code), uint8(subcode)).String())
		}
	}
	if r.Level < h.level.Level() || !h.Handler.Enabled(ctx, r.Level) {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h *notifyHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	c := *h
	c.Handler = h.Handler.WithAttrs(attrs)
	for _, a := range attrs {
		if a.Key == "Key" {
			if p, err := netip.ParseAddr(a.Value.String()); err == nil {
				c.peer = p
			}
		}
	}
	return &c
}

func (h *notifyHandler) WithGroup(name string) slog.Handler {
	c := *h
	c.Handler = h.Handler.WithGroup(name)
	return &c
}
