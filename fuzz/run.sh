#!/usr/bin/env bash
# Builds every fuzz target and runs each one in turn, one process at a time (one core busy), for
# a bounded time. Prints per target the runs executed, the corpus size and any crash; exits
# non-zero if any target crashed (or failed to run).
#
#   fuzz/run.sh [SECONDS] [TARGET...]     # default: 600 s each, every target in Cargo.toml
#
# Environment:
#   CMIN=1        minimize each target's corpus (cargo fuzz cmin) after its run
#   FUZZ_ARGS     extra libFuzzer flags, e.g. FUZZ_ARGS="-max_len=20000"
#   LOG_DIR       where per-target logs go (default: fuzz/target/run-logs)
#   BUILD_ARGS    extra cargo-fuzz build flags, e.g. BUILD_ARGS=--no-default-features to leave
#                 out admission_review (and spur-operator, kube, k8s-openapi)
#
# Corpora are read from and grown in corpus/<target>/ (committed); crashes land in
# artifacts/<target>/ (not committed: keep a minimized reproducer in artifacts-found/<target>/).
set -euo pipefail

cd "$(dirname "$0")"

SECS=${1:-600}
shift || true
if [[ $# -gt 0 ]]; then
    TARGETS=("$@")
else
    mapfile -t TARGETS < <(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^spur-fuzz$')
fi
LOG_DIR=${LOG_DIR:-target/run-logs}
mkdir -p "$LOG_DIR"

# No sanitizer: the Spur crates forbid unsafe code, and without ASan each core runs about twice
# the executions. Debug assertions on: integer overflow is a panic, as in the tests.
BUILD_FLAGS=(--sanitizer none --debug-assertions)
# shellcheck disable=SC2206
BUILD_FLAGS+=(${BUILD_ARGS:-})

echo "building ${#TARGETS[@]} targets"
cargo +nightly fuzz build "${BUILD_FLAGS[@]}"

failed=0
summary=()
for t in "${TARGETS[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    log="$LOG_DIR/$t.log"
    marker="$LOG_DIR/$t.started"
    touch "$marker"
    echo "=== $t: ${SECS}s (log: $log)"
    status=0
    # shellcheck disable=SC2086
    cargo +nightly fuzz run "${BUILD_FLAGS[@]}" "$t" "corpus/$t" -- \
        -max_total_time="$SECS" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 \
        ${FUZZ_ARGS:-} >"$log" 2>&1 || status=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    if [[ -z "$runs" ]]; then
        runs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
    fi
    if [[ "${CMIN:-0}" == 1 && $status == 0 ]]; then
        cargo +nightly fuzz cmin "${BUILD_FLAGS[@]}" "$t" "corpus/$t" >>"$log" 2>&1 || true
    fi
    files=$(find "corpus/$t" -type f | wc -l)
    bytes=$(find "corpus/$t" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}')
    new=$(find "artifacts/$t" -type f -newer "$marker" | head -3 | tr '\n' ' ')
    crash="none"
    if [[ $status != 0 || -n "$new" ]]; then
        failed=1
        crash=$(grep -m1 -E "panicked at|ERROR: libFuzzer" "$log" || echo "exit status $status")
        crash="$crash; artifacts: ${new:-none}"
    fi
    line=$(printf '%-18s %6ss  runs %-12s corpus %5s files %9s bytes  crash: %s' \
        "$t" "$SECS" "${runs:-?}" "$files" "$bytes" "$crash")
    echo "$line"
    summary+=("$line")
done

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit $failed
