#!/usr/bin/env bash
# Sandbox resources on a real one-node cluster: create → fork Ready for a Sandbox with one
# PostgreSQL database resource, and its deletion (see perf/README.md, "Sandbox resources on a
# node"). Needs root and what tests/run.sh installs for the node tier. Builds the release
# binaries (spur-job-executor and spur-io statically) and the release images (into
# target/release/node-images), starts a node of its own (taken down on exit), runs the
# benchmark, which writes perf/results/resources.md.
#
#   perf/resources.sh
#   SPUR_BENCH_RUNS=20 perf/resources.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [ "$(id -u)" != 0 ]; then
    echo "perf/resources.sh: the node needs root (network namespace, containerd, kubelet); run it as root" >&2
    exit 1
fi

SPUR_KUBE_BINDIR="$(tests/kube/build.sh | tail -n 1)"
export SPUR_KUBE_BINDIR

cargo build --release --locked --bin spur --bin spur-sidecar --bin spur-init >&2
host_target="$(rustc -vV | sed -n 's/^host: //p')"
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked --target "$host_target" \
    --bin spur-job-executor --bin spur-io >&2
target_dir="$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
target_dir="${target_dir:-$root/target}"
bindir="$target_dir/release"
export SPUR_IMAGE_BINDIR="$bindir"
export SPUR_EXECUTOR_BIN="$target_dir/$host_target/release/spur-job-executor"
export SPUR_IO_BIN="$target_dir/$host_target/release/spur-io"

image_out="$(tests/node/image.sh "$bindir" "$bindir/node-images")"
echo "$image_out" >&2
mapfile -t images < <(awk '$2 ~ /\.tar$/ { print $2 }' <<<"$image_out")

# Build the bench before the node is up, so the node does not idle through a compile.
cargo bench --locked -p spur-perf --bench resources --no-run >&2

node_env=
trap '[ -z "$node_env" ] || tests/node/node.sh down "$(dirname "$node_env")"' EXIT
trap 'exit 130' INT TERM
node_env="$(SPUR_NODE_OWNER=$$ tests/node/node.sh up "${images[@]}" | tail -n 1)"
export SPUR_NODE_ENV="$node_env"

cargo bench --locked -p spur-perf --bench resources
