#!/usr/bin/env bash
# What one kept-alive HTTP/1.1 request costs in each proxy, counted rather than timed (issues 20
# and 49): user-space instructions (callgrind) and syscalls (strace -c), for spur-sidecar with
# its HTTP/1.1 relay, spur-sidecar with the relay off (every request through hyper), nginx and
# HAProxy, in one run, each in front of the same `spur-bench-upstream`, loaded by h2load on one
# connection (no routing key), for responses of 0 B, 1 KiB and 64 KiB (`GET /bytes/SIZE`).
#
#   perf/per_request.sh                       # all four peers → a markdown table on stdout
#   perf/per_request.sh BIN...                # also these spur-sidecar builds (before/after)
#   SIZES="0 1024" perf/per_request.sh        # response body sizes (default 0 1024 65536)
#   PEERS=target/release/spur-sidecar perf/per_request.sh   # these peers instead of the four
#   SPUR_PER_REQUEST=callgrind perf/per_request.sh   # instructions only (or =strace)
#
# Instructions: the peer runs under valgrind twice, for 1 000 and 6 000 requests; per request =
# (Ir(6000) - Ir(1000)) / 5000, so start-up and shutdown cancel out (nginx runs with
# `master_process off`, HAProxy with `nbthread 1`, spur with `--threads 1`). Syscalls: strace
# attaches to every thread of the running peer, h2load sends 20 000 requests, calls ÷ requests.
# A kept-alive HTTP/1.1 hop needs at least 4 (read the request, write it upstream, read the
# response, write it back); the table gives each peer's ratio to that. A 64 KiB body takes more
# than one read: how many depends on the socket buffers and on when each peer reads, so above 4
# the count says how a peer sizes its reads and writes, not only its overhead.
#
# Needs valgrind, strace, h2load (nghttp2-client), nginx and haproxy (apt-get install valgrind
# strace nghttp2-client nginx-light haproxy); builds the release binaries. Loopback only; every
# process it starts is stopped before it exits.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mode="${SPUR_PER_REQUEST:-all}"
need=(h2load curl)
[ "$mode" = strace ] || need+=(valgrind)
[ "$mode" = callgrind ] || need+=(strace)
for tool in "${need[@]}"; do
    command -v "$tool" >/dev/null || { echo "perf/per_request.sh: $tool is not installed" >&2; exit 1; }
done
# shellcheck source=perf/lib.sh
no_demo_app=1 source perf/lib.sh
cargo build --release --locked -p spur-perf --bin spur-bench-upstream >&2
upstream=127.0.0.1:19081
render_peer_configs "$upstream" 16
target/release/spur-bench-upstream --listen "$upstream" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 50); do curl -s -o /dev/null "http://$upstream/bytes/0" && break; sleep 0.1; done

syscalls() {
    local peer="$1" pid st n=20000
    peer_cmd "$peer"
    "${cmd[@]}" >/dev/null 2>&1 &
    pid=$!
    pids+=("$pid")
    wait_ready
    load 200
    local attach=()
    for t in /proc/"$pid"/task/*; do attach+=(-p "${t##*/}"); done
    strace -c -f -o "$work/strace.txt" "${attach[@]}" 2>/dev/null &
    st=$!
    sleep 1
    load "$n"
    kill -INT "$st"
    wait "$st" || true
    kill -TERM "$pid"
    wait "$pid" || true
    # strace -c columns: % time, seconds, usecs/call, calls, [errors], syscall.
    local total top
    total="$(awk '$NF == "total" { print $4 }' "$work/strace.txt")"
    top="$(awk -v n="$n" 'NR > 2 && $NF != "total" && $1 !~ /^-/ { printf "%s %.2f\n", $NF, $4 / n }' "$work/strace.txt" |
        sort -k2 -nr | head -5 | awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $1, $2 }')"
    printf '%s|%s' "$(awk -v t="$total" -v n="$n" 'BEGIN { printf "%.2f", t / n }')" "$top"
}

# PEERS replaces the default list (e.g. PEERS=target/release/spur-sidecar for one binary alone).
read -r -a peers <<<"${PEERS:-target/release/spur-sidecar target/release/spur-sidecar:hyper nginx haproxy}"
peers+=("$@")
echo "| response body | peer | instructions per request | syscalls per request | ÷ 4 (the least a kept-alive hop needs) | syscalls per request, by call |"
echo "|---|---|---:|---:|---:|---|"
for size in ${SIZES:-0 1024 65536}; do
    path="/bytes/$size"
    body="$size B"
    [ "$size" -ge 1024 ] && [ $(( size % 1024 )) -eq 0 ] && body="$(( size / 1024 )) KiB"
    for peer in "${peers[@]}"; do
        case "$peer" in
            nginx) [ -x "$nginx_bin" ] || { echo "| $body | nginx | not installed | | | |"; continue; } ;;
            haproxy) [ -x "$haproxy_bin" ] || { echo "| $body | haproxy | not installed | | | |"; continue; } ;;
        esac
        ins="–"
        sys="–"
        ratio="–"
        calls=""
        [ "$mode" = strace ] || ins="$(instructions "$peer" | awk '{ print $3 }')"
        if [ "$mode" != callgrind ]; then
            s="$(syscalls "$peer")"
            sys="${s%%|*}"
            calls="${s#*|}"
            ratio="$(awk -v s="$sys" 'BEGIN { printf "%.2f×", s / 4 }')"
        fi
        label="$peer"
        case "$peer" in
            *:hyper) label="${peer%:hyper} (http1Relay: false)" ;;
        esac
        echo "| $body | $label | $ins | $sys | $ratio | $calls |"
    done
done
