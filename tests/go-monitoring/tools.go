//go:build tools

// promtool is built from this module's pinned Prometheus (tests/go/build.sh).
package main

import _ "github.com/prometheus/prometheus/cmd/promtool"
