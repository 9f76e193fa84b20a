#!/usr/bin/env bash
# L4 side by side (issue #25): UDP datagrams per second and proxy CPU-µs per datagram through
# `spur gateway --config` (spur-l4), nginx's stream module and a direct path, in one run; TCP
# throughput and proxy CPU per GB through spur, nginx stream, HAProxy and socat, and direct.
# Writes perf/results/l4.md (SPUR_L4_OUT to write elsewhere).
#
#   perf/l4.sh                          # ~8 min after the builds
#   SPUR_L4_ROUNDS=1 perf/l4.sh         # one round instead of 3
#
# Knobs (environment): SPUR_L4_ROUNDS (3), SPUR_L4_DURATION_MS (5000, per run, after
# SPUR_L4_WARMUP_MS 1000), SPUR_L4_SIZES ("64 1200", UDP payload bytes), SPUR_L4_SESSIONS (64
# UDP sessions = source ports), SPUR_L4_WINDOW (1 datagram in flight per session),
# SPUR_L4_CONNS ("1 8", TCP connections), SPUR_L4_PEERS_UDP ("direct spur nginx"),
# SPUR_L4_PEERS_TCP ("direct spur nginx haproxy socat"), SPUR_L4_OUT, SPUR_L4_NO_BUILD (set: use
# the binaries in target/release as they are), SPUR_L4_SPUR (the spur binary to measure).
#
# One datagram in flight per session by default: 64 in flight at most fit every proxy's default
# UDP receive buffer (net.core.rmem_default, 208 KiB here) even at 1200 B. With 4 per session,
# 1200 B datagrams overflowed Spur's listener socket (UdpRcvbufErrors) whenever the proxy core
# was taken by something else, and each loss stalls its session for the 100 ms loss timeout, so
# the rates measured the drops.
#
# Setup: the proxy under test runs on core 1 (taskset), the load generator and the upstream
# (spur-l4-upstream: 3 UDP echo sockets, a TCP source) share core 0. A fresh proxy process per
# run; peers interleaved within each round, so a slow spell of the shared machine hits one run
# of each peer rather than every run of one. The headline is the proxy's CPU time (utime +
# stime from /proc/<pid>/stat, with its child processes: nginx's worker, socat's forks) per
# echoed datagram, not the rate: on 2 shared cores the rate mostly says how busy the client
# core was. Nothing asserts on timing. Loopback only; every process started here is stopped
# when the script exits (trap); every load run is bounded in count and time.
#
# Needs (Debian bookworm; installs nothing itself): apt-get update && apt-get install
# nginx-light libnginx-mod-stream socat haproxy (nginx-light has no stream module; Debian ships
# it as the dynamic module libnginx-mod-stream, loaded with load_module). HAProxy is optional:
# community HAProxy proxies no UDP (only HAProxy Enterprise has a UDP module), so it is a TCP
# peer only. Builds the release `spur` and the perf binaries.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

rounds="${SPUR_L4_ROUNDS:-3}"
duration_ms="${SPUR_L4_DURATION_MS:-5000}"
warmup_ms="${SPUR_L4_WARMUP_MS:-1000}"
sizes="${SPUR_L4_SIZES:-64 1200}"
sessions="${SPUR_L4_SESSIONS:-64}"
window="${SPUR_L4_WINDOW:-1}"
conns_list="${SPUR_L4_CONNS:-1 8}"
peers_udp="${SPUR_L4_PEERS_UDP:-direct spur nginx}"
peers_tcp="${SPUR_L4_PEERS_TCP:-direct spur nginx haproxy socat}"
out="${SPUR_L4_OUT:-perf/results/l4.md}"
command_line="perf/l4.sh"
for v in SPUR_L4_ROUNDS SPUR_L4_DURATION_MS SPUR_L4_WARMUP_MS SPUR_L4_SIZES SPUR_L4_SESSIONS \
    SPUR_L4_WINDOW SPUR_L4_CONNS SPUR_L4_PEERS_UDP SPUR_L4_PEERS_TCP SPUR_L4_NO_BUILD SPUR_L4_SPUR; do
    [ -n "${!v:-}" ] && command_line="$v='${!v}' $command_line"
done

nginx_bin="$(command -v nginx || echo /usr/sbin/nginx)"
haproxy_bin="$(command -v haproxy || echo /usr/sbin/haproxy)"
stream_module=/usr/lib/nginx/modules/ngx_stream_module.so
missing=()
[ -x "$nginx_bin" ] || missing+=(nginx-light)
[ -f "$stream_module" ] || missing+=(libnginx-mod-stream)
command -v socat >/dev/null || missing+=(socat)
command -v taskset >/dev/null || missing+=(util-linux)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "perf/l4.sh: missing: ${missing[*]} (apt-get update && apt-get install ${missing[*]})" >&2
    exit 1
