#!/usr/bin/env bash
# Builds the Kubernetes programs the tests run, from Go modules, into a cache directory that outlives
# `cargo clean` and checkouts:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/spur/kube/<kubernetes version>-<etcd version>
# or $SPUR_KUBE_BINDIR when set.
#   - the apiserver tier (tests/kube-harness): kube-apiserver and etcd, from tests/kube/go;
#   - the node tier (tests/node): kubelet, kube-controller-manager, kube-scheduler, kube-proxy and
#     kubectl from the same module graph, CoreDNS from tests/kube/go-coredns and helm from
#     tests/kube/go-helm (their own modules, so they never move kube-apiserver's dependencies);
#   - not a program: Istio's and Gateway API's CRDs (YAML) from their Go modules, in mesh-crds/.
# A binary that is there and reports its pinned version is reused without touching Go or the
# network. Go is a test-harness tool only.
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
coredns_version="$(awk '{ m = $1; v = $2 } $1 == "require" { m = $2; v = $3 } m == "github.com/coredns/coredns" { print v; exit }' "$here/go-coredns/go.mod")"
helm_version="$(awk '{ m = $1; v = $2 } $1 == "require" { m = $2; v = $3 } m == "helm.sh/helm/v3" { print v; exit }' "$here/go-helm/go.mod")"
if [ -z "$coredns_version" ] || [ -z "$helm_version" ]; then
    echo "tests/kube/build.sh: cannot read the coredns and helm versions from $here/go-coredns/go.mod and $here/go-helm/go.mod" >&2
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

# One row per binary: name, module directory, Go package, the command that prints its version, and
# the exact line that command must print.
binaries=(
    "kube-apiserver|go|k8s.io/kubernetes/cmd/kube-apiserver|--version|Kubernetes $k8s_version"
    "etcd|go|go.etcd.io/etcd/server/v3|--version|etcd Version: ${etcd_version#v}"
    "kubelet|go|k8s.io/kubernetes/cmd/kubelet|--version|Kubernetes $k8s_version"
    "kube-controller-manager|go|k8s.io/kubernetes/cmd/kube-controller-manager|--version|Kubernetes $k8s_version"
    "kube-scheduler|go|k8s.io/kubernetes/cmd/kube-scheduler|--version|Kubernetes $k8s_version"
    "kube-proxy|go|k8s.io/kubernetes/cmd/kube-proxy|--version|Kubernetes $k8s_version"
    "kubectl|go|k8s.io/kubernetes/cmd/kubectl|version --client|Client Version: $k8s_version"
    "coredns|go-coredns|github.com/coredns/coredns|-version|CoreDNS-${coredns_version#v}"
    "helm|go-helm|helm.sh/helm/v3/cmd/helm|version --template {{.Version}}|$helm_version"
)

# The whole output is captured before it is searched: `cmd | grep -q` under pipefail fails at
# random when grep exits at its first match and the still-writing command dies of SIGPIPE.
binary_current() {
    local name="$1" version_args="$2" want="$3" out
    [ -x "$bindir/$name" ] || return 1
    # shellcheck disable=SC2086 # version_args is a word list on purpose
    out="$(HOME="$bindir" "$bindir/$name" $version_args 2>/dev/null)" || return 1
    grep -qxF -- "$want" <<<"$out"
}

# Prints the names of the binaries that are missing or report another version.
stale_binaries() {
    local row name mod pkg args want
    for row in "${binaries[@]}"; do
        IFS='|' read -r name mod pkg args want <<<"$row"
        binary_current "$name" "$args" "$want" || echo "$name"
    done
}

# Istio's and Gateway API's CRDs, for the mesh-mode tests (tests/tests/kube_mesh.rs): the YAML
# their projects publish in their Go modules, fetched through the module proxy once, checked
# against the h1 sums pinned here (go.sum's hash), and copied into $bindir/mesh-crds, so no test
# fetches anything. One row per module: path, version, h1 sum, then the files to copy (shell
# globs, relative to the module root).
mesh_modules=(
    "istio.io/api|v1.32.0|h1:37mJvg9I0biYZAEQF+MATs4FNeCpXEIVO3LFpVb6iNM=|kubernetes/customresourcedefinitions.gen.yaml"
    "sigs.k8s.io/gateway-api|v1.6.3|h1:lKpJa5bGlraC/QeACvCpsHLdmO6y0iKfzVl6gzaFEYc=|config/crd/standard/gateway.networking.k8s.io_*.yaml"
)
mesh_dir="$bindir/mesh-crds"

# The stamp lists the rows the directory was filled from: other rows, another content.
mesh_crds_current() {
    [ -f "$mesh_dir/MODULES" ] && [ "$(cat "$mesh_dir/MODULES")" = "$(printf '%s\n' "${mesh_modules[@]}")" ]
}

# A field of `go mod download -json` output (one "Key": "value" per line).
json_field() {
    sed -n "s/^[[:space:]]*\"$1\": \"\(.*\)\",\{0,1\}$/\1/p" <<<"$2"
}

