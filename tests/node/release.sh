#!/usr/bin/env bash
# Rebuilds a recorded release (RELEASES, at the repository's root) for the node tier's upgrade
# test (tests/tests/node_upgrade): its chart and its Spur image, from the release's own commit,
# with that commit's Cargo.lock, Containerfile and tests/node/image.sh.
#
#   <dir>/release     "<version> <commit>"
#   <dir>/chart/      the release's charts/spur
#   <dir>/spur.tar    its Spur image, an OCI archive tagged localhost/spur:<version> (image.sh tags
#                     every image :dev, which is the tree under test's: the archive is retagged)
#
# The release's source comes from git (`git archive <commit>`; a shallow clone fetches the commit
# from origin first). Its binaries build in the tree's target directory, so the third-party crates
# the two trees share in the same versions and features compile once: about 3.5 minutes on two
# quiet cores for the release's own crates (issue 47). Cargo names a workspace crate's artifacts
# by its path inside the workspace and its version, the same in both trees, and judges them fresh
# by their sources' times: so the release's workspace version gets the suffix "-release" (its
# crates' artifacts are its own; `spur --version` says so) and its sources are dated now. Its
# vendored crates (vendor/) are shared when they are the tree's, dated from the commit; when they
# differ the whole release builds in a target directory of its own (slower, never wrong).
# Building there relinks target/debug/spur* and the static spur-job-executor and spur-io to the
# release's: the tree's are put back afterwards.
#
# Cached under ${XDG_CACHE_HOME:-~/.cache}/spur/releases/<version>-<commit>/: a second run prints
# the directory at once. At most the two most recently used release directories are kept. One run
# at a time (a lock in that directory).
#
# Usage: tests/node/release.sh [version]   (default: the last line of RELEASES)
#   with SPUR_KAFKA_DIR and SPUR_GO_BINDIR set (the release's image.sh builds every test image;
#   only the Spur image is kept), as tests/run.sh exports them. Needs root (image.sh does).
# Prints the release directory as its last line.
set -euo pipefail

prog=tests/node/release.sh
die() { echo "$prog: error: $*" >&2; exit 1; }
log() { echo "$prog: $*" >&2; }

[ $# -le 1 ] || { sed -n '/^# Usage:/,/^# Prints/p' "$0" | sed 's/^# //' >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
[ -f "$repo/RELEASES" ] || die "no RELEASES at $repo"

# The release: the named one, or the last.
releases=$(grep -Ev '^[[:space:]]*(#|$)' "$repo/RELEASES") || die "RELEASES names no release"
if [ $# -eq 1 ]; then
    line=$(awk -v v="$1" '$1 == v' <<<"$releases")
    [ -n "$line" ] || die "RELEASES has no release $1 (it has: $(awk '{print $1}' <<<"$releases" | paste -sd ' '))"
else
    line=$(tail -n 1 <<<"$releases")
fi
read -r version commit extra <<<"$line"
[ -z "${extra:-}" ] || die "RELEASES: '$line': expected '<version> <commit>'"
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+([-+][0-9A-Za-z.-]+)?$ ]] \
    || die "RELEASES: '$version' is not a semantic version"
[[ "$commit" =~ ^[0-9a-f]{40}$ ]] || die "RELEASES: '$commit' is not a full commit id (40 hex digits)"

cache=${XDG_CACHE_HOME:-$HOME/.cache}/spur/releases
dir=$cache/$version-$commit
mkdir -p "$cache"
# One run at a time: two would set aside each other's binaries, and replace the directory the
# other's test reads.
exec 9>"$cache/.lock"
flock 9
if [ -f "$dir/release" ] && [ -f "$dir/spur.tar" ] && [ -f "$dir/chart/Chart.yaml" ]; then
    touch "$dir"
    log "release $version ($commit): cached"
    echo "$dir"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "needs root (the release's tests/node/image.sh: mmdebstrap, buildah)"
for tool in git cargo rustc jq tar flock awk; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found"
done

