// Package metrics is the agent's Prometheus registry. The data planes' counters and
// the state of services and backends are read at scrape time from the status the
// agent publishes (the same one `weir status` shows, so the two never disagree);
// health-check latencies and reloads are counted as they happen.
package metrics

import (
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/weir-lb/weir/health"
	"github.com/weir-lb/weir/userspace/agent/api"
	"github.com/weir-lb/weir/userspace/config"
)

// Metrics is the registry.
type Metrics struct {
	status  func() (api.Status, error)
	reg     *prometheus.Registry
	checks  *prometheus.HistogramVec
	reloads *prometheus.CounterVec
	// The http plane's requests, by backend and status class, and their latency.
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	d        descs
}

// descs are the scrape-time metrics' descriptions.
type descs struct {
	serviceDataPlane, serviceDown, servicePackets, serviceBytes, serviceConns, serviceAccepted *prometheus.Desc
	backendPackets, backendBytes, serviceFlows, backendFlows, backendConns, backendConnects    *prometheus.Desc
	backendUsable, backendHealth, backendWeight, backendDrained, xdpReason, xdpLoaded          *prometheus.Desc
	bgpPeerUp, bgpPeerUptime, bgpAnnounced, bgpPending, nodeDrained, healthUnapplied           *prometheus.Desc
	tableInfo, prevTableInfo, prevTableAge                                                     *prometheus.Desc
	httpInFlight, httpTunnels                                                                  *prometheus.Desc
	serviceServing, serviceRestarts, serviceAcceptErrors, serviceClientTimeouts                *prometheus.Desc
}

// New returns the registry; status is read at every scrape.
func New(status func() (api.Status, error)) *Metrics {
	m := &Metrics{status: status, reg: prometheus.NewRegistry()}
	m.checks = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "weir_health_check_duration_seconds",
		Help:    "Duration of active health checks, by service and result (ok or fail).",
		Buckets: prometheus.ExponentialBuckets(0.0005, 4, 8),
	}, []string{"service", "result"})
	m.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "weir_reloads_total",
		Help: "Config reloads, by result (ok, or error: the running config stayed in force).",
	}, []string{"result"})
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "weir_http_requests_total",
		Help: "Requests the http data plane answered from a backend, by service, backend and status class (2xx, ..., 5xx).",
	}, []string{"service", "backend", "class"})
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "weir_http_request_duration_seconds",
		Help:    "Duration of the http data plane's requests, from their arrival to the last byte of the answer, by service and backend.",
		Buckets: prometheus.ExponentialBuckets(0.0001, 2.5, 14),
	}, []string{"service", "backend"})
	m.reloads.WithLabelValues("ok")
	m.reloads.WithLabelValues("error")
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, nil)
	}
	m.d = descs{
		serviceDataPlane: d("weir_service_data_plane", "1 for the data plane serving the service.", "service", "data_plane"),
		serviceDown:      d("weir_service_all_backends_down", "1 while no backend of the service is usable (all_down applies).", "service"),
		servicePackets:   d("weir_service_packets_total", "Packets the XDP program forwarded for the service.", "service"),
		serviceBytes:     d("weir_service_bytes_total", "Bytes the service moved (XDP: frames; proxy: both directions).", "service", "data_plane"),
		serviceConns:     d("weir_service_connections_active", "Connections the proxy handles now.", "service"),
		serviceAccepted:  d("weir_service_connections_total", "Connections the proxy accepted.", "service"),
		backendPackets:   d("weir_backend_packets_total", "Packets the XDP program sent to the backend.", "service", "backend"),
		backendBytes:     d("weir_backend_bytes_total", "Bytes to and from the backend.", "service", "backend", "data_plane"),
		serviceFlows:     d("weir_service_flows_active", "XDP nat flows open now (a flow the connection table forgets without FIN or RST stays counted).", "service"),
		backendFlows:     d("weir_backend_flows_active", "XDP nat flows to the backend open now.", "service", "backend"),
		backendConns:     d("weir_backend_connections_active", "Proxy connections to the backend now.", "service", "backend"),
		backendConnects:  d("weir_backend_connects_total", "Successful proxy connects to the backend.", "service", "backend"),
		backendUsable:    d("weir_backend_usable", "1 while health says the backend may take new flows.", "service", "backend"),
		backendHealth:    d("weir_backend_health", "1 for the backend's current health state.", "service", "backend", "state"),
		backendWeight:    d("weir_backend_weight", "The backend's weight in effect.", "service", "backend"),
		backendDrained:   d("weir_backend_drained", "1 while the backend is drained.", "service", "backend"),
		xdpReason:        d("weir_xdp_packets_total", "Packets the XDP program counted, by verdict reason (drop_* are drops).", "reason"),
		xdpLoaded:        d("weir_xdp_loaded", "1 while the XDP program is loaded and attached."),
		bgpPeerUp:        d("weir_bgp_peer_established", "1 while the BGP session with the peer is established.", "peer"),
		bgpPeerUptime:    d("weir_bgp_peer_uptime_seconds", "How long the BGP session with the peer has been established (0 while it is not).", "peer"),
		bgpAnnounced:     d("weir_bgp_route_announced", "1 for each VIP route the node announces over BGP.", "prefix"),
		bgpPending:       d("weir_bgp_route_pending", "1 for each VIP route whose announcement (want=announce) or withdrawal (want=withdraw) GoBGP refused; retried until made.", "prefix", "want"),
		nodeDrained:      d("weir_node_drained", "1 while the node is drained (weir node drain): every BGP route withdrawn."),
		healthUnapplied:  d("weir_health_unapplied", "1 while health verdicts the data planes refused wait for the agent's next try: the planes lag the checker (weir status says why)."),
		tableInfo: d("weir_service_table_info", "1, labelled with the fingerprint of the service's XDP lookup table: nodes with equal fingerprints "+
			"give every new flow the same backend (alert when they differ); fingerprint \"\" while no backend takes new flows; "+
			"no series for a service the XDP program does not hold.", "service", "fingerprint"),
		prevTableInfo: d("weir_service_previous_table_info", "1, labelled with the fingerprint of the lookup table the current one replaced, "+
			"while the previous-table fallback may use it.", "service", "fingerprint"),
		httpInFlight:          d("weir_http_requests_in_flight", "Requests the http data plane is forwarding now, tunnels included.", "service"),
		httpTunnels:           d("weir_http_tunnels_open", "Upgraded connections (WebSocket and others) the http data plane joins to a backend now.", "service"),
		serviceServing:        d("weir_service_serving", "Proxy and http plane: 1 while the service's server serves, 0 while it stopped on its own and is being started anew.", "service"),
		serviceRestarts:       d("weir_service_restarts_total", "Proxy and http plane: servers the agent started anew after the service's server stopped on its own (its listener failed).", "service"),
		serviceAcceptErrors:   d("weir_service_accept_errors_total", "Proxy and http plane: accept errors the service's listeners waited out (no file descriptor or socket memory left).", "service"),
		serviceClientTimeouts: d("weir_service_client_timeouts_total", "Proxy and http plane: client connections the kernel gave up on because the client stopped acknowledging (TCP keepalive probes or bytes sent to it unanswered: tcp_keepalive, tcp_user_timeout).", "service"),
		prevTableAge:          d("weir_service_previous_table_age_seconds", "Seconds since the service's previous lookup table was replaced, while the fallback may use it.", "service"),
	}
	m.reg.MustRegister(m.collectors()...)
	m.reg.MustRegister(prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	return m
}

