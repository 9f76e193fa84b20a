//go:build tools

// Package tools records the program tests/go/build.sh builds from this module (h2spec, the
// HTTP/2 conformance suite that tests/tests/h2spec.rs runs against the sidecar), so `go mod tidy`
// keeps every module it needs in go.mod and go.sum.
package tools

import _ "github.com/summerwind/h2spec/cmd/h2spec"
