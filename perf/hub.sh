#!/usr/bin/env bash
# Hub + agent: latency a preview request adds, one large download, preview requests per hub CPU
# second (perf/benches/hub_preview.rs; writes perf/results/hub_preview.md). Builds the release
# `spur` and `spur-bench-upstream` and kube-apiserver/etcd (cached; needs Go). About 2 minutes
# after the builds.
#
#   perf/hub.sh
#   SPUR_BENCH_RATE=1000 perf/hub.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
SPUR_KUBE_BINDIR="$(tests/kube/build.sh | tail -n 1)"
export SPUR_KUBE_BINDIR
cargo build --release --locked -p spur-hub-bin -p spur-agent-bin -p spur-perf --bin spur-bench-upstream
cargo bench --locked -p spur-perf --bench hub_preview -- --bench
