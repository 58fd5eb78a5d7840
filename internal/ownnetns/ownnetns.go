// Package ownnetns runs a test again in a child process in a network
// namespace of its own, for a test that changes what would reach other tests
// of the host's namespace: nftables rules, sysctls.
package ownnetns

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// env set to a test's name marks the child process In starts for it, which
// runs in a network namespace of its own.
const env = "WEIR_TEST_OWN_NETNS"

// In runs the calling test again in a child process in a network namespace of
// its own (loopback up, and the sysctls given, which are the namespace's own),
// with this process's environment, and reports false: the caller returns, the
// child's result being the test's. In the child it reports true: the caller
// goes on with the test.
func In(t *testing.T, sysctls map[string]string) bool {
	t.Helper()
	if os.Getenv(env) == t.Name() {
		if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
			t.Fatalf("ip link set lo up: %v: %s", err, out)
		}
		for k, v := range sysctls {
			if err := os.WriteFile("/proc/sys/"+strings.ReplaceAll(k, ".", "/"), []byte(v), 0); err != nil {
				t.Fatal(err)
			}
		}
		return true
	}
	cmd := exec.Command(os.Args[0], "-test.count=1", "-test.v", "-test.run=^"+t.Name()+"$")
	cmd.Env = append(os.Environ(), env+"="+t.Name())
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil || !strings.Contains(out.String(), "--- PASS: "+t.Name()) {
		t.Fatalf("in a network namespace of its own: %v\n%s", err, out.String())
	}
	if testing.Verbose() {
		t.Logf("child:\n%s", out.String())
	}
	return false
}
