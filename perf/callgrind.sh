#!/usr/bin/env bash
# User-space instructions per HTTP/1.1 request in spur-sidecar, counted by callgrind: the
# sidecar (one worker thread, explicit mode) runs under valgrind in front of `spur demo app`,
# h2load sends N keep-alive requests on one connection, twice (1000 and 6000); instructions per
# request = (Ir(6000) - Ir(1000)) / 5000, so start-up and shutdown cancel out. Pass several
# sidecar binaries to compare builds in one run (e.g. before and after a change):
#
#   perf/callgrind.sh                               # target/release/spur-sidecar
#   perf/callgrind.sh /tmp/sidecar-old target/release/spur-sidecar
#
# Needs valgrind and h2load (nghttp2-client); builds the release binaries if none are given.
# Loopback only; every process it starts is stopped before it exits.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
for tool in valgrind h2load callgrind_annotate; do
    command -v "$tool" >/dev/null || { echo "perf/callgrind.sh: $tool is not installed (apt-get install valgrind nghttp2-client)" >&2; exit 1; }
done
cargo build --release --locked --bin spur --bin spur-sidecar >&2
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(target/release/spur-sidecar)
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
target/release/spur demo app --name base --listen 127.0.0.1:19080 >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 50); do curl -s -o /dev/null http://127.0.0.1:19080/healthz && break; sleep 0.1; done
echo "| binary | Ir at 1000 requests | Ir at 6000 | instructions per request |"
echo "|---|---|---|---|"
for bin in "${bins[@]}"; do
    declare -A ir=()
    for n in 1000 6000; do
        out="$work/cg.$n"
        valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" --threads 1 \
            --app-addr 127.0.0.1:19080 --inbound-addr 127.0.0.1:19006 --admin-addr 127.0.0.1:19020 \
            --baseline-namespace t --baseline-name base >/dev/null 2>"$work/vg.log" &
        vg=$!
        pids+=("$vg")
        for _ in $(seq 150); do curl -s -o /dev/null http://127.0.0.1:19020/live && break; sleep 0.2; done
        h2load -n "$n" -c 1 --h1 http://127.0.0.1:19006/ >"$work/h2load.txt" 2>&1
        grep -q "$n succeeded" "$work/h2load.txt" || { echo "perf/callgrind.sh: not every request succeeded:" >&2; cat "$work/h2load.txt" >&2; exit 1; }
        kill -TERM "$vg"
        wait "$vg" || true
        ir[$n]="$(grep -E '^(summary|totals):' "$out" | head -1 | awk '{print $2}')"
    done
    echo "| $bin | ${ir[1000]} | ${ir[6000]} | $(( (ir[6000] - ir[1000]) / 5000 )) |"
done
