#!/usr/bin/env bash
# What a smart-test run costs (issue 48, docs/smart-tests.md), counted rather than timed: the
# CPU time of the runner (`spur test run`, what a run's pod spends besides its start), of the
# baseline's sidecar and of the apps, and the bytes a run leaves: its JSON report and, with
# capture on at the baseline's sidecar for the run's key, what the traffic store keeps.
#
# The setup is the node acceptance's shop on loopback (perf/lib.sh's conventions): `spur demo
# app` as the catalog's baseline and as an unchanged fork of it (each answer carries a fresh
# request id and time, which the run learns as noise), a spur-sidecar in front of the baseline
# routing key k1 to the fork and capturing k1 into `spur-traffic-store serve` (in memory). The
# test has STEPS steps (GET /catalog); each is sent three times (sandbox, baseline, baseline), so
# 34 steps are about 100 requests. It runs RUNS times; the figures are per run and per request.
#
#   perf/smarttest.sh [STEPS [RUNS [calls]]]   → a markdown table on stdout (defaults 34 and 40;
# CPU is counted in 10 ms ticks, so fewer runs are coarse)
#
# With `calls`, each run is `spur test run --calls` (docs/smart-tests.md, "Downstream calls"):
# the sidecar takes its capture settings from the store instead of a file, each run asks the
# store for a run capture (the sandbox's key and a reference key at every sidecar of namespace
# t), the baseline's requests carry the reference key, and the run reads its captured calls
# back; every request of the run is then captured, not only the sandbox's. Its wall time
# includes the runner's fixed waits (a second for the settings to reach the sidecars, a second
# of quiet before reading the calls back).
#
# CPU: user+system ticks from /proc (10 ms each) of each long-lived process over all runs, and
# the runner's own from its rusage (GNU time). Loopback only; every process it starts is stopped
# before it exits. Needs curl and GNU time (apt-get install time).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
steps="${1:-34}"
runs="${2:-40}"
mode="${3:-}"
for tool in curl /usr/bin/time; do
    command -v "$tool" >/dev/null || { echo "perf/smarttest.sh: $tool is not installed" >&2; exit 1; }
done
cargo build --release --locked --bin spur --bin spur-sidecar --bin spur-traffic-store >&2

work="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

base=127.0.0.1:19180
fork=127.0.0.1:19181
listen=127.0.0.1:19106
admin=127.0.0.1:19120
store=127.0.0.1:19190
store_metrics=127.0.0.1:19191

wait_http() {
    for _ in $(seq 100); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done
    echo "perf/smarttest.sh: $1 did not answer" >&2
    exit 1
}

target/release/spur demo app --name catalog --listen "$base" >"$work/base.log" 2>&1 &
base_pid=$!
pids+=("$base_pid")
target/release/spur demo app --name catalog --marker fork --listen "$fork" >"$work/fork.log" 2>&1 &
fork_pid=$!
pids+=("$fork_pid")
wait_http "http://$base/healthz"
wait_http "http://$fork/healthz"

printf 'perf-token\n' >"$work/token"
cat >"$work/store.yaml" <<'EOF'
maxBodyBytes: 16384
sandboxes:
  - {name: perf, routingKey: k1, workloads: [{kind: Deployment, namespace: t, name: base}]}
EOF
target/release/spur-traffic-store serve --insecure-plaintext --listen "$store" \
    --metrics-addr "$store_metrics" --settings "$work/store.yaml" --token-file "$work/token" \
    >"$work/store.log" 2>&1 &
