// Package benchstat is the arithmetic the benchmarks share for interleaved runs:
// medians, and the median of each run's ratio of one target to another (run i of
// every target is measured in the same round, so that ratio moves less with the
// machine's drift than a ratio of medians).
package benchstat

import "sort"

// Median is the median of v (the mean of the middle two for an even count); 0 for
// none. It sorts v.
func Median(v []float64) float64 {
	sort.Float64s(v)
	n := len(v)
	switch {
	case n == 0:
		return 0
	case n%2 == 0:
		return (v[n/2-1] + v[n/2]) / 2
	}
	return v[n/2]
}

// Of is the median of f over rs.
func Of[R any](rs []R, f func(R) float64) float64 {
	v := make([]float64, 0, len(rs))
	for _, r := range rs {
		v = append(v, f(r))
	}
	return Median(v)
}

// PairedRatio is the median over runs of f(a[i]) / f(b[i]), runs where f(b[i]) is
// not positive left out; false if none is left.
func PairedRatio[R any](a, b []R, f func(R) float64) (float64, bool) {
	var v []float64
	for i := range min(len(a), len(b)) {
		if d := f(b[i]); d > 0 {
			v = append(v, f(a[i])/d)
		}
	}
	if len(v) == 0 {
		return 0, false
	}
	return Median(v), true
}
