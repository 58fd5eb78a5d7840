package httplb

import "github.com/weir-lb/weir/internal/httpbackend"

// testCert and testKey are a self-signed certificate for 127.0.0.1, made when the
// tests start.
var testCert, testKey = selfSigned()

func selfSigned() (certPEM, keyPEM []byte) {
	cert, key, err := httpbackend.SelfSigned("weir test")
	if err != nil {
		panic(err)
	}
	return cert, key
}
