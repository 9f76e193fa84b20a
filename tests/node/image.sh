#!/usr/bin/env bash
# Builds the container images the node tests need, with no registry, as OCI image archives
# that `ctr -n k8s.io images import <file>` (containerd 1.6) accepts and tags:
#
#   localhost/spur:dev              the Spur image: the repo's Containerfile, target `prebuilt`
#                                   (its runtime stage + the given binaries in /usr/local/bin)
#   localhost/spur-test-client:dev  base, plus Signadot's `sdroutes` (go-routesapi's CLI) and
#                                   `routesapi-watch` (tests/go's harness of go-routesapi's
#                                   packages), both from tests/go/build.sh, in /usr/local/bin;
#                                   entrypoint `catatonit -P` (sleeps until SIGTERM); curl
#                                   available
#   localhost/pause:dev             base only; entrypoint `catatonit -P`, for containerd's
#                                   sandbox_image
#   localhost/spur-postgres:dev     PostgreSQL 15 from Debian's packages (server, psql): a
#                                   database server as a Deployment, and the stock image of
#                                   steps that run psql. Entrypoint spur-postgres-server
#                                   (tests/node/spur-postgres-server.sh: initdb on first start,
#                                   superuser password from POSTGRES_PASSWORD, then postgres in
#                                   the foreground on *:5432); user postgres; StopSignal SIGINT
#                                   (fast shutdown); PGDATA=/var/lib/postgresql/data/pgdata.
#   localhost/spur-kafka:dev        Apache Kafka 3.9 and its independent clients, for the Kafka
#                                   tests (issue 44): Debian's OpenJDK 17 JRE and kcat (librdkafka),
#                                   the broker's and kafka-clients' jars and the Java client harness
#                                   (Probe; CLASSPATH set, so `java Probe ...` runs it), franz-go's
#                                   harness (`kafka-client`), and `spur-kafka-broker`
#                                   (tests/node/spur-kafka-broker.sh: a one-node KRaft broker on
#                                   9092). No entrypoint: pods give a command. User 65532.
#
# The first three share one layer (the test client adds one with sdroutes): a Debian bookworm
# rootfs made with mmdebstrap (iptables, nftables, ca-certificates, curl, catatonit). The
# postgres image has a rootfs of its own (same options; postgresql-15, postgresql-client-15,
# ca-certificates, catatonit; without LLVM, whose only user is PostgreSQL's optional JIT) plus a
# layer with its entrypoint. Both rootfs are
# cached under ${XDG_CACHE_HOME:-~/.cache}/spur/node/, each keyed by a hash of its recipe.
# buildah (vfs storage in a temp dir, chroot isolation, --pull=never) turns them into images;
# nothing is pulled from a registry. The first run needs the Debian mirror (about two minutes);
# later runs reuse the cached rootfs.
#
# Usage: tests/node/image.sh <bindir with spur, the role binaries (spur-operator, ...), spur-sidecar, spur-init, spur-job-executor, spur-io> <outdir>
#   with SPUR_KAFKA_DIR (tests/kafka/fetch.sh's directory) and SPUR_GO_BINDIR (tests/go/build.sh's,
#   with kafka-client and sdroutes) set, as tests/run.sh exports them.
# Prints one line per image on stdout: <name> <archive> compressed=<MB> uncompressed=<MB>.
# Env: SPUR_EXECUTOR_BIN and SPUR_IO_BIN are the spur-job-executor and spur-io to use instead
# of <bindir>'s (tests/run.sh passes static builds: they run inside pods of any image);
# SPUR_NODE_BASE_REFRESH=1 rebuilds both cached rootfs; SPUR_DEBIAN_MIRROR overrides the
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
# The server roles' binaries (bin/ in the workspace), which the chart's Deployments run.
roles=(spur-routeserver spur-gateway spur-operator spur-tunnel-proxy spur-hub spur-agent spur-jobs
    spur-ics spur-traffic-store)
bins=(spur spur-sidecar spur-init spur-job-executor spur-io "${roles[@]}")
bindir=$(cd "$bindir" && pwd)
srcs=()
for b in "${bins[@]}"; do
    src=$bindir/$b
    [ "$b" = spur-job-executor ] && src=${SPUR_EXECUTOR_BIN:-$src}
    [ "$b" = spur-io ] && src=${SPUR_IO_BIN:-$src}
    [ -f "$src" ] && [ -x "$src" ] \
        || die "$src missing or not executable (cargo build --bin spur --bin spur-sidecar --bin spur-init --bin spur-job-executor --bin spur-io$(printf ' --bin %s' "${roles[@]}"))"
    srcs+=("$src")
