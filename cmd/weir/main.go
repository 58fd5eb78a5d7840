// Command weir is the load balancer's one binary. Subcommands:
//
//	weir run [-c FILE] [--no-xdp]         run the agent
//	weir validate [FILE] [--file-only] [--no-xdp]  check a config file, and that this host's agent takes it
//	weir status [--json]                  what the running agent serves, and how
//	weir drain SERVICE BACKEND            no new flows to a backend; established ones stay
//	weir undrain SERVICE BACKEND
//	weir weight SERVICE BACKEND N         set a backend's weight at runtime
//	weir stop [--detach]                  stop the agent; --detach also removes its XDP program
//	weir explain [--json] SERVICE CLIENT_IP:PORT  which backend a client's flow gets (XDP)
//	weir reload [--max-move PCT]          re-read the config file (or send SIGHUP)
//	weir plan [-c FILE] [--json] [--max-move PCT]  what a config change would move
//	weir node drain [--wait] | undrain    withdraw (or announce again) the node's BGP routes
//	weir decap --interface IFACE          on a tunnel-mode backend: decapsulate weir's tunnel packets
//	weir demo [--keep] | weir demo down   the agent on a namespaced demo topology
//	weir demo fleet                       three nodes behind a BIRD router's ECMP, one killed
//	weir version                          version, commit, build date, BPF object hash
//
// Every command that reads a config takes -c/--config FILE (default
// /etc/weir/weir.yaml); -h prints a command's usage and exits 0; flags may follow
// the arguments. The standard flag package serves this with two small helpers
// (cli.go): each command has a handful of flags, and a CLI library would add a
// dependency tree for what these commands do not need.
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/weir-lb/weir/userspace/agent"
	"github.com/weir-lb/weir/userspace/agent/admin"
	"github.com/weir-lb/weir/userspace/agent/xdpplane"
	"github.com/weir-lb/weir/userspace/config"
)

const usage = `weir: an L4 load balancer with an XDP data plane

usage:
  weir run [-c FILE] [--no-xdp]    run the agent (SIGHUP reloads, SIGTERM stops)
  weir validate [FILE] [--file-only] [--no-xdp]
                                   check a config file, and whether the agent on this host
                                   would take it (as weir run --no-xdp with --no-xdp; not
                                   with --file-only); prints every error, exit 1 if any
  weir status [--json]             services, data planes, backends, health, counters
  weir drain SERVICE BACKEND       stop new flows to BACKEND (ip:port); established ones stay
  weir undrain SERVICE BACKEND     end a drain
  weir weight SERVICE BACKEND N    set BACKEND's weight (0..65535) until restart
  weir stop [--detach]             stop the agent (the pinned XDP program keeps balancing);
                                   --detach removes it too, even with the agent stopped (-c FILE)
  weir explain [--json] SERVICE CLIENT
                                   which backend a new flow from CLIENT (ip:port) gets, and the
                                   backend an existing flow is pinned to (XDP services)
  weir reload [--max-move PCT]     re-read the config file; an invalid one changes nothing,
                                   nor one that moves more than PCT% of a service's new flows
  weir plan [-c FILE] [--json] [--max-move PCT]
                                   what applying FILE (default: the agent's own) would move:
                                   table slots, established flows, proxy connections; exit 1
                                   if the reload would be refused, or a service moves more
                                   than PCT% of its new flows
  weir node drain [--wait]         withdraw every BGP route of this node (flows still arriving
                                   are served); weir node undrain announces again
  weir decap --interface IFACE [--mode auto|native|generic] [--addr A ...] [--from PREFIX ...] [--interval D]
                                   on a backend of a tunnel-mode service: attach weir's
                                   decapsulation program until SIGINT/SIGTERM
  weir demo [--backends N] [--requests N] [--mode auto|native|generic] [--keep]
                                   run the agent on a demo topology in network namespaces
                                   and show it balancing real traffic; --keep leaves it running
  weir demo down                   remove what weir demo --keep left
  weir demo fleet [--streams N]    three nodes announcing a VIP over BGP to a BIRD router; one dies,
                                   the streams go on
  weir version                     version, commit, build date and BPF object hash

FILE is -c/--config FILE, default ` + defaultConfig + `. status, drain, undrain, weight,
explain, stop, reload, plan and node talk to the admin socket the config names (or -s SOCKET).
run 'weir COMMAND -h' for a command's usage and flags
`

