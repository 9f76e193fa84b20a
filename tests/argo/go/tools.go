//go:build tools

// Package tools pins the Argo Rollouts controller's main package so that `go mod tidy` keeps every
// module it needs. Nothing here is compiled into a binary of ours: build.sh runs
// `go build github.com/argoproj/argo-rollouts/cmd/rollouts-controller` in this module.
package tools

import _ "github.com/argoproj/argo-rollouts/cmd/rollouts-controller"