fetch_mesh_crds() {
    local row mod version sum files out dir got tmpdir
    tmpdir="$(mktemp -d "$bindir/.mesh.XXXXXX")"
    for row in "${mesh_modules[@]}"; do
        IFS='|' read -r mod version sum files <<<"$row"
        # Outside any module, so no go.mod is read or written; -mod=mod lets `download` resolve.
        out="$(cd "$tmpdir" && GOFLAGS=-mod=mod go mod download -json "$mod@$version")"
        dir="$(json_field Dir "$out")"
        got="$(json_field Sum "$out")"
        if [ "$got" != "$sum" ] || [ ! -d "$dir" ]; then
            echo "tests/kube/build.sh: $mod@$version: expected sum $sum, got '${got}' (dir '${dir}'):" >&2
            echo "$out" >&2
            rm -rf "$tmpdir"
            exit 1
        fi
        mkdir -p "$tmpdir/${mod//\//_}"
        # shellcheck disable=SC2086 # files is a glob on purpose
        (cd "$dir" && cp $files "$tmpdir/${mod//\//_}/")
    done
    printf '%s\n' "${mesh_modules[@]}" >"$tmpdir/MODULES"
    rm -rf "$mesh_dir.old"
    if [ -d "$mesh_dir" ]; then mv "$mesh_dir" "$mesh_dir.old"; fi
    mv "$tmpdir" "$mesh_dir"
    rm -rf "$mesh_dir.old"
    echo "tests/kube/build.sh: mesh CRDs in $mesh_dir" >&2
}

if [ "$mode" = build ] && [ -z "$(stale_binaries)" ] && mesh_crds_current; then
    echo "$bindir"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "tests/kube/build.sh: 'go' is not installed; it is needed (>= the go line of $gomod) to build the Kubernetes $k8s_version programs, etcd $etcd_version, CoreDNS $coredns_version and helm $helm_version for the Kubernetes tests. See https://go.dev/doc/install, or point SPUR_KUBE_BINDIR at a directory holding them all." >&2
    exit 127
fi

mkdir -p "$bindir"
# Two callers racing (parallel test binaries, a developer and CI) would each spend minutes
# building; the second waits and then finds the first one's binaries.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$bindir/.build.lock"
    flock 9
    if [ "$mode" = build ] && [ -z "$(stale_binaries)" ] && mesh_crds_current; then
        echo "$bindir"
        exit 0
    fi
fi

if [ "$mode" = force ] || ! mesh_crds_current; then
    fetch_mesh_crds
fi

# The binaries are built next to their final place and renamed in, so a reader never sees a
# half-written binary and an interrupted build leaves the old ones (or none), never a broken one.
tmp="$(mktemp -d "$bindir/.build.XXXXXX")"
# The Go build cache of this build, deleted with it: the binaries are cached by version, so the
# several GB of compiled packages would only be used again for another version, and on CI's
# fresh machine they took disk the node tier needed.
export GOCACHE="$tmp/go-build"
trap 'rm -rf "$tmp"' EXIT

# GOTOOLCHAIN=local: never fetch a toolchain behind the user's back; an old Go fails with a clear
# "go.mod requires go >= ..." instead. -mod=readonly: build exactly the committed go.sum.
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
if [ "$mode" = force ]; then
    todo="$(printf '%s\n' "${binaries[@]}" | cut -d'|' -f1)"
else
    todo="$(stale_binaries)"
fi
if [ -n "$todo" ]; then
    echo "tests/kube/build.sh: building $(echo $todo) into $bindir with $(go version | cut -d' ' -f3) (a cold build takes about 10 minutes; see tests/kube/README.md)" >&2
fi

# Without these the Kubernetes programs report v0.0.0-master and helm its minor only, which the
# version check could not tell from any other build.
version_pkg=k8s.io/component-base/version
k8s_ldflags="-s -w -X $version_pkg.gitVersion=$k8s_version -X $version_pkg.gitMajor=1 -X $version_pkg.gitMinor=$k8s_minor -X $version_pkg.gitTreeState=clean"
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version -X helm.sh/helm/v3/internal/version.gitTreeState=clean"

start=$SECONDS
for row in "${binaries[@]}"; do
    IFS='|' read -r name mod pkg args want <<<"$row"
    grep -qxF -- "$name" <<<"$todo" || continue
    case "$mod:$name" in
        go:etcd | go-coredns:*) ldflags="-s -w" ;;
        go-helm:*) ldflags="$helm_ldflags" ;;
        *) ldflags="$k8s_ldflags" ;;
    esac
    (cd "$here/$mod" && go build -trimpath -ldflags "$ldflags" -o "$tmp/$name" "$pkg")
    mv -f "$tmp/$name" "$bindir/$name"
    if ! binary_current "$name" "$args" "$want"; then
        echo "tests/kube/build.sh: the freshly built $bindir/$name does not report '$want':" >&2
        # shellcheck disable=SC2086
        HOME="$bindir" "$bindir/$name" $args >&2 || true
        exit 1
    fi
    echo "tests/kube/build.sh: $name built after $((SECONDS - start)) s" >&2
done
echo "$bindir"
