//go:build !race

package httplb

const raceDetector = false
