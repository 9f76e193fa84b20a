#!/usr/bin/env bash
# Flame graphs of spur-sidecar serving kept-alive HTTP/1.1 requests (issue 20, goal 1): the
# HTTP/1.1 relay (default) and, for comparison, the same binary with `http1Relay: false` (every
# request through hyper). The sidecar (one worker thread) runs in front of `spur demo app`;
# h2load sends 60 000 requests on one connection (0-byte bodies, no routing key) while
# `perf record -e cpu-clock --call-graph dwarf` samples the sidecar only; inferno draws the graph.
#
#   perf/flamegraph.sh [OUT_DIR]     # → OUT_DIR/flamegraph-h1-relay.svg, flamegraph-h1-hyper.svg
#                                    #   (default perf/results)
#
# Needs perf (linux-perf), h2load (nghttp2-client) and inferno (`cargo install inferno`). The
# cpu-clock software event works in VMs without a PMU; unwinding uses the binary's .eh_frame, so
# the release build needs no extra debug info. Loopback only; everything it starts is stopped.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-perf/results}"
for tool in perf h2load curl inferno-collapse-perf inferno-flamegraph; do
    command -v "$tool" >/dev/null || { echo "perf/flamegraph.sh: $tool is not installed" >&2; exit 1; }
done
# shellcheck source=perf/lib.sh
source perf/lib.sh

for variant in relay hyper; do
    extra=()
    [ "$variant" = hyper ] && extra=(--proxy-config "$work/no-relay.yaml")
    target/release/spur-sidecar --threads 1 --app-addr "$app" --inbound-addr "$listen" \
        --admin-addr 127.0.0.1:19020 --baseline-namespace t --baseline-name base "${extra[@]}" \
        >/dev/null 2>&1 &
    sidecar=$!
    pids+=("$sidecar")
    for _ in $(seq 100); do curl -s -o /dev/null "http://$listen/healthz" && break; sleep 0.1; done
    h2load -n 2000 -c 1 --h1 "http://$listen/" >/dev/null 2>&1
    perf record -q -e cpu-clock -F 4999 --call-graph dwarf,16384 -p "$sidecar" -o "$work/perf.data" \
        >/dev/null 2>&1 &
    rec=$!
    sleep 1
    h2load -n 60000 -c 1 --h1 "http://$listen/" >"$work/h2load.txt" 2>&1
    grep -q "60000 succeeded" "$work/h2load.txt" || { echo "perf/flamegraph.sh: requests failed" >&2; cat "$work/h2load.txt" >&2; exit 1; }
    kill -INT "$rec"
    wait "$rec" || true
    kill -TERM "$sidecar"
    wait "$sidecar" || true
    perf script -i "$work/perf.data" 2>/dev/null | inferno-collapse-perf >"$work/folded.txt"
    inferno-flamegraph --title "spur-sidecar, HTTP/1.1 keep-alive, $variant path (cpu-clock samples)" \
        --width 1600 <"$work/folded.txt" >"$out/flamegraph-h1-$variant.svg"
    echo "$out/flamegraph-h1-$variant.svg: $(awk '{ n += $NF } END { printf "%.2f", n / 1e9 }' "$work/folded.txt") s of CPU sampled" >&2
done
