package benchstat

import "testing"

func TestMedianAndPairedRatio(t *testing.T) {
	for _, tc := range []struct {
		v    []float64
		want float64
	}{
		{nil, 0}, {[]float64{3}, 3}, {[]float64{3, 1, 2}, 2}, {[]float64{4, 1, 3, 2}, 2.5},
	} {
		if got := Median(tc.v); got != tc.want {
			t.Errorf("Median(%v) = %v; want %v", tc.v, got, tc.want)
		}
	}
	id := func(x float64) float64 { return x }
	// Run 2's base is 0 and is left out: ratios 2, 3, 0.5 -> 2.
	if got, ok := PairedRatio([]float64{2, 9, 3, 1}, []float64{1, 0, 1, 2}, id); !ok || got != 2 {
		t.Errorf("PairedRatio = %v, %v; want 2, true", got, ok)
	}
	if _, ok := PairedRatio([]float64{1}, []float64{0}, id); ok {
		t.Errorf("PairedRatio with no usable run reported a ratio")
	}
}
