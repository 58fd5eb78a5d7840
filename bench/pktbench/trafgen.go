package pktbench

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/bench/pktgen"
)

// Trafgen is the second, independent generator: netsniff-ng's trafgen,
// sending through a packet socket's TX ring (no qdisc) out of g0, one process
// pinned to the generator's CPU (trafgen pins its sender to CPU 0 itself;
// the benchmark moves it once it sends). It sends the same frames as weir's generator
// (the same bytes for every flow, written into its configuration as one
// packet each, cycled in order), so only the generator differs. On this
// kernel it reaches only a few hundred thousand frames/s from one CPU, so
// compare ratios (weir over the floor under each generator), not rates.
const Trafgen = "trafgen"

// TrafgenAvailable says whether the trafgen binary is on PATH.
func TrafgenAvailable() bool {
	_, err := exec.LookPath(Trafgen)
	return err == nil
}

// trafgenConfig is a trafgen configuration sending cfg's frames of kind p,
// one packet per flow, as byte lists.
func trafgenConfig(cfg pktgen.Config, p pktgen.Packet) []byte {
	var b bytes.Buffer
	for f := range cfg.Flows {
		b.WriteString("{")
		for i, x := range cfg.Frame(p, f) {
			if i > 0 {
				b.WriteString(",")
			}
			fmt.Fprintf(&b, "0x%02x", x)
		}
		b.WriteString("}\n")
	}
	return b.Bytes()
}

// trafgenLoad is a running trafgen process.
type trafgenLoad struct {
	cmd  *exec.Cmd
	dir  string
	out  bytes.Buffer
	done chan error // the process's exit
}

// startTrafgen starts trafgen in the generator namespace sending cfg's
// frames out of g0, pinned to cpu (< 0: unpinned), at rate frames/s (0: flat
// out), for at most limit (it is killed then if stop has not ended it).
func startTrafgen(l *Line, cfg pktgen.Config, cpu int, rate float64, limit time.Duration) (*trafgenLoad, error) {
	if !TrafgenAvailable() {
		return nil, fmt.Errorf("trafgen: %w (install netsniff-ng)", exec.ErrNotFound)
	}
	dir, err := os.MkdirTemp("", "weir-trafgen-")
	if err != nil {
		return nil, fmt.Errorf("trafgen: %w", err)
	}
	conf := dir + "/frames.cfg"
	if err := os.WriteFile(conf, trafgenConfig(cfg, cfg.Mix[0]), 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("trafgen: %w", err)
	}
	args := []string{"netns", "exec", l.Gen.Name()}
	if cpu >= 0 {
		args = append(args, "taskset", "-c", strconv.Itoa(cpu))
	}
	args = append(args, Trafgen, "--dev", GenLink, "--conf", conf, "--cpus", "1", "--no-cpu-stats")
	if rate > 0 {
		args = append(args, "--rate", fmt.Sprintf("%.0fpps", rate))
	}
	t := &trafgenLoad{cmd: exec.Command("ip", args...), dir: dir, done: make(chan error, 1)}
	t.cmd.Stdout, t.cmd.Stderr = &t.out, &t.out
	// Its own process group, so stop reaches trafgen's forked sender too.
	t.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := t.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("trafgen: %w", err)
	}
	pgid := t.cmd.Process.Pid
	killer := time.AfterFunc(limit, func() { syscall.Kill(-pgid, syscall.SIGKILL) })
	// Exits when the process does: stop, the limit above, or an error.
	go func() {
		err := t.cmd.Wait()
		killer.Stop()
		t.done <- err
	}()
	return t, nil
}

// stop interrupts trafgen (its process group, which startTrafgen created),
// waits for it and removes its configuration. An exit caused by the
// interrupt is not an error.
func (t *trafgenLoad) stop() error {
	pgid := t.cmd.Process.Pid
	syscall.Kill(-pgid, syscall.SIGINT)
	var err error
	select {
	case err = <-t.done:
	case <-time.After(3 * time.Second):
		syscall.Kill(-pgid, syscall.SIGKILL)
		err = <-t.done
	}
	os.RemoveAll(t.dir)
	var exit *exec.ExitError
	if errors.As(err, &exit) && (exit.ExitCode() == 0 || strings.Contains(exit.String(), "interrupt")) {
		err = nil
	}
	if err != nil {
		return fmt.Errorf("trafgen: %w: %s", err, strings.TrimSpace(t.out.String()))
	}
	return nil
}

// g0Sent returns the frames g0 has sent or dropped on sending (a full
// receive ring on the peer): what a generator outside weir offered.
func (l *Line) g0Sent() (uint64, error) {
	var n uint64
	err := l.Gen.Do(func() error {
		g, err := netlink.LinkByName(GenLink)
		if err != nil {
			return err
		}
		s := g.Attrs().Statistics
		n = s.TxPackets + s.TxDropped
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("g0 counters: %w", err)
	}
	return n, nil
}

// pin moves every thread of trafgen's processes (the one startTrafgen
// started and its children) to cpu: trafgen pins its sender to CPU 0
// itself, after taskset. Call it once trafgen is sending.
func (t *trafgenLoad) pin(cpu int) error {
	if cpu < 0 {
		return nil
	}
	var set unix.CPUSet
	set.Set(cpu)
	pids := []int{t.cmd.Process.Pid}
	for i := 0; i < len(pids); i++ {
		pid := pids[i]
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return fmt.Errorf("trafgen: pin to cpu %d: %w", cpu, err)
		}
		for _, task := range tasks {
			tid, err := strconv.Atoi(task.Name())
			if err != nil {
				continue
			}
			if err := unix.SchedSetaffinity(tid, &set); err != nil {
				return fmt.Errorf("trafgen: pin thread %d to cpu %d: %w", tid, cpu, err)
			}
			children, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, tid))
			for _, c := range strings.Fields(string(children)) {
				if n, err := strconv.Atoi(c); err == nil {
					pids = append(pids, n)
				}
			}
		}
	}
	return nil
}
