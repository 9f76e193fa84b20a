# Shared by perf/per_request.sh and perf/flamegraph.sh (sourced, from the repository root):
# builds the release binaries, makes a work directory and a cleanup trap that stops every pid in
# `pids`, and starts `spur demo app` on $app. Proxies under test listen on $listen;
# $work/no-relay.yaml turns the sidecar's HTTP/1.1 relay off.
cargo build --release --locked --bin spur --bin spur-sidecar >&2

work="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

app=127.0.0.1:19080
listen=127.0.0.1:19006
target/release/spur demo app --name base --listen "$app" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 50); do curl -s -o /dev/null "http://$app/healthz" && break; sleep 0.1; done
printf 'http1Relay: false\n' >"$work/no-relay.yaml"