store_pid=$!
pids+=("$store_pid")
wait_http "http://$store_metrics/metrics"
printf 'keys: [{routingKey: k1, sandbox: perf}]\n' >"$work/capture.yaml"
cat >"$work/rules.yaml" <<EOF
- routingKey: k1
  baseline: {kind: Deployment, namespace: t, name: base}
  destinationSandbox: {name: perf}
  mappings:
    - workloadPort: ${base##*:}
      destinations: [{host: ${fork%:*}, port: ${fork##*:}}]
EOF
settings=(--capture-settings "$work/capture.yaml")
run_args=(--key k1)
if [ "$mode" = calls ]; then
    # Settings from the store, where run captures are.
    settings=()
    run_args=(--sandbox perf --key k1 --calls --server "http://$store" --token-file "$work/token")
fi
target/release/spur-sidecar --threads 1 --app-addr "$base" --inbound-addr "$listen" \
    --admin-addr "$admin" --baseline-namespace t --baseline-name base --rules "$work/rules.yaml" \
    --traffic-server "$store" --traffic-server-token-file "$work/token" \
    "${settings[@]}" >"$work/sidecar.log" 2>&1 &
sidecar_pid=$!
pids+=("$sidecar_pid")
for _ in $(seq 100); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$admin/ready")" = 200 ] && break
    sleep 0.1
done
# The key reaches the fork before anything is measured (and the capture settings are read).
for _ in $(seq 100); do
    curl -s -H 'baggage: sd-routing-key=k1' "http://$listen/" | grep -q '"marker":"fork"' && break
    sleep 0.1
done
sleep 1.5

{
    echo "steps:"
    for i in $(seq "$steps"); do
        printf -- '- name: catalog-%d\n  http: {url: "http://%s/catalog?page=%d"}\n  checks: [{status: 200}]\n' "$i" "$listen" "$i"
    done
} >"$work/test.yaml"

ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
metric() {
    curl -s "http://$store_metrics/metrics" | awk -v m="$1" '$1 == m { print $2 }'
}
declare -A before=()
for p in "$sidecar_pid" "$base_pid" "$fork_pid" "$store_pid"; do before[$p]="$(ticks "$p")"; done
stored_before="$(metric spur_traffic_exchanges_stored_total)"
runner_cpu=0
report_bytes=0
wall_ms=0
for r in $(seq "$runs"); do
    start=$(date +%s%N)
    status=0
    /usr/bin/time -f '%U %S %M' -o "$work/time.$r" target/release/spur test run -f "$work/test.yaml" \
        "${run_args[@]}" -o json --summary-file "$work/summary.$r.json" >"$work/report.$r.json" \
        2>"$work/stderr.$r" || status=$?
    end=$(date +%s%N)
    if [ "$status" -ne 0 ]; then
        echo "perf/smarttest.sh: run $r exited $status (an unchanged fork should pass):" >&2
        head -c 4000 "$work/report.$r.json" "$work/stderr.$r" >&2
        exit 1
    fi
    wall_ms=$((wall_ms + (end - start) / 1000000))
    runner_cpu=$(awk -v a="$runner_cpu" -v u="$(cut -d' ' -f1 "$work/time.$r")" \
        -v s="$(cut -d' ' -f2 "$work/time.$r")" 'BEGIN { print a + u + s }')
    report_bytes=$((report_bytes + $(stat -c %s "$work/report.$r.json")))
done
sleep 1.5
declare -A spent=()
for p in "$sidecar_pid" "$base_pid" "$fork_pid" "$store_pid"; do
    spent[$p]=$(( $(ticks "$p") - before[$p] ))
done
stored=$(awk -v a="$stored_before" -v b="$(metric spur_traffic_exchanges_stored_total)" 'BEGIN { print b - a }')
store_bytes="$(metric spur_traffic_store_bytes)"
requests=$((steps * 3))
rss_kb="$(cut -d' ' -f3 "$work/time.$runs")"

per_run() { awk -v v="$1" -v n="$runs" 'BEGIN { printf "%.1f", v / n }'; }
per_100() { awk -v v="$1" -v n="$runs" -v q="$requests" 'BEGIN { printf "%.2f", v / n / q * 100 }'; }
ms_of_ticks() { awk -v t="$1" 'BEGIN { print t * 10 }'; }
runner_ms=$(awk -v c="$runner_cpu" 'BEGIN { print c * 1000 }')

captured_what="the sandbox's requests"
calls_seen=""
if [ "$mode" = calls ]; then
    captured_what="every request of the run, --calls"
    calls_seen="$(grep -o '"captured": *[0-9]*' "$work/report.$runs.json" | grep -o '[0-9]*$' || true)"
fi
echo "A run of $steps steps ($requests requests: each step to the sandbox and twice to the baseline), $runs runs${mode:+ ($mode)}; per run and per 100 requests."
echo
echo "| | per run | per 100 requests |"
echo "|---|---:|---:|"
echo "| wall time (ms) | $(per_run "$wall_ms") | $(per_100 "$wall_ms") |"
echo "| runner CPU (ms, \`spur test run\`) | $(per_run "$runner_ms") | $(per_100 "$runner_ms") |"
echo "| baseline's sidecar CPU (ms) | $(per_run "$(ms_of_ticks "${spent[$sidecar_pid]}")") | $(per_100 "$(ms_of_ticks "${spent[$sidecar_pid]}")") |"
echo "| the apps' CPU (ms, baseline + fork) | $(per_run "$(ms_of_ticks $((spent[$base_pid] + spent[$fork_pid])))") | $(per_100 "$(ms_of_ticks $((spent[$base_pid] + spent[$fork_pid])))") |"
echo "| traffic store CPU (ms) | $(per_run "$(ms_of_ticks "${spent[$store_pid]}")") | $(per_100 "$(ms_of_ticks "${spent[$store_pid]}")") |"
echo "| JSON report (bytes) | $(per_run "$report_bytes") | $(per_100 "$report_bytes") |"
echo "| exchanges captured at the sidecar ($captured_what) | $(per_run "$stored") | $(per_100 "$stored") |"
echo "| bytes the traffic store keeps of them | $(per_run "$store_bytes") | $(per_100 "$store_bytes") |"
echo
echo "The runner's peak RSS: $rss_kb KiB. The traffic store holds $store_bytes bytes after all runs ($stored exchanges).${calls_seen:+ The last run read $calls_seen captured exchanges back.}"
