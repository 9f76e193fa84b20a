#!/usr/bin/env bash
# Builds the container images the node tests need, with no registry, as OCI image archives
# that `ctr -n k8s.io images import <file>` (containerd 1.6) accepts and tags:
#
#   localhost/spur:dev              the Spur image: the repo's Containerfile, target `prebuilt`
#                                   (its runtime stage + the given binaries in /usr/local/bin)
#   localhost/spur-test-client:dev  base only; entrypoint `catatonit -P` (sleeps until SIGTERM);
#                                   curl available
#   localhost/pause:dev             base only; entrypoint `catatonit -P`, for containerd's
#                                   sandbox_image
#
# All three share one layer: a Debian bookworm rootfs made with mmdebstrap (iptables, nftables,
# ca-certificates, curl, catatonit), cached under ${XDG_CACHE_HOME:-~/.cache}/spur/node/ keyed
# by a hash of its recipe. buildah (vfs storage in a temp dir, chroot isolation, --pull=never)
# turns it into images; nothing is pulled from a registry. The first run needs the Debian
# mirror (about a minute); later runs reuse the cached rootfs.
#
# Usage: tests/node/image.sh <bindir with spur, spur-sidecar, spur-init, spur-job-executor, spur-io> <outdir>
# Prints one line per image on stdout: <name> <archive> compressed=<MB> uncompressed=<MB>.
# Env: SPUR_EXECUTOR_BIN and SPUR_IO_BIN are the spur-job-executor and spur-io to use instead of
# <bindir>'s (tests/run.sh passes static builds: they run inside pods of any image); SPUR_NODE_BASE_REFRESH=1
# rebuilds the cached rootfs; SPUR_DEBIAN_MIRROR overrides the
# mirror (default: mmdebstrap's, deb.debian.org plus updates and security).
#
# Needs root (mmdebstrap's root mode; buildah's storage). The image config (user 65532:65532,
# ENTRYPOINT ["spur"], PATH, /usr/local/bin) comes from the Containerfile's runtime stage, so
# what this script builds and what users build from the Containerfile agree.
set -euo pipefail

prog=tests/node/image.sh
die() { echo "$prog: error: $*" >&2; exit 1; }
log() { echo "$prog: $*" >&2; }

[ $# -eq 2 ] || { sed -n '/^# Usage:/,/^# Prints/p' "$0" | sed 's/^# //' >&2; exit 2; }
bindir=$1
outdir=$2

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
containerfile=$repo/Containerfile
[ -f "$containerfile" ] || die "no Containerfile at $containerfile"

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap root mode, buildah storage); run it as root"
for tool in mmdebstrap buildah jq flock sha256sum tar findmnt; do
    command -v "$tool" >/dev/null 2>&1 \
        || die "'$tool' not found (apt-get install -y mmdebstrap buildah jq util-linux)"
done
bins=(spur spur-sidecar spur-init spur-job-executor spur-io)
bindir=$(cd "$bindir" && pwd)
srcs=()
for b in "${bins[@]}"; do
    src=$bindir/$b
    [ "$b" = spur-job-executor ] && src=${SPUR_EXECUTOR_BIN:-$src}
    [ "$b" = spur-io ] && src=${SPUR_IO_BIN:-$src}
    [ -f "$src" ] && [ -x "$src" ] \
        || die "$src missing or not executable (cargo build --bin spur --bin spur-sidecar --bin spur-init --bin spur-job-executor --bin spur-io)"
    srcs+=("$src")
done
mkdir -p "$outdir" || die "cannot create $outdir"
outdir=$(cd "$outdir" && pwd)