done
mkdir -p "$outdir" || die "cannot create $outdir"
outdir=$(cd "$outdir" && pwd)

pg_server=$repo/tests/node/spur-postgres-server.sh
[ -f "$pg_server" ] || die "no $pg_server"
kafka_broker=$repo/tests/node/spur-kafka-broker.sh
[ -f "$kafka_broker" ] || die "no $kafka_broker"
kafka_dir=${SPUR_KAFKA_DIR:-}
[ -n "$kafka_dir" ] && [ -d "$kafka_dir/lib" ] && [ -d "$kafka_dir/classes" ] \
    || die "SPUR_KAFKA_DIR must name tests/kafka/fetch.sh's directory (SPUR_KAFKA_DIR=\"\$(tests/kafka/fetch.sh | tail -n 1)\")"
go_client=${SPUR_GO_BINDIR:-}/kafka-client
sdroutes=${SPUR_GO_BINDIR:-}/sdroutes
routesapi_watch=${SPUR_GO_BINDIR:-}/routesapi-watch
[ -n "${SPUR_GO_BINDIR:-}" ] && [ -x "$go_client" ] && [ -x "$sdroutes" ] && [ -x "$routesapi_watch" ] \
    || die "SPUR_GO_BINDIR must name tests/go/build.sh's directory, with kafka-client, sdroutes and routesapi-watch (SPUR_GO_BINDIR=\"\$(tests/go/build.sh | tail -n 1)\")"

# ---- the rootfs (cached) ------------------------------------------------------------------
suite=bookworm
packages=(iptables nftables ca-certificates curl catatonit)
# Shared by both rootfs; the base's options keep their order (its cache key is their hash).
common_opts=(
    --aptopt='APT::Install-Recommends "false"'
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --skip=output/dev
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*.log "$1"/var/log/apt/*'
)
mm_opts=(--variant=minbase --include="$(IFS=,; echo "${packages[*]}")" "${common_opts[@]}")
pg_packages=(postgresql-15 postgresql-client-15 ca-certificates catatonit)
pg_opts=(
    --variant=minbase
    --include="$(IFS=,; echo "${pg_packages[*]}")"
    "${common_opts[@]}"
    # libLLVM (110 MB), its libz3 (23 MB) and the JIT's bitcode (26 MB) serve only PostgreSQL's
    # optional JIT, and PostgreSQL quietly runs without it when llvmjit.so is absent.
    --dpkgopt='path-exclude=/usr/lib/*/libLLVM-*'
    --dpkgopt='path-exclude=/usr/lib/*/libz3.so*'
    --dpkgopt='path-exclude=/usr/lib/postgresql/*/lib/llvmjit*'
    --dpkgopt='path-exclude=/usr/lib/postgresql/*/lib/bitcode/*'
    # No cluster from the package's postinst: the entrypoint makes one in $PGDATA.
    --essential-hook='mkdir -p "$1"/etc/postgresql-common/createcluster.d && echo "create_main_cluster = false" >"$1"/etc/postgresql-common/createcluster.d/spur.conf'
    # ssl-cert's postinst made a snakeoil key pair; the server does not use TLS, and an image
    # is no place for a private key.
    --customize-hook='rm -f "$1"/etc/ssl/private/ssl-cert-snakeoil.key "$1"/etc/ssl/certs/ssl-cert-snakeoil.pem'
    --customize-hook='chroot "$1" install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data'
)
mirror=${SPUR_DEBIAN_MIRROR:-}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/spur/node
key=$(printf '%s\n' base-v1 "$suite" "$mirror" "${mm_opts[@]}" | sha256sum | cut -c1-16)
base_tar=$cache/base-$suite-$key.tar
pg_key=$(printf '%s\n' postgres-v1 "$suite" "$mirror" "${pg_opts[@]}" | sha256sum | cut -c1-16)
pg_tar=$cache/postgres-$suite-$pg_key.tar
kafka_packages=(openjdk-17-jre-headless kcat ca-certificates catatonit)
kafka_opts=(
    --variant=minbase
    --include="$(IFS=,; echo "${kafka_packages[*]}")"
    "${common_opts[@]}"
    # openjdk's postinst registers its man pages as alternatives' slaves, and fails when their
    # directory is missing (man pages are not installed here).
    --essential-hook='mkdir -p "$1"/usr/share/man/man1'
)
kafka_key=$(printf '%s\n' kafka-v1 "$suite" "$mirror" "${kafka_opts[@]}" | sha256sum | cut -c1-16)
kafka_tar=$cache/kafka-$suite-$kafka_key.tar
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