// defaultConfig is where every command looks for the config unless told.
const defaultConfig = "/etc/weir/weir.yaml"

// errReported: the command has printed its errors itself.
var errReported = errors.New("errors reported")

func main() {
	// A closed stdout (weir demo | head) must not kill the process before it removes
	// its namespaces: with SIGPIPE ignored the write fails and teardown still runs.
	signal.Ignore(syscall.SIGPIPE)
	ctx, stop := context.Background(), func() {}
	// validate does not watch a context: a signal keeps its default action and
	// ends it, even while it reads a config that is slow to come (a pipe).
	if len(os.Args) < 2 || os.Args[1] != "validate" {
		sigs := []os.Signal{os.Interrupt, syscall.SIGTERM}
		if len(os.Args) < 2 || os.Args[1] != "run" {
			// weir run reloads on SIGHUP; every other command stops on it.
			sigs = append(sigs, syscall.SIGHUP)
		}
		ctx, stop = signal.NotifyContext(ctx, sigs...)
		defer stop()
	}
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		if !errors.Is(err, errReported) {
			fmt.Fprintln(os.Stderr, "weir:", err)
		}
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command given")
	}
	switch args[0] {
	case "demo":
		return runDemo(ctx, args[1:], stdout, stderr)
	case "validate":
		return runValidate(args[1:], stdout, stderr)
	case "run":
		return runAgent(ctx, args[1:], stdout, stderr)
	case "status":
		return runStatus(ctx, args[1:], stdout, stderr)
	case "drain", "undrain":
		return runDrain(ctx, args[0], args[1:], stdout, stderr)
	case "weight":
		return runWeight(ctx, args[1:], stdout, stderr)
	case "reload":
		return runReload(ctx, args[1:], stdout, stderr)
	case "plan":
		return runPlan(ctx, args[1:], stdout, stderr)
	case "stop":
		return runStop(ctx, args[1:], stdout, stderr)
	case "explain":
		return runExplain(ctx, args[1:], stdout, stderr)
	case "node":
		return runNode(ctx, args[1:], stdout, stderr)
	case "decap":
		return runDecap(ctx, args[1:], stdout, stderr)
	case "version", "--version", "-version":
		return runVersion(args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", args[0])
}

func runValidate(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("validate", "[FILE]", "Check a config file and print every problem, each with its file:line and field.\nFILE defaults to -c/--config, "+defaultConfig+".\nAlso checks it against this host, as the agent here would take it: certificate pairs\nload, XDP can serve what only XDP may serve; exit 1 if the agent would refuse it.", stdout, stderr)
	file := configFlag(fs)
	fileOnly := fs.Bool("file-only", false, "check the file alone, as on another machine: no certificate pair read, no host check")
	noXDP := fs.Bool("no-xdp", false, "check the file as weir run --no-xdp takes it here: XDP serves nothing")
	if err := parseFlags(fs, args, 0, 1); err != nil {
		return err
	}
	if fs.NArg() == 1 {
		named := false
		fs.Visit(func(f *flag.Flag) { named = named || f.Name == "c" || f.Name == "config" })
		if named {
			// Two files: which one the answer is about must not be a guess.
			return fmt.Errorf("validate: the file is %q or -c %q, not both", fs.Arg(0), *file)
		}
		*file = fs.Arg(0)
	}
	cfg, err := config.Load(*file)
	var es config.Errors
	if errors.As(err, &es) {
		return reportAll(stderr, es, *file, "%d %s", "error", "errors")
	}
	if err != nil {
		return fmt.Errorf("validate: %w", err)
	}
	// A reload is refused when a certificate and key do not load, so the file is
	// not valid then either. (Their paths are resolved: a relative one is taken
	// from the file's directory, by this command and the agent alike.)
	var bad []error
	for _, s := range cfg.Services {
		if h := s.HTTP; !*fileOnly && s.DataPlane == config.DataPlaneHTTP && h.TLSCert != "" {
			if _, err := tls.LoadX509KeyPair(h.TLSCert, h.TLSKey); err != nil {
				bad = append(bad, cfg.TLSPairError(*file, s.Name, err))
			}
		}
	}
	if len(bad) > 0 {
		return reportAll(stderr, bad, *file, "%d certificate %s", "pair that does not load", "pairs that do not load")
	}
	fmt.Fprintf(stdout, "%s: valid, %d services\n", *file, len(cfg.Services))
	for _, s := range cfg.Services {
		// The XDP mode only of a service XDP may serve (see the agent's decide).
		plane, v := string(s.DataPlane), s.Serving()
		switch {
		case v.XDP:
			plane += ", xdp mode " + string(s.Mode)
		case v.Else != s.DataPlane:
			plane = string(v.Else) + " (" + string(s.DataPlane) + ": XDP does not serve " + string(s.Algorithm) + ")"
		}
		fmt.Fprintf(stdout, "  %s  %s  data plane %s, %s, %d backends\n", s.Name, s.Key(), plane, s.Algorithm, len(s.Backends))
	}
	if b := cfg.BGP; b.ASN != 0 {
		var peers []string
		for _, p := range b.Peers {
			peers = append(peers, fmt.Sprintf("%s (AS %d)", p.Address, p.ASN))
		}
		fmt.Fprintf(stdout, "  bgp: AS %d, router id %s, peers %s\n", b.ASN, b.RouterID, strings.Join(peers, ", "))
	}
	if *fileOnly {
		return nil
	}
	refused, notes := xdpplane.Preflight(cfg, *file, *noXDP)
	if len(notes) > 0 {
		fmt.Fprintln(stdout, "this host (these decide where services run here):")
		for _, p := range notes {
			fmt.Fprintln(stdout, "  "+p)
		}
	}
	if len(refused) > 0 {
		// What the agent on this host refuses is an error here, as a certificate
		// pair that does not load is: a script that validates before it reloads
		// must not read success.
		return reportAll(stderr, refused, *file, "the file is valid, but the agent on this host refuses it: %d %s (--file-only checks the file alone)", "problem", "problems")
	}
	return nil
}

// reportAll writes each problem on a line of stderr, then a closing line: the
// file, and count, a format given their number and one or many as fits it;
// errReported.
func reportAll[T any](stderr io.Writer, problems []T, file, count, one, many string) error {
	for _, p := range problems {
		fmt.Fprintln(stderr, p)
	}
	noun := many
	if len(problems) == 1 {
		noun = one
	}
	fmt.Fprintf(stderr, "%s: "+count+"\n", file, len(problems), noun)
	return errReported
}

// configFlag adds -c and --config, one setting, default defaultConfig.
func configFlag(fs *command) *string {
	file := new(string)
	fs.StringVar(file, "c", defaultConfig, "the config `file`")
	fs.StringVar(file, "config", defaultConfig, "the config `file` (same as -c)")
	return file
}

func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("run", "", "Run the agent: load the config, attach XDP, serve until SIGTERM or SIGINT; SIGHUP reloads.", stdout, stderr)
	file := configFlag(fs)
	noXDP := fs.Bool("no-xdp", false, "load no XDP: the proxy serves the services it may (data_plane auto or proxy); a data_plane xdp or udp service makes the agent refuse the file")
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return err
	}
	a := agent.New(agent.Options{ConfigPath: *file, NoXDP: *noXDP, Log: stderr})
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	// Exits when runCtx is done (Run returned, or a signal stopped the agent).
	go func() {
		defer close(done)
		for {
			select {
			case <-runCtx.Done():
				return
			case <-hup:
				a.Reload(runCtx) // logs its outcome, keeps the running config on error
			}
		}
	}()
	err := a.Run(runCtx)
	cancel()
	<-done
	if err != nil {
		return fmt.Errorf("run: %w", err)
	}
	return nil
}

