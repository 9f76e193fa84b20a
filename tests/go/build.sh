#!/usr/bin/env bash
# Builds the real public Routes API Go clients used by tests/tests/routesapi_go.rs:
#   sdroutes         github.com/signadot/routesapi/go-routesapi/cmd/sdroutes (their CLI, unchanged)
#   routesapi-watch  our harness (tests/go/main.go) importing their watched/workload packages
#   h2spec           github.com/summerwind/h2spec/cmd/h2spec from tests/go-h2spec (its own module),
#                    the HTTP/2 conformance suite tests/tests/h2spec.rs runs against the sidecar
#   xds-client       our harness tests/go-xds/main.go (its own module): a proxyless gRPC client on
#                    grpc-go's real, unchanged xDS client, run against Spur's xDS (ADS) server
#   kafka-client     our harness tests/go-kafka/main.go (its own module): franz-go, unchanged, as
#                    a Kafka producer and group consumer for tests/tests/kafka_records.rs
#   promtool         github.com/prometheus/prometheus/cmd/promtool from tests/go-monitoring (its
#                    own module), unchanged: checks and unit-tests Spur's alerts
#   monitoring-check our harness tests/go-monitoring/main.go: Spur's Grafana dashboards against
#                    the Grafana Foundation SDK's dashboard model and Prometheus' PromQL parser
#                    (tests/tests/monitoring.rs)
# into $OUT (default: target/go-bin, relative to the repository root). Go is a test-harness tool
# only. tests/run.sh runs it before the tests and exports SPUR_GO_BINDIR (the last stdout line);
# a test run without it builds here itself. Re-running is cheap: go's build cache makes an up-to-date build a no-op.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-target/go-bin}"
case "$out" in /*) ;; *) out="$root/$out" ;; esac

if ! command -v go >/dev/null 2>&1; then
    echo "tests/go/build.sh: 'go' is not installed (needed >= 1.26 (grpc-go v1.85 in tests/go-xds needs it) to build the Go test clients; see https://go.dev/doc/install)" >&2
    exit 127
fi

# -mod=readonly: build exactly the committed go.sum, never rewrite it.
export GOFLAGS=-mod=readonly GOTOOLCHAIN=local
mkdir -p "$out"
cd "$root/tests/go"
# Static: both also run in the node's test-client image (tests/node/image.sh).
CGO_ENABLED=0 go build -o "$out/sdroutes" github.com/signadot/routesapi/go-routesapi/cmd/sdroutes
CGO_ENABLED=0 go build -o "$out/routesapi-watch" .
cd "$root/tests/go-h2spec"
go build -o "$out/h2spec" github.com/summerwind/h2spec/cmd/h2spec
cd "$root/tests/go-xds"
# Static (no cgo): the node test copies it into a pod of a Debian image.
CGO_ENABLED=0 go build -o "$out/xds-client" .
cd "$root/tests/go-kafka"
go build -o "$out/kafka-client" .
cd "$root/tests/go-monitoring"
go build -o "$out/promtool" github.com/prometheus/prometheus/cmd/promtool
go build -o "$out/monitoring-check" .
echo "$out"