fi
if [ ! -x "$haproxy_bin" ]; then
    echo "perf/l4.sh: haproxy is not installed: no HAProxy TCP rows" >&2
    peers_tcp="${peers_tcp//haproxy/}"
fi

if [ -z "${SPUR_L4_NO_BUILD:-}" ]; then
    cargo build --release --locked -p spur-cli --bin spur >&2
    cargo build --release --locked -p spur-perf --bin spur-l4-load --bin spur-l4-upstream >&2
fi
spur="${SPUR_L4_SPUR:-target/release/spur}"
load=target/release/spur-l4-load

work="$(mktemp -d)"
pids=()
stop_pid() {
    local p="$1"
    kill -TERM "$p" 2>/dev/null || return 0
    for _ in $(seq 50); do
        kill -0 "$p" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
}
cleanup() {
    for p in "${pids[@]}"; do stop_pid "$p"; done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$(nproc)" -ge 2 ]; then
    client_cpu=(taskset -c 0)
    proxy_cpu=(taskset -c 1)
    pinning="proxy on core 1; load generator and upstream on core 0 (taskset)"
else
    client_cpu=()
    proxy_cpu=()
    pinning="not pinned (fewer than 2 CPUs)"
fi

echo_addrs=(127.0.0.1:19301 127.0.0.1:19302 127.0.0.1:19303)
source_addr=127.0.0.1:19311
udp_listen=127.0.0.1:19320
tcp_listen=127.0.0.1:19321
admin=127.0.0.1:19322

# A process left over on one of these ports (another run) would answer for every peer.
ports_re=":(19301|19302|19303|19311|19320|19321|19322)\b"
if ss -Huantl 2>/dev/null | awk '{print $5}' | grep -Eq "$ports_re"; then
    echo "perf/l4.sh: ports 19301-19322 are in use (a run still going, or left over):" >&2
    ss -Huantlp 2>/dev/null | grep -E "$ports_re" >&2
    exit 1
fi

# The upstream, on the client core.
up_args=(--tcp-source "$source_addr")
for a in "${echo_addrs[@]}"; do up_args+=(--udp-echo "$a"); done
"${client_cpu[@]}" target/release/spur-l4-upstream "${up_args[@]}" >"$work/upstream.out" 2>&1 &
upstream_pid=$!
pids+=("$upstream_pid")
for _ in $(seq 100); do grep -q ready "$work/upstream.out" 2>/dev/null && break; sleep 0.1; done
grep -q ready "$work/upstream.out" || { echo "perf/l4.sh: the upstream did not start" >&2; exit 1; }

# Peer configurations.
mkdir -p "$work/nginx"
udp_servers=""
udp_endpoints=""
i=0
for a in "${echo_addrs[@]}"; do
    i=$((i + 1))
    udp_servers+="        server $a;\n"
    udp_endpoints+="    - {id: echo-$i, address: \"$a\"}\n"
done
sed -e "s|{{STREAM_MODULE}}|$stream_module|" -e "s|{{PREFIX}}|$work/nginx|g" \
    -e "s|{{UDP_SERVERS}}|${udp_servers%\\n}|" -e "s|{{UDP_LISTEN}}|$udp_listen|" \
    -e "s|{{TCP_LISTEN}}|$tcp_listen|" -e "s|{{TCP_UPSTREAM}}|$source_addr|" \
    perf/configs/nginx-l4.conf.tmpl >"$work/nginx/nginx.conf"
sed -e "s|{{TCP_LISTEN}}|$tcp_listen|" -e "s|{{TCP_UPSTREAM}}|$source_addr|" \
    perf/configs/haproxy-l4.cfg.tmpl >"$work/haproxy.cfg"
sed -e "s|{{UDP_ENDPOINTS}}|${udp_endpoints%\\n}|" -e "s|{{UDP_LISTEN}}|$udp_listen|" \
    -e "s|{{TCP_LISTEN}}|$tcp_listen|" -e "s|{{TCP_UPSTREAM}}|$source_addr|" \
    perf/configs/spur-l4.yaml.tmpl >"$work/spur.yaml"

# Starts peer $1 on the proxy core, into `peer_pid` (empty for direct). taskset execs the
# peer, so the pid is the peer's own (nginx's master, socat's listener).
start_peer() {
    peer_pid=""
    local cmd
    case "$1" in
        direct) return 0 ;;
        spur) cmd=("$spur" gateway --config "$work/spur.yaml" --admin-addr "$admin") ;;
        nginx) cmd=("$nginx_bin" -p "$work/nginx" -e "$work/nginx/error.log" -c "$work/nginx/nginx.conf") ;;
        haproxy) cmd=("$haproxy_bin" -db -f "$work/haproxy.cfg") ;;
        socat) cmd=(socat "TCP-LISTEN:${tcp_listen##*:},bind=${tcp_listen%:*},reuseaddr,fork,backlog=128" "TCP:$source_addr") ;;
        *) echo "perf/l4.sh: unknown peer $1" >&2; exit 1 ;;
    esac
    "${proxy_cpu[@]}" "${cmd[@]}" >>"$work/$1.log" 2>&1 &
    peer_pid=$!
    pids+=("$peer_pid")
}

