package agent

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/config"
)

// metrics is the agent's Prometheus registry. Counters of the data planes are read
// at scrape time from a Status snapshot; check latencies and reloads are counted as
// they happen.
type metrics struct {
	a        *Agent
	reg      *prometheus.Registry
	checks   *prometheus.HistogramVec
	reloads  *prometheus.CounterVec
	collDesc map[string]*prometheus.Desc
}

func newMetrics(a *Agent) *metrics {
	m := &metrics{a: a, reg: prometheus.NewRegistry()}
	m.checks = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "weir_health_check_duration_seconds",
		Help:    "Duration of active health checks, by service and result (ok or fail).",
		Buckets: prometheus.ExponentialBuckets(0.0005, 4, 8),
	}, []string{"service", "result"})
	m.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "weir_reloads_total",
		Help: "Config reloads, by result (ok, or error: the running config stayed in force).",
	}, []string{"result"})
	m.reloads.WithLabelValues("ok")
	m.reloads.WithLabelValues("error")
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, nil)
	}
	m.collDesc = map[string]*prometheus.Desc{
		"service_dp":      d("weir_service_data_plane", "1 for the data plane serving the service.", "service", "data_plane"),
		"service_down":    d("weir_service_all_backends_down", "1 while no backend of the service is usable (all_down applies).", "service"),
		"service_pkts":    d("weir_service_packets_total", "Packets the XDP program forwarded for the service.", "service"),
		"service_bytes":   d("weir_service_bytes_total", "Bytes the service moved (XDP: frames; proxy: both directions).", "service", "data_plane"),
		"service_conns":   d("weir_service_connections_active", "Connections the proxy handles now.", "service"),
		"service_accept":  d("weir_service_connections_total", "Connections the proxy accepted.", "service"),
		"backend_pkts":    d("weir_backend_packets_total", "Packets the XDP program sent to the backend.", "service", "backend"),
		"backend_bytes":   d("weir_backend_bytes_total", "Bytes to and from the backend.", "service", "backend", "data_plane"),
		"service_flows":   d("weir_service_flows_active", "XDP nat flows open now (a flow the connection table forgets without FIN or RST stays counted).", "service"),
		"backend_flows":   d("weir_backend_flows_active", "XDP nat flows to the backend open now.", "service", "backend"),
		"backend_conns":   d("weir_backend_connections_active", "Proxy connections to the backend now.", "service", "backend"),
		"backend_connect": d("weir_backend_connects_total", "Successful proxy connects to the backend.", "service", "backend"),
		"backend_usable":  d("weir_backend_usable", "1 while health says the backend may take new flows.", "service", "backend"),
		"backend_health":  d("weir_backend_health", "1 for the backend's current health state.", "service", "backend", "state"),
		"backend_weight":  d("weir_backend_weight", "The backend's weight in effect.", "service", "backend"),
		"backend_drained": d("weir_backend_drained", "1 while the backend is drained.", "service", "backend"),
		"xdp_reason":      d("weir_xdp_packets_total", "Packets the XDP program counted, by verdict reason (drop_* are drops).", "reason"),
		"xdp_loaded":      d("weir_xdp_loaded", "1 while the XDP program is loaded and attached."),
	}
	m.reg.MustRegister(m.checks, m.reloads, m, prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) observeCheck(r health.Result) {
	res := "ok"
	if r.Err != nil {
		res = "fail"
	}
	m.checks.WithLabelValues(r.Service, res).Observe(r.Duration.Seconds())
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// Describe sends the descriptions of the scrape-time metrics.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range m.collDesc {
		ch <- d
	}
}

// Collect reads a status snapshot into metrics.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	st, err := m.a.Status()
	if err != nil {
		return
	}
	g := func(key string, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(m.collDesc[key], prometheus.GaugeValue, v, labels...)
	}
	c := func(key string, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(m.collDesc[key], prometheus.CounterValue, float64(v), labels...)
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	g("xdp_loaded", b2f(st.XDP.Loaded))
	for r, n := range st.XDPReasons {
		c("xdp_reason", n, r)
	}
	states := []string{health.Unknown.String(), health.Up.String(), health.Down.String(), health.Ejected.String()}
	for _, s := range st.Services {
		g("service_dp", 1, s.Name, s.DataPlane)
		g("service_down", b2f(s.AllDown), s.Name)
		c("service_bytes", s.Bytes, s.Name, s.DataPlane)
		if s.DataPlane == PlaneXDP {
			c("service_pkts", s.Packets, s.Name)
			if s.Mode == config.ModeNAT {
				g("service_flows", float64(s.ActiveFlows), s.Name)
			}
		} else {
			g("service_conns", float64(s.Connections), s.Name)
			c("service_accept", s.Accepted, s.Name)
		}
		for _, b := range s.Backends {
			c("backend_bytes", b.Bytes, s.Name, b.Address, s.DataPlane)
			if s.DataPlane == PlaneXDP {
				c("backend_pkts", b.Packets, s.Name, b.Address)
				if s.Mode == config.ModeNAT {
					g("backend_flows", float64(b.ActiveFlows), s.Name, b.Address)
				}
			} else {
				g("backend_conns", float64(b.Connections), s.Name, b.Address)
				c("backend_connect", b.Connects, s.Name, b.Address)
			}
			g("backend_usable", b2f(b.Usable), s.Name, b.Address)
			for _, state := range states {
				g("backend_health", b2f(b.Health == state), s.Name, b.Address, state)
			}
			g("backend_weight", float64(b.Weight), s.Name, b.Address)
			g("backend_drained", b2f(b.Drained), s.Name, b.Address)
		}
	}
}
