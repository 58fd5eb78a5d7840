package agent

import (
	"sync"

	"golang.org/x/sys/unix"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/agent/plan"
	"github.com/weir-lb/weir/userspace/config"
)

// healthConfig translates a service's settings for the health checker. The config
// has resolved every default, and its zeros mean off as health's do.
func healthConfig(s *config.Service) health.Config {
	h := s.Health
	hc := health.Config{
		Check: health.Check{
			Kind:     health.Kind(h.Type),
			Method:   healthMethod(h.Type, h.Method),
			Interval: h.Interval,
			Timeout:  h.Timeout,
			Rise:     h.Rise,
			Fall:     h.Fall,
			Jitter:   h.Jitter,
			Initial:  plan.InitialState(h.Initial),
			HTTP:     health.HTTPCheck{Path: h.Path, Host: h.Host, Body: h.ExpectBody},
		},
		Outlier: health.Outlier{
			Consecutive:        s.Passive.Consecutive,
			BaseEjection:       s.Passive.BaseEjection,
			MaxEjection:        s.Passive.MaxEjection,
			MaxEjectionPercent: s.Passive.MaxEjectionPercent,
		},
		PanicThreshold: s.PanicThreshold,
	}
	for _, r := range h.ExpectStatus {
		hc.Check.HTTP.Status = append(hc.Check.HTTP.Status, health.StatusRange{Min: r.Min, Max: r.Max})
	}
	return hc
}

// healthMethod resolves a service's check method: auto is syn for tcp checks
// when the agent may open raw sockets (CAP_NET_RAW), connect otherwise. The
// checker itself falls back to connect if its raw sockets fail all the same,
// and status says so.
func healthMethod(t config.CheckType, m config.CheckMethod) health.Method {
	switch {
	case t != config.CheckTCP || m == config.MethodConnect:
		return health.MethodConnect
	case m == config.MethodSyn || haveNetRaw():
		return health.MethodSyn
	}
	return health.MethodConnect
}

// haveNetRaw reports whether the process has CAP_NET_RAW in its effective set.
var haveNetRaw = sync.OnceValue(func() bool {
	const capNetRaw = 13 // linux/capability.h
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if unix.Capget(&hdr, &data[0]) != nil {
		return false
	}
	return data[0].Effective&(1<<capNetRaw) != 0
})

// healthMethodStatus is the method a service's tcp checks use now, as status
// shows it.
func (a *Agent) healthMethodStatus(service string) string {
	m, err := a.checker.Method(service)
	if err != nil {
		return m.String() + " (" + err.Error() + ")"
	}
	if syn := a.checker.Syn(); m == health.MethodSyn && syn.ReserveErr != nil {
		return m.String() + " (" + syn.ReserveErr.Error() + ")"
	}
	return m.String()
}
