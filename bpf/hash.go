package bpf

import (
	"crypto/sha256"
	"encoding/hex"
)

// ObjectHash is the SHA-256 of the balancer's compiled object as embedded, so two
// binaries can tell whether they carry the same data plane.
func ObjectHash() string {
	h := sha256.Sum256(_WeirBytes)
	return hex.EncodeToString(h[:])
}
