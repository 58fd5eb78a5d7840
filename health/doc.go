// Package health decides which backends the data planes may send new flows to.
//
// A Checker runs active checks (a TCP connect, a half-open SYN through one
// shared raw socket, or an HTTP GET on a kept-alive connection) against every
// backend on a shared schedule with a bounded number of checks in flight, applies
// rise/fall hysteresis, and folds in passive signals that the data planes report
// with Observe (outlier ejection, as Envoy does it). Each backend belongs to a
// service; per service the Checker also applies a maximum ejection percentage and
// a panic threshold below which every backend is used again.
//
// Consumers read the outcome three ways: Snapshot for status output and metrics,
// Subscribe/Watch for an ordered stream of Change values, and OnCheck for a
// callback after every active check (metrics, benchmarks).
//
// The package knows nothing of BPF or of the proxy and builds on every OS.
package health
