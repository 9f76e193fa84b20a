#!/usr/bin/env bash
# Runs Spur's whole test suite: unit, property, end-to-end (real sockets, real clients) tests.
# Needs Go (>= 1.24) for the test tools built from Go modules (tests/go, tests/kube).
# Installs what the tests drive when it is missing: curl, h2load, iproute2, iptables. Needs root
# (or sudo) for that and for the network-namespace tests.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v h2load >/dev/null 2>&1 || need+=(nghttp2-client)
# Transparent-mode tests build network namespaces with iptables REDIRECT rules.
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
if [ ${#need[@]} -gt 0 ]; then
    echo "tests/run.sh: installing ${need[*]}" >&2
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
fi

# kube-apiserver and etcd for the real-apiserver tests (tests/kube-harness), built from Go modules:
# minutes on a fresh machine (tests/kube/README.md), reused from the cache afterwards. Built here,
# before cargo runs tests in parallel, so no test waits on (or races) the build.
SPUR_KUBE_BINDIR="$(tests/kube/build.sh | tail -n 1)"
export SPUR_KUBE_BINDIR

# Two test threads: the machine has two cores and several tests run their own load.
cargo test --workspace --locked -- --test-threads 2 "$@"
