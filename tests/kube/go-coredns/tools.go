//go:build tools

// Package tools records the program tests/kube/build.sh builds from this module (coredns), so
// `go mod tidy` keeps every module it needs in go.mod and go.sum.
package tools

import _ "github.com/coredns/coredns"
