//go:build tools

// Package tools records the two programs tests/kube/build.sh builds, so `go mod tidy` keeps every
// module they need in go.mod and go.sum. The build tag keeps the package out of normal builds:
// main packages cannot be imported.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)
