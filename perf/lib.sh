# Shared by perf/per_request.sh, perf/callgrind.sh and perf/flamegraph.sh (sourced, from the
# repository root): builds the release binaries, makes a work directory and a cleanup trap that
# stops every pid in `pids`, and starts `spur demo app` on $app. Proxies under test listen on
# $listen; $work/no-relay.yaml turns the sidecar's HTTP/1.1 relay off (peer `BIN:hyper`), and
# $work/no-h2relay.yaml its HTTP/2 relay (peer `BIN:hyper2`). Then the helpers to start
# a peer, wait for it, load it with h2load and count its instructions under callgrind.
# The sidecar on its own, as the Containerfile builds it (with `spur`, Cargo would unify in
# kube-client's `tracing/log`, which costs the sidecar's HTTP/2 path).
# A script that sets no_demo_app=1 before sourcing this file has its own upstream: neither `spur`
# is built nor the demo app started.
cargo build --release --locked --bin spur-sidecar >&2
[ -n "${no_demo_app:-}" ] || cargo build --release --locked --bin spur >&2

work="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

app=127.0.0.1:19080
listen=127.0.0.1:19006
if [ -z "${no_demo_app:-}" ]; then
    target/release/spur demo app --name base --listen "$app" >/dev/null 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do curl -s -o /dev/null "http://$app/healthz" && break; sleep 0.1; done
fi
printf 'http1Relay: false\n' >"$work/no-relay.yaml"
printf 'http2Relay: false\n' >"$work/no-h2relay.yaml"
nginx_bin="$(command -v nginx || echo /usr/sbin/nginx)"
haproxy_bin="$(command -v haproxy || echo /usr/sbin/haproxy)"

# Renders the nginx and HAProxy configs into $work for upstream $1, with an idle upstream pool
# of $2 connections, the HTTP/1.1 listener on $listen and the h2c listener on $h2listen.
h2listen=127.0.0.1:19007
render_peer_configs() {
    mkdir -p "$work/nginx/logs"
    sed -e "s|{{PREFIX}}|$work/nginx|g" -e "s|{{UPSTREAM}}|$1|g" -e "s|{{KEEPALIVE}}|$2|g" \
        -e "s|{{LISTEN_H1}}|$listen|g" -e "s|{{H2_LISTEN_DIRECTIVES}}|listen $h2listen http2;|g" \
        -e "s|{{MAX_CONCURRENCY}}|$2|g" perf/configs/nginx.conf.tmpl >"$work/nginx/nginx.conf"
    sed -e "s|{{UPSTREAM}}|$1|g" -e "s|{{LISTEN_H1}}|$listen|g" -e "s|{{LISTEN_H2}}|$h2listen|g" \
        perf/configs/haproxy.cfg.tmpl >"$work/haproxy.cfg"
}

# The command line of a peer, into `cmd`; a spur-sidecar binary path names a spur peer. Its
# upstream is $upstream when set (nginx's and HAProxy's come from render_peer_configs), else $app.
peer_cmd() {
    local spur=(--threads 1 --app-addr "${upstream:-$app}" --inbound-addr "$listen" --admin-addr 127.0.0.1:19020
        --baseline-namespace t --baseline-name base)
    case "$1" in
        nginx) cmd=("$nginx_bin" -p "$work/nginx" -c "$work/nginx/nginx.conf" -g "daemon off; master_process off;") ;;
        haproxy) cmd=("$haproxy_bin" -db -f "$work/haproxy.cfg") ;;
        *:hyper) cmd=("${1%:hyper}" "${spur[@]}" --proxy-config "$work/no-relay.yaml") ;;
        *:hyper2) cmd=("${1%:hyper2}" "${spur[@]}" --proxy-config "$work/no-h2relay.yaml") ;;
        # A bare HTTP/2-to-HTTP/2 relay on the h2 crate alone (perf/src/bin/spur-h2-bare.rs).
        h2-bare) cmd=(target/release/spur-h2-bare --listen "$listen" --upstream "${upstream:-$app}") ;;
        *) cmd=("$1" "${spur[@]}") ;;
    esac
}

