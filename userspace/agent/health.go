package agent

import (
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
