#!/usr/bin/env bash
# What the sidecar's record of sampled traces costs per request (issue 46, `spur doctor
# propagation`, docs/cli.md), counted rather than timed: user-space instructions (callgrind, as
# perf/capture.sh counts them) and CPU time from /proc, one kept-alive connection loaded by
# h2load, in these setups:
#
#   h1 plain       HTTP/1.1 (the relay), no trace header
#   h1 traced      HTTP/1.1 with a `traceparent` whose trace is not recorded: the production case
#   h1 recorded    HTTP/1.1 with a recorded trace (id ending in 5b0d): handed to the hyper path
#                  and written to the ring
#   h2c traced     h2c (the hyper path, where every request is looked at) with a traceparent
#                  that is not recorded
#   h2c recorded   h2c with a recorded trace
#
#   perf/trace.sh [BEFORE_BIN]   → a markdown table on stdout; with BEFORE_BIN (a spur-sidecar
#                                  built from a commit before the record existed) its rows for
#                                  the setups it can run (all but the recorded ones, which it
#                                  runs as plain traced requests)
#
# Instructions: (Ir(6000) - Ir(1000)) / 5000 under valgrind, so start-up cancels out, with
# --threads 1. CPU: user+system ticks of the sidecar over 20 000 requests, ÷ requests.
# Needs valgrind and h2load (apt-get install valgrind nghttp2-client). Loopback only; every
# process it starts is stopped before it exits.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
for tool in h2load curl valgrind; do
    command -v "$tool" >/dev/null || { echo "perf/trace.sh: $tool is not installed" >&2; exit 1; }
done
# shellcheck source=perf/lib.sh
source perf/lib.sh

unrecorded="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
recorded="00-4bf92f3577b34da6a3ce929d0e0e5b0d-00f067aa0ba902b7-01"

# Sets `cmd` (binary $1), `proto` and `header` for setup $2.
setup() {
    cmd=("$1" --threads 1 --app-addr "$app" --inbound-addr "$listen" --admin-addr 127.0.0.1:19020
        --baseline-namespace t --baseline-name base)
    case "$2" in
        h1-plain) proto=(--h1); header=() ;;
        h1-traced) proto=(--h1); header=(-H "traceparent: $unrecorded") ;;
        h1-recorded) proto=(--h1); header=(-H "traceparent: $recorded") ;;
        h2c-traced) proto=(); header=(-H "traceparent: $unrecorded") ;;
        h2c-recorded) proto=(); header=(-H "traceparent: $recorded") ;;
    esac
}

run_load() {
    h2load -n "$1" -c 1 "${proto[@]}" "${header[@]}" "http://$listen/" >"$work/h2load.txt" 2>&1
    grep -q "$1 succeeded" "$work/h2load.txt" || {
        echo "$0: not every request succeeded:" >&2
        cat "$work/h2load.txt" >&2
        exit 1
    }
}

per_request_ir() {
    count_instructions setup run_load wait_ready "$1" "$2" | awk '{ print $3 }'
}

# What the sidecar kept: its counter of recorded requests, when it has one.
read_recorded() {
    curl -s http://127.0.0.1:19020/metrics |
        awk '$1 == "spur_traces_recorded_total" { print $2 }' >"$work/recorded"
}

per_request_cpu_us() {
    after_load=read_recorded count_cpu_us setup run_load wait_ready "$1" "$2"
}

echo "| sidecar | setup | instructions per request | CPU µs per request | recorded |"
echo "|---|---|---:|---:|---:|"
for bin in target/release/spur-sidecar "$@"; do
    label=after
    [ "$bin" = target/release/spur-sidecar ] || label="before ($bin)"
    for s in h1-plain h1-traced h1-recorded h2c-traced h2c-recorded; do
        ir="$(per_request_ir "$bin" "$s")"
        : >"$work/recorded"
        cpu="$(per_request_cpu_us "$bin" "$s")"
        recorded_total="$(cat "$work/recorded")"
        echo "| $label | $s | $ir | $cpu | ${recorded_total:--} |"
    done
done
