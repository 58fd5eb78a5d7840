//go:build !linux

package health

import "testing"

func synEnv(t *testing.T) checkEnv {
	t.Skip("syn checks need Linux")
	return checkEnv{}
}