# ---- the base rootfs (cached) -------------------------------------------------------------
suite=bookworm
packages=(iptables nftables ca-certificates curl catatonit)
mm_opts=(
    --variant=minbase
    --include="$(IFS=,; echo "${packages[*]}")"
    --aptopt='APT::Install-Recommends "false"'
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --skip=output/dev
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*.log "$1"/var/log/apt/*'
)
mirror=${SPUR_DEBIAN_MIRROR:-}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/spur/node
key=$(printf '%s\n' base-v1 "$suite" "$mirror" "${mm_opts[@]}" | sha256sum | cut -c1-16)
base_tar=$cache/base-$suite-$key.tar
mkdir -p "$cache"

tmp=
cleanup() {
    local rc=$?
    set +e
    if [ -n "$tmp" ] && [ -d "$tmp" ]; then
        if [ -d "$tmp/storage" ]; then
            buildah "${B[@]}" rm --all >/dev/null 2>&1 || true
        fi
        # chroot-isolated RUN steps bind /dev, /proc, /sys into the rootfs: never rm through them.
        findmnt -rn -o TARGET | grep -F "$tmp/" | sort -r | while read -r m; do
            umount -l "$m" 2>/dev/null
        done
        if findmnt -rn -o TARGET | grep -qF "$tmp/"; then
            echo "$prog: warning: left $tmp in place, something is still mounted under it" >&2
        else
            rm -rf --one-file-system "$tmp"
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
tmp=$(mktemp -d "${TMPDIR:-/tmp}/spur-image.XXXXXX")

build_base() {
    exec 9>"$cache/base.lock"
    flock -n 9 || { log "waiting for another image.sh run (lock $cache/base.lock)"; flock 9; }
    rm -f "$cache"/base-*.part.*  # from interrupted runs
    if [ -s "$base_tar" ] && [ -z "${SPUR_NODE_BASE_REFRESH:-}" ]; then
        return
    fi
    log "building the Debian $suite base rootfs with mmdebstrap (about a minute; needs the Debian mirror)"
    local part="$base_tar.part.$$" start=$SECONDS
    rm -f "$part"
    if ! mmdebstrap --quiet --mode=root --format=tar "${mm_opts[@]}" "$suite" "$part" \
            ${mirror:+"$mirror"} >"$tmp/mmdebstrap.log" 2>&1; then
        rm -f "$part"
        tail -n 30 "$tmp/mmdebstrap.log" >&2
        die "mmdebstrap failed (is the Debian mirror reachable?)"
    fi
    mv -f "$part" "$base_tar"
    # Old rootfs from other recipes.
    find "$cache" -maxdepth 1 -name "base-*.tar" ! -name "$(basename "$base_tar")" -delete
    log "base rootfs: $base_tar ($(( $(stat -c %s "$base_tar") / 1048576 )) MB, $((SECONDS - start)) s)"
}
# The lock stays held until exit: concurrent runs take turns.
build_base

# ---- skip when nothing changed --------------------------------------------------------------
names=(localhost/spur:dev localhost/spur-test-client:dev localhost/pause:dev)
files=(spur.tar spur-test-client.tar pause.tar)
stamp=$outdir/.images.stamp
inputs=$( {
    stat -c '%n %s %Y' "$base_tar"
    sha256sum "$0" "$containerfile" | cut -d' ' -f1
    sha256sum "${srcs[@]}"
} | sha256sum | cut -c1-32)
if [ -f "$stamp" ] && [ "$(head -n1 "$stamp")" = "$inputs" ] \
        && (cd "$outdir" && ls "${files[@]}" >/dev/null 2>&1); then
    log "images up to date in $outdir"
    tail -n +2 "$stamp"
    exit 0
fi
rm -f "$stamp"

# ---- buildah, with private storage and policy -----------------------------------------------
cat >"$tmp/storage.conf" <<EOF
[storage]
driver = "vfs"
graphroot = "$tmp/storage/root"
runroot = "$tmp/storage/run"
EOF
echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$tmp/policy.json"
export CONTAINERS_STORAGE_CONF=$tmp/storage.conf
export BUILDAH_ISOLATION=chroot
B=(--root "$tmp/storage/root" --runroot "$tmp/storage/run" --storage-driver vfs)
bh() { buildah "${B[@]}" "$@"; }
policy=(--signature-policy "$tmp/policy.json")
mkdir -p "$tmp/storage"
start=$SECONDS

path_env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# One working container with the rootfs; each commit makes the same single base layer
# (--timestamp 0 makes it byte-identical across commits and runs).
c=$(bh from "${policy[@]}" scratch)
bh add "$c" "$base_tar" / >/dev/null
bh config --env "$path_env" --label org.opencontainers.image.source=https://github.com/spur-dev/spur "$c"
commit() { bh commit "${policy[@]}" --quiet --timestamp 0 "$c" "$1" >/dev/null; }

bh config --entrypoint '["catatonit","-P"]' --cmd '' --user 65535:65535 \
    --label org.opencontainers.image.title=pause "$c"
commit localhost/pause:dev
bh config --entrypoint '["catatonit","-P"]' --cmd '' --user 0:0 \
    --label org.opencontainers.image.title=spur-test-client "$c"
commit localhost/spur-test-client:dev
bh config --entrypoint '' --cmd '' --user 0:0 \
    --label org.opencontainers.image.title=spur-base "$c"
commit localhost/spur-base:dev
bh rm "$c" >/dev/null

# The Spur image: the Containerfile's `prebuilt` target, binaries from a context dir.
mkdir -p "$tmp/ctx/bin"
for i in "${!bins[@]}"; do
    ln "${srcs[$i]}" "$tmp/ctx/bin/${bins[$i]}" 2>/dev/null || cp "${srcs[$i]}" "$tmp/ctx/bin/${bins[$i]}"
done
if ! bh bud "${policy[@]}" --quiet --isolation chroot --pull=never --timestamp 0 \
        --target prebuilt --build-arg BASE_IMAGE=localhost/spur-base:dev \
        -f "$containerfile" -t localhost/spur:dev "$tmp/ctx" >"$tmp/bud.log" 2>&1; then
    cat "$tmp/bud.log" >&2
    die "buildah bud of $containerfile (target prebuilt) failed"
fi

# ---- OCI archives -----------------------------------------------------------------------------
layout=$tmp/oci
for n in "${names[@]}"; do
    bh push "${policy[@]}" --quiet "$n" "oci:$layout:$n" >/dev/null
done
summary=
for i in "${!names[@]}"; do
    n=${names[$i]} f=$outdir/${files[$i]}
    stage=$tmp/stage-$i
    mkdir -p "$stage"
    cp "$layout/oci-layout" "$stage/"
    jq -c --arg n "$n" '{schemaVersion: 2, manifests: [.manifests[]
        | select(.annotations["org.opencontainers.image.ref.name"] == $n)
        | .annotations["io.containerd.image.name"] = $n]}' "$layout/index.json" >"$stage/index.json"
    mdigest=$(jq -r '.manifests[0].digest // empty' "$stage/index.json")
    [ -n "$mdigest" ] || die "buildah push wrote no manifest for $n"
    manifest=$layout/blobs/sha256/${mdigest#sha256:}
    blobs=("blobs/sha256/${mdigest#sha256:}")
    while read -r d; do blobs+=("blobs/sha256/${d#sha256:}"); done \
        < <(jq -r '.config.digest, .layers[].digest' "$manifest")
    tar -cf "$f.part" --owner=0 --group=0 --numeric-owner \
        -C "$stage" oci-layout index.json -C "$layout" "${blobs[@]}"
    mv -f "$f.part" "$f"
    compressed=$(jq '[.config.size, .layers[].size] | add' "$manifest")
    uncompressed=$(bh images --noheading --format '{{.Size}}' "$n" | head -n1)
    line="$n $f compressed=$((compressed / 1048576))MB uncompressed=${uncompressed// /}"
    summary+="$line"$'\n'
done
printf '%s\n%s' "$inputs" "$summary" >"$stamp"
log "built ${#names[@]} images in $((SECONDS - start)) s"
printf '%s' "$summary"