// collectors are the registry's collectors of weir's own metrics (weir_*),
// which docs/operating.md lists.
func (m *Metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.checks, m.reloads, m.requests, m.latency, m}
}

// ObserveCheck counts one health check's result and latency.
func (m *Metrics) ObserveCheck(r health.Result) {
	res := "ok"
	if r.Err != nil {
		res = "fail"
	}
	m.checks.WithLabelValues(r.Service, res).Observe(r.Duration.Seconds())
}

var classes = [...]string{"other", "1xx", "2xx", "3xx", "4xx", "5xx"}

// ObserveRequest counts one request the http data plane answered from backend.
func (m *Metrics) ObserveRequest(service, backend string, status int, d time.Duration) {
	c := status / 100
	if c < 1 || c > 5 {
		c = 0
	}
	m.requests.WithLabelValues(service, backend, classes[c]).Inc()
	m.latency.WithLabelValues(service, backend).Observe(d.Seconds())
}

// Reload counts a reload: ok, or rejected (the running config stayed in force).
func (m *Metrics) Reload(ok bool) {
	if ok {
		m.reloads.WithLabelValues("ok").Inc()
	} else {
		m.reloads.WithLabelValues("error").Inc()
	}
}

// Handler serves the exposition.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// Describe sends the descriptions of the scrape-time metrics.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.d.serviceDataPlane, m.d.serviceDown, m.d.servicePackets, m.d.serviceBytes,
		m.d.serviceConns, m.d.serviceAccepted, m.d.backendPackets, m.d.backendBytes, m.d.serviceFlows, m.d.backendFlows,
		m.d.backendConns, m.d.backendConnects, m.d.backendUsable, m.d.backendHealth, m.d.backendWeight,
		m.d.backendDrained, m.d.xdpReason, m.d.xdpLoaded, m.d.bgpPeerUp, m.d.bgpPeerUptime, m.d.bgpAnnounced, m.d.bgpPending, m.d.nodeDrained, m.d.healthUnapplied,
		m.d.tableInfo, m.d.prevTableInfo, m.d.prevTableAge, m.d.httpInFlight, m.d.httpTunnels, m.d.serviceServing, m.d.serviceRestarts, m.d.serviceAcceptErrors, m.d.serviceClientTimeouts} {
		ch <- d
	}
}