stop_peer() {
    [ -n "$peer_pid" ] && stop_pid "$peer_pid"
    peer_pid=""
}

results="$work/results.jsonl"
: >"$results"
loadavg_before="$(cut -d' ' -f1-3 /proc/loadavg)"
echo "perf/l4.sh: $rounds round(s); UDP sizes $sizes through $peers_udp; TCP ${conns_list// /,} connection(s) through $peers_tcp" >&2

for round in $(seq 0 $((rounds - 1))); do
    for size in $sizes; do
        for peer in $peers_udp; do
            start_peer "$peer"
            targets=()
            if [ "$peer" = direct ]; then
                for a in "${echo_addrs[@]}"; do targets+=(--target "$a"); done
            else
                "$load" wait --udp "$udp_listen" --timeout-ms 10000 && kill -0 "$peer_pid" ||
                    { echo "perf/l4.sh: $peer did not answer on $udp_listen; see its log:" >&2; cat "$work/$peer.log" >&2; exit 1; }
                targets+=(--target "$udp_listen")
            fi
            cpu=()
            [ -n "$peer_pid" ] && cpu=(--cpu-pid "$peer_pid")
            echo "round $((round + 1))/$rounds: udp $size B via $peer" >&2
            "${client_cpu[@]}" "$load" udp "${targets[@]}" --sessions "$sessions" --window "$window" \
                --size "$size" --warmup-ms "$warmup_ms" --duration-ms "$duration_ms" \
                --peer "$peer" --round "$round" "${cpu[@]}" --upstream-pid "$upstream_pid" >>"$results"
            stop_peer
        done
    done
    for conns in $conns_list; do
        for peer in $peers_tcp; do
            start_peer "$peer"
            target="$tcp_listen"
            [ "$peer" = direct ] && target="$source_addr"
            "$load" wait --tcp "$target" --timeout-ms 10000 && { [ -z "$peer_pid" ] || kill -0 "$peer_pid"; } ||
                { echo "perf/l4.sh: $peer did not answer on $target; see its log:" >&2; cat "$work/$peer.log" >&2; exit 1; }
            cpu=()
            [ -n "$peer_pid" ] && cpu=(--cpu-pid "$peer_pid")
            echo "round $((round + 1))/$rounds: tcp $conns conn(s) via $peer" >&2
            "${client_cpu[@]}" "$load" tcp --target "$target" --conns "$conns" \
                --warmup-ms "$warmup_ms" --duration-ms "$duration_ms" \
                --peer "$peer" --round "$round" "${cpu[@]}" --upstream-pid "$upstream_pid" >>"$results"
            stop_peer
        done
    done
done
loadavg_after="$(cut -d' ' -f1-3 /proc/loadavg)"

nginx_version="$("$nginx_bin" -v 2>&1 | sed 's/^nginx version: //')"
haproxy_version="$({ "$haproxy_bin" -v 2>/dev/null || true; } | head -1 | awk '{print $3}')"
socat_version="$(socat -V 2>/dev/null | awk '/socat version/ {print $3; exit}')"
mkdir -p "$(dirname "$out")"
"$load" report "$results" --command "$command_line" \
    --note "Peers: spur \`spur gateway --config\` (release build, $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- dataplane controlplane || echo ' + local changes'); one tokio worker, as taskset leaves it one core), $nginx_version (stream module, 1 worker), HAProxy ${haproxy_version:-not installed} (TCP only, nbthread 1), socat ${socat_version:-?} (fork per connection); configurations: perf/configs/*-l4.*.tmpl." \
    --note "UDP: $sessions sessions (one socket each: distinct source ports) × $window datagrams in flight, to 3 echo sockets (spur: Maglev on sourceIpPort; nginx: \`hash \$remote_addr\$remote_port consistent\`; direct: session i to echo i mod 3). TCP: a source writing 64 KiB chunks, downloaded over 1 or 8 connections. Each run: $warmup_ms ms warm-up, then $duration_ms ms measured." \
    --note "Pinning: $pinning. Load average before / after: $loadavg_before / $loadavg_after (the machine is shared: read CPU per unit, not rates)." \
    >"$out"
cat "$out"
