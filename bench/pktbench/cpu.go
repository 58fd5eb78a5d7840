package pktbench

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Softirq time, as Cilium reports a datapath's CPU cost: the kernel's
// softirq column of /proc/stat, read for the CPU the generator is pinned to
// before and after each window. A veth runs its receiver's NAPI poll on the
// sending CPU, in softirq context, so that column holds the balancer
// namespace's work on the load (l0's XDP program or the kernel stack and
// nftables) and the sinks' beyond it; the generator's own program runs in
// process context and counts as system time. /proc/stat counts in USER_HZ
// (100) ticks, and this kernel samples at each scheduler tick which context
// was interrupted (CONFIG_TICK_CPU_ACCOUNTING, no IRQ time accounting): a
// statistical estimate, about 70 samples in a 0.7 s window, with other
// engineers' softirq work on that CPU included.

// userHZ is the unit of /proc/stat's times (USER_HZ, fixed by the ABI).
const userHZ = 100

// softirqTicks returns the softirq time of cpu (< 0: all CPUs) in USER_HZ
// ticks.
func softirqTicks(cpu int) (uint64, error) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("softirq time: %w", err)
	}
	defer f.Close()
	want := "cpu"
	if cpu >= 0 {
		want = "cpu" + strconv.Itoa(cpu)
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		// cpu user nice system idle iowait irq softirq ...
		if len(fields) < 8 || fields[0] != want {
			continue
		}
		v, err := strconv.ParseUint(fields[7], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("softirq time: /proc/stat %s: %w", want, err)
		}
		return v, nil
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("softirq time: %w", err)
	}
	return 0, fmt.Errorf("softirq time: no %q line in /proc/stat", want)
}

// pinThread binds the calling thread (locked to its goroutine by the
// caller) to cpu and returns what restores its old set.
func pinThread(cpu int) (func(), error) {
	var old, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		return nil, fmt.Errorf("get cpu affinity: %w", err)
	}
	set.Set(cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("pin to cpu %d: %w", cpu, err)
	}
	return func() { unix.SchedSetaffinity(0, &old) }, nil
}