# build_rootfs <what> <tar> <mmdebstrap option...>: the cached rootfs <tar>, built if missing.
build_rootfs() {
    local what=$1 tar=$2
    shift 2
    local prefix
    prefix=$(basename "$tar" | cut -d- -f1)
    rm -f "$cache/$prefix"-*.part.*  # from interrupted runs
    if [ -s "$tar" ] && [ -z "${SPUR_NODE_BASE_REFRESH:-}" ]; then
        return
    fi
    log "building the Debian $suite $what rootfs with mmdebstrap (about a minute; needs the Debian mirror)"
    local part="$tar.part.$$" start=$SECONDS
    rm -f "$part"
    if ! mmdebstrap --quiet --mode=root --format=tar "$@" "$suite" "$part" \
            ${mirror:+"$mirror"} >"$tmp/mmdebstrap.log" 2>&1; then
        rm -f "$part"
        tail -n 30 "$tmp/mmdebstrap.log" >&2
        die "mmdebstrap failed for the $what rootfs (is the Debian mirror reachable?)"
    fi
    mv -f "$part" "$tar"
    # Old rootfs from other recipes.
    find "$cache" -maxdepth 1 -name "$prefix-*.tar" ! -name "$(basename "$tar")" -delete
    log "$what rootfs: $tar ($(( $(stat -c %s "$tar") / 1048576 )) MB, $((SECONDS - start)) s)"
}
# The lock stays held until exit: concurrent runs take turns.
exec 9>"$cache/base.lock"
flock -n 9 || { log "waiting for another image.sh run (lock $cache/base.lock)"; flock 9; }
build_rootfs base "$base_tar" "${mm_opts[@]}"
build_rootfs postgres "$pg_tar" "${pg_opts[@]}"
build_rootfs kafka "$kafka_tar" "${kafka_opts[@]}"

# ---- skip when nothing changed --------------------------------------------------------------
names=(localhost/spur:dev localhost/spur-test-client:dev localhost/pause:dev localhost/spur-postgres:dev
    localhost/spur-kafka:dev)
