#!/usr/bin/env bash
# What a routing key costs the sidecar per request (issue 49): user-space instructions under
# callgrind (lib.sh's count_instructions: (Ir at 6000 − Ir at 1000) / 5000) of a request without a
# key, which stays on the application, and of one with `baggage: sd-routing-key=k1`, which the
# rules of `perf/run.sh` (perf/configs/spur-rules.yaml.tmpl) send to a second listener of the same
# `spur-bench-upstream`. HTTP/1.1 is `GET /bytes/1024` on one kept-alive connection (the relay);
# h2c the same on one connection with one stream at a time (the HTTP/2 relay).
#
#   perf/keyed_cost.sh                         # target/release/spur-sidecar
#   perf/keyed_cost.sh OLD_BIN NEW_BIN         # these builds, one after the other (before/after)
#   PROTOS=h1 perf/keyed_cost.sh
#
# Needs valgrind and h2load (nghttp2-client). Loopback only; every process it starts is stopped.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
for tool in valgrind h2load curl; do
    command -v "$tool" >/dev/null || { echo "perf/keyed_cost.sh: $tool is not installed" >&2; exit 1; }
done
# shellcheck source=perf/lib.sh
no_demo_app=1 source perf/lib.sh
cargo build --release --locked -p spur-perf --bin spur-bench-upstream >&2

app_port=19081
sandbox_port=19082
up=127.0.0.1:$app_port
taskset -c 0 target/release/spur-bench-upstream --listen "$up" --listen "127.0.0.1:$sandbox_port" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 50); do curl -s -o /dev/null "http://$up/bytes/0" && break; sleep 0.1; done
sed -e "s/{{UPSTREAM_PORT}}/$app_port/" -e "s/{{SANDBOX_PORT}}/$sandbox_port/" \
    perf/configs/spur-rules.yaml.tmpl >"$work/rules.yaml"

admin=127.0.0.1:19020
keyed_cmd() {
    cmd=("$1" --threads 1 --app-addr "$up" --inbound-addr "$listen" --admin-addr "$admin"
        --baseline-namespace bench --baseline-name app --rules "$work/rules.yaml")
}
# Ready once the rules are loaded and the listener answers.
keyed_ready() {
    for _ in $(seq 300); do
        curl -sf -o /dev/null "http://$admin/ready" && curl -s -o /dev/null "http://$listen/bytes/0" && return 0
        sleep 0.2
    done
    echo "perf/keyed_cost.sh: the sidecar did not start" >&2
    return 1
}
keyed_load() {
    local args=(-n "$1" -c 1)
    [ -z "$key" ] || args+=(-H "baggage: sd-routing-key=$key")
    case "$proto" in
        h1) args+=(--h1) ;;
        h2c) args+=(-m 1) ;;
    esac
    h2load "${args[@]}" "http://$listen/bytes/1024" >"$work/h2load.txt" 2>&1
    grep -q "$1 succeeded" "$work/h2load.txt" || {
        echo "perf/keyed_cost.sh: not every request succeeded:" >&2
        cat "$work/h2load.txt" >&2
        exit 1
    }
}

echo "| sidecar | protocol | instructions per request, no key | with key k1 | difference |"
echo "|---|---|---:|---:|---:|"
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(target/release/spur-sidecar)
for bin in "${bins[@]}"; do
    for proto in ${PROTOS:-h1 h2c}; do
        declare -A per=()
        for key in "" k1; do
            read -r _ _ n <<<"$(count_instructions keyed_cmd keyed_load keyed_ready "$bin")"
            per["${key:-none}"]=$n
        done
        echo "| $bin | $proto | ${per[none]} | ${per[k1]} | $((per[k1] - per[none])) |"
    done
done
