package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/weir-lb/weir/loader"
)

// addrList is a repeatable --addr flag.
type addrList []netip.Addr

func (l *addrList) String() string { return joined(*l) }

// joined is a repeatable flag's values, comma-separated.
func joined[T fmt.Stringer](values []T) string {
	s := make([]string, len(values))
	for i, v := range values {
		s[i] = v.String()
	}
	return strings.Join(s, ",")
}

func (l *addrList) Set(v string) error {
	a, err := netip.ParseAddr(v)
	if err != nil {
		return err
	}
	*l = append(*l, a.Unmap())
	return nil
}

// prefixList is a repeatable --from flag: prefixes, or addresses as prefixes of
// their full length.
type prefixList []netip.Prefix

func (l *prefixList) String() string { return joined(*l) }

func (l *prefixList) Set(v string) error {
	if !strings.Contains(v, "/") {
		a, err := netip.ParseAddr(v)
		if err != nil {
			return err
		}
		*l = append(*l, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
		return nil
	}
	p, err := netip.ParsePrefix(v)
	if err != nil {
		return err
	}
	if p.Addr().Is4In6() {
		return fmt.Errorf("%s: give an IPv4-mapped prefix as IPv4", v)
	}
	*l = append(*l, p.Masked())
	return nil
}

// runDecap attaches weir's decapsulation program to an interface of a tunnel-mode
// backend until ctx is done (SIGINT, SIGTERM), printing its counters on SIGUSR1,
// every --interval, and at exit; then detaches it.
func runDecap(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("decap", "--interface IFACE", "On a backend of a tunnel-mode service: attach weir's decapsulation program until\nSIGINT or SIGTERM, printing its counters on SIGUSR1, every --interval and at exit.", stdout, stderr)
	ifname := fs.String("interface", "", "the `interface` tunnel packets arrive on")
	mode := fs.String("mode", "auto", "XDP attach `mode`: auto, native or generic")
	var addrs addrList
	fs.Var(&addrs, "addr", "an `address` whose tunnel packets to decapsulate (repeat; default: the interface's own addresses)")
	var from prefixList
	fs.Var(&from, "from", "a balancer `address or prefix` tunnel packets may come from; others are dropped (repeat; default: any source)")
	interval := fs.Duration("interval", 0, "print the counters every `duration` (0: only on SIGUSR1 and at exit)")
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return err
	}
	if *ifname == "" {
		return errors.New("decap: usage: weir decap --interface IFACE [--mode auto|native|generic] [--addr A ...] [--from PREFIX ...] [--interval D]")
	}
	m, err := loader.ParseMode(*mode)
	if err != nil {
		return fmt.Errorf("decap: --mode: %w", err)
	}
	if *interval < 0 {
		return fmt.Errorf("decap: --interval must be 0 or positive, got %v", *interval)
	}
	if len(addrs) == 0 {
		if addrs, err = ownAddrs(*ifname); err != nil {
			return fmt.Errorf("decap: %w", err)
		}
		if len(addrs) == 0 {
			return fmt.Errorf("decap: interface %s has no global address: give the tunnel endpoint with --addr", *ifname)
		}
	}
	d, err := loader.LoadDecap(addrs)
	if err != nil {
		return fmt.Errorf("decap: %w", err)
	}
	defer d.Close()
	if err := d.SetSources(from); err != nil {
		return fmt.Errorf("decap: --from: %w", err)
	}
	got, err := d.Attach(*ifname, m)
	if err != nil {
		return fmt.Errorf("decap: %w", err)
	}
	sources := "any source"
	if len(from) > 0 {
		sources = from.String()
	}
	fmt.Fprintf(stdout, "weir decap: attached to %s (%s) for tunnel packets to %s from %s; SIGUSR1 prints counters, SIGINT/SIGTERM detaches\n", *ifname, got, addrs.String(), sources)

	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	defer signal.Stop(usr1)
	var tick <-chan time.Time
	if *interval > 0 {
		t := time.NewTicker(*interval)
		defer t.Stop()
		tick = t.C
	}
	report := func(what string) {
		st, err := d.Stats()
		if err != nil {
			fmt.Fprintf(stderr, "weir decap: %v\n", err)
			return
		}
		fmt.Fprintf(stdout, "%s: decapsulated %d packets (%d bytes), not ours %d, malformed (dropped) %d, not from a balancer (dropped) %d\n",
			what, st.Decapsulated.Packets, st.Decapsulated.Bytes, st.NotOurs.Packets, st.Malformed.Packets, st.Foreign.Packets)
	}
	for {
		select {
		case <-ctx.Done():
			report("at exit")
			if err := d.Close(); err != nil {
				return fmt.Errorf("decap: %w", err)
			}
			fmt.Fprintf(stdout, "weir decap: detached from %s\n", *ifname)
			return nil
		case <-usr1:
			report(time.Now().Format(time.RFC3339))
		case <-tick:
			report(time.Now().Format(time.RFC3339))
		}
	}
}

// ownAddrs returns the global unicast addresses on an interface.
func ownAddrs(ifname string) (addrList, error) {
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		return nil, fmt.Errorf("interface %s: %w", ifname, err)
	}
	list, err := iface.Addrs()
	if err != nil {
		return nil, fmt.Errorf("interface %s: %w", ifname, err)
	}
	var out addrList
	for _, a := range list {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap().IsGlobalUnicast() {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out, nil
}