// adminFlags adds -s and -c/--config to a client command's flags and returns the
// socket to use: -s if given, else the one the config names, else the default.
func adminFlags(fs *command) func() (string, error) {
	sock := fs.String("s", "", "the agent's admin `socket` (default: the config's admin.socket, else "+config.DefaultAdminSocket+")")
	file := configFlag(fs)
	return func() (string, error) {
		if *sock != "" {
			return *sock, nil
		}
		explicit := false
		fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "c" || f.Name == "config" })
		cfg, err := config.Load(*file)
		switch {
		case err == nil:
			return cfg.Admin.Socket, nil
		case errors.Is(err, config.ErrInvalid):
			// A file edited since the agent loaded it may fail validation
			// elsewhere: the agent still answers on the socket it names (and
			// a reload, asked of it, is refused with the file's errors).
			if s, serr := config.AdminSocket(*file); serr == nil {
				return s, nil
			}
			return "", err
		case explicit || !errors.Is(err, os.ErrNotExist):
			return "", err
		}
		return config.DefaultAdminSocket, nil
	}
}

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("status", "", "What the running agent serves and how: data planes and why, backends, health, counters.", stdout, stderr)
	asJSON := fs.Bool("json", false, "print JSON, for scripts")
	socket := adminFlags(fs)
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return err
	}
	path, err := socket()
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	st, err := admin.NewClient(path).Status(ctx)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	st.WriteTable(stdout)
	return nil
}

