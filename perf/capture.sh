#!/usr/bin/env bash
# What traffic capture costs the sidecar per request (issue 27, docs/traffic.md), counted rather
# than timed: user-space instructions (callgrind, as perf/per_request.sh counts them) and CPU
# time from /proc, for one kept-alive HTTP/1.1 connection loaded by h2load, in these setups:
#
#   off            the sidecar without --traffic-server (capture compiled in, never asked)
#   armed          --traffic-server set and capturing key k1; the requests carry no key
#   keyed          requests with key k1, no capture (no rule for k1: the baseline answers)
#   keyed, hyper   the same with the HTTP/1.1 relay off: the path a captured request takes
#   keyed, captured  requests with key k1, captured (k1 is a virtual workload's key) and shipped
#                  to a real traffic store (spur-traffic-store serve, in memory)
#   BIN ...        any other spur-sidecar builds given as arguments (e.g. one built from the
#                  commit before capture existed), run like `off`
#
#   perf/capture.sh [BIN...]            → a markdown table on stdout
#
# Instructions: (Ir(6000) - Ir(1000)) / 5000 under valgrind, so start-up cancels out; the
# sidecar runs with --threads 1, so its shipper's work (encoding, gRPC pushes) is counted in the
# same process. CPU: user+system ticks of the sidecar process over 20 000 requests, ÷ requests.
# Needs valgrind and h2load (apt-get install valgrind nghttp2-client). Loopback only; every
# process it starts is stopped before it exits.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
for tool in h2load curl valgrind; do
    command -v "$tool" >/dev/null || { echo "perf/capture.sh: $tool is not installed" >&2; exit 1; }
done
# shellcheck source=perf/lib.sh
source perf/lib.sh
# lib.sh builds the proxies; the store is this script's own.
cargo build --release --locked --bin spur-traffic-store >&2

store=127.0.0.1:19790
printf 'perf-token\n' >"$work/token"
cat >"$work/store.yaml" <<'EOF'
maxBodyBytes: 16384
sandboxes:
  - {name: perf, routingKey: k1, workloads: [{kind: Deployment, namespace: t, name: base}]}
EOF
target/release/spur-traffic-store serve --insecure-plaintext --listen "$store" \
    --metrics-addr 127.0.0.1:19791 --settings "$work/store.yaml" --token-file "$work/token" \
    >"$work/store.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:19791/metrics && break; sleep 0.1; done
printf 'keys: [{routingKey: k1, sandbox: perf}]\n' >"$work/capture.yaml"

# Sets `cmd` for setup $1 and `header` for its requests.
setup() {
    local base=(--threads 1 --app-addr "$app" --inbound-addr "$listen" --admin-addr 127.0.0.1:19020
        --baseline-namespace t --baseline-name base)
    local capture=(--traffic-server "$store" --traffic-server-token-file "$work/token"
        --capture-settings "$work/capture.yaml")
    header=()
    case "$1" in
        off) cmd=(target/release/spur-sidecar "${base[@]}") ;;
        armed) cmd=(target/release/spur-sidecar "${base[@]}" "${capture[@]}") ;;
        keyed) cmd=(target/release/spur-sidecar "${base[@]}"); header=(-H 'baggage: sd-routing-key=k1') ;;
        keyed-hyper) cmd=(target/release/spur-sidecar "${base[@]}" --proxy-config "$work/no-relay.yaml")
            header=(-H 'baggage: sd-routing-key=k1') ;;
        keyed-captured) cmd=(target/release/spur-sidecar "${base[@]}" "${capture[@]}")
            header=(-H 'baggage: sd-routing-key=k1') ;;
        *) cmd=("$1" "${base[@]}") ;;
    esac
}

run_load() {
    h2load -n "$1" -c 1 --h1 "${header[@]}" "http://$listen/" >"$work/h2load.txt" 2>&1
    grep -q "$1 succeeded" "$work/h2load.txt" || {
        echo "$0: not every request succeeded:" >&2
        cat "$work/h2load.txt" >&2
        exit 1
    }
}

# Waits until the sidecar answers and, when it captures, has its settings (a first request
# would otherwise race the settings file's first read).
ready() {
    wait_ready
    sleep 1.5
}

per_request_ir() {
    settle=1 count_instructions setup run_load ready "$1" | awk '{ print $3 }'
}

per_request_cpu_us() {
    count_cpu_us setup run_load ready "$1"
}

stored() {
    curl -s http://127.0.0.1:19791/metrics | awk '$1 == "spur_traffic_exchanges_stored_total" { print $2 }'
}

echo "| setup | instructions per request | CPU µs per request |"
echo "|---|---:|---:|"
for s in off armed keyed keyed-hyper keyed-captured "$@"; do
    before="$(stored)"
    ir="$(per_request_ir "$s")"
    cpu="$(per_request_cpu_us "$s")"
    label="$s"
    if [ "$s" = keyed-captured ]; then
        label="$s (stored by the store: $(awk -v a="$before" -v b="$(stored)" 'BEGIN { print b - a }'))"
    fi
    echo "| $label | $ir | $cpu |"
done
