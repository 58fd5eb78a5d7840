package pktbench

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/internal/netns"
)

// Where a veth's receive work runs. A veth has one receive queue here, and
// its NAPI poll runs in softirq on the CPU that scheduled it: the CPU whose
// send found the poll idle. With the generator alone sending, that is the
// generator's CPU, and every case runs on it. With streams sending from
// another CPU, the poll moves to whichever CPU caught it idle and stays
// there while the generator keeps its ring full, so a flood's cost lands on
// either CPU by chance. A threaded NAPI poll (a kernel thread per queue,
// /sys/class/net/<link>/threaded) pinned to one CPU ends that: the link's
// receive work runs there whoever sends. The thread runs SCHED_FIFO, as
// softirq work preempts tasks: at an ordinary thread's priority, bulk TCP
// writers on its CPU overran the ring before it was scheduled and a stream
// starved in retransmission back-off with no flood at all. The kernel's
// real-time throttling leaves other tasks 5% of the CPU however busy the
// poll is (kernel.sched_rt_runtime_us).

// pollOn makes link, in ns, polled by SCHED_FIFO kernel threads pinned to
// cpu, and returns what puts it back to softirq polling.
func pollOn(ns *netns.NS, link string, cpu int) (restore func() error, err error) {
	if cpu < 0 {
		return nil, fmt.Errorf("poll %s in %s: need a CPU, got %d", link, ns, cpu)
	}
	prefix := "napi/" + link + "-"
	before, err := threadsNamed(prefix)
	if err != nil {
		return nil, err
	}
	if err := setThreaded(ns, link, true); err != nil {
		return nil, err
	}
	restore = func() error { return setThreaded(ns, link, false) }
	defer func() {
		if err != nil {
			restore()
		}
	}()
	after, err := threadsNamed(prefix)
	if err != nil {
		return nil, err
	}
	var set unix.CPUSet
	set.Set(cpu)
	pinned := 0
	for pid := range after {
		if before[pid] {
			continue
		}
		if err := unix.SchedSetaffinity(pid, &set); err != nil {
			return nil, fmt.Errorf("poll %s in %s: pin thread %d to cpu %d: %w", link, ns, pid, cpu, err)
		}
		// The lowest real-time priority: above every ordinary task, below
		// the kernel's own real-time threads.
		if err := unix.SchedSetAttr(pid, &unix.SchedAttr{Policy: unix.SCHED_FIFO, Priority: 1}, 0); err != nil {
			return nil, fmt.Errorf("poll %s in %s: thread %d to SCHED_FIFO: %w", link, ns, pid, err)
		}
		pinned++
	}
	if pinned == 0 {
		return nil, fmt.Errorf("poll %s in %s: no %s* kernel thread appeared when threaded polling was turned on", link, ns, prefix)
	}
	return restore, nil
}

// setThreaded turns threaded NAPI polling of link in ns on or off. It writes
// the link's sysfs attribute from `ip netns exec`, which mounts a sysfs of
// the namespace.
func setThreaded(ns *netns.NS, link string, on bool) error {
	v := "0"
	if on {
		v = "1"
	}
	path := "/sys/class/net/" + link + "/threaded"
	cmd := exec.Command("ip", "netns", "exec", ns.Name(), "tee", path)
	cmd.Stdin = strings.NewReader(v + "\n")
	var out bytes.Buffer
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			return fmt.Errorf("%s=%s in %s: %w (install iproute2)", path, v, ns, err)
		}
		return fmt.Errorf("%s=%s in %s: %w: %s", path, v, ns, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// threadsNamed returns the processes (kernel threads here) whose name starts
// with prefix.
func threadsNamed(prefix string) (map[int]bool, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list threads: %w", err)
	}
	out := map[int]bool{}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile("/proc/" + e.Name() + "/comm")
		if err != nil {
			continue // gone meanwhile
		}
		if strings.HasPrefix(string(comm), prefix) {
			out[pid] = true
		}
	}
	return out, nil
}
