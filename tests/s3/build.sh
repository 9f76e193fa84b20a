#!/usr/bin/env bash
# Builds SeaweedFS' server, `weed` (Go module github.com/seaweedfs/seaweedfs, Apache-2.0; the
# version pinned in go/go.mod), a real S3-compatible server that tests/tests/s3_store.rs runs the
# jobs store's S3 backend against: OUT/weed, with OUT/weed.stamp naming what it was built from.
#
# `go install .../weed@version` is refused ("The go.mod file for the module providing named
# packages contains one or more replace directives"), so go/ is a wrapper module that requires
# seaweedfs and carries its replace directive copied verbatim; its go.sum is committed and the
# build runs with -mod=readonly. Cold, the build is the largest of the Go test tools (about 700
# CPU seconds and 2 GB of modules): tests/run.sh starts it first, in the background.
#
# Usage: build.sh OUT_DIR
# Idempotent: when OUT has a binary stamped with the current go.mod and go.sum, it exits at once
# without calling Go. The last stdout line is the binary's path (everything else goes to stderr).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: $0 OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

stamp="$(cat "$here/go/go.mod" "$here/go/go.sum" | sha256sum | cut -d' ' -f1)"
current() {
    [ -x "$out/weed" ] && [ -f "$out/weed.stamp" ] && [ "$(cat "$out/weed.stamp")" = "$stamp" ]
}
if current; then
    echo "$out/weed"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "tests/s3/build.sh: 'go' is not installed (needed >= the go line of $here/go/go.mod)" >&2
    exit 127
fi
# GOTOOLCHAIN=local: never fetch a toolchain; -mod=readonly: build exactly the committed go.sum.
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0

if command -v flock >/dev/null 2>&1; then
    exec 9>"$out/.weed-build.lock"
    flock 9
    # Another run may have built it while this one waited.
    if current; then
        echo "$out/weed"
        exit 0
    fi
fi

tmp=""
trap 'rm -rf "$tmp"' EXIT
tmp="$(mktemp -d "$out/.weed-build.XXXXXX")"
# The Go build cache of this build, deleted with it: the binaries are cached by version, so the
# several GB of compiled packages would only be used again for another version, and on CI's
# fresh machine they took disk the node tier needed.
export GOCACHE="$tmp/go-build"
cd "$here/go"
start=$SECONDS
echo "tests/s3/build.sh: building weed with $(go version | cut -d' ' -f3) (cold: several minutes)" >&2
go build -trimpath -ldflags "-s -w" -o "$tmp/weed" github.com/seaweedfs/seaweedfs/weed
"$tmp/weed" version >&2
mv -f "$tmp/weed" "$out/weed"
echo "$stamp" >"$out/weed.stamp"
echo "tests/s3/build.sh: weed built after $((SECONDS - start)) s" >&2
echo "$out/weed"
