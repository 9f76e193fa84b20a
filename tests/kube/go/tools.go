//go:build tools

// Package tools records the programs tests/kube/build.sh builds (the apiserver tier's kube-apiserver
// and etcd, and the node tier's kubelet, controller manager, scheduler, kube-proxy and kubectl), so
// `go mod tidy` keeps every module they need in go.mod and go.sum. The build tag keeps the package out of normal builds:
// main packages cannot be imported.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