files=(spur.tar spur-test-client.tar pause.tar spur-postgres.tar spur-kafka.tar)
stamp=$outdir/.images.stamp
inputs=$( {
    stat -c '%n %s %Y' "$base_tar" "$pg_tar" "$kafka_tar"
    sha256sum "$0" "$containerfile" "$pg_server" "$kafka_broker" "$go_client" "$sdroutes" "$routesapi_watch" | cut -d' ' -f1
    sha256sum "${srcs[@]}"
    cat "$kafka_dir/lib.done" "$kafka_dir/classes.done"
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
bh config --entrypoint '' --cmd '' --user 0:0 \
    --label org.opencontainers.image.title=spur-base "$c"
commit localhost/spur-base:dev
bh rm "$c" >/dev/null
# The test client: the base layer and one of its own with the Routes API's Go clients (a container
# of its own: buildah commits what changed in a container since its image as one layer).
mkdir -p "$tmp/client-layer/usr/local/bin"
install -m 0755 "$sdroutes" "$tmp/client-layer/usr/local/bin/sdroutes"
install -m 0755 "$routesapi_watch" "$tmp/client-layer/usr/local/bin/routesapi-watch"
tar -cf "$tmp/client-layer.tar" --numeric-owner --mtime=@0 -C "$tmp/client-layer" \
    ./usr/local/bin/sdroutes ./usr/local/bin/routesapi-watch
t=$(bh from "${policy[@]}" localhost/spur-base:dev)
bh add "$t" "$tmp/client-layer.tar" / >/dev/null
bh config --entrypoint '["catatonit","-P"]' --cmd '' --user 0:0 \
    --label org.opencontainers.image.title=spur-test-client "$t"
bh commit "${policy[@]}" --quiet --timestamp 0 "$t" localhost/spur-test-client:dev >/dev/null
bh rm "$t" >/dev/null

# The postgres image: its own rootfs, then a layer of its own (editing the script rebuilds no
# rootfs) with the entrypoint and the socket directory Debian's libpq looks in (mmdebstrap
# empties /run). Numeric user: the kubelet can check runAsNonRoot only against a uid.
pg_user=$(tar -xOf "$pg_tar" ./etc/passwd | awk -F: '$1 == "postgres" { print $3 ":" $4 }')
[ -n "$pg_user" ] || die "no postgres user in $pg_tar"
mkdir -p "$tmp/pg-layer/usr/local/bin" "$tmp/pg-layer/run/postgresql"
install -m 0755 "$pg_server" "$tmp/pg-layer/usr/local/bin/spur-postgres-server"
chown "$pg_user" "$tmp/pg-layer/run/postgresql"
chmod 2775 "$tmp/pg-layer/run/postgresql"
# Only these two entries: a parent directory in the tar would replace the rootfs' own.
tar -cf "$tmp/pg-layer.tar" --numeric-owner --mtime=@0 -C "$tmp/pg-layer" \
    ./usr/local/bin/spur-postgres-server ./run/postgresql
p=$(bh from "${policy[@]}" scratch)
bh add "$p" "$pg_tar" / >/dev/null
bh commit "${policy[@]}" --quiet --timestamp 0 "$p" localhost/spur-postgres-base:dev >/dev/null
bh rm "$p" >/dev/null
p=$(bh from "${policy[@]}" localhost/spur-postgres-base:dev)
bh add "$p" "$tmp/pg-layer.tar" / >/dev/null
bh config --env "PATH=/usr/lib/postgresql/15/bin:${path_env#PATH=}" --env LANG=C.UTF-8 \
    --env PGDATA=/var/lib/postgresql/data/pgdata \
    --entrypoint '["/usr/local/bin/spur-postgres-server"]' --cmd '' --user "$pg_user" \
    --port 5432/tcp --stop-signal SIGINT --workingdir /var/lib/postgresql \
    --label org.opencontainers.image.source=https://github.com/spur-dev/spur \
    --label org.opencontainers.image.title=spur-postgres "$p"
bh commit "${policy[@]}" --quiet --timestamp 0 "$p" localhost/spur-postgres:dev >/dev/null
bh rm "$p" >/dev/null

# The Kafka image: its own rootfs, then one layer with the jars, the harnesses and the broker's
# entrypoint. log4j.properties sits on the classpath, where log4j finds it without a flag.
mkdir -p "$tmp/kafka-layer/opt/kafka/lib" "$tmp/kafka-layer/opt/kafka/classes" "$tmp/kafka-layer/usr/local/bin"
cp "$kafka_dir"/lib/*.jar "$tmp/kafka-layer/opt/kafka/lib/"
cp -r "$kafka_dir"/classes/. "$tmp/kafka-layer/opt/kafka/classes/"
cp "$kafka_dir/log4j.properties" "$tmp/kafka-layer/opt/kafka/classes/"
install -m 0755 "$kafka_broker" "$tmp/kafka-layer/usr/local/bin/spur-kafka-broker"
install -m 0755 "$go_client" "$tmp/kafka-layer/usr/local/bin/kafka-client"
mkdir -p "$tmp/kafka-layer/var/lib/kafka"
chown 65532:65532 "$tmp/kafka-layer/var/lib/kafka"
tar -cf "$tmp/kafka-layer.tar" --numeric-owner --mtime=@0 -C "$tmp/kafka-layer" \
    ./opt/kafka ./usr/local/bin/spur-kafka-broker ./usr/local/bin/kafka-client ./var/lib/kafka
k=$(bh from "${policy[@]}" scratch)
bh add "$k" "$kafka_tar" / >/dev/null
bh add "$k" "$tmp/kafka-layer.tar" / >/dev/null
bh config --env "$path_env" --env 'CLASSPATH=/opt/kafka/lib/*:/opt/kafka/classes' \
    --entrypoint '' --cmd '' --user 65532:65532 --port 9092/tcp --workingdir /tmp \
    --label org.opencontainers.image.source=https://github.com/spur-dev/spur \
    --label org.opencontainers.image.title=spur-kafka "$k"
bh commit "${policy[@]}" --quiet --timestamp 0 "$k" localhost/spur-kafka:dev >/dev/null
bh rm "$k" >/dev/null

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
