#!/usr/bin/env bash
# Runs Spur's whole test suite: unit, property, end-to-end (real sockets, real clients) tests.
# Needs Go (>= 1.24) for the test tools built from Go modules (tests/go, tests/kube).
# Installs what the tests drive when it is missing: curl, h2load, iproute2, iptables (with
# iptables-legacy), nftables, setpriv. Needs root (or sudo) for that and for the network-namespace
# tests.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v h2load >/dev/null 2>&1 || need+=(nghttp2-client)
# Transparent-mode and interception tests build network namespaces with iptables REDIRECT rules;
# spur-init's tests program them with iptables-legacy and with nft, and run the sidecar and an
# unprivileged spur-init under other uids with setpriv.
command -v ip >/dev/null 2>&1 || need+=(iproute2)
{ command -v iptables && command -v iptables-legacy; } >/dev/null 2>&1 || need+=(iptables)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v setpriv >/dev/null 2>&1 || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
    echo "tests/run.sh: installing ${need[*]}" >&2
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
fi

# A clean build of the suite takes 3 to 5 GB under target/ (the more with incremental builds); say
# so up front rather than fail half-way through a link with "No space left on device".
target_parent="${CARGO_TARGET_DIR:-target}"
[ -d "$target_parent" ] || target_parent=.
free_kb="$(df -Pk "$target_parent" | awk 'NR == 2 { print $4 }')"
if [ -n "$free_kb" ] && [ "$free_kb" -lt $((4 * 1024 * 1024)) ]; then
    echo "tests/run.sh: warning: only $((free_kb / 1024)) MiB free for $target_parent;" \
        "a clean build of the test suite needs 3 to 5 GB" >&2
fi

# kube-apiserver and etcd for the real-apiserver tests (tests/kube-harness), built from Go modules:
# minutes on a fresh machine (tests/kube/README.md), reused from the cache afterwards. Built here,
# before cargo runs tests in parallel, so no test waits on (or races) the build.
SPUR_KUBE_BINDIR="$(tests/kube/build.sh | tail -n 1)"
export SPUR_KUBE_BINDIR

# Two test threads: the machine has two cores and several tests run their own load.
cargo test --workspace --locked -- --test-threads 2 "$@"
