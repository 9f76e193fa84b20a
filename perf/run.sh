#!/usr/bin/env bash
# Side-by-side benchmark: spur-sidecar vs nginx vs haproxy vs direct (see perf/README.md,
# "Side-by-side"). Builds the release binaries, installs missing peers/tools (Debian/Ubuntu,
# apt-get), then runs target/release/spur-bench with all arguments passed through.
#
#   perf/run.sh            # default run, ~20 min → perf/results/<date>.md + latest.md + plots
#   perf/run.sh --quick    # smoke run, ~3 min   → perf/results/<date>-quick.md
#   perf/run.sh --help     # all options
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# --- peers and tools -------------------------------------------------------------------------
missing=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
have nginx || missing+=(nginx-light)
have haproxy || missing+=(haproxy)
have taskset || missing+=(util-linux)
have wrk || have h2load || missing+=(wrk)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)

if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "run.sh: missing ${missing[*]} and no apt-get; install them and re-run" >&2
        exit 1
    fi
    sudo=""
    if [ "$(id -u)" != 0 ]; then
        sudo="sudo"
    fi
    echo "run.sh: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    # nginx-light does not exist on every release; fall back to nginx, and wrk to h2load.
    if ! timeout 600 $sudo apt-get install -y --no-install-recommends "${missing[@]}" >&2; then
        timeout 300 $sudo apt-get update >&2
        if ! timeout 600 $sudo apt-get install -y --no-install-recommends "${missing[@]}" >&2; then
            alt=()
            for p in "${missing[@]}"; do
                case "$p" in
                    nginx-light) alt+=(nginx) ;;
                    wrk) alt+=(nghttp2-client) ;;
                    *) alt+=("$p") ;;
                esac
            done
            timeout 600 $sudo apt-get install -y --no-install-recommends "${alt[@]}" >&2
        fi
    fi
    # Debian starts packaged daemons on install where it can; the benchmark runs its own.
    for svc in nginx haproxy; do
        if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$svc" 2>/dev/null; then
            $sudo systemctl stop "$svc" || true
        fi
    done
fi

# --- binaries ---------------------------------------------------------------------------------
# Apart, as the Containerfile builds the sidecar: spur-perf's kube dependency would unify
# kube-client's `tracing/log` into it.
cargo build --release -p spur-sidecar --bins >&2
cargo build --release -p spur-perf --bins >&2

target_dir="$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
target_dir="${target_dir:-$root/target}"

export SPUR_BENCH_COMMAND="perf/run.sh${*:+ $*}"
exec "$target_dir/release/spur-bench" --bin-dir "$target_dir/release" "$@"
