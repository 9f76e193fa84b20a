#!/usr/bin/env bash
# User-space instructions per HTTP/1.1 request in spur-sidecar, counted by callgrind: the
# sidecar (one worker thread, explicit mode) runs under valgrind in front of `spur demo app`,
# h2load sends N keep-alive requests on one connection, twice (1000 and 6000); instructions per
# request = (Ir(6000) - Ir(1000)) / 5000, so start-up and shutdown cancel out. Pass several
# sidecar binaries to compare builds in one run (e.g. before and after a change):
#
#   perf/callgrind.sh                               # target/release/spur-sidecar
#   perf/callgrind.sh /tmp/sidecar-old target/release/spur-sidecar
#
# Needs valgrind and h2load (nghttp2-client); builds the release binaries if none are given.
# Loopback only; every process it starts is stopped before it exits.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
for tool in valgrind h2load callgrind_annotate; do
    command -v "$tool" >/dev/null || { echo "perf/callgrind.sh: $tool is not installed (apt-get install valgrind nghttp2-client)" >&2; exit 1; }
done
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(target/release/spur-sidecar)
# Builds of two checkouts in one target dir can come out as one binary: Cargo hashes workspace
# members by their path inside the workspace, so the second checkout's older sources look built.
for ((i = 1; i < ${#bins[@]}; i++)); do
    if cmp -s "${bins[0]}" "${bins[$i]}"; then
        echo "perf/callgrind.sh: ${bins[0]} and ${bins[$i]} are the same binary (touch the second checkout's sources, or build it in its own target dir)" >&2
        exit 1
    fi
done
# shellcheck source=perf/lib.sh
source perf/lib.sh
echo "| binary | Ir at 1000 requests | Ir at 6000 | instructions per request |"
echo "|---|---|---|---|"
for bin in "${bins[@]}"; do
    read -r ir1000 ir6000 per <<<"$(instructions "$bin")"
    echo "| $bin | $ir1000 | $ir6000 | $per |"
done
