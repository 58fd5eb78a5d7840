// Package benchproc runs the programs a benchmark compares (weir, HAProxy, nginx,
// Caddy, their backends) as child processes and reads what they cost from /proc: CPU,
// memory and descriptors, summed over the process and the workers it forked.
package benchproc

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Proc is a process a benchmark started in a process group of its own, with the
// workers it forked. A nil *Proc reads as an empty one and stops as a no-op, so a
// benchmark can measure a target that has no process of its own (direct).
type Proc struct {
	Cmd  *exec.Cmd
	done chan struct{}
}

// Start runs argv with env added to the environment; its output goes to
// dir/name.log. The child is killed if the benchmark dies (Pdeathsig).
func Start(dir, name string, env []string, argv ...string) (*Proc, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), env...)
	logf, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Proc{Cmd: cmd, done: make(chan struct{})}
	// Exits when the process has exited (Stop makes sure it does).
	go func() {
		cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// Stop ends the process (SIGTERM, then SIGKILL after 3 s) and the process group it
// was started in, so workers of nginx or HAProxy go with it, then gives the kernel a
// moment to release their ports.
func (p *Proc) Stop() {
	if p == nil {
		return
	}
	pid := p.Cmd.Process.Pid
	syscall.Kill(-pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(3 * time.Second):
		syscall.Kill(-pid, syscall.SIGKILL)
		<-p.done
	}
	// Workers that outlived their master in the group.
	syscall.Kill(-pid, syscall.SIGKILL)
	time.Sleep(200 * time.Millisecond)
}

// PIDs is the process and its children (nginx's and HAProxy's workers).
func (p *Proc) PIDs() []int {
	if p == nil {
		return nil
	}
	pid := p.Cmd.Process.Pid
	out := []int{pid}
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
	for _, f := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(f); err == nil {
			out = append(out, n)
		}
	}
	return out
}

// CPU is the user+system seconds of the process and its workers.
func (p *Proc) CPU() float64 {
	user, sys := p.CPUSplit()
	return user + sys
}

// CPUSplit is the user and the system (kernel) seconds of the process and its
// workers.
func (p *Proc) CPUSplit() (user, sys float64) {
	for _, pid := range p.PIDs() {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		ut, _ := strconv.ParseFloat(f[11], 64)
		st, _ := strconv.ParseFloat(f[12], 64)
		user += ut / 100 // USER_HZ
		sys += st / 100
	}
	return user, sys
}

// Mem is a /proc/PID/status field in kB (VmRSS, VmHWM) summed over the processes,
// in MB.
func (p *Proc) Mem(field string) float64 {
	var kb float64
	for _, pid := range p.PIDs() {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		for l := range strings.Lines(string(b)) {
			if strings.HasPrefix(l, field+":") {
				v, _ := strconv.ParseFloat(strings.Fields(l)[1], 64)
				kb += v
			}
		}
	}
	return kb / 1024
}

// FDs is the number of open descriptors of the process and its workers.
func (p *Proc) FDs() int {
	n := 0
	for _, pid := range p.PIDs() {
		ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		n += len(ents)
	}
	return n
}

