#!/usr/bin/env bash
# Builds the real Argo Rollouts controller (rollouts-controller, Go module
# github.com/argoproj/argo-rollouts, version pinned in go/go.mod) from the Go module proxy, and
# copies the manifests it needs next to it:
#   OUT/rollouts-controller
#   OUT/argo-rollouts/crds/{rollout,analysis-run,analysis-template,cluster-analysis-template,experiment}-crd.yaml
#   OUT/argo-rollouts/role/argo-rollouts-clusterrole.yaml      (the controller's RBAC, ClusterRole "argo-rollouts")
#   OUT/argo-rollouts/notifications/argo-rollouts-notification-configmap.yaml   (empty ConfigMap)
#   OUT/argo-rollouts/MODULE                                    (stamp: module@version sum)
#
# `go install .../cmd/rollouts-controller@vX` is refused ("The go.mod file for the module providing
# named packages contains one or more replace directives"), so go/ is a wrapper module that requires
# argo-rollouts and carries the replace block copied verbatim from argo-rollouts' own go.mod; its
# go.sum is committed and the build runs with -mod=readonly.
#
# Usage: build.sh OUT_DIR [--force]
# Idempotent: when OUT has a binary reporting the pinned version and a current manifest stamp, it
# exits at once without calling Go. The last stdout line is OUT (everything else goes to stderr).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
gomod="$here/go/go.mod"
module=github.com/argoproj/argo-rollouts
pkg=$module/cmd/rollouts-controller

out="${1:?usage: $0 OUT_DIR [--force]}"
force=0
case "${2:-}" in "") ;; --force) force=1 ;; *) echo "usage: $0 OUT_DIR [--force]" >&2; exit 2 ;; esac
mkdir -p "$out"
out="$(cd "$out" && pwd)"

version="$(awk '{ m = $1; v = $2 } $1 == "require" { m = $2; v = $3 } m == "'"$module"'" { print v; exit }' "$gomod")"
if [ -z "$version" ]; then
    echo "build.sh: cannot read the $module version from $gomod" >&2
    exit 1
fi
# What `rollouts-controller --version` prints when linked with -X ...version=${version#v} and no
# git commit (utils/version.GetVersion appends "+unknown").
want="v${version#v}+unknown"
manifest_dir="$out/argo-rollouts"

binary_current() {
    local got
    [ -x "$out/rollouts-controller" ] || return 1
    # Captured whole before comparing: `cmd | grep -q` under pipefail can die of SIGPIPE.
    got="$("$out/rollouts-controller" --version 2>/dev/null)" || return 1
    [ "$got" = "$want" ]
}
manifests_current() {
    [ -f "$manifest_dir/MODULE" ] && grep -q "^$module@$version " "$manifest_dir/MODULE"
}

if [ "$force" = 0 ] && binary_current && manifests_current; then
    echo "$out"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: 'go' is not installed (needed >= the go line of $gomod)" >&2
    exit 127
fi

# GOTOOLCHAIN=local: never fetch a toolchain; -mod=readonly: build exactly the committed go.sum.
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0

if command -v flock >/dev/null 2>&1; then
    exec 9>"$out/.argo-build.lock"
    flock 9
fi

tmp="" mtmp=""
trap 'rm -rf "$tmp" "$mtmp"' EXIT
cd "$here/go"
start=$SECONDS

# The module's directory in the module cache, checked against go.sum by `go mod download`.
dl="$(go mod download -json "$module")"
dir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' <<<"$dl")"
sum="$(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",\{0,1\}$/\1/p' <<<"$dl")"
if [ -z "$dir" ] || [ ! -d "$dir/manifests/crds" ]; then
    echo "build.sh: go mod download $module gave no usable Dir:" >&2
    echo "$dl" >&2
    exit 1
fi

if [ "$force" = 1 ] || ! binary_current; then
    echo "build.sh: building rollouts-controller $version with $(go version | cut -d' ' -f3) (cold: several minutes)" >&2
    tmp="$(mktemp -d "$out/.argo-build.XXXXXX")"
    # The Go build cache of this build, deleted with it: the binaries are cached by version, so the
    # several GB of compiled packages would only be used again for another version, and on CI's
    # fresh machine they took disk the node tier needed.
    export GOCACHE="$tmp/go-build"
    go build -trimpath -ldflags "-s -w -X $module/utils/version.version=${version#v}" \
        -o "$tmp/rollouts-controller" "$pkg"
    mv -f "$tmp/rollouts-controller" "$out/rollouts-controller"
    if ! binary_current; then
        echo "build.sh: the freshly built $out/rollouts-controller does not report '$want':" >&2
        "$out/rollouts-controller" --version >&2 || true
        exit 1
    fi
    echo "build.sh: rollouts-controller built after $((SECONDS - start)) s" >&2
fi

# Manifests: copied into a fresh directory and renamed in, so readers never see a half copy.
mtmp="$(mktemp -d "$out/.argo-manifests.XXXXXX")"
mkdir -p "$mtmp/crds" "$mtmp/role" "$mtmp/notifications"
for f in rollout-crd analysis-run-crd analysis-template-crd cluster-analysis-template-crd experiment-crd; do
    cp "$dir/manifests/crds/$f.yaml" "$mtmp/crds/"
done
cp "$dir/manifests/role/argo-rollouts-clusterrole.yaml" "$mtmp/role/"
cp "$dir/manifests/notifications/argo-rollouts-notification-configmap.yaml" "$mtmp/notifications/"
chmod -R u+w,go+rX "$mtmp"   # module cache files are read-only; mktemp makes 0700
echo "$module@$version $sum" >"$mtmp/MODULE"
rm -rf "$manifest_dir.old"
if [ -d "$manifest_dir" ]; then mv "$manifest_dir" "$manifest_dir.old"; fi
mv "$mtmp" "$manifest_dir"
rm -rf "$manifest_dir.old"
echo "$out"