func runDrain(ctx context.Context, cmd string, args []string, stdout, stderr io.Writer) error {
	about := "No new flows or connections to BACKEND (ip:port, see weir status); established ones stay.\nLasts until weir undrain or a restart; reloads keep it."
	if cmd == "undrain" {
		about = "End a drain: BACKEND (ip:port) takes new flows again."
	}
	fs := newFlagSet(cmd, "SERVICE BACKEND", about, stdout, stderr)
	socket := adminFlags(fs)
	if err := parseFlags(fs, args, 2, 2); err != nil {
		return err
	}
	path, err := socket()
	if err != nil {
		return fmt.Errorf("%s: %w", cmd, err)
	}
	if err := admin.NewClient(path).Drain(ctx, fs.Arg(0), fs.Arg(1), cmd == "drain"); err != nil {
		return fmt.Errorf("%s: %w", cmd, err)
	}
	fmt.Fprintf(stdout, "%sed %s of %s (until undone or weir restarts; reloads keep it)\n", cmd, fs.Arg(1), fs.Arg(0))
	return nil
}

func runWeight(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("weight", "SERVICE BACKEND N", "Set BACKEND's weight (0..65535) until weir restarts; reloads keep it.", stdout, stderr)
	socket := adminFlags(fs)
	if err := parseFlags(fs, args, 3, 3); err != nil {
		return err
	}
	n, err := strconv.ParseInt(fs.Arg(2), 10, 64)
	if err != nil || n < 0 || n > config.MaxWeight {
		return fmt.Errorf("weight: N must be 0..%d, got %q", config.MaxWeight, fs.Arg(2))
	}
	path, err := socket()
	if err != nil {
		return fmt.Errorf("weight: %w", err)
	}
	if err := admin.NewClient(path).Weight(ctx, fs.Arg(0), fs.Arg(1), n); err != nil {
		return fmt.Errorf("weight: %w", err)
	}
	fmt.Fprintf(stdout, "weight of %s of %s set to %d (until weir restarts; reloads keep it)\n", fs.Arg(1), fs.Arg(0), n)
	return nil
}

func runReload(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("reload", "", "Re-read the config file and apply it; an invalid or unappliable one changes nothing.\nWith --max-move, neither does one that would move more than PCT% of a service's new flows (see weir plan).", stdout, stderr)
	socket := adminFlags(fs)
	maxMove := maxMoveFlag(fs)
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return err
	}
	path, err := socket()
	if err != nil {
		return fmt.Errorf("reload: %w", err)
	}
	c := admin.NewClient(path)
	if maxMove.set {
		err = c.ReloadWithin(ctx, maxMove.pct)
	} else {
		err = c.Reload(ctx)
	}
	if err != nil {
		return reportRejected(stderr, "reload", "reload rejected; the running config stays in force", err)
	}
	fmt.Fprintln(stdout, "reloaded")
	return nil
}