// Collect reads a status snapshot into metrics.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	st, err := m.status()
	if err != nil {
		return
	}
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	c := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	g(m.d.xdpLoaded, b2f(st.XDP.Loaded))
	g(m.d.healthUnapplied, b2f(st.HealthUnapplied != nil))
	for r, n := range st.XDPReasons {
		c(m.d.xdpReason, n, r)
	}
	if b := st.BGP; b != nil {
		g(m.d.nodeDrained, b2f(b.Drained))
		for _, p := range b.Peers {
			g(m.d.bgpPeerUp, b2f(p.State == "established"), p.Address)
			up := 0.0
			if !p.Since.IsZero() {
				up = time.Since(p.Since).Seconds()
			}
			g(m.d.bgpPeerUptime, up, p.Address)
		}
		for _, r := range b.Announced {
			g(m.d.bgpAnnounced, 1, r.Prefix)
		}
		for _, r := range b.Pending {
			g(m.d.bgpPending, 1, r.Prefix, r.Want)
		}
	}
	states := []string{health.Unknown.String(), health.Up.String(), health.Down.String(), health.Ejected.String()}
	for _, s := range st.Services {
		g(m.d.serviceDataPlane, 1, s.Name, s.DataPlane)
		g(m.d.serviceDown, b2f(s.AllDown), s.Name)
		// The http plane counts requests, not bytes or backend connections: its
		// services have none of those series rather than zeros that read as idle.
		bytesKept := s.DataPlane != api.PlaneHTTP
		if bytesKept {
			c(m.d.serviceBytes, s.Bytes, s.Name, s.DataPlane)
		}
		if t := s.Table; t != nil {
			g(m.d.tableInfo, 1, s.Name, t.Fingerprint)
			if t.Previous != "" {
				g(m.d.prevTableInfo, 1, s.Name, t.Previous)
				g(m.d.prevTableAge, t.PreviousAgeSeconds, s.Name)
			}
		}
		if s.DataPlane == api.PlaneXDP {
			c(m.d.servicePackets, s.Packets, s.Name)
			if s.Mode == string(config.ModeNAT) {
				g(m.d.serviceFlows, float64(s.ActiveFlows), s.Name)
			}
		} else {
			g(m.d.serviceConns, float64(s.Connections), s.Name)
			c(m.d.serviceAccepted, s.Accepted, s.Name)
			g(m.d.serviceServing, b2f(s.Down == ""), s.Name)
			c(m.d.serviceRestarts, s.Restarts, s.Name)
			c(m.d.serviceAcceptErrors, s.AcceptErrors, s.Name)
			c(m.d.serviceClientTimeouts, s.ClientTimeouts, s.Name)
		}
		if s.DataPlane == api.PlaneHTTP {
			g(m.d.httpInFlight, float64(s.InFlight), s.Name)
			g(m.d.httpTunnels, float64(s.Tunnels), s.Name)
		}
		for _, b := range s.Backends {
			if bytesKept {
				c(m.d.backendBytes, b.Bytes, s.Name, b.Address, s.DataPlane)
			}
			switch s.DataPlane {
			case api.PlaneXDP:
				c(m.d.backendPackets, b.Packets, s.Name, b.Address)
				if s.Mode == string(config.ModeNAT) {
					g(m.d.backendFlows, float64(b.ActiveFlows), s.Name, b.Address)
				}
			case api.PlaneProxy:
				g(m.d.backendConns, float64(b.Connections), s.Name, b.Address)
				c(m.d.backendConnects, b.Connects, s.Name, b.Address)
			}
			g(m.d.backendUsable, b2f(b.Usable), s.Name, b.Address)
			for _, state := range states {
				g(m.d.backendHealth, b2f(b.Health == state), s.Name, b.Address, state)
			}
			g(m.d.backendWeight, float64(b.Weight), s.Name, b.Address)
			g(m.d.backendDrained, b2f(b.Drained), s.Name, b.Address)
		}
	}
}
