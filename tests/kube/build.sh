#!/usr/bin/env bash
# Builds the kube-apiserver and etcd that the real-apiserver tests run (tests/kube-harness) from the
# Go module in tests/kube/go, into a cache directory that outlives `cargo clean` and checkouts:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/spur/kube/<kubernetes version>-<etcd version>
# or $SPUR_KUBE_BINDIR when set. When both binaries are there and report the pinned versions they
# are reused without touching Go or the network. Go is a test-harness tool only.
#
# Usage: tests/kube/build.sh [--print-dir | --force]
#   (none)       reuse or build; the last stdout line is the bin dir (everything else goes to stderr)
#   --print-dir  only print the bin dir, build nothing
#   --force      rebuild even when the cached binaries look current
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
gomod="$here/go/go.mod"

mode=build
case "${1:-}" in
    "") ;;
    --print-dir) mode=print ;;
    --force) mode=force ;;
    *) echo "usage: $0 [--print-dir | --force]" >&2; exit 2 ;;
esac

# go.mod is the one place the versions are written down.
k8s_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v1\./ { print $2; exit }' "$gomod")"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" && $2 ~ /^v3\./ { print $2; exit }' "$gomod")"
if [ -z "$k8s_version" ] || [ -z "$etcd_version" ]; then
    echo "tests/kube/build.sh: cannot read the k8s.io/kubernetes and go.etcd.io/etcd/server/v3 versions from $gomod" >&2
    exit 1
fi
k8s_minor="$(echo "$k8s_version" | cut -d. -f2)"
# A staging replace left on another release would build a kube-apiserver that mixes two releases.
staging_version="v0.${k8s_version#v1.}"
stale="$(awk -v want="$staging_version" '$2 == "=>" && $3 ~ /^k8s\.io\// && $4 != want { print $1 " => " $4 }' "$gomod")"
if [ -n "$stale" ]; then
    echo "tests/kube/build.sh: these replaces in $gomod are not at $staging_version (k8s.io/kubernetes $k8s_version):" >&2
    echo "$stale" >&2
    exit 1
fi

bindir="${SPUR_KUBE_BINDIR:-${XDG_CACHE_HOME:-${HOME:?HOME or XDG_CACHE_HOME must be set}/.cache}/spur/kube/$k8s_version-$etcd_version}"
case "$bindir" in /*) ;; *) bindir="$PWD/$bindir" ;; esac

if [ "$mode" = print ]; then
    echo "$bindir"
    exit 0
fi

current() {
    [ -x "$bindir/kube-apiserver" ] && [ -x "$bindir/etcd" ] || return 1
    "$bindir/kube-apiserver" --version 2>/dev/null | grep -qxF "Kubernetes $k8s_version" || return 1
    "$bindir/etcd" --version 2>/dev/null | grep -qxF "etcd Version: ${etcd_version#v}" || return 1
}

if [ "$mode" = build ] && current; then
    echo "$bindir"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "tests/kube/build.sh: 'go' is not installed; it is needed (>= the go line of $gomod) to build kube-apiserver $k8s_version and etcd $etcd_version for the real-apiserver tests. See https://go.dev/doc/install, or point SPUR_KUBE_BINDIR at a directory holding both binaries." >&2
    exit 127
fi

mkdir -p "$bindir"
# Two callers racing (parallel test binaries, a developer and CI) would each spend minutes
# building; the second waits and then finds the first one's binaries.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$bindir/.build.lock"
    flock 9
    if [ "$mode" = build ] && current; then
        echo "$bindir"
        exit 0
    fi
fi

# The binaries are built next to their final place and renamed in, so a reader never sees a
# half-written binary and an interrupted build leaves the old ones (or none), never a broken one.
tmp="$(mktemp -d "$bindir/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# GOTOOLCHAIN=local: never fetch a toolchain behind the user's back; an old Go fails with a clear
# "go.mod requires go >= ..." instead. -mod=readonly: build exactly the committed go.sum.
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
cd "$here/go"
echo "tests/kube/build.sh: building kube-apiserver $k8s_version and etcd $etcd_version into $bindir with $(go version | cut -d' ' -f3) (a cold build takes several minutes; see tests/kube/README.md)" >&2

start=$SECONDS
go list -deps k8s.io/kubernetes/cmd/kube-apiserver go.etcd.io/etcd/server/v3 >/dev/null
echo "tests/kube/build.sh: modules ready after $((SECONDS - start)) s" >&2

# Without these the binary reports v0.0.0-master, which `current` could not tell from any other build.
version_pkg=k8s.io/component-base/version
ldflags="-s -w -X $version_pkg.gitVersion=$k8s_version -X $version_pkg.gitMajor=1 -X $version_pkg.gitMinor=$k8s_minor -X $version_pkg.gitTreeState=clean"
go build -trimpath -ldflags "$ldflags" -o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
echo "tests/kube/build.sh: kube-apiserver built after $((SECONDS - start)) s" >&2
go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3
echo "tests/kube/build.sh: etcd built after $((SECONDS - start)) s" >&2

mv -f "$tmp/kube-apiserver" "$tmp/etcd" "$bindir/"
if ! current; then
    echo "tests/kube/build.sh: the freshly built binaries in $bindir do not report kube-apiserver $k8s_version / etcd $etcd_version:" >&2
    "$bindir/kube-apiserver" --version >&2 || true
    "$bindir/etcd" --version >&2 || true
    exit 1
fi
echo "$bindir"
