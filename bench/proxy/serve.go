package main

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	_ "net/http/pprof" // -pprof
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/weir-lb/weir/loader"
	"github.com/weir-lb/weir/userspace/proxy"
)

// sockmapEnv set to 1 makes the -serve child forward in the kernel (loader.SockMap).
const sockmapEnv = "WEIR_BENCH_SOCKMAP"

// loopsEnv, if set, is the -serve child's event loops per service (proxy.Config's
// AcceptLoops), for an A/B of the default (one per P).
const loopsEnv = "WEIR_BENCH_LOOPS"

func numCPU() int { return runtime.NumCPU() }

// serveWeir runs weir's proxy with the same two services the other proxies get, until
// SIGTERM or SIGINT.
func serveWeir() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if *pprofAddr != "" {
		// Exits with the process.
		go func() { log.Print(http.ListenAndServe(*pprofAddr, nil)) }()
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	cfgs := []proxy.Config{
		{
			Name: "http", Listen: netip.MustParseAddrPort(proxyHTTP), Algorithm: "least_conn",
			Backends: []proxy.Backend{
				{Addr: netip.MustParseAddrPort(httpA)}, {Addr: netip.MustParseAddrPort(httpB)},
			},
			IdleTimeout: time.Minute, ShutdownTimeout: time.Second, Logger: logger,
			DrainTimeout: proxy.DefaultDrainTimeout, EjectAfter: proxy.DefaultEjectAfter,
		},
		{
			Name: "bulk", Listen: netip.MustParseAddrPort(proxyBulk), Algorithm: "least_conn",
			Backends:    []proxy.Backend{{Addr: netip.MustParseAddrPort(iperfAddr)}},
			IdleTimeout: time.Minute, ShutdownTimeout: time.Second, Logger: logger,
			DrainTimeout: proxy.DefaultDrainTimeout, EjectAfter: proxy.DefaultEjectAfter,
		},
	}
	if n, err := strconv.Atoi(os.Getenv(loopsEnv)); err == nil {
		for i := range cfgs {
			cfgs[i].AcceptLoops = n
		}
	}
	if os.Getenv(sockmapEnv) == "1" {
		sm, err := loader.LoadSockMap()
		if err != nil {
			return err
		}
		defer sm.Close()
		for i := range cfgs {
			cfgs[i].Redirector = sm
		}
	}
	var wg sync.WaitGroup
	errc := make(chan error, len(cfgs))
	for _, cfg := range cfgs {
		s, err := proxy.Listen(ctx, cfg)
		if err != nil {
			return err
		}
		wg.Add(1)
		// Exits when ctx is done and the service has shut down.
		go func() {
			defer wg.Done()
			if err := s.Serve(ctx); err != nil {
				errc <- fmt.Errorf("serve %s: %w", cfg.Name, err)
				stop()
			}
		}()
	}
	wg.Wait()
	close(errc)
	return <-errc
}
