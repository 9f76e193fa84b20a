#!/usr/bin/env bash
# Flame graphs of spur-sidecar (issue 20, goal 1). The sidecar runs with one worker thread, and
# `perf record -e cpu-clock --call-graph dwarf` samples only the sidecar while h2load loads it.
# inferno draws the graphs. Protocols:
#   h1    kept-alive HTTP/1.1 through the relay (default) and, for comparison, through hyper
#         (`http1Relay: false`). In front of `spur demo app`: 60 000 requests on one
#         connection, 0-byte bodies, no routing key.
#   h2c   h2c prior knowledge, `GET /bytes/1024`, one connection with 16 streams in flight.
#         The sidecar forwards over HTTP/2 to `spur-bench-upstream`.
#   grpc  gRPC unary `spur.bench.v1.Bench/Echo` with a 1 KiB message, one connection with 16
#         streams in flight, to `spur-bench-upstream`.
#   h2c-hyper, grpc-hyper
#         the same through hyper's HTTP/2 path (`http2Relay: false`) instead of the relay.
#
#   perf/flamegraph.sh [OUT_DIR] [PROTOCOL...]   # → OUT_DIR/flamegraph-h1-relay.svg,
#       flamegraph-h1-hyper.svg, flamegraph-h2c.svg, flamegraph-grpc.svg (default: perf/results, h1)
#
# Needs perf (linux-perf), h2load (nghttp2-client) and inferno (`cargo install inferno`). The
# cpu-clock software event works in VMs without a PMU; unwinding uses the binary's .eh_frame, so
# the release build needs no extra debug info. Loopback only; everything it starts is stopped.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
for tool in perf h2load curl inferno-collapse-perf inferno-flamegraph; do
    command -v "$tool" >/dev/null || { echo "perf/flamegraph.sh: $tool is not installed" >&2; exit 1; }
done
# shellcheck source=perf/lib.sh
source perf/lib.sh

out="${1:-perf/results}"
shift || true
protocols=("$@")
[ ${#protocols[@]} -gt 0 ] || protocols=(h1)
upstream=127.0.0.1:19081
if printf '%s\n' "${protocols[@]}" | grep -qv '^h1$'; then
    cargo build --release --locked -p spur-perf --bin spur-bench-upstream >&2
    target/release/spur-bench-upstream --listen "$upstream" >/dev/null 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do curl -s -o /dev/null "http://$upstream/bytes/0" && break; sleep 0.1; done
    # One gRPC request body: the 5-byte frame header, then `bytes payload = 1` of 1 KiB.
    { printf '\x00\x00\x00\x04\x03\x0a\x80\x08'; head -c 1024 /dev/zero; } >"$work/grpc.bin"
fi

# profile NAME TITLE APP SIDECAR_ARGS... -- H2LOAD_ARGS...: one graph, OUT/flamegraph-NAME.svg.
profile() {
    local name="$1" title="$2" to="$3" sidecar_args=() load_args=()
    shift 3
    while [ $# -gt 0 ] && [ "$1" != -- ]; do sidecar_args+=("$1"); shift; done
    shift
    load_args=("$@")
    target/release/spur-sidecar --threads 1 --app-addr "$to" --inbound-addr "$listen" \
        --admin-addr 127.0.0.1:19020 --baseline-namespace t --baseline-name base "${sidecar_args[@]}" \
        >/dev/null 2>&1 &
    local sidecar=$!
    pids+=("$sidecar")
    for _ in $(seq 100); do curl -s -o /dev/null "http://$listen/healthz" && break; sleep 0.1; done
    h2load -n 2000 "${load_args[@]}" >/dev/null 2>&1
    perf record -q -e cpu-clock -F 4999 --call-graph dwarf,16384 -p "$sidecar" -o "$work/perf.data" \
        >/dev/null 2>&1 &
    local rec=$!
    sleep 1
    h2load -n 60000 "${load_args[@]}" >"$work/h2load.txt" 2>&1
    grep -q "60000 succeeded" "$work/h2load.txt" || { echo "perf/flamegraph.sh: requests failed" >&2; cat "$work/h2load.txt" >&2; exit 1; }
    kill -INT "$rec"
    wait "$rec" || true
    kill -TERM "$sidecar"
    wait "$sidecar" || true
    perf script -i "$work/perf.data" 2>/dev/null | inferno-collapse-perf >"$work/folded.txt"
    cp "$work/folded.txt" "$work/folded-$name.txt"
    inferno-flamegraph --title "spur-sidecar, $title (cpu-clock samples)" \
        --width 1600 <"$work/folded.txt" >"$out/flamegraph-$name.svg"
    echo "$out/flamegraph-$name.svg: $(awk '{ n += $NF } END { printf "%.2f", n / 1e9 }' "$work/folded.txt") s of CPU sampled" >&2
    if [ -n "${SPUR_FLAMEGRAPH_FOLDED:-}" ]; then cp "$work/folded.txt" "$SPUR_FLAMEGRAPH_FOLDED/$name.folded"; fi
}

for protocol in "${protocols[@]}"; do
    case "$protocol" in
        h1)
            profile h1-relay "HTTP/1.1 keep-alive, relay path" "$app" -- -c 1 --h1 "http://$listen/"
            profile h1-hyper "HTTP/1.1 keep-alive, hyper path" "$app" --proxy-config "$work/no-relay.yaml" \
                -- -c 1 --h1 "http://$listen/"
            ;;
        h2c)
            profile h2c "h2c 1 KiB responses, 16 streams" "$upstream" -- -c 1 -m 16 "http://$listen/bytes/1024"
            ;;
        h2c-hyper)
            profile h2c-hyper "h2c 1 KiB responses, 16 streams, hyper path" "$upstream" \
                --proxy-config "$work/no-h2relay.yaml" -- -c 1 -m 16 "http://$listen/bytes/1024"
            ;;
        grpc)
            profile grpc "gRPC unary 1 KiB, 16 streams" "$upstream" -- -c 1 -m 16 -d "$work/grpc.bin" \
                -H 'content-type: application/grpc' -H 'te: trailers' "http://$listen/spur.bench.v1.Bench/Echo"
            ;;
        grpc-hyper)
            profile grpc-hyper "gRPC unary 1 KiB, 16 streams, hyper path" "$upstream" \
                --proxy-config "$work/no-h2relay.yaml" -- -c 1 -m 16 -d "$work/grpc.bin" \
                -H 'content-type: application/grpc' -H 'te: trailers' "http://$listen/spur.bench.v1.Bench/Echo"
            ;;
        *) echo "perf/flamegraph.sh: unknown protocol $protocol (h1, h2c, h2c-hyper, grpc, grpc-hyper)" >&2; exit 2 ;;
    esac
done