func runExplain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("explain", "SERVICE CLIENT_IP:PORT", "Which backend a new flow from CLIENT_IP:PORT ([v6]:port for IPv6) gets, and the backend\nan existing flow is pinned to (XDP services).", stdout, stderr)
	asJSON := fs.Bool("json", false, "print JSON, for scripts")
	socket := adminFlags(fs)
	if err := parseFlags(fs, args, 2, 2); err != nil {
		return err
	}
	path, err := socket()
	if err != nil {
		return fmt.Errorf("explain: %w", err)
	}
	ex, err := admin.NewClient(path).Explain(ctx, fs.Arg(0), fs.Arg(1))
	if err != nil {
		return fmt.Errorf("explain: %w", err)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(ex)
	}
	if ex.New == "" {
		why := ex.NoBackend
		if why == "" {
			why = "every backend is down or drained"
		}
		fmt.Fprintf(stdout, "a new flow from %s to %s: no backend takes new flows: %s\n", ex.Client, ex.Service, why)
	} else {
		fmt.Fprintf(stdout, "a new flow from %s to %s: %s\n", ex.Client, ex.Service, ex.New)
	}
	if c := ex.P2C; c != nil {
		why := "the first: the second is not less loaded by more than an eighth"
		switch {
		case c.First == c.Second:
			why = "both candidates are the same backend"
		case c.SecondWins:
			why = "the second: the first has more than an eighth more active flows per weight"
		case c.FirstLoad < 0 || c.SecondLoad < 0:
			why = "the first: a load is unknown"
		}
		fmt.Fprintf(stdout, "maglev_p2c candidates: first %s (%d active flows), second %s (%d); a new connection takes %s\n",
			c.First, c.FirstLoad, c.Second, c.SecondLoad, why)
		fmt.Fprintln(stdout, "a packet that is not a SYN and misses the connection table takes the first")
	}
	switch {
	case ex.Tracked == "":
		fmt.Fprintln(stdout, "no flow from this client address and port is tracked")
	case !ex.TrackedUsable:
		fmt.Fprintf(stdout, "tracked flow: %s, no longer usable: its next packet is re-selected\n", ex.Tracked)
	case ex.Tracked != ex.New:
		fmt.Fprintf(stdout, "tracked flow: pinned to %s (not where a new flow would go: it stays there)\n", ex.Tracked)
	default:
		fmt.Fprintf(stdout, "tracked flow: %s\n", ex.Tracked)
	}
	if ex.HalfOpen {
		fmt.Fprintln(stdout, "half-open: only the flow's first packet was seen; it is established by the client's next one")
	}
	if ex.NATPort != 0 {
		fmt.Fprintf(stdout, "nat source port towards the backend: %d\n", ex.NATPort)
	}
	if ex.Previous != "" {
		fmt.Fprintf(stdout, "previous lookup table: %s (where this flow goes if it arrives mid-connection and no flow table here knows it)\n", ex.Previous)
	}
	if ex.Fingerprint != "" {
		fmt.Fprintf(stdout, "lookup table fingerprint: %s (nodes showing the same one give every new flow the same backend)\n", ex.Fingerprint)
	}
	return nil
}

func runStop(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("stop", "", "Stop the agent. Its pinned XDP program keeps balancing until the next weir run;\n--detach removes it too, also when no agent runs (from the config's settings).", stdout, stderr)
	detach := fs.Bool("detach", false, "also detach the XDP program and remove its pins (drops every XDP flow)")
	socket := adminFlags(fs)
	if err := parseFlags(fs, args, 0, 0); err != nil {
		return fmt.Errorf("%w\n(usage: weir stop [--detach] [-s SOCKET | -c FILE])", err)
	}
	path, err := socket()
	if err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	err = admin.NewClient(path).Stop(ctx, *detach)
	var re *admin.RequestError
	switch {
	case err == nil && *detach:
		fmt.Fprintln(stdout, "weir is stopping and detaching its XDP program")
		return nil
	case err == nil:
		fmt.Fprintln(stdout, "weir is stopping; its XDP program, if pinned, keeps balancing until the next weir run (weir stop --detach removes it)")
		return nil
	case errors.As(err, &re) || !*detach:
		return fmt.Errorf("stop: %w", err)
	}
	// No agent answers: remove what the last one left, from the config's settings.
	file := fs.Lookup("c").Value.String()
	cfg, cerr := config.Load(file)
	partly := false
	if errors.Is(cerr, config.ErrInvalid) {
		// The file the program was loaded from may fail this release's stricter
		// validation, or have been edited since: removing the program takes only
		// its interfaces and xdp sections, so those alone must be right.
		if xcfg, xerr := config.LoadXDP(file); xerr == nil {
			fmt.Fprintf(stderr, "weir stop: warning: %s is invalid; detaching with only its interfaces and xdp settings, which are valid. The file's errors:\n%v\n", file, cerr)
			cfg, cerr, partly = xcfg, nil, true
		} else if errors.Is(xerr, config.ErrInvalid) {
			cerr = xerr
		}
	}
	if cerr != nil {
		return fmt.Errorf("stop: %w\n(to remove the XDP program a stopped agent left, give its config: weir stop --detach -c FILE)", cerr)
	}
	if err := xdpplane.RemovePinned(cfg); err != nil {
		return fmt.Errorf("stop: no agent answers on %s, and: %w", path, err)
	}
	from := ""
	if partly {
		from = " (with the interfaces and xdp settings of the invalid file)"
	}
	fmt.Fprintf(stdout, "no agent was running; the XDP program pinned in %s is detached and its pins removed%s\n", cfg.XDP.PinPath, from)
	return nil
}