# ---- the source -------------------------------------------------------------------------------
if ! git -C "$repo" cat-file -e "$commit^{commit}" 2>/dev/null; then
    log "commit $commit is not in this clone (a shallow one?): fetching it from origin"
    depth=()
    [ "$(git -C "$repo" rev-parse --is-shallow-repository)" = true ] && depth=(--depth 1)
    git -C "$repo" fetch --quiet "${depth[@]}" origin "$commit" \
        || die "release $version's commit $commit is neither in this clone nor fetchable from origin (clone without --depth, or fetch it)"
fi
# Scratch left by a killed run.
find "$cache" -mindepth 1 -maxdepth 1 -name '.build-*' -mmin +1440 -exec rm -rf {} +
tmp=$(mktemp -d "$cache/.build-XXXXXX")
saved=$tmp/saved
restore=()
# The tree's binaries go back whatever happens; then the scratch goes.
cleanup() {
    local i
    for i in "${!restore[@]}"; do
        # Untouched when the build had nothing to relink.
        if [ -e "$saved/$i" ] && ! [ "$saved/$i" -ef "${restore[$i]}" ]; then
            mv -f "$saved/$i" "${restore[$i]}" || echo "$prog: could not put ${restore[$i]} back" >&2
        fi
    done
    rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$tmp/src" "$saved"
# Dated now (-m), not from the commit (see the top). The vendored crates, when they are the
# tree's, keep the commit's dates, so the tree's artifacts of them stay fresh for both.
git -C "$repo" archive "$commit" | tar -x -m -C "$tmp/src"
target=${CARGO_TARGET_DIR:-$repo/target}
if git -C "$repo" diff --quiet "$commit" -- vendor; then
    rm -rf "$tmp/src/vendor"
    git -C "$repo" archive "$commit" vendor | tar -x -C "$tmp/src"
else
    log "vendor/ differs between the release and the tree: building the release in a target directory of its own"
    target=$cache/target
fi
# The release's workspace version, suffixed, in the manifest and in the lock (its members are
# the lock's packages without a source and with that version).
ws_version=$(awk '/^\[workspace.package\]/ { p = 1; next } /^\[/ { p = 0 } p && /^version *= *"/ { gsub(/.*= *"|".*/, ""); print; exit }' "$tmp/src/Cargo.toml")
[ -n "$ws_version" ] || die "the release's Cargo.toml has no [workspace.package] version"
suffixed=$ws_version-release
awk -v from="$ws_version" -v to="$suffixed" '
    /^\[workspace.package\]/ { p = 1 } /^\[/ && !/^\[workspace.package\]/ { p = 0 }
    p && $0 == "version = \"" from "\"" { $0 = "version = \"" to "\"" }
    { print }' "$tmp/src/Cargo.toml" >"$tmp/Cargo.toml"
mv -f "$tmp/Cargo.toml" "$tmp/src/Cargo.toml"
awk -v from="$ws_version" -v to="$suffixed" '
    function flush() { if (n) { for (i = 1; i <= n; i++) { if (!src && block[i] == "version = \"" from "\"") block[i] = "version = \"" to "\""; print block[i] } } n = 0; src = 0 }
    /^\[\[package\]\]/ { flush() }
    { block[++n] = $0; if ($0 ~ /^source = /) src = 1 }
    END { flush() }' "$tmp/src/Cargo.lock" >"$tmp/Cargo.lock"
mv -f "$tmp/Cargo.lock" "$tmp/src/Cargo.lock"
grep -q "^version = \"$suffixed\"" "$tmp/src/Cargo.lock" \
    || die "could not give the release's workspace crates the version $suffixed in its Cargo.lock"

# ---- the binaries -----------------------------------------------------------------------------
mkdir -p "$target"
target=$(cd "$target" && pwd)
host=$(rustc -vV | sed -n 's/^host: //p')
static_target=$target/static
# What the two builds below relink: set aside now, put back by cleanup.
save() {
    local f
    for f in "$@"; do
        [ -f "$f" ] && [ -x "$f" ] || continue
        # A hard link keeps the file: cargo replaces a binary by a new link, not in place.
        ln "$f" "$saved/${#restore[@]}" 2>/dev/null || cp -p "$f" "$saved/${#restore[@]}"
        restore+=("$f")
    done
}
save "$target"/debug/spur "$target"/debug/spur-* \
    "$static_target/$host/debug/spur-job-executor" "$static_target/$host/debug/spur-io"
log "building release $version ($commit)"
(cd "$tmp/src" && CARGO_TARGET_DIR=$target cargo build --locked --workspace --all-features --bins) \
    || die "the release's build failed (output above)"
mkdir -p "$tmp/bin"
for f in "$target"/debug/spur "$target"/debug/spur-*; do
    [ -f "$f" ] && [ -x "$f" ] || continue
    ln "$f" "$tmp/bin/" 2>/dev/null || cp -p "$f" "$tmp/bin/"
done
# The job executor and spur-io run inside runner pods of any image: static, as tests/run.sh builds
# the tree's.
(cd "$tmp/src" && RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR=$static_target \
    cargo build --locked --target "$host" --bin spur-job-executor --bin spur-io) \
    || die "the release's static build of spur-job-executor and spur-io failed (output above)"
mkdir -p "$tmp/bin/static"
for f in spur-job-executor spur-io; do
    ln "$static_target/$host/debug/$f" "$tmp/bin/static/" 2>/dev/null \
        || cp -p "$static_target/$host/debug/$f" "$tmp/bin/static/"
done

# ---- the image --------------------------------------------------------------------------------
# The release's image.sh keeps one rootfs per recipe in its cache and deletes the others: its own
# cache, seeded with the tree's (hard links), so neither evicts the other's.
node_cache=${XDG_CACHE_HOME:-$HOME/.cache}/spur/node
mkdir -p "$cache/xdg/spur/node"
for f in "$node_cache"/*.tar; do
    [ -f "$f" ] && ln -f "$f" "$cache/xdg/spur/node/" 2>/dev/null || true
done
XDG_CACHE_HOME=$cache/xdg SPUR_EXECUTOR_BIN=$tmp/bin/static/spur-job-executor \
    SPUR_IO_BIN=$tmp/bin/static/spur-io \
    "$tmp/src/tests/node/image.sh" "$tmp/bin" "$tmp/images" >"$tmp/images.txt" \
    || die "the release's tests/node/image.sh failed (output above)"
archive=$(awk '$1 == "localhost/spur:dev" { print $2 }' "$tmp/images.txt")
[ -n "$archive" ] && [ -f "$archive" ] \
    || die "the release's image.sh wrote no localhost/spur:dev archive: $(cat "$tmp/images.txt")"
# Retagged: a new index.json naming localhost/spur:<version>, the blobs as they are.
mkdir -p "$tmp/retag"
tar -xf "$archive" -C "$tmp/retag"
name=localhost/spur:$version
jq -c --arg n "$name" '.manifests |= map(.annotations["io.containerd.image.name"] = $n
    | .annotations["org.opencontainers.image.ref.name"] = $n)' \
    "$tmp/retag/index.json" >"$tmp/index.json"
mv -f "$tmp/index.json" "$tmp/retag/index.json"
[ "$(jq '.manifests | length' "$tmp/retag/index.json")" = 1 ] \
    || die "the release's Spur archive holds more than one manifest"

# ---- the release directory ----------------------------------------------------------------------
out=$tmp/out
mkdir -p "$out"
(cd "$tmp/retag" && tar -cf "$out/spur.tar" --owner=0 --group=0 --numeric-owner oci-layout index.json blobs)
cp -r "$tmp/src/charts/spur" "$out/chart"
echo "$version $commit" >"$out/release"
rm -rf "$dir"
mv -T "$out" "$dir"
# The two most recently used stay (the one under test and, after a release is cut, the one
# before).
find "$cache" -mindepth 1 -maxdepth 1 -type d ! -name '.*' ! -name xdg ! -name target \
    -printf '%T@ %p\0' | sort -zrn | tail -zn +3 | cut -zd ' ' -f 2- | xargs -0r rm -rf
log "release $version ($commit): $dir"
echo "$dir"