# Waits until the peer answers a proxied request.
wait_ready() {
    for _ in $(seq 300); do
        curl -s -o /dev/null "http://$listen/healthz" && return 0
        sleep 0.2
    done
    echo "$0: the peer did not start" >&2
    return 1
}

# N kept-alive HTTP/1.1 requests on one connection, for $path (default /).
load() {
    h2load -n "$1" -c 1 --h1 "http://$listen${path:-/}" >"$work/h2load.txt" 2>&1
    grep -q "$1 succeeded" "$work/h2load.txt" || {
        echo "$0: not every request succeeded:" >&2
        cat "$work/h2load.txt" >&2
        exit 1
    }
}

# User-space instructions under callgrind of the command `SETUP ARGS...` puts in `cmd`, loaded
# with `LOAD N` once `READY` returns: "Ir(1000) Ir(6000) per-request", where per request =
# (Ir(6000) - Ir(1000)) / 5000, so start-up and shutdown cancel out. $settle (default 0) seconds
# pass between the load and the stop, for work the load left behind (a capture's shipper).
# Work a process does per second rather than per request (timers, a settings file polled) would
# count too, in proportion to how much longer the 6000 requests took under valgrind, which
# depends on the machine's load: the 6000 run goes first, and the 1000 run idles after its load
# until it has lasted as long, so that work cancels out as start-up does.
count_instructions() {
    local setup_fn="$1" load_fn="$2" ready_fn="$3" n out vg t0 took long=0
    shift 3
    declare -A ir=()
    for n in 6000 1000; do
        out="$work/cg.$n"
        "$setup_fn" "$@"
        valgrind --tool=callgrind --callgrind-out-file="$out" "${cmd[@]}" >/dev/null 2>"$work/vg.log" &
        vg=$!
        pids+=("$vg")
        "$ready_fn"
        t0="$(date +%s%N)"
        "$load_fn" "$n"
        took=$(( $(date +%s%N) - t0 ))
        if [ "$n" = 6000 ]; then
            long="$took"
        elif [ "$long" -gt "$took" ]; then
            sleep "$(awk -v ns=$(( long - took )) 'BEGIN { printf "%.3f", ns / 1e9 }')"
        fi
        sleep "${settle:-0}"
        kill -TERM "$vg"
        wait "$vg" || true
        ir[$n]="$(grep -E '^(summary|totals):' "$out" | head -1 | awk '{print $2}')"
    done
    echo "${ir[1000]} ${ir[6000]} $(( (ir[6000] - ir[1000]) / 5000 ))"
}

# CPU µs per request (user + system ticks of the process over 20 000 requests) of the command
# `SETUP ARGS...` puts in `cmd`, loaded with `LOAD N` once `READY` returns (and 500 requests of
# warm-up). $after_load, when set, is run while the process still serves.
count_cpu_us() {
    local setup_fn="$1" load_fn="$2" ready_fn="$3" n=20000 pid hz t0 t1
    shift 3
    hz="$(getconf CLK_TCK)"
    "$setup_fn" "$@"
    "${cmd[@]}" >/dev/null 2>&1 &
    pid=$!
    pids+=("$pid")
    "$ready_fn"
    "$load_fn" 500
    t0="$(awk '{ print $14 + $15 }' "/proc/$pid/stat")"
    "$load_fn" "$n"
    sleep 0.5
    t1="$(awk '{ print $14 + $15 }' "/proc/$pid/stat")"
    if [ -n "${after_load:-}" ]; then "$after_load"; fi
    kill -TERM "$pid"
    wait "$pid" || true
    awk -v a="$t0" -v b="$t1" -v hz="$hz" -v n="$n" 'BEGIN { printf "%.1f", (b - a) / hz * 1e6 / n }'
}

# User-space instructions of a peer under callgrind (count_instructions).
instructions() {
    count_instructions peer_cmd load wait_ready "$1"
}
