#!/usr/bin/env bash
# Pod start-up with and without sidecar injection, and the sidecar's memory, on a real one-node
# cluster (see perf/README.md, "Pod start-up on a node"). Needs root and what tests/run.sh installs
# for the node tier (containerd, runc, CNI plugins, mmdebstrap, buildah, jq, openssl).
# Builds the release binaries and the release image (into target/release/node-images, not
# target/node-images where tests/run.sh keeps its debug images), starts a node of its own (taken
# down on exit; other nodes, e.g. a concurrent test run's, are left alone), runs the benchmark,
# which writes perf/results/node.md. About 10 minutes after the builds.
#
#   perf/node.sh
#   SPUR_BENCH_PODS=20 SPUR_BENCH_MEM_PODS=3 perf/node.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [ "$(id -u)" != 0 ]; then
    echo "perf/node.sh: the node needs root (network namespace, containerd, kubelet); run it as root" >&2
    exit 1
fi

SPUR_KUBE_BINDIR="$(tests/kube/build.sh | tail -n 1)"
export SPUR_KUBE_BINDIR

cargo build --release --locked --bin spur --bin spur-sidecar --bin spur-init >&2
# The image also holds the static helpers that run inside pods of any image.
host_target="$(rustc -vV | sed -n 's/^host: //p')"
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked --target "$host_target" \
    --bin spur-job-executor --bin spur-io >&2
target_dir="$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
bindir="${target_dir:-$root/target}/release"
export SPUR_IMAGE_BINDIR="$bindir"
export SPUR_EXECUTOR_BIN="${target_dir:-$root/target}/$host_target/release/spur-job-executor"
export SPUR_IO_BIN="${target_dir:-$root/target}/$host_target/release/spur-io"

# One line per image: <name> <archive> compressed=<MB> uncompressed=<size>.
image_out="$(tests/node/image.sh "$bindir" "$bindir/node-images")"
echo "$image_out" >&2
export SPUR_BENCH_IMAGES="$image_out"
mapfile -t images < <(awk '$2 ~ /\.tar$/ { print $2 }' <<<"$image_out")

# Build the bench before the node is up, so the node does not idle through a compile.
cargo bench --locked -p spur-perf --bench pod_startup --no-run >&2

node_env=
trap '[ -z "$node_env" ] || tests/node/node.sh down "$(dirname "$node_env")"' EXIT
trap 'exit 130' INT TERM
node_env="$(SPUR_NODE_OWNER=$$ tests/node/node.sh up "${images[@]}" | tail -n 1)"
export SPUR_NODE_ENV="$node_env"

cargo bench --locked -p spur-perf --bench pod_startup
