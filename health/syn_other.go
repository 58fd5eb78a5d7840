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
type synProber struct{ free chan uint16 }

func openSyn([2]uint16) (*synProber, error) {
	return nil, fmt.Errorf("raw sockets: %w", errors.ErrUnsupported)
}

func (p *synProber) close()                                                                       {}
func (p *synProber) drop(uint16, uint32)                                                          {}
func (p *synProber) excludedPorts() int                                                           { return 0 }
func (p *synProber) reserveError() error                                                          { return nil }
func (p *synProber) queue(netip.AddrPort, netip.Addr, uint16, uint32, time.Duration, func(error)) {}
func (p *synProber) flush()                                                                       {}

func newSeq() uint32 { return rand.Uint32() }