// WaitPorts polls until every address accepts a TCP connection: the programs a
// benchmark starts are ready when they listen. It gives up after 10 s or when ctx
// ends.
func WaitPorts(ctx context.Context, addrs ...string) error {
	deadline := time.Now().Add(10 * time.Second)
	for _, a := range addrs {
		for {
			c, err := net.DialTimeout("tcp", a, time.Second)
			if err == nil {
				c.Close()
				break
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return fmt.Errorf("wait for %s: %w", a, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// PortsFree returns an error naming the first address something already accepts
// connections on, and what listens there. A benchmark checks its ports before it
// starts a program on them: weir, HAProxy and nginx all listen with SO_REUSEPORT,
// so a program left over from an earlier run would silently take a share of the
// load, and every figure would be read off the wrong process.
func PortsFree(addrs ...string) error {
	for _, a := range addrs {
		c, err := net.DialTimeout("tcp", a, time.Second)
		if err != nil {
			continue
		}
		c.Close()
		who := ""
		if _, port, err := net.SplitHostPort(a); err == nil {
			out, _ := exec.Command("ss", "-ltnpH", "sport = :"+port).Output()
			who = strings.TrimSpace(string(out))
		}
		if who == "" {
			who = "a process ss cannot name"
		}
		return fmt.Errorf("%s is in use before the benchmark starts anything there (%s): stop it first", a, who)
	}
	return nil
}

// AptInstall installs the Debian packages pkgs (sorted first, for the log), with
// apt-get update before; nothing when pkgs is empty. A benchmark lists what it
// found missing.
func AptInstall(ctx context.Context, pkgs []string) error {
	if len(pkgs) == 0 {
		return nil
	}
	slices.Sort(pkgs)
	log.Printf("apt-get install %v", pkgs)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	for _, argv := range [][]string{{"apt-get", "update"}, append([]string{"apt-get", "install", "-y"}, pkgs...)} {
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %w\n%s", strings.Join(argv, " "), err, out)
		}
	}
	return nil
}

// Variant is one more weir target of a benchmark's -variants flag: its own name,
// environment and, for a before/after in one run, binary.
type Variant struct {
	Name string
	Env  []string // KEY=V
	Bin  string   // the program to run weir from
}

// ParseVariants reads a -variants flag, "name:KEY=V,KEY=V;name2:...", where each
// KEY is one of keys or BIN (another build of the benchmark; self by default).
func ParseVariants(s, self string, keys []string) ([]Variant, error) {
	var vs []Variant
	for spec := range strings.SplitSeq(s, ";") {
		if spec = strings.TrimSpace(spec); spec == "" {
			continue
		}
		name, kvs, ok := strings.Cut(spec, ":")
		if !ok || name == "" {
			return nil, fmt.Errorf("-variants %q: want name:KEY=V,...", spec)
		}
		v := Variant{Name: name, Bin: self}
		for kv := range strings.SplitSeq(kvs, ",") {
			k, val, ok := strings.Cut(kv, "=")
			switch {
			case ok && k == "BIN":
				v.Bin = val
			case ok && slices.Contains(keys, k):
				v.Env = append(v.Env, kv)
			default:
				return nil, fmt.Errorf("-variants %q: %q: want %s or BIN=value", spec, kv, strings.Join(keys, ", "))
			}
		}
		vs = append(vs, v)
	}
	return vs, nil
}

// SyscallCount counts tracepoint events (system calls) of some processes with perf
// stat: no ptrace, so the processes run at full speed.
type SyscallCount struct {
	cmd *exec.Cmd
	out string
}

// CountSyscalls starts counting events (such as "raw_syscalls:sys_enter", every
// system call) of pids. It returns nil, whose Stop reports an error, where perf is
// missing or cannot start.
func CountSyscalls(pids []int, events ...string) *SyscallCount {
	if _, err := exec.LookPath("perf"); err != nil || len(pids) == 0 {
		return nil
	}
	var ps []string
	for _, p := range pids {
		ps = append(ps, strconv.Itoa(p))
	}
	f, err := os.CreateTemp("", "perf-*.csv")
	if err != nil {
		return nil
	}
	f.Close()
	cmd := exec.Command("perf", "stat", "-x,", "-o", f.Name(), "-e", strings.Join(events, ","), "-p", strings.Join(ps, ","))
	if err := cmd.Start(); err != nil {
		os.Remove(f.Name())
		return nil
	}
	time.Sleep(200 * time.Millisecond) // attached
	return &SyscallCount{cmd: cmd, out: f.Name()}
}

// Stop ends the count and returns each event's total.
func (sc *SyscallCount) Stop() (map[string]int64, error) {
	if sc == nil {
		return nil, errors.New("no perf")
	}
	defer os.Remove(sc.out)
	sc.cmd.Process.Signal(os.Interrupt)
	sc.cmd.Wait()
	b, err := os.ReadFile(sc.out)
	if err != nil {
		return nil, err
	}
	counts := map[string]int64{}
	for line := range strings.SplitSeq(string(b), "\n") {
		fs := strings.Split(line, ",")
		if len(fs) < 3 {
			continue
		}
		if v, err := strconv.ParseInt(fs[0], 10, 64); err == nil {
			counts[fs[2]] = v
		}
	}
	return counts, nil
}
