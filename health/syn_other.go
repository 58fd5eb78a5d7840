//go:build !linux

package health

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"time"
)

// synProber exists only on Linux; elsewhere syn checks fall back to connect.
type synProber struct{}

func openSyn([2]uint16, func(*backend, error, time.Time)) (*synProber, error) {
	return nil, fmt.Errorf("raw sockets: %w", errors.ErrUnsupported)
}

func (p *synProber) close()                    {}
func (p *synProber) drop(uint16, uint32)       {}
func (p *synProber) excludedPorts() int        { return 0 }
func (p *synProber) reserveError() error       { return nil }
func (p *synProber) takePort() (uint16, bool)  { return 0, false }
func (p *synProber) putPort(uint16)            {}
func (p *synProber) flush(time.Time)           {}
func (p *synProber) poll(time.Time)            {}
func (p *synProber) wakeAt() (time.Time, bool) { return time.Time{}, false }
func (p *synProber) queue(time.Time, *backend, netip.AddrPort, netip.Addr, uint16, uint32, time.Duration) {
}

func newSeq() uint32 { return rand.Uint32() }
