#!/usr/bin/env bash
# What one h2c or gRPC request costs in each proxy (issues 20 and 49): system calls per request
# (`strace -c -f` over 20 000 requests), CPU-µs per request at saturation (user + system ticks
# of the proxy from /proc over N requests, closed loop) and user-space instructions per request
# under callgrind (lib.sh's count_instructions: one connection of 16 streams, (Ir at 6000 − Ir at
# 1000) / 5000; INSTRUCTIONS=0 skips it). Every peer runs alone, pinned to core 1,
# in front of `spur-bench-upstream` (core 0). h2load runs on core 0 with one connection and 16
# streams for the syscall count, and 8 connections × 16 streams for the CPU figure. h2c is
# `GET /bytes/SIZE` (default 1024); gRPC is unary `spur.bench.v1.Bench/Echo` with a 1 KiB message.
# nginx and HAProxy use the configs in perf/configs/ (h2c → HTTP/1.1 upstream, gRPC → HTTP/2).
#
#   perf/per_request_h2.sh                         # spur, nginx, haproxy → a markdown table
#   perf/per_request_h2.sh BIN...                  # also these spur-sidecar builds (before/after);
#                                                  # BIN:hyper2 is BIN with its HTTP/2 relay off;
#                                                  # h2-bare is a bare relay on the h2 crate alone
#                                                  # (perf/src/bin/spur-h2-bare.rs): h2's own cost
#   N=100000 SIZE=1024 perf/per_request_h2.sh      # requests per CPU run, h2c body size
#   CG_STREAMS=1 perf/per_request_h2.sh            # callgrind with one stream at a time (default 16)
#
# The CPU figure is a saturation measurement on a 2-core machine, coarse (10 ms ticks) and noisy:
# alternate the binaries and repeat. The fixed-rate headline is `perf/run.sh`. Needs strace, h2load
# (nghttp2-client), valgrind, nginx and haproxy. Loopback only; every process it starts is stopped.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
for tool in strace h2load curl taskset valgrind; do
    command -v "$tool" >/dev/null || { echo "perf/per_request_h2.sh: $tool is not installed" >&2; exit 1; }
done
# shellcheck source=perf/lib.sh
source perf/lib.sh
cargo build --release --locked -p spur-perf --bin spur-bench-upstream --bin spur-h2-bare >&2

n="${N:-100000}"
size="${SIZE:-1024}"
up=127.0.0.1:19081
render_peer_configs "$up" 128
# One gRPC request body: the 5-byte frame header, then `bytes payload = 1` of 1 KiB.
{ printf '\x00\x00\x00\x04\x03\x0a\x80\x08'; head -c 1024 /dev/zero; } >"$work/grpc.bin"

taskset -c 0 target/release/spur-bench-upstream --listen "$up" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 50); do curl -s -o /dev/null "http://$up/bytes/0" && break; sleep 0.1; done

# load PROTO ADDR CONNS N [STREAMS]: h2load on core 0 (16 streams per connection unless said);
# fails unless every request succeeded.
load() {
    local args=(-c "$3" -m "${5:-16}")
    case "$1" in
        h2c) args+=("http://$2/bytes/$size") ;;
        grpc) args+=(-d "$work/grpc.bin" -H 'content-type: application/grpc' -H 'te: trailers'
            "http://$2/spur.bench.v1.Bench/Echo") ;;
    esac
    taskset -c 0 h2load -n "$4" "${args[@]}" >"$work/h2load.txt" 2>&1
    grep -q "$4 succeeded" "$work/h2load.txt" || {
        echo "perf/per_request_h2.sh: not every request succeeded:" >&2
        cat "$work/h2load.txt" >&2
        exit 1
    }
}

ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

# Callgrind's helpers (lib.sh's count_instructions): the peer in front of the bench upstream,
# one connection of 16 streams.
h2_cmd() {
    local app_saved=$app
    app=$up
    peer_cmd "$1"
    app=$app_saved
}
h2_ready() {
    for _ in $(seq 300); do
        curl -s -o /dev/null --http2-prior-knowledge "http://$addr/bytes/0" && return 0
        sleep 0.2
    done
    echo "perf/per_request_h2.sh: the peer did not start" >&2
    return 1
}
# With 16 streams in flight one read carries several requests, and h2's per-poll work is shared
# among them; at 1 (CG_STREAMS=1) each request pays it alone, as at a low rate.
h2_load() { load "$proto" "$addr" 1 "$1" "${CG_STREAMS:-16}"; }

echo "| peer | protocol | syscalls per request | by call | CPU-µs per request (saturation, $n requests) | instructions per request (callgrind) |"
echo "|---|---|---:|---|---:|---:|"
declare -A cpus=()
for peer in target/release/spur-sidecar nginx haproxy "$@"; do
    case "$peer" in
        nginx | haproxy) addr=$h2listen ;;
        *) addr=$listen ;;
    esac
    # lib.sh's command line, in front of the bench upstream instead of the demo app.
    app_saved=$app
    app=$up
    peer_cmd "$peer"
    app=$app_saved
    taskset -c 1 "${cmd[@]}" >/dev/null 2>&1 &
    pid=$!
    pids+=("$pid")
    for _ in $(seq 100); do curl -s -o /dev/null --http2-prior-knowledge "http://$addr/bytes/0" && break; sleep 0.1; done
    for proto in h2c grpc; do
        load "$proto" "$addr" 1 2000
        attach=()
        for t in /proc/"$pid"/task/*; do attach+=(-p "${t##*/}"); done
        strace -c -f -o "$work/strace.txt" "${attach[@]}" 2>/dev/null &
        st=$!
        sleep 1
        load "$proto" "$addr" 1 20000
        kill -INT "$st"
        wait "$st" || true
        total="$(awk '$NF == "total" { print $4 }' "$work/strace.txt")"
        calls="$(awk 'NR > 2 && $NF != "total" && $1 !~ /^-/ { printf "%s %.2f\n", $NF, $4 / 20000 }' "$work/strace.txt" |
            sort -k2 -nr | head -4 | awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $1, $2 }')"
        load "$proto" "$addr" 8 5000
        t0="$(ticks "$pid")"
        load "$proto" "$addr" 8 "$n"
        t1="$(ticks "$pid")"
        cpu="$(awk -v a="$t0" -v b="$t1" -v n="$n" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.1f", (b - a) * 1e6 / hz / n }')"
        cpus["$proto"]="| $(awk -v t="$total" 'BEGIN { printf "%.2f", t / 20000 }') | $calls | $cpu |"
    done
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
    for proto in h2c grpc; do
        if [ "${INSTRUCTIONS:-1}" = 1 ]; then
            read -r _ _ per <<<"$(count_instructions h2_cmd h2_load h2_ready "$peer")"
        else
            per="-"
        fi
        echo "| ${peer##*/} | $proto ${cpus[$proto]} $per |"
    done
done
