//go:build tools

// Package tools records the program tests/kube/build.sh builds from this module (helm), so
// `go mod tidy` keeps every module it needs in go.mod and go.sum.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
