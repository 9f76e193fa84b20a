#!/usr/bin/env bash
# Where each proxy's CPU per request goes at a fixed rate: user space against the kernel (issue 49,
# the limit goal 1 is measured against). Each peer runs alone, pinned to core 1, in front of
# `spur-bench-upstream` (core 0); `spur-load` (core 0) sends an open loop of RATE requests per
# second for 10 s; user and system time of the peer's process come from /proc/PID/stat before and
# after, and so do its voluntary context switches (how often it slept) from /proc/PID/status.
#
#   perf/cpu_split.sh                          # h1 (1 KiB), h2c (1 KiB), gRPC (1 KiB); every peer
#   PROTOS="h2 grpc" ROUNDS=2 perf/cpu_split.sh
#   PEERS="target/release/spur-sidecar nginx" RATE=5000 perf/cpu_split.sh
#
# The load is that of `perf/run.sh`: HTTP/1.1 on 64 kept-alive connections, h2c and gRPC on 8
# connections of 16 streams. The kernel counts CPU time in ticks (10 ms here), so at 5 000 rps for
# 10 s a figure is good to about ±2 µs; alternate the peers and repeat (ROUNDS) rather than trust
# one row. nginx and HAProxy use the configs in perf/configs/ (h2c → HTTP/1.1 upstream, gRPC →
# HTTP/2). Needs nginx and haproxy; builds the release binaries. Loopback only; every process it
# starts is stopped.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
command -v curl >/dev/null || { echo "perf/cpu_split.sh: curl is not installed" >&2; exit 1; }
# shellcheck source=perf/lib.sh
no_demo_app=1 source perf/lib.sh
cargo build --release --locked -p spur-perf --bin spur-bench-upstream --bin spur-load >&2

rate="${RATE:-5000}"
rounds="${ROUNDS:-1}"
secs=10
up=127.0.0.1:19081
render_peer_configs "$up" 128
taskset -c 0 target/release/spur-bench-upstream --listen "$up" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 50); do curl -s -o /dev/null "http://$up/bytes/0" && break; sleep 0.1; done
hz="$(getconf CLK_TCK)"

# user-ticks system-ticks voluntary-switches of PID
sample() {
    echo "$(awk '{ print $14, $15 }' "/proc/$1/stat") $(awk '/^voluntary_ctxt_switches/ { print $2 }' "/proc/$1/status")"
}

echo "| round | protocol | peer | user µs / request | system µs / request | total | voluntary context switches / request |"
echo "|---:|---|---|---:|---:|---:|---:|"
for round in $(seq "$rounds"); do
    for proto in ${PROTOS:-h1 h2 grpc}; do
        for peer in ${PEERS:-target/release/spur-sidecar nginx haproxy}; do
            case "$peer:$proto" in
                nginx:h1 | haproxy:h1 | *spur-sidecar*) addr=$listen ;;
                *) addr=$h2listen ;;
            esac
            upstream=$up peer_cmd "$peer"
            taskset -c 1 "${cmd[@]}" >/dev/null 2>&1 &
            pid=$!
            pids+=("$pid")
            for _ in $(seq 100); do curl -s -o /dev/null "http://$addr/bytes/0" && break; sleep 0.1; done
            case "$proto" in
                h1) args=(--url "http://$addr/bytes/1024" --proto h1 --connections 64) ;;
                h2) args=(--url "http://$addr/bytes/1024" --proto h2 --connections 8 --streams 16) ;;
                grpc) args=(--url "http://$addr/" --proto grpc --connections 8 --streams 16 --payload 1024) ;;
                *) echo "perf/cpu_split.sh: unknown protocol $proto (h1, h2, grpc)" >&2; exit 1 ;;
            esac
            # Warm-up: connections open, pools fill.
            taskset -c 0 target/release/spur-load "${args[@]}" --rate 1000 --duration 2s --warmup 0s >/dev/null
            read -r u0 s0 v0 <<<"$(sample "$pid")"
            taskset -c 0 target/release/spur-load "${args[@]}" --rate "$rate" --duration "${secs}s" --warmup 0s >"$work/load.txt"
            read -r u1 s1 v1 <<<"$(sample "$pid")"
            grep -q 'errors 0 ' "$work/load.txt" || {
                echo "perf/cpu_split.sh: $peer $proto: requests failed:" >&2
                cat "$work/load.txt" >&2
                exit 1
            }
            kill -TERM "$pid"
            wait "$pid" 2>/dev/null || true
            awk -v r="$round" -v p="$proto" -v n="${peer##*/}" -v u0="$u0" -v u1="$u1" -v s0="$s0" \
                -v s1="$s1" -v v0="$v0" -v v1="$v1" -v hz="$hz" -v req=$((rate * secs)) 'BEGIN {
                    u = (u1 - u0) * 1e6 / hz / req; s = (s1 - s0) * 1e6 / hz / req
                    printf "| %s | %s | %s | %.1f | %.1f | %.1f | %.2f |\n", r, p, n, u, s, u + s, (v1 - v0) / req
                }'
        done
    done
done
