//go:build race

package httplb

// raceDetector: this test binary runs under the race detector, which grows
// goroutine stacks and the heap's objects.
const raceDetector = true
