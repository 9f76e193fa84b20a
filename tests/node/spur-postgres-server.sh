#!/usr/bin/env bash
# The entrypoint of localhost/spur-postgres:dev (tests/node/image.sh), installed there as
# /usr/local/bin/spur-postgres-server: a PostgreSQL 15 server in the foreground.
#
# On first start (no PG_VERSION in $PGDATA) it runs initdb: superuser `postgres` with the password
# from POSTGRES_PASSWORD (required then; later starts keep the stored one), UTF-8 with the C.UTF-8
# locale, `peer` auth on the Unix socket, `scram-sha-256` for every TCP client. Then it execs
# postgres listening on all addresses, port 5432, so the server is the container's main process:
# SIGTERM is PostgreSQL's smart shutdown (waits for sessions to end), SIGINT its fast shutdown
# (what the image's StopSignal asks containerd for), SIGQUIT an immediate one.
#
# Arguments starting with `-` (optionally after a first `postgres`) go to postgres after the
# defaults and so override them (e.g. `-c listen_addresses=127.0.0.1 -p 55432`); any other first
# argument is run instead of the server (`psql ...`), so a pod can set only `args` and still get a
# client.
#
# Started as root it gives $PGDATA and the socket directory to the `postgres` user, then re-runs
# itself as that user: PostgreSQL refuses to run as root.
set -euo pipefail

prog=spur-postgres-server
die() { echo "$prog: error: $*" >&2; exit 1; }

if [ "${1:-}" = postgres ]; then
    shift
elif [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@"
fi

export PGDATA=${PGDATA:-/var/lib/postgresql/data/pgdata}
# Debian's libpq looks here for the socket; a read-only /run falls back to /tmp.
sockdir=/run/postgresql

if [ "$(id -u)" = 0 ]; then
    # A volume mounted at $PGDATA's parent comes up root-owned; initdb needs to own $PGDATA.
    install -d -o postgres -g postgres -m 0700 "$PGDATA" \
        || die "cannot create $PGDATA for the postgres user"
    install -d -o postgres -g postgres -m 2775 "$sockdir" 2>/dev/null || true
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    [ -n "${POSTGRES_PASSWORD:-}" ] \
        || die "POSTGRES_PASSWORD is not set: it is the password of the superuser 'postgres', needed to initialise $PGDATA"
    case $POSTGRES_PASSWORD in
        *$'\n'*) die "POSTGRES_PASSWORD must be one line" ;;
    esac
    # mkdir, not install: a non-root user can only make what it will own, and must own $PGDATA.
    mkdir -p -m 0700 "$PGDATA" || die "cannot create $PGDATA (is its parent writable by uid $(id -u)?)"
    if [ -n "$(ls -A "$PGDATA")" ]; then
        die "$PGDATA is not empty but holds no database (no PG_VERSION); refusing to initialise over it"
    fi
    echo "$prog: initialising $PGDATA" >&2
    # The password goes through a file only this user can read, removed at once; never argv
    # (visible to every process in /proc).
    pwfile=$(umask 077 && mktemp) || die "cannot create a temporary file"
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    rc=0
    initdb --pgdata="$PGDATA" --username=postgres --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=peer --auth-host=scram-sha-256 --pwfile="$pwfile" >/dev/null || rc=$?
    rm -f "$pwfile"
    [ "$rc" = 0 ] || die "initdb failed"
    # initdb lets TCP in from loopback only; the server is meant to be reached over the network.
    printf '%s\n' 'host all all 0.0.0.0/0 scram-sha-256' 'host all all ::/0 scram-sha-256' \
        >>"$PGDATA/pg_hba.conf"
fi

[ -d "$sockdir" ] && [ -w "$sockdir" ] || sockdir=/tmp
exec postgres -c listen_addresses='*' -p 5432 -k "$sockdir" "$@"
