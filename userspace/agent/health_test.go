package agent

import (
	"testing"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/config"
)

func TestHealthMethod(t *testing.T) {
	auto := health.MethodConnect
	if haveNetRaw() {
		auto = health.MethodSyn
	}
	tests := []struct {
		typ    config.CheckType
		method config.CheckMethod
		want   health.Method
	}{
		{config.CheckTCP, config.MethodAuto, auto},
		{config.CheckTCP, config.MethodSyn, health.MethodSyn},
		{config.CheckTCP, config.MethodConnect, health.MethodConnect},
		{config.CheckHTTP, config.MethodAuto, health.MethodConnect},
		{config.CheckHTTP, config.MethodConnect, health.MethodConnect},
		{config.CheckNone, config.MethodAuto, health.MethodConnect},
	}
	for _, tt := range tests {
		if got := healthMethod(tt.typ, tt.method); got != tt.want {
			t.Errorf("healthMethod(%s, %s): got %v; want %v", tt.typ, tt.method, got, tt.want)
		}
	}
}
