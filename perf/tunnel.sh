#!/usr/bin/env bash
# Workstation tunnel vs OpenSSH `ssh -L` (see perf/README.md, "Tunnel vs ssh -L"). Needs root.
# Installs what is missing (OpenSSH client and server, iproute2, nftables, ethtool; Debian/Ubuntu,
# apt-get), builds kube-apiserver/etcd (cached) and the release `spur`, then runs the benchmark,
# which writes perf/results/tunnel_vs_ssh.md. About 20 minutes after the builds (3 rounds; `SPUR_BENCH_ROUNDS=1` takes a third).
#
#   perf/tunnel.sh
#   SPUR_BENCH_PATHS="spur quic,ssh -L" perf/tunnel.sh   # a subset; writes no report
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [ "$(id -u)" != 0 ]; then
    echo "tunnel.sh: the benchmark builds network namespaces and nftables rules; run it as root" >&2
    exit 1
fi

missing=()
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v ethtool >/dev/null 2>&1 || missing+=(ethtool)
if [ ${#missing[@]} -gt 0 ]; then
    echo "tunnel.sh: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! timeout 600 apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; then
        timeout 300 apt-get update -qq >&2
        timeout 600 apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    fi
    # Debian starts sshd on install where it can; the benchmark runs its own on another port.
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet ssh 2>/dev/null; then
        systemctl stop ssh || true
    fi
fi

SPUR_KUBE_BINDIR="$(tests/kube/build.sh | tail -n 1)"
export SPUR_KUBE_BINDIR

cargo build --release --locked -p spur-cli -p spur-tunnel-proxy-bin >&2
target_dir="$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
export SPUR_BIN="${target_dir:-$root/target}/release/spur"

exec cargo bench --locked -p spur-perf --bench tunnel_vs_ssh
